"""The CPU KV budget of vLLM-Omni's diffusion worker on diffusion-kv's CPU platform
(:mod:`diffusion_kv.integrations.vllm_omni.cpu_memory`; no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diffusion_kv.core.errors import ConfigurationError, DiffusionKVError
from diffusion_kv.integrations.vllm_omni.cpu_memory import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    GIB,
    HostMemory,
    KVBudget,
    budget_rule,
    cpu_kv_cache_budget,
)

MIB = 1 << 20
BIG = HostMemory(total=256 * GIB, available=200 * GIB, process=2 * GIB)
SMALL = HostMemory(total=8 * GIB, available=2 * GIB, process=512 * MIB)


def cache(kv_bytes: int | None = None, utilization: float = 0.9) -> SimpleNamespace:
    """vLLM's ``CacheConfig`` fields the rule reads, as vLLM-Omni sets them (its default
    ``gpu_memory_utilization`` is 0.9)."""
    return SimpleNamespace(kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=utilization)


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def test_default_is_4_gib_at_most_a_quarter_of_available_memory() -> None:
    assert DEFAULT_CPU_KV_CACHE_BYTES == 4 * GIB
    assert cpu_kv_cache_budget(cache(), BIG) == KVBudget(4 * GIB, "default", profiles=True)
    assert cpu_kv_cache_budget(cache(), SMALL) == KVBudget(512 * MIB, "default", profiles=True)
    # never vLLM's 0.9 x host memory
    assert cpu_kv_cache_budget(cache(), BIG).bytes < 0.9 * BIG.total


def test_explicit_bytes_win_and_skip_profiling() -> None:
    assert budget_rule(cache(kv_bytes=96 * MIB)) == KVBudget(
        96 * MIB, "kv_cache_memory_bytes", profiles=False
    )
    assert cpu_kv_cache_budget(cache(kv_bytes=96 * MIB, utilization=0.5), SMALL).bytes == 96 * MIB
    assert budget_rule(cache(kv_bytes=0)).source == "default"  # 0 is unset, as upstream reads it


def test_vllm_cpu_kvcache_space_wins_like_vllms_cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert cpu_kv_cache_budget(cache(kv_bytes=96 * MIB), SMALL) == KVBudget(
        GIB, "VLLM_CPU_KVCACHE_SPACE", profiles=False
    )
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")
    assert budget_rule(cache()).source == "default"  # empty: unset, as vLLM reads it


def test_utilization_follows_vllms_cpu_rule() -> None:
    budget = cpu_kv_cache_budget(cache(utilization=0.25), SMALL)
    assert budget == KVBudget(2 * GIB - 512 * MIB, "gpu_memory_utilization", profiles=True)


@pytest.mark.parametrize(
    ("env", "config", "message"),
    [
        (
            None,
            cache(kv_bytes=3 * GIB),
            r"kv_cache_memory_bytes asks for 3221225472 bytes .* than the host's 2147483648 available bytes \(of 8589934592\)",
        ),
        ("4", cache(), r"VLLM_CPU_KVCACHE_SPACE asks for 4294967296 bytes"),
        ("x", cache(), r"VLLM_CPU_KVCACHE_SPACE='x' is not a whole number of GiB"),
        ("0", cache(), r"VLLM_CPU_KVCACHE_SPACE=0 GiB: .* at least 1 GiB"),
        (
            None,
            cache(utilization=0.05),
            r"gpu_memory_utilization=0.05 reserves 429496730 bytes .* leaves -107374182 bytes",
        ),
        (
            None,
            cache(utilization=0.5),
            r"gpu_memory_utilization=0.5 .* leaves 3758096384 bytes .* at most the 2147483648 available",
        ),
    ],
)
def test_refusals_name_setting_value_and_limit(
    monkeypatch: pytest.MonkeyPatch, env: str | None, config: SimpleNamespace, message: str
) -> None:
    if env is not None:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", env)
    before = vars(config).copy()
    with pytest.raises(ConfigurationError, match=message) as info:
        cpu_kv_cache_budget(config, SMALL)
    assert isinstance(info.value, DiffusionKVError) and isinstance(info.value, ValueError)
    assert vars(config) == before  # nothing changed on the config


def test_no_memory_left_refuses_the_default() -> None:
    with pytest.raises(
        ConfigurationError, match="the host has 3 bytes available: no default CPU KV cache fits"
    ):
        cpu_kv_cache_budget(cache(), HostMemory(total=8, available=3, process=1))

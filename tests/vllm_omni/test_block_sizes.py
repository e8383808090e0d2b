"""Block sizes through vLLM-Omni's own configuration path, on diffusion-kv's platform.

vLLM-Omni builds its diffusion ``VllmConfig`` in two steps (``create_base_diffusion_vllm_config``,
then ``configure_diffusion_vllm_config``, which calls the platform's hook in paged mode). The
block size put on the cache config between them is the configured one; diffusion-kv never
changes it: the backend chosen is the highest-priority one serving it (vLLM's ``CPU_ATTN``
takes multiples of 32, the cpu reference any size), and a forced backend that cannot serve it
is refused. A tiny-DiT request is then paged at block size 16 end to end.

Runs in both lane runs (zero-patch and module replacement): the configuration path is the same.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch

from diffusion_kv.core.errors import UnsupportedRequirementsError
from diffusion_kv.integrations.vllm_omni.hooks import CONFIG_KEY
from tests.vllm_omni import tiny_dit
from tests.vllm_omni.conftest import patched

CPU = torch.device("cpu")


def configured(monkeypatch: pytest.MonkeyPatch, block_size: int | None, forced: str | None) -> Any:
    if forced is None:
        monkeypatch.delenv("DIFFUSION_KV_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DIFFUSION_KV_BACKEND", forced)
    od = tiny_dit.od_config(tiny_dit.Shape(), paged=True)
    return tiny_dit.diffusion_vllm_config(CPU, od, block_size)


def test_vllms_default_block_size_here_is_128(monkeypatch: pytest.MonkeyPatch) -> None:
    config = configured(monkeypatch, None, None)
    assert (config.cache_config.block_size, config.additional_config[CONFIG_KEY]) == (
        128,
        "cpu:vllm-cpu-attn",
    )


@pytest.mark.parametrize(
    ("block_size", "forced", "expected", "layout"),
    [
        (16, None, "cpu:sdpa", "LBNHC"),  # CPU_ATTN takes multiples of 32 only
        (32, None, "cpu:vllm-cpu-attn", "LBHNC"),
        (128, None, "cpu:vllm-cpu-attn", "LBHNC"),
        (16, "cpu:reference", "cpu:reference", "LBNHC"),
        (32, "cpu:reference", "cpu:reference", "LBNHC"),
        (128, "cpu:reference", "cpu:reference", "LBNHC"),
        (32, "cpu:vllm-cpu-attn", "cpu:vllm-cpu-attn", "LBHNC"),
        (128, "cpu:vllm-cpu-attn", "cpu:vllm-cpu-attn", "LBHNC"),
    ],
)
def test_the_configured_block_size_is_kept_and_chooses_the_backend(
    monkeypatch: pytest.MonkeyPatch, block_size: int, forced: str | None, expected: str, layout: str
) -> None:
    config = configured(monkeypatch, block_size, forced)
    cache = config.cache_config
    assert (cache.block_size, config.additional_config[CONFIG_KEY], cache.kv_cache_layout) == (
        block_size,
        expected,
        layout,
    )


def test_a_forced_cpu_attn_is_refused_for_block_size_16(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedRequirementsError) as refused:
        configured(monkeypatch, 16, "cpu:vllm-cpu-attn")
    message = str(refused.value)
    assert "DIFFUSION_KV_BACKEND forces diffusion-kv backend cpu:vllm-cpu-attn" in message
    assert "vLLM-Omni's configured block size 16: it takes block sizes multiple of 32" in message
    assert "diffusion-kv does not change the block size" in message
    assert "(e.g. 32)" in message
    assert "here cpu:sdpa, cpu:reference serve block size 16 for dtype=float16, block_size=16" in message


def test_block_size_16_pages_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIFFUSION_KV_BACKEND", raising=False)
    shape = tiny_dit.Shape(block_size=16)
    dense = tiny_dit.run(shape, paged=False)
    result = tiny_dit.run(shape, paged=True)
    backend: Any = result.hooks["backend"]
    assert backend.vllm_config.additional_config[CONFIG_KEY] == "cpu:sdpa"
    assert (result.hooks["block_size"], result.hooks["kv_cache_layout"]) == (16, "LBNHC")
    assert {spec["block_size"] for spec in result.hooks["specs"].values()} == {16}
    assert list(backend.block_tables.kernel_block_sizes) == [16]
    # 160 tokens per sequence: 10 blocks of 16 for each of the two sequences
    (block_ids,) = result.hooks["block_ids"]
    assert [len(ids[0]) for ids in block_ids] == [10, 10]
    assert result.tokens_per_step == [160, 64, 64]
    expected_module = (
        "diffusion_kv.integrations.vllm_omni.runner"
        if patched()
        else "vllm_omni.diffusion.diffusion_kv.model_runner_backend"
    )
    assert type(backend).__module__ == expected_module
    torch.testing.assert_close(result.output, dense.output, atol=2e-3, rtol=2e-3)

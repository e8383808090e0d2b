"""The cuda plugin's tier choice (vLLM FlashAttention vs standalone), without a GPU: the vLLM
tier's environment check and parts are replaced by stand-ins."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffusion_kv.core.errors import PlatformError
from diffusion_kv.integrations.vllm import cuda_tier
from diffusion_kv.platforms.cuda import ENV_TIER, CudaPlatform


class FakeParts:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def block_tables_cls(self) -> str:
        return "vllm-block-tables"

    def allocate_kv_cache(self, *args: Any) -> str:
        return f"vllm-cache{args[:4]}"


def test_auto_uses_vllm_tier_when_it_reports_no_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TIER, raising=False)
    monkeypatch.setattr(cuda_tier, "vllm_tier_reasons", lambda _req: [])
    monkeypatch.setattr(cuda_tier, "VllmCudaParts", FakeParts)
    p = CudaPlatform()
    assert p.block_tables_cls() == "vllm-block-tables"  # type: ignore[comparison-overlap]
    assert p.allocate_kv_cache(3, 16, 2, 64, torch.float16, torch.device("cpu")) == "vllm-cache(3, 16, 2, 64)"  # type: ignore[comparison-overlap]
    assert dict(p.backend_variants()) == {"vllm-flash-attn": {}}
    assert any("tier: vLLM FlashAttention" in line for line in p.explain())


def test_auto_falls_back_to_standalone_with_the_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TIER, raising=False)
    monkeypatch.setattr(cuda_tier, "vllm_tier_reasons", lambda _req: ["vLLM is not installed"])
    p = CudaPlatform()
    assert set(p.backend_variants()) == {"auto", "triton", "sdpa"}
    assert "  tier: standalone (vLLM tier not used: vLLM is not installed)" in p.explain()


def test_forced_vllm_tier_without_vllm_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TIER, "vllm")
    monkeypatch.setattr(cuda_tier, "vllm_tier_reasons", lambda _req: ["vLLM is not installed"])
    with pytest.raises(PlatformError, match="DIFFUSION_KV_CUDA_TIER=vllm, but: vLLM is not installed"):
        CudaPlatform().block_tables_cls()


def test_standalone_mode_never_consults_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TIER, "standalone")

    def boom(_req: object) -> list[str]:
        raise AssertionError("consulted")

    monkeypatch.setattr(cuda_tier, "vllm_tier_reasons", boom)
    assert set(CudaPlatform().backend_variants()) == {"auto", "triton", "sdpa"}
    monkeypatch.setenv(ENV_TIER, "bogus")
    with pytest.raises(PlatformError, match=r"DIFFUSION_KV_CUDA_TIER='bogus'; expected one of"):
        CudaPlatform().backend_variants()

"""fp8 (e4m3) pages through vLLM-Omni's own paged module (zero-patch run).

vLLM-Omni hands ``vllm_config.cache_config.cache_dtype`` (vLLM's ``--kv-cache-dtype``) to the
paged impl of every diffusion layer. diffusion-kv takes ``fp8`` / ``fp8_e4m3`` as e4m3 pages with
the core's per-KV-head scales (1.0 unless the host sets them) on a backend that declares e4m3
(here ``cpu:reference``, chosen automatically or forced), and refuses a backend that does not
and e5m2. The tiny DiT's paged output is compared with its dense run whose attention reads the
K/V rounded through e4m3 (what the pages hold), within the kit's float16 tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch
from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.platforms import current_omni_platform

from diffusion_kv.conformance.reference import tolerance
from diffusion_kv.core.backend import KVPageLayout
from diffusion_kv.core.errors import UnsupportedFeatureError, UnsupportedRequirementsError
from diffusion_kv.core.kv_quant import FP8_E4M3, fake_quantize
from diffusion_kv.integrations.vllm_omni.native import LAYER_ATTR, PagedImpl, page_view
from tests.vllm_omni import tiny_dit
from tests.vllm_omni.conftest import patched

zero_patch = pytest.mark.skipif(patched(), reason="vLLM-Omni is patched here: module-replacement run")

SHAPE = tiny_dit.Shape(dtype=torch.float16, block_size=32)
TOL = tolerance(torch.float16)


def with_cache_dtype(monkeypatch: pytest.MonkeyPatch, cache_dtype: str, forced: str | None) -> None:
    """vLLM's ``cache_config.cache_dtype`` set before the platform's configuration hook sees it."""
    if forced is None:
        monkeypatch.delenv("DIFFUSION_KV_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DIFFUSION_KV_BACKEND", forced)
    cls = type(current_omni_platform)
    bound = cls.configure_diffusion_vllm_config

    def configure(_cls: Any, vllm_config: Any, od: Any) -> None:
        vllm_config.cache_config.cache_dtype = cache_dtype
        bound(vllm_config, od)

    monkeypatch.setattr(cls, "configure_diffusion_vllm_config", classmethod(configure), raising=False)


@pytest.fixture(scope="module")
def dense_over_stored() -> tiny_dit.RunResult:
    """The dense run, its attention reading K/V as e4m3 pages at scale 1 hold them."""
    forward = Attention.forward

    def stored(self: Any, query: Any, key: Any, value: Any, attn_metadata: Any = None) -> Any:
        ones = torch.ones(key.shape[-2])
        return forward(self, query, fake_quantize(key, ones), fake_quantize(value, ones), attn_metadata)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Attention, "forward", stored)
        return tiny_dit.run(SHAPE, paged=False)


@pytest.fixture(scope="module")
def dense() -> tiny_dit.RunResult:
    return tiny_dit.run(SHAPE, paged=False)


@zero_patch
@pytest.mark.parametrize(("cache_dtype", "forced"), [("fp8", None), ("fp8_e4m3", "cpu:reference")])
def test_fp8_pages_match_dense_over_the_stored_values(
    monkeypatch: pytest.MonkeyPatch,
    dense_over_stored: tiny_dit.RunResult,
    dense: tiny_dit.RunResult,
    cache_dtype: str,
    forced: str | None,
) -> None:
    with_cache_dtype(monkeypatch, cache_dtype, forced)
    result = tiny_dit.run(SHAPE, paged=True)
    backend: Any = result.hooks["backend"]
    assert backend.vllm_config.additional_config["diffusion_kv_backend"] == "cpu:reference"
    adapters = backend._kv_cache_layer_adapters
    assert sorted(adapters) == ["transformer.blocks.0.attn", "transformer.blocks.1.attn"]
    for adapter in adapters.values():
        assert adapter.attn_backend.supported_kv_cache_dtypes == ["auto", "fp8", "fp8_e4m3"]
        bound = getattr(adapter, LAYER_ATTR)
        assert (bound.geometry.dtype, bound.geometry.cache_dtype) == (torch.float16, FP8_E4M3)
        assert bound.geometry.kv_scales.values == ((1.0, 1.0), (1.0, 1.0))
        assert bound.geometry.kv_scales.saturations() == (0, 0)
        # vLLM-Omni sizes the spec in float16: K and V take each token's first 2 * head_size bytes
        raw = adapter.kv_cache.view(torch.uint8)
        d = SHAPE.head_size
        assert adapter.kv_cache.dtype == torch.float16 and raw.shape[-1] == 4 * d
        assert int(raw[..., 2 * d :].count_nonzero()) == 0
        assert int(raw[..., : 2 * d].count_nonzero()) > 0
    assert result.tokens_per_step == [160, 64, 64]
    torch.testing.assert_close(result.output, dense_over_stored.output, atol=TOL["atol"], rtol=TOL["rtol"])
    # the pages are quantised: the run is closer to the dense run over the rounded K/V than to the
    # unrounded one (measured: 2 and 4 float16 steps at the output's scale, 1.66)
    near = (result.output.float() - dense_over_stored.output.float()).abs().max().item()
    gap = (result.output.float() - dense.output.float()).abs().max().item()
    assert near < gap


@zero_patch
@pytest.mark.parametrize("forced", ["cpu:sdpa", "cpu:vllm-cpu-attn"])
def test_a_backend_without_e4m3_is_refused(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    with_cache_dtype(monkeypatch, "fp8", forced)
    with pytest.raises(UnsupportedRequirementsError) as error:
        tiny_dit.run(SHAPE, paged=True)
    text = str(error.value)
    assert "kv_cache_dtype=float8_e4m3fn" in text
    assert f"`{forced}`" in text and "kv_cache_dtype=fp8_e4m3 (pages hold the compute dtype only)" in text


@zero_patch
def test_e5m2_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with_cache_dtype(monkeypatch, "fp8_e5m2", None)
    with pytest.raises(
        UnsupportedFeatureError, match=r"kv_cache_dtype='fp8_e5m2' \(served: auto, fp8, fp8_e4m3"
    ):
        tiny_dit.run(SHAPE, paged=True)
    with pytest.raises(UnsupportedFeatureError, match=r"fp8_e5m2"):
        PagedImpl(4, 32, 0.125, 2, kv_cache_dtype="fp8_e5m2")
    assert PagedImpl(4, 32, 0.125, 2, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_page_view_of_a_16_bit_cache_as_e4m3() -> None:
    cache = torch.zeros(3, 2, 4, 2 * 8, dtype=torch.bfloat16)  # [blocks, kv_heads, block, 2 * head_size]
    key, value = page_view(cache, KVPageLayout.SEPARATE, 8, FP8_E4M3)
    assert (key.dtype, tuple(key.shape), tuple(value.shape)) == (FP8_E4M3, (3, 4, 2, 8), (3, 4, 2, 8))
    key[1, 2, 0, 3] = 1.5
    value[1, 2, 1, 7] = -2.0
    raw = cache.view(torch.uint8)
    assert raw[1, 0, 2, 3].item() == torch.tensor(1.5, dtype=FP8_E4M3).view(torch.uint8).item()
    assert raw[1, 1, 2, 8 + 7].item() == torch.tensor(-2.0, dtype=FP8_E4M3).view(torch.uint8).item()
    assert int(raw.count_nonzero()) == 2


@pytest.mark.skipif(not patched(), reason="vLLM-Omni is unpatched here: zero-patch run")
def test_the_module_replacement_refuses_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    with_cache_dtype(monkeypatch, "fp8", None)
    with pytest.raises(UnsupportedFeatureError) as error:
        tiny_dit.run(SHAPE, paged=True)
    assert str(error.value).startswith("the module replacement does not serve kv_cache_dtype='fp8' yet")

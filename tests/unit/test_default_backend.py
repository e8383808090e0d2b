"""PagedBackend's defaults: ``build`` hands back the batch, ``write_kv`` copies K/V by slot
into any of the three page layouts (padding skipped, e4m3 pages through the layer's scales)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from diffusion_kv import KVPageLayout, LayerGeometry, PagedBackend
from diffusion_kv.core.backend import allocate_pages
from diffusion_kv.core.kv_quant import KVScales

BLOCKS, PAGE, HKV, D = 3, 4, 2, 8


def backend_with(layout: KVPageLayout) -> PagedBackend:
    class OnlyForward(PagedBackend):
        name: ClassVar[str] = "only-forward"
        page_layout: ClassVar[KVPageLayout] = layout

        def forward(self, layer: Any, query: Any, kv_cache: Any, metadata: Any, out: Any = None) -> Any:
            raise AssertionError("not called")

    return OnlyForward.__new__(OnlyForward)  # write_kv and build read no instance state


def token(cache: object, layout: KVPageLayout, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (K, V) ``[Hkv, D]`` stored at flat kernel slot ``slot``."""
    block, offset = divmod(slot, PAGE)
    if layout is KVPageLayout.SEPARATE:
        k, v = cache  # type: ignore[misc]
        return k[block, offset], v[block, offset]
    assert isinstance(cache, torch.Tensor)
    if layout is KVPageLayout.HEAD_FIRST:
        return cache[0, block, :, offset], cache[1, block, :, offset]
    return cache[0, block, offset], cache[1, block, offset]


@pytest.mark.parametrize("layout", list(KVPageLayout), ids=lambda x: x.value)
def test_default_write_kv_serves_every_layout_and_skips_padding(layout: KVPageLayout) -> None:
    layer = LayerGeometry("l0", 4, HKV, D, D**-0.5, torch.float32)
    cache = allocate_pages(layout, BLOCKS, PAGE, HKV, D, torch.float32, torch.device("cpu"))
    key = torch.arange(4 * HKV * D, dtype=torch.float32).reshape(4, HKV, D) + 1
    value = -key
    slots = torch.tensor([5, -1, 11, 0], dtype=torch.int32)
    backend_with(layout).write_kv(layer, key, value, cache, slots)
    for i, slot in ((0, 5), (2, 11), (3, 0)):
        k, v = token(cache, layout, slot)
        assert torch.equal(k, key[i]) and torch.equal(v, value[i])
    written = sum(int((t != 0).any(dim=-1).sum()) for t in (cache if isinstance(cache, tuple) else (cache,)))
    assert written == 3 * 2 * HKV  # three tokens, K and V, every KV head; the padding token nowhere


def test_default_write_kv_quantises_e4m3_pages_with_the_layer_scales() -> None:
    scales = KVScales(HKV, torch.device("cpu"), k_scale=[2.0, 0.5], v_scale=1.0)
    layer = LayerGeometry(
        "l0", 2, HKV, D, 1.0, torch.float32, cache_dtype=torch.float8_e4m3fn, kv_scales=scales
    )
    cache = allocate_pages(
        KVPageLayout.COMBINED, BLOCKS, PAGE, HKV, D, torch.float8_e4m3fn, torch.device("cpu")
    )
    key = torch.tensor([[[1.0] * D, [3.0] * D], [[1000.0] * D, [0.25] * D]])
    backend_with(KVPageLayout.COMBINED).write_kv(layer, key, key, cache, torch.tensor([1, 6]))
    assert cache[0, 0, 1].float().tolist() == [[0.5] * D, [6.0] * D]
    assert cache[0, 1, 2].float().tolist() == [[448.0] * D, [0.5] * D]  # 1000 / 2 saturates at 448
    assert cache[1, 1, 2].float().tolist() == [[448.0] * D, [0.25] * D]
    assert scales.saturated.tolist() == [D, D]


def test_default_build_is_the_batch_itself() -> None:
    batch = object()
    assert backend_with(KVPageLayout.COMBINED).build(batch) is batch  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", list(KVPageLayout), ids=lambda x: x.value)
def test_default_write_kv_valid_writes_what_write_kv_writes(layout: KVPageLayout) -> None:
    layer = LayerGeometry("l0", 4, HKV, D, D**-0.5, torch.float32)
    key = torch.randn(3, HKV, D)
    value = torch.randn(3, HKV, D)
    slots = torch.tensor([7, 2, 9])
    masked = allocate_pages(layout, BLOCKS, PAGE, HKV, D, torch.float32, torch.device("cpu"))
    direct = allocate_pages(layout, BLOCKS, PAGE, HKV, D, torch.float32, torch.device("cpu"))
    backend_with(layout).write_kv(layer, key, value, masked, slots)
    backend_with(layout).write_kv_valid(layer, key, value, direct, slots)
    for a, b in zip(
        masked if isinstance(masked, tuple) else (masked,),
        direct if isinstance(direct, tuple) else (direct,),
        strict=True,
    ):
        assert torch.equal(a, b)
    k, v = token(direct, layout, 9)
    assert torch.equal(k, key[2]) and torch.equal(v, value[2])

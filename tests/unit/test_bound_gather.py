"""A layer's bound call over pages that are not one strided view of the cache (scattered blocks,
as a shuffled pool gives them): the sdpa backends record the batch's block gather (its index made
once per batch) with the SDPA call, so the layer's later calls -- and its twins' first ones --
skip the full path and still read what the writes since put in the pages. Outputs and pages
equal the full path's exactly, step after step."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.conformance.harness import PagedHarness
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.cpu import CpuPlatform
from tests.unit.test_bound_layers import _count_forward

LAYERS = ("l0", "l1", "l2")
PREFIX, TARGET = 80, 48


def _harness(bind: bool) -> PagedHarness:
    h = PagedHarness(
        CpuPlatform(),
        backend_choice="sdpa",
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        block_size=16,
        num_blocks=64,
        max_model_len=256,
        layer_names=LAYERS,
    )
    if not bind:
        for counting in h.backends.values():
            counting.inner.bind_layer = lambda *args: None  # type: ignore[method-assign]
            counting.inner.bind_layer_like = lambda *args: None  # type: ignore[method-assign]
    h.install("r", [PREFIX + TARGET, PREFIX + TARGET], placement="permuted")
    h.prefill("r", [PREFIX + TARGET, PREFIX + TARGET], seed=3)
    return h


def _steps(h: PagedHarness, steps: int, check: bool) -> list[torch.Tensor]:
    rows = tuple(PagedRow("r", TARGET, PREFIX + TARGET, PREFIX, sequence_id=i) for i in range(2))
    gen = torch.Generator().manual_seed(7)
    outs = []
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        for _ in range(steps):
            for name in LAYERS:
                q = torch.randn(2 * TARGET, h.num_heads, h.head_size, generator=gen)
                k, v = (torch.randn(2 * TARGET, h.num_kv_heads, h.head_size, generator=gen) for _ in range(2))
                outs.append(h.executor.forward(name, q, k, v))
            if check:
                state = h.translator.active_state
                assert state is not None and set(state.bound_layers) == set(LAYERS)
                md = batch.attn_metadata[LAYERS[0]]
                for name in LAYERS:  # the first layer recorded its gather, its twins took it over
                    call = md.calls[id(h.kv_caches[name])]
                    assert call.gather is not None and call.kt is None
                    assert call.gather.k_cache.data_ptr() == key_value_caches(h.kv_caches[name])[0].data_ptr()
    return outs


@pytest.mark.parametrize("steps", [1, 3])
def test_scattered_pages_bind_their_gather_and_equal_the_full_path(steps: int) -> None:
    fast, full = _harness(bind=True), _harness(bind=False)
    # the backend's own forward counted: a bound call does not go through it
    fast_calls, full_calls = _count_forward(fast.backend), _count_forward(full.backend)
    got, want = _steps(fast, steps, check=True), _steps(full, steps, check=False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for name in LAYERS:
        for x, y in zip(
            key_value_caches(fast.kv_caches[name]), key_value_caches(full.kv_caches[name]), strict=True
        ):
            assert torch.equal(x, y)
    # the full path ran once (the first layer's first call), every later call and layer bound
    assert fast_calls["forward"] == 1 and full_calls["forward"] == len(LAYERS) * steps

"""A layer's fast path within one activation (``PagedBackend.bind_layer``): after a layer's first
plain call of a batch, its later calls with the same Q/K/V layout go straight to what the backend
bound (the sdpa backend: the batch's slot-run writes and its recorded SDPA call), with the same
results as the full path, every write still seen by a wrapper on the writer, and failures
reported as the full path reports them. A twin layer (the same geometry but the name, a
congruent cache, the same batch metadata) is bound from the first one's binding before its own
first call (``PagedBackend.bind_layer_like``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.errors import NativeBackendError
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from diffusion_kv.platforms.cpu import CpuPlatform

H, D, BLOCK = 2, 8, 16
POLICY = SessionPolicy(chunk_tokens=32, window_chunks=2, sink_chunks=1)
LAYERS = ("l0", "l1")


def _session(
    backend: str = "sdpa", layers: dict[str, PagedLayerSpec] | None = None
) -> tuple[SessionCache, FreeListPool]:
    """A session cache over ``layers`` (default: ``LAYERS``, alike)."""
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(1024, 1, 2, 1024, device=torch.device("cpu"), backend=backend)
    )
    worker.register_kv_cache_layers(
        layers
        if layers is not None
        else {name: PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask) for name in LAYERS}
    )
    num_blocks = 2 + 2 * 3 + 1
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=BLOCK)
    pool = FreeListPool(num_blocks)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=1024, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    return SessionCache(worker, alloc, POLICY), pool


def _bound(worker: PagedWorker) -> dict[str, Any]:
    assert worker.translator is not None
    state = worker.translator.active_state
    assert state is not None
    return state.bound_layers


def _count_forward(backend: Any) -> dict[str, int]:
    """Count ``backend.forward`` calls (a wrapper on the instance: the class's method stays, so
    the backend still binds)."""
    calls = {"forward": 0}
    inner = backend.forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["forward"] += 1
        return inner(*args, **kwargs)

    backend.forward = counted
    return calls


def _assert_same_pages(a: PagedWorker, b: PagedWorker, names: tuple[str, ...] = LAYERS) -> None:
    for name in names:
        for x, y in zip(
            key_value_caches(a.kv_caches[name]), key_value_caches(b.kv_caches[name]), strict=True
        ):
            assert torch.equal(x, y)


def _run_chunks(
    cache: SessionCache,
    chunks: int,
    steps: int,
    seed: int,
    inputs: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    on_step: Callable[[int, int], None] | None = None,
    names: tuple[str, ...] = LAYERS,
) -> list[torch.Tensor]:
    """``chunks`` chunks of ``steps`` denoise steps; every step writes fresh K/V for the chunk
    in every layer. Returns every output in call order."""
    worker = cache.worker
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(seed)
    outs: list[torch.Tensor] = []
    for index in range(chunks):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        with worker.stepper() as runtime:
            for step in range(steps):
                runtime.ensure_rows(chunk.rows())
                for name in names:
                    q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
                    outs.append(worker.forward(name, inputs(q), inputs(k), inputs(v)))
                if on_step is not None:
                    on_step(index, step)
        cache.commit(chunk)
    return outs


def test_later_calls_take_the_bound_path_and_equal_the_full_path_exactly() -> None:
    fast, _ = _session()
    full, _ = _session()
    full_backend = full.worker.backends[0]
    full_backend.bind_layer = lambda *args: None  # type: ignore[method-assign]
    backend = fast.worker.backends[0]
    calls = _count_forward(backend)
    seen: list[tuple[int, int, int]] = []

    def check(index: int, step: int) -> None:
        seen.append((index, step, len(_bound(fast.worker))))

    fast_outs = _run_chunks(fast, chunks=6, steps=3, seed=1, on_step=check)
    full_outs = _run_chunks(full, chunks=6, steps=3, seed=1)
    assert len(fast_outs) == len(full_outs) == 6 * 3 * 2
    for a, b in zip(fast_outs, full_outs, strict=True):
        assert torch.equal(a, b)
    # every layer bound after the first step of each chunk; the full forward ran once per
    # chunk -- "l0"'s first call; its twin "l1" was bound from "l0"'s binding before its first
    # call (bind_layer_like) -- and the 2 later steps of each chunk took the bound path
    assert seen == [(i, s, 2) for i in range(6) for s in range(3)]
    assert calls["forward"] == 6
    _assert_same_pages(fast.worker, full.worker)


def test_the_bound_path_reads_each_steps_writes_against_dense_attention() -> None:
    cache, pool = _session()
    worker = cache.worker
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(3)
    keys = {n: torch.zeros(0, H, D) for n in LAYERS}
    values = {n: torch.zeros(0, H, D) for n in LAYERS}
    for _ in range(5):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        mask = POLICY.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
        last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        with worker.stepper() as runtime:
            for _step in range(3):
                runtime.ensure_rows(chunk.rows())
                for name in LAYERS:
                    q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
                    out = worker.forward(name, q, k, v)
                    assert (name in _bound(worker)) is True  # bound by the first step's call
                    ref = dense_attention(
                        q, torch.cat([keys[name], k]), torch.cat([values[name], v]), mask, D**-0.5
                    )
                    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
                    last[name] = (k, v)
        cache.commit(chunk)
        for name, (k, v) in last.items():
            keys[name], values[name] = torch.cat([keys[name], k]), torch.cat([values[name], v])
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_another_layout_takes_the_full_path_with_the_same_result() -> None:
    cache, _ = _session()
    worker = cache.worker
    backend = worker.backends[0]
    calls = _count_forward(backend)
    session = cache.begin_session("s", 1)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    gen = torch.Generator().manual_seed(5)
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
        first = worker.forward("l0", q, k, v)
        assert calls["forward"] == 1 and "l0" in _bound(worker)
        # the same values as [T, H*D] and with a wider token stride: other layouts, the full path
        flat = worker.forward("l0", q.reshape(-1, H * D), k.reshape(-1, H * D), v.reshape(-1, H * D))
        assert calls["forward"] == 2 and flat.shape == (chunk.tokens, H * D)
        assert torch.equal(flat.reshape(-1, H, D), first)
        wide = torch.randn(chunk.tokens, 2 * H, D, generator=gen)
        wide[:, :H] = q
        strided = worker.forward("l0", wide[:, :H], k, v)
        assert calls["forward"] == 3 and torch.equal(strided, first)
        again = worker.forward("l0", q, k, v)  # the bound layout: no full call
        assert calls["forward"] == 3 and torch.equal(again, first)
    cache.abort(chunk)


def test_a_writer_wrapped_on_the_instance_sees_every_write() -> None:
    cache, _ = _session()
    backend = cache.worker.backends[0]
    writes: list[int] = []
    inner = backend.write_kv_valid

    def counted(
        layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slots: torch.Tensor
    ) -> None:
        writes.append(key.shape[0])
        inner(layer, key, value, kv_cache, slots)

    backend.write_kv_valid = counted  # type: ignore[method-assign]
    reference, _ = _session()
    outs = _run_chunks(cache, chunks=4, steps=3, seed=7)
    assert writes == [POLICY.chunk_tokens] * (4 * 3 * 2)
    assert all(
        torch.equal(a, b)
        for a, b in zip(outs, _run_chunks(reference, chunks=4, steps=3, seed=7), strict=True)
    )


def test_a_failure_on_the_bound_path_is_named_and_the_layer_not_counted_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, pool = _session()
    worker = cache.worker
    session = cache.begin_session("s", 1)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        worker.forward("l0", q, k, v)
        assert worker.translator is not None
        state = worker.translator.active_state
        assert state is not None and "l0" in state.bound_layers and "l0" in state.layers_done
        state.layers_done.discard("l0")

        def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise RuntimeError("kernel exploded")

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
        with pytest.raises(
            NativeBackendError, match=r"backend 'sdpa' failed in layer 'l0' \(RuntimeError: kernel exploded\)"
        ):
            worker.forward("l0", q, k, v)
        assert "l0" not in state.layers_done
        monkeypatch.undo()
        worker.forward("l0", q, k, v)
        assert "l0" in state.layers_done
    cache.abort(chunk)
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_gradients_reach_the_query_on_the_bound_path_and_never_the_cache() -> None:
    cache, _ = _session()
    worker = cache.worker
    session = cache.begin_session("s", 1)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    gen = torch.Generator().manual_seed(11)
    q0, k0, v0 = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
    grads = []
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        for _ in range(2):  # the full path, then the bound one
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            out = worker.forward("l0", q, k, v)
            out.square().sum().backward()
            assert q.grad is not None and k.grad is None and v.grad is None
            grads.append(q.grad)
            assert "l0" in _bound(worker)
        k_cache, v_cache = key_value_caches(worker.kv_caches["l0"])
        assert not k_cache.requires_grad and not v_cache.requires_grad
    assert torch.equal(grads[0], grads[1])
    cache.abort(chunk)


def test_a_backend_without_bind_layer_binds_nothing() -> None:
    cache, _ = _session(backend="reference")
    worker = cache.worker
    assert type(worker.backends[0]).bind_layer is PagedBackend.bind_layer
    bound_sizes: list[int] = []
    _run_chunks(
        cache, chunks=2, steps=2, seed=13, on_step=lambda i, s: bound_sizes.append(len(_bound(worker)))
    )
    assert bound_sizes == [0, 0, 0, 0]


def test_under_inference_mode_the_bound_path_writes_by_index_and_equals_the_full_path() -> None:
    """Inference tensors have no version counter, so no slot runs are kept: the bound write is
    the indexed copy (as on a GPU), outputs and pages equal to the full path's."""
    fast, _ = _session()
    full, _ = _session()
    full.worker.backends[0].bind_layer = lambda *args: None  # type: ignore[method-assign]
    with torch.inference_mode():
        sizes: list[int] = []
        fast_outs = _run_chunks(
            fast, 4, 3, seed=17, on_step=lambda i, s: sizes.append(len(_bound(fast.worker)))
        )
        full_outs = _run_chunks(full, 4, 3, seed=17)
    assert sizes == [2] * 12
    assert all(torch.equal(a, b) for a, b in zip(fast_outs, full_outs, strict=True))
    _assert_same_pages(fast.worker, full.worker)


def test_the_bound_indexed_write_reads_the_slot_buffer_at_each_call() -> None:
    """What a CUDA graph replay relies on: the bound write holds a view of the batch's slot
    buffer, not a copy, so slots written into that buffer after binding are where the next
    call writes."""
    cache, _ = _session()
    worker = cache.worker
    session = cache.begin_session("s", 1)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    gen = torch.Generator().manual_seed(19)
    with torch.inference_mode(), worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
        worker.forward("l0", q, k, v)
        assert "l0" in _bound(worker)
        assert worker.translator is not None
        batch = worker.translator.active_batch
        assert batch is not None
        slots = batch.slot_mappings_by_layer["l0"]
        original = slots.clone()
        slots.copy_(original.flip(0))  # the same slots in the other order, in the same buffer
        k2, v2 = torch.randn(2, chunk.tokens, H, D, generator=gen).unbind(0)
        worker.forward("l0", q, k2, v2)
        k_cache, v_cache = key_value_caches(worker.kv_caches["l0"])
        assert torch.equal(k_cache.reshape(-1, H, D)[original.flip(0).long()], k2)
        assert torch.equal(v_cache.reshape(-1, H, D)[original.flip(0).long()], v2)
        slots.copy_(original)
    cache.abort(chunk)


TWINS = {
    "a": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask),
    "b": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask),
    "odd": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask, scale=0.5),  # not a twin
    "c": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask),
}


def test_twin_layers_bind_from_the_first_ones_binding_with_the_same_results() -> None:
    fast, _ = _session(layers=TWINS)
    full, _ = _session(layers=TWINS)
    full.worker.backends[0].bind_layer = lambda *args: None  # type: ignore[method-assign]
    backend = fast.worker.backends[0]
    forwards: list[str] = []
    inner_forward = backend.forward

    def counted(layer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        forwards.append(layer.layer_name)
        return inner_forward(layer, *args, **kwargs)

    backend.forward = counted  # type: ignore[method-assign]
    names = ("a", "b", "odd", "c")
    fast_outs = _run_chunks(fast, chunks=5, steps=3, seed=21, names=names)
    full_outs = _run_chunks(full, chunks=5, steps=3, seed=21, names=names)
    assert len(fast_outs) == len(full_outs) == 5 * 3 * 4
    assert all(torch.equal(x, y) for x, y in zip(fast_outs, full_outs, strict=True))
    # per chunk: "a" (the first) and "odd" (another scale: no twin) take the full path once;
    # "b" and "c" are bound from "a" before their first calls
    assert forwards == ["a", "odd"] * 5
    _assert_same_pages(fast.worker, full.worker, tuple(TWINS))


def test_a_backend_declining_twins_takes_the_full_path_once_per_layer() -> None:
    cache, _ = _session(layers={name: spec for name, spec in TWINS.items() if name != "odd"})
    backend = cache.worker.backends[0]
    asked: list[tuple[str, str]] = []

    def declined(layer: Any, kv_cache: Any, md: Any, slots: Any, like: Any, like_cache: Any) -> None:
        asked.append((layer.layer_name, like.layer_name))
        return None

    backend.bind_layer_like = declined  # type: ignore[method-assign,assignment]
    calls = _count_forward(backend)
    _run_chunks(cache, chunks=2, steps=2, seed=23, names=("a", "b", "c"))
    # asked once per twin and chunk, then each layer's own first call bound it
    assert asked == [("b", "a"), ("c", "a")] * 2
    assert calls["forward"] == 3 * 2


def test_a_failure_binding_a_twin_is_named_and_the_layer_not_counted_done() -> None:
    cache, pool = _session(layers=TWINS)
    worker = cache.worker
    backend = worker.backends[0]

    def broken(*args: Any) -> None:
        raise RuntimeError("cannot bind")

    backend.bind_layer_like = broken  # type: ignore[method-assign,assignment]
    session = cache.begin_session("s", 1)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    gen = torch.Generator().manual_seed(25)
    q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        worker.forward("a", q, k, v)
        assert worker.translator is not None
        state = worker.translator.active_state
        assert state is not None
        with pytest.raises(
            NativeBackendError, match=r"backend 'sdpa' failed in layer 'b' \(RuntimeError: cannot bind\)"
        ):
            worker.forward("b", q, k, v)
        assert "b" not in state.layers_done and "b" not in state.bound_layers
    cache.abort(chunk)
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_the_sdpa_backend_binds_no_twin_over_a_cache_of_another_shape() -> None:
    cache, _ = _session(layers=TWINS)
    worker = cache.worker
    backend = worker.backends[0]
    session = cache.begin_session("s", 1)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    gen = torch.Generator().manual_seed(27)
    q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
    with worker.stepper() as runtime:
        batch = runtime.ensure_rows(chunk.rows())
        worker.forward("a", q, k, v)
        layer_b = worker.layers["b"]
        md, slots = batch.attn_metadata["b"], batch.slot_mappings_by_layer["b"]
        like, like_cache = worker.layers["a"], worker.kv_caches["a"]
        other = torch.zeros(2, 3, BLOCK, H, D)  # another block count: not congruent
        assert backend.bind_layer_like(layer_b, other, md, slots, like, like_cache) is None
        assert (
            backend.bind_layer_like(layer_b, worker.kv_caches["b"], md, slots, like, like_cache) is not None
        )
    cache.abort(chunk)


def test_a_view_is_moved_onto_a_twin_cache_only_from_within_its_own_cache() -> None:
    """``_rebased``: a view of one layer's cache lands at the same offsets in a congruent cache
    (here two caches sharing one storage, as a pooled allocation lays them out); a copy, or a
    view reaching outside the first cache, is not moved."""
    from diffusion_kv.platforms.torch_sdpa import _rebased

    pool = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    a, b = pool[0], pool[1]
    view = a[1:3].transpose(0, 1)
    moved = _rebased(view, a, b)
    assert moved is not None and torch.equal(moved, b[1:3].transpose(0, 1))
    assert _rebased(view.clone(), a, b) is None  # a copy: nothing of a's to move
    beyond = pool.view(-1)[8:16]  # starts inside a, ends inside b
    assert _rebased(beyond, a.reshape(-1), b.reshape(-1)) is None

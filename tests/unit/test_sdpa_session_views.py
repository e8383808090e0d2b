"""On the CPU the sdpa backend writes a batch's slots by slice copies where they form a few runs
(found at build) and reads a session's unmasked live blocks in cache order, so the ring the
window's blocks make in a pool sized to the session's bound is one view of the cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.torch_sdpa import (
    MAX_WRITE_RUNS,
    CudaPagedMetadata,
    SdpaRowGroup,
    TorchSdpaBackend,
    live_runs,
    order_free,
    slot_runs,
)

H, D, BLOCK = 2, 8, 16
POLICY = SessionPolicy(chunk_tokens=32, window_chunks=2, sink_chunks=1)  # whole blocks per chunk


def _group(live: tuple[int, ...], keys: int, key_mask: torch.Tensor | None = None) -> SdpaRowGroup:
    return SdpaRowGroup(
        32, 512, (0,), None, None, keys, live=torch.tensor(live), live_host=live, key_mask=key_mask
    )


def test_slot_runs_exact() -> None:
    assert slot_runs(torch.tensor([5, 6, 7, 20, 21])) == ((0, 5, 3), (3, 20, 2))
    assert slot_runs(torch.tensor([9])) == ((0, 9, 1),)
    assert slot_runs(torch.tensor([], dtype=torch.long)) is None
    assert slot_runs(torch.tensor([-1, 0, 1])) is None  # a padding slot
    assert slot_runs(torch.tensor([3, 4, -1])) is None
    scattered = torch.arange(0, 2 * (MAX_WRITE_RUNS + 1), 2)
    assert slot_runs(scattered) is None
    assert slot_runs(scattered[:-1]) == tuple((i, 2 * i, 1) for i in range(MAX_WRITE_RUNS))


def test_an_unmasked_group_of_whole_blocks_is_read_in_cache_order() -> None:
    # sink in kernel blocks 0-1, the window's tail in 6-9, its head (the chunk) in 2-5
    ids = ((0, 1, 9, 9, 6, 7, 8, 9, 2, 3, 4, 5),)
    live = (0, 1, 4, 5, 6, 7, 8, 9, 10, 11)
    grp = _group(live, 16 * len(live))
    assert order_free(grp, 16)
    ids = ((0, 1, 99, 99, 6, 7, 8, 9, 2, 3, 4, 5),)
    assert live_runs(grp, ids, 1, 16) == ((0, 10),)
    assert live_runs(grp, ids, 1) is None  # without the page size: the table's order, 3 runs
    # a block cut at seq_len (it must stay last) or a mask over the keys: the table's order
    cut = _group(live, 16 * len(live) - 3)
    assert not order_free(cut, 16) and live_runs(cut, ids, 1, 16) is None
    masked = _group(live, 16 * len(live), torch.ones(32, 16 * len(live), dtype=torch.bool))
    assert not order_free(masked, 16) and live_runs(masked, ids, 1, 16) is None


def _session() -> tuple[SessionCache, FreeListPool]:
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(1024, 1, 2, 1024, device=torch.device("cpu"), backend="sdpa")
    )
    worker.register_kv_cache_layers(
        {f"l{i}": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask) for i in range(2)}
    )
    num_blocks = 2 + 2 * 3 + 1  # sink + window + the chunk + one: the session's bound
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=BLOCK)
    pool = FreeListPool(num_blocks)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=1024, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    return SessionCache(worker, alloc, POLICY), pool


def test_a_ring_placed_session_reads_one_view_writes_by_slices_and_matches_dense() -> None:
    cache, pool = _session()
    worker = cache.worker
    backend = worker.backends[0]
    assert type(backend).name == "sdpa"
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(0)
    keys = {n: torch.zeros(0, H, D) for n in worker.layers}
    values = {n: torch.zeros(0, H, D) for n in worker.layers}
    viewed_after = 0
    for index in range(10):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        written = {}
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            assert worker.translator is not None
            batch = worker.translator.active_batch
            assert batch is not None
            md: CudaPagedMetadata = batch.attn_metadata["l0"]
            (grp,) = md.sdpa_groups
            ids = batch.common.host_block_ids[0][0]
            table_order = [ids[c] for c in grp.live_host]
            if index >= 3:  # the window slid: the table's order is not the cache's
                assert grp.live_runs == ((min(table_order), len(table_order)),)
                if table_order != sorted(table_order):
                    viewed_after += 1
            known = backend._write_runs  # type: ignore[attr-defined]
            assert known is not None and len(known[2]) >= 1
            slots = batch.slot_mappings_by_layer["l0"]
            for name in worker.layers:
                q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
                out = worker.forward(name, q, k, v)
                k_cache, v_cache = key_value_caches(worker.kv_caches[name])
                assert torch.equal(k_cache.reshape(-1, H, D)[slots], k)
                assert torch.equal(v_cache.reshape(-1, H, D)[slots], v)
                all_k, all_v = torch.cat([keys[name], k]), torch.cat([values[name], v])
                mask = POLICY.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
                ref = dense_attention(q, all_k, all_v, mask, D**-0.5)
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
                written[name] = (k, v)
        cache.commit(chunk)
        for name, (k, v) in written.items():
            keys[name] = torch.cat([keys[name], k])
            values[name] = torch.cat([values[name], v])
    assert viewed_after >= 3  # the ring's order differed from the cache's and was read as one view
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_a_slot_mapping_written_after_build_is_written_by_index() -> None:
    cache, pool = _session()
    worker = cache.worker
    backend = worker.backends[0]
    session = cache.begin_session("s", 1)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        assert worker.translator is not None
        batch = worker.translator.active_batch
        assert batch is not None
        slots = batch.slot_mappings_by_layer["l0"]
        known = backend._write_runs  # type: ignore[attr-defined]
        assert known is not None and known[2] == ((0, int(slots[0]), chunk.tokens),)
        layer = worker.executor.layers["l0"] if worker.executor is not None else None
        assert layer is not None
        kv = worker.kv_caches["l0"]
        k_cache, v_cache = key_value_caches(kv)
        moved = slots.clone().flip(0)
        slots.copy_(moved)  # the same memory, written since build: its runs no longer hold
        k, v = torch.randn(2, chunk.tokens, H, D).unbind(0)
        backend.write_kv_valid(layer, k, v, kv, slots)
        assert torch.equal(k_cache.reshape(-1, H, D)[moved], k)
        assert torch.equal(v_cache.reshape(-1, H, D)[moved], v)
        slots.copy_(moved.flip(0))
    cache.abort(chunk)
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_under_inference_mode_the_slots_are_written_by_index() -> None:
    """A host running under ``torch.inference_mode`` (vLLM-Omni's runner does) hands inference
    tensors, which have no version counter to prove the slots unchanged since build: no runs are
    recorded and the write is the indexed copy, exact."""
    cache, pool = _session()
    worker = cache.worker
    backend = worker.backends[0]
    session = cache.begin_session("s", 1)
    with torch.inference_mode():
        chunk = cache.append_chunk(session)
        assert chunk is not None
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            assert worker.translator is not None
            batch = worker.translator.active_batch
            assert batch is not None
            slots = batch.slot_mappings_by_layer["l0"]
            assert slots.is_inference()
            assert backend._write_runs is None  # type: ignore[attr-defined]
            layer = worker.executor.layers["l0"] if worker.executor is not None else None
            assert layer is not None
            kv = worker.kv_caches["l0"]
            k_cache, v_cache = key_value_caches(kv)
            k, v = torch.randn(2, chunk.tokens, H, D).unbind(0)
            backend.write_kv_valid(layer, k, v, kv, slots)
            assert torch.equal(k_cache.reshape(-1, H, D)[slots.long()], k)
            assert torch.equal(v_cache.reshape(-1, H, D)[slots.long()], v)
        cache.abort(chunk)
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def _active(worker: PagedWorker) -> tuple[Any, Any]:
    """Inside a stepper: the worker's active batch and its executor."""
    assert worker.executor is not None and worker.translator is not None
    batch = worker.translator.active_batch
    assert batch is not None
    return batch, worker.executor


def test_the_denoise_steps_of_a_chunk_reuse_the_first_calls_decisions_and_read_each_steps_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk's denoise steps run every layer over the same batch: the first call on a layer's
    cache records the resolved SDPA call (K/V views of the cache, the mask decision) in the
    batch's metadata and later calls take it; each step's output is exact over what that step
    wrote, never over an earlier step's K/V, whatever the query's token stride. A record made
    by another layer object on the same cache is not taken (the full way, also exact)."""
    cache, pool = _session()
    worker = cache.worker
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(1)
    full_calls: list[str] = []
    group_tensors = TorchSdpaBackend._group_tensors

    def counted(layer: Any, *args: Any) -> Any:
        full_calls.append(layer.layer_name)
        return group_tensors(layer, *args)

    monkeypatch.setattr(TorchSdpaBackend, "_group_tensors", staticmethod(counted))
    keys = {n: torch.zeros(0, H, D) for n in worker.layers}
    values = {n: torch.zeros(0, H, D) for n in worker.layers}
    for _ in range(6):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        mask = POLICY.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
        last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            md: CudaPagedMetadata = _active(worker)[0].attn_metadata["l0"]
            for step in range(3):
                for name in worker.layers:
                    q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
                    if step == 2 and name == "l1":  # packed per token, a wider token stride
                        q = torch.randn(chunk.tokens, 2 * H * D, generator=gen)[:, : H * D].view(-1, H, D)
                    out = worker.forward(name, q, k, v)
                    ref = dense_attention(
                        q, torch.cat([keys[name], k]), torch.cat([values[name], v]), mask, D**-0.5
                    )
                    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
                    last[name] = (k, v)
                    bound = md.calls.get(id(worker.kv_caches[name]))
                    assert bound is not None and bound.kv_cache is worker.kv_caches[name]
                    assert bound.tokens == chunk.tokens
        # the first step's "l0" call went the full way; "l1", its twin, was bound from that
        # record moved onto its own cache (bind_layer_like); every later call took its record
        assert full_calls == ["l0"]
        full_calls.clear()
        cache.commit(chunk)
        for name, (k, v) in last.items():
            keys[name] = torch.cat([keys[name], k])
            values[name] = torch.cat([values[name], v])
    # a record another layer object made on this cache (one geometry, another object) is not taken
    chunk = cache.append_chunk(session)
    assert chunk is not None
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        batch, executor = _active(worker)
        layer = executor.layers["l0"]
        twin = type(layer)(**{f: getattr(layer, f) for f in layer.__dataclass_fields__})
        assert twin == layer and twin is not layer
        backend = worker.backends[0]
        kv = worker.kv_caches["l0"]
        md = batch.attn_metadata["l0"]
        k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(2))
        backend.write_kv_valid(layer, k, v, kv, batch.slot_mappings_by_layer["l0"])
        q = torch.randn(chunk.tokens, H, D, generator=gen)
        first = backend.forward(layer, q, kv, md)
        assert md.calls[id(kv)].layer is layer
        again = backend.forward(twin, q, kv, md)
        assert md.calls[id(kv)].layer is twin
        assert torch.equal(first, again)
        mask = POLICY.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
        ref = dense_attention(q, torch.cat([keys["l0"], k]), torch.cat([values["l0"], v]), mask, D**-0.5)
        torch.testing.assert_close(again.double(), ref, atol=1e-5, rtol=1e-5)
    cache.abort(chunk)
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_pages_that_do_not_flatten_are_read_fresh_at_every_step() -> None:
    """A layer cache whose pages do not flatten into slots in place (a head-major layout, as a
    host's cache may be) makes the one live run's K/V a reshaped copy, not a view: nothing of it
    is kept for the batch's later calls, so each denoise step reads what it wrote."""
    cache, pool = _session()
    worker = cache.worker
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(2)
    keys = torch.zeros(0, H, D)
    values = torch.zeros(0, H, D)
    for _ in range(4):  # the window slides: the live blocks form one run of the cache
        chunk = cache.append_chunk(session)
        assert chunk is not None
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            ks = {}
            for name in worker.layers:
                q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
                worker.forward(name, q, k, v)
                ks[name] = (k, v)
        cache.commit(chunk)
        keys, values = torch.cat([keys, ks["l0"][0]]), torch.cat([values, ks["l0"][1]])
    chunk = cache.append_chunk(session)
    assert chunk is not None
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        batch, executor = _active(worker)
        md: CudaPagedMetadata = batch.attn_metadata["l0"]
        (grp,) = md.sdpa_groups
        assert grp.live_runs is not None and len(grp.live_runs) == 1
        layer = executor.layers["l0"]
        backend = worker.backends[0]
        k_cache, v_cache = key_value_caches(worker.kv_caches["l0"])
        head_major = tuple(c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in (k_cache, v_cache))
        assert head_major[0].stride(0) != head_major[0].shape[1] * head_major[0].stride(1)
        assert torch.equal(head_major[0], k_cache)
        slots = batch.slot_mappings_by_layer["l0"]
        mask = POLICY.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
        for _ in range(3):
            q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
            backend.write_kv_valid(layer, k, v, head_major, slots)
            out = backend.forward(layer, q, head_major, md)
            ref = dense_attention(q, torch.cat([keys, k]), torch.cat([values, v]), mask, D**-0.5)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        assert id(head_major) not in md.calls
        assert not any(at[0] == head_major[0].data_ptr() for at in md.views)
    cache.abort(chunk)
    cache.end_session(session)
    assert pool.num_free == pool.num_total

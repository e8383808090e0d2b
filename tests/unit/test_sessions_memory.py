"""Sessions opened and closed leave nothing behind (issue 42, the session half): after N sessions
-- windows that slid, chunks aborted, a failing forward, first chunks aborted away, sessions
ended with a chunk open -- every per-session map of the session cache, the allocator, the
worker's registry and its translator is empty again, the pool whole, and the registry's
tombstones exactly its ``generation_memory`` window, still refusing a late snapshot."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.errors import GenerationError
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import Chunk, SessionCache, SessionPolicy
from diffusion_kv.platforms.cpu import CpuPlatform

H, D, BLOCK = 2, 8, 4
POLICY = SessionPolicy(chunk_tokens=6, window_chunks=2, sink_chunks=1)
MEMORY = 5  # the registry's generation_memory: tombstones it keeps


def make(num_blocks: int = 48) -> tuple[SessionCache, FreeListPool]:
    worker = PagedWorker(CpuPlatform(), RunnerConfig(96, 2, 4, 96, device=torch.device("cpu")))
    worker.register_kv_cache_layers(
        {f"l{i}": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask) for i in range(2)}
    )
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=BLOCK)
    assert worker.registry is not None
    worker.registry.generation_memory = MEMORY
    pool = FreeListPool(num_blocks)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=96, max_rows_per_request=2, worker_rows=8, pool=pool
    )
    return SessionCache(worker, alloc, POLICY), pool


def write(cache: SessionCache, chunk: Chunk, fail: bool = False) -> None:
    """One denoise step over the chunk: every layer writes its K/V (a failing forward raises
    after the first layer wrote)."""
    n = chunk.tokens * chunk.branches
    with cache.worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        for i, name in enumerate(cache.worker.layers):
            if fail and i == 1:
                raise RuntimeError("the model failed")
            q, k, v = (torch.randn(n, H, D) for _ in range(3))
            cache.worker.forward(name, q, k, v)


def maps(cache: SessionCache) -> dict[str, int]:
    """Every map that holds per-session state, by size."""
    registry, translator = cache.worker.registry, cache.worker.translator
    assert registry is not None and translator is not None
    return {
        "sessions": len(cache.sessions),
        "reserved": len(cache.allocator.reserved()),
        "used_blocks": cache.allocator.pool.num_total - cache.allocator.pool.num_free,
        "states": len(registry.installed_requests()),
        "rows": len(registry.rows),
        "written": len(registry._written),
        "bindings": len(registry._bindings),
        "holders": sum(len(h) for h in registry._holders),
        "worker_rows_in_use": registry.capacity - len(registry.free_rows),
        "active_batches": int(translator.active_batch is not None),
    }


EMPTY = dict.fromkeys(
    (
        "sessions",
        "reserved",
        "used_blocks",
        "states",
        "rows",
        "written",
        "bindings",
        "holders",
        "worker_rows_in_use",
        "active_batches",
    ),
    0,
)


def serve(cache: SessionCache, number: int) -> None:
    """Session ``number``: 4 chunks (the window slides; one in three with two CFG branches),
    with the mix of a long-lived server: a first chunk aborted away, a chunk aborted later, a
    failing forward through ``run_chunk``; one in four ends with a chunk open."""
    session = cache.begin_session(f"s{number}", branches=1 + (number % 3 == 1))
    first = cache.append_chunk(session)
    assert first is not None
    if number % 2:
        write(cache, first)
        cache.abort(first)  # the reservation goes with it (retired, then reserved anew)
        assert not session.reserved
        first = cache.append_chunk(session)
        assert first is not None
    write(cache, first)
    cache.commit(first)
    for index in range(1, 4):
        if index == 1:
            chunk = cache.append_chunk(session)
            assert chunk is not None
            write(cache, chunk)
            cache.abort(chunk)
        if index == 2 and number % 2 == 0:
            with pytest.raises(RuntimeError, match="the model failed"):
                cache.run_chunk(session, lambda c: write(cache, c, fail=True))
        assert cache.run_chunk(session, lambda c: write(cache, c)) is not None
    assert session.chunks_committed == 4 and session.committed_tokens == 24
    snapshot = cache.worker.registry.snapshot_of(session.session_id)  # type: ignore[union-attr]
    assert snapshot is not None and NULL_BLOCK in snapshot.sequences[0].block_ids[0]  # it slid
    if number % 4 == 3:
        open_chunk = cache.append_chunk(session)
        assert open_chunk is not None
        write(cache, open_chunk)  # ended mid-stream, the chunk open
    cache.end_session(session)


def test_per_session_maps_are_empty_after_n_sessions_and_tombstones_stay_at_their_window() -> None:
    cache, pool = make()
    registry = cache.worker.registry
    assert registry is not None
    for number in range(8):
        serve(cache, number)
        assert maps(cache) == EMPTY, number
        assert len(registry._removed) == min(number + 1, MEMORY)
    assert pool.num_free == pool.num_total == 48
    # the tombstones are exactly the last MEMORY sessions ended, in the order they ended
    assert list(registry._removed) == [f"s{n}" for n in range(3, 8)]


def test_open_sessions_hold_only_their_own_entries() -> None:
    cache, pool = make()
    registry = cache.worker.registry
    assert registry is not None
    a, b = cache.begin_session("a", branches=2), cache.begin_session("b")
    for _ in range(5):  # the windows slide: each branch holds at most kv_blocks_bound blocks
        for session in (a, b):
            cache.run_chunk(session, lambda c: write(cache, c))
    held = maps(cache)
    assert held["sessions"] == 2 and held["reserved"] == 2 and held["states"] == 2
    assert held["rows"] == held["written"] == 3  # a's two branches and b's one
    assert held["used_blocks"] == held["holders"] <= 3 * cache.kv_blocks_bound()
    cache.end_session(a)
    cache.end_session(b)
    assert maps(cache) == EMPTY and list(registry._removed) == ["a", "b"]
    assert pool.num_free == pool.num_total


def test_a_late_snapshot_of_an_ended_session_is_refused_while_its_tombstone_is_kept() -> None:
    cache, _ = make()
    registry = cache.worker.registry
    assert registry is not None
    session = cache.begin_session("late")
    for _ in range(2):
        cache.run_chunk(session, lambda c: write(cache, c))
    stale = registry.snapshot_of("late")  # a snapshot still in flight when the session ends
    assert stale is not None
    cache.end_session(session)
    retired_through = registry.removed_generation("late")
    assert retired_through == cache.allocator.generation
    with pytest.raises(GenerationError):
        cache.worker.install(stale)
    assert maps(cache) == EMPTY and registry.removed_generation("late") == retired_through
    for number in range(MEMORY - 1):  # the window is full: "late" is still remembered
        serve(cache, 100 + number)
    assert registry.removed_generation("late") == retired_through
    with pytest.raises(GenerationError):
        cache.worker.install(stale)
    serve(cache, 200)  # one more: the oldest tombstone leaves, the window stays MEMORY
    assert registry.removed_generation("late") is None and len(registry._removed) == MEMORY

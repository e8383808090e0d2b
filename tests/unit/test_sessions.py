"""Sessions (core/sessions): chunks appended, written by denoise steps, committed or aborted,
over a chunk-causal + window + sink mask on the cpu reference, against dense attention over the
whole history under the same mask."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.registry import RowTransition
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import ChunkState, SessionCache, SessionPolicy
from diffusion_kv.platforms.cpu import CpuPlatform

H, D, BLOCK = 2, 8, 4
POLICY = SessionPolicy(chunk_tokens=6, window_chunks=2, sink_chunks=1)  # chunks straddle blocks


def make(num_blocks: int = 40, policy: SessionPolicy = POLICY) -> tuple[SessionCache, FreeListPool]:
    worker = PagedWorker(CpuPlatform(), RunnerConfig(96, 2, 2, 96, device="cpu"))
    worker.register_kv_cache_layers(
        {f"l{i}": PagedLayerSpec(H, H, D, torch.float32, mode=policy.mask) for i in range(2)}
    )
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=BLOCK)
    pool = FreeListPool(num_blocks)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=96, max_rows_per_request=2, worker_rows=4, pool=pool
    )
    return SessionCache(worker, alloc, policy), pool


class Stream:
    """A session's host loop with its own dense bookkeeping (committed K/V per branch/layer)."""

    def __init__(self, cache: SessionCache, sid: str, branches: int, seed: int) -> None:
        self.cache, self.branches = cache, branches
        self.session = cache.begin_session(sid, branches)
        self.gen = torch.Generator().manual_seed(seed)
        names = list(cache.worker.layers)
        self.keys = {(b, n): torch.zeros(0, H, D) for b in range(branches) for n in names}
        self.values = {(b, n): torch.zeros(0, H, D) for b in range(branches) for n in names}

    def step(self, chunk, check: bool = True) -> dict:  # type: ignore[no-untyped-def]
        """One denoise step over the chunk: every layer writes the chunk's K/V and attends."""
        T, written = chunk.tokens * self.branches, {}
        with self.cache.worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            for name in self.cache.worker.layers:
                q, k, v = (torch.randn(T, H, D, generator=self.gen) for _ in range(3))
                out = self.cache.worker.forward(name, q, k, v)
                for b in range(self.branches):
                    part = slice(b * chunk.tokens, (b + 1) * chunk.tokens)
                    keys = torch.cat([self.keys[b, name], k[part]])
                    values = torch.cat([self.values[b, name], v[part]])
                    written[b, name] = (k[part], v[part])
                    if check:
                        mask = self.cache.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
                        ref = dense_attention(q[part], keys, values, mask, D**-0.5)
                        torch.testing.assert_close(out[part].double(), ref, atol=1e-5, rtol=1e-5)
        return written

    def keep(self, written: dict) -> None:  # type: ignore[type-arg]
        for key, (k, v) in written.items():
            self.keys[key] = torch.cat([self.keys[key], k])
            self.values[key] = torch.cat([self.values[key], v])

    def chunk(self, steps: int = 3) -> None:
        chunk = self.cache.append_chunk(self.session)
        assert chunk is not None
        written = {}
        for _ in range(steps):
            written = self.step(chunk)
        self.cache.commit(chunk)
        self.keep(written)  # the last step's K/V are what the chunk committed


def test_a_windowed_session_matches_dense_and_holds_sink_window_and_one_chunk() -> None:
    cache, pool = make()
    stream = Stream(cache, "s", branches=2, seed=0)
    for _ in range(9):
        stream.chunk()
    bound = cache.kv_blocks_bound()
    assert bound == 2 + 5 + 1  # sink 6 tokens -> 2 blocks; window + chunk 18 tokens -> 5; a straddled block
    history = stream.session.history
    assert max(history) <= 2 * bound  # two branches
    # flat once the window filled, up to the block a chunk boundary straddles (per branch)
    assert max(history[3:]) - min(history[3:]) <= 2, history
    snapshot = cache.worker.registry.snapshot_of("s")
    assert snapshot is not None and NULL_BLOCK in snapshot.sequences[0].block_ids[0]
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total and cache.sessions == ()


def test_an_aborted_chunk_leaves_the_session_exactly_as_before() -> None:
    cache, pool = make()
    stream = Stream(cache, "s", branches=1, seed=1)
    for _ in range(4):
        stream.chunk()
    registry = cache.worker.registry
    before = (registry.snapshot_of("s").sequences, pool.num_free, registry.written_spans(("s", 0, None)))
    chunk = cache.append_chunk(stream.session)
    assert chunk is not None and chunk.start == 24
    stream.step(chunk)
    cache.abort(chunk)
    assert registry.last_transitions == {RowTransition.TRUNCATE}
    after = (registry.snapshot_of("s").sequences, pool.num_free, registry.written_spans(("s", 0, None)))
    assert after == before and chunk.state is ChunkState.ABORTED
    with pytest.raises(StateError, match="is not open"):
        cache.commit(chunk)
    for _ in range(3):  # the stream goes on from the same position, still equal to dense
        stream.chunk()
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total


def test_a_failing_denoise_step_aborts_the_chunk_and_the_first_chunk_takes_the_reservation() -> None:
    cache, pool = make()
    stream = Stream(cache, "s", branches=1, seed=2)

    def boom(chunk: object) -> None:
        stream.step(chunk)  # written, then the model fails
        raise RuntimeError("the model failed")

    with pytest.raises(RuntimeError, match="the model failed"):
        cache.run_chunk(stream.session, boom)
    assert stream.session.open_chunk is None and not stream.session.reserved
    assert pool.num_free == pool.num_total and cache.worker.registry.installed_requests() == ()
    stream.chunk()  # the same session starts again at position 0, equal to dense
    assert stream.session.committed_tokens == 6
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total


def test_a_chunk_nobody_wrote_cannot_commit() -> None:
    cache, pool = make()
    session = cache.begin_session("s")
    chunk = cache.append_chunk(session)
    assert chunk is not None
    free = pool.num_free
    with pytest.raises(StateError, match=r"tokens \[\(0, 6\)\] were never written"):
        cache.commit(chunk)
    assert chunk.state is ChunkState.OPEN and pool.num_free == free
    with pytest.raises(StateError, match="has chunk 0 open"):
        cache.append_chunk(session)
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_sessions_interleaved_stay_apart() -> None:
    cache, pool = make(num_blocks=60)
    a, b = Stream(cache, "a", 1, seed=3), Stream(cache, "b", 2, seed=4)
    for _ in range(5):
        a.chunk()
        b.chunk(steps=2)
    cache.end_session(a.session)
    cache.end_session(b.session)
    assert pool.num_free == pool.num_total


def test_a_short_pool_takes_nothing() -> None:
    cache, pool = make(num_blocks=16)  # a two-branch session may hold 16 (admission)
    assert pool.allocate(10) is not None  # held elsewhere: 6 free
    first = Stream(cache, "x", branches=2, seed=5)
    first.chunk()  # two rows of 6 tokens: 4 blocks
    session = cache.begin_session("s", branches=2)
    assert cache.append_chunk(session) is None  # 4 more blocks needed, 2 free
    assert pool.num_free == 2 and not session.reserved
    chunk = cache.append_chunk(first.session)  # 12 tokens: one more block per row, the last 2
    assert chunk is not None and pool.num_free == 0
    cache.abort(chunk)
    assert pool.num_free == 2 and first.session.open_chunk is None


def test_bad_policies_and_workers_are_refused() -> None:
    with pytest.raises(ValidationError, match="chunk_tokens must be a positive int"):
        SessionPolicy(chunk_tokens=0)
    with pytest.raises(ValidationError, match="window_chunks must be an int >= 0 or None"):
        SessionPolicy(chunk_tokens=4, window_chunks=-1)
    cache, _ = make()
    with pytest.raises(ValidationError, match=r"the session policy's mask is chunk_causal\(chunk=8"):
        SessionCache(cache.worker, cache.allocator, SessionPolicy(chunk_tokens=8, window_chunks=1))
    cache.begin_session("s")
    with pytest.raises(ValidationError, match="session 's' is open already"):
        cache.begin_session("s")
    unbounded = SessionPolicy(chunk_tokens=6)
    assert unbounded.mask.window is None and unbounded.mask.sink == 0

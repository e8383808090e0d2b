"""Sessions at scale (core/sessions: batching, admission, offload, sharing) on the cpu reference:
many sessions in one step beside one-shot requests, admission numbers, offload/reload bit-exact,
prefix sharing through the prefix cache, and fp8 pages -- every output against dense attention
over the same mask (and, for the mixed step, against each session's / request's separate run)."""

from __future__ import annotations

import zlib

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.conformance.reference import dense_attention, tolerance
from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.allocator import AdmissionError
from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.kv_quant import fake_quantize
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.prefix_cache import PrefixCache
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.scheduler import DiffusionRequest, DiffusionScheduler, StepBatch
from diffusion_kv.core.sessions import Session, SessionCache, SessionPolicy
from diffusion_kv.core.sessions.admission import admission
from diffusion_kv.core.sessions.batching import MixedStep, SessionBatch, SessionScheduler
from diffusion_kv.core.sessions.offload import lru_offloader, offload, reload
from diffusion_kv.core.sessions.sharing import SharedStarts
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend

H, D, BLOCK = 2, 8, 4
LAYERS = ("l0", "l1")
POLICY = SessionPolicy(chunk_tokens=6, window_chunks=2, sink_chunks=1)  # chunks straddle blocks


def make(
    num_blocks: int = 40,
    policy: SessionPolicy = POLICY,
    *,
    prefix: bool = False,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
) -> SessionCache:
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(96, 2, 4, 192, device="cpu", kv_cache_dtype=kv_cache_dtype)
    )
    worker.register_kv_cache_layers(
        {n: PagedLayerSpec(H, H, D, torch.float32, mode=policy.mask, k_scale=k_scale) for n in LAYERS}
    )
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=BLOCK)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK,
        max_model_len=96,
        max_rows_per_request=2,
        worker_rows=8,
        pool=FreeListPool(num_blocks),
        prefix_cache=PrefixCache() if prefix else None,
    )
    return SessionCache(worker, alloc, policy)


def qkv(tag: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs determined by ``tag`` alone (the same in a mixed step and in a separate run)."""
    gen = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    return tuple(torch.randn(tokens, H, D, generator=gen) for _ in range(3))  # type: ignore[return-value]


class Host:
    """The host side of many sessions on one cache: runs a step over session rows with inputs
    determined by (session, branch, chunk, step, layer), checks every row against dense
    attention over its own bookkeeping (the committed K/V, dequantised for fp8 pages), keeps the
    outputs by the same tag, and appends the last step's K/V at commit."""

    def __init__(self, cache: SessionCache) -> None:
        self.cache = cache
        self.keys: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.pending: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.tol = tolerance(torch.float32, CpuReferenceBackend)

    def stored(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scales = self.cache.worker.layers[layer].kv_scales
        if scales is None:
            return k, v
        return fake_quantize(k, scales.k_scale), fake_quantize(v, scales.v_scale)

    def history(self, sid: str, b: int, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.zeros(0, H, D)
        return self.keys.get((sid, b, layer), (empty, empty))

    def run_rows(self, rows: tuple[PagedRow, ...], tags: list[str], chunk_of: list[int]) -> None:
        """One forward over ``rows`` (already active); ``tags[i]`` names row i's inputs."""
        for layer in LAYERS:
            parts = [qkv(f"{t}/{layer}", r.query_len) for t, r in zip(tags, rows, strict=True)]
            q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
            out = self.cache.worker.forward(layer, q, k, v)
            offset = 0
            for row, tag, (rq, rk, rv) in zip(rows, tags, parts, strict=True):
                part = out[offset : offset + row.query_len]
                offset += row.query_len
                self.outputs[f"{tag}/{layer}"] = part.clone()
                b = int(row.sequence_id or 0)
                hk, hv = self.history(row.request_id, b, layer)
                sk, sv = self.stored(layer, rk, rv)
                keys, values = (
                    torch.cat([hk[: row.kv_start_pos], sk]),
                    torch.cat([hv[: row.kv_start_pos], sv]),
                )
                mask = self.cache.mask.row_mask(row.kv_start_pos, row.query_len, row.seq_len)
                ref = dense_attention(rq, keys, values, mask, D**-0.5)
                torch.testing.assert_close(part.double(), ref, **self.tol)
                self.pending[(row.request_id, b, layer)] = (sk, sv)

    def session_step(self, batch: SessionBatch) -> None:
        tags, chunks = [], []
        for e in batch.entries:
            for row in e.rows:
                tags.append(f"{e.session_id}/b{row.sequence_id}/c{e.chunk.index}/s{e.step}")
                chunks.append(e.chunk.index)
        self.run_rows(batch.rows, tags, chunks)

    def keep(self, sid: str, branches: int) -> None:
        for b in range(branches):
            for layer in LAYERS:
                hk, hv = self.history(sid, b, layer)
                sk, sv = self.pending.pop((sid, b, layer))
                self.keys[(sid, b, layer)] = (torch.cat([hk, sk]), torch.cat([hv, sv]))

    def chunk(self, session: Session, steps: int = 2) -> None:
        """One chunk of one session alone (append, steps, commit), tags as in a mixed step."""
        chunk = self.cache.append_chunk(session)
        assert chunk is not None
        for s in range(steps):
            with self.cache.worker.stepper() as rt:
                rt.ensure_rows(chunk.rows())
                tags = [f"{session.session_id}/b{b}/c{chunk.index}/s{s}" for b in range(session.branches)]
                self.run_rows(chunk.rows(), tags, [chunk.index] * session.branches)
        self.cache.commit(chunk)
        self.keep(session.session_id, session.branches)


# --- many sessions in one step, beside one-shot requests ---------------------------------------


def one_shot_scheduler() -> DiffusionScheduler:
    worker = PagedWorker(CpuPlatform(), RunnerConfig(64, 1, 4, 256, device="cpu"))
    worker.register_kv_cache_layers(
        {n: PagedLayerSpec(H, H, D, torch.float32, mode=AttentionMode.CAUSAL) for n in LAYERS}
    )
    worker.initialize_kv_cache(num_blocks=32, block_size=BLOCK)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=64, max_rows_per_request=1, worker_rows=4, pool=FreeListPool(32)
    )
    return DiffusionScheduler(worker, alloc)


def request_step(sched: DiffusionScheduler, outputs: dict[str, torch.Tensor], batch: StepBatch) -> None:
    meta = AttentionMetadata(full_attn_spans=batch.full_attn_spans)
    for layer in LAYERS:
        parts = [qkv(f"{e.request.request_id}/s{e.step}/{layer}", e.num_tokens) for e in batch.entries]
        q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
        out = sched.runner.forward(layer, q, k, v, meta)
        for e in batch.entries:
            outputs[f"{e.request.request_id}/s{e.step}/{layer}"] = out[
                e.token_offset : e.token_offset + e.num_tokens
            ].clone()


REQUESTS = (DiffusionRequest("r0", 8, 8, steps=3), DiffusionRequest("r1", 4, 12, steps=2))


def test_one_step_serves_sessions_at_different_fills_and_steps_beside_one_shot_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = make()
    host = Host(cache)
    requests = one_shot_scheduler()
    sched = SessionScheduler(cache, requests)
    plans = []
    import diffusion_kv.core.translate as translate

    real = translate.build_block_plan
    monkeypatch.setattr(translate, "build_block_plan", lambda *a, **k: plans.append(1) or real(*a, **k))
    sessions = {
        "a": cache.begin_session("a", 2),
        "b": cache.begin_session("b", 1),
        "c": cache.begin_session("c", 1),
    }
    steps = {"a": 3, "b": 2, "c": 2}
    chunks_left = {"a": 4, "b": 5, "c": 3}
    request_out: dict[str, torch.Tensor] = {}
    seen: list[MixedStep] = []

    def fn(step: MixedStep) -> None:
        seen.append(step)
        if step.sessions is not None:
            host.session_step(step.sessions)
        if step.requests is not None:
            request_step(requests, request_out, step.requests)

    sched.submit_chunk(sessions["a"], steps["a"])
    for r in REQUESTS:
        requests.submit(r)
    tick = 0
    while not sched.idle:
        if tick == 1:
            sched.submit_chunk(sessions["b"], steps["b"])  # staggered: other denoise steps
        if tick == 4:
            sched.submit_chunk(sessions["c"], steps["c"])
        report = sched.step(fn)
        assert report is not None and not report.aborted
        for sid, _ in report.committed:
            host.keep(sid, sessions[sid].branches)
            chunks_left[sid] -= 1
            if chunks_left[sid]:
                sched.submit_chunk(sessions[sid], steps[sid])
        tick += 1
    assert chunks_left == {"a": 0, "b": 0, "c": 0}
    mixed = [s for s in seen if s.sessions is not None and s.requests is not None]
    assert len(mixed) >= 3  # one step served both kinds
    several = [s.sessions for s in seen if s.sessions is not None and len(s.sessions.entries) == 3]
    assert several and any(len({e.step for e in b.entries}) > 1 for b in several)  # different denoise steps
    assert any(len({e.fill for e in b.entries}) > 1 for b in several)  # different window fills
    # the visible pages are planned once per prepared batch, never per layer or per step
    assert len(plans) == sched.preparations < sum(s.sessions is not None for s in seen)
    # each session alone, on a fresh cache, gives the very same outputs (exact)
    for sid, session in sessions.items():
        alone = make()
        solo = Host(alone)
        s = alone.begin_session(sid, session.branches)
        for _ in range(session.chunks_committed):
            solo.chunk(s, steps[sid])
        for tag, out in solo.outputs.items():
            assert torch.equal(out, host.outputs[tag]), tag
    # each one-shot request alone gives the very same outputs (exact)
    for r in REQUESTS:
        single = one_shot_scheduler()
        outs: dict[str, torch.Tensor] = {}
        single.submit(r)
        single.run(lambda batch, s=single, o=outs: request_step(s, o, batch))  # type: ignore[misc]
        assert outs and all(torch.equal(out, request_out[tag]) for tag, out in outs.items())
    for session in sessions.values():
        cache.end_session(session)
    pool = cache.allocator.pool
    assert pool.num_free == pool.num_total
    assert requests.allocator.pool.num_free == requests.allocator.pool.num_total
    sched.close()


def test_a_failing_mixed_step_aborts_the_chunks_and_fails_the_requests() -> None:
    cache = make()
    host = Host(cache)
    requests = one_shot_scheduler()
    sched = SessionScheduler(cache, requests)
    a = cache.begin_session("a", 1)
    host.chunk(a)  # one committed chunk before
    registry = cache.worker.registry
    assert registry is not None
    before = (registry.snapshot_of("a").sequences, cache.allocator.pool.num_free)  # type: ignore[union-attr]
    sched.submit_chunk(a, 2)
    requests.submit(REQUESTS[0])

    def boom(step: MixedStep) -> None:
        raise RuntimeError("the model failed")

    report = sched.step(boom)
    assert report is not None
    assert report.aborted == (("a", 1, "RuntimeError: the model failed"),)
    assert report.requests is not None and report.requests.failed == ("r0",)
    after = (registry.snapshot_of("a").sequences, cache.allocator.pool.num_free)  # type: ignore[union-attr]
    assert after == before and a.open_chunk is None and sched.idle
    assert sched.step(boom) is None  # nothing left to do
    sched.close()
    with pytest.raises(StateError, match="the session scheduler is closed"):
        sched.submit_chunk(a, 1)


def test_a_step_whose_batch_cannot_be_prepared_aborts_the_open_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diffusion_kv.core.errors import NativeBackendError

    cache = make()
    host = Host(cache)
    sched = SessionScheduler(cache)
    a, b = cache.begin_session("a", 2), cache.begin_session("b", 1)
    host.chunk(a)  # a has committed KV; b's chunk would be its first
    registry = cache.worker.registry
    assert registry is not None
    before = (registry.snapshot_of("a").sequences, registry.snapshot_of("b"), cache.allocator.pool.num_free)  # type: ignore[union-attr]
    sched.submit_chunk(a, 2)
    sched.submit_chunk(b, 2)

    def broken(self: object, batch: object) -> None:
        raise RuntimeError("no metadata today")

    monkeypatch.setattr(CpuReferenceBackend, "build", broken)
    with pytest.raises(
        NativeBackendError, match=r"failed to build metadata .*RuntimeError: no metadata today"
    ):
        sched.step(lambda s: host.session_step(s.sessions))  # type: ignore[arg-type]
    after = (registry.snapshot_of("a").sequences, registry.snapshot_of("b"), cache.allocator.pool.num_free)  # type: ignore[union-attr]
    assert after == before and a.open_chunk is None and b.open_chunk is None and not b.reserved
    assert sched.running == () and sched.waiting == () and sched.idle
    monkeypatch.undo()
    sched.submit_chunk(a, 1)  # the scheduler goes on: the same sessions, equal to dense
    sched.submit_chunk(b, 1)
    report = sched.step(lambda s: host.session_step(s.sessions))  # type: ignore[arg-type]
    assert report is not None and report.committed == (("a", 1), ("b", 0))
    sched.close()


def test_session_scheduler_refuses_a_shared_worker_and_a_second_chunk() -> None:
    cache = make()
    sched = SessionScheduler(cache)
    a = cache.begin_session("a")
    sched.submit_chunk(a, 2)
    with pytest.raises(ValidationError, match="session 'a' has a chunk queued or open"):
        sched.submit_chunk(a, 2)
    assert sched.waiting == ("a",)
    assert sched.cancel(a) and sched.waiting == ()
    sched.close()


def test_queued_chunks_wait_for_blocks_in_order() -> None:
    cache = make(num_blocks=16)
    sched = SessionScheduler(cache)
    host = Host(cache)
    a, b, c = cache.begin_session("a", 2), cache.begin_session("b", 1), cache.begin_session("c", 1)
    for s in (a, b, c):
        sched.submit_chunk(s, 1)
    held = cache.allocator.pool.allocate(11)  # someone else holds most of the pool
    assert held is not None
    report = sched.step(lambda s: host.session_step(s.sessions))  # type: ignore[arg-type]
    assert report is not None and report.opened == ("a",) and report.waiting == ("b", "c")
    assert report.committed == (("a", 0),) and cache.allocator.pool.num_free == 1
    host.keep("a", 2)
    cache.allocator.pool.free(held)
    report = sched.step(lambda s: host.session_step(s.sessions))  # type: ignore[arg-type]
    assert report is not None and report.opened == ("b", "c") and report.committed == (("b", 0), ("c", 0))
    sched.close()


# --- admission ---------------------------------------------------------------------------------


def test_admission_counts_sessions_now_and_at_most() -> None:
    cache = make(num_blocks=40)
    assert cache.kv_blocks_bound() == 8
    first = admission(cache)
    assert (first.per_session, first.now, first.at_most, first.free_blocks, first.headroom) == (
        8,
        5,
        5,
        40,
        0,
    )
    assert admission(cache, 2).at_most == 2 and admission(cache, 2).now == 2
    host = Host(cache)
    a = cache.begin_session("a", 1)
    host.chunk(a)  # holds 2 blocks, may grow to 8
    now = admission(cache)
    assert (now.free_blocks, now.headroom, now.now, now.at_most) == (38, 6, 4, 5)
    small = make(num_blocks=12)
    with pytest.raises(
        AdmissionError, match=r"session 'x' may hold 16 blocks \(8 per branch x 2.*pool has 12"
    ):
        small.begin_session("x", 2)
    with pytest.raises(AdmissionError, match="session 'y' needs 3 rows"):
        small.begin_session("y", 3)
    assert small.sessions == () and small.allocator.pool.num_free == 12
    unbounded = make(num_blocks=40, policy=SessionPolicy(chunk_tokens=6))
    assert admission(unbounded).per_session == 24 and admission(unbounded).at_most == 1
    unbounded.begin_session("u", 2)  # its first chunk fits: admitted (it grows until max_model_len)


# --- offload -----------------------------------------------------------------------------------


def pages_of(cache: SessionCache, sid: str) -> tuple[object, ...]:
    """The session's rows (lengths, released places) and the bytes of its live blocks."""
    snap = cache.worker.registry.snapshot_of(sid)  # type: ignore[union-attr]
    assert snap is not None
    shape = tuple((s.seq_len, tuple(b == NULL_BLOCK for b in s.block_ids[0])) for s in snap.sequences)
    live = [b for s in snap.sequences for b in s.block_ids[0] if b != NULL_BLOCK]
    data = []
    for name in LAYERS:
        for t in key_value_caches(cache.worker.kv_caches[name]):
            data.append(t.view(torch.uint8)[live].clone())
    written = tuple(cache.worker.resolve(sid, s.sequence_id).written for s in snap.sequences)
    return shape, data, written


@pytest.mark.parametrize("dtype", ["auto", "fp8_e4m3"])
def test_offload_and_reload_are_bit_exact_and_free_the_blocks(dtype: str) -> None:
    cache = make(kv_cache_dtype=dtype, k_scale=0.5)
    host = Host(cache)
    a, b = cache.begin_session("a", 2), cache.begin_session("b", 1)
    for _ in range(4):
        host.chunk(a)
        host.chunk(b)
    shape, data, written = pages_of(cache, "a")
    assert any(any(row[1]) for row in [shape[0]])  # the window slid: holes
    pool = cache.allocator.pool
    free = pool.num_free
    freed = offload(cache, a)
    assert freed == sum(not hole for row in shape for hole in row[1]) and pool.num_free == free + freed
    assert cache.worker.registry.snapshot_of("a") is None and a.offloaded is not None  # type: ignore[union-attr]
    for call in (cache.append_chunk, lambda s: offload(cache, s)):
        with pytest.raises(StateError, match="session 'a' is offloaded to host memory"):
            call(a)
    with pytest.raises(StateError, match="session 'a' is offloaded"):
        cache.run_chunk(a, lambda c: None)
    host.chunk(b)  # another session takes (and overwrites) the freed blocks meanwhile
    host.chunk(b)
    assert reload(cache, a) and a.offloaded is None
    new_shape, new_data, new_written = pages_of(cache, "a")
    assert new_shape == shape and new_written == written
    assert all(torch.equal(x, y) for x, y in zip(data, new_data, strict=True))
    for _ in range(3):
        host.chunk(a)  # the stream goes on, equal to dense
    with pytest.raises(StateError, match="session 'a' is not offloaded"):
        reload(cache, a)
    cache.end_session(a)
    cache.end_session(b)
    assert pool.num_free == pool.num_total


def test_reload_waits_for_room_and_refuses_changed_scales() -> None:
    cache = make(num_blocks=16, kv_cache_dtype="fp8_e4m3")
    host = Host(cache)
    a = cache.begin_session("a")
    for _ in range(4):
        host.chunk(a)
    offload(cache, a)
    pool = cache.allocator.pool
    taken = pool.allocate(pool.num_free - 2)
    assert taken is not None
    assert reload(cache, a) is False and a.offloaded is not None and pool.num_free == 2
    pool.free(taken)
    cache.worker.layers["l1"].kv_scales.set(2.0, 1.0)  # type: ignore[union-attr]
    with pytest.raises(StateError, match=r"k_scale/v_scale of layers \['l1'\] changed"):
        reload(cache, a)
    assert a.offloaded is not None and pool.num_free == pool.num_total
    cache.end_session(a)  # drops the host copy
    assert a.offloaded is None and cache.sessions == ()


def test_a_short_pool_offloads_the_least_recently_used_idle_session() -> None:
    cache = make(num_blocks=12)
    cache.on_pool_short = lru_offloader(cache)
    host = Host(cache)
    a, b, c = (cache.begin_session(s) for s in "abc")
    for s in (a, b, c):
        host.chunk(s)  # 2 blocks each
    host.chunk(b)
    host.chunk(c)  # b: 3 blocks, c: 3 blocks, a: 2 (least recently used)
    pool = cache.allocator.pool
    assert pool.num_free == 12 - 8
    d = cache.begin_session("d")
    taken = pool.allocate(3)  # leave 1 free: d's first chunk needs 2
    assert taken is not None
    chunk = cache.append_chunk(d)
    assert chunk is not None
    assert a.offloaded is not None and b.offloaded is None and c.offloaded is None
    cache.abort(chunk)
    pool.free(taken)
    assert reload(cache, a)
    host.chunk(a)  # equal to dense after the round trip
    for s in (a, b, c, d):
        cache.end_session(s)
    assert pool.num_free == pool.num_total


# --- prefix sharing ----------------------------------------------------------------------------


def test_sessions_from_the_same_first_chunk_share_its_blocks() -> None:
    cache = make(prefix=True)
    host = Host(cache)
    starts = SharedStarts(cache, "tiny-model")
    prefix_cache = cache.allocator.prefix_cache
    assert prefix_cache is not None
    with pytest.raises(ValidationError, match="2 shared chunks exceed the sink"):
        starts.begin("x", "first-frame", 2)
    assert cache.sessions == ()

    def write(begun, tag: str) -> None:  # type: ignore[no-untyped-def]
        with cache.worker.stepper() as rt:
            rows = begun.rows()
            rt.ensure_rows(rows)
            host.run_rows(rows, [f"{tag}/b{r.sequence_id}" for r in rows], [0] * len(rows))

    leader = starts.begin("lead", "first-frame", 1)
    assert leader is not None and leader.hit == (0,)
    with pytest.raises(StateError, match="has chunk 0 open"):
        cache.append_chunk(leader.session)
    write(leader, "prefix")
    starts.commit(leader)
    host.keep("lead", 1)
    keys = leader.keys[0]
    assert len(keys) == 1 and prefix_cache.refs(keys[0]) == 1  # 6 tokens: one full block shared
    shared_block = prefix_cache.block_of(keys[0])
    follower = starts.begin("follow", "first-frame", 1)
    assert follower is not None and follower.hit == (4,)
    assert follower.rows() == (PagedRow("follow", 2, 6, 4, sequence_id=0),)
    with cache.worker.stepper() as rt, pytest.raises(ValidationError, match="read-only cached prefix"):
        rt.ensure_rows((PagedRow("follow", 6, 6, 0, sequence_id=0),))  # the shared block is never written
    # the follower's dense history: the leader's first block, then its own [4, 6)
    for layer in LAYERS:
        k, v = host.history("lead", 0, layer)
        host.keys[("follow", 0, layer)] = (k[:4], v[:4])
    write(follower, "prefix")  # same content, same inputs for [4, 6)
    starts.commit(follower)
    for layer in LAYERS:
        hk, hv = host.history("follow", 0, layer)
        sk, sv = host.pending.pop(("follow", 0, layer))
        host.keys[("follow", 0, layer)] = (torch.cat([hk, sk]), torch.cat([hv, sv]))
    assert prefix_cache.refs(keys[0]) == 2
    assert cache.allocator.blocks_of("follow")[0] == shared_block == cache.allocator.blocks_of("lead")[0]
    assert follower.session.committed_tokens == 6 and follower.session.chunks_committed == 1
    for _ in range(3):
        host.chunk(leader.session)
        host.chunk(follower.session)
    cache.end_session(leader.session)
    assert prefix_cache.refs(keys[0]) == 1 and prefix_cache.block_of(keys[0]) == shared_block
    other = cache.begin_session("other", 2)
    for _ in range(2):
        host.chunk(other)  # takes the leader's freed blocks
        host.chunk(follower.session)  # the shared sink block stays, equal to dense
    cache.end_session(other)
    cache.end_session(follower.session)
    pool = cache.allocator.pool
    assert prefix_cache.refs(keys[0]) == 0 and prefix_cache.num_idle == 1
    assert pool.num_free == pool.num_total - 1
    pool.free(prefix_cache.evict(prefix_cache.num_idle))
    assert pool.num_free == pool.num_total


def test_a_shared_start_session_re_caches_into_blocks_of_its_own() -> None:
    """A prompt switch (re-cache) of a session whose first chunk is shared through the prefix
    cache: the shadow takes fresh blocks at the shared places too, and the commit drops the
    session's reference. The other session keeps reading the shared block (dense-equal over the
    old K/V), the re-cached one reads its new K/V, a later session with the same content still
    hits the original block, and the re-cached session never publishes its new K/V under the old
    content's keys. An aborted re-cache leaves the shared state as it was."""
    cache = make(prefix=True)
    host = Host(cache)
    starts = SharedStarts(cache, "tiny-model")
    prefix_cache = cache.allocator.prefix_cache
    assert prefix_cache is not None
    pool = cache.allocator.pool

    first: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # the shared block's K/V per layer

    def begin(sid: str) -> Session:
        begun = starts.begin(sid, "first-frame", 1)
        assert begun is not None
        if begun.hit[0]:  # the dense history of the shared block: the leader's first K/V
            for layer in LAYERS:
                k, v = first[layer]
                host.keys[(sid, 0, layer)] = (k[: begun.hit[0]], v[: begun.hit[0]])
        with cache.worker.stepper() as rt:
            rows = begun.rows()
            rt.ensure_rows(rows)
            host.run_rows(rows, [f"prefix/b{r.sequence_id}" for r in rows], [0] * len(rows))
        starts.commit(begun)
        for layer in LAYERS:
            hk, hv = host.history(sid, 0, layer)
            sk, sv = host.pending.pop((sid, 0, layer))
            host.keys[(sid, 0, layer)] = (torch.cat([hk, sk]), torch.cat([hv, sv]))
        return begun.session

    lead = begin("lead")
    first.update({layer: host.history("lead", 0, layer) for layer in LAYERS})
    follow = begin("follow")
    key = starts.keys("first-frame", 1, 1)[0][0]
    shared_block = prefix_cache.block_of(key)
    assert prefix_cache.refs(key) == 2 and cache.allocator.blocks_of("lead")[0] == shared_block

    aborted = cache.begin_recache(lead)
    assert aborted is not None
    cache.abort_recache(aborted)
    assert prefix_cache.refs(key) == 2 and cache.allocator.blocks_of("lead")[0] == shared_block

    free = pool.num_free
    rc = cache.begin_recache(lead)
    assert rc is not None and rc.spans == ((0, 6),)
    assert pool.num_free == free - 2  # the shadow: a fresh block at each of the 2 live places
    with cache.worker.stepper() as rt:
        rt.ensure_rows(rc.rows())
        host.run_rows(rc.rows(), ["recache/b0"], [0])
    cache.commit_recache(rc)
    for layer in LAYERS:
        host.keys[("lead", 0, layer)] = host.pending.pop((rc.shadow_id, 0, layer))
    # the old private block went back, the shared one stays with the follower
    assert pool.num_free == free - 1
    assert prefix_cache.refs(key) == 1 and prefix_cache.block_of(key) == shared_block
    assert shared_block not in cache.allocator.blocks_of("lead")
    snap = cache.worker.registry.snapshot_of("lead")  # type: ignore[union-attr]
    assert snap is not None and snap.sequences[0].cached_prefix_len == 0
    assert cache.allocator.publish("lead") is None  # no prefix keys any more: nothing to publish
    for _ in range(3):
        host.chunk(lead)  # attends over the re-cached K/V (dense-checked)
        host.chunk(follow)  # still over the original shared block
    third = begin("third")  # the same content hits the original block
    assert cache.allocator.blocks_of("third")[0] == shared_block and prefix_cache.refs(key) == 2
    host.chunk(third)
    for session in (lead, follow, third):
        cache.end_session(session)
    assert prefix_cache.refs(key) == 0 and prefix_cache.num_idle == 1
    assert pool.num_free == pool.num_total - 1
    pool.free(prefix_cache.evict(prefix_cache.num_idle))
    assert pool.num_free == pool.num_total


def test_an_aborted_shared_begin_leaves_nothing() -> None:
    cache = make(prefix=True)
    starts = SharedStarts(cache, "tiny-model")
    begun = starts.begin("s", "frame", 1, branches=2)
    assert begun is not None and begun.hit == (0, 0)
    with pytest.raises(StateError, match=r"branch 0: shared prefix tokens \[\(0, 6\)\] were never written"):
        starts.commit(begun)
    starts.abort(begun)
    with pytest.raises(StateError, match="the shared begin of session 's' is over"):
        starts.commit(begun)
    pool = cache.allocator.pool
    assert cache.sessions == () and pool.num_free == pool.num_total
    assert len(cache.allocator.prefix_cache) == 0  # type: ignore[arg-type]


# --- fp8 windows -------------------------------------------------------------------------------


def test_a_session_stream_on_fp8_pages_matches_dense_over_the_stored_values() -> None:
    cache = make(kv_cache_dtype="fp8_e4m3", k_scale=0.25)
    assert cache.worker.layers["l0"].cache_dtype == torch.float8_e4m3fn
    host = Host(cache)  # checks every row against dense over the dequantised K/V
    a, b = cache.begin_session("a", 2), cache.begin_session("b", 1)
    sched = SessionScheduler(cache)
    left = {"a": 4, "b": 4}
    sched.submit_chunk(a, 2)
    sched.submit_chunk(b, 3)
    while not sched.idle:
        report = sched.step(lambda s: host.session_step(s.sessions))  # type: ignore[arg-type]
        assert report is not None
        for sid, _ in report.committed:
            session = a if sid == "a" else b
            host.keep(sid, session.branches)
            left[sid] -= 1
            if left[sid]:
                sched.submit_chunk(session, 2)
    assert cache.worker.layers["l0"].kv_scales.saturations() == (0, 0)  # type: ignore[union-attr]
    sched.close()
    cache.end_session(a)
    cache.end_session(b)
    assert cache.allocator.pool.num_free == cache.allocator.pool.num_total


def test_a_queued_chunk_of_an_offloaded_session_reloads_it_first() -> None:
    cache = make()
    host = Host(cache)
    a = cache.begin_session("a")
    host.chunk(a)
    offload(cache, a)
    sched = SessionScheduler(cache)
    sched.submit_chunk(a, 1)
    report = sched.step(lambda s: host.session_step(s.sessions))  # type: ignore[arg-type]
    assert report is not None and report.opened == ("a",) and report.committed == (("a", 1),)
    assert a.offloaded is None and a.committed_tokens == 12  # equal to dense after the reload
    sched.close()
    cache.end_session(a)
    assert cache.allocator.pool.num_free == cache.allocator.pool.num_total

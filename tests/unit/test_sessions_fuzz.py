"""Stateful fuzz of sessions: random chunk / commit / abort / failure / end / re-cache (on slid
windows too) / reset / context ops over several sessions on one small pool (pool-short cases
included), and a second fuzz adding offload / reload (explicit and through ``lru_offloader``),
shared starts through the prefix cache and ``SessionScheduler`` steps (failing ones included).
After every op each open, resident session's readable committed KV pages equal its dense
bookkeeping (exact, fp32 on the cpu reference; every step also attends equal to dense under the
mask), and each pool's free count is its total less what live sessions hold (and the prefix
cache's idle blocks); at the end every block is free."""

from __future__ import annotations

import random

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool
from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.prefix_cache import PrefixCache
from diffusion_kv.core.registry import missing_spans
from diffusion_kv.core.sessions import SessionCache, SessionPolicy, SharedStarts
from diffusion_kv.core.sessions.batching import MixedStep, SessionScheduler
from diffusion_kv.core.sessions.offload import lru_offloader, offload, reload
from tests.unit.test_sessions import D, H, Stream
from tests.unit.test_sessions_contexts import make, recache_slid_forward, write_context

POLICY = SessionPolicy(chunk_tokens=6, window_chunks=2, sink_chunks=1)


def check_pages(cache: SessionCache, stream: Stream) -> None:
    """Every readable committed token's K/V in the pages equals the bookkeeping, bit for bit
    (the live ones at least: a re-cache leaves only those readable)."""
    session = stream.session
    if not session.reserved or session.committed_tokens == 0:
        return
    worker = cache.worker
    live = cache.live_row_spans(session)  # row positions: a compacted row sits row_offset lower
    off = session.row_offset
    for b in range(stream.branches):
        binding = worker.resolve(session.session_id, b)
        readable = binding.written
        assert not [g for a, e in live for g in missing_spans(readable, a, e)]
        for name in worker.layers:
            keys, values = key_value_caches(worker.kv_caches[name])
            for start, end in readable:
                for t in range(start, min(end, session.committed_tokens - off)):
                    block = binding.block_ids[0][t // 4]
                    timeline = t if t < cache.compact_from else t + off
                    assert block != NULL_BLOCK
                    assert torch.equal(keys[block, t % 4], stream.keys[b, name][timeline])
                    assert torch.equal(values[block, t % 4], stream.values[b, name][timeline])


def held(cache: SessionCache) -> int:
    return sum(len(cache.allocator.blocks_of(r)) for r in cache.allocator.reserved())


@pytest.mark.parametrize("seed", [0, 1])
def test_random_session_ops_keep_kv_dense_equal_and_the_pool_whole(seed: int) -> None:
    rng = random.Random(seed)
    cache, pool, cpool = make(POLICY, blocks=22, ctx_blocks=8)
    streams: dict[str, Stream] = {}
    serial = 0
    for _ in range(36):
        op = rng.choice(
            ["begin", "chunk", "chunk", "chunk", "abort", "fail", "end", "recache", "reset", "context"]
        )
        open_ = list(streams.values())
        if op == "begin" or not open_:
            if len(streams) < 3:
                serial += 1
                sid = f"s{serial}"
                streams[sid] = Stream(cache, sid, rng.choice([1, 2]), seed=serial)
            continue
        stream = rng.choice(open_)
        session = stream.session
        free = pool.num_free
        if op in ("chunk", "abort", "fail"):
            chunk = cache.append_chunk(session)
            if chunk is None:  # pool short: nothing taken
                assert pool.num_free == free
                continue
            written = stream.step(chunk)
            if op == "chunk":
                cache.commit(chunk)
                stream.keep(written)
            elif op == "abort":
                cache.abort(chunk)
            else:

                def boom(c: object) -> None:
                    raise RuntimeError("model failed")

                cache.abort(chunk)  # the first chunk's reservation goes too; then a failing run
                with pytest.raises(RuntimeError, match="model failed"):
                    cache.run_chunk(session, boom)
            if op != "chunk":
                assert pool.num_free == free and session.open_chunk is None
        elif op == "end":
            cache.end_session(session)
            del streams[session.session_id]
        elif op == "reset":
            cache.reset(session)
            stream.keys = {k: v[:0] for k, v in stream.keys.items()}
            stream.values = {k: v[:0] for k, v in stream.values.items()}
        elif op == "context":
            names = cache.contexts.names(session.session_id)  # type: ignore[union-attr]
            if "text" not in names:
                rows = cache.set_context(session, "text", rng.choice([3, 5]))
                if rows is not None:
                    written_ctx = write_context(cache, rows, seed=rng.randrange(1000))
                    k, _ = cache.context_kv(session, "text", "x0", branch=len(rows) - 1)
                    assert torch.equal(k, written_ctx[-1][0])
        elif op == "recache" and session.committed_tokens:
            rc = cache.begin_recache(session)
            if rc is None:
                assert pool.num_free == free
                continue
            new = recache_slid_forward(stream, rc, seed=rng.randrange(1000))
            if rng.random() < 0.5:
                cache.abort_recache(rc)
            else:
                cache.commit_recache(rc)
                for key, (k, v) in new.items():
                    stream.keys[key], stream.values[key] = k, v
            assert pool.num_free == free
        for s in streams.values():
            check_pages(cache, s)
        assert pool.num_free == pool.num_total - held(cache)
        assert cpool.num_free == cpool.num_total - held(cache.contexts)  # type: ignore[arg-type]
    for stream in list(streams.values()):
        cache.end_session(stream.session)
    assert pool.num_free == pool.num_total and cpool.num_free == cpool.num_total
    assert cache.worker.registry.installed_requests() == ()  # type: ignore[union-attr]


# --- the second fuzz: offload / reload (explicit and LRU), re-cache on slid windows, shared starts,
# SessionScheduler steps -- over one small pool with a prefix cache -----------------------------


def make_shared(blocks: int) -> tuple[SessionCache, FreeListPool, FreeListPool]:
    """``make``'s cache with a prefix cache on the session allocator (shared starts)."""
    cache, _, cpool = make(POLICY, blocks=blocks, ctx_blocks=8)
    pool = FreeListPool(blocks)
    alloc = DiffusionKVAllocator(
        block_size=4,
        max_model_len=96,
        max_rows_per_request=2,
        worker_rows=4,
        pool=pool,
        prefix_cache=PrefixCache(),
    )
    return SessionCache(cache.worker, alloc, POLICY, contexts=cache.contexts), pool, cpool


def distinct_held(cache: SessionCache) -> int:
    return len({b for r in cache.allocator.reserved() for b in cache.allocator.blocks_of(r)})


def scheduler_op(cache: SessionCache, streams: dict[str, Stream], rng: random.Random) -> None:
    """Chunks of some sessions through a SessionScheduler (one forward per layer over every open
    chunk's rows, each checked against dense), stepped until idle; a failing step sometimes."""
    sched = SessionScheduler(cache)
    picked = [s for s in streams.values() if s.session.open_chunk is None and rng.random() < 0.7]
    for stream in picked:
        sched.submit_chunk(stream.session, rng.choice([1, 2]))
    pending: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
    fail_at = rng.choice([None, None, 0, 1])
    tick = 0

    def fn(step: MixedStep) -> None:
        batch = step.sessions
        assert batch is not None
        if tick == fail_at:
            raise RuntimeError("the model failed")
        for name in cache.worker.layers:
            q, k, v = (torch.randn(batch.num_tokens, H, D, generator=rng_t) for _ in range(3))
            out = cache.worker.forward(name, q, k, v)
            for e in batch.entries:
                stream, chunk = streams[e.session_id], e.chunk
                for b in range(chunk.branches):
                    part = slice(e.token_offset + b * chunk.tokens, e.token_offset + (b + 1) * chunk.tokens)
                    keys = torch.cat([stream.keys[b, name], k[part]])
                    values = torch.cat([stream.values[b, name], v[part]])
                    mask = cache.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
                    ref = dense_attention(q[part], keys, values, mask, D**-0.5)
                    torch.testing.assert_close(out[part].double(), ref, atol=1e-5, rtol=1e-5)
                    pending.setdefault(e.session_id, {})[b, name] = (k[part], v[part])

    rng_t = torch.Generator().manual_seed(rng.randrange(1 << 30))
    while not sched.idle:
        report = sched.step(fn)
        tick += 1
        if report is None or (not report.session_rows and sched.waiting):
            for sid in sched.waiting:  # waits for blocks nothing running could free
                assert sched.cancel(streams[sid].session)
            break
        for sid, _ in report.committed:
            streams[sid].keep(pending.pop(sid))
        for sid, _, why in report.aborted:
            assert why == "RuntimeError: the model failed"
            pending.pop(sid, None)
    sched.close()


OPS = (
    ["chunk"] * 5
    + ["sched"] * 2
    + ["recache"] * 2
    + ["reload"] * 2
    + ["begin", "shared", "abort", "end", "offload", "lru", "context"]
)


@pytest.mark.parametrize(
    ("seed", "covers"),
    [
        (2, {"lru_offloaded", "offload", "reload", "sched", "shared", "chunk"}),
        (7, {"recache_slid", "offload", "reload", "sched", "shared", "abort"}),
        (9, {"recache_shared", "recache_slid", "offload", "reload", "shared", "end"}),
    ],
)
def test_random_ops_with_offload_recache_shared_starts_and_scheduler_steps(
    seed: int, covers: set[str]
) -> None:
    rng = random.Random(seed)
    cache, pool, cpool = make_shared(blocks=20)
    cache.on_pool_short = lru_offloader(cache)
    prefix = cache.allocator.prefix_cache
    assert prefix is not None
    starts = SharedStarts(cache, "fuzz-model")
    streams: dict[str, Stream] = {}
    shared: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # published prefix K/V
    serial = 0
    counts: dict[str, int] = {}
    for _ in range(50):
        op = rng.choice(OPS)
        before_offloaded = {s for s, st in streams.items() if st.session.offloaded is not None}
        live = [s for s in streams.values() if s.session.offloaded is None]
        offloaded = [s for s in streams.values() if s.session.offloaded is not None]
        if op in ("begin", "shared") or not streams:
            if len(streams) >= 3:
                continue
            serial += 1
            sid, branches = f"s{serial}", rng.choice([1, 2])
            if op == "begin" or not streams:
                streams[sid] = Stream(cache, sid, branches, seed=serial)
            else:
                content = rng.choice(["frame-a", "frame-b"])
                free = pool.num_free
                begun = starts.begin(sid, content, 1, branches)
                if begun is None:
                    assert pool.num_free == free and sid not in cache.sessions
                    continue
                stream = streams[sid] = Stream.__new__(Stream)
                stream.cache, stream.branches, stream.session = cache, branches, begun.session
                stream.gen = torch.Generator().manual_seed(serial)
                stream.keys, stream.values = {}, {}
                rows = begun.rows()
                gen = torch.Generator().manual_seed(1000 + serial)
                written: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
                with cache.worker.stepper() as runtime:
                    if rows:
                        runtime.ensure_rows(rows)
                    for name in cache.worker.layers:
                        n = sum(r.query_len for r in rows)
                        q, k, v = (torch.randn(n, H, D, generator=gen) for _ in range(3))
                        if rows:
                            cache.worker.forward(name, q, k, v)
                        offset = 0
                        for b in range(branches):
                            hit = begun.hit[b]
                            mine = (k[offset : offset + 6 - hit], v[offset : offset + 6 - hit])
                            offset += 6 - hit
                            head = shared[content, b, name] if hit else (mine[0][:0], mine[1][:0])
                            written[b, name] = (
                                torch.cat([head[0][:hit], mine[0]]),
                                torch.cat([head[1][:hit], mine[1]]),
                            )
                starts.commit(begun)
                for (b, name), (k, v) in written.items():
                    stream.keys[b, name], stream.values[b, name] = k, v
                    if begun.hit[b] == 0:  # this session published the full block
                        shared[content, b, name] = (k[:4], v[:4])
            counts[op] = counts.get(op, 0) + 1
        elif op == "reload":
            if not offloaded:
                continue
            stream = rng.choice(offloaded)
            free = pool.num_free
            if not reload(cache, stream.session):
                assert pool.num_free == free and stream.session.offloaded is not None
            else:
                counts[op] = counts.get(op, 0) + 1
        elif op == "lru":
            cache.on_pool_short = None if cache.on_pool_short is not None else lru_offloader(cache)
        elif op == "sched":
            scheduler_op(cache, streams, rng)
            counts[op] = counts.get(op, 0) + 1
        elif not live:
            continue
        else:
            stream = rng.choice(live)
            session = stream.session
            free = pool.num_free
            if op in ("chunk", "abort"):
                chunk = cache.append_chunk(session)  # may offload an idle session (LRU hook)
                if chunk is None:
                    continue
                written = stream.step(chunk)
                if op == "chunk":
                    cache.commit(chunk)
                    stream.keep(written)
                else:
                    cache.abort(chunk)
                counts[op] = counts.get(op, 0) + 1
            elif op == "end":
                cache.end_session(session)
                del streams[session.session_id]
            elif op == "offload":
                if not session.reserved or not session.committed_tokens:
                    continue
                back = offload(cache, session)
                assert back > 0 and session.offloaded is not None
                counts[op] = counts.get(op, 0) + 1
            elif op == "context":
                if "text" not in cache.contexts.names(session.session_id):  # type: ignore[union-attr]
                    ctx_rows = cache.set_context(session, "text", rng.choice([3, 5]))
                    if ctx_rows is not None:
                        write_context(cache, ctx_rows, seed=rng.randrange(1000))
            elif op == "recache" and session.committed_tokens:
                snapshot = cache.worker.registry.snapshot_of(session.session_id)  # type: ignore[union-attr]
                # a shared start: the commit gives the session private blocks where it shared
                shared_blocks = (
                    sum(s.cached_prefix_len // cache.allocator.block_size for s in snapshot.sequences)
                    if snapshot is not None
                    else 0
                )
                rc = cache.begin_recache(session)
                if rc is None:
                    assert pool.num_free == free
                    continue
                new = recache_slid_forward(stream, rc, seed=rng.randrange(1000))
                if rng.random() < 0.3:
                    cache.abort_recache(rc)
                    assert pool.num_free == free
                else:
                    cache.commit_recache(rc)
                    for key, (k, v) in new.items():
                        stream.keys[key], stream.values[key] = k, v
                    kind = (
                        "recache_shared"
                        if shared_blocks
                        else ("recache_slid" if len(rc.spans) > 1 or rc.spans[0][0] else op)
                    )
                    counts[kind] = counts.get(kind, 0) + 1
                    assert pool.num_free == free - shared_blocks
        if op in ("chunk", "abort", "sched") and any(
            st.session.offloaded is not None for s, st in streams.items() if s not in before_offloaded
        ):
            counts["lru_offloaded"] = counts.get("lru_offloaded", 0) + 1
        for s in streams.values():
            if s.session.offloaded is None:
                check_pages(cache, s)
        assert pool.num_free == pool.num_total - distinct_held(cache) - prefix.num_idle
        assert cpool.num_free == cpool.num_total - held(cache.contexts)  # type: ignore[arg-type]
    for stream in list(streams.values()):
        cache.end_session(stream.session)
    pool.free(prefix.evict(prefix.num_idle))  # idle shared blocks stay cached until evicted
    assert pool.num_free == pool.num_total and cpool.num_free == cpool.num_total
    assert cache.worker.registry.installed_requests() == ()  # type: ignore[union-attr]
    assert covers <= counts.keys(), counts  # the ops this seed is kept for happened

"""Stateful fuzz of sessions: random chunk / commit / abort / failure / end / re-cache / reset /
context ops over several sessions on one small pool (pool-short cases included). After every op
each open session's committed KV pages equal its dense bookkeeping (exact, fp32 on the cpu
reference; every step also attends equal to dense under the mask), and each pool's free count is
its total less what live sessions hold; at the end every block is free."""

from __future__ import annotations

import random

import pytest
import torch

from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.registry import missing_spans
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from tests.unit.test_sessions import Stream
from tests.unit.test_sessions_contexts import make, recache_slid_forward, write_context

POLICY = SessionPolicy(chunk_tokens=6, window_chunks=2, sink_chunks=1)


def check_pages(cache: SessionCache, stream: Stream) -> None:
    """Every readable committed token's K/V in the pages equals the bookkeeping, bit for bit
    (the live ones at least: a re-cache leaves only those readable)."""
    session = stream.session
    if not session.reserved or session.committed_tokens == 0:
        return
    worker = cache.worker
    live = cache.live_spans(session)
    for b in range(stream.branches):
        binding = worker.resolve(session.session_id, b)
        readable = binding.written
        assert not [g for a, e in live for g in missing_spans(readable, a, e)]
        for name in worker.layers:
            keys, values = key_value_caches(worker.kv_caches[name])
            for start, end in readable:
                for t in range(start, min(end, session.committed_tokens)):
                    block = binding.block_ids[0][t // 4]
                    assert block != NULL_BLOCK
                    assert torch.equal(keys[block, t % 4], stream.keys[b, name][t])
                    assert torch.equal(values[block, t % 4], stream.values[b, name][t])


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

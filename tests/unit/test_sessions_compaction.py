"""Row compaction (``RowRegistry.compact``, ``DiffusionKVAllocator.compact``, ``SessionCache``'s
commit): a long session's rows drop the released places past the sink, so a stream runs far past
``max_model_len`` with its rows as long as its live keys, every chunk still equal to dense
attention over the whole history on the host's timeline; and the refusals, which change nothing."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.errors import GenerationError, StateError, ValidationError
from diffusion_kv.core.registry import RowTransition
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from diffusion_kv.core.sessions.batching import MixedStep, SessionScheduler
from diffusion_kv.core.sessions.offload import offload, reload
from tests.unit.test_sessions import BLOCK, D, H, Stream, make
from tests.unit.test_sessions_contexts import make as make_with_contexts
from tests.unit.test_sessions_contexts import recache_slid_forward
from tests.unit.test_sessions_fuzz import check_pages

POLICY = SessionPolicy(chunk_tokens=6, window_chunks=2, sink_chunks=1)  # chunks straddle blocks


def row_of(cache: SessionCache, sid: str) -> tuple[int, ...]:
    snapshot = cache.worker.registry.snapshot_of(sid)  # type: ignore[union-attr]
    assert snapshot is not None
    return snapshot.sequences[0].block_ids[0]


def state(cache: SessionCache, sid: str) -> tuple[object, ...]:
    registry = cache.worker.registry
    assert registry is not None
    snapshot = registry.snapshot_of(sid)
    assert snapshot is not None
    return (
        snapshot.sequences,
        tuple(registry.written_spans((sid, s.sequence_id, None)) for s in snapshot.sequences),
        cache.worker.block_tables.block_tables[0].gpu.clone(),  # type: ignore[union-attr]
        cache.allocator.pool.num_free,
    )


def test_a_stream_runs_past_max_model_len_with_rows_as_long_as_its_live_keys() -> None:
    cache, pool = make(num_blocks=40, policy=POLICY)
    assert cache.allocator.max_model_len == 96
    assert (cache.compact_from, cache.compact_tokens) == (8, 24)  # sink 6 -> 2 blocks; lcm(6, 4) x 2
    stream = Stream(cache, "s", branches=2, seed=3)
    lengths = []
    for i in range(30):  # 180 tokens on the timeline, every step checked against dense over it
        stream.chunk(steps=2)
        lengths.append(len(row_of(cache, "s")))
        if i == 12:  # an aborted chunk after compactions: the session exactly as before
            before = state(cache, "s")
            chunk = cache.append_chunk(stream.session)
            assert chunk is not None and chunk.start == 78 and chunk.row_offset == stream.session.row_offset
            stream.step(chunk)
            cache.abort(chunk)
            after = state(cache, "s")
            assert after[:2] == before[:2] and after[3] == before[3]  # rows, readable spans, pool
        check_pages(cache, stream)
    session = stream.session
    assert session.committed_tokens == 180 and session.row_offset == 144
    # the row holds the sink's 2 places, at most compact_tokens of released places, the window and
    # the chunk: never more than 2 + 6 + 5 places, however long the stream ran
    assert max(lengths) <= 2 + 6 + 5 and lengths[-1] == (180 - 144) // BLOCK
    assert row_of(cache, "s")[:2] == tuple(cache.allocator.blocks_of("s")[:2])  # the sink never moved
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_a_compacted_session_offloads_reloads_and_recaches_on_the_timeline() -> None:
    cache, pool, _ = make_with_contexts(POLICY, blocks=30)
    stream = Stream(cache, "s", branches=2, seed=5)
    for _ in range(10):
        stream.chunk(steps=1)
    session = stream.session
    assert session.row_offset == 24 and cache.live_spans(session) == ((0, 6), (48, 60))
    assert cache.live_row_spans(session) == ((0, 6), (24, 36))
    offload(cache, session)
    assert reload(cache, session)
    check_pages(cache, stream)
    stream.chunk(steps=1)  # equal to dense after the round trip
    rc = cache.begin_recache(session)
    assert session.row_offset == 24
    assert rc is not None and rc.spans == ((0, 6), (54, 66)) and rc.row_spans == ((0, 6), (30, 42))
    new = recache_slid_forward(stream, rc, seed=6)  # checked against dense on the timeline
    cache.commit_recache(rc)
    for key, (k, v) in new.items():
        stream.keys[key], stream.values[key] = k, v
    check_pages(cache, stream)
    for _ in range(6):
        stream.chunk(steps=1)
    assert session.row_offset > 24
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_compacted_sessions_batch_through_the_scheduler() -> None:
    cache, pool = make(num_blocks=40, policy=POLICY)
    streams = {sid: Stream(cache, sid, branches=1, seed=n) for n, sid in enumerate(("a", "b"))}
    for _ in range(8):
        streams["a"].chunk(steps=1)  # "a" compacted, "b" fresh: different row offsets in one batch
    assert streams["a"].session.row_offset > 0 and streams["b"].session.row_offset == 0
    sched = SessionScheduler(cache)
    gen = torch.Generator().manual_seed(9)
    pending: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}

    def fn(step: MixedStep) -> None:
        batch = step.sessions
        assert batch is not None
        for name in cache.worker.layers:
            q, k, v = (torch.randn(batch.num_tokens, H, D, generator=gen) for _ in range(3))
            out = cache.worker.forward(name, q, k, v)
            for e in batch.entries:
                stream, chunk = streams[e.session_id], e.chunk
                part = slice(e.token_offset, e.token_offset + chunk.tokens)
                keys = torch.cat([stream.keys[0, name], k[part]])
                values = torch.cat([stream.values[0, name], v[part]])
                mask = cache.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
                ref = stream_ref(q[part], keys, values, mask)
                torch.testing.assert_close(out[part].double(), ref, atol=1e-5, rtol=1e-5)
                pending.setdefault(e.session_id, {})[0, name] = (k[part], v[part])

    for _ in range(9):
        for stream in streams.values():
            sched.submit_chunk(stream.session, 2)
        while not sched.idle:
            report = sched.step(fn)
            assert report is not None
            for sid, _ in report.committed:
                streams[sid].keep(pending.pop(sid))
    assert streams["b"].session.row_offset > 0
    for stream in streams.values():
        cache.end_session(stream.session)
    assert pool.num_free == pool.num_total


def stream_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from diffusion_kv.conformance.reference import dense_attention

    return dense_attention(q, k, v, mask, D**-0.5)


def _compactable(cache: SessionCache) -> Stream:
    stream = Stream(cache, "s", branches=1, seed=11)
    for _ in range(6):
        stream.chunk(steps=1)
    return stream


def test_the_registry_refuses_a_compaction_that_would_change_what_a_query_sees_and_changes_nothing() -> None:
    from dataclasses import replace

    from diffusion_kv.core.allocation import RequestAllocation

    cache, _ = make(num_blocks=40, policy=POLICY)
    cache.compact_tokens = None  # compaction by hand below
    stream = _compactable(cache)
    registry, worker, alloc = cache.worker.registry, cache.worker, cache.allocator
    assert registry is not None
    row = row_of(cache, "s")
    # 36 tokens; [8, 24) released (places 2..5), the sink's places 0-1 and [24, 36) held
    assert row[2:6] == (NULL_BLOCK,) * 4 and NULL_BLOCK not in row[6:] and len(row) == 9
    assert registry.written_spans(("s", 0, None)) == ((0, 8), (24, 36))
    current = registry.snapshot_of("s")
    assert current is not None
    seq = current.sequences[0]

    def cut(at: int, tokens: int, gen: int | None = None) -> RequestAllocation:
        ids = seq.block_ids[0]
        first, n = at // BLOCK, tokens // BLOCK
        kept = ids[:first] + ids[first + n :]
        return replace(
            current,
            allocation_generation=current.allocation_generation + 1 if gen is None else gen,
            sequences=(
                replace(
                    seq, seq_len=seq.seq_len - tokens, target_len=seq.target_len - tokens, block_ids=(kept,)
                ),
            ),
        )

    good = cut(8, 12)
    bad = replace(good, sequences=(replace(good.sequences[0], target_len=good.sequences[0].target_len + 1),))
    before = state(cache, "s")
    cases = [
        ((good, 8, 6), ValidationError, r"\[8, 14\) is not whole blocks of group 0 \(4 tokens per block\)"),
        ((cut(8, 8), 8, 8), ValidationError, r"8 tokens is not whole chunks of group 0's mask chunk_causal"),
        ((cut(4, 12), 4, 12), ValidationError, r"pins its first 6 tokens \(the sink\); tokens from 4"),
        ((cut(8, 24), 8, 24), ValidationError, r"places 2\.\.7 must all be released"),
        ((cut(8, 12, gen=current.allocation_generation), 8, 12), GenerationError, r"is not newer"),
        ((bad, 8, 12), ValidationError, r"the new snapshot must be the row less \[8, 20\)"),
        ((good, 8, 0), ValidationError, r"positive token count"),
    ]
    for (snapshot, at, tokens), error, message in cases:
        with pytest.raises(error, match=message):
            worker.compact(snapshot, at, tokens)
        after = state(cache, "s")
        assert after[:2] == before[:2] and torch.equal(after[2], before[2])  # type: ignore[arg-type]
    with pytest.raises(StateError, match="'nobody', which is not installed"):
        registry.compact(RequestAllocation("nobody", 99, ()), 8, 12)
    # the allocator refuses the same way, and an install that fails leaves it unchanged
    with pytest.raises(ValidationError, match="whole blocks of 4 tokens"):
        alloc.compact("s", 8, 6)
    with pytest.raises(ValidationError, match=r"tokens \[12, 36\) must be released places"):
        alloc.compact("s", 12, 24)
    with pytest.raises(ValidationError, match="'nobody', which is not reserved"):
        alloc.compact("nobody", 8, 12)

    def failing(snapshot: RequestAllocation) -> None:
        raise RuntimeError("the worker refused")

    generation = alloc.generation
    with pytest.raises(RuntimeError, match="the worker refused"):
        alloc.compact("s", 8, 12, install=failing)
    assert alloc.generation == generation
    # the legal cut, from the allocator's unchanged record: two chunks, three places
    snapshot = alloc.compact("s", 8, 12, install=lambda s: worker.compact(s, 8, 12))
    assert registry.last_transitions == {RowTransition.COMPACT}
    assert snapshot.sequences == good.sequences and snapshot.sequences[0].block_ids[0] == row[:2] + row[5:]
    assert registry.written_spans(("s", 0, None)) == ((0, 8), (12, 24))  # [24, 36) moved down by 12
    stream.session.row_offset = 12  # what SessionCache._compact records after the cut
    check_pages(cache, stream)
    stream.chunk(steps=1)  # equal to dense on the timeline
    cache.end_session(stream.session)


def test_compact_tokens_takes_whole_chunks_and_blocks_and_none_keeps_absolute_rows() -> None:
    from diffusion_kv.core.allocator import AdmissionError

    cache, pool = make(num_blocks=40, policy=POLICY)
    assert cache.compact_unit == 12 and cache.compact_tokens == 24
    for bad in (0, 18, 6, -12, 12.0, True):
        with pytest.raises(
            ValidationError, match=r"positive multiple of 12 \(whole chunks of 6 and blocks of 4\)"
        ):
            cache.compact_tokens = bad  # type: ignore[assignment]
        assert cache.compact_tokens == 24  # unchanged
    cache.compact_tokens = 36
    assert cache.compact_tokens == 36
    cache.compact_tokens = None  # rows at absolute positions: max_model_len (96) bounds the stream
    stream = Stream(cache, "s", branches=1, seed=13)
    for _ in range(16):
        stream.chunk(steps=1)
    assert stream.session.row_offset == 0 and stream.session.committed_tokens == 96
    with pytest.raises(AdmissionError, match="102 tokens exceed max_model_len 96"):
        cache.append_chunk(stream.session)
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total
    unbounded, _ = make(num_blocks=40, policy=SessionPolicy(chunk_tokens=6))
    assert unbounded.compact_tokens is None
    with pytest.raises(ValidationError, match="releases nothing to compact"):
        unbounded.compact_tokens = 12

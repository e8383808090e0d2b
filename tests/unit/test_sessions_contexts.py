"""Sessions: cross-attention contexts, re-cache (shadow row + REPLACE), reset_at_boundary and
reset, on the cpu reference, against dense bookkeeping."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.registry import RowTransition
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import SessionCache, SessionContexts, SessionPolicy
from diffusion_kv.core.sessions.cache import RecachePass
from diffusion_kv.platforms.cpu import CpuPlatform
from tests.unit.test_sessions import BLOCK, D, H, Stream

UNBOUNDED = SessionPolicy(chunk_tokens=6)


def make(
    policy: SessionPolicy = UNBOUNDED, blocks: int = 40, ctx_blocks: int = 12
) -> tuple[SessionCache, FreeListPool, FreeListPool]:
    worker = PagedWorker(CpuPlatform(), RunnerConfig(96, 2, 4, 96, device="cpu"))
    worker.register_kv_cache_layers(
        {f"l{i}": PagedLayerSpec(H, H, D, torch.float32, mode=policy.mask) for i in range(2)}
    )
    worker.initialize_kv_cache(num_blocks=blocks, block_size=BLOCK)
    pool = FreeListPool(blocks)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=96, max_rows_per_request=2, worker_rows=4, pool=pool
    )
    cw = PagedWorker(CpuPlatform(), RunnerConfig(32, 2, 4, 64, device="cpu"))
    cw.register_kv_cache_layers({"x0": PagedLayerSpec(H, H, D, torch.float32, mode=AttentionMode.FULL)})
    cw.initialize_kv_cache(num_blocks=ctx_blocks, block_size=BLOCK)
    cpool = FreeListPool(ctx_blocks)
    calloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=32, max_rows_per_request=2, worker_rows=4, pool=cpool
    )
    return SessionCache(worker, alloc, policy, contexts=SessionContexts(cw, calloc)), pool, cpool


def write_context(cache: SessionCache, rows: tuple, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(seed)
    worker = cache.contexts.worker  # type: ignore[union-attr]
    T = sum(r.query_len for r in rows)
    k, v = torch.randn(T, H, D, generator=gen), torch.randn(T, H, D, generator=gen)
    with worker.stepper() as runtime:
        runtime.ensure_rows(rows)
        worker.forward("x0", k, k, v)
    n = rows[0].query_len
    return [(k[b * n : (b + 1) * n], v[b * n : (b + 1) * n]) for b in range(len(rows))]


def test_a_context_is_written_once_read_from_its_pages_and_released_with_the_session() -> None:
    cache, _, cpool = make()
    stream = Stream(cache, "s", branches=2, seed=0)
    rows = cache.set_context(stream.session, "text", 5)
    assert rows is not None and [(r.query_len, r.sequence_id) for r in rows] == [(5, 0), (5, 1)]
    assert cpool.num_free == 12 - 4  # 5 tokens -> 2 blocks per branch
    with pytest.raises(
        StateError, match=r"context 'text' of session 's': \(branch, tokens\) \[\(0, \(\(0, 5\),\)\), \(1"
    ):
        cache.context_kv(stream.session, "text", "x0")
    written = write_context(cache, rows, seed=1)
    for b in range(2):
        k, v = cache.context_kv(stream.session, "text", "x0", branch=b)
        assert torch.equal(k, written[b][0]) and torch.equal(v, written[b][1])
    with pytest.raises(StateError, match="written already"):
        cache.set_context(stream.session, "text", 5)
    assert cpool.num_free == 8
    stream.chunk()  # the session runs on; contexts stay
    assert cache.context_rows(stream.session, "text") == rows
    cache.end_session(stream.session)
    assert cpool.num_free == cpool.num_total and cache.contexts.worker.registry.installed_requests() == ()  # type: ignore[union-attr]


def test_a_short_context_pool_takes_nothing_and_no_contexts_is_a_state_error() -> None:
    cache, _, cpool = make(ctx_blocks=5)
    assert cache.set_context(cache.begin_session("x"), "text", 5) is not None  # 2 blocks
    session = cache.begin_session("s", branches=2)
    assert cache.set_context(session, "text", 5) is None and cpool.num_free == 3  # needs 4
    bare = SessionCache(cache.worker, cache.allocator, UNBOUNDED)
    with pytest.raises(StateError, match="has no cross-attention contexts"):
        bare.set_context(bare.begin_session("t"), "text", 4)


def recache_forward(stream: Stream, recache, seed: int) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """The host's one forward over the re-cache rows: new K/V for every committed token."""
    gen = torch.Generator().manual_seed(seed)
    n, out = recache.tokens, {}
    worker = stream.cache.worker
    with worker.stepper() as runtime:
        runtime.ensure_rows(recache.rows())
        for name in worker.layers:
            q, k, v = (torch.randn(n * recache.branches, H, D, generator=gen) for _ in range(3))
            worker.forward(name, q, k, v)
            for b in range(recache.branches):
                out[b, name] = (k[b * n : (b + 1) * n], v[b * n : (b + 1) * n])
    return out


def test_a_recache_commits_atomically_and_an_abort_leaves_everything_bit_exact() -> None:
    cache, pool, cpool = make()
    stream = Stream(cache, "s", branches=2, seed=2)
    write_context(cache, cache.set_context(stream.session, "text", 5), seed=3)  # type: ignore[arg-type]
    for _ in range(3):
        stream.chunk()
    old_k = cache.context_kv(stream.session, "text", "x0")
    registry = cache.worker.registry
    before = (registry.snapshot_of("s").sequences, pool.num_free, cpool.num_free)  # type: ignore[union-attr]
    # abort: nothing of the shadow or the staged context stays
    rc = cache.begin_recache(stream.session, {"text": 7})
    assert rc is not None and rc.tokens == 18 and pool.num_free == before[1] - 2 * 5
    with pytest.raises(StateError, match="has a re-cache open"):
        cache.append_chunk(stream.session)
    with pytest.raises(StateError, match=r"branch 0: tokens \[\(0, 18\)\] were never written"):
        cache.commit_recache(rc)
    recache_forward(stream, rc, seed=4)
    cache.abort_recache(rc)
    assert (registry.snapshot_of("s").sequences, pool.num_free, cpool.num_free) == before  # type: ignore[union-attr]
    assert all(
        torch.equal(a, b) for a, b in zip(cache.context_kv(stream.session, "text", "x0"), old_k, strict=True)
    )
    stream.chunk()  # still equal to dense over the old KV
    # commit: the new KV and context are what later chunks read
    rc = cache.begin_recache(stream.session, {"text": 7})
    assert rc is not None
    new = recache_forward(stream, rc, seed=5)
    with pytest.raises(StateError, match="staged context 'text'"):
        cache.commit_recache(rc)
    ctx = write_context(cache, cache.recache_context_rows(rc, "text"), seed=6)
    cache.commit_recache(rc)
    assert registry.last_transitions == {RowTransition.REPLACE}
    for key, (k, v) in new.items():
        stream.keys[key], stream.values[key] = k, v
    assert torch.equal(cache.context_kv(stream.session, "text", "x0", branch=1)[0], ctx[1][0])
    assert (
        pool.num_free == pool.num_total - 2 * 6 and cpool.num_free == cpool.num_total - 4
    )  # 24 tokens; 7 tokens
    stream.chunk()  # equal to dense over the re-cached KV
    with pytest.raises(StateError, match="is not open"):
        cache.abort_recache(rc)
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total and cpool.num_free == cpool.num_total


def recache_slid_forward(
    stream: Stream, recache: RecachePass, seed: int, check: bool = True
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The host's forwards over a re-cache pass (sink, then window): new K/V for every live
    token, each forward's output checked against dense attention over the live keys (the new
    K/V; the mask with ``live_from``). Returns ``(branch, layer) -> (keys, values)`` over
    ``[0, tokens)`` with the new K/V at the live places and the old ones elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    worker, mask = stream.cache.worker, stream.cache.mask
    out = {key: (stream.keys[key].clone(), stream.values[key].clone()) for key in stream.keys}
    for (a, b), rows in zip(recache.spans, recache.forwards(), strict=True):  # timeline spans, rows
        n = b - a
        with worker.stepper() as runtime:
            runtime.ensure_rows(rows)
            for name in worker.layers:
                q, k, v = (torch.randn(n * recache.branches, H, D, generator=gen) for _ in range(3))
                got = worker.forward(name, q, k, v)
                for br in range(recache.branches):
                    part = slice(br * n, (br + 1) * n)
                    keys, values = out[br, name]
                    keys[a:b], values[a:b] = k[part], v[part]
                    if check:
                        visible = mask.row_mask(a, n, b, live_from=a)
                        ref = dense_attention(q[part], keys[:b], values[:b], visible, D**-0.5)
                        torch.testing.assert_close(got[part].double(), ref, atol=1e-5, rtol=1e-5)
    return out


@pytest.mark.parametrize("branches", [1, 2])
def test_a_recache_after_the_window_slid_recomputes_the_live_keys_over_the_live_keys(branches: int) -> None:
    policy = SessionPolicy(chunk_tokens=6, window_chunks=1, sink_chunks=1)  # chunks straddle blocks
    cache, pool, _ = make(policy)
    stream = Stream(cache, "s", branches=branches, seed=7)
    for _ in range(4):
        stream.chunk()
    registry = cache.worker.registry
    assert registry is not None
    row = registry.snapshot_of("s").sequences[0].block_ids[0]  # type: ignore[union-attr]
    assert [p for p, b in enumerate(row) if b == NULL_BLOCK] == [2, 3]  # [8, 16) slid out
    assert cache.live_spans(stream.session) == ((0, 6), (18, 24))
    before = (registry.snapshot_of("s"), pool.num_free, registry.written_spans(("s", 0, None)))
    rc = cache.begin_recache(stream.session)
    assert rc is not None and rc.spans == ((0, 6), (18, 24))
    assert pool.num_free == before[1] - 4 * branches  # a fresh block at each live place (0, 1, 4, 5)
    assert [[(r.kv_start_pos, r.query_len, r.seq_len, r.live_from) for r in f] for f in rc.forwards()] == [
        [(0, 6, 6, 0)] * branches,
        [(18, 6, 24, 18)] * branches,
    ]
    with pytest.raises(StateError, match=r"in 2 forwards: run pass.forwards\(\) in order"):
        rc.rows()
    # the window's forward reads the sink: before the sink's forward wrote it, provenance refuses
    with (
        pytest.raises(StateError, match=r"would read tokens \[\(0, 6\)\]"),
        cache.worker.stepper() as runtime,
    ):
        runtime.ensure_rows(rc.forwards()[1])
    with pytest.raises(StateError, match=r"branch 0: tokens \[\(0, 6\), \(18, 24\)\] were never written"):
        cache.commit_recache(rc)
    recache_slid_forward(stream, rc, seed=20)
    cache.abort_recache(rc)  # the old KV bit for bit, the shadow's blocks back
    assert (registry.snapshot_of("s"), pool.num_free, registry.written_spans(("s", 0, None))) == before
    stream.chunk()  # still dense-equal over the old KV
    rc = cache.begin_recache(stream.session)
    assert rc is not None and rc.spans == ((0, 6), (24, 30))
    new = recache_slid_forward(stream, rc, seed=21)
    cache.commit_recache(rc)
    assert registry.last_transitions == {RowTransition.REPLACE}
    # only the live tokens stay readable (a straddled block's dead tokens were not recomputed)
    assert registry.written_spans(("s", 0, None)) == ((0, 6), (24, 30))
    for key, (k, v) in new.items():
        stream.keys[key], stream.values[key] = k, v
    assert stream.session.committed_tokens == 30 and pool.num_free == pool.num_total - 4 * branches
    for _ in range(3):  # later chunks: equal to dense whose history is the re-cached K/V
        stream.chunk()
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total


def test_a_recache_without_a_sink_is_one_forward_from_the_window_and_reset_at_boundary_keeps_the_sink() -> (
    None
):
    cache, pool, _ = make(SessionPolicy(chunk_tokens=6, window_chunks=1))
    stream = Stream(cache, "s", branches=1, seed=22)
    for _ in range(3):
        stream.chunk()
    # the row was compacted at the third commit (12 released tokens: the chunk and block
    # multiple that reaches the 12 live keys), so its window sits 12 lower in the row
    assert stream.session.row_offset == 12 and cache.live_row_spans(stream.session) == ((0, 6),)
    rc = cache.begin_recache(stream.session)
    assert rc is not None and rc.spans == ((12, 18),) and rc.row_spans == ((0, 6),)
    assert [(r.kv_start_pos, r.live_from) for r in rc.rows()] == [(0, 0)]
    new = recache_slid_forward(stream, rc, seed=23)
    cache.commit_recache(rc)
    for key, (k, v) in new.items():
        stream.keys[key], stream.values[key] = k, v
    stream.chunk()
    cache.end_session(stream.session)
    # reset_at_boundary: only the sink is live
    cache, pool, _ = make(SessionPolicy(chunk_tokens=8, sink_chunks=1, reset_at_boundary=True))
    stream = Stream(cache, "s", branches=1, seed=24)
    for _ in range(3):
        stream.chunk()
    rc = cache.begin_recache(stream.session)
    assert rc is not None and rc.spans == ((0, 8),) and rc.rows()[0].live_from == 0
    new = recache_slid_forward(stream, rc, seed=25)
    cache.commit_recache(rc)
    for key, (k, v) in new.items():
        stream.keys[key], stream.values[key] = k, v
    stream.chunk()
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total
    with pytest.raises(StateError, match="no committed KV"):
        cache.begin_recache(cache.begin_session("t"))


def test_live_from_is_refused_without_a_window_and_by_a_backend_that_does_not_declare_it() -> None:
    from dataclasses import replace

    from diffusion_kv.core.errors import UnsupportedFeatureError
    from diffusion_kv.core.rows import PagedRow

    with pytest.raises(ValidationError, match=r"live_from must be an int in \[0, kv_start_pos=4\]; got 5"):
        PagedRow("r", 2, 6, 4, sequence_id=0, live_from=5)
    cache, _, _ = make()  # no window
    stream = Stream(cache, "s", branches=1, seed=26)
    stream.chunk()
    stream.chunk()
    with (
        pytest.raises(ValidationError, match="declares live_from=6, but not every layer's mask has a window"),
        cache.worker.stepper() as runtime,
    ):
        runtime.ensure_rows((PagedRow("s", 6, 12, 6, sequence_id=0, live_from=6),))
    cache, pool, _ = make(SessionPolicy(chunk_tokens=6, window_chunks=1, sink_chunks=1))
    stream = Stream(cache, "s", branches=1, seed=27)
    for _ in range(3):
        stream.chunk()
    backend = cache.worker.backends[0]
    caps = backend.capabilities
    type(backend).capabilities = replace(caps, supports_live_from=False)
    try:
        free = pool.num_free
        with pytest.raises(
            UnsupportedFeatureError, match=r"backends \['reference'\] of platform 'cpu' do not serve"
        ):
            cache.begin_recache(stream.session)
        assert pool.num_free == free and stream.session.recache is None
    finally:
        type(backend).capabilities = caps
    cache.end_session(stream.session)


def test_reset_at_boundary_keeps_only_the_sink_and_positions_stay_absolute() -> None:
    policy = SessionPolicy(chunk_tokens=8, sink_chunks=1, reset_at_boundary=True)
    assert (policy.mask.window, policy.mask.sink) == (8, 8)
    cache, pool, _ = make(policy)
    stream = Stream(cache, "s", branches=1, seed=8)
    for i in range(6):
        stream.chunk()  # chunk i sees the sink and itself, at [8 i, 8 i + 8)
        row = cache.worker.registry.snapshot_of("s").sequences[0].block_ids[0]  # type: ignore[union-attr]
        # every second commit cuts the two released chunks (16 tokens: the sink + window's
        # live keys) out of the row: positions stay absolute for the host, the row stays short
        assert stream.session.row_offset == 16 * (i // 2)
        assert sum(b != NULL_BLOCK for b in row) == 2 and len(row) == 2 * (i + 1) - 4 * (i // 2)
    assert stream.session.committed_tokens == 48 and pool.num_free == pool.num_total - 2
    with pytest.raises(ValidationError, match="window_chunks must be None or 0, got 2"):
        SessionPolicy(chunk_tokens=8, window_chunks=2, reset_at_boundary=True)


def test_reset_starts_the_session_over_and_keeps_only_named_contexts() -> None:
    cache, pool, cpool = make()
    stream = Stream(cache, "s", branches=1, seed=9)
    write_context(cache, cache.set_context(stream.session, "text", 4), seed=10)  # type: ignore[arg-type]
    cache.set_context(stream.session, "action", 3)
    stream.chunk()
    chunk = cache.append_chunk(stream.session)
    with pytest.raises(ValidationError, match=r"no contexts \['image'\] to keep"):
        cache.reset(stream.session, keep_contexts=["image"])
    assert chunk is not None and chunk.state.value == "open"
    cache.reset(stream.session, keep_contexts=["text"])
    assert chunk.state.value == "aborted" and stream.session.committed_tokens == 0
    assert pool.num_free == pool.num_total and cpool.num_free == cpool.num_total - 1
    assert cache.contexts.names("s") == ("text",)  # type: ignore[union-attr]
    stream.keys = {k: v[:0] for k, v in stream.keys.items()}
    stream.values = {k: v[:0] for k, v in stream.values.items()}
    stream.chunk()  # position 0 again, equal to dense
    assert stream.session.committed_tokens == 6
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total and cpool.num_free == cpool.num_total


def test_a_cross_attention_step_reads_the_context_pages() -> None:
    """A denoise step's cross-attention over a written context equals dense attention."""
    cache, _, _ = make()
    session = cache.begin_session("s")
    ((k, v),) = write_context(cache, cache.set_context(session, "text", 5), seed=11)  # type: ignore[arg-type]
    q = torch.randn(6, H, D, generator=torch.Generator().manual_seed(12))
    ck, cv = cache.context_kv(session, "text", "x0")
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), ck.transpose(0, 1), cv.transpose(0, 1)
    )
    ref = dense_attention(q, k, v, torch.ones(6, 5, dtype=torch.bool), D**-0.5)
    torch.testing.assert_close(out.transpose(0, 1).double(), ref, atol=1e-5, rtol=1e-5)


def test_adopt_refuses_an_unwritten_donor_a_mismatch_and_install_still_refuses_a_replacement() -> None:
    from dataclasses import replace

    from diffusion_kv.core.allocation import RequestAllocation
    from diffusion_kv.core.errors import GenerationError

    cache, pool, _ = make()
    stream = Stream(cache, "s", branches=1, seed=13)
    stream.chunk()
    registry, alloc = cache.worker.registry, cache.allocator
    assert registry is not None
    shadow = alloc.shadow("s", "d")
    assert shadow is not None and pool.num_free == 40 - 4
    cache.worker.install(shadow)
    old = registry.snapshot_of("s")
    assert old is not None
    swapped = RequestAllocation(
        "s", alloc.generation + 1, (replace(old.sequences[0], block_ids=shadow.sequences[0].block_ids),)
    )
    with pytest.raises(GenerationError, match="conflicting allocation snapshot"):
        cache.worker.install(swapped)
    with pytest.raises(StateError, match=r"donor 'd' never wrote tokens \[\(0, 6\)\]"):
        alloc.adopt("s", "d", install=lambda s: cache.worker.adopt(s, "d"))
    bad = RequestAllocation("s", alloc.generation + 1, (replace(old.sequences[0], block_ids=((0, 1),)),))
    with pytest.raises(ValidationError, match="take donor 'd'"):
        cache.worker.adopt(bad, "d")
    assert registry.snapshot_of("s") == old and registry.snapshot_of("d") == shadow and pool.num_free == 36
    alloc.free("d")
    cache.worker.retire("d", alloc.generation)
    cache.end_session(stream.session)
    assert pool.num_free == pool.num_total


def test_a_plan_with_live_from_is_exact_against_the_dense_mask() -> None:
    from diffusion_kv.core.attention import BlockKind, MaskSpec, build_block_plan

    mask = MaskSpec(AttentionMode.CHUNK_CAUSAL, chunk=6, window=12, sink=6)
    for block in (2, 4, 5):
        for start, end, floor in ((18, 24, 18), (24, 30, 24), (12, 30, 12), (18, 24, 0)):
            plan = build_block_plan(mask, [start], [end - start], [end], block, live_from=[floor])
            dense = mask.row_mask(start, end - start, end, live_from=floor)
            assert torch.equal(plan.row_mask(0, start, end - start, end), dense)
            seen = [dense[:, b * block : (b + 1) * block] for b in range(-(-end // block))]
            want = [
                BlockKind.SKIP if not s.any() else BlockKind.FULL if s.all() else BlockKind.PARTIAL
                for s in seen
            ]
            assert plan.kinds[0].tolist() == [int(k) for k in want], (block, start, floor)
    assert mask.row_mask(18, 6, 24, live_from=18)[0].nonzero().flatten().tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        18,
        19,
        20,
        21,
        22,
        23,
    ]


def _context_worker(backend: str, blocks: int = 12) -> tuple[PagedWorker, DiffusionKVAllocator, FreeListPool]:
    """A context worker on ``cpu:<backend>`` (head size 16, blocks of 16: what ``sdpa`` takes)."""
    cw = PagedWorker(CpuPlatform(), RunnerConfig(64, 4, 4, 64, device=torch.device("cpu"), backend=backend))
    cw.register_kv_cache_layers(
        {f"x{i}": PagedLayerSpec(4, 2, 16, torch.float32, mode=AttentionMode.FULL) for i in range(2)}
    )
    cw.initialize_kv_cache(num_blocks=blocks, block_size=16)
    pool = FreeListPool(blocks)
    alloc = DiffusionKVAllocator(
        block_size=16, max_model_len=64, max_rows_per_request=2, worker_rows=4, pool=pool
    )
    return cw, alloc, pool


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_paged_cross_attention_reads_the_context_pages_in_place_and_equals_dense(backend: str) -> None:
    cw, calloc, cpool = _context_worker(backend)
    assert cw.backends[0].name == backend
    contexts = SessionContexts(cw, calloc)
    gen = torch.Generator().manual_seed(30)
    written: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for sid, tokens, branches in (("a", 20, 2), ("b", 7, 1)):
        ctx = contexts.set(sid, "text", tokens, branches)
        assert ctx is not None
        k, v = (
            torch.randn(tokens * branches, 2, 16, generator=gen),
            torch.randn(tokens * branches, 2, 16, generator=gen),
        )
        with cw.stepper() as runtime:
            runtime.ensure_rows(ctx.rows())
            for name in cw.layers:
                cw.forward(name, torch.randn(tokens * branches, 4, 16, generator=gen), k, v)
        written[sid, "text"] = [
            (k[b * tokens : (b + 1) * tokens], v[b * tokens : (b + 1) * tokens]) for b in range(branches)
        ]
    caches_before = [t.clone() for name in cw.layers for t in key_value_caches(cw.kv_caches[name])]
    lq = 9
    q = torch.randn(2 * lq, 4, 16, generator=gen)
    for name in cw.layers:
        out = contexts.attend("a", "text", name, q)
        for b in range(2):
            k, v = written["a", "text"][b]
            ref = dense_attention(
                q[b * lq : (b + 1) * lq], k, v, torch.ones(lq, 20, dtype=torch.bool), 16**-0.5
            )
            torch.testing.assert_close(out[b * lq : (b + 1) * lq].double(), ref, atol=1e-5, rtol=1e-5)
    assert len(contexts._readers) == 1  # built once, reused by every layer
    # one call over two sessions' contexts (three rows)
    reader = contexts.reader([("a", "text"), ("b", "text")], lq)
    q3 = torch.randn(3 * lq, 4, 16, generator=gen)
    out = reader.attend("x1", q3)
    for r, (sid, b) in enumerate((("a", 0), ("a", 1), ("b", 0))):
        k, v = written[sid, "text"][b]
        ref = dense_attention(
            q3[r * lq : (r + 1) * lq], k, v, torch.ones(lq, len(k), dtype=torch.bool), 16**-0.5
        )
        torch.testing.assert_close(out[r * lq : (r + 1) * lq].double(), ref, atol=1e-5, rtol=1e-5)
    # nothing was written: the pages are as before
    after = [t for name in cw.layers for t in key_value_caches(cw.kv_caches[name])]
    assert all(torch.equal(a, b) for a, b in zip(caches_before, after, strict=True))
    with pytest.raises(ValidationError, match=r"q must be \[27, 4, 16\] torch.float32; got \[18, 4, 16\]"):
        reader.attend("x0", q)
    contexts.release("b", "text")
    with pytest.raises(StateError, match="context 'text' of session 'b' was released or replaced"):
        reader.attend("x0", q3)
    contexts.release_session("a")
    assert contexts._readers == {} and cpool.num_free == cpool.num_total


def _sdpa_or_reference(backend: str, policy: SessionPolicy) -> SessionCache:
    """A session cache on ``cpu:<backend>`` at block size 16 (what ``sdpa`` takes)."""
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(128, 2, 4, 128, device=torch.device("cpu"), backend=backend)
    )
    worker.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 16, torch.float32, mode=policy.mask)})
    worker.initialize_kv_cache(num_blocks=24, block_size=16)
    alloc = DiffusionKVAllocator(
        block_size=16, max_model_len=128, max_rows_per_request=2, worker_rows=4, pool=FreeListPool(24)
    )
    return SessionCache(worker, alloc, policy)


def test_a_recache_after_the_window_slid_on_sdpa_equals_the_reference() -> None:
    """``cpu:sdpa`` serves the window forward's ``live_from`` (keys in [sink, live_from) skipped):
    every forward of a stream, its slid re-cache and the chunks after it equal the reference
    backend's on the same inputs, with chunks straddling blocks."""
    policy = SessionPolicy(chunk_tokens=12, window_chunks=1, sink_chunks=1)
    caches = {b: _sdpa_or_reference(b, policy) for b in ("reference", "sdpa")}
    assert caches["sdpa"].worker.backends[0].name == "sdpa"
    sessions = {b: c.begin_session("s") for b, c in caches.items()}
    gen = torch.Generator().manual_seed(3)

    def forward(rows_of: dict[str, tuple]) -> None:  # type: ignore[type-arg]
        T = sum(r.query_len for r in next(iter(rows_of.values())))
        q, k, v = (torch.randn(T, 2, 16, generator=gen) for _ in range(3))
        outs = {}
        for b, rows in rows_of.items():
            worker = caches[b].worker
            with worker.stepper() as runtime:
                runtime.ensure_rows(rows)
                outs[b] = worker.forward("l0", q, k, v)
        torch.testing.assert_close(outs["sdpa"], outs["reference"], atol=1e-5, rtol=1e-5)

    def chunk() -> None:
        chunks = {b: caches[b].append_chunk(s) for b, s in sessions.items()}
        for _ in range(2):  # two denoise steps
            forward({b: c.rows() for b, c in chunks.items() if c is not None})
        for b, c in chunks.items():
            assert c is not None
            caches[b].commit(c)

    for _ in range(5):
        chunk()
    passes = {b: caches[b].begin_recache(s) for b, s in sessions.items()}
    assert all(p is not None for p in passes.values())
    spans = {b: p.spans for b, p in passes.items() if p is not None}
    assert spans["sdpa"] == spans["reference"] == ((0, 12), (48, 60))
    forwards = {b: p.forwards() for b, p in passes.items() if p is not None}
    assert forwards["sdpa"][1][0].live_from == 48
    for i in range(2):
        forward({b: f[i] for b, f in forwards.items()})
    for b, p in passes.items():
        assert p is not None
        caches[b].commit_recache(p)
    for _ in range(2):
        chunk()
    for b, s in sessions.items():
        caches[b].end_session(s)
        assert caches[b].allocator.pool.num_free == 24

"""The attention spec as a value (core/attention): masks, block plans, retention, and the
worker serving a chunk-causal + window + sink mask on the cpu reference with retention
releasing blocks."""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
import torch

from diffusion_kv import (
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    PagedLayerSpec,
    PagedRow,
    SequenceRequest,
)
from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.allocation import NULL_BLOCK
from diffusion_kv.core.attention import AttentionMode, BlockKind, MaskSpec, build_block_plan
from diffusion_kv.core.capabilities import Capabilities, MultipleOf, Requirements, capability_reasons
from diffusion_kv.core.errors import (
    StateError,
    UnsupportedFeatureError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.registry import RowTransition
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend

CHUNK = AttentionMode.CHUNK_CAUSAL


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


# -- the mask ----------------------------------------------------------------------------------


def test_chunk_causal_window_and_sink_rows() -> None:
    spec = MaskSpec(CHUNK, chunk=2, window=4, sink=2)
    # 10 keys, every query: chunk c sees chunks c-1 and c, plus the first 2 tokens
    assert rows(spec.row_mask(0, 10, 10)) == [
        "xx........", "xx........",
        "xxxx......", "xxxx......",
        "xxxxxx....", "xxxxxx....",
        "xx..xxxx..", "xx..xxxx..",
        "xx....xxxx", "xx....xxxx",
    ]  # fmt: skip
    # a causal window of 3 with no sink, a suffix query
    assert rows(MaskSpec(AttentionMode.CAUSAL, window=3).row_mask(3, 2, 5)) == [".xxx.", "..xxx"]
    # the plain kinds agree with the enum's masks
    for mode in (AttentionMode.CAUSAL, AttentionMode.FULL):
        assert torch.equal(MaskSpec(mode).row_mask(2, 3, 5), mode.row_mask(2, 3, 5))
    spans = [(1, 3)]
    assert torch.equal(
        MaskSpec(AttentionMode.CAUSAL).row_mask(0, 5, 5, spans),
        AttentionMode.PIECEWISE.row_mask(0, 5, 5, spans),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": CHUNK}, "MaskSpec.chunk must be a positive int; got None"),
        (
            {"kind": AttentionMode.CAUSAL, "chunk": 4},
            "MaskSpec.chunk is for CHUNK_CAUSAL masks; CAUSAL got 4",
        ),
        ({"kind": CHUNK, "chunk": 4, "window": 6}, "MaskSpec.window 6 must be a multiple of chunk 4"),
        ({"kind": AttentionMode.CAUSAL, "sink": 2}, "MaskSpec.sink needs a window"),
        ({"kind": AttentionMode.CAUSAL, "window": 0}, "MaskSpec.window must be a positive int; got 0"),
        (
            {"kind": AttentionMode.PIECEWISE},
            "MaskSpec.kind must be AttentionMode.CAUSAL, FULL or CHUNK_CAUSAL",
        ),
        (
            {"kind": AttentionMode.CAUSAL, "window": 4, "spans": True},
            r"full_attn_spans refine plain causal or full masks only; causal\(window=4\) cannot take them",
        ),
    ],
)
def test_malformed_masks_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        MaskSpec(**kwargs)


def test_what_a_mask_requires_of_a_backend() -> None:
    C, F, P = AttentionMode.CAUSAL, AttentionMode.FULL, AttentionMode.PIECEWISE
    assert MaskSpec(F).required_modes == {C, F, P}  # spans cut a full layer into causal segments too
    assert MaskSpec(F, spans=False).required_modes == {F}
    spec = MaskSpec(CHUNK, chunk=4, window=12, sink=4)
    assert spec.required_modes == {CHUNK} and spec.spans is False and spec.releases
    assert spec.describe() == "chunk_causal(chunk=4, window=12, sink=4)"
    caps = Capabilities(
        dtypes=frozenset({torch.float32}), head_sizes=None, kernel_block_sizes=(MultipleOf(1),)
    )
    req = Requirements(attention_modes={CHUNK}, window=12, sink=4)
    assert capability_reasons(caps, req) == [
        "attention mode(s) ['chunk_causal'] (supported: ['causal', 'full', 'piecewise'])",
        "window=12 tokens (served: none)",
        "sink=4 tokens (served: none)",
    ]
    assert capability_reasons(CpuReferenceBackend.capabilities, req) == []
    with pytest.raises(ValidationError, match="CHUNK_CAUSAL has a chunk size: use MaskSpec.row_mask"):
        CHUNK.row_mask(0, 4, 4)


# -- the block plan and retention agree with the dense mask ----------------------------------


def _random_mask(rng: random.Random) -> MaskSpec:
    kind = rng.choice([AttentionMode.CAUSAL, AttentionMode.FULL, CHUNK])
    chunk = rng.randint(1, 5) if kind is CHUNK else None
    window = rng.choice([None, rng.randint(1, 4) * (chunk or rng.randint(1, 3))])
    sink = rng.randint(0, 6) if window is not None else 0
    return MaskSpec(kind, chunk=chunk, window=window, sink=sink)


def test_block_plan_is_the_dense_mask_reduced_by_block() -> None:
    rng = random.Random(7)
    for _ in range(400):
        spec = _random_mask(rng)
        seq_len = rng.randint(1, 40)
        query_len = rng.randint(1, seq_len)
        offset = seq_len - query_len if spec.kind.is_causal else rng.randint(0, seq_len - query_len)
        block = rng.randint(1, 8)
        plan = build_block_plan(spec, [offset], [query_len], [seq_len], block)
        dense = spec.row_mask(offset, query_len, seq_len)
        expected = []
        for b in range(-(-seq_len // block)):
            cols = dense[:, b * block : (b + 1) * block]
            expected.append(
                BlockKind.SKIP if not cols.any() else BlockKind.FULL if cols.all() else BlockKind.PARTIAL
            )
        assert plan.kinds[0].tolist() == [int(k) for k in expected], (spec, seq_len, query_len, offset, block)


def test_retention_releases_only_keys_no_later_query_sees() -> None:
    rng = random.Random(11)
    for _ in range(400):
        spec = _random_mask(rng)
        seq_len = rng.randint(2, 48)
        next_query = rng.randint(0, seq_len - 1)
        kept = spec.retention(next_query)
        later = spec.row_mask(next_query, seq_len - next_query, seq_len)
        seen = later.any(dim=0)
        assert not seen[kept.pinned : kept.first_live].any(), (spec, next_query, kept)
        if spec.window is not None and spec.kind is not AttentionMode.FULL:
            # the retention is tight: the first live key is seen by the query at next_query
            first = spec.row_mask(next_query, 1, max(seq_len, next_query + 1))[0]
            if kept.first_live < seq_len and kept.first_live > kept.pinned:
                assert bool(first[kept.first_live])
    assert MaskSpec(CHUNK, chunk=4, window=8, sink=4).retention(16).releasable_blocks(4) == range(1, 3)


# -- served on the cpu reference, retention freeing blocks -----------------------------------

SPEC = MaskSpec(CHUNK, chunk=4, window=8, sink=4)
H, D = 2, 8


def _runner(num_blocks: int, backend: str | None = None) -> PagedWorker:
    runner = PagedWorker(
        CpuPlatform(),
        RunnerConfig(64, 1, 2, 64, device="cpu", backend=backend),
    )
    runner.register_kv_cache_layers(
        {f"l{i}": PagedLayerSpec(H, H, D, torch.float32, mode=SPEC) for i in range(2)}
    )
    runner.initialize_kv_cache(num_blocks=num_blocks, block_size=4)
    return runner


def test_a_chunk_stream_with_window_and_sink_matches_dense_and_releases_blocks() -> None:
    """Chunks of 4 tokens, each written and attended once (the last denoise step), over a sink
    chunk and a window of 2 chunks: outputs equal dense attention over the whole history under
    the same mask, and blocks that slid out go back to the pool as the stream goes."""
    runner = _runner(num_blocks=8)
    assert runner.layout.groups[0].spec.mask == SPEC
    assert type(runner.backends[0]).name == "reference"  # sdpa declares no window: the reference serves
    pool = FreeListPool(8)
    alloc = DiffusionKVAllocator(
        block_size=4, max_model_len=64, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    runner.install(alloc.reserve(KVRequest("s", (SequenceRequest(0, 0, 4),))))
    torch.manual_seed(0)
    keys = {n: torch.zeros(0, H, D) for n in runner.layers}
    values = {n: torch.zeros(0, H, D) for n in runner.layers}
    used, peak = [], []
    for chunk in range(8):
        start = chunk * 4
        if chunk:
            alloc.extend("s", 0, 4, install=runner.install)
            assert runner.registry.last_transitions == {RowTransition.EXTEND}
        peak.append(pool.num_total - pool.num_free)
        row = PagedRow("s", 4, start + 4, start, sequence_id=0)
        with runner.stepper() as runtime:
            runtime.ensure_rows([row])
            for name in runner.layers:
                q, k, v = (torch.randn(4, H, D) for _ in range(3))
                out = runner.forward(name, q, k, v)
                keys[name] = torch.cat([keys[name], k])
                values[name] = torch.cat([values[name], v])
                mask = SPEC.row_mask(start, 4, start + 4)
                expected = dense_attention(q, keys[name], values[name], mask, D**-0.5)
                torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        releasable = list(SPEC.retention(start + 4).releasable_blocks(4))
        if releasable:
            alloc.release("s", 0, releasable, install=runner.install)
            assert runner.registry.last_transitions == {RowTransition.SLIDE}
        used.append(pool.num_total - pool.num_free)
    # while a chunk attends: the sink chunk, the chunk before and its own (sink + window);
    # between chunks: the sink and the one chunk the next query still sees
    assert peak == [1, 2, 3, 3, 3, 3, 3, 3]
    assert used == [1, 2, 2, 2, 2, 2, 2, 2]
    snapshot = runner.registry.snapshot_of("s")
    assert snapshot is not None
    assert snapshot.sequences[0].block_ids[0][1:6] == (NULL_BLOCK,) * 5
    # a row that would read released keys is refused before anything runs
    with (
        pytest.raises(StateError, match=r"would read tokens \[\(24, 28\)\] .* released are gone for good"),
        runner.stepper() as runtime,
    ):
        runtime.ensure_rows([PagedRow("s", 4, 32, 28, sequence_id=0)])
    runner.retire("s", alloc.generation)
    alloc.free("s")
    assert pool.num_free == pool.num_total


def test_slides_that_break_the_rules_change_nothing() -> None:
    runner = _runner(num_blocks=8)
    pool = FreeListPool(8)
    alloc = DiffusionKVAllocator(
        block_size=4, max_model_len=64, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    runner.install(alloc.reserve(KVRequest("s", (SequenceRequest(0, 0, 12),))))
    before = (runner.registry.snapshot_of("s"), pool.num_free, alloc.generation)
    with pytest.raises(
        ValidationError, match=r"releases blocks \[0\], which hold sink or cached-prefix tokens"
    ):
        alloc.release("s", 0, [0], install=runner.install)
    assert (runner.registry.snapshot_of("s"), pool.num_free, alloc.generation) == before
    with pytest.raises(ValidationError, match=r"positions \[3\] lie outside its 3 blocks"):
        alloc.release("s", 0, [3], install=runner.install)
    assert (runner.registry.snapshot_of("s"), pool.num_free, alloc.generation) == before


def test_a_causal_group_cannot_release() -> None:
    runner = PagedWorker(CpuPlatform(), RunnerConfig(64, 1, 2, 64, device="cpu"))
    runner.register_kv_cache_layers({"l0": PagedLayerSpec(H, H, D, torch.float32)})
    runner.initialize_kv_cache(num_blocks=8, block_size=4)
    pool = FreeListPool(8)
    alloc = DiffusionKVAllocator(
        block_size=4, max_model_len=64, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    runner.install(alloc.reserve(KVRequest("r", (SequenceRequest(0, 0, 12),))))
    with pytest.raises(ValidationError, match=r"the group's mask causal keeps every key"):
        alloc.release("r", 0, [1], install=runner.install)
    assert pool.num_free == 5


# -- a full-only backend is never handed causal segments (spans on a full layer) -------------


class FullOnlyBackend(CpuReferenceBackend):
    name: ClassVar[str] = "full-only"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.float32}),
        head_sizes=None,
        kernel_block_sizes=(MultipleOf(1),),
        attention_modes=frozenset({AttentionMode.FULL}),
    )


class FullOnlyPlatform(CpuPlatform):
    name: ClassVar[str] = "full-only-cpu"
    backends: ClassVar[tuple] = (FullOnlyBackend,)


def test_a_full_only_backend_is_refused_for_full_layers_that_take_spans() -> None:
    runner = PagedWorker(FullOnlyPlatform(), RunnerConfig(64, 1, 2, 64, device="cpu"))
    with pytest.raises(UnsupportedRequirementsError, match=r"attention mode\(s\) \['causal', 'piecewise'\]"):
        runner.register_kv_cache_layers(
            {"l0": PagedLayerSpec(H, H, D, torch.float32, mode=AttentionMode.FULL)}
        )
    assert runner.layers == {}


def test_a_full_layer_without_spans_is_served_full_only_and_spans_are_refused_before_any_write() -> None:
    runner = PagedWorker(FullOnlyPlatform(), RunnerConfig(64, 1, 2, 64, device="cpu"))
    full = MaskSpec(AttentionMode.FULL, spans=False)
    runner.register_kv_cache_layers({"l0": PagedLayerSpec(H, H, D, torch.float32, mode=full)})
    runner.initialize_kv_cache(num_blocks=8, block_size=4)
    assert type(runner.backends[0]) is FullOnlyBackend
    pool = FreeListPool(8)
    alloc = DiffusionKVAllocator(
        block_size=4, max_model_len=64, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    runner.install(alloc.reserve(KVRequest("r", (SequenceRequest(0, 0, 8),))))
    cache = runner.kv_caches["l0"]
    snapshot = [t.clone() for t in cache] if isinstance(cache, tuple) else cache.clone()
    with runner.stepper() as runtime:
        runtime.ensure_rows([PagedRow("r", 8, 8, 0, sequence_id=0)])
        q, k, v = (torch.randn(8, H, D) for _ in range(3))
        with pytest.raises(UnsupportedFeatureError, match=r"cannot refine layer 'l0' of mask full"):
            runner.forward("l0", q, k, v, AttentionMetadata(full_attn_spans=[[(0, 4)]]))
        after = runner.kv_caches["l0"]
        if isinstance(after, tuple):
            assert all(torch.equal(a, b) for a, b in zip(after, snapshot, strict=True))  # type: ignore[arg-type]
        else:
            assert torch.equal(after, snapshot)  # type: ignore[arg-type]
        out = runner.forward("l0", q, k, v)
        expected = dense_attention(q, k, v, torch.ones(8, 8, dtype=torch.bool), D**-0.5)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# -- a stateful run of streams: extend, write, slide, bad slides, retire -----------------------


def test_random_windowed_streams_keep_blocks_owned_once_and_the_pool_whole() -> None:
    """Several windowed streams at once under random operations (extend by a chunk, write the
    newest chunk, slide what retention allows, slides that break a rule, retire), checked after
    every operation against the allocator's and worker's own accounts: every block held by at
    most one row, held exactly when a live snapshot lists it, the pool plus the reservations
    equal to the whole pool; a refused operation changes nothing."""
    rng = random.Random(5)
    runner = _runner(num_blocks=24)
    pool = FreeListPool(24)
    alloc = DiffusionKVAllocator(
        block_size=4, max_model_len=64, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    registry = runner.registry
    assert registry is not None
    lengths: dict[str, int] = {}  # request -> tokens written so far
    serial = 0
    done: dict[str, int] = dict.fromkeys(["open", "extend", "write", "slide", "bad", "retire"], 0)

    def check() -> None:
        listed: dict[int, str] = {}
        for rid in alloc.reserved():
            snap = registry.snapshot_of(rid)
            assert snap is not None
            for b in snap.sequences[0].block_ids[0]:
                if b != NULL_BLOCK:
                    assert b not in listed, f"block {b} listed by {rid} and {listed[b]}"
                    listed[b] = rid
        for b in range(24):
            holders = registry.holders_of(0, b)
            assert (b in listed) == bool(holders), (b, holders)
        assert pool.num_free + len(listed) == pool.num_total

    ops, weights = ["open", "extend", "write", "slide", "bad", "retire"], [2, 6, 6, 4, 1, 1]
    for _ in range(400):
        op = rng.choices(ops, weights)[0]
        live = list(alloc.reserved())
        if op == "open" and len(live) < 2:
            serial += 1
            rid = f"s{serial}"
            snap = alloc.reserve(KVRequest(rid, (SequenceRequest(0, 0, 4),)))
            if snap is not None:
                runner.install(snap)
                lengths[rid] = 0
                done[op] += 1
        elif op == "extend" and live:
            rid = rng.choice(live)
            snap = registry.snapshot_of(rid)
            assert snap is not None
            if lengths[rid] == snap.sequences[0].seq_len and snap.sequences[0].seq_len + 4 <= 64:
                done[op] += alloc.extend(rid, 0, 4, install=runner.install) is not None
        elif op == "write" and live:
            rid = rng.choice(live)
            snap = registry.snapshot_of(rid)
            assert snap is not None
            end = snap.sequences[0].seq_len
            if lengths[rid] < end:
                with runner.stepper() as runtime:
                    runtime.ensure_rows([PagedRow(rid, 4, end, end - 4, sequence_id=0)])
                    for name in runner.layers:
                        runner.forward(name, *(torch.randn(4, H, D) for _ in range(3)))
                lengths[rid] = end
                done[op] += 1
        elif op == "slide" and live:
            rid = rng.choice(live)
            release = list(SPEC.retention(lengths[rid]).releasable_blocks(4))
            if release:
                alloc.release(rid, 0, release, install=runner.install)
                done[op] += 1
        elif op == "bad" and live:
            rid = rng.choice(live)
            before = (registry.snapshot_of(rid), pool.num_free, alloc.generation)
            with pytest.raises(ValidationError):
                alloc.release(rid, 0, [0], install=runner.install)  # the sink block is pinned
            assert (registry.snapshot_of(rid), pool.num_free, alloc.generation) == before
            done[op] += 1
        elif op == "retire" and live:
            rid = rng.choice(live)
            runner.retire(rid, alloc.generation)
            alloc.free(rid)
            del lengths[rid]
            done[op] += 1
        check()
    assert min(done.values()) >= 5, done  # every kind of operation ran
    for rid in list(alloc.reserved()):
        runner.retire(rid, alloc.generation)
        alloc.free(rid)
    assert pool.num_free == pool.num_total and registry.installed_requests() == ()

"""Translator, piecewise planner, layer context and runtime: rules of the reference adapter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from diffusion_kv.conformance.harness import PagedHarness
from diffusion_kv.core.batch import PagedBatch
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import StaleBatchError, StateError, UnknownIdentityError, ValidationError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.piecewise import (
    PiecewisePlan,
    Segment,
    build_piecewise_plan,
    build_segments,
    plan_call_count,
)
from diffusion_kv.core.registry import RowBinding
from diffusion_kv.core.rows import PagedRow, Phase, PhaseRows
from diffusion_kv.core.runtime import BatchStepper
from diffusion_kv.core.translate import Translator, dcp_local_seq_lens
from diffusion_kv.platforms.cpu import CpuPlatform

C, F = AttentionMode.CAUSAL, AttentionMode.FULL


class RecordingBuilder:
    """Wraps a backend's build, recording every PagedBatch it is given."""

    def __init__(self, inner: Any, threshold: int | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.reorder_batch_threshold = threshold
        self.calls: list[PagedBatch] = []
        self.fail = False

    def build(self, batch: PagedBatch) -> Any:
        self.calls.append(batch)
        if self.fail:
            raise RuntimeError("builder failed")
        return self.inner.build(batch)


def make(threshold: int | None = None, **kw: Any) -> tuple[PagedHarness, RecordingBuilder]:
    h = PagedHarness(CpuPlatform(), block_size=4, num_blocks=64, max_model_len=32, **kw)
    rec = RecordingBuilder(h.backend, threshold)
    h.translator = Translator(
        layout=h.layout,
        block_tables=h.block_tables,
        backends=[rec],  # type: ignore[list-item]
        rows=h.registry,
        device=h.device,
    )
    h.registry.before_mutation = h.translator.invalidate
    h.executor.translator = h.translator
    return h, rec


def qkv(h: PagedHarness, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(tokens, h.num_heads, h.head_size, generator=g),
        torch.randn(tokens, h.num_kv_heads, h.head_size, generator=g),
        torch.randn(tokens, h.num_kv_heads, h.head_size, generator=g),
    )


def unchanged(h: PagedHarness, before: list[torch.Tensor]) -> bool:
    return h.writes() == 0 and all(torch.equal(a, b) for a, b in zip(before, h.cache_snapshot(), strict=True))


# --- rows ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(request_id="", query_len=1, seq_len=1, sequence_id=0), "request_id must be a non-empty string"),
        (dict(request_id="r", query_len=1, seq_len=1), "exactly one of sequence_id or context_id"),
        (dict(request_id="r", query_len=1, seq_len=1, sequence_id=0, context_id="c"), "exactly one of"),
        (dict(request_id="r", query_len=1, seq_len=1, sequence_id=-1), "sequence_id must be an int >= 0"),
        (
            dict(request_id="r", query_len=1, seq_len=1, context_id=""),
            "context_id must be a non-empty string",
        ),
        (dict(request_id="r", query_len=0, seq_len=1, sequence_id=0), "query_len must be a positive int"),
        (dict(request_id="r", query_len=1, seq_len=0, sequence_id=0), "seq_len must be a positive int"),
        (
            dict(request_id="r", query_len=1, seq_len=2, kv_start_pos=-1, sequence_id=0),
            "kv_start_pos must be",
        ),
        (
            dict(request_id="r", query_len=3, seq_len=4, kv_start_pos=2, sequence_id=0),
            "write span exceeds seq_len: kv_start_pos=2, query_len=3, seq_len=4",
        ),
    ],
)
def test_row_rules(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PagedRow(**kwargs)


def test_phase_rows() -> None:
    a = (PagedRow("r", 9, 9, sequence_id=0), PagedRow("r", 9, 9, sequence_id=1))
    b = (PagedRow("r", 6, 9, 3, sequence_id=0), PagedRow("r", 6, 9, 3, sequence_id=1))
    phases = PhaseRows(a, b)
    assert phases.rows_for_step(0) == a and phases.rows_for_step(1) == b and phases.rows_for_step(7) == b
    with pytest.raises(ValidationError, match="denoise step index must be an int >= 0; got -1"):
        phases.rows_for_step(-1)
    with pytest.raises(ValidationError, match="same ordered identities"):
        PhaseRows(a, tuple(reversed(b)))
    with pytest.raises(ValidationError, match="need both prefill and denoise rows"):
        PhaseRows(a, ())


# --- piecewise planner --------------------------------------------------------------------------------


def test_segments_keep_span_end() -> None:
    assert build_segments([(5, 8)], 3, 6) == [
        Segment(3, 5, 5, C),
        Segment(5, 8, 8, F),
        Segment(8, 9, 9, C),
    ]
    assert build_segments([(2, 10)], 4, 3) == [Segment(4, 7, 10, F)]
    assert build_segments([(0, 2), (4, 6)], 0, 8) == [
        Segment(0, 2, 2, F),
        Segment(2, 4, 4, C),
        Segment(4, 6, 6, F),
        Segment(6, 8, 8, C),
    ]


def test_worked_example_segment_metadata() -> None:
    h, rec = make()
    h.install("r", [9, 9], placement="contiguous")
    h.prefill("r", [9, 9])
    rec.calls.clear()
    rows = (PagedRow("r", 6, 9, 3, sequence_id=0), PagedRow("r", 6, 9, 3, sequence_id=1))
    q, k, v = qkv(h, 12)
    batch = h.translator.prepare(rows)
    assert batch.common.positions.tolist() == [3, 4, 5, 6, 7, 8] * 2
    with h.translator.activate(batch):
        for name in h.layer_names:
            h.executor.forward(name, q, k, v, AttentionMetadata(full_attn_spans=[[(5, 8)], [(5, 8)]]))
    segs = rec.calls[1:]
    assert len(segs) == 3  # built once per batch, reused by both layers
    assert [s.query_start_loc_cpu.tolist() for s in segs] == [[0, 2, 4], [0, 3, 6], [0, 1, 2]]
    assert [s.seq_lens_cpu.tolist() for s in segs] == [[5, 5], [8, 8], [9, 9]]
    assert [s.positions.tolist() for s in segs] == [[3, 4, 3, 4], [5, 6, 7, 5, 6, 7], [8, 8]]
    assert [s.causal for s in segs] == [True, False, True]
    # blocks of sequence 0 are 0..2 and of sequence 1 are 3..5 (block size 4)
    assert segs[0].slot_mapping.tolist() == [3, 4, 15, 16]
    assert [len(b.writes) for b in h.backends.values()] == [1, 1]


def test_plan_paths() -> None:
    plan = build_piecewise_plan([[(5, 8)], [(5, 8)]], [3, 3], [6, 6], [9, 9])
    assert plan.homogeneous_batch_shape == (2, 6) and not plan.contiguous
    assert plan.segments[0].query_indices.tolist() == [0, 1, 6, 7]
    single = build_piecewise_plan([[(5, 8)]], [3], [6], [9])
    assert single.contiguous and single.homogeneous_batch_shape is None
    assert [s.query_range for s in single.segments] == [(0, 2), (2, 5), (5, 6)]
    mixed = build_piecewise_plan([[(20, 30)], [(10, 20)]], [10, 0], [30, 30], [40, 30])
    assert mixed.homogeneous_batch_shape is not None  # same local ranges, different offsets


def _calls(plan: PiecewisePlan) -> list[tuple[str, tuple[int, ...], list[tuple[int, int, int]]]]:
    return [
        (seg.mode.value, seg.rows, [(s.q_start, s.q_end, s.kv_end) for s in seg.row_segments])
        for seg in plan.segments
    ]


def test_rows_with_different_segment_structures_share_calls() -> None:
    # row 0: [C 3-5, F 5-8, C 8-9]; row 1 has no span: [C 3-9] -> 2 causal calls + 1 full call
    plan = build_piecewise_plan([[(5, 8)], []], [3, 3], [6, 6], [9, 9])
    assert _calls(plan) == [
        ("causal", (0, 1), [(3, 5, 5), (3, 9, 9)]),
        ("full", (0,), [(5, 8, 8)]),
        ("causal", (0,), [(8, 9, 9)]),
    ]
    assert [s.query_indices.tolist() for s in plan.segments] == [[0, 1, 6, 7, 8, 9, 10, 11], [2, 3, 4], [5]]
    assert plan.homogeneous_batch_shape is None and not plan.contiguous
    # modes at different positions: row 0 [F 0-2, C 2-6], row 1 [C 0-4, F 4-6]
    plan = build_piecewise_plan([[(0, 2)], [(4, 6)]], [0, 0], [6, 6], [6, 6])
    assert _calls(plan) == [
        ("full", (0, 1), [(0, 2, 2), (4, 6, 6)]),
        ("causal", (0, 1), [(2, 6, 6), (0, 4, 4)]),
    ]


def test_mixed_phase_batch_plan() -> None:
    """A row at prefill (query = the whole sequence) beside rows at denoise (query = the target)
    and a row without prefix: one causal call (the prefill row's prefix) and one full call."""
    spans = [[(4, 10)], [(6, 9)], [(0, 5)]]
    plan = build_piecewise_plan(spans, [0, 6, 0], [10, 3, 5], [10, 9, 5])
    assert _calls(plan) == [
        ("causal", (0,), [(0, 4, 4)]),
        ("full", (0, 1, 2), [(4, 10, 10), (6, 9, 9), (0, 5, 5)]),
    ]
    assert plan.segments[1].query_indices.tolist() == list(range(4, 18))
    assert plan.segments[1].query_range == (4, 18) and plan.contiguous
    assert plan_call_count([[AttentionMode.CAUSAL, AttentionMode.FULL], [AttentionMode.FULL]] * 2) == 2


def test_call_count_rule() -> None:
    C, F = AttentionMode.CAUSAL, AttentionMode.FULL
    assert plan_call_count([[C, F, C], [C, F, C]]) == 3  # uniform: one call per segment
    assert plan_call_count([[C, F], [F], [C]]) == 2
    assert plan_call_count([[C, F, C, F], [F], [C, F]]) == 4
    assert plan_call_count([]) == 0


def test_reorder_threshold_puts_short_segments_first() -> None:
    plan = build_piecewise_plan([[], []], [0, 6], [8, 2], [8, 8], reorder_threshold=4)
    assert _calls(plan) == [("causal", (1, 0), [(6, 8, 8), (0, 8, 8)])]
    assert plan.segments[0].query_indices.tolist() == [8, 9, *range(8)]


@pytest.mark.parametrize(
    ("spans", "offsets", "lens", "seq", "message"),
    [
        ([[(5, 8)]], [3, 3], [6, 6], [9, 9], "full_attn_spans has 1 rows; the batch has 2"),
        ([[(5, 10)]], [3], [6], [9], r"span \(5, 10\) must satisfy 0 <= start < end <= seq_len=9"),
        ([[(6, 6)]], [3], [6], [9], "must satisfy 0 <= start < end"),
        ([[(6, 8), (4, 6)]], [0], [9], [9], "sorted and non-overlapping"),
        ([["x"]], [0], [1], [1], "must be per-row lists of"),
    ],
)
def test_plan_rejections(spans: list, offsets: list, lens: list, seq: list, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        build_piecewise_plan(spans, offsets, lens, seq)


# --- preparation --------------------------------------------------------------------------------------


def test_prepare_builds_common_metadata() -> None:
    h, rec = make()
    h.install("r", [6, 9], placement="contiguous")
    h.prefill("r", [6, 9])
    rows = (PagedRow("r", 2, 6, 4, sequence_id=0), PagedRow("r", 9, 9, sequence_id=1))
    batch = h.translator.prepare(rows)
    common = rec.calls[-1]
    assert common.query_start_loc_cpu.tolist() == [0, 2, 11]
    assert common.seq_lens_cpu.tolist() == [6, 9]
    assert common.positions.tolist() == [4, 5, *range(9)]
    assert common.max_query_len == 9 and common.max_seq_len == 9 and common.num_tokens == 11
    assert common.block_table.tolist()[0][:2] == [0, 1] and common.block_table.tolist()[1][:3] == [
        2,
        3,
        4,
    ]
    assert common.slot_mapping.tolist() == [4, 5, *range(8, 17)]
    assert common.mode is AttentionMode.CAUSAL and common.dcp_local_seq_lens is None
    assert batch.row_indices.dtype == torch.int32 and batch.row_indices.tolist() == [0, 1]
    assert set(batch.slot_mappings_by_layer) == set(h.layer_names)


def prepare_error(h: PagedHarness, rows: Any, exc: type[Exception], message: str) -> None:
    gen = h.translator._generation
    with pytest.raises(exc, match=message):
        h.translator.prepare(rows)
    assert h.translator._generation == gen  # nothing prepared, nothing invalidated


def test_prepare_rejections() -> None:
    h, _ = make(threshold=2, max_num_seqs=1, max_rows_per_request=3)
    h.install("r", [8, 8, 8], placement="contiguous")
    prepare_error(h, (), ValidationError, "at least one row")
    prepare_error(h, [PagedRow("r", 8, 8, sequence_id=0)] * 2, ValidationError, "duplicate row identities")
    prepare_error(h, (PagedRow("r", 1, 8, 7, sequence_id=5),), UnknownIdentityError, r"\('r', 5, None\)")
    prepare_error(
        h,
        (PagedRow("r", 1, 9, 8, sequence_id=0),),
        ValidationError,
        "installed allocation has logical length 8",
    )
    prepare_error(
        h,
        (PagedRow("r", 8, 8, sequence_id=0), PagedRow("r", 1, 8, 7, sequence_id=1)),
        ValidationError,
        r"short-query rows \(query_len <= 2\) before long-query rows",
    )
    rows4 = (
        *tuple(PagedRow("r", 1, 8, 7, sequence_id=i) for i in range(3)),
        PagedRow("x", 1, 1, sequence_id=0),
    )
    prepare_error(h, rows4, ValidationError, "paged batch has 4 rows; worker capacity is 3")


def test_prepare_checks_installed_blocks_and_tokens() -> None:
    h, _ = make(max_num_seqs=1, max_rows_per_request=2)
    h.install("r", [8], placement="contiguous")
    # a row source claiming a longer logical length than the installed blocks cover

    class LyingRows:
        def resolve(self, rid: str, sid: int | None, cid: str | None = None) -> RowBinding:
            return RowBinding(0, 16, written=((0, 16),))

        def record_writes(self, spans: Any) -> None:
            pass

    h.translator.rows = LyingRows()
    prepare_error(
        h,
        (PagedRow("r", 1, 12, 11, sequence_id=0),),
        ValidationError,
        "needs 3 blocks in cache group 0 for seq_len=12",
    )
    h2, _ = make(max_num_seqs=1, max_rows_per_request=2)
    h2.install("r", [32, 32], placement="contiguous")
    rows = (PagedRow("r", 32, 32, sequence_id=0), PagedRow("r", 32, 32, sequence_id=1))
    h2.block_tables.max_num_batched_tokens = 63  # type: ignore[misc]
    prepare_error(h2, rows, ValidationError, "paged batch has 64 tokens; worker capacity is 63")


def test_prepare_reports_the_first_failing_check_in_order() -> None:
    """Checks run in one pass over the rows, yet a batch failing several of them gets the error
    of the first check in this order, whichever row fails it: worker row and capacity, then
    short-before-long order, installed blocks, token capacity, page provenance."""
    h, _ = make(threshold=2, max_num_seqs=1, max_rows_per_request=3)
    h.install("r", [8], placement="contiguous")  # worker row 0 holds 2 blocks; rows 1, 2 none
    bindings = {
        0: RowBinding(0, 16, written=((0, 16),)),  # seq_len 12 needs 3 blocks
        1: RowBinding(1, 4, written=((0, 16),)),  # logical length 4
        2: RowBinding(2, 16, written=()),  # no blocks, nothing written
        3: RowBinding(0, 8, written=()),  # enough blocks, nothing written
        4: RowBinding(1, 16, written=((0, 16),)),  # no blocks
    }

    class ScriptedRows:
        def resolve(self, rid: str, sid: int | None, cid: str | None = None) -> RowBinding:
            assert sid is not None
            return bindings[sid]

        def record_writes(self, spans: Any) -> None:
            pass

    h.translator.rows = ScriptedRows()
    short_of_blocks = PagedRow("r", 1, 12, 11, sequence_id=0)
    prepare_error(
        h,
        (short_of_blocks, PagedRow("r", 1, 8, 7, sequence_id=1)),
        ValidationError,
        "installed allocation has logical length 4",
    )
    prepare_error(
        h,
        (PagedRow("r", 8, 8, 0, sequence_id=4), PagedRow("r", 1, 8, 7, sequence_id=3)),
        ValidationError,
        "short-query rows",
    )
    prepare_error(
        h,
        (short_of_blocks, PagedRow("r", 1, 8, 7, sequence_id=2)),
        ValidationError,
        r"row \('r', 0, None\) needs 3 blocks in cache group 0 for seq_len=12",
    )
    unread = (PagedRow("r", 1, 8, 7, sequence_id=3),)
    h.block_tables.max_num_batched_tokens = 0  # type: ignore[misc]
    prepare_error(h, unread, ValidationError, "paged batch has 1 tokens; worker capacity is 0")
    h.block_tables.max_num_batched_tokens = 8  # type: ignore[misc]
    prepare_error(h, unread, StateError, r"would read tokens \[\(0, 7\)\] that were never written")


def test_builder_failure_still_invalidates_older_batches() -> None:
    h, rec = make()
    h.install("r", [4])
    rows = (PagedRow("r", 4, 4, sequence_id=0),)
    old = h.translator.prepare(rows)
    rec.fail = True
    with pytest.raises(RuntimeError, match="builder failed"):
        h.translator.prepare(rows)
    with pytest.raises(StaleBatchError), h.translator.activate(old):
        pass


def test_activation_rules() -> None:
    h, _ = make()
    h.install("r", [4])
    rows = (PagedRow("r", 4, 4, sequence_id=0),)
    other, _ = make()
    other.install("r", [4])
    foreign = other.translator.prepare(rows)
    with (
        pytest.raises(ValidationError, match="belongs to a different translator"),
        h.translator.activate(foreign),
    ):
        pass
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        with pytest.raises(StateError, match="already active"), h.translator.activate(batch):
            pass
        with pytest.raises(StateError):
            h.registry.remove(["r"])
        with pytest.raises(StateError):
            h.registry.refresh_layout()
    assert h.translator.active_batch is None
    assert h.registry.remove(["r"]) == 1


# --- layer context -------------------------------------------------------------------------------------


def test_layer_context_rejections_leave_cache_untouched() -> None:
    h, _ = make()
    h.install("r", [9, 9])
    h.prefill("r", [9, 9])
    rows = (PagedRow("r", 6, 9, 3, sequence_id=0), PagedRow("r", 6, 9, 3, sequence_id=1))
    q, k, v = qkv(h, 12)
    before = h.cache_snapshot()
    batch = h.translator.prepare(rows)
    layer = h.layer_names[0]
    cases: list[tuple[Any, type[Exception], str]] = [
        ((layer, q, k, v, type("M", (), {"joint_attn_mask": 1})()), NotImplementedError, "joint_attn_mask"),
        ((layer, q, k, v, type("M", (), {"query_ranges": [(0, 1)]})()), NotImplementedError, "query_ranges"),
        (
            (layer, q, k, v, type("M", (), {"extra": {"b": 1, "a": 2}})()),
            NotImplementedError,
            r"extra=\['a', 'b'\]",
        ),
        (
            (layer, q, k, v, AttentionMetadata([[(5, 8)], [(5, 8)]], torch.ones(9, 9))),
            NotImplementedError,
            "requires a 4-D tensor",
        ),
        (("nope", q, k, v, None), KeyError, "unknown paged attention layer 'nope'"),
        ((layer, q.reshape(3, 4, 4, -1), k, v, None), ValidationError, "key token layout"),
        (
            (layer, q.reshape(3, 4, -1), k.reshape(3, 4, -1), v.reshape(3, 4, -1), None),
            ValidationError,
            r"\[rows=2, L >= every query_len\]",
        ),
        ((layer, q[None], k[None], v[None], None), ValidationError, r"batched layout \(1, 12\)"),
        (
            (layer, q.reshape(2, 2, 3, 4, -1), k.reshape(2, 2, 3, 4, -1), v.reshape(2, 2, 3, 4, -1), None),
            ValidationError,
            "packed",
        ),
        ((layer, q, k.double(), v, None), ValidationError, "key dtype must be torch.float32"),
        (
            (layer, q.reshape(12, -1)[:, :-1], k, v, None),
            ValidationError,
            r"must end in \(4, 64\) or \(256,\)",
        ),
    ]
    with h.translator.activate(batch):
        for args, exc, message in cases:
            with pytest.raises(exc, match=message):
                h.executor.forward(*args)
        h.executor.forward(layer, q, k, v, AttentionMetadata([[(5, 8)], [(5, 8)]]))
        with pytest.raises(ValidationError, match="changed between layers"):
            h.executor.forward(h.layer_names[1], q, k, v, AttentionMetadata([[(4, 8)], [(4, 8)]]))
    assert h.writes() == 1  # only the one successful call wrote
    del before


def test_strided_key_value_views_are_kept() -> None:
    h, _ = make()
    h.install("r", [8])
    rows = (PagedRow("r", 8, 8, sequence_id=0),)
    qkv_proj = torch.randn(8, 3, h.num_heads, h.head_size)
    q, k, v = qkv_proj[:, 0], qkv_proj[:, 1], qkv_proj[:, 2]
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        ctx = h.executor.context(h.layer_names[0], q, k, v)
        assert ctx.key.data_ptr() == k.data_ptr() and not ctx.key.is_contiguous()
        odd = torch.randn(8, h.head_size, h.num_heads).transpose(1, 2)  # inner dims not packed
        ctx2 = h.executor.context(h.layer_names[0], q, odd, v)
        assert ctx2.key.is_contiguous()


def test_restore_output_into_caller_layout() -> None:
    h, _ = make()
    h.install("r", [3, 5])
    rows = (PagedRow("r", 3, 3, sequence_id=0), PagedRow("r", 5, 5, sequence_id=1))
    batch = h.translator.prepare(rows)
    q = torch.randn(2, 5, h.num_heads * h.head_size)
    k = torch.randn(2, 5, h.num_kv_heads * h.head_size)
    with h.translator.activate(batch):
        ctx = h.executor.context(h.layer_names[0], q, k, k)
        assert ctx.scatter_indices is not None and ctx.scatter_indices.tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
        marker = torch.arange(8.0)[:, None, None].expand(8, h.num_heads, h.head_size)
        restored = ctx.restore_output(marker)
    assert restored.shape == (2, 5, h.num_heads * h.head_size)
    assert restored[:, :, 0].tolist() == [[0, 1, 2, 0, 0], [3, 4, 5, 6, 7]]


# --- runtime ---------------------------------------------------------------------------------------------


def test_runtime_prepares_once_per_phase() -> None:
    h, rec = make()
    h.install("r", [9, 9])
    phases = PhaseRows(
        (PagedRow("r", 9, 9, sequence_id=0), PagedRow("r", 9, 9, sequence_id=1)),
        (PagedRow("r", 6, 9, 3, sequence_id=0), PagedRow("r", 6, 9, 3, sequence_id=1)),
    )
    runtime = BatchStepper(h.translator, phases)
    q, k, v = qkv(h, 18)
    with runtime.activate():
        assert runtime.ensure_active(0).num_tokens == 18
        assert runtime.ensure_active(0).num_tokens == 18
        for name in h.layer_names:  # step 0 writes every layer's pages
            h.executor.forward(name, q, k, v)
        b1 = runtime.ensure_active(1)
        assert runtime.ensure_active(2) is b1 and runtime.ensure_active(5) is b1
        assert runtime.preparations == 2 and len(rec.calls) == 2
    assert runtime.closed and h.translator.active_batch is None
    runtime.close()
    with pytest.raises(StateError, match="closed"):
        runtime.ensure_active(3)


def test_dcp_local_seq_lens() -> None:
    seq = torch.tensor([0, 1, 5, 8, 9, 17])
    assert dcp_local_seq_lens(seq, 2, 0, 1).tolist() == [0, 1, 3, 4, 5, 9]
    assert dcp_local_seq_lens(seq, 2, 1, 1).tolist() == [0, 0, 2, 4, 4, 8]
    assert dcp_local_seq_lens(seq, 4, 1, 2).tolist() == [0, 0, 2, 2, 2, 4]


def test_runtime_reads_phase_rows_when_a_phase_begins_and_wraps_the_hosts_activation() -> None:
    h, rec = make()
    h.install("r", [9, 9])
    prefill = (PagedRow("r", 9, 9, sequence_id=0), PagedRow("r", 9, 9, sequence_id=1))
    source = {Phase.PREFILL: prefill, Phase.DENOISE: prefill}
    asked: list[Phase] = []
    entered: list[int] = []

    def rows_of(phase: Phase) -> tuple[PagedRow, ...]:
        asked.append(phase)
        return source[phase]

    @contextlib.contextmanager
    def host_activation(batch: Any) -> Iterator[None]:
        with h.translator.activate(batch):
            entered.append(batch.num_tokens)
            yield

    runtime = BatchStepper(h.translator, phase_rows=rows_of, activation=host_activation)
    q, k, v = qkv(h, 18)
    with runtime.activate():
        runtime.ensure_active(0)
        for name in h.layer_names:
            h.executor.forward(name, q, k, v)
        source[Phase.DENOISE] = (PagedRow("r", 6, 9, 3, sequence_id=0),)  # replaced between steps
        assert runtime.ensure_active(1).num_tokens == 6
        assert runtime.ensure_active(2).num_tokens == 6
    assert asked == [Phase.PREFILL, Phase.DENOISE] and entered == [18, 6] and len(rec.calls) == 2
    assert h.translator.active_batch is None
    with pytest.raises(ValidationError, match="takes phases or phase_rows, not both"):
        BatchStepper(h.translator, PhaseRows(prefill, prefill), phase_rows=rows_of)

"""Piecewise attention: ``full_attn_spans`` -> aligned causal/full segments.

``full_attn_spans[row]`` lists half-open spans ``[a, b)`` in global sequence positions. A query
token inside a span sees every key ``< b`` (bidirectional inside the span); every other token is
causal. A row's query ``[q0, q0 + L)`` is cut at span boundaries into segments:

* a causal segment ``(s, e, kv_end=e)`` runs bottom-right aligned over keys ``[0, e)``;
* a full segment ``(s, e, kv_end=b)`` keeps the span's original end ``b``, so a query range that
  starts or stops inside a span still sees the whole span.

Rows of one batch may cut into different segment sequences (a row at prefill beside rows at
denoise, rows with different spans or none). The plan groups the rows' segments into native
calls: a row's ``j``-th segment of a mode joins that mode's ``j``-th call, so a batch takes
``sum over modes of max over rows (segments of that mode in the row)`` calls -- the least
possible, since one call serves at most one segment per row and one mode. A call carries only
the rows that have a segment in it. A uniform batch (every row the same sequence of modes)
keeps one call per segment index, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from diffusion_kv.core.attention.mode import AttentionMode, dense_piecewise_mask
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.transfer import to_device

Spans = tuple[tuple[tuple[int, int], ...], ...]

CAUSAL = AttentionMode.CAUSAL
FULL = AttentionMode.FULL


class Segment(NamedTuple):
    q_start: int
    q_end: int
    kv_end: int
    mode: AttentionMode


def build_segments(spans: Sequence[tuple[int, int]], query_offset: int, query_len: int) -> list[Segment]:
    """Cut one row's query range at its spans (see module docstring)."""
    q_end = query_offset + query_len
    cur = query_offset
    out: list[Segment] = []
    for a, b in spans:
        lo, hi = max(a, cur), min(b, q_end)
        if hi <= lo:
            continue
        if lo > cur:
            out.append(Segment(cur, lo, lo, CAUSAL))
        out.append(Segment(lo, hi, b, FULL))
        cur = hi
    if cur < q_end:
        out.append(Segment(cur, q_end, q_end, CAUSAL))
    return out


@dataclass(frozen=True, slots=True)
class PlanSegment:
    """One native call: the rows taking part, their segments and where their queries sit."""

    rows: tuple[int, ...]
    """Indices (into the batch's rows) of the rows in this call, in call order."""
    row_segments: tuple[Segment, ...]
    """One segment per entry of ``rows``."""
    query_indices: torch.Tensor
    """Positions in the packed ``[T]`` query axis, in call order."""
    query_range: tuple[int, int] | None
    """Set when ``query_indices`` is one contiguous run (view fast path)."""
    local_range: tuple[int, int] | None
    """Set when every row of the call uses the same range relative to its own query start."""
    num_batch_rows: int = 0
    """Rows in the whole batch (``rows`` may be a subset)."""

    @property
    def mode(self) -> AttentionMode:
        return self.row_segments[0].mode

    @property
    def all_rows(self) -> bool:
        """Every row of the batch takes part, in batch order."""
        return self.rows == tuple(range(self.num_batch_rows))


@dataclass(frozen=True, slots=True)
class PiecewisePlan:
    spans: Spans
    segments: tuple[PlanSegment, ...]
    num_query_tokens: int
    contiguous: bool
    """Segment query ranges tile ``[0, T)`` in order."""
    homogeneous_batch_shape: tuple[int, int] | None
    """``(rows, L)`` when every row has ``L`` queries and every segment a shared local range."""

    @property
    def single_call(self) -> bool:
        """One native call serves every query in packed order (e.g. CFG rows at denoise, target
        span only): the query and the output need no slicing."""
        return (
            len(self.segments) == 1
            and self.segments[0].all_rows
            and self.segments[0].query_range == (0, self.num_query_tokens)
        )


def _bound(value: object) -> int:
    """A span bound: a Python or 0-d integer tensor/NumPy value, never a float or a bool."""
    if type(value) is int:
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        return int(value.__index__())  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        raise ValidationError(f"full_attn_spans bounds must be integers; got {value!r}") from None


def freeze_spans(full_attn_spans: Sequence[Sequence[Sequence[int]]]) -> Spans:
    if isinstance(full_attn_spans, (str, bytes, torch.Tensor)):
        raise ValidationError(
            f"full_attn_spans must be per-row lists of (start, end) pairs; got {type(full_attn_spans).__name__}"
        )
    try:
        return tuple(tuple((_bound(a), _bound(b)) for a, b in row) for row in full_attn_spans)
    except ValidationError:
        raise
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"full_attn_spans must be per-row lists of (start, end) pairs: {exc}") from exc


def build_piecewise_plan(
    full_attn_spans: Sequence[Sequence[Sequence[int]]],
    query_offsets: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    device: torch.device | None = None,
    reorder_threshold: int | None = None,
) -> PiecewisePlan:
    """The calls for one batch (see the module docstring). With ``reorder_threshold`` (a
    backend that needs short queries first), each call lists rows whose segment has at most
    that many queries before the others."""
    spans = freeze_spans(full_attn_spans)
    n = len(query_lens)
    if n == 0:
        raise ValidationError("a piecewise plan needs at least one row")
    if not (len(spans) == len(query_offsets) == len(seq_lens) == n):
        raise ValidationError(
            f"full_attn_spans has {len(spans)} rows; the batch has {n} (one span list per row is required)"
        )
    per_row: list[list[Segment]] = []
    for r, (row_spans, q0, ql, sl) in enumerate(zip(spans, query_offsets, query_lens, seq_lens, strict=True)):
        prev = 0
        for a, b in row_spans:
            if not 0 <= a < b <= sl:
                raise ValidationError(
                    f"row {r}: span ({a}, {b}) must satisfy 0 <= start < end <= seq_len={sl}"
                )
            if a < prev:
                raise ValidationError(
                    f"row {r}: spans must be sorted and non-overlapping; got {list(row_spans)}"
                )
            prev = b
        if ql <= 0 or q0 < 0 or q0 + ql > sl:
            raise ValidationError(f"row {r}: query range [{q0}, {q0 + ql}) must lie in [0, seq_len={sl}]")
        per_row.append(build_segments(row_spans, q0, ql))
    # A row's j-th segment of a mode joins call (mode, j); calls are ordered by first appearance
    # scanning segment positions, so a uniform batch keeps one call per position, in order.
    members: dict[tuple[AttentionMode, int], list[tuple[int, Segment]]] = {}
    seen = [dict.fromkeys(AttentionMode, 0) for _ in range(n)]
    for i in range(max(len(s) for s in per_row)):
        for r, segs in enumerate(per_row):
            if i < len(segs):
                seg = segs[i]
                key = (seg.mode, seen[r][seg.mode])
                seen[r][seg.mode] += 1
                members.setdefault(key, []).append((r, seg))
    packed_offsets = [0]
    for ql in query_lens:
        packed_offsets.append(packed_offsets[-1] + ql)
    total = packed_offsets[-1]
    segments: list[PlanSegment] = []
    for entries in members.values():
        entries = sorted(entries, key=lambda e: e[0])  # batch order
        if reorder_threshold is not None:
            entries = sorted(entries, key=lambda e: e[1].q_end - e[1].q_start > reorder_threshold)
        rows = tuple(r for r, _ in entries)
        row_segments = tuple(seg for _, seg in entries)
        starts = [packed_offsets[r] + (s.q_start - query_offsets[r]) for r, s in entries]
        lens = [s.q_end - s.q_start for s in row_segments]
        pieces = [torch.arange(st, st + ln, dtype=torch.long) for st, ln in zip(starts, lens, strict=True)]
        indices = torch.cat(pieces)
        contiguous_run = all(starts[j] + lens[j] == starts[j + 1] for j in range(len(starts) - 1))
        query_range = (starts[0], starts[0] + sum(lens)) if contiguous_run else None
        local = {(s.q_start - query_offsets[r], s.q_end - query_offsets[r]) for r, s in entries}
        segments.append(
            PlanSegment(
                rows=rows,
                row_segments=row_segments,
                query_indices=to_device(indices, device) if device is not None else indices,
                query_range=query_range,
                local_range=local.pop() if len(local) == 1 else None,
                num_batch_rows=n,
            )
        )
    cursor = 0
    contiguous = True
    for call in segments:
        if call.query_range is None or call.query_range[0] != cursor:
            contiguous = False
            break
        cursor = call.query_range[1]
    contiguous = contiguous and cursor == total
    homogeneous = None
    if (
        n > 1
        and len(set(query_lens)) == 1
        and all(call.all_rows and call.local_range is not None for call in segments)
    ):
        homogeneous = (n, query_lens[0])
    return PiecewisePlan(spans, tuple(segments), total, contiguous, homogeneous)


def plan_call_count(segment_modes: Sequence[Sequence[AttentionMode]]) -> int:
    """Native calls a batch takes given each row's segment modes (the planner's rule)."""
    if not segment_modes:
        return 0
    return sum(max(list(row).count(mode) for row in segment_modes) for mode in AttentionMode)


SegmentRunner = Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]
"""``(query, native_metadata, out | None) -> out`` for one segment (pages are read in place)."""


def run_piecewise_plan(
    query: torch.Tensor,
    plan: PiecewisePlan,
    segment_metadata: Sequence[Any],
    runner: SegmentRunner,
    *,
    out_head_size: int,
) -> torch.Tensor:
    """Run every segment once and assemble ``[T, H, D]`` in packed query order."""
    if len(segment_metadata) != len(plan.segments):
        raise ValidationError(f"{len(segment_metadata)} segment metadata for {len(plan.segments)} segments")
    T, H = query.shape[0], query.shape[1]
    if plan.num_query_tokens != T:
        raise ValidationError(f"query has {T} tokens; the plan covers {plan.num_query_tokens}")
    if plan.homogeneous_batch_shape is not None:
        B, L = plan.homogeneous_batch_shape
        q3 = query.view(B, L, H, -1)
        outs = []
        for seg, md in zip(plan.segments, segment_metadata, strict=True):
            s, e = seg.local_range  # type: ignore[misc]
            q = q3[:, s:e].reshape(-1, H, q3.shape[-1])
            o = runner(q, md, None)
            _check_tokens(o, q.shape[0])
            outs.append(o.view(B, e - s, H, -1))
        if len(outs) == 1:  # one segment covers every query: its output is the result
            return outs[0].reshape(T, H, -1)
        return torch.cat(outs, dim=1).reshape(T, H, -1)
    output = query.new_empty((T, H, out_head_size))
    for seg, md in zip(plan.segments, segment_metadata, strict=True):
        if seg.query_range is not None:
            s, e = seg.query_range
            o = runner(query[s:e], md, output[s:e] if plan.contiguous else None)
            _check_tokens(o, e - s)
            if o.data_ptr() != output[s:e].data_ptr():
                output[s:e] = o
        else:
            idx = seg.query_indices
            o = runner(query.index_select(0, idx), md, None)
            _check_tokens(o, idx.shape[0])
            output.index_copy_(0, idx, o)
    return output


def _check_tokens(out: torch.Tensor, expected: int) -> None:
    if out.shape[0] != expected:
        raise ValidationError(f"segment runner returned {out.shape[0]} tokens; expected {expected}")


__all__ = [
    "PiecewisePlan",
    "PlanSegment",
    "Segment",
    "build_piecewise_plan",
    "build_segments",
    "dense_piecewise_mask",
    "freeze_spans",
    "plan_call_count",
    "run_piecewise_plan",
]

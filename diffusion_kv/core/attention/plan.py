"""The block plan: per row, which kv-blocks its queries skip, read in full, or read partially.

Built once when a batch is prepared (FlexAttention's ``BlockMask`` and FlashInfer's ``plan()``
are the anchors), from the group's :class:`~diffusion_kv.core.attention.mask.MaskSpec` and the
rows' query ranges; a backend reads it instead of re-deriving the mask per layer: a SKIP block
is never gathered (after retention released it, its table entry is the null entry), a FULL
block needs no mask, a PARTIAL block does.

Exact without a dense mask: a query sees at most the two runs ``[0, min(sink, hi))`` and
``[lo, hi)`` (mask.py), so the keys of block ``[s, e)`` it sees are counted by interval
arithmetic, for every (query, block) pair of the row at once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_kv.core.attention.mask import MaskSpec, key_bounds
from diffusion_kv.core.errors import ValidationError


class BlockKind(enum.IntEnum):
    SKIP = 0
    """No query of the row sees any key of the block."""
    PARTIAL = 1
    """Some query sees some, not every, key of the block (or some query sees none)."""
    FULL = 2
    """Every query of the row sees every key of the block."""


def _overlap(s: torch.Tensor, e: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.minimum(e, hi) - torch.maximum(s, lo), min=0)


def row_block_kinds(
    mask: MaskSpec,
    query_offset: int,
    query_len: int,
    seq_len: int,
    block_size: int,
    spans: Sequence[tuple[int, int]] = (),
    live_from: int = 0,
) -> torch.Tensor:
    """``[ceil(seq_len / block_size)]`` int8 :class:`BlockKind` of one row's blocks (``live_from``:
    the row skips keys in ``[sink, live_from)``, ``PagedRow.live_from``)."""
    n_blocks = -(-seq_len // block_size)
    if query_len == 0 or n_blocks == 0:
        return torch.zeros(n_blocks, dtype=torch.int8)
    if not spans:
        runs = mask.query_runs(query_offset, query_len, seq_len, live_from)
        if runs is not None:
            return _kinds_of_bounds(
                [(lo, hi) for _, lo, hi in runs], mask.sink, n_blocks, seq_len, block_size
            )
    return _row_block_kinds_tensor(mask, query_offset, query_len, seq_len, block_size, spans, live_from)


def _row_block_kinds_tensor(
    mask: MaskSpec,
    query_offset: int,
    query_len: int,
    seq_len: int,
    block_size: int,
    spans: Sequence[tuple[int, int]] = (),
    live_from: int = 0,
) -> torch.Tensor:
    """:func:`row_block_kinds` over every query's bounds as tensors (any mask, spans too)."""
    n_blocks = -(-seq_len // block_size)
    if query_len == 0 or n_blocks == 0:
        return torch.zeros(n_blocks, dtype=torch.int8)
    lo, hi, sink = key_bounds(mask, query_offset, query_len, seq_len, spans, live_from)
    # a block's kind depends on a query's (lo, hi) alone: one row per distinct pair (a chunk's
    # queries share one), not one per query
    width = max(seq_len, int(lo.max())) + 1  # 0 <= lo, hi < width: one int64 key per pair
    pairs = torch.unique(lo * width + hi)
    lo, hi = torch.div(pairs, width, rounding_mode="floor"), pairs % width
    # Only blocks meeting [0, min(sink, max hi)) or [min lo, max hi) can hold a visible key; every
    # other block is SKIP. Classifying just those keeps a long session's plan as cheap as a short
    # one's (its released blocks are most of the row).
    hi_max, lo_min = int(hi.max()), int(lo.min())
    sink_blocks = range(0, min(n_blocks, -(-min(sink, hi_max) // block_size)))
    window_start = min(lo_min // block_size, n_blocks)
    # (a live_from past every bound leaves the window run empty: lo > hi)
    window_blocks = range(window_start, max(window_start, min(n_blocks, -(-hi_max // block_size))))
    kinds = torch.zeros(n_blocks, dtype=torch.int8)  # SKIP
    if window_blocks.start <= sink_blocks.stop:
        candidates = torch.arange(0, max(sink_blocks.stop, window_blocks.stop), dtype=torch.long)
    else:
        candidates = torch.cat(
            [
                torch.arange(sink_blocks.start, sink_blocks.stop, dtype=torch.long),
                torch.arange(window_blocks.start, window_blocks.stop, dtype=torch.long),
            ]
        )
    if candidates.numel() == 0:
        return kinds
    starts = candidates * block_size
    ends = torch.clamp(starts + block_size, max=seq_len)
    s, e = starts[None, :], ends[None, :]
    lo_, hi_ = lo[:, None], hi[:, None]
    sink_hi = torch.clamp(hi_, max=sink)
    zero = torch.zeros_like(lo_)
    seen = (
        _overlap(s, e, lo_, hi_)
        + _overlap(s, e, zero, sink_hi)
        - _overlap(s, e, lo_, torch.minimum(hi_, sink_hi))
    )
    picked = torch.full((candidates.numel(),), int(BlockKind.PARTIAL), dtype=torch.int8)
    picked[(seen == 0).all(dim=0)] = int(BlockKind.SKIP)
    picked[(seen == (e - s)).all(dim=0)] = int(BlockKind.FULL)
    kinds[candidates] = picked
    return kinds


_FULL, _PARTIAL = int(BlockKind.FULL), int(BlockKind.PARTIAL)
_FULL_BYTES, _PARTIAL_BYTES = bytes([_FULL]), bytes([_PARTIAL])


def _seen_blocks(lo: int, hi: int, sink: int, n_blocks: int, seq_len: int, block_size: int) -> bytearray:
    """What one bound's queries see of each block, as a :class:`BlockKind` value per block:
    none (SKIP), some keys (PARTIAL) or every key (FULL) of the keys ``[0, min(hi, sink)) |
    [lo, hi)``, by whole slices of blocks -- no per-block loop."""
    seen = bytearray(n_blocks)  # SKIP
    sink_hi = min(hi, sink)
    runs = [(0, hi)] if lo <= sink_hi else [(0, sink_hi), (lo, hi)]
    last = n_blocks - 1
    for a, b in runs:
        b = min(b, seq_len)
        if a >= b:
            continue
        first_touch, last_touch = a // block_size, (b - 1) // block_size
        seen[first_touch : last_touch + 1] = _PARTIAL_BYTES * (last_touch + 1 - first_touch)
        # a block is whole inside [a, b) when it starts at or past a and ends at or before b;
        # the last block ends at seq_len, not at a block boundary
        first_full = -(-a // block_size)
        stop_full = b // block_size  # blocks [first_full, stop_full) end at or before b
        if stop_full > first_full:
            seen[first_full:stop_full] = _FULL_BYTES * (stop_full - first_full)
        if b == seq_len and last * block_size >= a and stop_full <= last:
            seen[last] = _FULL
    return seen


def _kinds_of_bounds(
    bounds: list[tuple[int, int]], sink: int, n_blocks: int, seq_len: int, block_size: int
) -> torch.Tensor:
    """:func:`row_block_kinds` from the distinct bounds of a row's queries, in Python ints:
    each bound's visible keys are at most two runs, so what it sees of every block is a few
    slices (:func:`_seen_blocks`); a block is FULL where every bound sees all of it, SKIP
    where none sees any of it, PARTIAL otherwise (one bound: its own view, as it is)."""
    if not n_blocks:
        return torch.zeros(0, dtype=torch.int8)
    first = _seen_blocks(*bounds[0], sink, n_blocks, seq_len, block_size)
    if len(bounds) == 1:
        return torch.frombuffer(first, dtype=torch.int8)  # (no copy: the bytearray is the tensor's)
    views = np.stack(
        [
            np.frombuffer(_seen_blocks(lo, hi, sink, n_blocks, seq_len, block_size), dtype=np.int8)
            for lo, hi in bounds
        ]
    )
    agree = (views == views[0]).all(axis=0)
    return torch.from_numpy(np.where(agree, views[0], np.int8(_PARTIAL)).astype(np.int8))


@dataclass(frozen=True)
class BlockPlan:
    """Per row of a batch, the :class:`BlockKind` of each of its kv-blocks (host tensors)."""

    mask: MaskSpec
    block_size: int
    """Tokens per block the plan counts in (the group's kernel block size)."""
    kinds: tuple[torch.Tensor, ...]
    """Per row, ``[ceil(seq_len / block_size)]`` int8."""
    live_from: tuple[int, ...] = ()
    """Per row, the start of the keys it may read past the sink (``PagedRow.live_from``: keys in
    ``[sink, live_from)`` are skipped even where the mask reaches them -- a re-cache pass after
    the window slid); empty when no row declares one. Only backends declaring
    ``Capabilities.supports_live_from`` are handed such rows; they apply :meth:`row_mask`."""

    def row_live_from(self, row: int) -> int:
        return self.live_from[row] if self.live_from else 0

    def row_mask(self, row: int, query_offset: int, query_len: int, seq_len: int) -> torch.Tensor:
        """The dense ``[query_len, seq_len]`` mask of one row, its ``live_from`` applied."""
        return self.mask.row_mask(query_offset, query_len, seq_len, live_from=self.row_live_from(row))

    def live_blocks(self, row: int) -> torch.Tensor:
        """Indices of the row's blocks some query reads (FULL or PARTIAL), ascending."""
        return torch.nonzero(self.kinds[row] != int(BlockKind.SKIP)).flatten()

    def counts(self) -> dict[str, int]:
        """Blocks of each kind over the batch (what the plan saves: ``skip``)."""
        allk = torch.cat(self.kinds) if self.kinds else torch.zeros(0, dtype=torch.int8)
        return {k.name.lower(): int((allk == int(k)).sum()) for k in BlockKind}


def build_block_plan(
    mask: MaskSpec,
    query_offsets: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    live_from: Sequence[int] | None = None,
) -> BlockPlan:
    """The plan of one batch's rows under ``mask`` (``spans`` per row, when it takes them;
    ``live_from`` per row, when a row skips keys past the sink)."""
    if type(block_size) is not int or block_size <= 0:
        raise ValidationError(f"block plan block_size must be a positive int; got {block_size!r}")
    n = len(query_lens)
    if (
        not (len(query_offsets) == len(seq_lens) == n)
        or (spans is not None and len(spans) != n)
        or (live_from is not None and len(live_from) != n)
    ):
        raise ValidationError(
            "a block plan takes one query offset, query length, seq_len (and span list, live_from) per row"
        )
    floors = tuple(live_from) if live_from is not None and any(live_from) else ()
    kinds = tuple(
        row_block_kinds(
            mask, q0, ql, sl, block_size, spans[r] if spans is not None else (), floors[r] if floors else 0
        )
        for r, (q0, ql, sl) in enumerate(zip(query_offsets, query_lens, seq_lens, strict=True))
    )
    return BlockPlan(mask, block_size, kinds, floors)

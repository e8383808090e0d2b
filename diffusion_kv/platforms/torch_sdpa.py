"""Device-neutral torch helpers of the platform plugins: paged attention by gather (or view) +
torch SDPA.

Any plugin may build on this module; no plugin imports another. The ``cpu`` plugin's ``sdpa``
backend is :class:`TorchSdpaBackend` as it is; the ``cuda`` plugin's backends extend it with the
in-place Triton way and choose per batch.

The gather + SDPA way groups a batch's rows by shape (one SDPA call per shape and layer), reads a
group's pages as a strided view of the cache when they form evenly spaced contiguous runs (no
gather), and, under decode context parallelism, returns the partial with its natural-log
log-sum-exp over this rank's keys (torch's memory-efficient kernel on CUDA, the CPU flash
kernel elsewhere), the staircase causal mask built once at ``build``. Nothing here imports a
vendor module or depends on the device type beyond choosing torch's kernel.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from diffusion_kv.core.attention import AttentionMode, BlockPlan, MaskSpec, key_bounds
from diffusion_kv.core.backend import GroupContext, LayerRunner, PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry, PagedBatch, key_value_caches, write_pages
from diffusion_kv.core.capabilities import Requirements
from diffusion_kv.core.errors import UnsupportedFeatureError, ValidationError
from diffusion_kv.core.kv_quant import dequantize
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.transfer import to_device
from diffusion_kv.core.translate import dcp_local_seq_lens

__all__ = [
    "BIAS_ALIGN",
    "ROW_SHAPES_CACHE_SIZE",
    "CudaPagedMetadata",
    "KernelWay",
    "RowShapes",
    "SdpaRowGroup",
    "TorchSdpaBackend",
    "contiguous_run",
    "dcp_causal_mask",
    "page_view",
    "planned_blocks",
    "planned_row_groups",
    "planned_tokens",
    "row_shapes",
    "sdpa_row_groups",
    "sdpa_with_lse",
    "to_device",
    "token_view",
    "uniform_key_runs",
]

ROW_SHAPES_CACHE_SIZE = 64
"""Row shapes (with their device row indices) a :class:`TorchSdpaBackend` keeps, by batch shape
(the oldest is dropped first)."""

BIAS_ALIGN = 16
"""The memory-efficient SDPA kernel wants the rows of an additive mask 16-element aligned."""


@dataclass(frozen=True)
class SdpaRowGroup:
    """Rows sharing one (query_len, seq_len) shape: one gather (or view) + one SDPA call per layer."""

    query_len: int
    seq_len: int
    rows: tuple[int, ...]
    row_index: torch.Tensor | None  # device indices when the rows are not consecutive
    view: tuple[int, int] | None = None
    """``(first kernel block, kernel blocks from one row's start to the next)`` when every row's
    pages form one contiguous run and the runs are evenly spaced: K/V are then read as a strided
    view of the cache, with no gather."""
    kv_len: int | None = None
    """Keys read from this rank's pages: the local keys under DCP; None means ``seq_len``."""
    bias: torch.Tensor | None = None
    """DCP causal partials: additive mask ``[1, 1, G * query_len, keys]`` (0 or -inf) over the
    query heads of one KV head folded into the query sequence (``G = H // Hkv``); None when
    every query sees every local key."""
    visible: torch.Tensor | None = None
    """DCP causal partials: ``[query_len]`` bool, whether a query sees any local key; None when
    every query does."""
    live: torch.Tensor | None = None
    """A planned mask (chunk, window, sink): device indices of the kernel blocks the group's rows
    read, ascending (the block plan's FULL and PARTIAL blocks; SKIP blocks, released ones
    included, are never gathered). ``kv_len`` then counts the keys they hold below ``seq_len``."""
    key_mask: torch.Tensor | None = None
    """A planned mask: ``[query_len, kv_len]`` bool on the device, which live key each query
    sees; None when every query sees every live key (FULL blocks only)."""
    live_host: tuple[int, ...] = ()
    """A planned mask: ``live`` on the host (the block-table columns the group reads)."""
    live_runs: tuple[tuple[int, int], ...] | None = None
    """A planned mask on the CPU, one row: ``(first kernel block, count)`` runs of the cache
    holding the live blocks in ``live``'s order, set per batch from its placement: K/V are then
    one view of the cache (one run) or a concatenation of a few slices, not an indexed gather."""
    key_runs: tuple[tuple[int, int], ...] = ()
    """A planned mask under which every query of the group sees the same keys (one whole chunk,
    block-causal by chunk) and some live block holds keys no query sees (a chunk boundary
    inside a block): those keys as ``[start, end)`` position runs (at most two: the sink and the
    window). The group then reads exactly them, token by token, with no mask (``key_mask``
    None). Empty otherwise."""
    key_pos: torch.Tensor | None = None
    """With ``key_runs``: ``[kv_len]`` device positions of the visible keys, ascending."""
    tokens: torch.Tensor | None = None
    """With ``key_runs``: ``[rows * kv_len]`` device cache slots (kernel block x page + offset) of
    the visible keys, row after row, made per batch at ``build`` from its block table (never
    cached by shape: the placement changes as a session's window slides). One ``index_select``
    per K and V per layer reads them."""
    blocks: torch.Tensor | None = None
    """A planned group read by block: ``[rows * len(live)]`` device kernel-block ids of its live
    blocks, row after row, made per batch at ``build`` from its block table (never cached by
    shape), so a layer's gather is one ``index_select`` per K and V."""
    token_view: tuple[int, int] | None = None
    """With ``tokens``, on the CPU, one row: ``(first slot, count)`` when the visible keys fill one
    run of cache slots: K/V are then a view of the cache, nothing gathered."""

    @property
    def contiguous(self) -> bool:
        return self.row_index is None

    @property
    def keys(self) -> int:
        return self.seq_len if self.kv_len is None else self.kv_len


def _placed_copy(grp: SdpaRowGroup, **placement: Any) -> SdpaRowGroup:
    """``dataclasses.replace(grp, **placement)`` without re-running the frozen ``__init__`` (17
    guarded field writes, a per-batch cost on the CPU): the fields copied, the placement's set.
    Only for the per-batch placement fields (the group's own were checked when it was made)."""
    new = object.__new__(SdpaRowGroup)
    fields = new.__dict__
    fields.update(grp.__dict__)
    fields.update(placement)
    return new


def contiguous_run(ids: tuple[int, ...], ratio: int, count: int) -> int | None:
    """The first kernel block when the first ``count`` kernel blocks of a row (scheduler ids
    ``ids``, ``ratio`` kernel blocks each) are consecutive, else None."""
    needed = -(-count // ratio)
    if len(ids) < needed:
        return None
    first = ids[0]
    if needed <= 1:
        return first * ratio
    if ids[needed - 1] != first + needed - 1:  # rejects most placements at once
        return None
    return first * ratio if tuple(ids[:needed]) == tuple(range(first, first + needed)) else None


RowShapes = tuple[tuple[int, int, tuple[int, ...], "torch.Tensor | None"], ...]
"""``(query_len, seq_len, rows, device row index or None when the rows are consecutive)`` per
row shape of a batch, rows without queries left out."""


def row_shapes(qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device) -> RowShapes:
    """A batch's rows grouped by shape (the part of :func:`sdpa_row_groups` that depends on the
    lengths alone)."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for r in range(len(seq)):
        shapes.setdefault((qsl[r + 1] - qsl[r], seq[r]), []).append(r)
    out = []
    for (ql, sl), rows in shapes.items():
        if ql == 0:  # a row without queries in this (piecewise) segment
            continue
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        index = None if consecutive else to_device(torch.tensor(rows, dtype=torch.long), device)
        out.append((ql, sl, tuple(rows), index))
    return tuple(out)


def page_view(
    rows: tuple[int, ...], seq_len: int, host_block_ids: tuple[tuple[int, ...], ...], ratio: int, page: int
) -> tuple[int, int] | None:
    """``SdpaRowGroup.view`` for rows of ``seq_len`` keys placed at ``host_block_ids``."""
    if not host_block_ids:
        return None
    nblk = -(-seq_len // page)
    starts: list[int] = []
    for r in rows:  # stop at the first row whose pages are not one run
        start = contiguous_run(host_block_ids[r], ratio, nblk)
        if start is None:
            return None
        starts.append(start)
    first = starts[0]
    step = (starts[1] - first) if len(starts) > 1 else nblk
    evenly = all(st == first + i * step for i, st in enumerate(starts))
    return (first, step) if evenly and step >= nblk else None


def sdpa_row_groups(
    qsl: tuple[int, ...],
    seq: tuple[int, ...],
    device: torch.device,
    host_block_ids: tuple[tuple[int, ...], ...] = (),
    ratio: int = 1,
    page: int = 1,
    shapes: RowShapes | None = None,
    kv_lens: tuple[int, ...] | None = None,
) -> tuple[SdpaRowGroup, ...]:
    """Rows grouped by shape, each group read as a strided view of the cache when its pages
    allow it; ``shapes`` is ``row_shapes(qsl, seq, device)`` when the caller has it already.
    ``kv_lens`` are the keys each row reads from this rank's pages when they differ from
    ``seq`` (DCP; equal within a group); a group with no local keys is left out."""
    if shapes is None:
        shapes = row_shapes(qsl, seq, device)
    groups = []
    for ql, sl, rows, index in shapes:
        kv_len = None if kv_lens is None else kv_lens[rows[0]]
        keys = sl if kv_len is None else kv_len
        if keys == 0:  # no key of these rows lives on this rank
            continue
        view = page_view(rows, keys, host_block_ids, ratio, page)
        groups.append(SdpaRowGroup(ql, sl, rows, index, view, kv_len))
    return tuple(groups)


def uniform_key_runs(
    mask: MaskSpec, query_offset: int, query_len: int, seq_len: int, live_from: int = 0
) -> tuple[tuple[int, int], ...] | None:
    """The keys every query of one row sees, as ascending ``[start, end)`` runs (at most two,
    none empty), when every query sees the same keys; None when what they see differs.

    A query sees ``[0, min(sink, hi)) u [lo, hi)`` (``key_bounds``); written canonically as
    ``[0, a) u [b, c)`` with ``a < b`` or ``a == b == 0``, two queries see the same keys exactly
    when their ``(a, b, c)`` agree. O(query_len), no dense mask."""
    if query_len <= 0:
        return None
    runs = mask.query_runs(query_offset, query_len, seq_len, live_from)
    if runs is not None:  # a few distinct (lo, hi) (one per chunk the queries meet): Python ints
        sink_ints = mask.sink
        seen = set()
        for _, low, high in runs:
            sink_stop = min(high, sink_ints)
            nothing = low >= high
            one_run = nothing or low <= sink_stop
            seen.add((0 if one_run else sink_stop, 0 if one_run else low, sink_stop if nothing else high))
        if len(seen) != 1:
            return None
        ((a_i, b_i, c_i),) = seen
        return tuple((x, y) for x, y in ((0, a_i), (b_i, c_i)) if y > x)
    lo, hi, sink = key_bounds(mask, query_offset, query_len, seq_len, live_from=live_from)
    sink_end = torch.clamp(hi, max=sink)
    empty = lo >= hi  # no window keys: the sink part alone
    merged = empty | (lo <= sink_end)  # one run from 0
    a = torch.where(merged, 0, sink_end)
    b = torch.where(merged, 0, lo)
    c = torch.where(empty, sink_end, hi)
    abc = torch.stack([a, b, c])
    first = abc[:, :1]
    if not bool((abc == first).all()):
        return None
    a0, b0, c0 = (int(x) for x in first.flatten().tolist())
    return tuple((x, y) for x, y in ((0, a0), (b0, c0)) if y > x)


def planned_row_groups(
    qsl: tuple[int, ...],
    seq: tuple[int, ...],
    plan: BlockPlan,
    device: torch.device,
    shapes: RowShapes | None = None,
) -> tuple[SdpaRowGroup, ...]:
    """Rows grouped by shape under a planned mask (chunk, window, sink), each group reading
    only what its queries see:

    * every query sees the same keys (the session case: the queries are one whole chunk) and
      they fill the live blocks (the last one cut at ``seq_len``): the live blocks, gathered
      (or viewed), no mask;
    * every query sees the same keys, but a chunk boundary cuts a live block: exactly those
      keys (``key_runs``, ``key_pos``; the per-batch cache slots, ``tokens``, are made at
      ``build`` by :meth:`TorchSdpaBackend._placed`), no mask, so the per-layer call is a dense
      unmasked SDPA (cuDNN / FlashAttention on CUDA) over the visible keys;
    * what the queries see differs: the live blocks with the exact ``key_mask`` over their keys.

    Rows of one shape and one ``live_from`` have one plan (the plan of a row is a function of
    the mask, its query offset ``seq_len - query_len``, its lengths and its ``live_from``), so a
    group shares its live blocks and its mask; everything is made here, once per batch shape,
    so the per-layer path only launches work."""
    if shapes is None:
        shapes = row_shapes(qsl, seq, device)
    page = plan.block_size
    split: list[tuple[int, int, tuple[int, ...], torch.Tensor | None]] = []
    for ql, sl, rows, index in shapes:
        # rows of one shape share a plan unless their live_from differs (a re-cache's window
        # forward beside other rows): each live_from is a group of its own
        if not plan.live_from:
            split.append((ql, sl, rows, index))
            continue
        starts = {plan.row_live_from(r) for r in rows}
        if len(starts) == 1:
            split.append((ql, sl, rows, index))
            continue
        for start in sorted(starts):
            part = tuple(r for r in rows if plan.row_live_from(r) == start)
            split.append((ql, sl, part, to_device(torch.tensor(part, dtype=torch.long), device)))
    groups = []
    for ql, sl, rows, index in split:
        live_from = plan.row_live_from(rows[0])
        live = plan.live_blocks(rows[0])
        n_live = int(live.numel())
        if n_live == 0:
            continue
        live_host = tuple(live.tolist())
        runs = uniform_key_runs(plan.mask, sl - ql, ql, sl, live_from)
        if runs is not None:
            kv_len = sum(e - s for s, e in runs)
            # keys the live blocks hold below seq_len (only the last live block may pass it)
            block_keys = n_live * page - max(0, (live_host[-1] + 1) * page - sl)
            if kv_len == block_keys:  # the live blocks' keys, all of them: read by block
                groups.append(
                    SdpaRowGroup(
                        ql, sl, rows, index, None, kv_len, live=to_device(live, device), live_host=live_host
                    )
                )
                continue
            pos = torch.cat([torch.arange(s, e, dtype=torch.long) for s, e in runs])
            groups.append(
                SdpaRowGroup(
                    ql,
                    sl,
                    rows,
                    index,
                    None,
                    kv_len,
                    live=to_device(live, device),
                    live_host=live_host,
                    key_runs=runs,
                    key_pos=to_device(pos, device),
                )
            )
            continue
        key_pos = (live[:, None] * page + torch.arange(page, dtype=torch.long)[None, :]).flatten()
        key_pos = key_pos[key_pos < sl]  # ascending: only the last live block may pass seq_len
        # over the gathered keys alone: a dense [query_len, seq_len] mask would grow with the
        # row's absolute length (a long session's released keys are most of it)
        visible = plan.mask.key_mask(sl - ql, ql, sl, key_pos, live_from=live_from)
        key_mask = None if bool(visible.all()) else to_device(visible, device)
        groups.append(
            SdpaRowGroup(
                ql,
                sl,
                rows,
                index,
                None,
                int(key_pos.numel()),
                live=to_device(live, device),
                key_mask=key_mask,
                live_host=live_host,
            )
        )
    return tuple(groups)


def planned_tokens(grp: SdpaRowGroup, block_table: torch.Tensor, page: int) -> torch.Tensor:
    """``SdpaRowGroup.tokens`` of a ``key_runs`` group over this batch's ``block_table`` (kernel
    block ids per row): device ops only, no host synchronisation."""
    assert grp.key_pos is not None
    R = len(grp.rows)
    if grp.row_index is None:
        table = block_table[grp.rows[0] : grp.rows[0] + R]
    else:
        table = block_table.index_select(0, grp.row_index)
    cols = torch.div(grp.key_pos, page, rounding_mode="floor")
    return (table.index_select(1, cols).long() * page + grp.key_pos % page).reshape(-1)


def planned_blocks(grp: SdpaRowGroup, block_table: torch.Tensor) -> torch.Tensor:
    """``SdpaRowGroup.blocks`` of a planned group read by block over this batch's
    ``block_table``: device ops only, no host synchronisation."""
    assert grp.live is not None
    R = len(grp.rows)
    if grp.row_index is None:
        table = block_table[grp.rows[0] : grp.rows[0] + R]
    else:
        table = block_table.index_select(0, grp.row_index)
    return table.index_select(1, grp.live).reshape(-1).long()


def token_view(tokens: torch.Tensor) -> tuple[int, int] | None:
    """``SdpaRowGroup.token_view`` of one row's host ``tokens``: ``(first, count)`` when they are
    consecutive slots, else None."""
    n = int(tokens.numel())
    if n == 0:
        return None
    first = int(tokens[0])
    if int(tokens[-1]) - first != n - 1:  # rejects most placements at once
        return None
    return (first, n) if bool((tokens.diff() == 1).all()) else None


MAX_WRITE_RUNS = 4
"""At most this many runs of consecutive cache slots are written by slice copies (more: one
indexed copy). A slice ``copy_`` of a 64-token chunk took about 5 us against 11 us for
``index_copy_`` (128 tokens: 10 against 36 us; 4 or 8 heads x 64 float32, 2 threads)."""


def slot_runs(slots: torch.Tensor, limit: int = MAX_WRITE_RUNS) -> tuple[tuple[int, int, int], ...] | None:
    """A CPU slot mapping ``[T]`` as ``(first token, first slot, count)`` runs of consecutive
    real slots, in token order; None when empty, more than ``limit`` runs or a padding slot
    (``< 0``) is met."""
    a = slots.numpy()
    n = int(a.size)
    if n == 0:
        return None
    first = int(a[0])
    steps = a[1:] - a[:-1]
    if first >= 0 and (steps == 1).all():  # one run (a chunk's slots, mostly): no break search
        return ((0, first, n),)
    breaks = np.flatnonzero(steps != 1).tolist()
    if len(breaks) >= limit:
        return None
    starts = [0, *(b + 1 for b in breaks)]
    ends = [*starts[1:], n]
    firsts = a[starts].tolist()
    if min(firsts) < 0:
        return None
    return tuple((a, f, e - a) for a, f, e in zip(starts, firsts, ends, strict=True))


MAX_LIVE_RUNS = 1
"""At most this many runs of cache blocks are read as slices (more: the indexed gather). One: a
single run is a view of the cache (nothing copied); a concatenation of several slices measured
no faster than the gather on the CPU (20 blocks of 16 x 4 x 64 float32 in 3 runs: about 20 us
either way, 1 thread)."""


def order_free(grp: SdpaRowGroup, page: int) -> bool:
    """Whether a planned group's live blocks may be read in any order: every query sees every
    key of every live block (no ``key_mask``, none cut at ``seq_len``), so attention over them
    is a sum over one set of keys. Reading them in cache order then turns a session's ring of
    window blocks (sink, the window's tail, its head) into one run of the cache: a view instead
    of a gather. The keys' order changes only the kernel's summation order (results agree to
    float rounding, not bit for bit, with the table-order gather)."""
    return grp.key_mask is None and grp.bias is None and grp.keys == len(grp.live_host) * page


def live_runs(
    grp: SdpaRowGroup, host_block_ids: tuple[tuple[int, ...], ...], ratio: int, page: int = 0
) -> tuple[tuple[int, int], ...] | None:
    """``SdpaRowGroup.live_runs`` of a one-row planned group placed at ``host_block_ids``
    (scheduler ids, ``ratio`` kernel blocks each, ``page`` keys per kernel block); None for
    several rows, an unknown placement or more than :data:`MAX_LIVE_RUNS` runs. The runs follow
    the block table's order, or the cache's where the group is :func:`order_free` (``page``
    given)."""
    if len(grp.rows) != 1 or not grp.live_host or not host_block_ids:
        return None
    ids = host_block_ids[grp.rows[0]]
    if (grp.live_host[-1] // ratio) >= len(ids):
        return None
    blocks = [ids[col // ratio] * ratio + col % ratio for col in grp.live_host]
    if page and order_free(grp, page):
        blocks.sort()
    runs: list[list[int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1][1] += 1
        elif len(runs) == MAX_LIVE_RUNS:
            return None
        else:
            runs.append([block, 1])
    return tuple((a, n) for a, n in runs)


def dcp_causal_mask(
    grp: SdpaRowGroup,
    heads_per_kv: int,
    cp_size: int,
    cp_rank: int,
    interleave: int,
    dtype: torch.dtype,
    device: torch.device,
) -> SdpaRowGroup:
    """``grp`` with the DCP causal ``bias`` and ``visible`` its partial needs (built on the
    device at ``build`` from host lengths; no synchronisation).

    Query ``m`` of the group sits at absolute position ``seq_len - query_len + m`` and sees the
    local keys at absolute positions up to it: a prefix of the local keys (their positions grow
    with their index) of length ``dcp_local_seq_lens(position + 1)``.
    """
    ql, sl, keys = grp.query_len, grp.seq_len, grp.keys
    positions = torch.arange(sl - ql, sl, dtype=torch.int32)
    seen = dcp_local_seq_lens(positions + 1, cp_size, cp_rank, interleave)  # host, [ql]
    least = int(seen.min())
    bias = visible = None
    if least < keys:
        counts = to_device(seen.repeat(heads_per_kv), device)  # folded row g * ql + m
        padded = cdiv(keys, BIAS_ALIGN) * BIAS_ALIGN
        cols = torch.arange(padded, device=device)
        full = torch.zeros((heads_per_kv * ql, padded), dtype=dtype, device=device)
        full.masked_fill_(cols[None, :] >= counts[:, None], float("-inf"))
        bias = full[:, :keys][None, None]
    if least == 0:
        visible = to_device(seen > 0, device)
    return replace(grp, bias=bias, visible=visible)


def _flash_serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether torch's FlashAttention kernel (``aten::_scaled_dot_product_flash_attention``)
    takes these CUDA inputs as they are: fp16/bf16, one dtype, equal heads, a head size that is a
    multiple of 8 up to 256 (SDPA's dispatcher pads other sizes; a direct call does not), the
    last dimension contiguous, and a device of compute capability 8.0 or newer."""
    d = query.shape[-1]
    if query.dtype not in (torch.float16, torch.bfloat16) or not (query.dtype == key.dtype == value.dtype):
        return False
    if d % 8 or d > 256 or key.shape[-1] != d or value.shape[-1] != d:
        return False
    if query.shape[1] != key.shape[1] or key.shape[1] != value.shape[1]:
        return False
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    return _sm80_or_newer(query.device.index)


_SM80: dict[int | None, bool] = {}


def _sm80_or_newer(index: int | None) -> bool:
    known = _SM80.get(index)
    if known is None:
        known = _SM80[index] = torch.cuda.get_device_capability(index)[0] >= 8
    return known


def sdpa_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, M, D]`` over ``[B, H, N, D]`` -> ``(out [B, H, M, D], natural-log lse [B, H, M]
    float32)``, with an optional additive ``bias`` ``[B, H, M, N]`` in the query's dtype.

    On CUDA without a bias: torch's FlashAttention kernel where it takes the inputs
    (:func:`_flash_serves`: fp16/bf16, head size a multiple of 8 up to 256, sm80+), its
    ``logsumexp`` natural-log ``[B, H, M]`` float32; otherwise (a bias, fp32, another head
    size) torch's memory-efficient kernel (cuDNN and FlashAttention take no such mask).
    Elsewhere (the CPU, under Triton's interpreter in CI): torch's CPU flash kernel. A query
    whose keys are all masked has an undefined result here: the caller masks it out.
    """
    m = query.shape[2]
    if query.device.type == "cuda":
        if bias is None and _flash_serves(query, key, value):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, 0.0, False, False, scale=scale
            )[:2]
            return out, lse[..., :m]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, False, scale=scale
        )[:2]
        return out, lse[..., :m]  # the kernel pads the LSE rows to a multiple of 32
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse


class KernelWay(enum.Enum):
    """How a cuda backend attends for one batch."""

    TRITON = "triton"
    """The Triton kernel reading the pages in place."""
    SDPA = "sdpa"
    """Gather each row's pages (or view them when contiguous), then torch SDPA (cuDNN)."""


@dataclass(frozen=True)
class CudaPagedMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    page: int
    host_query_start_loc: tuple[int, ...]
    host_seq_lens: tuple[int, ...]
    way: KernelWay
    reason: str
    tile_row: torch.Tensor | None = None
    tile_q0: torch.Tensor | None = None
    block_m: int = 64
    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    sdpa_groups: tuple[SdpaRowGroup, ...] = ()
    local_seq_lens: torch.Tensor | None = None
    """Under DCP, ``[num_reqs]`` keys of each row on this rank (device); None without DCP."""
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per (layer cache address, row group): the K/V strided views of contiguous pages, made by
    the batch's first layer and reused by the others (a layer's cache never moves)."""
    splits: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per layer cache object (by ``id``; the object is held in the entry, so no other takes
    its id while the batch lives): the cache and its key and value halves, split by the
    batch's first call on it."""
    biases: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per (row group, query heads per KV head, dtype): a planned mask's additive bias for the
    partial path, made by the batch's first call and reused by the others."""
    calls: dict[int, _BoundCall] = field(default_factory=dict, compare=False, repr=False)
    """Per layer cache object (by ``id``, the cache held in the entry): the batch's whole
    :meth:`TorchSdpaBackend.forward` resolved by its first call there, for the later calls on
    the same cache (the denoise steps of a chunk, the steps between two preparations) -- set
    only where one SDPA call covers every query in order, over K/V that are views of the cache
    (they read what later writes put there) or gathered by a block index the batch fixes."""
    gathers: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict, compare=False, repr=False)
    """Per row group (by ``id``; the group is held by ``sdpa_groups``): the block index its
    pages are gathered by and the blocks per row, made by the batch's first call and reused by
    every later one (no index conversion per layer)."""


def _uniform_row_group(md: CudaPagedMetadata, query_len: int) -> SdpaRowGroup | None:
    """The batch's one row group when it is one row of ``query_len`` queries that all see the
    same keys with no mask to apply (a planned group without ``key_mask``, or a non-causal row;
    no DCP bias or visibility): what :meth:`TorchSdpaBackend.forward_partial_extra` attends in
    one call. None otherwise. Host data only (no synchronisation)."""
    if md.way is not KernelWay.SDPA or md.cp_size != 1 or len(md.sdpa_groups) != 1:
        return None
    grp = md.sdpa_groups[0]
    if len(grp.rows) != 1 or grp.query_len != query_len:
        return None
    if grp.key_mask is not None or grp.bias is not None or grp.visible is not None:
        return None
    if grp.live is None and md.causal:  # a causal row: each query sees its own prefix
        return None
    return grp


def _row_view(cache: torch.Tensor, view: tuple[int, int], rows: int, tokens: int) -> torch.Tensor:
    """``[rows, tokens, Hkv, D]`` over ``cache`` ``[blocks, page, Hkv, D]``: row ``r`` starts at
    kernel block ``first + r * step``."""
    first, step = view
    page_elems = cache.stride(0)
    return cache.as_strided(
        (rows, tokens, cache.shape[2], cache.shape[3]),
        (step * page_elems, cache.stride(1), cache.stride(2), cache.stride(3)),
        cache.storage_offset() + first * page_elems,
    )


class _Gather(NamedTuple):
    """How a recorded call gathers its K/V from the pages at every call (pages that are not one
    strided view): the cache halves, the batch's block index (fixed at its first call) and the
    ``[R, blocks * page, Hkv, D]`` shape the gathered blocks take, cut to ``keys``."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_index: torch.Tensor
    shape: tuple[int, int, int, int]
    keys: int

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kt``, ``vt`` ``[R, Hkv, keys, D]``: the pages as they are now."""
        k = _gather_blocks(self.k_cache, self.block_index, self.shape, self.keys)
        v = _gather_blocks(self.v_cache, self.block_index, self.shape, self.keys)
        return k.transpose(1, 2), v.transpose(1, 2)


def _gather_blocks(
    cache: torch.Tensor, block_index: torch.Tensor, shape: tuple[int, int, int, int], keys: int
) -> torch.Tensor:
    """``[R, keys, Hkv, D]``: the blocks ``block_index`` of ``cache`` ``[blocks, page, Hkv, D]``
    as ``shape`` ``[R, blocks * page, Hkv, D]``, cut to the first ``keys`` of each row."""
    return cache.index_select(0, block_index).view(shape)[:, :keys]


def _block_index(md: CudaPagedMetadata, grp: SdpaRowGroup, blocks: int) -> tuple[torch.Tensor, int]:
    """The block index a row group's pages are gathered by and the blocks per row: a planned
    mask's live blocks, else the rows' first ``blocks`` table entries."""
    if grp.live is not None:
        index = grp.blocks if grp.blocks is not None else planned_blocks(grp, md.block_table)
        return index, grp.live.shape[0]
    first, rows = grp.rows[0], len(grp.rows)
    table = (
        md.block_table[first : first + rows, :blocks]
        if grp.row_index is None
        else md.block_table[grp.row_index, :blocks]
    )
    return table.reshape(-1).long(), blocks


class _BoundCall(NamedTuple):
    """One layer cache's resolved attention for a batch (``CudaPagedMetadata.calls``): the
    query's ``[R, ql, H, D]`` view shape, K/V as ``[R, Hkv, keys, D]`` views of the cache (or,
    with ``gather``, gathered from the pages by the batch's block index at every call), and the
    SDPA arguments the full path chose."""

    kv_cache: Any
    layer: LayerGeometry
    tokens: int
    q_shape: tuple[int, int, int, int]
    kt: torch.Tensor | None
    vt: torch.Tensor | None
    mask: Any
    """SDPA's ``attn_mask``: a planned group's bool key mask, a lower-right causal bias, or None."""
    is_causal: bool
    gqa: bool
    cudnn: bool
    gather: _Gather | None = None


class _WriteViews(NamedTuple):
    """One layer cache's slice-copy destinations for a batch (``TorchSdpaBackend._write_views``)."""

    kv_cache: Any
    key_dtype: torch.dtype
    value_dtype: torch.dtype
    runs: tuple[tuple[slice | None, torch.Tensor, torch.Tensor], ...] | None
    """``None``: the caches' pages do not flatten in place (the indexed copy writes)."""


def _write_run_views(
    k_cache: torch.Tensor, v_cache: torch.Tensor, runs: tuple[tuple[int, int, int], ...], tokens: int
) -> tuple[tuple[slice | None, torch.Tensor, torch.Tensor], ...]:
    """Per slot run ``(src, dst, n)``: the source slice of a layer's K/V (``None`` when one run
    covers all ``tokens``) and the destination views of the flat (``_flat``) caches."""
    nb, page = k_cache.shape[0], k_cache.shape[1]
    flat_k = k_cache.view(nb * page, *k_cache.shape[2:])
    flat_v = v_cache.view(nb * page, *v_cache.shape[2:])
    whole = len(runs) == 1 and runs[0][0] == 0 and runs[0][2] == tokens
    return tuple(
        (None if whole else slice(src, src + n), flat_k[dst : dst + n], flat_v[dst : dst + n])
        for src, dst, n in runs
    )


def _flat(cache: torch.Tensor) -> bool:
    """Whether ``cache`` ``[blocks, page, Hkv, D]``'s pages flatten into slots in place."""
    return cache.stride(0) == cache.shape[1] * cache.stride(1)


def _slot_range(cache: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """``[1, count, Hkv, D]``: the cache slots ``first ..`` (a view; the caller checked
    :func:`_flat`)."""
    nb, page = cache.shape[0], cache.shape[1]
    return cache.view(nb * page, *cache.shape[2:])[first : first + count].unsqueeze(0)


def _gather_slots(cache: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[len(tokens), Hkv, D]``: the cache slots ``tokens`` (block x page + offset), one indexed
    gather (by block and offset where the pages do not flatten in place)."""
    nb, page = cache.shape[0], cache.shape[1]
    if _flat(cache):
        return cache.view(nb * page, *cache.shape[2:]).index_select(0, tokens)
    return cache[torch.div(tokens, page, rounding_mode="floor"), tokens % page]


def _sdpa_priority(cuda: bool) -> contextlib.AbstractContextManager[Any]:
    """SDPA's kernel priority for a call: cuDNN, FlashAttention, memory-efficient, math on a
    CUDA device; nothing to enter on the host (the order names CUDA kernels only)."""
    if not cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    return sdpa_kernel(order, set_priority=True)


def _aliases(t: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether ``t`` lives in ``cache``'s memory (a view of it, not a copy)."""
    return t.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


def _congruent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two caches have the same shape, strides, dtype and device."""
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device


def _last_element(t: torch.Tensor) -> int:
    """The offset of ``t``'s last element from its first (-1 when empty)."""
    if t.numel() == 0:
        return -1
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def _rebased(view: torch.Tensor, base: torch.Tensor, other: torch.Tensor) -> torch.Tensor | None:
    """``view`` of ``base`` moved onto ``other`` (congruent with ``base``): the same shape and
    strides at the same element offset from ``other``'s start. None where ``view`` does not
    lie within ``base``'s memory (a gathered copy, or a view reaching past ``base``: nothing
    to move)."""
    if not _aliases(view, base) or any(st < 0 for st in view.stride()):
        return None
    offset = view.storage_offset() - base.storage_offset()
    if offset < 0 or offset + _last_element(view) > _last_element(base):
        return None
    return other.as_strided(view.shape, view.stride(), other.storage_offset() + offset)


def _runs_of(cache: torch.Tensor, runs: tuple[tuple[int, int], ...], keys: int) -> torch.Tensor:
    """``[1, keys, Hkv, D]``: the first ``keys`` keys of the cache blocks ``runs`` (``(first,
    count)``, in order): a view for one run, else one concatenation of the slices."""
    if len(runs) == 1:
        a, n = runs[0]
        part = cache[a : a + n]
    else:
        part = torch.cat([cache[a : a + n] for a, n in runs])
    return part.reshape(1, part.shape[0] * part.shape[1], cache.shape[2], cache.shape[3])[:, :keys]


def _planned_bias(md: CudaPagedMetadata, grp: SdpaRowGroup, per_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, per_kv * query_len, keys]`` additive mask (0 or -inf, rows 16-aligned) of a
    planned group's ``key_mask`` for the partial path, made by the batch's first call and reused
    by every later layer (kept in ``md.biases``). Not made at ``build``: only a direct
    ``forward_partial`` call reads it (the core calls it under DCP alone, which planned masks
    refuse), and ``forward`` passes the bool mask itself, so a bias made for every batch would
    double the mask's device memory for nothing."""
    at = (id(grp), per_kv, dtype)
    bias = md.biases.get(at)
    if bias is None:
        assert grp.key_mask is not None
        keys = grp.keys
        padded = cdiv(keys, BIAS_ALIGN) * BIAS_ALIGN
        full = torch.zeros((per_kv * grp.query_len, padded), dtype=dtype, device=grp.key_mask.device)
        full[:, :keys].masked_fill_(~grp.key_mask.repeat(per_kv, 1), float("-inf"))
        bias = md.biases[at] = full[:, :keys][None, None]
    return bias


class TorchSdpaBackend(PagedBackend):
    """Paged attention by gather (or view) + torch SDPA, on any torch device.

    Not registered by itself: a plugin subclasses it with its identity (``name``, ``platform``,
    ``priority``) and its capabilities. ``build`` groups the rows by shape (the shapes, with
    their device row indices, made once per batch shape), ``write_kv`` copies by slot without a
    host sync, ``forward`` / ``forward_partial`` call SDPA per row group.
    """

    retains_metadata: ClassVar[bool] = True
    """``build`` makes new row groups and per-batch caches each time; what it shares between
    batches (row shapes, planned groups) is never written after it is made. The write runs kept
    for the last built batch are checked against the slot mapping handed in, so an earlier
    batch's write takes the indexed copy."""

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        self._bind_dcp()
        layer = group.layers[0]
        self.group_ratio = layer.num_heads // layer.num_kv_heads
        self.kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self._cudnn_answers: dict[tuple[Any, ...], bool] = {}
        self._shapes: dict[tuple[tuple[int, ...], tuple[int, ...], torch.device], RowShapes] = {}
        self._planned: dict[
            tuple[tuple[int, ...], tuple[int, ...], torch.device, tuple[int, ...]], tuple[SdpaRowGroup, ...]
        ] = {}
        self._write_runs: tuple[torch.Tensor, int, tuple[tuple[int, int, int], ...]] | None = None
        """On the CPU, the last built batch's slot mapping, its version and its runs of
        consecutive slots (:func:`slot_runs`): ``write_kv_valid`` handed a view of the same
        memory (held here, so no other tensor can take its address) that was not written since
        (its version counter, shared by every view, unchanged) writes by slice copies."""
        self._write_views: dict[int, _WriteViews] = {}
        """Per layer cache object (by ``id``, the object held in the entry so no other can take
        the id), for the last built batch: the caches' dtypes and each slot run's source slice
        of the layer's K/V (``None``: the whole tensor) with its destination views of the two
        caches, made by the batch's first write into that cache (later layers reuse them)."""

    @classmethod
    def not_supported_reasons(cls, requirements: Requirements) -> list[str]:
        reasons = super().not_supported_reasons(requirements)
        planned = (
            AttentionMode.CHUNK_CAUSAL in requirements.attention_modes
            or requirements.window is not None
            or requirements.sink
        )
        if planned and requirements.dcp_size > 1:
            reasons.append(
                f"decode context parallelism (cp_size {requirements.dcp_size}) with a chunk-causal, "
                "windowed or sink mask (the gather + SDPA way plans such masks over a row's whole keys)"
            )
        return reasons

    @property
    def sdpa_reason(self) -> str:
        """Why a batch takes the gather + SDPA way (recorded in its metadata)."""
        return f"backend {self.name!r} always takes this way"

    def _row_shapes(self, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device) -> RowShapes:
        """:func:`row_shapes` of one batch shape, made once (its device row indices are never
        written after they are made, so a batch that holds them stays valid)."""
        key = (qsl, seq, device)
        shapes = self._shapes.get(key)
        if shapes is None:
            shapes = row_shapes(qsl, seq, device)
            if len(self._shapes) >= ROW_SHAPES_CACHE_SIZE:
                del self._shapes[next(iter(self._shapes))]
            self._shapes[key] = shapes
        return shapes

    def build(self, batch: PagedBatch) -> CudaPagedMetadata:
        self._write_runs = None
        self._write_views = {}
        slots = batch.slot_mapping
        # (an inference tensor -- a host running under torch.inference_mode -- has no version
        # counter to prove its slots unchanged at write time: it keeps the indexed copy)
        if slots.device.type == "cpu" and slots.dim() == 1 and not slots.is_inference():
            runs = slot_runs(slots)
            if runs is not None:
                self._write_runs = (slots, slots._version, runs)
        qsl = tuple(batch.query_start_loc_cpu.tolist())
        seq = tuple(batch.seq_lens_cpu.tolist())
        device = batch.query_start_loc.device
        if batch.block_plan is not None:
            return self._metadata(
                batch,
                qsl,
                seq,
                KernelWay.SDPA,
                self.sdpa_reason,
                dict(sdpa_groups=self._placed(batch, self._planned_groups(batch, qsl, seq, device), device)),
            )
        if self.cp_size > 1:
            local, local_dev = self._dcp_local(batch, device)
            groups = self._dcp_sdpa_groups(batch, qsl, seq, local, device)
            return self._metadata(
                batch, qsl, seq, KernelWay.SDPA, self.sdpa_reason, dict(sdpa_groups=groups), local_dev
            )
        g = self.group
        groups = sdpa_row_groups(
            qsl,
            seq,
            device,
            batch.host_block_ids,
            g.block_size // g.kernel_block_size,
            g.kernel_block_size,
            shapes=self._row_shapes(qsl, seq, device),
        )
        return self._metadata(batch, qsl, seq, KernelWay.SDPA, self.sdpa_reason, dict(sdpa_groups=groups))

    def _planned_groups(
        self, batch: PagedBatch, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device
    ) -> tuple[SdpaRowGroup, ...]:
        """:func:`planned_row_groups` of one batch shape, made once (the plan is a function of
        the group's mask, the rows' lengths and their live_from; released blocks are never read, so the
        placement does not enter)."""
        if self.cp_size > 1:
            raise UnsupportedFeatureError(
                f"backend {self.name!r}: decode context parallelism (cp_size {self.cp_size}) with the "
                f"planned mask {self.group.mask.describe()} is not implemented"
            )
        assert batch.block_plan is not None
        key = (qsl, seq, device, batch.block_plan.live_from)
        groups = self._planned.get(key)
        if groups is None:
            groups = planned_row_groups(
                qsl, seq, batch.block_plan, device, self._row_shapes(qsl, seq, device)
            )
            if len(self._planned) >= ROW_SHAPES_CACHE_SIZE:
                del self._planned[next(iter(self._planned))]
            self._planned[key] = groups
        return groups

    def _placed(
        self, batch: PagedBatch, groups: tuple[SdpaRowGroup, ...], device: torch.device
    ) -> tuple[SdpaRowGroup, ...]:
        """The planned groups with what this batch's placement decides (made per prepared batch,
        never cached by shape: the placement changes as a session's window slides):

        * a ``key_runs`` group: its visible keys' cache slots (``tokens``), device ops on the
          batch's block table (no host synchronisation; a captured graph is bound to its batch),
          and on the CPU, one row, ``token_view`` when they are one run of slots;
        * a group read by block: on the CPU, one row, ``live_runs`` where its live blocks are
          one run of the cache (in the cache's order where the group is :func:`order_free`);
          else its live blocks' ids (``blocks``), device ops as above.

        On the CPU a token gather of the visible keys measured no slower than a view of whole
        live blocks with the mask (``benchmarks/profile_session_gpu.py`` docstring), so a view is
        taken only where it needs no mask."""
        ratio = self.group.block_size // self.group.kernel_block_size
        page = self.group.kernel_block_size
        cpu = device.type == "cpu"
        out = []
        for grp in groups:
            if grp.key_pos is not None:
                tokens = planned_tokens(grp, batch.block_table, page)
                view = None
                if cpu and len(grp.rows) == 1:
                    # every query sees exactly these keys, unmasked: any order of them will do
                    view = token_view(tokens)
                    if view is None:
                        view = token_view(tokens.sort().values)
                out.append(_placed_copy(grp, tokens=tokens, token_view=view))
            elif cpu and (runs := live_runs(grp, batch.host_block_ids, ratio, page)) is not None:
                out.append(_placed_copy(grp, live_runs=runs))
            elif grp.live is not None:
                out.append(_placed_copy(grp, blocks=planned_blocks(grp, batch.block_table)))
            else:
                out.append(grp)
        return tuple(out)

    def _dcp_local(self, batch: PagedBatch, device: torch.device) -> tuple[tuple[int, ...], torch.Tensor]:
        """Under DCP, the keys of each row on this rank: on the host and on ``device``."""
        host = batch.dcp_local_seq_lens_cpu
        if host is None:
            host = dcp_local_seq_lens(batch.seq_lens_cpu, self.cp_size, self.cp_rank, self.cp_interleave)
        local = tuple(int(x) for x in host.tolist())
        local_dev = batch.dcp_local_seq_lens
        if local_dev is None:
            local_dev = to_device(host.to(torch.int32), device)
        return local, local_dev

    def _dcp_sdpa_groups(
        self,
        batch: PagedBatch,
        qsl: tuple[int, ...],
        seq: tuple[int, ...],
        local: tuple[int, ...],
        device: torch.device,
    ) -> tuple[SdpaRowGroup, ...]:
        """Under DCP, the row groups over this rank's keys, causal partials with their mask."""
        g = self.group
        groups = sdpa_row_groups(
            qsl,
            seq,
            device,
            batch.host_block_ids,
            g.block_size // g.kernel_block_size,
            g.kernel_block_size,
            kv_lens=local,
        )
        if batch.causal:
            layer = g.layers[0]
            groups = tuple(
                dcp_causal_mask(
                    grp,
                    self.group_ratio,
                    self.cp_size,
                    self.cp_rank,
                    self.cp_interleave,
                    layer.dtype,
                    device,
                )
                for grp in groups
            )
        return groups

    def _metadata(
        self,
        batch: PagedBatch,
        qsl: tuple[int, ...],
        seq: tuple[int, ...],
        way: KernelWay,
        reason: str,
        extra: dict[str, Any],
        local_seq_lens: torch.Tensor | None = None,
    ) -> CudaPagedMetadata:
        return CudaPagedMetadata(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=batch.slot_mapping,
            causal=batch.causal,
            page=self.group.kernel_block_size,
            host_query_start_loc=qsl,
            host_seq_lens=seq,
            way=way,
            reason=reason,
            local_seq_lens=local_seq_lens,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            cp_interleave=self.cp_interleave,
            **extra,
        )

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        k_cache, v_cache = key_value_caches(kv_cache)
        slots = slot_mapping[: key.shape[0]]
        # Route -1 slots to a scratch row so no host sync is needed.
        nb, page, hkv, d = k_cache.shape
        flat_k = k_cache.view(nb * page, hkv, d)
        flat_v = v_cache.view(nb * page, hkv, d)
        keep = slots >= 0
        idx = torch.where(keep, slots, torch.zeros_like(slots)).long()
        old_k = flat_k.index_select(0, idx)
        old_v = flat_v.index_select(0, idx)
        flat_k.index_copy_(0, idx, torch.where(keep[:, None, None], key.to(k_cache.dtype), old_k))
        flat_v.index_copy_(0, idx, torch.where(keep[:, None, None], value.to(v_cache.dtype), old_v))

    def write_kv_valid(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Every slot is real: one indexed copy per cache (no launcher, no padding mask); e4m3
        pages take the Triton writer, which quantises in the same pass."""
        if layer.kv_scales is not None:
            self.write_kv(layer, key, value, kv_cache, slot_mapping)
            return
        known = self._write_runs
        if (
            known is not None
            and slot_mapping._version == known[1]
            and key.shape[0] == known[0].shape[0]
            and (
                slot_mapping is known[0]  # the batch's own tensor: same memory, shape and strides
                or (
                    slot_mapping.data_ptr() == known[0].data_ptr()
                    and not slot_mapping.is_inference()
                    and slot_mapping.shape == known[0].shape
                    and slot_mapping.stride() == known[0].stride()
                )
            )
        ):
            hit = self._write_views.get(id(kv_cache))
            if hit is None or hit.kv_cache is not kv_cache:
                k_cache, v_cache = key_value_caches(kv_cache)
                hit = self._write_views[id(kv_cache)] = _WriteViews(
                    kv_cache,
                    k_cache.dtype,
                    v_cache.dtype,
                    _write_run_views(k_cache, v_cache, known[2], key.shape[0])
                    if _flat(k_cache) and _flat(v_cache)
                    else None,
                )
            if hit.runs is not None and key.dtype == hit.key_dtype and value.dtype == hit.value_dtype:
                # the batch's slots in a few runs (found at build): slice copies, no indexed copy
                for src, dst_k, dst_v in hit.runs:
                    dst_k.copy_(key if src is None else key[src])
                    dst_v.copy_(value if src is None else value[src])
                return
        k_cache, v_cache = key_value_caches(kv_cache)
        slots = slot_mapping[: key.shape[0]]
        write_pages(k_cache, slots, key)
        write_pages(v_cache, slots, value)

    def bind_layer(
        self, layer: LayerGeometry, kv_cache: KVCache, metadata: Any, slot_mapping: torch.Tensor
    ) -> LayerRunner | None:
        """The layer's recorded SDPA call (:attr:`CudaPagedMetadata.calls`) with its write: by
        the batch's slot runs (slice copies into the pages) where :meth:`write_kv_valid` took
        them, else through :meth:`write_kv_valid` itself (so a subclass's writer, or a wrapper
        set on the instance, still does the writing)."""
        if type(self).forward is not TorchSdpaBackend.forward:
            return None  # a subclass's own forward: nothing here knows what it does
        return self._bind_sdpa(layer, kv_cache, metadata, slot_mapping)

    def bind_layer_like(
        self,
        layer: LayerGeometry,
        kv_cache: KVCache,
        metadata: Any,
        slot_mapping: torch.Tensor,
        like: LayerGeometry,
        like_kv_cache: KVCache,
    ) -> LayerRunner | None:
        """``like``'s recorded SDPA call and write over ``kv_cache``'s views
        (:meth:`_bind_sdpa_like`); a subclass's own forward binds nothing here."""
        if type(self).forward is not TorchSdpaBackend.forward:
            return None
        return self._bind_sdpa_like(layer, kv_cache, metadata, slot_mapping, like_kv_cache)

    def _bind_sdpa_like(
        self,
        layer: LayerGeometry,
        kv_cache: KVCache,
        metadata: Any,
        slot_mapping: torch.Tensor,
        like_kv_cache: KVCache,
    ) -> LayerRunner | None:
        """Record for ``kv_cache`` the call (and the slot-run write views) recorded for its
        twin's cache ``like_kv_cache`` in this batch, each view moved onto ``kv_cache``'s
        memory at the same offsets (:func:`_rebased`) -- a recorded gather keeps its block index
        over ``kv_cache``'s halves -- then bind it as :meth:`bind_layer` does. None where the
        twin's call is not recorded or a view is not the twin cache's own."""
        md = metadata
        if not isinstance(md, CudaPagedMetadata) or md.cp_size > 1 or layer.kv_scales is not None:
            return None
        call, split = md.calls.get(id(like_kv_cache)), md.splits.get(id(like_kv_cache))
        if (
            call is None
            or call.kv_cache is not like_kv_cache
            or split is None
            or split[0] is not like_kv_cache
        ):
            return None
        k0, v0 = split[1], split[2]
        k1, v1 = key_value_caches(kv_cache)
        if not (_congruent(k0, k1) and _congruent(v0, v1)):
            return None
        gather = call.gather
        if gather is not None:  # the same block index over this cache's halves
            kt = vt = None
            gather = gather._replace(k_cache=k1, v_cache=v1)
        else:
            assert call.kt is not None and call.vt is not None
            kt, vt = _rebased(call.kt, k0, k1), _rebased(call.vt, v0, v1)
            if kt is None or vt is None:
                return None
        hit = self._write_views.get(id(like_kv_cache))
        if hit is not None and hit.kv_cache is like_kv_cache and hit.runs is not None:
            runs: list[tuple[slice | None, torch.Tensor, torch.Tensor]] = []
            for src, dst_k, dst_v in hit.runs:
                rk, rv = _rebased(dst_k, k0, k1), _rebased(dst_v, v0, v1)
                if rk is None or rv is None:
                    break
                runs.append((src, rk, rv))
            else:  # every destination moved: the slice copies serve this cache too
                self._write_views[id(kv_cache)] = _WriteViews(kv_cache, k1.dtype, v1.dtype, tuple(runs))
        md.splits[id(kv_cache)] = (kv_cache, k1, v1)
        md.calls[id(kv_cache)] = call._replace(kv_cache=kv_cache, layer=layer, kt=kt, vt=vt, gather=gather)
        return self._bind_sdpa(layer, kv_cache, md, slot_mapping)

    def _bind_sdpa(
        self, layer: LayerGeometry, kv_cache: KVCache, metadata: Any, slot_mapping: torch.Tensor
    ) -> LayerRunner | None:
        md = metadata
        if not isinstance(md, CudaPagedMetadata) or md.cp_size > 1 or layer.kv_scales is not None:
            return None
        call = md.calls.get(id(kv_cache))
        if call is None or call.kv_cache is not kv_cache or call.layer is not layer:
            return None
        sdpa = self._bound_sdpa
        known, hit = self._write_runs, self._write_views.get(id(kv_cache))
        own_writer = type(
            self
        ).write_kv_valid is TorchSdpaBackend.write_kv_valid and "write_kv_valid" not in vars(self)
        if (
            own_writer
            and known is not None
            and known[1] == slot_mapping._version
            and known[0].shape[0] == call.tokens
            and (
                known[0] is slot_mapping  # the batch's own tensor, or a view of the same memory
                or (
                    slot_mapping.data_ptr() == known[0].data_ptr()
                    and not slot_mapping.is_inference()
                    and slot_mapping.shape == known[0].shape
                    and slot_mapping.stride() == known[0].stride()
                )
            )
            and hit is not None
            and hit.kv_cache is kv_cache
            and hit.runs is not None
            and hit.key_dtype == hit.value_dtype == layer.dtype
        ):
            slots, version, runs = slot_mapping, known[1], hit.runs
            write = self.write_kv_valid

            def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
                if slots._version == version:
                    for src, dst_k, dst_v in runs:
                        dst_k.copy_(key if src is None else key[src])
                        dst_v.copy_(value if src is None else value[src])
                else:  # the slot mapping was written since: the writer decides afresh
                    write(layer, key, value, kv_cache, slots)
                return sdpa(call, query)

            return run

        k_cache, v_cache = key_value_caches(kv_cache)
        if own_writer and k_cache.dtype == v_cache.dtype == layer.dtype and _flat(k_cache) and _flat(v_cache):
            # write_kv_valid's indexed copy (write_pages), its per-call checks and views made
            # once: the flat caches and the slot mapping's view are views, so each call -- a
            # CUDA graph's replay too -- reads the slots the batch's buffer holds then
            k_flat = k_cache.view(-1, *k_cache.shape[2:])
            v_flat = v_cache.view(-1, *v_cache.shape[2:])
            slots_view = slot_mapping[: call.tokens]
            as_long = slots_view.dtype != torch.long

            def run_indexed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
                index = slots_view.long() if as_long else slots_view
                k_flat.index_copy_(0, index, key)
                v_flat.index_copy_(0, index, value)
                return sdpa(call, query)

            return run_indexed

        def run_written(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            self.write_kv_valid(layer, key, value, kv_cache, slot_mapping)
            return sdpa(call, query)

        return run_written

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: CudaPagedMetadata = metadata
        if md.cp_size > 1:
            raise ValidationError(
                f"cuda metadata is DCP-sharded (cp_size={md.cp_size}): attention over one rank's keys "
                "is partial; use forward_partial and merge across the DCP group"
            )
        return self._gather_sdpa(layer, query, kv_cache, md, out)

    def forward_partial(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over this DCP rank's keys: ``(out [T, H, D], lse [T, H] float32)``, the
        log-sum-exp in natural log, ``-inf`` (and ``out`` 0) where no local key is visible.
        Without DCP the local keys are all keys and ``out`` equals :meth:`forward`'s."""
        return self._gather_sdpa_partial(layer, query, kv_cache, metadata)

    def forward_partial_extra(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        extra_query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``PagedBackend.forward_partial_extra``: where the batch is one row group of one row
        whose queries all see the same keys (a planned group without ``key_mask``, or a FULL
        row; no DCP), ONE SDPA call with the extra queries appended to the row's; otherwise
        (the in-place Triton way, a per-query mask, several rows) the default."""
        md = metadata
        grp = _uniform_row_group(md, query.shape[0]) if isinstance(md, CudaPagedMetadata) else None
        if grp is None or extra_query.shape[0] == 0:
            return super().forward_partial_extra(layer, query, extra_query, kv_cache, metadata)
        return self._gather_sdpa_partial(layer, query, kv_cache, md, extra_query)

    def forward_extra_keys(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        extra_query: torch.Tensor,
        extra_key: torch.Tensor,
        extra_value: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``PagedBackend.forward_extra_keys``: where the batch is one row group of one row whose
        queries all see the same keys (as :meth:`forward_partial_extra`'s one-call path), ONE
        SDPA call of the row's and the extra queries over the row's keys with the extra keys
        appended; None (the caller merges) otherwise."""
        md = metadata
        grp = _uniform_row_group(md, query.shape[0]) if isinstance(md, CudaPagedMetadata) else None
        if grp is None:
            return None
        hkv, hd = layer.num_kv_heads, layer.head_size
        for name, t in (("extra_key", extra_key), ("extra_value", extra_value)):
            if t.dim() != 3 or t.shape[1:] != (hkv, hd) or t.shape[0] != extra_key.shape[0]:
                raise ValidationError(
                    f"backend {self.name!r} forward_extra_keys: {name} must be [X, {hkv}, {hd}] with one X for "
                    f"keys and values; got {tuple(t.shape)}"
                )
        if extra_query.dim() != 3 or extra_query.shape[1:] != (layer.num_heads, hd):
            raise ValidationError(
                f"backend {self.name!r} forward_extra_keys: extra_query must be [E, {layer.num_heads}, {hd}]; "
                f"got {tuple(extra_query.shape)}"
            )
        for name, t in (("extra_query", extra_query), ("extra_key", extra_key), ("extra_value", extra_value)):
            if t.device != query.device:
                raise ValidationError(
                    f"backend {self.name!r} forward_extra_keys: {name} is on {t.device}, the query on {query.device}"
                )
        return self._gather_sdpa_partial(layer, query, kv_cache, md, extra_query, (extra_key, extra_value))

    @staticmethod
    def _gather_dequantized(
        cache: torch.Tensor,
        index: torch.Tensor,
        rows: int,
        keys: int,
        scale: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``[rows, keys, Hkv, D]`` in ``dtype``: e4m3 pages gathered by block (``index``, each
        row's pages in order) times the per-KV-head ``scale``. Here a gather, then
        :func:`dequantize`; a plugin overrides it with one pass (the cuda plugin: a Triton
        kernel)."""
        blocks = index.numel() // max(rows, 1)
        shape = (rows, blocks * cache.shape[1], cache.shape[2], cache.shape[3])
        return dequantize(_gather_blocks(cache, index, shape, keys), scale, dtype)

    @staticmethod
    def _dequantized(pages: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[R, keys, Hkv, D]`` e4m3 ``pages`` (a view or a gathered copy) times the per-KV-head
        ``scale``, in ``dtype`` (overridden as :meth:`_gather_dequantized` is)."""
        return dequantize(pages, scale, dtype)

    @classmethod
    def _group_tensors(
        cls,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: CudaPagedMetadata,
        grp: SdpaRowGroup,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row group's ``q [R, ql, H, D]`` and ``k``/``v`` ``[R, keys, Hkv, D]`` (a view of the
        cache when its pages are contiguous, else gathered). e4m3 pages (``layer.kv_scales``)
        come back dequantised into a copy in the query's dtype: gathered and dequantised in one
        pass where the keys are gathered by block."""
        hkv, hd = layer.num_kv_heads, layer.head_size
        scales = layer.kv_scales
        dequantized = False
        qsl, rows, ql, keys = md.host_query_start_loc, grp.rows, grp.query_len, grp.keys
        nblk = cdiv(keys, md.page)
        R = len(rows)
        split = md.splits.get(id(kv_cache))
        if split is None or split[0] is not kv_cache:  # the batch's first call on this cache
            split = md.splits[id(kv_cache)] = (kv_cache, *key_value_caches(kv_cache))
        k_cache, v_cache = split[1], split[2]
        if grp.token_view is not None and _flat(k_cache) and _flat(v_cache):
            # the visible keys fill one run of slots: a view, nothing gathered
            k = _slot_range(k_cache, *grp.token_view)
            v = _slot_range(v_cache, *grp.token_view)
        elif grp.tokens is not None:  # exactly the visible keys, one gather per K and V
            k = _gather_slots(k_cache, grp.tokens).view(R, keys, hkv, hd)
            v = _gather_slots(v_cache, grp.tokens).view(R, keys, hkv, hd)
        elif grp.live_runs is not None:  # a planned mask on the CPU: the live blocks' runs, sliced
            at = (k_cache.data_ptr(), id(grp))
            cached = md.views.get(at) if len(grp.live_runs) == 1 else None
            if cached is not None:  # one view per layer cache, made by the batch's first call
                k, v = cached
            else:
                k = _runs_of(k_cache, grp.live_runs, keys)
                v = _runs_of(v_cache, grp.live_runs, keys)
                if len(grp.live_runs) == 1 and _aliases(k, k_cache) and _aliases(v, v_cache):
                    md.views[at] = (k, v)  # views (pages that flatten in place), not copies
        elif grp.live is not None or grp.view is None:
            # gathered by block (a planned mask's live blocks, or rows whose pages are not one
            # strided view), by the index the batch's first call made
            gathered = md.gathers.get(id(grp))
            if gathered is None:
                gathered = md.gathers[id(grp)] = _block_index(md, grp, nblk)
            index, blocks = gathered
            if scales is not None:
                k = cls._gather_dequantized(k_cache, index, R, keys, scales.k_scale, query.dtype)
                v = cls._gather_dequantized(v_cache, index, R, keys, scales.v_scale, query.dtype)
                dequantized = True
            else:
                shape = (R, blocks * md.page, hkv, hd)
                k, v = (
                    _gather_blocks(k_cache, index, shape, keys),
                    _gather_blocks(v_cache, index, shape, keys),
                )
        else:  # contiguous pages: a strided view of the cache, no gather
            at = (k_cache.data_ptr(), id(grp))
            cached = md.views.get(at)
            if cached is None:
                cached = md.views[at] = (
                    _row_view(k_cache, grp.view, R, nblk * md.page)[:, :keys],
                    _row_view(v_cache, grp.view, R, nblk * md.page)[:, :keys],
                )
            k, v = cached
        if scales is not None and not dequantized:
            k = cls._dequantized(k, scales.k_scale, query.dtype)
            v = cls._dequantized(v, scales.v_scale, query.dtype)
        if grp.contiguous:
            q = query[qsl[rows[0]] : qsl[rows[0]] + R * ql].view(R, ql, layer.num_heads, hd)
        else:
            q = torch.stack([query[qsl[r] : qsl[r] + ql] for r in rows])
        return q, k, v

    def _gather_sdpa_partial(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: CudaPagedMetadata,
        extra_query: torch.Tensor | None = None,
        extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather + SDPA with the log-sum-exp. The ``G`` query heads of each KV head are folded
        into the query sequence (``[R, Hkv, G * ql, D]``), so GQA needs no copy of K/V.

        Under DCP the causal masks were built at ``build``. Without DCP (a direct call: the core
        calls ``forward_partial`` only under DCP) a causal mask is built here, per call.

        With ``extra_query`` ``[E, H, D]`` (:meth:`forward_partial_extra`; the caller checked
        the batch is one uniform row group of one row, :func:`_uniform_row_group`): the extra
        queries appended to the row's in the same SDPA call, ``[T + E, H, D]`` returned as SDPA
        wrote it (no zero-filled output, no copy into it). With ``extra_kv`` too
        (:meth:`forward_extra_keys`): ``[X, Hkv, D]`` keys and values appended to the row's, seen
        by every query."""
        hkv, heads, hd = layer.num_kv_heads, layer.num_heads, layer.head_size
        per_kv = heads // hkv
        qsl = md.host_query_start_loc
        if extra_query is not None:
            (grp,) = md.sdpa_groups
            q, k, v = self._group_tensors(layer, query, kv_cache, md, grp)
            if extra_kv is not None and extra_kv[0].shape[0]:
                k = torch.cat((k, extra_kv[0].to(k.dtype).unsqueeze(0)), dim=1)
                v = torch.cat((v, extra_kv[1].to(v.dtype).unsqueeze(0)), dim=1)
            n = grp.query_len + extra_query.shape[0]
            q = torch.cat((q[0], extra_query.to(q.dtype))) if extra_query.shape[0] else q[0]
            qf = q.reshape(n, hkv, per_kv, hd).permute(1, 2, 0, 3).reshape(1, hkv, per_kv * n, hd)
            o, lg = sdpa_with_lse(qf, k.transpose(1, 2), v.transpose(1, 2), None, layer.scale)
            o = o.reshape(hkv, per_kv, n, hd).permute(2, 0, 1, 3).reshape(n, heads, hd)
            return o, lg.reshape(hkv, per_kv, n).permute(2, 0, 1).reshape(n, heads).float()
        out = torch.zeros_like(query)  # rows without local keys keep out 0 and lse -inf
        lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=query.device)
        groups = md.sdpa_groups
        if md.cp_size == 1 and md.causal:
            groups = tuple(
                g if g.live is not None else dcp_causal_mask(g, per_kv, 1, 0, 1, query.dtype, query.device)
                for g in groups
            )
        for grp in groups:
            q, k, v = self._group_tensors(layer, query, kv_cache, md, grp)
            R, ql, keys = len(grp.rows), grp.query_len, grp.keys
            qf = q.reshape(R, ql, hkv, per_kv, hd).permute(0, 2, 3, 1, 4).reshape(R, hkv, per_kv * ql, hd)
            bias = None if grp.bias is None else grp.bias.expand(R, hkv, per_kv * ql, keys)
            if grp.key_mask is not None:  # a planned mask that differs per query
                bias = _planned_bias(md, grp, per_kv, query.dtype).expand(R, hkv, per_kv * ql, keys)
            o, lg = sdpa_with_lse(qf, k.transpose(1, 2), v.transpose(1, 2), bias, layer.scale)
            o = o.reshape(R, hkv, per_kv, ql, hd).permute(0, 3, 1, 2, 4).reshape(R, ql, heads, hd)
            lg = lg.reshape(R, hkv, per_kv, ql).permute(0, 3, 1, 2).reshape(R, ql, heads)
            if grp.visible is not None:  # queries that see no local key: out 0, lse -inf
                o = torch.where(grp.visible[None, :, None, None], o, 0.0)
                lg = torch.where(grp.visible[None, :, None], lg, float("-inf"))
            if grp.contiguous:
                at = slice(qsl[grp.rows[0]], qsl[grp.rows[0]] + R * ql)
                out[at].view(R, ql, heads, hd).copy_(o)
                lse[at].view(R, ql, heads).copy_(lg)
            else:
                for i, r in enumerate(grp.rows):
                    out[qsl[r] : qsl[r] + ql] = o[i]
                    lse[qsl[r] : qsl[r] + ql] = lg[i]
        return out, lse

    def _cudnn_serves(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, gqa: bool
    ) -> bool:
        """Whether SDPA's cuDNN kernel takes these inputs (asked once per input signature)."""
        sig = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, is_causal, gqa)
        known = self._cudnn_answers.get(sig)
        if known is None:
            known = False
            if q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled():  # type: ignore[no-untyped-call]
                try:
                    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, is_causal, gqa)
                    known = bool(torch.backends.cuda.can_use_cudnn_attention(params))
                except (RuntimeError, TypeError):  # an older SDPAParams signature
                    known = False
            if len(self._cudnn_answers) >= 256:
                self._cudnn_answers.clear()
            self._cudnn_answers[sig] = known
        return known

    @staticmethod
    def _replayable_gather(
        md: CudaPagedMetadata, grp: SdpaRowGroup, kv_cache: KVCache, k: torch.Tensor
    ) -> _Gather | None:
        """How ``k`` (what :meth:`_group_tensors` returned for ``grp`` over ``kv_cache``) was
        gathered, where ``grp`` reads by the block gather -- its index in
        :attr:`CudaPagedMetadata.gathers`, which only that way of reading makes -- else None."""
        gathered, split = md.gathers.get(id(grp)), md.splits.get(id(kv_cache))
        if gathered is None or split is None or split[0] is not kv_cache:
            return None
        block_index, blocks = gathered
        k_cache, v_cache = split[1], split[2]
        shape = (k.shape[0], blocks * md.page, k_cache.shape[2], k_cache.shape[3])
        return _Gather(k_cache, v_cache, block_index, shape, k.shape[1])

    @staticmethod
    def _views_cache(md: CudaPagedMetadata, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether ``k`` and ``v`` (what :meth:`_group_tensors` returned for ``kv_cache``) live in
        the cache's own memory -- views, which a :class:`_BoundCall` may hold because they see
        every later write -- and not gathered or reshaped copies."""
        split = md.splits.get(id(kv_cache))
        return split is not None and _aliases(k, split[1]) and _aliases(v, split[2])

    @staticmethod
    def _sdpa_call(call: _BoundCall, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor) -> torch.Tensor:
        """SDPA of ``qt`` ``[R, H, ql, D]`` over ``call``'s K/V: ``[R, ql, H, D]`` (a transposed
        view of SDPA's own output)."""
        scale = call.layer.scale
        o: torch.Tensor
        if call.cudnn:
            # cuDNN's kernel called directly: the kernel SDPA's priority below would pick,
            # without the dispatcher's per-call backend selection on the host
            o = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qt, kt, vt, None, False, 0.0, call.is_causal, False, scale=scale
            )[0]
        else:
            with _sdpa_priority(qt.is_cuda):
                o = torch.nn.functional.scaled_dot_product_attention(
                    qt,
                    kt,
                    vt,
                    attn_mask=call.mask,
                    is_causal=call.is_causal,
                    scale=scale,
                    enable_gqa=call.gqa,
                )
        return o.transpose(1, 2)

    def _bound_sdpa(self, call: _BoundCall, query: torch.Tensor) -> torch.Tensor:
        """``call`` over ``query`` ``[tokens, H, D]`` (any token stride) holding its rows in
        order: ``[tokens, H, D]`` (a view when SDPA wrote ``[B, L, H, D]``)."""
        g = call.gather
        if g is None:
            kt, vt = call.kt, call.vt
            assert kt is not None and vt is not None
        else:
            kt, vt = g.kv()
        o = self._sdpa_call(call, query.view(call.q_shape).transpose(1, 2), kt, vt)
        return o.reshape(call.tokens, call.layer.num_heads, call.layer.head_size)

    def _gather_sdpa(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: CudaPagedMetadata,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        bound = md.calls.get(id(kv_cache)) if out is None else None
        if (
            bound is not None
            and bound.kv_cache is kv_cache
            and bound.layer is layer
            and query.shape[0] == bound.tokens
        ):
            return self._bound_sdpa(bound, query)
        hd = layer.head_size
        qsl = md.host_query_start_loc
        # One group covering every row in order: SDPA's own output (already [tokens, H, D] in
        # memory) is returned as is, without a copy into ``out``.
        single = len(md.sdpa_groups) == 1 and out is None
        result = out
        for grp in md.sdpa_groups:
            ql, sl, rows = grp.query_len, grp.seq_len, grp.rows
            R = len(rows)
            contiguous = grp.contiguous
            q, k, v = self._group_tensors(layer, query, kv_cache, md, grp)
            mask: Any = None
            is_causal = False
            if grp.live is not None:  # a planned mask: exact over the live keys, or none needed
                mask = grp.key_mask
            elif md.causal and ql == sl:
                is_causal = True
            elif md.causal:
                # imported here: torch.nn.attention.bias pulls in torch's compiler stack (a second
                # or more on a first import), and only a causal call with fewer queries than keys
                # needs it
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(ql, sl)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            gqa = layer.num_heads != layer.num_kv_heads
            cudnn = mask is None and self._cudnn_serves(qt, kt, vt, is_causal, gqa)
            call = _BoundCall(
                kv_cache, layer, R * ql, (R, ql, layer.num_heads, hd), kt, vt, mask, is_causal, gqa, cudnn
            )
            o = self._sdpa_call(call, qt, kt, vt)
            if single and contiguous and R * ql == query.shape[0]:
                # (e4m3 pages record nothing: their K/V are dequantised copies, made at every call)
                if layer.kv_scales is None and self._views_cache(md, kv_cache, k, v):
                    md.calls[id(kv_cache)] = call  # later calls on this cache skip the decisions above
                elif (
                    layer.kv_scales is None
                    and (gathered := self._replayable_gather(md, grp, kv_cache, k)) is not None
                ):
                    # K/V gathered by the batch's fixed block index: later calls gather the same
                    # way (reading what later writes put in the pages), the decisions kept
                    md.calls[id(kv_cache)] = call._replace(kt=None, vt=None, gather=gathered)
                return o.reshape(R * ql, layer.num_heads, hd)  # a view when SDPA wrote [B, L, H, D]
            if result is None:
                result = torch.empty_like(query)
            if contiguous:
                result[qsl[rows[0]] : qsl[rows[0]] + R * ql].view(R, ql, layer.num_heads, hd).copy_(o)
            else:
                for i, r in enumerate(rows):
                    result[qsl[r] : qsl[r] + ql] = o[i]
        return result if result is not None else torch.zeros_like(query)

"""Dense attention computed independently of every platform: the kit's oracle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from diffusion_kv.core.attention import AttentionMode, MaskSpec
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.errors import ValidationError


def row_mask(
    mode: AttentionMode | MaskSpec,
    query_offset: int,
    query_len: int,
    seq_len: int,
    spans: Sequence[tuple[int, int]] = (),
    **mode_args: Any,
) -> torch.Tensor:
    """``[query_len, seq_len]`` bool for one row: :meth:`MaskSpec.row_mask` for a parametrised
    mask, :meth:`AttentionMode.row_mask` for a plain kind (its keyword arguments pass through)."""
    if isinstance(mode, MaskSpec):
        return mode.row_mask(query_offset, query_len, seq_len, spans)
    if not isinstance(mode, AttentionMode):
        raise ValidationError(
            f"the oracle's mode must be an AttentionMode ({', '.join(m.name for m in AttentionMode)}) "
            f"or a MaskSpec; got {mode!r}"
        )
    return mode.row_mask(query_offset, query_len, seq_len, spans, **mode_args)


def dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``query [Lq, H, D]``, ``key/value [Lk, Hkv, D]``, ``mask [Lq, Lk]`` -> ``[Lq, H, D]`` (float64)."""
    q = query.detach().to("cpu", torch.float64)
    k = key.detach().to("cpu", torch.float64)
    v = value.detach().to("cpu", torch.float64)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask[None].to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def tolerance(dtype: torch.dtype, backend: type[PagedBackend] | None = None) -> dict[str, float]:
    """The kit's ``atol``/``rtol`` for ``dtype``: the backend's declared ``tolerances`` entry
    when it has one, else the default for the dtype."""
    if backend is not None and dtype in backend.tolerances:
        atol, rtol = backend.tolerances[dtype]
        return {"atol": float(atol), "rtol": float(rtol)}
    if dtype == torch.float64:
        return {"atol": 1e-9, "rtol": 1e-9}
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 3e-3, "rtol": 3e-3}
    return {"atol": 2e-2, "rtol": 2e-2}


def _where(
    index: Sequence[int],
    rows: Sequence[Any],
    mode: AttentionMode | MaskSpec | None,
    spans: Sequence[Any] | None,
) -> str:
    """``index`` (packed token, head, ...) as the row, position, head and mode it belongs to."""
    token = int(index[0])
    head = f", head {int(index[1])}" if len(index) >= 3 else ""
    offset = 0
    for i, row in enumerate(rows):
        if token < offset + row.query_len:
            pos = row.kv_start_pos + token - offset
            what = mode.describe() if isinstance(mode, MaskSpec) else mode.value if mode is not None else "?"
            if mode is AttentionMode.PIECEWISE:
                inside = [(a, b) for a, b in (spans[i] if spans else ()) if a <= pos < b]
                what += f" (full span [{inside[0][0]}, {inside[0][1]}))" if inside else " (causal piece)"
            seq = f", sequence {row.sequence_id}" if row.sequence_id is not None else ""
            return (
                f"row {i} (request {row.request_id!r}{seq}), key/query position {pos} of {row.seq_len}{head}, "
                f"mode {what}"
            )
        offset += row.query_len
    return f"packed token {token}{head}"


def mismatch(
    got: torch.Tensor,
    want: torch.Tensor,
    atol: float,
    rtol: float,
    rows: Sequence[Any] = (),
    mode: AttentionMode | MaskSpec | None = None,
    spans: Sequence[Any] | None = None,
) -> str | None:
    """None when ``got`` equals ``want`` within ``|got - want| <= atol + rtol * |want|`` (NaN
    never equal); else one line naming the first differing value's row, key/query position,
    head and mode (``rows``: the batch's :class:`~diffusion_kv.core.rows.PagedRow` s, whose
    queries ``want``'s first axis packs; without them, the packed token), both values, how many
    differ and where the largest difference is."""
    got = got.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    if got.numel() != want.numel():
        return f"paged output has shape {tuple(got.shape)}, dense {tuple(want.shape)}"
    got = got.reshape(want.shape)
    bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)
    if not bool(bad.any()):
        return None
    diff = (got - want).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    first = [int(x) for x in bad.nonzero()[0].tolist()]
    flat = int(torch.where(bad, diff, torch.full_like(diff, -1.0)).reshape(-1).argmax())
    worst = [int(x) for x in torch.unravel_index(torch.tensor(flat), want.shape)]
    g, w = float(got[tuple(first)]), float(want[tuple(first)])
    return (
        f"paged != dense at {_where(first, rows, mode, spans)}: paged {g:.6g}, dense {w:.6g} "
        f"(|diff| {abs(g - w):.3g} > atol {atol:g} + rtol {rtol:g} x |dense|); {int(bad.sum())} of "
        f"{bad.numel()} values differ, the largest |diff| {float(diff.reshape(-1)[flat]):.3g} at "
        f"{_where(worst, rows, mode, spans)}"
    )

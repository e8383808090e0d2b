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

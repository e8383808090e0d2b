"""Whether tensors share memory: the check that keeps two layers from writing one page.

A tensor's memory is the set of bytes ``data_ptr + sum(i_k * stride_k * itemsize) + b`` over
its indices ``i_k`` and the bytes ``b`` of one element. Two tensors overlap when those sets
intersect. The check is exact for what hosts hand in (separate tensors, disjoint slices of one
buffer, and interleaved views such as vLLM's key and value halves ``cache[..., :d]`` and
``cache[..., d:]``), and says "cannot tell" only for layouts whose strides are not nested
(each stride beyond every offset of the smaller ones) and too large to enumerate.

Everything here works on addresses and shapes only: no tensor is read or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ENUMERATE_LIMIT = 1 << 22
"""Bytes of a layout enumerated when the exact structural check does not apply."""


@dataclass(frozen=True)
class Footprint:
    """The bytes a tensor occupies: ``start + sum(i_k * stride_k)`` with ``0 <= i_k < size_k``,
    ``dims = ((stride_k, size_k), ...)`` in bytes, ascending by stride, adjacent dimensions
    merged and the element's own bytes included as the first dimension."""

    device: torch.device
    start: int
    dims: tuple[tuple[int, int], ...]

    @property
    def last(self) -> int:
        """The offset of the last byte from ``start``."""
        return sum((n - 1) * s for s, n in self.dims)

    @property
    def end(self) -> int:
        return self.start + self.last + 1

    @property
    def nested(self) -> bool:
        """Every stride lies beyond every offset the smaller dimensions reach (then no byte is
        addressed twice, and a difference of offsets decomposes in at most two ways per step)."""
        reach = 0
        for s, n in self.dims:
            if s <= reach:
                return False
            reach += (n - 1) * s
        return True

    @property
    def dense(self) -> bool:
        """It covers every byte between its first and last."""
        return len(self.dims) == 1 and self.dims[0][0] == 1


def footprint(t: torch.Tensor) -> Footprint | None:
    """``t``'s bytes, or None when it has none (no elements, or the meta device)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    item = t.element_size()
    raw = sorted((abs(s) * item, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    start = t.data_ptr() + sum((n - 1) * s * item for s, n in zip(t.stride(), t.shape, strict=True) if s < 0)
    dims: list[tuple[int, int]] = [(1, item)]
    for s, n in raw:
        prev_s, prev_n = dims[-1]
        if s == prev_s * prev_n:
            dims[-1] = (prev_s, prev_n * n)
        else:
            dims.append((s, n))
    return Footprint(t.device, start, tuple(dims))


def _offsets(fp: Footprint) -> torch.Tensor:
    offsets = torch.zeros(1, dtype=torch.int64)
    for s, n in fp.dims:
        offsets = (offsets[:, None] + torch.arange(n, dtype=torch.int64) * s).flatten()
    return offsets


def _size(fp: Footprint) -> int:
    total = 1
    for _, n in fp.dims:
        total *= n
    return total


def _in_differences(delta: int, dims: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``delta = sum(j_k * s_k)`` with ``|j_k| < n_k`` (nested ``dims``, ascending)."""
    reach = [0]
    for s, n in dims:
        reach.append(reach[-1] + (n - 1) * s)

    def search(k: int, rest: int) -> bool:
        if k == 0:
            return rest == 0
        s, n = dims[k - 1]
        inner = reach[k - 1]
        low = max(-(n - 1), -((inner - rest) // s))  # ceil((rest - inner) / s)
        high = min(n - 1, (rest + inner) // s)
        return any(search(k - 1, rest - j * s) for j in range(low, high + 1))

    return search(len(dims), delta)


def internal_overlap(fp: Footprint) -> bool | None:
    """Whether one tensor addresses a byte twice (a broadcast view, say); None: cannot tell."""
    if fp.nested:
        return False
    if any(s == 0 for s, _ in fp.dims):
        return True
    if _size(fp) > ENUMERATE_LIMIT:
        return None
    offsets = _offsets(fp)
    return bool(torch.unique(offsets).numel() != offsets.numel())


def overlap(a: Footprint, b: Footprint) -> bool | None:
    """Whether two footprints share a byte; None: cannot tell (see the module docstring)."""
    if a.device != b.device or a.end <= b.start or b.end <= a.start:
        return False
    if a.dense and b.dense:
        return True
    if a.dims == b.dims and a.nested:
        return _in_differences(b.start - a.start, a.dims)
    if a.dense or b.dense:  # the other starts or ends inside the dense one's range
        dense, other = (a, b) if a.dense else (b, a)
        if dense.start <= other.start < dense.end or dense.start <= other.end - 1 < dense.end:
            return True
    if _size(a) > ENUMERATE_LIMIT or _size(b) > ENUMERATE_LIMIT:
        return None
    base = min(a.start, b.start)
    return bool(torch.isin(_offsets(a) + (a.start - base), _offsets(b) + (b.start - base)).any())


def shared_memory(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[str, str | None, bool | None] | None:
    """The first memory a list of named tensors shares: ``(name, None, verdict)`` for a tensor
    that addresses a byte twice, ``(name_a, name_b, verdict)`` for two tensors that share one
    (``verdict`` None: cannot tell they do not); None when every byte has one owner."""
    prints: list[tuple[str, Footprint]] = []
    for name, t in named:
        fp = footprint(t)
        if fp is None:
            continue
        verdict = internal_overlap(fp)
        if verdict is not False:
            return name, None, verdict
        prints.append((name, fp))
    prints.sort(key=lambda item: (str(item[1].device), item[1].start))
    open_: list[tuple[str, Footprint]] = []  # tensors whose range reaches the current start
    for name, fp in prints:
        open_ = [(n, o) for n, o in open_ if o.device == fp.device and o.end > fp.start]
        for other_name, other in open_:
            verdict = overlap(other, fp)
            if verdict is not False:
                return other_name, name, verdict
        open_.append((name, fp))
    return None

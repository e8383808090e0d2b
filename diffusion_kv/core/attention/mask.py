"""One layer's mask as a frozen, parametrised value: :class:`MaskSpec`.

Every mask here has one shape, which keeps each question the core asks cheap and exact. For a
query at absolute position ``q`` of a row with ``seq_len`` keys, its **bound** ``hi(q)`` is the
end of what it may see:

* CAUSAL: ``q + 1``; FULL: ``seq_len``; CHUNK_CAUSAL with chunk ``C``: the end of ``q``'s chunk,
  ``(q // C + 1) * C``;
* spans (``full_attn_spans``, CAUSAL and FULL layers only) raise it to ``b`` for ``a <= q < b``;
* keys exist only below ``seq_len``, so the query sees below ``min(hi(q), seq_len)``.

The bound composes with a **window** and **sinks**: the query sees key ``k < seq_len`` when
``k < hi(q)`` and (no window, or ``k >= hi(q) - window``, or ``k < sink``). So the visible keys of a query
are at most two runs, ``[0, min(sink, hi))`` and ``[max(hi - window, 0), hi)``, and ``hi`` never
decreases along a row -- which is what makes the block plan (``plan.py``) and retention
(:meth:`MaskSpec.retention`) exact without a dense mask. The anchors: xformers' typed biases
(``LocalAttentionFromBottomRightMask`` is CAUSAL with a window), FlexAttention's composed
``mask_mod`` and ``BlockMask``, vLLM's ``SlidingWindowSpec`` and its skipped-token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffusion_kv.core.attention.mode import AttentionMode, dense_piecewise_mask
from diffusion_kv.core.errors import ValidationError


@dataclass(frozen=True, slots=True)
class Retention:
    """What a row keeps once every query still to come sits at or after some position.

    ``pinned`` leading tokens (the sink) are kept for good; every key in
    ``[pinned, first_live)`` is seen by no later query and its blocks may be released;
    keys from ``first_live`` on are live. Full and causal masks keep everything
    (``first_live == pinned == 0``)."""

    first_live: int
    pinned: int

    def releasable_blocks(self, block_size: int) -> range:
        """Indices of the row's blocks lying wholly in ``[pinned, first_live)``."""
        start = -(-self.pinned // block_size)
        return range(start, max(start, self.first_live // block_size))


def _positive(value: object, name: str) -> None:
    if type(value) is not int or value <= 0:
        raise ValidationError(f"MaskSpec.{name} must be a positive int; got {value!r}")


@dataclass(frozen=True, slots=True)
class MaskSpec:
    """What a layer attends to (module docstring): its kind and parameters.

    ``MaskSpec(AttentionMode.CAUSAL)`` and ``MaskSpec(AttentionMode.FULL)`` are today's layer
    modes; ``MaskSpec(AttentionMode.CHUNK_CAUSAL, chunk=C, window=W, sink=S)`` is the
    autoregressive-diffusion mask: block-causal by chunks of ``C`` tokens, each query seeing its
    own chunk and the ``W - C`` tokens before it plus the first ``S`` tokens of the row."""

    kind: AttentionMode = AttentionMode.CAUSAL
    chunk: int | None = None
    """CHUNK_CAUSAL only: tokens per chunk (chunks start at absolute position 0)."""
    window: int | None = None
    """Tokens ending at the query's bound that it sees (None: every earlier key). For
    CHUNK_CAUSAL a multiple of ``chunk`` (the query's own chunk included)."""
    sink: int = 0
    """Leading tokens every query sees (within its bound) and no retention releases."""
    spans: bool | None = None
    """Whether ``full_attn_spans`` may refine the mask (None: for a plain CAUSAL or FULL mask,
    as vLLM-Omni applies spans on every layer; never with a chunk, window or sink)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, AttentionMode) or not self.kind.is_layer_mode:
            raise ValidationError(
                f"MaskSpec.kind must be {AttentionMode.layer_modes_text()}; got {self.kind!r}"
            )
        if self.kind is AttentionMode.CHUNK_CAUSAL:
            _positive(self.chunk, "chunk")
        elif self.chunk is not None:
            raise ValidationError(
                f"MaskSpec.chunk is for CHUNK_CAUSAL masks; {self.kind.name} got {self.chunk!r}"
            )
        if self.window is not None:
            _positive(self.window, "window")
            if self.chunk is not None and self.window % self.chunk:
                raise ValidationError(
                    f"MaskSpec.window {self.window} must be a multiple of chunk {self.chunk} "
                    "(whole chunks are seen, the query's own included)"
                )
        if type(self.sink) is not int or self.sink < 0:
            raise ValidationError(f"MaskSpec.sink must be an int >= 0; got {self.sink!r}")
        if self.sink and self.window is None:
            raise ValidationError("MaskSpec.sink needs a window (without one every key is seen anyway)")
        plain = self.kind.accepts_spans and self.window is None and not self.sink
        if self.spans is None:
            object.__setattr__(self, "spans", plain)
        elif type(self.spans) is not bool:
            raise ValidationError(f"MaskSpec.spans must be a bool or None; got {self.spans!r}")
        elif self.spans and not plain:
            raise ValidationError(
                f"full_attn_spans refine plain causal or full masks only; {self.describe()} cannot take them"
            )

    # -- what the core reads -------------------------------------------------------------------

    @staticmethod
    def of(mode: AttentionMode | MaskSpec) -> MaskSpec:
        """The spec of a layer mode (a spec is returned as it is)."""
        if isinstance(mode, MaskSpec):
            return mode
        return _PLAIN[mode] if mode in _PLAIN else MaskSpec(mode)

    @property
    def is_plain(self) -> bool:
        """Today's CAUSAL or FULL mask: no chunk, window or sink (nothing to plan or release)."""
        return self.chunk is None and self.window is None and not self.sink

    @property
    def releases(self) -> bool:
        """Keys slide out of every later query's view: retention may release blocks."""
        return self.window is not None

    @property
    def required_modes(self) -> frozenset[AttentionMode]:
        """The kinds a backend must declare to run a group of such layers."""
        if self.spans:
            return self.kind.group_modes
        return frozenset({self.kind})

    def describe(self) -> str:
        """``chunk_causal(chunk=4, window=12, sink=4)``: the kind and its parameters."""
        params = [f"{n}={v}" for n, v in (("chunk", self.chunk), ("window", self.window)) if v is not None]
        if self.sink:
            params.append(f"sink={self.sink}")
        return f"{self.kind.value}({', '.join(params)})" if params else self.kind.value

    # -- the mask -----------------------------------------------------------------------------

    def bounds(
        self, positions: torch.Tensor, seq_len: int, spans: Sequence[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` for every query position (int64): it sees ``[0, min(sink, hi))`` and
        ``[lo, hi)``. The window counts back from the unclipped bound (the end of a chunk the
        row has not filled yet), so what a query sees never depends on ``seq_len``."""
        if self.kind is AttentionMode.FULL:
            raw = torch.full_like(positions, seq_len)
        elif self.kind is AttentionMode.CHUNK_CAUSAL:
            chunk = self.chunk or 1
            raw = ((positions // chunk) + 1) * chunk
        else:
            raw = positions + 1
        for a, b in spans:
            inside = (positions >= a) & (positions < b)
            raw = torch.where(inside, torch.clamp(raw, min=b), raw)
        hi = torch.clamp(raw, max=seq_len)
        lo = torch.clamp(raw - self.window, min=0) if self.window is not None else torch.zeros_like(raw)
        return lo, hi

    def row_mask(
        self,
        query_offset: int,
        query_len: int,
        seq_len: int,
        spans: Sequence[tuple[int, int]] = (),
        *,
        live_from: int = 0,
    ) -> torch.Tensor:
        """``[query_len, seq_len]`` bool (True: visible) for one row whose queries sit at
        positions ``query_offset ..`` over keys ``0 .. seq_len``: the dense oracle. A row that
        declares ``live_from`` (``PagedRow.live_from``) sees no key in ``[sink, live_from)``."""
        return self.key_mask(
            query_offset,
            query_len,
            seq_len,
            torch.arange(seq_len, dtype=torch.long),
            spans,
            live_from=live_from,
        )

    def key_mask(
        self,
        query_offset: int,
        query_len: int,
        seq_len: int,
        keys: torch.Tensor,
        spans: Sequence[tuple[int, int]] = (),
        *,
        live_from: int = 0,
    ) -> torch.Tensor:
        """``row_mask(...)[:, keys]`` for the key positions ``keys [n]`` (int64) alone: a backend
        that gathers only the blocks a plan keeps builds its mask over those keys, so its cost
        follows the keys it reads, not the row's absolute length."""
        if spans and not self.spans:
            raise ValidationError(f"full_attn_spans cannot refine a {self.describe()} mask")
        runs = None if spans else self.query_runs(query_offset, query_len, seq_len, live_from)
        if runs:  # a few distinct bounds: one row of the mask per run, repeated down its queries
            k = keys.to(torch.long)
            rows = []
            for count, lo, hi in runs:
                visible = k < hi
                if lo > 0:  # keys below lo are seen only inside the sink
                    visible &= (k >= lo) | (k < self.sink)
                rows.append(visible[None, :].expand(count, -1))
            return torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()
        return self._key_mask_tensor(query_offset, query_len, seq_len, keys, spans, live_from=live_from)

    def query_runs(
        self, query_offset: int, query_len: int, seq_len: int, live_from: int = 0
    ) -> list[tuple[int, int, int]] | None:
        """``(queries, lo, hi)`` per run of consecutive queries sharing their bounds
        (:meth:`bounds` without spans; ``live_from`` raises ``lo``, as :func:`key_bounds` does),
        as Python ints, in order: one per chunk met for CHUNK_CAUSAL, one for FULL; None where
        every query has its own (CAUSAL) or there is no query. The block plan, the key mask and
        the backends' uniform-visibility test read a row's bounds from here."""
        if query_len <= 0:
            return None
        window = self.window
        if self.kind is AttentionMode.CHUNK_CAUSAL:
            chunk = self.chunk or 1
            end = query_offset + query_len
            raws = [
                (min((c + 1) * chunk, end) - max(c * chunk, query_offset), (c + 1) * chunk)
                for c in range(query_offset // chunk, (end - 1) // chunk + 1)
            ]
        elif self.kind is AttentionMode.FULL:
            raws = [(query_len, seq_len)]
        else:
            return None
        return [
            (count, max(raw - window if window is not None else 0, 0, live_from), min(raw, seq_len))
            for count, raw in raws
        ]

    def _key_mask_tensor(
        self,
        query_offset: int,
        query_len: int,
        seq_len: int,
        keys: torch.Tensor,
        spans: Sequence[tuple[int, int]] = (),
        *,
        live_from: int = 0,
    ) -> torch.Tensor:
        """:meth:`key_mask` from every query's bounds as tensors (any mask, spans too)."""
        q = torch.arange(query_offset, query_offset + query_len, dtype=torch.long)
        lo, hi = self.bounds(q, seq_len, spans)
        k = keys.to(torch.long)[None, :]
        visible = k < hi[:, None]
        if self.window is not None:
            visible &= (k >= lo[:, None]) | (k < self.sink)
        if live_from > self.sink:
            visible &= (k >= live_from) | (k < self.sink)
        return visible

    def first_visible(self, position: int, seq_len: int) -> int:
        """The lowest non-sink key a query at ``position`` sees (queries after it see none
        lower: bounds never decrease along a row)."""
        if self.window is None:
            return 0
        if self.kind is AttentionMode.FULL:
            raw = max(seq_len, position + 1)
        elif self.kind is AttentionMode.CHUNK_CAUSAL:
            chunk = self.chunk or 1
            raw = (position // chunk + 1) * chunk
        else:
            raw = position + 1  # a windowed mask takes no spans: the plain bound (bounds())
        return max(0, raw - self.window)

    # -- retention -----------------------------------------------------------------------------

    def retention(self, next_query: int) -> Retention:
        """What a row keeps once every query still to come sits at position ``next_query`` or
        later: the sink is pinned, keys below the first one such a query sees are released.
        Causal and full masks keep everything; spans never apply to a releasing mask."""
        if self.window is None or self.kind is AttentionMode.FULL:
            return Retention(0, 0)  # a full row's bound is its end, which moves with the row
        first_live = max(self.sink, self.first_visible(next_query, next_query + 1))
        return Retention(first_live, self.sink)


_PLAIN = {
    mode: MaskSpec(mode)
    for mode in AttentionMode
    if mode.is_layer_mode and mode is not AttentionMode.CHUNK_CAUSAL
}


def key_bounds(
    mask: MaskSpec,
    query_offset: int,
    query_len: int,
    seq_len: int,
    spans: Sequence[tuple[int, int]] = (),
    live_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per query of one row, ``(lo, hi, sink)``: it sees ``[0, min(sink, hi)) u [lo, hi)`` (``lo``
    raised to ``live_from`` for a row that skips ``[sink, live_from)``: still two runs)."""
    q = torch.arange(query_offset, query_offset + query_len, dtype=torch.long)
    lo, hi = mask.bounds(q, seq_len, spans)
    if live_from > 0:
        lo = torch.clamp(lo, min=live_from)
    return lo, hi, mask.sink


__all__ = ["MaskSpec", "Retention", "dense_piecewise_mask", "key_bounds"]

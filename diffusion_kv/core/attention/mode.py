"""The kinds of attention masks: :class:`AttentionMode`.

A kind names a family of masks; a layer's parametrised mask (chunk size, window, sink) is a
:class:`~diffusion_kv.core.attention.mask.MaskSpec` of one kind. Capabilities declare kinds, a
piecewise plan's segments carry kinds (CAUSAL or FULL), and the conformance kit's oracle reads
each kind's row mask here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from diffusion_kv.core.errors import ValidationError


def dense_piecewise_mask(
    spans: Sequence[tuple[int, int]], query_offset: int, query_len: int, seq_len: int
) -> torch.Tensor:
    """``[query_len, seq_len]`` bool mask: causal, plus ``mask[a:b, :b] = True`` per span."""
    q = torch.arange(query_offset, query_offset + query_len)[:, None]
    k = torch.arange(seq_len)[None, :]
    mask = k <= q
    for a, b in spans:
        in_span = (q >= a) & (q < b)
        mask = mask | (in_span & (k < b))
    return mask


class AttentionMode(enum.Enum):
    """The kinds of masks (layers, segments, batches, capabilities)."""

    CAUSAL = "causal"
    """Bottom-right aligned causal mask over the row's keys."""
    FULL = "full"
    """Every query token sees every key of the row."""
    PIECEWISE = "piecewise"
    """Causal with bidirectional ``full_attn_spans``: the core cuts it into causal and full calls,
    so a backend declares it only when it serves both and may be called once per segment."""
    CHUNK_CAUSAL = "chunk_causal"
    """Block-causal by chunks of a fixed size: a query sees every key up to the end of its own
    chunk (full attention inside a chunk, causal across chunks), the mask of autoregressive
    video diffusion; usually with a sliding window of chunks and sink chunks
    (:class:`~diffusion_kv.core.attention.mask.MaskSpec`)."""

    # Everything the core and the reference backend know about a kind is read from these
    # members, so a new kind is declared here once (docs/architecture.md, "Adding a mask").

    @property
    def is_layer_mode(self) -> bool:
        """A kind a layer (and so a KV-cache group) declares; PIECEWISE is not one: it is a
        causal or full layer's rows refined by spans."""
        return self is not AttentionMode.PIECEWISE

    @property
    def is_causal(self) -> bool:
        """A query never sees a key past the row's end, and the row's queries must be its last
        tokens (a suffix); the decode-first batch reorder applies."""
        return self is not AttentionMode.FULL

    @property
    def accepts_spans(self) -> bool:
        """Layers of this kind may be given ``full_attn_spans`` (the core then cuts their calls
        into causal and full segments); a layer of any other kind given spans is refused."""
        return self in (AttentionMode.CAUSAL, AttentionMode.FULL)

    @property
    def group_modes(self) -> frozenset[AttentionMode]:
        """What a backend must serve to run a group of layers of this kind: the kind itself,
        and, when spans may refine it, the causal and full segments they cut (PIECEWISE). A
        full layer given spans runs causal segments too (vLLM-Omni applies spans on every
        layer), so a full-only backend does not serve it; a layer that takes no spans declares
        ``MaskSpec(..., spans=False)``."""
        if self.accepts_spans:
            return frozenset({self, AttentionMode.CAUSAL, AttentionMode.FULL, AttentionMode.PIECEWISE})
        return frozenset({self})

    @classmethod
    def layer_modes(cls) -> tuple[AttentionMode, ...]:
        """The kinds layers declare, in the order the runner builds their groups."""
        return tuple(m for m in cls if m.is_layer_mode)

    @classmethod
    def layer_modes_text(cls) -> str:
        """``AttentionMode.CAUSAL, FULL or CHUNK_CAUSAL``: the layer kinds, as errors name them."""
        names = [m.name for m in cls.layer_modes()]
        names[0] = f"AttentionMode.{names[0]}"
        return " or ".join((", ".join(names[:-1]), names[-1])) if len(names) > 1 else names[0]

    def row_mask(
        self, query_offset: int, query_len: int, seq_len: int, spans: Sequence[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """The kind's meaning as ``[query_len, seq_len]`` bool (True: visible) for one row whose
        queries sit at positions ``query_offset ..`` over keys ``0 .. seq_len``: CAUSAL, key <=
        query position; FULL, every key; PIECEWISE, causal plus each ``[start, end)`` span seen
        in full by its own queries. CHUNK_CAUSAL needs its chunk size: ask its
        :class:`~diffusion_kv.core.attention.mask.MaskSpec`. The conformance kit's oracle reads
        its masks here and from :meth:`MaskSpec.row_mask`."""
        if self is AttentionMode.FULL:
            return torch.ones(query_len, seq_len, dtype=torch.bool)
        if self is AttentionMode.CHUNK_CAUSAL:
            raise ValidationError("AttentionMode.CHUNK_CAUSAL has a chunk size: use MaskSpec.row_mask")
        return dense_piecewise_mask(
            spans if self is AttentionMode.PIECEWISE else (), query_offset, query_len, seq_len
        )


BASE_MODES: frozenset[AttentionMode] = frozenset(
    {AttentionMode.CAUSAL, AttentionMode.FULL, AttentionMode.PIECEWISE}
)
"""The kinds of the first plugin contract, and the default of ``Capabilities.attention_modes``.
A kind added later is served only by the backends that declare it, so adding one never changes
what an existing backend claims (``frozenset(AttentionMode)`` claims every kind, future ones
included: only a backend that masks with :meth:`MaskSpec.row_mask`, like the cpu reference,
should declare that)."""

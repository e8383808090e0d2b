"""vLLM-Omni's paged-attention records, with upstream's names, fields and checks.

vLLM-Omni's model runner builds :class:`DiffusionPagedAttentionRow` and
:class:`DiffusionPagedAttentionMetadata` from its scheduler's ``DiffusionKVMetadata``; the
module replacement (:mod:`.runner`) re-exports these under upstream's module path, so the
runner's own code builds ours. The checks and their error types follow upstream (``ValueError``
for a malformed row), through :class:`~diffusion_kv.core.errors.ValidationError` (a
``ValueError``).

The conversions at the end turn upstream-shaped objects (read by attribute name) into the core's
records: a scheduler allocation into a :class:`~diffusion_kv.core.allocation.RequestAllocation`
and a row into a :class:`~diffusion_kv.core.rows.PagedRow`. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.rows import PagedRow, PhaseRows

Identity = tuple[str, int | None, str | None]


@dataclass(frozen=True)
class DiffusionPagedAttentionRowBinding:
    """The worker row and logical length installed for one allocation identity."""

    row_index: int
    max_seq_len: int
    block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class DiffusionPagedAttentionRow:
    """One block-table row taking part in a paged attention call (upstream's record)."""

    request_id: str
    query_len: int
    seq_len: int
    kv_start_pos: int = 0
    sequence_id: int | None = None
    context_id: str | None = None

    def __post_init__(self) -> None:
        if type(self.request_id) is not str or not self.request_id:
            raise ValidationError("Paged attention request_id must be a non-empty string")
        if (self.sequence_id is None) == (self.context_id is None):
            raise ValidationError("Paged attention row requires exactly one of sequence_id or context_id")
        if self.sequence_id is not None and (type(self.sequence_id) is not int or self.sequence_id < 0):
            raise ValidationError("Paged attention sequence_id must be a non-negative integer")
        if self.context_id is not None and (type(self.context_id) is not str or not self.context_id):
            raise ValidationError("Paged attention context_id must be a non-empty string")
        if type(self.query_len) is not int or self.query_len <= 0:
            raise ValidationError("Paged attention query_len must be a positive integer")
        if type(self.seq_len) is not int or self.seq_len <= 0:
            raise ValidationError("Paged attention seq_len must be a positive integer")
        if type(self.kv_start_pos) is not int or self.kv_start_pos < 0:
            raise ValidationError("Paged attention kv_start_pos must be a non-negative integer")
        if self.kv_start_pos + self.query_len > self.seq_len:
            raise ValidationError(
                "Paged attention write span exceeds seq_len: "
                f"start={self.kv_start_pos}, query_len={self.query_len}, seq_len={self.seq_len}"
            )

    @property
    def identity(self) -> Identity:
        return (self.request_id, self.sequence_id, self.context_id)


@dataclass(frozen=True)
class DiffusionPagedAttentionMetadata:
    """The runner's rows for one request-level denoise loop: prefill rows at step 0, denoise
    rows afterwards, with the same ordered identities."""

    prefill_rows: tuple[DiffusionPagedAttentionRow, ...]
    denoise_rows: tuple[DiffusionPagedAttentionRow, ...]

    def __post_init__(self) -> None:
        if not self.prefill_rows or not self.denoise_rows:
            raise ValidationError("Paged attention metadata requires both prefill and denoise rows")
        prefill = tuple(row.identity for row in self.prefill_rows)
        denoise = tuple(row.identity for row in self.denoise_rows)
        if prefill != denoise:
            raise ValidationError(
                "Paged attention prefill and denoise rows must use the same ordered identities: "
                f"prefill={prefill!r}, denoise={denoise!r}"
            )

    def rows_for_step(self, step_idx: int | None) -> tuple[DiffusionPagedAttentionRow, ...]:
        if type(step_idx) is not int or step_idx < 0:
            raise ValidationError(
                f"Paged attention requires a non-negative denoise step index, got {step_idx!r}"
            )
        return self.prefill_rows if step_idx == 0 else self.denoise_rows


# --------------------------------------------------------------------------------------------
# Conversions from upstream-shaped objects (read by attribute name)
# --------------------------------------------------------------------------------------------


def _block_ids(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, value))


def allocation_from_metadata(metadata: Any) -> RequestAllocation:
    """A vLLM-Omni ``DiffusionKVMetadata`` (or a :class:`RequestAllocation`) as a snapshot.

    Block ids become a tuple of tuples and context ids a tuple here, which is all the records'
    constructors would normalise, so every shape takes the records' ``normalised`` builders:
    one call per record, no shape test first."""
    if isinstance(metadata, RequestAllocation):
        return metadata
    try:
        sequences = []
        for s in metadata.sequences:
            block_ids, context_ids = s.block_ids, getattr(s, "context_ids", ()) or ()
            sequences.append(
                SequenceAllocation.normalised(
                    s.sequence_id,
                    s.prefix_len,
                    s.target_len,
                    s.seq_len,
                    tuple(map(tuple, block_ids)),
                    context_ids if type(context_ids) is tuple else tuple(context_ids),
                    getattr(s, "cached_prefix_len", 0),
                )
            )
        contexts = getattr(metadata, "contexts", ()) or ()
        if contexts:
            contexts = tuple(
                ContextAllocation(
                    context_id=c.context_id,
                    cache_role=c.cache_role,
                    num_tokens=c.num_tokens,
                    block_ids=_block_ids(c.block_ids),
                )
                for c in contexts
            )
        # the fields are in normal form: tuples of the records built just now
        return RequestAllocation.normalised(
            metadata.request_id, metadata.allocation_generation, tuple(sequences), contexts
        )
    except (AttributeError, TypeError) as exc:
        raise ValidationError(
            f"{type(metadata).__name__} is not DiffusionKVMetadata-shaped: {type(exc).__name__}: {exc}"
        ) from exc


def paged_row(row: Any) -> PagedRow:
    """A ``DiffusionPagedAttentionRow``-shaped object (or a :class:`PagedRow`) as a core row."""
    if isinstance(row, PagedRow):
        return row
    try:
        return PagedRow(
            request_id=row.request_id,
            query_len=row.query_len,
            seq_len=row.seq_len,
            kv_start_pos=getattr(row, "kv_start_pos", 0),
            sequence_id=getattr(row, "sequence_id", None),
            context_id=getattr(row, "context_id", None),
        )
    except AttributeError as exc:
        raise ValidationError(
            f"{type(row).__name__} is not DiffusionPagedAttentionRow-shaped: {exc}"
        ) from exc


def phase_rows_from_metadata(metadata: Any) -> PhaseRows:
    """A ``DiffusionPagedAttentionMetadata``-shaped object (or :class:`PhaseRows`) as phase rows."""
    if isinstance(metadata, PhaseRows):
        return metadata
    try:
        prefill, denoise = metadata.prefill_rows, metadata.denoise_rows
    except AttributeError as exc:
        raise ValidationError(
            f"{type(metadata).__name__} is not DiffusionPagedAttentionMetadata-shaped: {exc}"
        ) from exc
    return PhaseRows(tuple(paged_row(r) for r in prefill), tuple(paged_row(r) for r in denoise))


__all__ = [
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionRow",
    "DiffusionPagedAttentionRowBinding",
    "Identity",
    "allocation_from_metadata",
    "paged_row",
    "phase_rows_from_metadata",
]

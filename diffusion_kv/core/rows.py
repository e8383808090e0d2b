"""Paged rows: one block-table row taking part in a paged attention call, and phase rows."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.registry import Identity


@dataclass(frozen=True)
class PagedRow:
    """``query_len`` new tokens at positions ``[kv_start_pos, kv_start_pos + query_len)`` of a row
    whose attention covers ``seq_len`` keys. Exactly one of ``sequence_id`` / ``context_id``."""

    request_id: str
    query_len: int
    seq_len: int
    kv_start_pos: int = 0
    sequence_id: int | None = None
    context_id: str | None = None
    live_from: int = 0
    """Keys in ``[sink, live_from)`` are skipped even where the layers' mask reaches them (and
    need not be readable): a session's re-cache pass after its window slid attends over the live
    keys only. At most ``kv_start_pos``; only on a worker whose every mask has a window, and
    served only by backends declaring ``Capabilities.supports_live_from``."""

    def __post_init__(self) -> None:
        if type(self.request_id) is not str or not self.request_id:
            raise ValidationError(f"paged row request_id must be a non-empty string; got {self.request_id!r}")
        if (self.sequence_id is None) == (self.context_id is None):
            raise ValidationError(
                f"paged row of request {self.request_id!r} needs exactly one of sequence_id or context_id; "
                f"got sequence_id={self.sequence_id!r}, context_id={self.context_id!r}"
            )
        if self.sequence_id is not None and (type(self.sequence_id) is not int or self.sequence_id < 0):
            raise ValidationError(f"paged row sequence_id must be an int >= 0; got {self.sequence_id!r}")
        if self.context_id is not None and (type(self.context_id) is not str or not self.context_id):
            raise ValidationError(f"paged row context_id must be a non-empty string; got {self.context_id!r}")
        for name in ("query_len", "seq_len"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValidationError(
                    f"paged row {self.identity!r} {name} must be a positive int; got {value!r}"
                )
        if type(self.kv_start_pos) is not int or self.kv_start_pos < 0:
            raise ValidationError(
                f"paged row {self.identity!r} kv_start_pos must be an int >= 0; got {self.kv_start_pos!r}"
            )
        if type(self.live_from) is not int or not 0 <= self.live_from <= self.kv_start_pos:
            raise ValidationError(
                f"paged row {self.identity!r} live_from must be an int in [0, kv_start_pos={self.kv_start_pos}]; "
                f"got {self.live_from!r}"
            )
        if self.kv_start_pos + self.query_len > self.seq_len:
            raise ValidationError(
                f"paged row {self.identity!r} write span exceeds seq_len: kv_start_pos={self.kv_start_pos}, "
                f"query_len={self.query_len}, seq_len={self.seq_len}"
            )

    @property
    def identity(self) -> Identity:
        return (self.request_id, self.sequence_id, self.context_id)

    @property
    def is_suffix(self) -> bool:
        """The query/write span ends at ``seq_len`` (required by causal and piecewise modes)."""
        return self.kv_start_pos + self.query_len == self.seq_len


class Phase(enum.Enum):
    """Where a row is in its request's denoise loop (one representation everywhere: the
    scheduler, the runtime, the vLLM-Omni runner)."""

    PREFILL = "prefill"
    """The row writes and attends over its whole sequence (less a prefix-cache hit)."""
    DENOISE = "denoise"
    """The row writes its target and attends over its cached prefix pages."""

    @staticmethod
    def of_step(step: int) -> Phase:
        """Step 0 is the prefill step; every later one denoises."""
        if type(step) is not int or step < 0:
            raise ValidationError(f"denoise step index must be an int >= 0; got {step!r}")
        return Phase.PREFILL if step == 0 else Phase.DENOISE


@dataclass(frozen=True)
class PhaseRows:
    """Rows of one request-level denoise loop: step 0 uses ``prefill``, later steps ``denoise``."""

    prefill: tuple[PagedRow, ...]
    denoise: tuple[PagedRow, ...]

    def __post_init__(self) -> None:
        for name in ("prefill", "denoise"):
            rows = getattr(self, name)
            if not isinstance(rows, (tuple, list)) or not all(isinstance(r, PagedRow) for r in rows):
                raise ValidationError(f"PhaseRows.{name} must be a sequence of PagedRow; got {rows!r}")
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "denoise", tuple(self.denoise))
        if not self.prefill or not self.denoise:
            raise ValidationError("phase rows need both prefill and denoise rows")
        a = tuple(r.identity for r in self.prefill)
        b = tuple(r.identity for r in self.denoise)
        if a != b:
            raise ValidationError(
                f"prefill and denoise rows must have the same ordered identities: prefill={a!r}, denoise={b!r}"
            )

    def rows_for_step(self, step: int) -> tuple[PagedRow, ...]:
        return self.rows_for(Phase.of_step(step))

    def rows_for(self, phase: Phase) -> tuple[PagedRow, ...]:
        return self.prefill if phase is Phase.PREFILL else self.denoise

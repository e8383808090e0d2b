"""Step-driven activation of prepared batches.

Two ways to drive it:

* one request's denoise loop (:class:`PhaseRows`): step 0 activates the prefill rows, every
  later step the denoise rows; each phase is prepared once and its batch is reused by every
  later step and layer (:meth:`BatchStepper.ensure_active`);
* a scheduler stepping many requests, each at its own phase (:meth:`BatchStepper.ensure_rows`):
  the batch is prepared again only when its composition (the ordered rows) changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.rows import PagedRow, Phase, PhaseRows
from diffusion_kv.core.translate import PreparedBatch, Translator

_PREFILL = Phase.PREFILL  # (a module constant: an idle step compares against it)


class BatchStepper:
    """Activates prepared batches as steps advance (see the module docstring).

    ``phase_rows`` (instead of ``phases``) supplies each phase's rows when that phase begins,
    for hosts whose rows may be replaced between steps; ``activation`` makes a prepared batch
    the active one (default: ``translator.activate``; a host adds its own context, e.g. its
    forward context, around it).
    """

    def __init__(
        self,
        translator: Translator,
        phases: PhaseRows | None = None,
        *,
        phase_rows: Callable[[Phase], Sequence[PagedRow]] | None = None,
        activation: Callable[[PreparedBatch], AbstractContextManager[Any]] | None = None,
    ) -> None:
        if phases is not None and not isinstance(phases, PhaseRows):
            raise ValidationError(f"BatchStepper needs PhaseRows (or None); got {type(phases).__name__}")
        if phases is not None and phase_rows is not None:
            raise ValidationError("BatchStepper takes phases or phase_rows, not both")
        self.translator = translator
        self.phases = phases
        self.phase_rows = phase_rows
        self._activation_of = activation if activation is not None else translator.activate
        self.phase: Phase | None = None
        """The phase whose rows :meth:`ensure_active` activated (None: none is active, or the
        runtime is closed); read-only for callers."""
        self._rows: tuple[PagedRow, ...] | None = None  # the composition ensure_rows activated
        self._activation: AbstractContextManager[Any] | None = None
        self._closed = False
        self.preparations = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def ensure_active(self, step: int) -> PreparedBatch:
        """Activate the rows of ``step``'s phase (preparing them on a phase change)."""
        active = self.phase  # (None once closed or deactivated)
        if active is not None and type(step) is int and step >= 0 and (step == 0) is (active is _PREFILL):
            return self._active_batch()  # an idle step: this phase's rows are active
        if self._closed:
            raise StateError("the paged runtime is closed")
        if self.phases is None and self.phase_rows is None:
            raise StateError("this runtime steps explicit rows (ensure_rows); it has no phase rows")
        phase = Phase.of_step(step)
        if self.phase is phase:
            return self._active_batch()
        rows = self.phases.rows_for(phase) if self.phases is not None else self.phase_rows(phase)  # type: ignore[misc]
        batch = self._activate(tuple(rows))
        self.phase = phase
        return batch

    def ensure_rows(self, rows: Sequence[PagedRow]) -> PreparedBatch:
        """Activate ``rows`` (each at its own phase), preparing them only when the composition
        differs from the active one; returns the active batch."""
        if self._closed:
            raise StateError("the paged runtime is closed")
        rows = tuple(rows)
        if self._rows is not None and self._rows == rows:
            return self._active_batch()
        batch = self._activate(rows)
        self._rows = rows
        return batch

    def _active_batch(self) -> PreparedBatch:
        active = self.translator.active_batch
        assert active is not None
        return active

    def _activate(self, rows: tuple[PagedRow, ...]) -> PreparedBatch:
        self._deactivate()
        batch = self.translator.prepare(rows)
        self.preparations += 1
        activation = self._activation_of(batch)
        activation.__enter__()
        self._activation = activation
        return batch

    def deactivate(self) -> None:
        """End the active batch (its completed writes are recorded); the next ``ensure_*``
        prepares again. Needed before installing or removing requests."""
        self._deactivate()

    def _deactivate(self) -> None:
        activation, self._activation, self.phase, self._rows = self._activation, None, None, None
        if activation is not None:
            activation.__exit__(None, None, None)

    def close(self) -> None:
        """Deactivate and refuse further use (idempotent)."""
        if self._closed:
            return
        self._deactivate()
        self._closed = True

    @contextmanager
    def activate(self) -> Iterator[BatchStepper]:
        try:
            yield self
        finally:
            self.close()


PagedRuntime = BatchStepper
"""The name :class:`BatchStepper` had before 2026-12-06 (``HostRuntime`` is the embedding host's
objects; this steps prepared batches): an alias for one release (``docs/migration.md``)."""

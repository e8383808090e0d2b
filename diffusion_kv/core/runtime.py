"""Denoise-step-driven activation of prepared batches.

Step 0 activates the prefill rows, every later step the denoise rows; each phase is prepared
once and its batch is reused by every later step and layer. The model's denoise loop publishes
its step index through :meth:`PagedRuntime.ensure_active`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.rows import PhaseRows
from diffusion_kv.core.translate import PreparedBatch, Translator


class PagedRuntime:
    def __init__(self, translator: Translator, phases: PhaseRows) -> None:
        if not isinstance(phases, PhaseRows):
            raise ValidationError(f"PagedRuntime needs PhaseRows; got {type(phases).__name__}")
        self.translator = translator
        self.phases = phases
        self._phase: bool | None = None  # True: prefill, False: denoise
        self._activation: AbstractContextManager[PreparedBatch] | None = None
        self._closed = False
        self.preparations = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def ensure_active(self, step: int) -> PreparedBatch:
        """Activate the rows of ``step``'s phase (preparing them on a phase change)."""
        if self._closed:
            raise StateError("the paged runtime is closed")
        rows = self.phases.rows_for_step(step)
        prefill = step == 0
        if self._phase is prefill:
            active = self.translator.active_batch
            assert active is not None
            return active
        self._deactivate()
        batch = self.translator.prepare(rows)
        self.preparations += 1
        activation = self.translator.activate(batch)
        activation.__enter__()
        self._activation = activation
        self._phase = prefill
        return batch

    def _deactivate(self) -> None:
        activation, self._activation, self._phase = self._activation, None, None
        if activation is not None:
            activation.__exit__(None, None, None)

    def close(self) -> None:
        """Deactivate and refuse further use (idempotent)."""
        if self._closed:
            return
        self._deactivate()
        self._closed = True

    @contextmanager
    def activate(self) -> Iterator[PagedRuntime]:
        try:
            yield self
        finally:
            self.close()

"""The command line's one progress display, on ``tqdm``.

Every long command reports through :class:`ProgressDisplay`: a bar per phase with its step
count (``steps``), and one-line messages between bars (``say``). It is silent -- it writes
nothing at all -- when ``--no-progress`` is given, when stdout is not a terminal (output piped or
redirected: a log or a JSON consumer gets the result only), or when its own stream is not one.
The demo, the stream demo and the bench take the callbacks made here (:func:`demo_progress`,
:func:`stream_progress`, :func:`bench_progress`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO, Any

from tqdm import tqdm


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or unusual stream: treat as not a terminal
        return False


class ProgressDisplay:
    """Bars and messages on ``stream`` (stderr), or nothing (see the module docstring)."""

    def __init__(self, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(enabled) and _isatty(sys.stdout) and _isatty(self.stream)
        self._bar: tqdm[Any] | None = None
        self._label: str | None = None

    def steps(self, label: str, done: int, total: int, **status: object) -> None:
        """``done`` of ``total`` steps of phase ``label``; ``status`` shows beside the bar."""
        if not self.enabled:
            return
        if self._bar is None or self._label != label or self._bar.total != total:
            self.close()
            self._bar = tqdm(
                total=total,
                desc=f"{label:>10}",
                unit="step",
                file=self.stream,
                leave=True,
                dynamic_ncols=True,
            )
            self._label = label
        self._bar.n = done
        if status:
            self._bar.set_postfix({k: str(v) for k, v in status.items()}, refresh=False)
        self._bar.refresh()
        if done >= total:
            self.close()

    def say(self, message: str) -> None:
        """One line, above any bar."""
        if self.enabled:
            tqdm.write(message, file=self.stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._label = None


def demo_progress(display: ProgressDisplay) -> Callable[[str, int, int], None]:
    """The demo's callback: ``(mode, step, steps)``."""

    def show(mode: str, i: int, n: int) -> None:
        display.steps(mode, i, n)

    return show


def stream_progress(display: ProgressDisplay) -> Callable[[str, Any, int, int], None]:
    """The stream demo's callback: ``(label, step report, requests done, requests)``; the bar
    counts finished requests, the status shows the step's batch and the pool."""

    def show(label: str, report: Any, done: int, total: int) -> None:
        display.steps(
            label,
            done,
            total,
            step=report.tick + 1,
            rows=report.rows,
            tokens=report.tokens,
            blocks=f"{report.blocks_in_use}/{report.blocks_total}",
        )

    return show


def bench_progress(display: ProgressDisplay) -> Callable[[str], None]:
    """The bench's callback: one message per part (``[bench] ...``)."""

    def say(message: str) -> None:
        display.say(f"[bench] {message}")

    return say


__all__ = ["ProgressDisplay", "bench_progress", "demo_progress", "stream_progress"]

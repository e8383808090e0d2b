"""Plugin isolation: running a plugin's code so that its failure stays its own.

Everything that calls into a plugin (discovery loading an entry point, selection asking a
backend class whether it is available, what it cannot serve, which BlockTables class it names)
runs the call through :func:`guarded` or :func:`backend_call`: whatever the plugin raises
(``SystemExit`` included; ``KeyboardInterrupt`` always propagates) becomes a value naming the
plugin, and what it prints to stdout is captured so machine-readable output stays valid.

This module sits below both :mod:`~diffusion_kv.platforms.interface` (the platform base class
guards its calls on backends) and :mod:`~diffusion_kv.platforms.selection` (discovery guards
loads and records failures): neither imports the other through it. Where a failure is recorded
is handed in (:class:`FailureReport`, which discovery's plugin set implements), never looked up.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Protocol, TypeVar

from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.errors import PlatformError

__all__ = [
    "BackendCallError",
    "FailureReport",
    "PluginFailure",
    "backend_call",
    "guarded",
    "printed_note",
    "safe_repr",
]

T = TypeVar("T")


def safe_repr(obj: object, how: Callable[[object], str] = repr) -> str:
    """``repr(obj)`` (or ``how(obj)``), or a placeholder when that raises."""
    try:
        return how(obj)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return f"<{type(obj).__name__} whose {how.__name__} raised {type(exc).__name__}>"


class PluginFailure(Exception):
    """What a plugin raised (anything but ``KeyboardInterrupt``), with its captured stdout."""

    def __init__(self, exc: BaseException, printed: str) -> None:
        super().__init__(f"{type(exc).__name__}: {safe_repr(exc, str)}")
        self.original = exc
        self.printed = printed


def guarded(call: Callable[[], T]) -> tuple[T, str]:
    """Run plugin code: ``(result, captured stdout)``, or :class:`PluginFailure` for anything it
    raises except ``KeyboardInterrupt`` (``SystemExit`` included)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            result = call()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise PluginFailure(exc, buffer.getvalue()) from exc
    return result, buffer.getvalue()


def printed_note(printed: str, when: str) -> str | None:
    """The warning about what a plugin printed to stdout ``when`` (None: it printed nothing)."""
    if not printed:
        return None
    shown = printed.strip().replace("\n", " | ")
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return (
        f"printed {len(printed)} characters to stdout {when} ({shown!r}); they were captured. "
        "Fix: log through logging or warnings instead of print"
    )


class BackendCallError(PlatformError):
    """A call on a paged backend class raised (``SystemExit`` included) or answered with the
    wrong type; the backend is skipped, and an entry-point one is reported as broken."""

    def __init__(self, backend: str, what: str, problem: str) -> None:
        super().__init__(f"backend {backend!r}: its {what} {problem}")
        self.what = what
        self.problem = problem


class FailureReport(Protocol):
    """Where :func:`backend_call` records a backend's failure or output (discovery's plugin set:
    an entry-point backend that failed is reported with its fix and skipped from then on; a
    built-in backend has no record there, so only the caller's reason remains)."""

    def report_failure(self, backend: type[PagedBackend], error: BackendCallError, printed: str) -> None: ...

    def report_note(self, backend: type[PagedBackend], note: str | None) -> None: ...


def backend_call(
    backend: type[PagedBackend],
    what: str,
    call: Callable[[], T],
    expect: Callable[[object], bool],
    expected: str,
    report: FailureReport | None = None,
) -> T:
    """Run plugin code on a backend class (``what`` names it, ``is_available()`` say) and check
    its answer. Whatever it raises (``SystemExit`` included; ``KeyboardInterrupt`` propagates)
    or a wrong answer is a :class:`BackendCallError`; the failure, and what the call printed to
    stdout (captured), go to ``report`` when one is given (discovery records an entry-point
    backend's failure: ``diffusion-kv platforms`` lists it with the fix, a
    ``PluginLoadWarning`` says so once, and the backend is skipped from then on)."""
    name = safe_repr(backend, lambda b: str(getattr(b, "name", b)))
    try:
        result, printed = guarded(call)
    except PluginFailure as failure:
        error = BackendCallError(name, what, f"raised {failure}")
        error.__cause__ = failure.original
        if report is not None:
            report.report_failure(backend, error, failure.printed)
        raise error from failure.original
    if not expect(result):
        error = BackendCallError(name, what, f"returned {safe_repr(result)}, not {expected}")
        if report is not None:
            report.report_failure(backend, error, printed)
        raise error
    if printed and report is not None:
        report.report_note(backend, printed_note(printed, f"in its {what}"))
    return result

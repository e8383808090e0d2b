"""pytest plugin (entry point ``pytest11``): the conformance kit's options and fixtures.

Run the kit against any installed platform and one of its paged backends::

    pytest --pyargs diffusion_kv.conformance --dkv-platform NAME [--dkv-backend BACKEND]

``--dkv-backend`` defaults to the backend ``DIFFUSION_KV_BACKEND=<platform>:<backend>`` names for
this platform, else the platform's highest-priority usable backend; every case builds its worker
with it as the backend choice (``RunnerConfig.backend``; the environment is never written). The
backend under test and who chose it head the summary (and pytest's header). The cases derive what they run from the backend's declared capabilities and skip, with
the backend's own reasons, what it does not declare. The terminal summary tells the truth about
every cell: the counts of passed, failed and skipped kit cases, and, when the session runs only
the kit, one line per case (parametrisations included) with its outcome and, for a skip or a
failure, the reason; then the declared-capability matrix (dtype x head size, slot dtypes, GQA
ratios), each combination passed or skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.errors import ConfigurationError
from diffusion_kv.platforms.interface import ENV_BACKEND, Platform, Requirements, forced_backend

MATRIX: list[str] = []
"""Lines the capability-matrix case records; printed in the terminal summary."""
KIT_MODULE = "diffusion_kv.conformance.test_paged_attention"
CELLS: list[tuple[str, str, str]] = []
"""``(outcome, case, reason)`` of every kit case this session ran."""
_KIT: dict[str, str] = {}  # node id -> case name, for the kit's items
_KIT_ONLY: list[bool] = []
UNDER_TEST: list[str] = []
"""``platform:backend (who chose it)`` of the backend the session's cases ran on."""
FIRST_USABLE = "the platform's first usable backend"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kit = {
        item.nodeid: item.name
        for item in items
        if getattr(getattr(item, "function", None), "__module__", None) == KIT_MODULE
    }
    _KIT.update(kit)
    _KIT_ONLY[:] = [bool(items) and len(kit) == len(items)]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    case = _KIT.get(report.nodeid)
    if case is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        CELLS.append(("skipped", case, reason.removeprefix("Skipped: ")))
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = str(getattr(crash, "message", "")) or report.longreprtext
        CELLS.append(("failed", case, message.strip().splitlines()[0][:200] if message.strip() else ""))
    else:
        CELLS.append(("passed", case, ""))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("diffusion-kv")
    group.addoption(
        "--dkv-platform",
        action="store",
        default=None,
        help="platform plugin the conformance kit runs against (default: automatic selection)",
    )
    group.addoption(
        "--dkv-backend",
        action="store",
        default=None,
        help="paged backend of that platform (default: its highest-priority available backend)",
    )


@pytest.fixture(scope="session")
def dkv_platform(request: pytest.FixtureRequest) -> Platform:
    from diffusion_kv.platforms.selection import get_platform

    name = request.config.getoption("--dkv-platform")
    return get_platform(name)


def backend_under_test(platform: Platform, name: str | None) -> tuple[type[PagedBackend] | None, str]:
    """The backend under test and who chose it: ``name`` (``--dkv-backend``), else the one
    ``DIFFUSION_KV_BACKEND`` names for ``platform``, else the platform's first usable backend
    (None when it has none usable here). A name the platform does not have, or a malformed
    ``DIFFUSION_KV_BACKEND``, is a :class:`ConfigurationError` (one line)."""
    candidates = platform.candidate_backends()
    source = "--dkv-backend"
    if name is None:
        name = forced_backend(platform.name)
        source = ENV_BACKEND
    if name is not None:
        named = [b for b in candidates if b.name == name]
        if not named:
            raise ConfigurationError(
                f"{source} names backend {name!r}, which platform {platform.name!r} does not have "
                f"(it has: {', '.join(b.name for b in candidates) or 'none'})"
            )
        return named[0], source
    for backend in candidates:
        if not platform.backend_reasons(backend, Requirements()):
            return backend, FIRST_USABLE
    return None, FIRST_USABLE


def choose_backend(platform: Platform, name: str | None) -> type[PagedBackend]:
    try:
        backend, source = backend_under_test(platform, name)
    except ConfigurationError as exc:
        raise pytest.UsageError(str(exc)) from None
    if backend is None:
        pytest.skip(f"{platform.name}: no paged backend is available here")
    label = f"{platform.name}:{backend.name} ({source})"
    if label not in UNDER_TEST:
        UNDER_TEST.append(label)
    return backend


@pytest.fixture
def dkv_backend(dkv_platform: Platform, request: pytest.FixtureRequest) -> Iterator[type[PagedBackend]]:
    """The backend under test (:func:`backend_under_test`); every case's worker is built with it
    as its backend choice (``RunnerConfig.backend``), so nothing touches the environment."""
    backend = choose_backend(dkv_platform, request.config.getoption("--dkv-backend"))
    reasons = dkv_platform.backend_reasons(backend, Requirements())
    if reasons:
        pytest.skip(f"{dkv_platform.name}:{backend.name}: {'; '.join(reasons)}")
    yield backend


def pytest_report_header(config: pytest.Config) -> str | None:
    """pytest's header (shown without ``-q``) names the backend under test."""
    if not config.getoption("--dkv-platform", None) and not config.getoption("--dkv-backend", None):
        return None
    from diffusion_kv.platforms.selection import get_platform

    try:
        platform = get_platform(config.getoption("--dkv-platform"))
        backend, source = backend_under_test(platform, config.getoption("--dkv-backend"))
    except Exception as exc:  # the session reports it where a case needs the backend
        return f"diffusion-kv conformance: no backend under test ({type(exc).__name__}: {exc})"
    shown = backend.name if backend is not None else "none usable here"
    return f"diffusion-kv conformance: platform {platform.name!r}, backend {shown!r} ({source})"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CELLS:
        counts = {o: sum(1 for c in CELLS if c[0] == o) for o in ("passed", "failed", "skipped")}
        terminalreporter.section("diffusion-kv conformance cases")
        if UNDER_TEST:
            terminalreporter.write_line("backend under test: " + "; ".join(UNDER_TEST))
        terminalreporter.write_line(
            f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
        )
        if _KIT_ONLY and _KIT_ONLY[0]:
            for outcome, case, reason in CELLS:
                terminalreporter.write_line(f"  {outcome:<8} {case}" + (f": {reason}" if reason else ""))
    if MATRIX:
        terminalreporter.section("diffusion-kv conformance matrix")
        for line in MATRIX:
            terminalreporter.write_line(line)

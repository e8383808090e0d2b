"""pytest plugin (entry point ``pytest11``): the conformance kit's options and fixtures.

Run the kit against any installed platform and one of its paged backends::

    pytest --pyargs diffusion_kv.conformance --dkv-platform NAME [--dkv-backend BACKEND]

``--dkv-backend`` defaults to the platform's highest-priority usable backend; the fixture
forces it for each case with ``DIFFUSION_KV_BACKEND``. The cases derive what they run from
the backend's declared capabilities and skip, with the backend's own reasons, what it does
not declare; the terminal summary prints the matrix of what ran and what was skipped.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.platforms.interface import Platform, Requirements

MATRIX: list[str] = []
"""Lines the capability-matrix case records; printed in the terminal summary."""


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


def choose_backend(platform: Platform, name: str | None) -> type[PagedBackend]:
    candidates = platform.candidate_backends()
    if name is not None:
        named = [b for b in candidates if b.name == name]
        if not named:
            raise pytest.UsageError(
                f"--dkv-backend {name!r}: platform {platform.name!r} has {[b.name for b in candidates]}"
            )
        return named[0]
    for backend in candidates:
        if not platform.backend_reasons(backend, Requirements()):
            return backend
    pytest.skip(f"{platform.name}: no paged backend is available here")


@pytest.fixture
def dkv_backend(dkv_platform: Platform, request: pytest.FixtureRequest) -> Iterator[type[PagedBackend]]:
    """The backend under test; every case's worker is built with it as its backend choice
    (``RunnerConfig.backend``), so nothing touches the environment."""
    backend = choose_backend(dkv_platform, request.config.getoption("--dkv-backend"))
    reasons = dkv_platform.backend_reasons(backend, Requirements())
    if reasons:
        pytest.skip(f"{dkv_platform.name}:{backend.name}: {'; '.join(reasons)}")
    yield backend


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MATRIX:
        terminalreporter.section("diffusion-kv conformance matrix")
        for line in MATRIX:
            terminalreporter.write_line(line)

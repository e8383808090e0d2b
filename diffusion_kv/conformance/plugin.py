"""pytest plugin (entry point ``pytest11``): ``--dkv-platform NAME`` and the ``dkv_platform``
fixture used by the conformance cases.

Run the kit against any installed platform plugin:

    pytest --pyargs diffusion_kv.conformance --dkv-platform NAME
"""

from __future__ import annotations

import pytest

from diffusion_kv.platforms.interface import Platform


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("diffusion-kv")
    group.addoption(
        "--dkv-platform",
        action="store",
        default=None,
        help="platform plugin the conformance kit runs against (default: automatic selection)",
    )


@pytest.fixture(scope="session")
def dkv_platform(request: pytest.FixtureRequest) -> Platform:
    from diffusion_kv.platforms.selection import get_platform

    name = request.config.getoption("--dkv-platform")
    return get_platform(name)

"""The documented minimal plugin (examples/dkv-toy-plugin), loaded from its source folder.

The conformance kit's ``dkv_platform`` fixture is overridden here, so the kit's cases imported
by ``test_toy_plugin_kit.py`` run against the toy platform. CI also installs the plugin as a
distribution and runs ``diffusion-kv conformance --platform toy`` through its entry point.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dkv-toy-plugin"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from dkv_toy import ToyPlatform  # noqa: E402


@pytest.fixture(autouse=True)
def _toy_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TOY_DEVICE", "1")
    yield


@pytest.fixture
def dkv_platform() -> ToyPlatform:
    return ToyPlatform()

"""Shared fixtures."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from diffusion_kv.platforms import selection

TEST_GROUP = "diffusion_kv_test.platforms"


@pytest.fixture(autouse=True)
def _clean_platform_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts from the real group, no overrides, and no cached plugin sets."""
    for var in (
        "DIFFUSION_KV_BACKEND",
        selection.ENV_PLATFORM,
        selection.ENV_PLUGINS,
        selection.ENV_BACKEND_PLUGINS,
        selection.ENV_BLOCKED_BACKENDS,
        selection.ENV_GROUP,
        "DKV_TEST_FAKEACCEL",
        "DKV_TEST_FAKEACCEL2",
        "DKV_TEST_LIMITED",
    ):
        monkeypatch.delenv(var, raising=False)
    selection.refresh()
    yield
    selection.refresh()


@pytest.fixture
def test_group(monkeypatch: pytest.MonkeyPatch) -> str:
    """Point discovery at the test distributions' entry-point group."""
    if (
        importlib.util.find_spec("dkv_test_plugins") is None
        or importlib.util.find_spec("dkv_test_plugins_dup") is None
    ):
        pytest.fail(
            "the test plugin distributions are not installed; run the README test command "
            "(ci/test.sh installs tests/fixtures/dkv-test-plugins and dkv-test-plugins-dup)"
        )
    monkeypatch.setenv(selection.ENV_GROUP, TEST_GROUP)
    selection.refresh()
    return TEST_GROUP

"""One broken plugin installed never breaks the reference, auto-selection or the CLI.

Every case is a real entry point of the ``dkv-test-plugins-hostile`` distribution, in a group of
its own beside the built-in ``cpu`` (``tests/fixtures/README.md``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest

import diffusion_kv
from diffusion_kv import PluginLoadError
from diffusion_kv.cli import main
from diffusion_kv.platforms import selection
from diffusion_kv.platforms.cpu import CpuPlatform

# group -> (plugin name, what its report must say)
CASES = {
    "sysexit": ("sysexit", "failed to import: SystemExit: 3"),
    "badattr": ("badattr", "inspecting the class raised RuntimeError: backend table could not be read"),
    "badrepr": ("badrepr", "resolved to <_BadRepr whose repr raised ValueError>, which is not a subclass"),
    "detector_exit": ("detector_exit", "detector raised SystemExit: driver library called exit()"),
    "detector_error": ("detector_error", "detector raised ValueError: malformed driver version string"),
    "init_raises": ("init_raises", "failed to construct: RuntimeError: device context could not be created"),
}


@pytest.fixture(autouse=True)
def _hostile_installed() -> None:
    if importlib.util.find_spec("dkv_test_hostile") is None:
        pytest.fail("dkv-test-plugins-hostile is not installed; run ci/bootstrap.sh")


def use_group(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setenv(selection.ENV_GROUP, f"dkv_hostile.{case}")
    selection.refresh()


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_broken_plugin_leaves_everything_else_working(
    case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name, fact = CASES[case]
    use_group(monkeypatch, case)
    assert isinstance(diffusion_kv.get_platform("cpu"), CpuPlatform)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = diffusion_kv.get_platform()
    assert chosen.name == "cpu"
    statuses = {s.name: s for s in diffusion_kv.available_platforms()}
    broken = statuses[name]
    assert not broken.available and not broken.selected
    report = broken.error if broken.error is not None else broken.reason
    assert fact in report, report
    if broken.error is not None:  # an unusable plugin is reported by auto-selection, never silently
        assert any(fact in str(w.message) for w in caught)
        assert f"dkv_hostile.{case}" not in broken.entry_point  # the entry point text, not the group
        assert broken.entry_point.startswith(f"{name} = dkv_test_hostile.")
        with pytest.raises(PluginLoadError, match="Fix: "):
            diffusion_kv.get_platform(name)

    capsys.readouterr()
    assert main(["platforms"]) == 0
    text = capsys.readouterr().out
    assert "selected: cpu" in text and fact in text
    assert main(["platforms", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["selected"] == "cpu"
    entry = next(p for p in payload["platforms"] if p["name"] == name)
    assert fact in (entry["error"] or entry["reason"])


def test_a_plugin_claiming_a_builtin_name_is_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use_group(monkeypatch, "claims_cpu")
    platform = diffusion_kv.get_platform("cpu")
    assert type(platform) is CpuPlatform  # the built-in, not dkv_test_plugins_dup.CpuThief
    statuses = {s.name: s for s in diffusion_kv.available_platforms()}
    assert statuses["cpu"].entry_point == "cpu = diffusion_kv.platforms.cpu:CpuPlatform"
    assert statuses["cpu"].available and statuses["cpu"].selected
    assert main(["platforms", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    (skipped,) = payload["skipped_entry_points"]
    assert skipped["entry_point"] == "cpu = dkv_test_plugins_dup:CpuThief"
    assert skipped["distribution"].startswith("dkv-test-plugins-dup ")
    assert "claims the built-in platform name 'cpu'" in skipped["error"] and "Fix:" in skipped["error"]
    assert main(["platforms"]) == 0
    assert (
        "cpu (skipped entry point): entry point 'cpu = dkv_test_plugins_dup:CpuThief'"
        in capsys.readouterr().out
    )


def test_keyboard_interrupt_still_interrupts(monkeypatch: pytest.MonkeyPatch) -> None:
    use_group(monkeypatch, "interrupt")
    with pytest.raises(KeyboardInterrupt):
        diffusion_kv.get_platform("cpu")


def test_printing_plugin_keeps_json_valid_in_a_real_process() -> None:
    """Run the console script: stdout must be exactly one JSON document."""
    env = {**os.environ, selection.ENV_GROUP: "dkv_hostile.printer"}
    env.pop(selection.ENV_PLATFORM, None)
    env.pop(selection.ENV_PLUGINS, None)
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "platforms", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    printer = next(p for p in payload["platforms"] if p["name"] == "printer")
    assert printer["error"] is None and printer["reason"] == "no printer device here"
    notes = " ".join(printer["notes"])
    assert "printed" in notes and "at import" in notes and "in its detector" in notes
    assert "printer plugin loaded" in notes

"""One broken plugin installed never breaks the reference, auto-selection, worker set-up or the CLI.

Every case is a real entry point of the ``dkv-test-plugins-hostile`` distribution, in a group of
its own beside the built-in ``cpu`` (``tests/fixtures/README.md``): platform plugins, and paged
backends added to ``cpu`` through the backends group.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch

import diffusion_kv
from diffusion_kv import (
    NativeBackendError,
    PagedLayerSpec,
    PagedWorker,
    PluginLoadError,
    Requirements,
    RunnerConfig,
)
from diffusion_kv.cli import main
from diffusion_kv.platforms import selection
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend

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
    for name in (selection.ENV_PLUGINS, selection.ENV_BACKEND_PLUGINS, selection.ENV_BLOCKED_BACKENDS):
        env.pop(name, None)
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


# --- backends another distribution adds (entry-point group ``<group>.backends``) ------------------

# case -> what its report must say (each backend names platform cpu, priority 500 > reference's)
BACKEND_CASES = {
    "avail_raises": "its is_available() raised RuntimeError: driver probe failed",
    "avail_exits": "its is_available() raised SystemExit: driver library called exit()",
    "avail_wrong": "its is_available() returned 'yes', not an Availability",
    "reasons_raise": "its not_supported_reasons() raised ValueError: capability table is corrupt",
    "reasons_exit": "its not_supported_reasons() raised SystemExit: 4",
    "tables_raise": "its block_tables_cls() raised RuntimeError: no block tables for you",
    "import_exits": "failed to import: SystemExit: 3",
}


def cpu_worker() -> PagedWorker:
    runner = PagedWorker(diffusion_kv.get_platform("cpu"), RunnerConfig(32, 1, 2, 64))
    runner.register_kv_cache_layers({"l0": PagedLayerSpec(2, 1, 8, torch.float32)})
    runner.initialize_kv_cache(num_blocks=8, block_size=4)
    return runner


@pytest.mark.parametrize("case", sorted(BACKEND_CASES))
def test_one_broken_backend_plugin_leaves_the_platform_working(
    case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fact = BACKEND_CASES[case]
    use_group(monkeypatch, f"backend_{case}")
    entry = f"{case} = dkv_test_hostile." + (
        "exits_at_import:Plugin" if case == "import_exits" else "backends:"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = cpu_worker()  # worker set-up: selection asks the broken backend first, then skips it
        assert diffusion_kv.get_platform().name == "cpu"  # auto-selection reports it too
    # float64 layers: of the built-ins only the reference serves them
    assert [b.name for b in runner.backends] == ["reference"] and type(
        runner.backends[0]
    ) is CpuReferenceBackend
    reported = [str(w.message) for w in caught if issubclass(w.category, selection.PluginLoadWarning)]
    assert reported and all(fact in r and "Fix: " in r and f"(entry point '{entry}" in r for r in reported)
    # skipped from then on: the platform lists, explains and selects without it
    cpu = diffusion_kv.get_platform("cpu")
    assert [b.name for b in cpu.candidate_backends()] == ["sdpa", "reference"]
    assert cpu.select_backend(Requirements()).name == "sdpa"
    (broken,) = selection.discover().broken_backends()
    assert broken.name == case and broken.backend_cls is None and fact in str(broken.error)

    capsys.readouterr()
    assert main(["platforms", "--explain"]) == 0
    text = capsys.readouterr().out
    assert (
        "plugins that failed to load:" in text
        and f"{case} (backend, skipped): paged backend {case!r}" in text
    )
    assert fact in text and "selected: cpu" in text and "selects backend 'sdpa'" in text
    assert main(["platforms", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    (skipped,) = payload["skipped_entry_points"]
    assert skipped["kind"] == "backend" and skipped["name"] == case
    assert (
        skipped["entry_point"].startswith(entry) and fact in skipped["error"] and "Fix: " in skipped["error"]
    )
    assert skipped["group"] == f"dkv_hostile.backend_{case}.backends"
    assert skipped["distribution"].startswith("dkv-test-plugins-hostile ")


@pytest.mark.parametrize("case", ["avail_exits", "reasons_raise"])
def test_a_broken_backend_is_listed_by_platforms_in_a_fresh_process(case: str) -> None:
    """The first thing a process does is list the platforms: the broken backend is found and
    reported there, the command exits 0 and stdout is exactly one JSON document."""
    env = {**os.environ, selection.ENV_GROUP: f"dkv_hostile.backend_{case}"}
    for name in (
        selection.ENV_PLATFORM,
        selection.ENV_PLUGINS,
        selection.ENV_BACKEND_PLUGINS,
        selection.ENV_BLOCKED_BACKENDS,
        "DIFFUSION_KV_BACKEND",
    ):
        env.pop(name, None)
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
    assert payload["selected"] == "cpu" and payload["error"] is None
    (skipped,) = payload["skipped_entry_points"]
    assert skipped["name"] == case and BACKEND_CASES[case] in skipped["error"]
    (cpu,) = payload["platforms"]
    listed = {b["name"]: b for b in cpu["backends"]}
    assert listed[case]["available"] is False and BACKEND_CASES[case] in listed[case]["reason"]
    assert listed["reference"]["available"] is True


def test_a_backend_constructor_calling_exit_is_a_native_error() -> None:
    class ExitingBackend(CpuReferenceBackend):
        name = "exiting"

        def __init__(self, group: Any) -> None:
            sys.exit("vendor runtime refused the context")

    class ExitingCpu(CpuPlatform):
        backends = (ExitingBackend,)

    runner = PagedWorker(ExitingCpu(), RunnerConfig(32, 1, 2, 64))
    runner.register_kv_cache_layers({"l0": PagedLayerSpec(2, 1, 8, torch.float32)})
    with pytest.raises(
        NativeBackendError,
        match=r"platform 'cpu' failed to build its backend 'exiting' \(SystemExit: vendor runtime refused",
    ) as info:
        runner.initialize_kv_cache(num_blocks=8, block_size=4)
    assert isinstance(info.value.__cause__, SystemExit) and not runner.initialized

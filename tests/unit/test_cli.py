"""The ``diffusion-kv`` command: output and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from diffusion_kv.cli import main
from diffusion_kv.platforms import selection


def test_platforms_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    assert "cpu = diffusion_kv.platforms.cpu:CpuPlatform" in out
    assert "cuda = diffusion_kv.platforms.cuda:CudaPlatform" in out
    assert "npu = diffusion_kv.platforms.npu:NpuPlatform" in out
    if not torch.cuda.is_available():
        assert "selected: cpu (auto: no accelerator platform is available" in out
        assert "torch_npu is not installed" in out


def test_platforms_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platforms", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    names = {p["name"]: p for p in payload["platforms"]}
    assert {"cpu", "cuda", "npu"} <= set(names)
    assert names["npu"]["capabilities"]["slot_mapping_dtypes"] == ["int32"]
    assert [b["name"] for b in names["cpu"]["backends"]][-1] == "reference"
    assert names["cuda"]["distributed_backend"] == "nccl" and names["cpu"]["distributed_backend"] == "gloo"
    assert names["npu"]["default_block_size"] == 128
    assert names["cpu"]["is_reference"] is True
    assert payload["error"] is None
    if not torch.cuda.is_available():
        assert payload["selected"] == "cpu" and names["cpu"]["selected"] is True
        assert names["cuda"]["available"] is False


def test_bogus_platform_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(selection.ENV_PLATFORM, "bogus")
    assert main(["platforms"]) == 1
    err = capsys.readouterr().err
    assert "'bogus'" in err and "installed: cpu, cuda, npu" in err


def test_broken_plugins_listed_in_cli(test_group: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    assert "plugins that failed to load:" in out
    assert "importerror: platform plugin 'importerror'" in out
    assert "selected: cpu" in out


def test_ambiguous_selection_exits_non_zero(
    test_group: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DKV_TEST_FAKEACCEL", "1")
    monkeypatch.setenv("DKV_TEST_FAKEACCEL2", "1")
    assert main(["platforms", "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["selected"] is None and "fakeaccel, fakeaccel2" in payload["error"]


def test_console_script_runs_as_a_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "platforms", "--json"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, selection.ENV_PLATFORM: "bogus"},
        check=False,
    )
    assert proc.returncode == 1
    assert "no platform named 'bogus'" in proc.stderr


def test_conformance_command_runs_the_kit() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffusion_kv.cli",
            "conformance",
            "--platform",
            "cpu",
            "--",
            "-k",
            "prefix_only or stale",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "conformance kit on platform 'cpu'" in proc.stdout
    assert "2 passed" in proc.stdout


def test_conformance_command_unknown_platform(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--platform", "bogus"]) == 2
    assert "diffusion-kv: error: argument --platform: no platform named 'bogus'" in capsys.readouterr().err

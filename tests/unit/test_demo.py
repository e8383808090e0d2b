"""The demo: dense and paged modes agree; the CLI fails when they do not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from diffusion_kv.models.demo import DemoConfig, format_result, run_demo
from diffusion_kv.platforms.cpu import CpuPlatform

SMALL = dict(prefix_len=37, target_len=19, steps=3, hidden=64, heads=4, layers=2, max_model_len=256)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("cfg_rows", [1, 2])
def test_modes_agree(block_size: int, cfg_rows: int) -> None:
    result = run_demo(CpuPlatform(), DemoConfig(block_size=block_size, cfg_rows=cfg_rows, **SMALL))  # type: ignore[arg-type]
    assert result.agree and result.max_abs_diff < 1e-4
    assert result.blocks_used == cfg_rows * -(-56 // block_size)
    assert len(result.dense_step_ms) == len(result.paged_step_ms) == 3
    assert result.block_utilisation == pytest.approx(cfg_rows * 56 / (result.blocks_used * block_size))


def test_gqa_and_half_precision_agree() -> None:
    result = run_demo(CpuPlatform(), DemoConfig(kv_heads=2, dtype=torch.float16, **SMALL))  # type: ignore[arg-type]
    assert result.agree and result.dtype == "float16"


def test_the_report_names_the_backend_that_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFUSION_KV_BACKEND", "cpu:reference")
    result = run_demo(CpuPlatform(), DemoConfig(**SMALL))  # type: ignore[arg-type]
    assert result.backends == ("cpu:reference",)
    assert (
        format_result(result).splitlines()[0]
        == "platform: cpu (device cpu, float32), paged backend cpu:reference"
    )
    monkeypatch.delenv("DIFFUSION_KV_BACKEND")
    assert run_demo(CpuPlatform(), DemoConfig(**SMALL)).backends == ("cpu:sdpa",)  # type: ignore[arg-type]


def test_corrupted_cache_is_detected() -> None:
    result = run_demo(CpuPlatform(), DemoConfig(inject_fault=True, **SMALL))  # type: ignore[arg-type]
    assert not result.agree and result.max_abs_diff > result.tolerance


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    small = ["--prefix", "40", "--target", "16", "--steps", "2", "--hidden", "64", "--layers", "1"]
    return subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "demo", *small, *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_json_and_exit_codes() -> None:
    ok = _cli("--json")
    assert ok.returncode == 0, ok.stderr
    payload = json.loads(ok.stdout)
    assert payload["agree"] is True and payload["platform"] == "cpu" and payload["cfg_rows"] == 2
    assert payload["shapes"]["seq_len"] == 56 and payload["speedup"] > 0
    bad = _cli("--inject-fault", "--no-progress")
    assert bad.returncode == 1
    assert "DISAGREE" in bad.stdout and "outputs disagree" in bad.stderr


def test_cli_rejects_bad_sizes() -> None:
    proc = _cli("--max-model-len", "8")
    assert proc.returncode == 2
    assert proc.stderr == "diffusion-kv: error: --prefix 40 + --target 16 exceeds --max-model-len 8\n"

"""The stream demo: mixed requests served together agree with their own dense runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from diffusion_kv.models.stream import StreamConfig, make_requests, run_stream
from diffusion_kv.platforms.cpu import CpuPlatform

SMALL = dict(
    requests=6, prefix_len=24, target_len=8, steps=3, hidden=32, heads=2, kv_heads=2, layers=1, block_size=8
)


def test_workload_mixes_every_shape() -> None:
    reqs = make_requests(StreamConfig(**SMALL))  # type: ignore[arg-type]
    assert [(r.prefix_len, r.target_len, r.steps, r.cfg_rows) for r in reqs] == [
        (24, 8, 3, 2),
        (12, 4, 3, 2),
        (0, 8, 3, 1),
        (24, 4, 5, 1),
        (12, 8, 5, 2),
        (0, 4, 5, 2),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stream_agrees_with_dense_per_request(dtype: torch.dtype) -> None:
    result = run_stream(CpuPlatform(), StreamConfig(dtype=dtype, **SMALL))  # type: ignore[arg-type]
    assert result.agree, result.requests
    reqs = make_requests(StreamConfig(**SMALL))  # type: ignore[arg-type]
    assert result.sequential["ticks"] == sum(r.steps for r in reqs) == 24
    assert result.stream["ticks"] < result.sequential["ticks"]
    assert result.stream["max_running"] > 1 and result.sequential["max_running"] == 1
    blocks = [r.cfg_rows * -(-r.seq_len // 8) for r in reqs]
    assert result.pool_blocks == max(max(blocks), -(-6 * sum(blocks) // 10))
    assert result.stream["peak_blocks"] <= result.pool_blocks
    assert result.target_token_steps == sum(r.cfg_rows * r.target_len * r.steps for r in reqs)
    assert result.stream["graph_captures"] == 0  # CPU: no graphs


def test_cli_stream_json() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "diffusion_kv.cli", "demo", "--stream", "4", "--prefix", "24", "--target", "8",
            "--steps", "3", "--hidden", "32", "--heads", "2", "--layers", "1", "--json",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["agree"] is True and len(payload["requests"]) == 4
    assert payload["stream"]["requests_per_s"] > 0 and payload["speedup"] > 0


def test_cli_stream_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "demo", "--stream", "2", "--inject-fault"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--inject-fault applies to the single-request demo only" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "demo", "--stream", "2", "--pool-fraction", "1.5"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "(0, 1]" in proc.stderr

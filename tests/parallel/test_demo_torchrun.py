"""``diffusion-kv demo --ulysses 2 --cfg-parallel`` launched by torchrun on 4 CPU ranks, and
``demo --dcp 2`` on 2 (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.parallel.harness import free_port


def test_torchrun_demo_ulysses_and_cfg_parallel_agree_with_dense() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # what the torchrun script runs
        "--nproc-per-node",
        "4",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "diffusion_kv.cli",
        "demo",
        "--ulysses",
        "2",
        "--cfg-parallel",
        *("--prefix", "21", "--target", "9", "--steps", "2", "--hidden", "32", "--layers", "1"),
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(proc.stdout)  # only rank 0 prints
    assert payload["agree"] is True and payload["max_abs_diff"] < 1e-4
    parallel = payload["extra"]["parallel"]
    assert parallel == {
        "backend": "gloo",
        "world_size": 4,
        "rank": 0,
        "ulysses_degree": 2,
        "cfg_parallel_size": 2,
        "dcp_size": 1,
        "dcp_interleave": 1,
        "paged_backends": ["sdpa"],
        "rank_local_heads": 2,
        "rank_local_kv_heads": 2,
        "worker_rows": {"demo/0": 0},  # rank 0 serves CFG branch 0 only
    }


def test_torchrun_demo_dcp_agrees_with_dense() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "diffusion_kv.cli",
        "demo",
        "--platform",
        "cpu",
        *("--dcp", "2", "--dcp-interleave", "4"),
        *("--prefix", "21", "--target", "9", "--steps", "2", "--hidden", "32", "--layers", "1"),
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(proc.stdout)
    assert payload["agree"] is True and payload["max_abs_diff"] < 1e-4
    parallel = payload["extra"]["parallel"]
    assert parallel == {
        "backend": "gloo",
        "world_size": 2,
        "rank": 0,
        "ulysses_degree": 1,
        "cfg_parallel_size": 1,
        "dcp_size": 2,
        "dcp_interleave": 4,
        "paged_backends": ["sdpa"],
        "rank_local_heads": 4,
        "rank_local_kv_heads": 4,
        "worker_rows": {"demo/0": 0, "demo/1": 1},  # every rank holds both CFG rows
    }
    # rank 0 holds positions 0-3, 8-11, 16-19, 24-27 of each 30-token row: 16 of 30 tokens
    assert payload["blocks_used"] == 2 and payload["block_utilisation"] == 1.0  # 16 tokens per 16-token block

"""The kit's report tells the truth: one line per case with its outcome and reason; per-backend
tolerances are declared on the backend and read by the kit."""

from __future__ import annotations

import subprocess
import sys

import torch

from diffusion_kv.conformance.reference import tolerance
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.selection import validate_backend_class


def test_every_case_is_one_line_with_its_outcome() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "diffusion_kv.conformance",
            "--dkv-platform", "cpu", "--dkv-backend", "sdpa", "-k", "block_sizes or fp8_kv_cache_saturates",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:]
    section = proc.stdout.split("diffusion-kv conformance cases")[1].splitlines()
    assert section[1:6] == [
        "3 passed, 0 failed, 1 skipped",
        "  passed   test_block_sizes[16]",
        "  passed   test_block_sizes[64]",
        "  passed   test_block_sizes[128]",
        "  skipped  test_fp8_kv_cache_saturates_and_counts: cpu:sdpa: declares no fp8_e4m3 KV cache",
    ]


class Loose(CpuReferenceBackend):
    name = "loose"
    tolerances = {torch.float16: (1e-2, 5e-3)}


class Bad(CpuReferenceBackend):
    name = "bad"
    tolerances = {torch.float16: (-1.0, 0.0)}  # type: ignore[dict-item]


def test_declared_tolerances_are_read_and_checked() -> None:
    assert tolerance(torch.float16, Loose) == {"atol": 1e-2, "rtol": 5e-3}
    assert tolerance(torch.float32, Loose) == tolerance(torch.float32) == {"atol": 2e-5, "rtol": 2e-5}
    assert validate_backend_class(Loose, "loose") == []
    assert any(
        "tolerances must map torch dtypes to (atol, rtol)" in p for p in validate_backend_class(Bad, "bad")
    )

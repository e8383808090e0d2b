"""The kit's report tells the truth: one line per case with its outcome and reason; per-backend
tolerances are declared on the backend and read by the kit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from diffusion_kv.conformance import test_paged_attention as kit
from diffusion_kv.conformance.plugin import MATRIX
from diffusion_kv.conformance.reference import mismatch, tolerance
from diffusion_kv.core.backend import KVPageLayout
from diffusion_kv.core.batch import KVCache, LayerGeometry, key_value_caches
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.cpu import CpuPlatform
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
    assert section[1:7] == [
        "backend under test: cpu:sdpa (--dkv-backend)",
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


# -- what a failure says ------------------------------------------------------------------------


def test_a_mismatch_names_row_position_head_and_mode() -> None:
    """Two rows packed (row 0: positions 2-5 of 6, row 1: 0-3 of 4) with the span (3, 5) on row
    0; one value off at packed token 2 (row 0, position 4, inside the span), head 1."""
    rows = (PagedRow("r", 4, 6, 2, sequence_id=0), PagedRow("r", 4, 4, 0, sequence_id=1))
    want = torch.zeros(8, 2, 3, dtype=torch.float64)
    got = want.clone()
    got[2, 1, 0] = 0.5
    got[6, 0, 2] = -2.0  # the largest: row 1, position 2, head 0, a causal piece
    assert mismatch(got, want, 1e-3, 1e-3, rows, AttentionMode.PIECEWISE, [[(3, 5)], []]) == (
        "paged != dense at row 0 (request 'r', sequence 0), key/query position 4 of 6, head 1, mode "
        "piecewise (full span [3, 5)): paged 0.5, dense 0 (|diff| 0.5 > atol 0.001 + rtol 0.001 x |dense|); "
        "2 of 48 values differ, the largest |diff| 2 at row 1 (request 'r', sequence 1), key/query position "
        "2 of 4, head 0, mode piecewise (causal piece)"
    )
    assert mismatch(want + 1e-4, want, 1e-3, 1e-3, rows, AttentionMode.CAUSAL) is None
    got = want.clone()
    got[7, 1, 1] = float("nan")
    assert mismatch(got, want, 1e-3, 1e-3).startswith(  # type: ignore[union-attr]
        "paged != dense at packed token 7, head 1: paged nan, dense 0 (|diff| nan > atol"
    )
    assert mismatch(got[:4], want, 1e-3, 1e-3) == "paged output has shape (4, 2, 3), dense (8, 2, 3)"


class WrongAtLargestGqa(CpuReferenceBackend):
    """Right everywhere except at 16 query heads per KV head, where head 5 is off by 0.5."""

    name: ClassVar[str] = "wrong-at-16"

    def forward(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, metadata: Any, out: Any = None
    ) -> torch.Tensor:
        result = super().forward(layer, query, kv_cache, metadata, out)
        if layer.num_heads // layer.num_kv_heads == 16:
            result[:, 5] += 0.5
        return result


@pytest.fixture
def matrix_lines() -> Any:
    saved = list(MATRIX)
    MATRIX.clear()
    yield MATRIX
    MATRIX[:] = saved


def test_a_failing_matrix_cell_is_named_and_the_matrix_printed(matrix_lines: list[str]) -> None:
    """Every other cell still runs; the matrix lists each with its outcome; the failure names
    the cell and, in it, the row, position, head and mode of the first differing value."""
    assert kit.gqa_ratios(WrongAtLargestGqa) == [1, 2, 16]  # no max_gqa_ratio declared
    with pytest.raises(AssertionError) as caught:
        kit.test_declared_capability_matrix(CpuPlatform(), WrongAtLargestGqa)
    where = (
        "AssertionError: cpu:wrong-at-16: paged != dense at row 0 (request 'r', sequence 0), key/query "
        "position 0 of 21, head 5, mode causal: paged "
    )
    assert str(caught.value).startswith(f"failing matrix cell(s): gqa=16:1 ({where}")
    assert matrix_lines[0] == (
        "cpu:wrong-at-16 declared cells (dtype x head size, slot dtypes, GQA): 12 passed, 1 failed, 0 skipped "
        "(the kit's other cases are counted above)"
    )
    assert [line.split(":")[0] for line in matrix_lines[1:]][-4:] == [
        "  passed   slots=int64",
        "  passed   gqa=1",
        "  passed   gqa=2",
        "  failed   gqa=16",
    ]
    assert matrix_lines[-1].startswith(f"  failed   gqa=16:1: {where}")
    assert len(matrix_lines) == 1 + 13


def test_the_largest_declared_gqa_ratio_is_tested() -> None:
    class Capped(CpuReferenceBackend):
        capabilities = CpuReferenceBackend.capabilities.__class__(
            **{**CpuReferenceBackend.capabilities.__dict__, "max_gqa_ratio": 4}
        )

    class NoGqa(CpuReferenceBackend):
        capabilities = CpuReferenceBackend.capabilities.__class__(
            **{**CpuReferenceBackend.capabilities.__dict__, "supports_gqa": False}
        )

    assert kit.gqa_ratios(Capped) == [1, 2, 4]
    assert kit.gqa_ratios(NoGqa) == [1, 2, 16]  # 2 and 16 are listed and skipped with its reason


class HeadFirstReference(CpuReferenceBackend):
    """The reference kernel over head-first pages ``[2, blocks, Hkv, page, D]``."""

    name: ClassVar[str] = "head-first"
    page_layout: ClassVar[KVPageLayout] = KVPageLayout.HEAD_FIRST

    def forward_partial(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = key_value_caches(kv_cache)
        return super().forward_partial(layer, query, (k.transpose(1, 2), v.transpose(1, 2)), metadata)


@pytest.mark.parametrize("scales", ["unit", "per-head"])
def test_the_fp8_byte_check_reads_the_declared_page_layout(scales: str) -> None:
    """A correct head-first backend passes the kit's e4m3 byte-for-byte check."""
    kit.test_fp8_kv_cache_equals_dense_over_the_stored_values(CpuPlatform(), HeadFirstReference, scales)


# -- which backend is under test, and what the command prints ------------------------------------


def _kit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "conformance", "--platform", "cpu", "--", "-k", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "DIFFUSION_KV_BACKEND"}, **(env or {})},
    )


def test_the_backend_variable_is_the_kits_default_and_dkv_backend_wins(tmp_path: Path) -> None:
    """DIFFUSION_KV_BACKEND=cpu:reference runs the kit on reference (not the platform's first
    backend), --dkv-backend overrides it, the header and the summary name it; and no pytest
    rewrite warning shows even where an installed distribution marks diffusion_kv for rewriting
    (a dist-info whose RECORD lists it, with a pytest11 entry point, stands in for the wheel)."""
    info = tmp_path / "dkv_standin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dkv-standin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\ndkv_standin = diffusion_kv.conformance.reference\n")
    (info / "RECORD").write_text("diffusion_kv/__init__.py,,\n")
    env = {"DIFFUSION_KV_BACKEND": "cpu:reference", "PYTHONPATH": str(tmp_path)}
    proc = _kit("prefix_only_causal", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "conformance kit on platform 'cpu', backend 'reference' (DIFFUSION_KV_BACKEND)"
    assert "backend under test: cpu:reference (DIFFUSION_KV_BACKEND)" in lines
    assert "Warning" not in proc.stdout + proc.stderr and "1 passed" in lines[-1]
    proc = _kit("prefix_only_causal", "--dkv-backend", "sdpa", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == "conformance kit on platform 'cpu', backend 'sdpa' (--dkv-backend)"
    assert "backend under test: cpu:sdpa (--dkv-backend)" in proc.stdout.splitlines()


@pytest.mark.parametrize(
    ("variable", "extra", "code", "error"),
    [
        (
            "cpu:nope",
            (),
            1,
            "DIFFUSION_KV_BACKEND names backend 'nope', which platform 'cpu' does not have (it has: ",
        ),
        ("nope", (), 1, "DIFFUSION_KV_BACKEND='nope'; expected <platform>:<backend>, e.g. cuda:triton"),
        (
            None,
            ("--dkv-backend=nope",),
            2,
            "--dkv-backend names backend 'nope', which platform 'cpu' does not have (it has: ",
        ),
    ],
)
def test_a_backend_the_platform_lacks_is_one_line_before_any_case(
    variable: str | None, extra: tuple[str, ...], code: int, error: str
) -> None:
    proc = _kit("prefix_only_causal", *extra, env={"DIFFUSION_KV_BACKEND": variable} if variable else None)
    assert (proc.returncode, proc.stdout) == (code, "")
    assert proc.stderr.startswith(f"diffusion-kv: error: {error}") and proc.stderr.count("\n") == 1

"""Host-side planning of the cuda backends (no GPU, no Triton): row groups and page views."""

from __future__ import annotations

import torch

from diffusion_kv.platforms.cuda.backend import choose_way, contiguous_run, sdpa_row_groups

CPU = torch.device("cpu")


def test_contiguous_runs_in_kernel_blocks() -> None:
    assert contiguous_run((4, 5, 6), ratio=1, count=3) == 4
    assert contiguous_run((4, 5, 9), ratio=1, count=2) == 4  # only the blocks the row reads count
    assert contiguous_run((4, 5, 9), ratio=1, count=3) is None
    assert contiguous_run((3, 4), ratio=2, count=3) == 6  # scheduler blocks 3, 4 = kernel blocks 6..9
    assert contiguous_run((3,), ratio=2, count=3) is None


def test_evenly_spaced_contiguous_rows_become_one_strided_view() -> None:
    qsl, seq = (0, 10, 20), (300, 300)
    # page 128: 3 kernel blocks per row; rows back to back (a best-fit allocation of one request)
    (grp,) = sdpa_row_groups(qsl, seq, CPU, ((0, 1, 2), (3, 4, 5)), ratio=1, page=128)
    assert grp.rows == (0, 1) and grp.view == (0, 3)
    (grp,) = sdpa_row_groups(qsl, seq, CPU, ((10, 11, 12), (20, 21, 22)), ratio=1, page=128)
    assert grp.view == (10, 10)  # evenly spaced runs with a gap still form one view
    (grp,) = sdpa_row_groups(qsl, seq, CPU, ((0, 1, 2), (5, 3, 4)), ratio=1, page=128)
    assert grp.view is None  # a shuffled row: gather
    (grp,) = sdpa_row_groups(qsl, seq, CPU, ((3, 4, 5), (0, 1, 2)), ratio=1, page=128)
    assert grp.view is None  # runs overlap in the view's order (negative step): gather
    (grp,) = sdpa_row_groups(qsl, seq, CPU, (), ratio=1, page=128)
    assert grp.view is None  # no host placement: gather


def test_the_per_batch_way() -> None:
    assert choose_way((1024, 1024), (5120, 5120), triton_ok=True)[0] == "sdpa"
    assert choose_way((32,) * 8, (8192,) * 8, triton_ok=True)[0] == "triton"
    assert choose_way((32,), (8192,), triton_ok=False) == ("sdpa", "Triton is not importable")

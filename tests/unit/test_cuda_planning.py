"""Host-side planning of the cuda backends (no GPU, no Triton): row groups and page views."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.core.translate import dcp_local_seq_lens
from diffusion_kv.platforms.cuda import backend as cuda_backend
from diffusion_kv.platforms.cuda.backend import (
    KernelWay,
    choose_way,
    contiguous_run,
    dcp_causal_mask,
    sdpa_row_groups,
)

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
    assert choose_way((1024, 1024), (5120, 5120), triton_ok=True)[0] is KernelWay.SDPA
    assert choose_way((32,) * 8, (8192,) * 8, triton_ok=True)[0] is KernelWay.TRITON
    assert choose_way((32,), (8192,), triton_ok=False) == (KernelWay.SDPA, "Triton is not importable")
    # today's cap: two row shapes; a continuous batch of six compute-bound shapes runs in place
    mixed_q = (5120, 5120, 1024, 1024, 2560, 2560, 512, 512, 1024, 1024, 512, 512)
    mixed_k = (5120, 5120, 5120, 5120, 2560, 2560, 2560, 2560, 1024, 1024, 512, 512)
    way, reason = choose_way(mixed_q, mixed_k, triton_ok=True)
    assert way is KernelWay.TRITON and "6 row shapes" in reason


def test_the_way_rule_under_a_higher_shape_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """What benchmarks/stream_way_rule.py measures: the cap raised to eight shapes with a share
    of long rows required."""
    monkeypatch.setattr(cuda_backend, "SDPA_MAX_ROW_SHAPES", 8)
    monkeypatch.setattr(cuda_backend, "SDPA_MIN_LONG_SHARE", 0.75)
    mixed_q = (5120, 5120, 1024, 1024, 2560, 2560, 512, 512, 1024, 1024, 512, 512)
    mixed_k = (5120, 5120, 5120, 5120, 2560, 2560, 2560, 2560, 1024, 1024, 512, 512)
    way, reason = choose_way(mixed_q, mixed_k, triton_ok=True)
    assert way is KernelWay.SDPA and "100% of the queries in such rows, 6 row shape(s)" in reason
    nine = tuple(range(512, 512 + 9 * 64, 64))
    assert choose_way(nine, nine, triton_ok=True)[0] is KernelWay.TRITON
    # one long row among many short ones: most queries memory-bound, in place
    way, reason = choose_way((1024,) + (32,) * 40, (4096,) * 41, triton_ok=True)
    assert way is KernelWay.TRITON and "44% of the queries in rows of >= 512" in reason


def test_dcp_row_groups_read_local_keys_and_skip_rows_without_any() -> None:
    # cp_size 2, interleave 2, rank 1 holds positions 2, 3, 6, 7, ...: 4 of 10 keys, 0 of 2
    local = tuple(int(x) for x in dcp_local_seq_lens(torch.tensor([10, 2]), 2, 1, 2).tolist())
    assert local == (4, 0)
    (grp,) = sdpa_row_groups((0, 10, 12), (10, 2), CPU, ((0,), (1,)), ratio=1, page=4, kv_lens=local)
    assert (grp.rows, grp.seq_len, grp.keys) == ((0,), 10, 4)
    assert grp.view == (0, 1)  # one page of local keys


def test_dcp_causal_mask_is_a_staircase_over_absolute_positions() -> None:
    (grp,) = sdpa_row_groups((0, 10), (10,), CPU, kv_lens=(4,))
    masked = dcp_causal_mask(grp, 2, 2, 1, 2, torch.float32, CPU)
    # query m sits at position m; rank 1's local keys are positions 2, 3, 6, 7
    seen = [0, 0, 1, 2, 2, 2, 3, 4, 4, 4]
    assert masked.visible is not None and masked.visible.tolist() == [n > 0 for n in seen]
    assert masked.bias is not None and tuple(masked.bias.shape) == (1, 1, 2 * 10, 4)
    bias = masked.bias[0, 0]
    assert (bias == 0).sum(dim=1).tolist() == seen * 2  # both query heads of the KV head, folded
    assert torch.isneginf(bias[bias != 0]).all()
    assert bias.stride(0) % 16 == 0  # rows aligned for the memory-efficient kernel
    # a suffix whose queries all see every local key needs neither mask
    (late,) = sdpa_row_groups((0, 2), (10,), CPU, kv_lens=(4,))
    plain = dcp_causal_mask(late, 2, 2, 1, 2, torch.float32, CPU)
    assert plain.bias is None and plain.visible is None

"""The planned SDPA path on the CPU reads a one-row group's live blocks as runs of the cache."""

from __future__ import annotations

import torch

from diffusion_kv.platforms.torch_sdpa import MAX_LIVE_RUNS, SdpaRowGroup, _runs_of, live_runs


def _group(rows: tuple[int, ...], live: tuple[int, ...]) -> SdpaRowGroup:
    return SdpaRowGroup(64, 320, rows, None, None, 16 * len(live), live=torch.tensor(live), live_host=live)


def test_one_run_follows_the_placement() -> None:
    grp = _group((0,), (0, 1, 2, 5, 6))
    assert live_runs(grp, ((10, 11, 12, 3, 4, 13, 14),), 1) == ((10, 5),)
    assert MAX_LIVE_RUNS == 1  # the live blocks in two runs: gathered
    assert live_runs(grp, ((10, 11, 12, 3, 4, 7, 8),), 1) is None


def test_one_run_with_several_kernel_blocks_per_block() -> None:
    grp = _group((0,), (2, 3, 4, 5))
    # scheduler blocks 5, 1, 2 hold kernel blocks 10-11, 2-3, 4-5
    assert live_runs(grp, ((5, 1, 2),), 2) == ((2, 4),)
    assert live_runs(_group((0,), (0, 1, 2, 3)), ((5, 1, 2),), 2) is None


def test_no_runs_for_several_rows_unknown_placement_or_too_many_runs() -> None:
    assert live_runs(_group((0, 1), (0, 1)), ((1, 2), (3, 4)), 1) is None
    assert live_runs(_group((0,), (0, 1)), (), 1) is None
    assert live_runs(_group((0,), (0, 3)), ((1, 2),), 1) is None  # column 3 is past the table
    scattered = tuple(range(0, 2 * (MAX_LIVE_RUNS + 1), 2))
    cols = tuple(range(MAX_LIVE_RUNS + 1))
    assert live_runs(_group((0,), cols), (scattered,), 1) is None
    assert live_runs(_group((0,), cols[:-1]), (scattered[:-1],), 1) == tuple((b, 1) for b in scattered[:-1])


def test_runs_read_exactly_what_the_gather_reads() -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(12, 4, 2, 3, generator=g)
    blocks = [7, 8, 9, 2, 3, 11]
    gathered = cache.index_select(0, torch.tensor(blocks)).reshape(1, 24, 2, 3)[:, :22]
    sliced = _runs_of(cache, ((7, 3), (2, 2), (11, 1)), 22)
    assert sliced.shape == (1, 22, 2, 3)
    assert torch.equal(sliced, gathered)
    one = _runs_of(cache, ((4, 3),), 10)
    assert one.data_ptr() == cache[4].data_ptr()  # one run: a view, nothing copied
    assert torch.equal(one, cache[4:7].reshape(1, 12, 2, 3)[:, :10])

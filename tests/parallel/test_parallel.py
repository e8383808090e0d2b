"""Multi-process tests on torch.distributed with the gloo backend (CPU, 2 and 4 ranks).

One spawn per world size runs every scenario (see ``scenarios.py``); each test compares every
rank's result with the single-process reference computed here, in the test process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parallel import scenarios
from tests.parallel.harness import run_ranks

_CACHE: dict[int, list[dict[str, Any]] | BaseException] = {}
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return scenarios.reference()


def ranks(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if world not in _CACHE:  # one spawn per world size, failed or not
        out: Path = tmp_path_factory.mktemp(f"gloo{world}")
        try:
            _CACHE[world] = run_ranks(scenarios.worker, world, out)
        except Exception as exc:
            _CACHE[world] = exc
    cached = _CACHE[world]
    if isinstance(cached, BaseException):
        raise cached
    return cached


def assert_matches(outputs: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], rows: slice) -> None:
    assert (
        set(outputs) == set(reference) == {f"{layer}/{step}" for layer in scenarios.LAYERS for step in (0, 1)}
    )
    for key, ref in reference.items():
        torch.testing.assert_close(outputs[key], ref[rows], **TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_equals_single_process(
    world: int, reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for rank, result in enumerate(ranks(world, tmp_path_factory)):
        r = result["ulysses"]
        assert_matches(r["outputs"], reference, slice(None))
        # padding (filled with 1e3 garbage) was cut out and comes back as zeros
        assert r["pad_max"] == 0.0, rank
        # rank-local heads in registration and in the KV allocation
        assert r["local_heads"] == (scenarios.H // world, scenarios.HKV // world)
        assert r["cache_shape"] == (
            2,
            scenarios.NUM_BLOCKS,
            scenarios.BLOCK,
            scenarios.HKV // world,
            scenarios.D,
        )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("interleave", [1, 2])
def test_dcp_equals_single_rank(
    world: int, interleave: int, reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = ranks(world, tmp_path_factory)
    total = 0
    for result in results:
        r = result["dcp"][interleave]
        assert_matches(r["outputs"], reference, slice(None))
        # each rank holds exactly its interleave slots (vLLM's local seq lens)
        assert r["written"] == r["expected_local"]
        total += r["written"][0]
    assert total == scenarios.S  # every token on exactly one rank


@pytest.mark.parametrize("world", [2, 4])
def test_same_snapshot_lands_in_same_rows_on_every_rank(
    world: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = ranks(world, tmp_path_factory)
    first = results[0]
    for result in results:
        assert result["ulysses"]["rows"] == first["ulysses"]["rows"] == {("r", 0, None): 0, ("r", 1, None): 1}
        assert result["dcp"][2]["rows"] == first["ulysses"]["rows"]
        assert result["rows"]["history"] == first["rows"]["history"]
    assert first["rows"]["history"] == [
        {("a", 0, None): 0, ("a", 1, None): 1, ("b", 0, None): 2},
        {("b", 0, None): 2, ("c", 0, None): 0, ("c", 1, None): 1, ("d", 0, None): 3},
    ]
    # a rank whose history diverged is caught, on every rank, naming the rank
    for result in results:
        message = result["rows"]["diverged"]
        assert message is not None and "worker rows differs across ranks" in message
        assert f"rank(s) [{world - 1}]" in message


def test_cfg_parallel_keeps_only_the_branch_rows(
    reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = ranks(2, tmp_path_factory)
    for rank, result in enumerate(results):
        r = result["cfg"]
        assert r["error"] is not None and "has 3 sequences; CFG-parallel size 2" in r["error"]
        assert r["unchanged"] is True  # rejected before anything was installed
        assert r["installed"] is True and r["again"] is False
        expected_rows = {("r", rank, None): 0}
        if rank == 0:
            expected_rows[("r", None, "ref")] = 1  # the context only branch 0 uses
        assert r["rows"] == expected_rows
        assert r["identities"] == [[("r", rank, None)], [("r", rank, None)]]
        assert_matches(r["outputs"], reference, slice(rank, rank + 1))
        assert_matches(r["gathered"], reference, slice(None))


def test_cfg_parallel_with_ulysses_on_four_ranks(
    reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = ranks(4, tmp_path_factory)
    for rank, result in enumerate(results):
        r = result["cfg_ulysses"]
        assert r["cfg"] == (2, rank // 2) and r["ulysses"] == (2, rank % 2)
        assert r["identities"][0] == [("r", rank // 2, None)]
        assert_matches(r["outputs"], reference, slice(None))


@pytest.mark.parametrize("world", [2, 4])
def test_group_split_must_match_the_world(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    for result in ranks(world, tmp_path_factory):
        assert result["groups_error"] == (
            f"ulysses_degree={2 * world} x cfg_parallel_size=1 = {2 * world} ranks, but the world has {world}"
        )

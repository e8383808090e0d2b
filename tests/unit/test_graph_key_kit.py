"""The conformance kit's graph-key case (``test_graph_equal_batches_are_served_by_each_others_metadata``)
catches a backend whose ``graph_key`` promises more than its metadata keeps: one keying every
batch alike while its metadata holds per-batch views fails it, naming the mismatch; the default
(no key) skips it."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest

from diffusion_kv.conformance import test_paged_attention as kit
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend


class AlwaysEqualKey(CpuSdpaBackend):
    """Keys every batch alike, though its metadata hold each batch's own page views."""

    name = "always-equal-key"

    def graph_key(self, metadata: Any) -> Hashable | None:
        del metadata
        return ("one graph for every batch",)


def test_a_key_promising_more_than_the_metadata_keeps_fails_the_kit_case() -> None:
    with pytest.raises(AssertionError) as failure:
        kit.test_graph_equal_batches_are_served_by_each_others_metadata(CpuPlatform(), AlwaysEqualKey)
    message = str(failure.value)
    assert message.startswith("cpu:always-equal-key: paged != dense at row 0 (request 'b', sequence 0)")
    assert "7680 of 7680 values differ" in message  # the first batch's pages read for the second


def test_the_default_key_skips_the_case() -> None:
    with pytest.raises(pytest.skip.Exception, match="graph_key gives no key"):
        kit.test_graph_equal_batches_are_served_by_each_others_metadata(CpuPlatform(), CpuSdpaBackend)


def test_the_harness_never_hands_a_block_out_twice() -> None:
    """Placements mixed in one harness may meet (reversed ids run down from the top while the
    others take from the bottom): the harness refuses the second hand-out, naming the block,
    instead of two rows sharing it, and a refused hand-out takes nothing."""
    from diffusion_kv.conformance.harness import PagedHarness

    h = PagedHarness(CpuPlatform(), num_blocks=8, block_size=16)
    assert h.take_blocks(3, "contiguous") == [0, 1, 2]
    assert h.take_blocks(1, "reversed") == [4] and h.take_blocks(1, "reversed") == [3]
    with pytest.raises(ValueError, match=r"harness placement 'reversed' gives blocks \[2\] out twice"):
        h.take_blocks(1, "reversed")
    assert h.take_blocks(1, "contiguous") == [5]

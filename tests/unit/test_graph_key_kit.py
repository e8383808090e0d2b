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

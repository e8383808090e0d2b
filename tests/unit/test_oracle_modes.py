"""The kit's oracle is typed on ``AttentionMode``: each mode's mask is the enum's own."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.conformance.reference import row_mask
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import ValidationError


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


def test_causal_is_bottom_right_aligned_over_the_rows_keys() -> None:
    # 2 queries at positions 3 and 4 of a 5-key row
    assert rows(row_mask(AttentionMode.CAUSAL, 3, 2, 5)) == ["xxxx.", "xxxxx"]


def test_full_sees_every_key() -> None:
    assert rows(row_mask(AttentionMode.FULL, 3, 2, 5)) == ["xxxxx", "xxxxx"]


def test_piecewise_is_causal_plus_each_span_seen_in_full_by_its_own_queries() -> None:
    assert rows(row_mask(AttentionMode.PIECEWISE, 0, 5, 5, [(0, 2)])) == [
        "xx...", "xx...", "xxx..", "xxxx.", "xxxxx",
    ]  # fmt: skip
    assert rows(row_mask(AttentionMode.PIECEWISE, 0, 5, 5, [(3, 5)])) == [
        "x....", "xx...", "xxx..", "xxxxx", "xxxxx",
    ]  # fmt: skip
    assert rows(row_mask(AttentionMode.PIECEWISE, 0, 6, 6, [(0, 2), (3, 5)])) == [
        "xx....", "xx....", "xxx...", "xxxxx.", "xxxxx.", "xxxxxx",
    ]  # fmt: skip
    # a suffix query of 2 tokens over 5 keys, the span covering both
    assert rows(row_mask(AttentionMode.PIECEWISE, 3, 2, 5, [(3, 5)])) == ["xxxxx", "xxxxx"]
    assert torch.equal(AttentionMode.PIECEWISE.row_mask(0, 4, 4), AttentionMode.CAUSAL.row_mask(0, 4, 4))


def test_a_mode_string_is_refused_with_the_accepted_values() -> None:
    with pytest.raises(
        ValidationError,
        match=r"must be an AttentionMode \(CAUSAL, FULL, PIECEWISE, CHUNK_CAUSAL\) or a MaskSpec; got 'causal'",
    ):
        row_mask("causal", 0, 1, 1)  # type: ignore[arg-type]


def test_what_the_core_reads_off_each_mode() -> None:
    C, F, P = AttentionMode.CAUSAL, AttentionMode.FULL, AttentionMode.PIECEWISE
    K = AttentionMode.CHUNK_CAUSAL
    table = {m: (m.is_layer_mode, m.is_causal, m.accepts_spans, m.group_modes) for m in AttentionMode}
    # spans cut a plain causal or full layer into causal and full segments: both groups need all three
    assert table == {
        C: (True, True, True, frozenset({C, F, P})),
        F: (True, False, True, frozenset({C, F, P})),
        P: (False, True, False, frozenset({P})),
        K: (True, True, False, frozenset({K})),
    }
    assert AttentionMode.layer_modes() == (C, F, K)
    assert AttentionMode.layer_modes_text() == "AttentionMode.CAUSAL, FULL or CHUNK_CAUSAL"


def test_a_layer_cannot_declare_piecewise() -> None:
    from diffusion_kv.core.layout import AttentionSpec
    from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
    from diffusion_kv.platforms.cpu import CpuPlatform

    with pytest.raises(ValidationError) as info:
        AttentionSpec(2, 64, torch.float32, AttentionMode.PIECEWISE)
    assert str(info.value) == (
        "AttentionSpec.mode must be AttentionMode.CAUSAL, FULL or CHUNK_CAUSAL; got <AttentionMode.PIECEWISE: 'piecewise'>"
    )
    runner = PagedWorker(CpuPlatform(), RunnerConfig(64, 1, 1, 64, device="cpu"))
    spec = PagedLayerSpec(2, 2, 64, torch.float32, mode=AttentionMode.PIECEWISE)
    with pytest.raises(ValidationError) as info:
        runner.register_kv_cache_layers({"l0": spec})
    assert str(info.value) == (
        "layer 'l0': mode must be AttentionMode.CAUSAL, FULL or a MaskSpec (CHUNK_CAUSAL needs its chunk size); "
        "got <AttentionMode.PIECEWISE: 'piecewise'>"
    )
    assert runner.layers == {}  # nothing registered after the refusal

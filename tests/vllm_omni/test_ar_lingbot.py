"""LingBot-World's causal transformer (vLLM-Omni 0.30.0, tiny random config) generating AR block
after AR block with its self-attention KV served by diffusion-kv sessions, against vLLM-Omni's
own AR-diffusion KV (``ARDiffusionKVCache`` / ``ARDiffusionKVState``) on the same weights and
inputs: across window eviction (sink 1 block, window 2 blocks), a session reset and close."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch

from diffusion_kv.core.errors import StateError, UnsupportedFeatureError
from tests.vllm_omni import ar_models as M

TOLERANCE = 1e-5  # fp32, the kit's fp32 bound
SHAPE = M.LingBotShape()


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    with M.environment() as od:
        yield od


def _pair(seed: int = 0) -> tuple[torch.nn.Module, Any, Any]:
    model = M.lingbot(SHAPE, seed=seed)
    layout = M.lingbot_layout(SHAPE)
    return model, M.host_state(layout), M.dkv_cache(layout).state("s0")


@torch.no_grad()
def test_chunk_stream_matches_vllm_omnis_own_path_across_eviction(env: Any) -> None:
    model, host, dkv = _pair()
    inputs = M.LingBotInputs(SHAPE, seed=1)
    host_cross: list[Any] = [None] * SHAPE.layers
    dkv_cross: list[Any] = [None] * SHAPE.layers
    cache = dkv.cache
    bound = cache.sessions.kv_blocks_bound()
    held = []
    for index in range(8):  # the window (sink 1 + window 2 blocks) fills at block 3, then slides
        ours = M.lingbot_block(model, dkv, dkv_cross, inputs, index)
        theirs = M.lingbot_block(model, host, host_cross, inputs, index)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
        held.append(cache.pool.num_total - cache.pool.num_free)
        assert (
            dkv.committed_tokens("positive") == (index + 1) * SHAPE.frames_per_block * SHAPE.tokens_per_frame
        )
    # after a commit only what the next block sees stays: the sink block (2 frames, one page per
    # frame) and the one earlier block its window keeps; flat from the second block on (the
    # host keeps 6 pages resident: it evicts at its next allocation)
    assert held == [2, 4, 4, 4, 4, 4, 4, 4] and max(held) <= bound
    dkv.close()
    assert cache.pool.num_free == cache.pool.num_total and cache.sessions.sessions == ()


@torch.no_grad()
def test_a_stream_longer_than_max_frames_matches_the_hosts(env: Any) -> None:
    """Rows are compacted (the released blocks between the sink and the window cut out), so a
    session runs past ``max_frames`` -- which bounds a row, not the stream -- still equal to
    vLLM-Omni's own path block after block."""
    model = M.lingbot(SHAPE, seed=0)
    layout = M.lingbot_layout(SHAPE)
    host = M.host_state(layout)
    dkv = M.dkv_cache(layout, max_frames=20).state("s0")
    inputs = M.LingBotInputs(SHAPE, seed=1)
    host_cross: list[Any] = [None] * SHAPE.layers
    dkv_cross: list[Any] = [None] * SHAPE.layers
    blocks = 24  # 48 frames on the timeline, rows of at most 20
    for index in range(blocks):
        ours = M.lingbot_block(model, dkv, dkv_cross, inputs, index)
        theirs = M.lingbot_block(model, host, host_cross, inputs, index)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
    session = dkv._session("positive")
    assert session.committed_tokens == blocks * SHAPE.frames_per_block * SHAPE.tokens_per_frame
    assert session.row_offset > 0
    assert session.committed_tokens - session.row_offset <= 20 * SHAPE.tokens_per_frame
    cache = dkv.cache
    dkv.close()
    assert cache.pool.num_free == cache.pool.num_total


@torch.no_grad()
def test_reset_restarts_at_position_zero_like_the_hosts(env: Any) -> None:
    model, host, dkv = _pair(seed=2)
    inputs = M.LingBotInputs(SHAPE, seed=3)
    crosses: dict[str, list[Any]] = {"h": [None] * SHAPE.layers, "d": [None] * SHAPE.layers}
    for index in range(4):
        M.lingbot_block(model, dkv, crosses["d"], inputs, index)
        M.lingbot_block(model, host, crosses["h"], inputs, index)
    dkv.reset()
    host.reset()
    assert dkv.committed_tokens("positive") == 0
    for index in range(3):  # a fresh window from frame 0
        ours = M.lingbot_block(model, dkv, crosses["d"], inputs, 10 + index)
        theirs = M.lingbot_block(model, host, crosses["h"], inputs, 10 + index)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
    dkv.close()
    assert dkv.cache.pool.num_free == dkv.cache.pool.num_total


@torch.no_grad()
def test_a_failed_forward_aborts_the_block_and_the_stream_goes_on(env: Any) -> None:
    model, host, dkv = _pair(seed=4)
    inputs = M.LingBotInputs(SHAPE, seed=5)
    crosses = {"h": [None] * SHAPE.layers, "d": [None] * SHAPE.layers}
    for index in range(3):
        M.lingbot_block(model, dkv, crosses["d"], inputs, index)
        M.lingbot_block(model, host, crosses["h"], inputs, index)
    cache = dkv.cache
    before = (cache.pool.num_free, dkv.committed_tokens("positive"))
    with pytest.raises(UnsupportedFeatureError, match="AR blocks of 8 tokens"):
        dkv.get_kv_caches("positive", seq_len=4, commit_current=False)
    M.lingbot_block(model, dkv, crosses["d"], inputs, 3, steps=(1000.0,))  # probes written ...
    chunk_open = cache.pool.num_free
    dkv.get_kv_caches("positive", seq_len=8, commit_current=True)
    dkv.abort_pending()  # ... as if the next block's model call failed
    assert (cache.pool.num_free, dkv.committed_tokens("positive")) == (chunk_open, before[1] + 8)
    ours = M.lingbot_block(model, dkv, crosses["d"], inputs, 4)
    M.lingbot_block(model, host, crosses["h"], inputs, 3, steps=(1000.0,))
    theirs = M.lingbot_block(model, host, crosses["h"], inputs, 4)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
    dkv.close()
    with pytest.raises(StateError, match="is closed"):
        dkv.get_kv_caches("positive", seq_len=8)
    assert cache.pool.num_free == cache.pool.num_total


@torch.no_grad()
def test_a_blocks_forwards_share_one_prepared_batch(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4 probe forwards and the committing forward of a block run over the same rows: the
    batch prepared for the first is activated again for the others (the commit's slide makes it
    stale, so the next block prepares its own), with outputs unchanged."""
    model, host, dkv = _pair(seed=6)
    inputs = M.LingBotInputs(SHAPE, seed=7)
    translator = dkv.cache.worker.translator
    prepared: list[int] = []
    real = translator.prepare

    def counting(rows: Any) -> Any:
        prepared.append(len(rows))
        return real(rows)

    monkeypatch.setattr(translator, "prepare", counting)
    crosses = {"h": [None] * SHAPE.layers, "d": [None] * SHAPE.layers}
    for index in range(4):
        ours = M.lingbot_block(model, dkv, crosses["d"], inputs, index)
        theirs = M.lingbot_block(model, host, crosses["h"], inputs, index)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
    assert prepared == [1, 1, 1, 1]  # one preparation per block of 5 forwards
    dkv.close()

"""DreamZero's causal Wan model (vLLM-Omni 0.30.0, tiny random t2v config, two CFG branches)
generating AR block after AR block with its self-attention KV served by diffusion-kv sessions and
its text cross-attention K/V in the adapter's write-once store, against vLLM-Omni's own
AR-diffusion KV on the same weights and inputs: across window eviction (window 3 blocks), the
model's window reset (text K/V kept) and session close."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch

from diffusion_kv.core.errors import StateError, UnsupportedFeatureError, ValidationError
from tests.vllm_omni import ar_models as M

TOLERANCE = 1e-5  # fp32, the kit's fp32 bound
SHAPE = M.DreamZeroShape()


@pytest.fixture(scope="module")
def env() -> Iterator[Any]:
    with M.environment() as od:
        yield od


@torch.no_grad()
def test_cfg_stream_matches_vllm_omnis_own_path_across_eviction_and_reset(env: Any) -> None:
    model = M.dreamzero(SHAPE, seed=0)
    layout = M.dreamzero_layout(SHAPE)
    host, dkv = M.host_state(layout), M.dkv_cache(layout).state("s0")
    inputs = M.DreamZeroInputs(SHAPE, seed=1)
    cache = dkv.cache
    observed: torch.Tensor | None = None
    frame, held = 0, []
    for index in range(7):
        if index == 4:  # DreamZero's window reset: history dropped, the prompt's text K/V kept
            text = dkv.get_cross_attention_kv("positive", "text")[0]["k"].clone()
            with pytest.raises(StateError, match="populated already \\(write-once"):
                dkv.populate_cross_attention("positive", "text", [])
            host.reset(keep_cross_attention=("text",))
            dkv.reset(keep_cross_attention=("text",))
            assert dkv.committed_tokens("positive") == 0 == dkv.committed_tokens("negative")
            assert torch.equal(dkv.get_cross_attention_kv("positive", "text")[0]["k"], text)
            observed, frame = None, 0
        ours, _ = M.dreamzero_block(model, dkv, inputs, index, frame, observed)
        theirs, _ = M.dreamzero_block(model, host, inputs, index, frame, observed)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
        held.append(cache.pool.num_total - cache.pool.num_free)
        observed, frame = theirs, frame + SHAPE.frames_per_block
    # per branch: the open block plus committed blocks, at most the window (3 blocks of 2 pages)
    # once it slides; the reset at block 4 starts again from one open block
    assert held == [4, 8, 12, 12, 4, 8, 12]
    contexts = cache.sessions.contexts
    assert contexts is not None
    ctx_pool = contexts.allocator.pool
    assert ctx_pool.num_total - ctx_pool.num_free == 2  # the text context: one 16-token block per branch
    dkv.close()
    assert cache.pool.num_free == cache.pool.num_total and cache.sessions.sessions == ()
    assert ctx_pool.num_free == ctx_pool.num_total


@torch.no_grad()
def test_what_is_not_served_is_refused_with_the_reason(env: Any) -> None:
    layout = M.dreamzero_layout(SHAPE)
    dkv = M.dkv_cache(layout).state("s1")
    free = dkv.cache.pool.num_free
    with pytest.raises(StateError, match="read before it was populated"):
        dkv.get_cross_attention_kv("positive", "text")
    with pytest.raises(ValidationError, match="unknown cross-attention cache 'image'"):
        dkv.is_cross_attention_populated("positive", "image")
    with pytest.raises(ValidationError, match="unknown KV branch 'middle'"):
        dkv.get_kv_caches("middle", seq_len=8)
    heads, size = SHAPE.heads, SHAPE.dim // SHAPE.heads
    good = torch.ones(1, SHAPE.text_tokens, heads, size)
    with pytest.raises(ValidationError, match="text' layer 1: k/v shape \\(1, 5, 2, 16\\)/"):
        dkv.populate_cross_attention("positive", "text", [(good, good), (good[:, :5], good[:, :5])])
    with pytest.raises(ValidationError, match="1 layers given, expected 2"):
        dkv.populate_cross_attention("positive", "text", [(good, good)])
    ctx_pool = dkv.cache.sessions.contexts.allocator.pool  # type: ignore[union-attr]
    assert not dkv.is_cross_attention_populated("positive", "text")
    assert ctx_pool.num_free == ctx_pool.num_total  # nothing reserved by a refused populate
    contexts = dkv.get_kv_caches("positive", seq_len=8, commit_current=True)
    with pytest.raises(
        ValidationError, match="40 queries; its chunk holds 8 video tokens and 33 action/state"
    ):
        contexts[0].forward_ctx.prepare(device=torch.device("cpu"), action_len=33, query_len=40)
    dkv.abort_pending()
    assert dkv.cache.pool.num_free == free and dkv.committed_tokens("positive") == 0
    with pytest.raises(
        UnsupportedFeatureError, match="window_frames=5 is not a multiple of frames_per_block=2"
    ):
        M.dkv_cache(M.KVLayout(2, 2, 16, 4, 2, window_frames=5, sink_frames=0))
    dkv.close()


@torch.no_grad()
def test_action_and_state_tokens_are_served_beside_the_video_kv(env: Any) -> None:
    """The real pipeline's denoise forwards carry action + state tokens: their K/V are scratch
    (seen by that forward only, never committed), every query (video and action) sees the
    session's visible video keys plus them; diffusion-kv merges the paged partial attention
    with the scratch partial by log-sum-exp."""
    model = M.dreamzero(SHAPE, seed=3)
    layout = M.dreamzero_layout(SHAPE)
    host, dkv = M.host_state(layout), M.dkv_cache(layout).state("s2")
    inputs = M.DreamZeroInputs(SHAPE, seed=4)
    cache = dkv.cache
    observed: torch.Tensor | None = None
    frame, held = 0, []
    for index in range(5):  # window 3 blocks: slides from block 3 on
        ours, our_act = M.dreamzero_block(model, dkv, inputs, index, frame, observed, actions=True)
        theirs, their_act = M.dreamzero_block(model, host, inputs, index, frame, observed, actions=True)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
        assert our_act is not None and their_act is not None
        torch.testing.assert_close(our_act, their_act, atol=TOLERANCE, rtol=TOLERANCE)
        assert not torch.equal(our_act, M.DreamZeroInputs(SHAPE, seed=4).action(index)[0])
        held.append(cache.pool.num_total - cache.pool.num_free)
        observed, frame = theirs, frame + SHAPE.frames_per_block
    # the action tokens take no pages: the same blocks as a stream without them
    assert held == [4, 8, 12, 12, 12]
    assert dkv.committed_tokens("positive") == 4 * SHAPE.frames_per_block * SHAPE.tokens_per_frame
    dkv.close()
    assert cache.pool.num_free == cache.pool.num_total


def _first_frame_layout(window_frames: int, sink_frames: int = 0) -> M.KVLayout:
    return dataclasses.replace(
        M.dreamzero_layout(SHAPE), window_frames=window_frames, sink_frames=sink_frames, first_block_frames=1
    )


@torch.no_grad()
def test_the_pipelines_request_flow_first_frame_block_actions_and_window_reset(env: Any) -> None:
    """DreamZero as its pipeline runs it: the first frame alone is the first AR block (1 frame,
    then blocks of 2), every denoise forward carries action/state tokens, and the window of
    max_chunk_size * F + 1 = 5 frames (max_chunk_size 2) is reset (text kept) when the next
    block would start at frame 5, so nothing slides. diffusion-kv holds the first frame as the session's first-block
    prefix (a context every later block attends through the log-sum-exp merge)."""
    layout = _first_frame_layout(window_frames=5)
    model = M.dreamzero(SHAPE, seed=5)
    host, dkv = M.host_state(layout), M.dkv_cache(layout).state("s3")
    inputs = M.DreamZeroInputs(SHAPE, seed=6)
    cache = dkv.cache
    ctx_pool = cache.sessions.contexts.allocator.pool  # type: ignore[union-attr]
    ours_at = theirs_at = 0
    observed: torch.Tensor | None = None
    held, starts = [], []
    for index in range(7):
        if ours_at >= layout.window_frames:  # the pipeline's "inference" reset: text kept
            host.reset(keep_cross_attention=("text",))
            dkv.reset(keep_cross_attention=("text",))
            assert dkv.first_block("positive") == "none" and dkv.committed_tokens("negative") == 0
            ours_at = theirs_at = 0
            observed = None
        starts.append(ours_at)
        ours, our_act, ours_at = M.dreamzero_request(model, dkv, inputs, index, ours_at, observed)
        theirs, their_act, theirs_at = M.dreamzero_request(model, host, inputs, index, theirs_at, observed)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(our_act, their_act, atol=TOLERANCE, rtol=TOLERANCE)
        assert dkv.first_block("negative") == "committed"
        held.append((cache.pool.num_total - cache.pool.num_free, ctx_pool.num_total - ctx_pool.num_free))
        observed = theirs
    # a request from frame 0 commits the first frame and denoises frames [1, 3); the next one
    # commits [1, 3) and denoises [3, 5); the one after would start at 5: reset
    assert starts == [0, 3, 0, 3, 0, 3, 0]
    # session pages (2 branches x 2 pages per block: the open one, then the committed one too)
    # and context pages (per branch: the text context and the first frame, a 16-token page each)
    assert held == [(4, 4), (8, 4), (4, 4), (8, 4), (4, 4), (8, 4), (4, 4)]
    dkv.close()
    assert cache.pool.num_free == cache.pool.num_total and ctx_pool.num_free == ctx_pool.num_total


@torch.no_grad()
@pytest.mark.parametrize(
    ("shape", "backend"),
    [(SHAPE, "reference"), (dataclasses.replace(SHAPE, height=8, width=8), "sdpa")],
    ids=["4-token-frames-reference", "16-token-frames-sdpa"],
)
def test_the_first_frame_block_slides_out_of_a_window_of_whole_blocks(
    env: Any, shape: M.DreamZeroShape, backend: str
) -> None:
    """Without the pipeline's reset, a window of 4 frames (two blocks): the first frame is seen
    by the block ending at frame 3, then slides out (its context released) and later blocks see
    the last two blocks, as the host's window of the last 4 frames. On the oracle and on the
    SDPA backend (pages of 16 tokens), both serving the partial attention the merges take."""
    layout = dataclasses.replace(
        M.dreamzero_layout(shape), window_frames=4, sink_frames=0, first_block_frames=1
    )
    model = M.dreamzero(shape, seed=7)
    host, dkv = M.host_state(layout), M.dkv_cache(layout, backend=backend).state("s4")
    assert [b.name for b in dkv.cache.worker.backends] == [backend]
    inputs = M.DreamZeroInputs(shape, seed=8)
    ctx_pool = dkv.cache.sessions.contexts.allocator.pool  # type: ignore[union-attr]
    at, observed, states = 0, None, []
    for index in range(5):
        ours, our_act, _ = M.dreamzero_request(model, dkv, inputs, index, at, observed)
        theirs, their_act, at = M.dreamzero_request(model, host, inputs, index, at, observed)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(our_act, their_act, atol=TOLERANCE, rtol=TOLERANCE)
        states.append((dkv.first_block("positive"), ctx_pool.num_total - ctx_pool.num_free))
        observed = theirs
    # the second request's commit forward (block [1, 3)) still sees frame 0; its denoise forwards
    # (block [3, 5), window [1, 5)) do not: the first frame's context goes back to the pool
    assert states == [("committed", 4), ("released", 2), ("released", 2), ("released", 2), ("released", 2)]
    dkv.close()
    assert ctx_pool.num_free == ctx_pool.num_total


@torch.no_grad()
def test_blocks_the_session_cannot_serve_are_refused_with_nothing_changed(env: Any) -> None:
    with pytest.raises(UnsupportedFeatureError, match="sink_frames=2 with a first block of 1 frames"):
        M.dkv_cache(_first_frame_layout(window_frames=4, sink_frames=2))
    layout = _first_frame_layout(window_frames=5)
    model = M.dreamzero(SHAPE, seed=9)
    dkv = M.dkv_cache(layout).state("s5")
    inputs = M.DreamZeroInputs(SHAPE, seed=10)
    with pytest.raises(
        UnsupportedFeatureError, match="forward of 8 tokens .* its first AR block holds 4 tokens"
    ):
        dkv.get_kv_caches("positive", seq_len=8, commit_current=True)
    at, observed = 0, None
    for index in range(2):  # blocks end at frames 3 and 5: the whole window, nothing slid
        observed, _, at = M.dreamzero_request(model, dkv, inputs, index, at, observed)
    assert observed is not None
    M.dreamzero_commit(model, dkv, inputs, observed, at - SHAPE.frames_per_block)  # block [3, 5)
    cache = dkv.cache
    before = (cache.pool.num_free, dkv.committed_tokens("positive"), dkv.first_block("positive"))
    assert before[1:] == (16, "committed")
    # without the pipeline's reset the next block ends at frame 7: the 5-frame window [2, 7)
    # would cut through the block [1, 3)
    with pytest.raises(UnsupportedFeatureError, match="window of 5 frames slides through an AR block of 2"):
        dkv.get_kv_caches("positive", seq_len=8, commit_current=False)
    assert (cache.pool.num_free, dkv.committed_tokens("positive"), dkv.first_block("positive")) == before
    dkv.close()


@torch.no_grad()
def test_each_cfg_branch_activates_its_own_prepared_batch_again(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline alternates the CFG branches forward after forward, each branch a session
    row of its own. The worker's batches are retained (``Translator.retains_batches``: the cpu
    tables and backends make fresh tensors per preparation), so a branch's denoise forwards
    activate the batch prepared for its rows again after the other branch prepared its own --
    until a block table change (a chunk opening or committing) makes them stale. Outputs equal
    vLLM-Omni's either way; without retention every forward prepares."""
    per_block: dict[bool, list[int]] = {}
    for retained in (True, False):
        model = M.dreamzero(SHAPE, seed=0)
        layout = M.dreamzero_layout(SHAPE)
        host, dkv = M.host_state(layout), M.dkv_cache(layout).state(f"r{retained}")
        inputs = M.DreamZeroInputs(SHAPE, seed=1)
        translator = dkv.cache.worker.translator
        assert translator is not None and translator.retains_batches
        if not retained:  # the same tables, taken as ones that reuse their buffers
            translator._retaining = (type(translator.block_tables), False)
        prepared: list[int] = []
        real = translator.prepare

        def counting(rows: Any, real: Any = real, prepared: list[int] = prepared) -> Any:
            prepared.append(len(rows))
            return real(rows)

        monkeypatch.setattr(translator, "prepare", counting)
        counts = []
        observed: torch.Tensor | None = None
        steps = (1000.0, 750.0, 500.0, 250.0)
        for index in range(3):
            before = len(prepared)
            ours, _ = M.dreamzero_block(model, dkv, inputs, index, 2 * index, observed, steps=steps)
            theirs, _ = M.dreamzero_block(model, host, inputs, index, 2 * index, observed, steps=steps)
            torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
            counts.append(len(prepared) - before)
            observed = theirs
        per_block[retained] = counts
        dkv.close()
    # without retention: every forward prepares (4 steps x 2 branches, and the two committing
    # forwards from the second block on); with it: 3 a block
    assert per_block == {True: [3, 3, 3], False: [8, 10, 10]}

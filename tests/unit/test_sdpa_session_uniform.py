"""The gather + SDPA way under a session mask: a group whose queries all see the same keys (one
whole chunk) reads exactly those keys with no mask, even where chunk boundaries cut blocks;
groups whose queries see different keys keep the exact mask. On cpu:sdpa, against the dense
oracle over the same mask."""

from __future__ import annotations

import random

import pytest
import torch

from diffusion_kv import (
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    PagedLayerSpec,
    PagedRow,
    SequenceRequest,
)
from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.attention import AttentionMode, MaskSpec, build_block_plan
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.torch_sdpa import (
    CudaPagedMetadata,
    SdpaRowGroup,
    planned_blocks,
    planned_row_groups,
    planned_tokens,
    token_view,
    uniform_key_runs,
)

CHUNK = AttentionMode.CHUNK_CAUSAL
H, D, BLOCK = 2, 8, 16
POLICY = SessionPolicy(chunk_tokens=24, window_chunks=2, sink_chunks=1)  # chunk boundaries cut blocks


def _random_mask(rng: random.Random) -> MaskSpec:
    kind = rng.choice([CHUNK, AttentionMode.CAUSAL, AttentionMode.FULL])
    chunk = rng.randint(1, 9) if kind is CHUNK else None
    window = rng.choice([None, (chunk or 1) * rng.randint(1, 4)])
    if window is not None and kind is not CHUNK:
        window = rng.randint(1, 30)
    sink = rng.randint(0, 12) if window is not None else 0
    return MaskSpec(kind, chunk=chunk, window=window, sink=sink)


def test_uniform_runs_are_the_dense_rows_when_they_agree() -> None:
    rng = random.Random(0)
    uniform = differing = 0
    for _ in range(600):
        mask = _random_mask(rng)
        seq_len = rng.randint(1, 70)
        query_len = rng.randint(1, seq_len)
        offset = seq_len - query_len
        live_from = rng.randint(0, offset) if mask.window is not None and rng.random() < 0.3 else 0
        dense = mask.row_mask(offset, query_len, seq_len, live_from=live_from)
        runs = uniform_key_runs(mask, offset, query_len, seq_len, live_from)
        same = bool((dense == dense[:1]).all())
        assert (runs is not None) == same, (mask, offset, query_len, seq_len, live_from)
        if runs is None:
            differing += 1
            continue
        uniform += 1
        expected = torch.zeros(seq_len, dtype=torch.bool)
        for a, b in runs:
            assert 0 <= a < b <= seq_len
            expected[a:b] = True
        assert torch.equal(dense[0], expected)
        assert len(runs) <= 2 and (len(runs) < 2 or runs[0][1] < runs[1][0])
    assert uniform > 100 and differing > 100  # both kinds were exercised


def test_a_chunk_cutting_blocks_is_one_group_without_mask_over_its_visible_keys() -> None:
    mask = POLICY.mask
    assert (mask.chunk, mask.window, mask.sink) == (24, 72, 24)
    # chunk 5 of a session: keys [120, 144) are the chunk; it sees the sink [0, 24) and the window
    # [72, 144); blocks 1 ([16, 32)) and 4 ([64, 80)) are cut
    qsl, seq = (0, 24), (144,)
    plan = build_block_plan(mask, [120], [24], [144], BLOCK)
    (grp,) = planned_row_groups(qsl, seq, plan, torch.device("cpu"))
    assert grp.key_mask is None and grp.bias is None
    assert grp.key_runs == ((0, 24), (72, 144))
    assert grp.kv_len == grp.keys == 24 + 72
    assert grp.key_pos is not None
    assert torch.equal(grp.key_pos, torch.cat([torch.arange(0, 24), torch.arange(72, 144)]))
    assert grp.live_host == (0, 1, 4, 5, 6, 7, 8) == tuple(plan.live_blocks(0).tolist())
    # the slots of this batch's placement: block table columns -> kernel blocks, token by token
    table = torch.tensor([[7, 3, 0, 0, 11, 12, 2, 5, 9]], dtype=torch.int32)
    tokens = planned_tokens(grp, table, BLOCK)
    pos = grp.key_pos
    assert torch.equal(tokens, table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    assert token_view(tokens) is None
    # chunks of whole blocks (32 tokens): the visible keys are the live blocks', read by block
    aligned = MaskSpec(CHUNK, chunk=32, window=96, sink=32)
    plan_a = build_block_plan(aligned, [160], [32], [192], BLOCK)
    (grp_a,) = planned_row_groups((0, 32), (192,), plan_a, torch.device("cpu"))
    assert grp_a.key_runs == () and grp_a.key_pos is None and grp_a.key_mask is None
    assert grp_a.live_host == (0, 1, 6, 7, 8, 9, 10, 11) and grp_a.kv_len == 128
    table_a = torch.arange(100, 112, dtype=torch.int32)[None]
    assert planned_blocks(grp_a, table_a).tolist() == [100, 101, 106, 107, 108, 109, 110, 111]


def test_rows_of_one_shape_share_the_slots_of_their_own_tables() -> None:
    mask = POLICY.mask
    plan = build_block_plan(mask, [120, 120], [24, 24], [144, 144], BLOCK)
    (grp,) = planned_row_groups((0, 24, 48), (144, 144), plan, torch.device("cpu"))
    assert grp.rows == (0, 1) and grp.key_mask is None
    table = torch.arange(18, dtype=torch.int32).reshape(2, 9) + 1
    tokens = planned_tokens(grp, table, BLOCK).view(2, -1)
    pos = grp.key_pos
    assert pos is not None
    for r in range(2):
        assert torch.equal(tokens[r], table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK)


def test_token_view_only_for_one_run_of_slots() -> None:
    assert token_view(torch.arange(40, 64)) == (40, 24)
    assert token_view(torch.cat([torch.arange(0, 8), torch.arange(9, 12)])) is None
    assert token_view(torch.tensor([5, 7, 6])) is None  # right span, wrong order
    assert token_view(torch.zeros(0, dtype=torch.long)) is None


def _session(num_blocks: int = 24) -> tuple[SessionCache, FreeListPool]:
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(512, 1, 2, 512, device=torch.device("cpu"), backend="sdpa")
    )
    worker.register_kv_cache_layers(
        {f"l{i}": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask) for i in range(2)}
    )
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=BLOCK)
    pool = FreeListPool(num_blocks)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=512, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    return SessionCache(worker, alloc, POLICY), pool


def test_a_session_past_the_slide_on_cpu_sdpa_reads_unmasked_and_matches_dense() -> None:
    cache, pool = _session()
    worker = cache.worker
    assert type(worker.backends[0]).name == "sdpa"
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(0)
    keys = {n: torch.zeros(0, H, D) for n in worker.layers}
    values = {n: torch.zeros(0, H, D) for n in worker.layers}
    cut = 0
    for index in range(9):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        written = {}
        for _step in range(2):
            with worker.stepper() as runtime:
                runtime.ensure_rows(chunk.rows())
                assert worker.translator is not None
                batch = worker.translator.active_batch
                assert batch is not None
                md: CudaPagedMetadata = batch.attn_metadata["l0"]
                (grp,) = md.sdpa_groups
                expected_runs = uniform_key_runs(POLICY.mask, chunk.start, chunk.tokens, chunk.end)
                assert expected_runs is not None
                assert grp.key_mask is None and grp.keys == sum(b - a for a, b in expected_runs)
                if grp.key_runs:  # a block is cut: this batch's slots, made at build
                    cut += 1
                    assert grp.tokens is not None and grp.tokens.numel() == grp.keys
                else:  # whole blocks: one run of the cache (a view) or their ids, made at build
                    assert (grp.live_runs is None) != (grp.blocks is None)
                for name in worker.layers:
                    q, k, v = (torch.randn(chunk.tokens, H, D, generator=gen) for _ in range(3))
                    out = worker.forward(name, q, k, v)
                    all_k, all_v = torch.cat([keys[name], k]), torch.cat([values[name], v])
                    mask = POLICY.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
                    ref = dense_attention(q, all_k, all_v, mask, D**-0.5)
                    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
                    written[name] = (k, v)
        cache.commit(chunk)
        for name, (k, v) in written.items():
            keys[name] = torch.cat([keys[name], k])
            values[name] = torch.cat([values[name], v])
        assert index < 4 or session.committed_tokens == 24 * (index + 1)
    assert cut >= 8  # every chunk from the second one cuts the sink's last block
    cache.end_session(session)
    assert pool.num_free == pool.num_total


def test_queries_spanning_two_chunks_keep_the_exact_mask_and_match_dense() -> None:
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(512, 1, 2, 512, device=torch.device("cpu"), backend="sdpa")
    )
    worker.register_kv_cache_layers({"l0": PagedLayerSpec(H, H, D, torch.float32, mode=POLICY.mask)})
    worker.initialize_kv_cache(num_blocks=16, block_size=BLOCK)
    pool = FreeListPool(16)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=512, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    allocation = alloc.reserve(KVRequest("r", (SequenceRequest(0, 0, 144),)))
    assert allocation is not None
    worker.install(allocation)
    gen = torch.Generator().manual_seed(1)
    all_k = torch.zeros(0, H, D)
    all_v = torch.zeros(0, H, D)
    # 96 tokens (four chunks) at once, then 48 (chunks 4 and 5): neither is one chunk
    for start, n in ((0, 96), (96, 48)):
        with worker.stepper() as runtime:
            runtime.ensure_rows([PagedRow("r", n, start + n, start, sequence_id=0)])
            assert worker.translator is not None
            batch = worker.translator.active_batch
            assert batch is not None
            (grp,) = batch.attn_metadata["l0"].sdpa_groups
            assert isinstance(grp, SdpaRowGroup) and grp.key_mask is not None and grp.key_runs == ()
            q, k, v = (torch.randn(n, H, D, generator=gen) for _ in range(3))
            out = worker.forward("l0", q, k, v)
            all_k, all_v = torch.cat([all_k, k]), torch.cat([all_v, v])
            mask = POLICY.mask.row_mask(start, n, start + n)
            ref = dense_attention(q, all_k, all_v, mask, D**-0.5)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads_per_kv", [1, 2])
def test_the_partial_path_agrees_with_forward_and_makes_its_bias_once_per_batch(heads_per_kv: int) -> None:
    """A direct forward_partial call: the unmasked group (no bias at all) and the masked one (the
    bias made by the first call, reused by the next)."""
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(512, 1, 2, 512, device=torch.device("cpu"), backend="sdpa")
    )
    worker.register_kv_cache_layers(
        {"l0": PagedLayerSpec(2 * heads_per_kv, 2, D, torch.float32, mode=POLICY.mask)}
    )
    worker.initialize_kv_cache(num_blocks=16, block_size=BLOCK)
    pool = FreeListPool(16)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=512, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    allocation = alloc.reserve(KVRequest("r", (SequenceRequest(0, 0, 144),)))
    assert allocation is not None
    worker.install(allocation)
    gen = torch.Generator().manual_seed(2)
    backend = worker.backends[0]
    heads = 2 * heads_per_kv
    for start, n, masked in ((0, 120, True), (120, 24, False)):
        with worker.stepper() as runtime:
            runtime.ensure_rows([PagedRow("r", n, start + n, start, sequence_id=0)])
            assert worker.translator is not None
            batch = worker.translator.active_batch
            assert batch is not None
            md = batch.attn_metadata["l0"]
            q = torch.randn(n, heads, D, generator=gen)
            k, v = (torch.randn(n, 2, D, generator=gen) for _ in range(2))
            out = worker.forward("l0", q, k, v)
            layer = backend.group.layers[0]
            kv_cache = worker.kv_caches["l0"]
            o1, lse1 = backend.forward_partial(layer, q, kv_cache, md)
            o2, lse2 = backend.forward_partial(layer, q, kv_cache, md)
            torch.testing.assert_close(o1, out, atol=1e-5, rtol=1e-5)
            assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
            assert torch.isfinite(lse1).all()
            assert len(md.biases) == (1 if masked else 0)

"""Sessions on a real GPU: the conformance kit's session cases on every cuda backend, and the
Triton paged kernel under chunk-causal, windowed and sink masks against dense attention at shapes
the interpreter lane cannot afford. Skipped without CUDA (see conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_kv.conformance.reference import dense_attention
from diffusion_kv.core.attention import AttentionMode, MaskSpec
from tests.kit_junit import run_kit

SESSION_CASES = "session or chunk_causal"


def kit_session_cases() -> int:
    """How many of the kit's cases ``-k SESSION_CASES`` selects, counted from the kit itself
    (each matching case function times its parametrizations): test_chunk_causal_window_sink_stream,
    the four window/sink layouts, commit, abort, eviction, many sessions in one batch, a stream
    past the rows' max_model_len, ... -- every one served natively by the cuda backends (none
    skipped), however many the kit grows to."""
    import diffusion_kv.conformance.test_paged_attention as kit

    count = 0
    for name, case in vars(kit).items():
        if name.startswith("test_") and callable(case) and ("session" in name or "chunk_causal" in name):
            n = 1
            for mark in getattr(case, "pytestmark", []):
                if mark.name == "parametrize":
                    n *= len(mark.args[1])
            count += n
    return count


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
def test_session_kit_cases_pass_natively(backend: str, tmp_path: Path) -> None:
    run = run_kit("cuda", backend, tmp_path / f"kit-sessions-{backend}.xml", "-k", SESSION_CASES)
    assert run.returncode == 0, run.tail
    assert (run.counts.failures, run.counts.errors, run.counts.skipped) == (0, 0, 0), run.tail
    assert run.counts.passed == kit_session_cases() >= 10, run.counts


MASKS = {
    "chunk-inside-pages": MaskSpec(AttentionMode.CHUNK_CAUSAL, chunk=96, window=288, sink=96),
    "chunk-window-no-sink": MaskSpec(AttentionMode.CHUNK_CAUSAL, chunk=64, window=128),
    "chunk-no-window": MaskSpec(AttentionMode.CHUNK_CAUSAL, chunk=80),
    "causal-window-sink": MaskSpec(AttentionMode.CAUSAL, window=100, sink=16),
}


def _planned_mask_case(
    spec: MaskSpec, kv_heads: int, page: int, splits: int, fp8: bool = False, **modes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel over rows of one or two chunks with long histories under ``spec``
    (released pages hold NaN in the cache and the null entry 0 in the table: a kernel loading
    them fails), bfloat16 queries, GQA; ``fp8``: e4m3 pages with per-KV-head scales, the
    reference over the dequantised pages. Returns (kernel output, dense reference) as float64."""
    from diffusion_kv.platforms.cuda import kernels

    dev, dtype, heads, d = torch.device("cuda"), torch.bfloat16, 8, 128
    group = heads // kv_heads
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1152, 480, 960]
    query_lens = [192, 96, 64]
    num_blocks = sum(-(-s // page) for s in seq_lens) + 1
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_cache = torch.full((num_blocks, page, kv_heads, d), float("nan"), dtype=cache_dtype, device=dev)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_scale = torch.rand(kv_heads, generator=gen) + 0.25
    v_scale = torch.rand(kv_heads, generator=gen) + 0.25
    width = max(-(-s // page) for s in seq_lens)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: the null entry
    queries, refs, at = [], [], 0
    for r, (sl, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
        n = -(-sl // page)
        blocks = order[at : at + n]
        at += n
        k = torch.randn(sl, kv_heads, d, generator=gen).to(dtype)
        v = torch.randn(sl, kv_heads, d, generator=gen).to(dtype)
        if fp8:  # what the pages hold, and the keys they stand for
            k8 = (k.float() / k_scale[:, None]).to(cache_dtype)
            v8 = (v.float() / v_scale[:, None]).to(cache_dtype)
            k, v = k8.float() * k_scale[:, None], v8.float() * v_scale[:, None]
        else:
            k8, v8 = k, v
        q = torch.randn(ql, heads, d, generator=gen).to(dtype)
        visible = spec.row_mask(sl - ql, ql, sl)
        seen_by_any = visible.any(dim=0)
        for i, b in enumerate(blocks):
            keys = slice(i * page, min((i + 1) * page, sl))
            if not bool(seen_by_any[keys].any()):  # released: NaN stays, the table holds 0
                continue
            table[r, i] = b
            k_cache[b, : keys.stop - keys.start] = k8[keys].to(dev)
            v_cache[b, : keys.stop - keys.start] = v8[keys].to(dev)
        queries.append(q)
        refs.append(dense_attention(q, k, v, visible, d**-0.5))
    query = torch.cat(queries).to(dev)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    block_m = 128
    per_tile = block_m // group
    tiles = [(r, q0) for r, ql in enumerate(query_lens) for q0 in range(0, ql, per_tile)]
    tile_row = torch.tensor([t[0] for t in tiles], dtype=torch.int32, device=dev)
    tile_q0 = torch.tensor([t[1] for t in tiles], dtype=torch.int32, device=dev)
    out = torch.empty_like(query)
    scales = dict(k_scale=k_scale.to(dev), v_scale=v_scale.to(dev)) if fp8 else {}
    kernels.paged_attention(
        query,
        k_cache,
        v_cache,
        out,
        table.to(dev),
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        qsl,
        tile_row,
        tile_q0,
        scale=d**-0.5,
        causal=spec.kind is AttentionMode.CAUSAL,
        block_m=block_m,
        block_n=64,
        num_splits=splits,
        num_warps=8,
        chunk=spec.chunk,
        window=spec.window,
        sink=spec.sink,
        **scales,  # type: ignore[arg-type]
        **modes,  # type: ignore[arg-type]
    )
    return out.double().cpu(), torch.cat(refs).double()


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_kernel_planned_masks_match_dense(mask: str, kv_heads: int, page: int, splits: int) -> None:
    got, ref = _planned_mask_case(MASKS[mask], kv_heads, page, splits)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("modes", [{}, {"qk_mode": 0, "pv_mode": 0}, {"qk_mode": 2, "pv_mode": 1}])
def test_triton_kernel_planned_masks_on_e4m3_pages(mask: str, modes: dict[str, int]) -> None:
    """Planned masks over e4m3 pages, 128-row query tiles: the default modes on this GPU (fp8
    MMAs from SM90 on), widened tiles, and fp8 MMAs named. The queries' second e4m3 term and the
    planned mask's per-query window bounds are separate values in the kernel (they once shared a
    name, and the planned mask's overwrote the queries')."""
    got, ref = _planned_mask_case(MASKS[mask], 2, 128, 4, fp8=True, **modes)
    assert not got.isnan().any()
    cos = torch.nn.functional.cosine_similarity(got.flatten(1), ref.flatten(1), dim=1)
    assert float(cos.min()) >= 0.999, float(cos.min())
    torch.testing.assert_close(got, ref, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("backend", ["paged", "sdpa"])
def test_chunks_cutting_blocks_take_unmasked_sdpa_over_their_visible_keys(backend: str) -> None:
    """Chunks of 600 tokens over blocks of 128 (sink 1 chunk, window 2 chunks; ``paged`` takes the
    gather + SDPA way from 512 queries): every chunk's group reads exactly its visible keys with
    no mask (the cache slots made at build), and the output matches dense attention over the
    whole history under the session mask."""
    from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
    from diffusion_kv.core.runner import PagedWorker, RunnerConfig
    from diffusion_kv.core.sessions import SessionCache, SessionPolicy
    from diffusion_kv.platforms.cuda import CudaPlatform
    from diffusion_kv.platforms.torch_sdpa import uniform_key_runs

    policy = SessionPolicy(chunk_tokens=600, window_chunks=2, sink_chunks=1)
    heads, d, block, dtype, dev = 4, 64, 128, torch.bfloat16, torch.device("cuda")
    max_len = 8 * policy.chunk_tokens + block
    worker = PagedWorker(
        CudaPlatform(), RunnerConfig(max_len, 1, 2, policy.chunk_tokens, device=dev, backend=backend)
    )
    worker.register_kv_cache_layers({"l0": PagedLayerSpec(heads, heads, d, dtype, mode=policy.mask)})
    worker.initialize_kv_cache(num_blocks=24, block_size=block)
    pool = FreeListPool(24)
    alloc = DiffusionKVAllocator(
        block_size=block, max_model_len=max_len, max_rows_per_request=1, worker_rows=2, pool=pool
    )
    cache = SessionCache(worker, alloc, policy)
    session = cache.begin_session("s", 1)
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.zeros(0, heads, d), torch.zeros(0, heads, d)
    cut = 0
    for _index in range(8):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            assert worker.translator is not None
            batch = worker.translator.active_batch
            assert batch is not None
            md = batch.attn_metadata["l0"]
            assert md.way.value == "sdpa"
            (grp,) = md.sdpa_groups
            runs = uniform_key_runs(policy.mask, chunk.start, chunk.tokens, chunk.end)
            assert runs is not None
            assert grp.key_mask is None and grp.keys == sum(b - a for a, b in runs)
            if grp.key_runs:
                cut += 1
                assert grp.tokens is not None and grp.tokens.is_cuda and grp.tokens.numel() == grp.keys
            q, k, v = (torch.randn(chunk.tokens, heads, d, generator=gen).to(dtype) for _ in range(3))
            out = worker.forward("l0", q.to(dev), k.to(dev), v.to(dev))
            keys, values = torch.cat([keys, k.float()]), torch.cat([values, v.float()])
            mask = policy.mask.row_mask(chunk.start, chunk.tokens, chunk.end)
            ref = dense_attention(q.float(), keys, values, mask, d**-0.5)
            torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
        cache.commit(chunk)
    assert cut == 4  # chunks 4 to 7: the sink ends inside block 4, the window starts past it
    cache.end_session(session)
    assert pool.num_free == pool.num_total

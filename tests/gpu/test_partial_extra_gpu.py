"""``PagedBackend.forward_partial_extra`` on CUDA in bf16: a session chunk's queries plus extra
queries (DreamZero's action/state queries) through cuda:paged and cuda:sdpa equal the default
(``forward_partial`` per piece) and float32 dense attention over the chunk's visible keys.
Skipped without CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import SessionCache, SessionPolicy

H, HKV, D, BLOCK, CHUNK = 8, 4, 64, 16, 88  # chunks straddle blocks
POLICY = SessionPolicy(chunk_tokens=CHUNK, window_chunks=1, sink_chunks=1)
LAYER = "l0"
DTYPE = torch.bfloat16


def _session(backend: str) -> tuple[SessionCache, Any, torch.Tensor, torch.Tensor]:
    from diffusion_kv.platforms.cuda import CudaPlatform

    device = torch.device("cuda")
    worker = PagedWorker(CudaPlatform(), RunnerConfig(512, 1, 1, 512, device=device, backend=backend))
    worker.register_kv_cache_layers({LAYER: PagedLayerSpec(H, HKV, D, DTYPE, mode=POLICY.mask)})
    worker.initialize_kv_cache(num_blocks=40, block_size=BLOCK)
    alloc = DiffusionKVAllocator(
        block_size=BLOCK, max_model_len=512, max_rows_per_request=1, worker_rows=1, pool=FreeListPool(40)
    )
    cache = SessionCache(worker, alloc, POLICY)
    session = cache.begin_session("s")
    gen = torch.Generator(device=device).manual_seed(3)
    keys, values = [], []
    for _ in range(3):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        k = torch.randn(CHUNK, HKV, D, generator=gen, device=device, dtype=DTYPE)
        v = torch.randn(CHUNK, HKV, D, generator=gen, device=device, dtype=DTYPE)
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            worker.forward(LAYER, torch.randn(CHUNK, H, D, generator=gen, device=device, dtype=DTYPE), k, v)
        cache.commit(chunk)
        keys.append(k)
        values.append(v)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    return cache, chunk, torch.cat(keys), torch.cat(values)


@contextmanager
def _written(
    cache: SessionCache, chunk: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Iterator[tuple[Any, ...]]:
    """The chunk's K/V written (its rows active): the backend, layer, query, cache and
    metadata of the call; the layer counted done on exit."""
    worker = cache.worker
    executor = worker.executor
    assert executor is not None
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        ctx = executor.context(LAYER, q, k, v)
        backend, kv_cache = executor.backends[LAYER], executor.kv_caches[LAYER]
        backend.write_kv(ctx.layer, ctx.key, ctx.value, kv_cache, ctx.slot_mapping)
        yield backend, ctx.layer, ctx.query, kv_cache, ctx.native_metadata
        executor.translator.layer_done(LAYER)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 attention of ``q`` over every key: ``(out [Q, H, D], lse [Q, H])``."""
    k, v = k.float().repeat_interleave(H // HKV, 1), v.float().repeat_interleave(H // HKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * D**-0.5
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out, torch.logsumexp(scores, -1).transpose(0, 1)


@torch.no_grad()
@pytest.mark.parametrize("backend_name", ["paged", "sdpa"])
@pytest.mark.parametrize("extra", [33, 200])
def test_the_fast_path_equals_the_default_in_bf16(backend_name: str, extra: int) -> None:
    cache, chunk, keys, values = _session(backend_name)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(10 + extra)
    q, x = (torch.randn(n, H, D, generator=gen, device=device, dtype=DTYPE) for n in (CHUNK, extra))
    k, v = (torch.randn(CHUNK, HKV, D, generator=gen, device=device, dtype=DTYPE) for _ in range(2))
    with _written(cache, chunk, q, k, v) as (backend, layer, query, kv_cache, md):
        out, lse = backend.forward_partial_extra(layer, query, x, kv_cache, md)
        d_out, d_lse = PagedBackend.forward_partial_extra(backend, layer, query, x, kv_cache, md)
    assert out.shape == (CHUNK + extra, H, D) and out.dtype == DTYPE and lse.dtype == torch.float32
    assert (out.float() - d_out.float()).abs().max().item() <= 2e-2
    assert (lse - d_lse).abs().max().item() <= 2e-2
    # chunk 3 sees the sink chunk 0, the window chunk 2 and itself
    ref_out, ref_lse = _dense(
        torch.cat([q, x]),
        torch.cat([keys[:CHUNK], keys[2 * CHUNK :], k]),
        torch.cat([values[:CHUNK], values[2 * CHUNK :], v]),
    )
    assert (out.float() - ref_out).abs().max().item() <= 2e-2
    assert (lse - ref_lse).abs().max().item() <= 2e-2


@torch.no_grad()
@pytest.mark.parametrize("backend_name", ["paged", "sdpa"])
def test_extra_keys_join_the_chunks_keys_in_one_call_in_bf16(backend_name: str) -> None:
    """``forward_extra_keys`` (DreamZero's scratch K/V beside the pages): where the backend's
    batch takes the SDPA way it attends them in one call; either way the result (its own, or
    the caller's merge when it declines) equals float32 dense attention over every key."""
    from diffusion_kv.core.parallel import merge_partial_attention

    cache, chunk, keys, values = _session(backend_name)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(40)
    q, x = (torch.randn(n, H, D, generator=gen, device=device, dtype=DTYPE) for n in (CHUNK, 33))
    k, v, ek, ev = (
        torch.randn(n, HKV, D, generator=gen, device=device, dtype=DTYPE) for n in (CHUNK, CHUNK, 5, 5)
    )
    with _written(cache, chunk, q, k, v) as (backend, layer, query, kv_cache, md):
        served = backend.forward_extra_keys(layer, query, x, ek, ev, kv_cache, md)
        if served is None:
            paged = backend.forward_partial_extra(layer, query, x, kv_cache, md)
            out_e, lse_e = _dense(torch.cat([q, x]), ek, ev)
            out = merge_partial_attention([paged[0].float(), out_e], [paged[1], lse_e])
        else:
            out = served[0]
            assert out.dtype == DTYPE and served[1].dtype == torch.float32
    if backend_name == "sdpa":
        assert served is not None  # the gather + SDPA backend always takes the SDPA way
    ref_out, _ = _dense(
        torch.cat([q, x]),
        torch.cat([keys[:CHUNK], keys[2 * CHUNK :], k, ek]),
        torch.cat([values[:CHUNK], values[2 * CHUNK :], v, ev]),
    )
    assert out.shape == (CHUNK + 33, H, D)
    assert (out.float() - ref_out).abs().max().item() <= 2e-2

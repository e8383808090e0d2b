"""``PagedBackend.forward_partial_extra`` on the cpu platform: one session chunk's queries plus
extra queries that see the chunk's keys. The default (``forward_partial`` per piece), the
reference backend's override and the gather + SDPA backend's one-call fast path give the same
out and log-sum-exp, equal to dense attention over the chunk's visible keys; where the fast path
does not apply (a causal row) the SDPA backend falls back to the default, and the reference
refuses what the contract excludes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffusion_kv import DiffusionKVAllocator, FreeListPool, PagedLayerSpec
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.errors import UnsupportedFeatureError, ValidationError
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import SessionCache, SessionPolicy
from diffusion_kv.platforms.cpu import CpuPlatform

H, HKV, D, BLOCK = 4, 2, 8, 16
POLICY = SessionPolicy(chunk_tokens=20, window_chunks=1, sink_chunks=1)  # chunks straddle blocks
LAYER = "l0"


def _worker(backend: str, mode: Any) -> PagedWorker:
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(96, 2, 2, 96, device=torch.device("cpu"), backend=backend)
    )
    worker.register_kv_cache_layers({LAYER: PagedLayerSpec(H, HKV, D, torch.float32, mode=mode)})
    worker.initialize_kv_cache(num_blocks=40, block_size=BLOCK)
    return worker


def _session(backend: str) -> tuple[SessionCache, Any, dict[str, torch.Tensor]]:
    """A session with three committed chunks (the first is the sink; the second slid out of
    the window) and an open fourth one; the committed K/V by position."""
    worker = _worker(backend, POLICY.mask)
    alloc = DiffusionKVAllocator(block_size=BLOCK, max_model_len=96, max_rows_per_request=2, worker_rows=2,
                                 pool=FreeListPool(40))  # fmt: skip
    cache = SessionCache(worker, alloc, POLICY)
    session = cache.begin_session("s")
    gen = torch.Generator().manual_seed(3)
    keys, values = [], []
    for _ in range(3):
        chunk = cache.append_chunk(session)
        assert chunk is not None
        k, v = torch.randn(20, HKV, D, generator=gen), torch.randn(20, HKV, D, generator=gen)
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            worker.forward(LAYER, torch.randn(20, H, D, generator=gen), k, v)
        cache.commit(chunk)
        keys.append(k)
        values.append(v)
    chunk = cache.append_chunk(session)
    assert chunk is not None
    return cache, chunk, {"k": torch.cat(keys), "v": torch.cat(values)}


def _call(
    worker: PagedWorker, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[Any, ...]:
    """Write the chunk's K/V; the backend, layer, query, cache and metadata of the call."""
    executor = worker.executor
    assert executor is not None
    ctx = executor.context(LAYER, query, key, value)
    backend = executor.backends[LAYER]
    kv_cache = executor.kv_caches[LAYER]
    backend.write_kv(ctx.layer, ctx.key, ctx.value, kv_cache, ctx.slot_mapping)
    return backend, ctx.layer, ctx.query, kv_cache, ctx.native_metadata


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = k.double().repeat_interleave(H // HKV, 1), v.double().repeat_interleave(H // HKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out, lse.transpose(0, 1)


class _Counting:
    """Counts a backend instance's ``forward_partial`` calls."""

    def __init__(self, backend: PagedBackend) -> None:
        self.calls = 0
        self.inner = backend.forward_partial

    def __call__(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.inner(*args)


@pytest.mark.parametrize("backend_name", ["reference", "sdpa"])
@pytest.mark.parametrize("extra", [0, 3, 20, 47])
def test_extra_queries_attend_the_chunks_keys_in_one_call_as_in_the_default(
    backend_name: str, extra: int
) -> None:
    cache, chunk, committed = _session(backend_name)
    gen = torch.Generator().manual_seed(10 + extra)
    q, x = torch.randn(20, H, D, generator=gen), torch.randn(extra, H, D, generator=gen)
    k, v = torch.randn(20, HKV, D, generator=gen), torch.randn(20, HKV, D, generator=gen)
    worker = cache.worker
    with worker.stepper() as runtime:
        runtime.ensure_rows(chunk.rows())
        backend, layer, query, kv_cache, md = _call(worker, q, k, v)
        counting = _Counting(backend)
        backend.forward_partial = counting
        out, lse = backend.forward_partial_extra(layer, query, x, kv_cache, md)
        fast_calls = counting.calls
        d_out, d_lse = PagedBackend.forward_partial_extra(backend, layer, query, x, kv_cache, md)
        default_calls = counting.calls - fast_calls
        worker.executor.translator.layer_done(LAYER)  # type: ignore[union-attr]
    assert out.shape == (20 + extra, H, D) and lse.shape == (20 + extra, H) and lse.dtype == torch.float32
    assert default_calls == 1 + -(-extra // 20)  # the default: one call per piece of 20 queries
    # both overrides attend every query in one pass, no forward_partial call (the SDPA backend
    # with no extra query: its forward_partial, once)
    assert fast_calls == (1 if extra == 0 and backend_name == "sdpa" else 0)
    torch.testing.assert_close(out, d_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, d_lse, atol=1e-5, rtol=1e-5)
    # chunk 3 (positions 60..80) sees the sink chunk 0, the window chunk 2 and itself
    keys = torch.cat([committed["k"][0:20], committed["k"][40:60], k])
    values = torch.cat([committed["v"][0:20], committed["v"][40:60], v])
    ref_out, ref_lse = _dense(torch.cat([q, x]), keys, values)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_a_causal_row_takes_the_default_on_sdpa_and_is_refused_by_the_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    q, x = torch.randn(5, H, D, generator=gen), torch.randn(2, H, D, generator=gen)
    k, v = torch.randn(5, HKV, D, generator=gen), torch.randn(5, HKV, D, generator=gen)
    results = {}
    for name in ("sdpa", "reference"):
        worker = _worker(name, AttentionMode.CAUSAL)
        assert worker.install(RequestAllocation("r", 0, (SequenceAllocation(0, 0, 5, 5, ((2,),)),)))
        with worker.activate(
            PhaseRows((PagedRow("r", 5, 5, sequence_id=0),), (PagedRow("r", 5, 5, sequence_id=0),))
        ) as runtime:
            runtime.ensure_active(0)
            backend, layer, query, kv_cache, md = _call(worker, q, k, v)
            if name == "reference":  # its queries see different keys: outside the contract
                with pytest.raises(UnsupportedFeatureError, match="row 0's 5 queries see different keys"):
                    backend.forward_partial_extra(layer, query, x, kv_cache, md)
                continue
            counting = _Counting(backend)
            backend.forward_partial = counting
            results[name] = backend.forward_partial_extra(layer, query, x, kv_cache, md)
            assert counting.calls == 2  # the default: the row, then one padded piece
    out, lse = results["sdpa"]
    # the default gives extra query i the visibility of the row's query i: keys 0..i
    for i in range(2):
        ref_out, ref_lse = _dense(x[i : i + 1], k[: i + 1], v[: i + 1])
        torch.testing.assert_close(out[5 + i : 6 + i].double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[5 + i : 6 + i].double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra", [0, 3])
def test_extra_keys_join_the_chunks_keys_in_one_sdpa_call(extra: int) -> None:
    """``forward_extra_keys``: the gather + SDPA backend attends the chunk's (and the extra)
    queries over the chunk's visible keys plus keys with no place in the pages, in one call;
    the reference backend (and the base class) decline with None."""
    gen = torch.Generator().manual_seed(20 + extra)
    q, x = torch.randn(20, H, D, generator=gen), torch.randn(extra, H, D, generator=gen)
    k, v = torch.randn(20, HKV, D, generator=gen), torch.randn(20, HKV, D, generator=gen)
    ek, ev = torch.randn(5, HKV, D, generator=gen), torch.randn(5, HKV, D, generator=gen)
    for name in ("sdpa", "reference"):
        cache, chunk, committed = _session(name)
        worker = cache.worker
        with worker.stepper() as runtime:
            runtime.ensure_rows(chunk.rows())
            backend, layer, query, kv_cache, md = _call(worker, q, k, v)
            counting = _Counting(backend)
            backend.forward_partial = counting
            served = backend.forward_extra_keys(layer, query, x, ek, ev, kv_cache, md)
            base = PagedBackend.forward_extra_keys(backend, layer, query, x, ek, ev, kv_cache, md)
            if name == "sdpa":
                with pytest.raises(ValidationError, match=r"extra_value must be \[X, 2, 8\] with one X"):
                    backend.forward_extra_keys(layer, query, x, ek, ev[:4], kv_cache, md)
                with pytest.raises(
                    ValidationError, match=r"extra_query must be \[E, 4, 8\]; got \(3, 2, 8\)"
                ):
                    backend.forward_extra_keys(layer, query, ek[:3], ek, ev, kv_cache, md)
                with pytest.raises(ValidationError, match="extra_key is on meta, the query on cpu"):
                    backend.forward_extra_keys(layer, query, x, ek.to("meta"), ev, kv_cache, md)
            worker.executor.translator.layer_done(LAYER)  # type: ignore[union-attr]
        assert base is None and counting.calls == 0
        if name == "reference":
            assert served is None  # declined: the caller merges its own partial
            continue
        assert served is not None
        out, lse = served
        assert out.shape == (20 + extra, H, D) and lse.shape == (20 + extra, H) and lse.dtype == torch.float32
        # the sink chunk 0, the window chunk 2, the chunk itself, then the extra keys
        keys = torch.cat([committed["k"][0:20], committed["k"][40:60], k, ek])
        values = torch.cat([committed["v"][0:20], committed["v"][40:60], v, ev])
        ref_out, ref_lse = _dense(torch.cat([q, x]), keys, values)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_a_causal_row_declines_extra_keys_on_sdpa() -> None:
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(5, n, D, generator=gen) for n in (H, HKV, HKV))
    worker = _worker("sdpa", AttentionMode.CAUSAL)
    assert worker.install(RequestAllocation("r", 0, (SequenceAllocation(0, 0, 5, 5, ((2,),)),)))
    with worker.activate(
        PhaseRows((PagedRow("r", 5, 5, sequence_id=0),), (PagedRow("r", 5, 5, sequence_id=0),))
    ) as runtime:
        runtime.ensure_active(0)
        backend, layer, query, kv_cache, md = _call(worker, q, k, v)
        # each query sees its own prefix: not one set of keys for every query
        assert backend.forward_extra_keys(layer, query, q[:0], k[:2], v[:2], kv_cache, md) is None

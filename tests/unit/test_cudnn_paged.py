"""``cuda:cudnn`` without a GPU: its availability reasons, and what it hands cuDNN.

The cuDNN graph itself runs on a GPU only (``tests/gpu/test_cudnn_paged_gpu.py``). Here the
backend runs on the CPU under Triton's interpreter with the graph's execution replaced by a
torch stand-in that reads exactly what cuDNN is given (per-row query and key lengths, the
queries' ragged offsets, the page table): attention from those inputs must equal dense
attention, and batches cuDNN does not take (causal, memory-bound) keep ``paged``'s ways.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest
import torch

from diffusion_kv.core.layout import pow2_at_least
from diffusion_kv.platforms.cuda import cudnn_paged
from diffusion_kv.platforms.cuda.cudnn_paged import CudnnBatch, cudnn_paged_available, make_batch
from diffusion_kv.platforms.interface import Availability
from tests.cuda_interpreted import InterpretedCudaPlatform, interpreted  # sets TRITON_INTERPRET first


def test_availability_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "cudnn" else real_find(name, *a)
    )
    found = cudnn_paged_available()
    assert not found and found.reason == (
        "the cuDNN frontend's Python package is not installed (pip install nvidia-cudnn-frontend)"
    )
    fake = types.ModuleType("cudnn")
    fake.__version__ = "1.32.0"  # type: ignore[attr-defined]
    fake.__spec__ = importlib.machinery.ModuleSpec("cudnn", None)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: fake.__spec__ if name == "cudnn" else None
    )
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90400)
    old = cudnn_paged_available()
    assert not old and old.reason == "torch's cuDNN is 90400; paged SDPA needs 90500 or later"
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert cudnn_paged_available() == Availability(True, "cuDNN 91900, frontend 1.32.0")


def test_buckets_are_powers_of_two_with_a_floor_and_a_cap() -> None:
    assert [pow2_at_least(n, 64) for n in (1, 64, 65, 512, 513, 5120)] == [64, 64, 128, 512, 1024, 8192]
    assert min(pow2_at_least(5000, 128), 4096) == 4096 and min(pow2_at_least(100, 128), 4096) == 128


def test_uniform_rows_are_not_ragged_and_keep_their_exact_query_count() -> None:
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    uniform = make_batch((48, 48), (60, 64), table, 16)
    assert (uniform.ragged, uniform.max_q, uniform.max_kv) == (False, 48, 64)
    assert uniform.seq_q.flatten().tolist() == [48, 48] and uniform.seq_kv.flatten().tolist() == [60, 64]
    mixed = make_batch((48, 8), (60, 64), table, 16)
    assert (mixed.ragged, mixed.max_q, mixed.max_kv) == (True, 64, 64)
    assert mixed.cum_q.tolist() == [0, 48, 56]
    bucketed = make_batch((48, 48), (60, 64), table, 16, exact_uniform=False)
    assert (bucketed.ragged, bucketed.max_q) == (True, 64)


def test_exact_graphs_are_admitted_for_a_bounded_number_of_uniform_shapes() -> None:
    graphs = cudnn_paged.CudnnGraphs()
    limit = cudnn_paged.EXACT_SHAPES
    assert all(graphs.admit_exact(1, 100 + q) for q in range(limit))
    assert not graphs.admit_exact(1, 99) and not graphs.admit_exact(2, 100)
    assert graphs.admit_exact(1, 100) and graphs.admit_exact(1, 100 + limit - 1)  # admitted ones stay


def _attend_from_inputs(
    batch: CudnnBatch,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """What cuDNN computes, from what it is handed only: per row, the queries at the ragged
    offset (without ragged offsets: at ``i * max_q`` tokens, every row ``max_q`` long), the keys
    of the row's pages up to its key length."""
    _, heads, d = query.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if batch.ragged:
        offsets = batch.offsets_for(heads * d).flatten().tolist()
    else:
        offsets = [i * batch.max_q * heads * d for i in range(batch.rows)]
    seq_q, seq_kv = batch.seq_q.flatten().tolist(), batch.seq_kv.flatten().tolist()
    flat_q, flat_o = query.reshape(-1), out.view(-1)
    for i in range(batch.rows):
        nq, nk = seq_q[i], seq_kv[i]
        assert nq <= batch.max_q and nk <= batch.max_kv
        assert batch.ragged or nq == batch.max_q
        q = flat_q[offsets[i] : offsets[i] + nq * heads * d].view(nq, heads, d)
        pages = batch.table[i, 0, : -(-nk // page), 0].long()
        k = k_cache[pages].reshape(-1, kv_heads, d)[:nk]
        v = v_cache[pages].reshape(-1, kv_heads, d)[:nk]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=heads != kv_heads
        )
        flat_o[offsets[i] : offsets[i] + nq * heads * d] = o.transpose(0, 1).reshape(-1)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU present: tests/gpu covers the real graph")
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cudnn_way_hands_cudnn_the_rows_it_attends(monkeypatch: pytest.MonkeyPatch, kv_heads: int) -> None:
    pytest.importorskip("triton", reason="Triton is not installed (ci/bootstrap.sh installs it)")
    from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
    from diffusion_kv.core.attention import AttentionMode
    from diffusion_kv.core.rows import PagedRow
    from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
    from diffusion_kv.platforms.cuda import backend as cuda_backend
    from diffusion_kv.platforms.cuda.backend import CudnnPagedBackend

    class Platform(InterpretedCudaPlatform):
        backends = (interpreted(CudnnPagedBackend),)  # type: ignore[assignment]

    calls: list[CudnnBatch] = []

    def stand_in(self: Any, batch: CudnnBatch, *args: Any) -> None:
        calls.append(batch)
        _attend_from_inputs(batch, *args)

    monkeypatch.setattr(cudnn_paged.CudnnGraphs, "attend", stand_in)
    monkeypatch.setattr(cuda_backend, "SDPA_MIN_QUERY", 24)
    heads, d, page = 4, 64, 16
    rows = [(24, 40), (8, 8), (32, 70), (24, 40)]  # (queries, keys): three shapes, ragged
    gen = torch.Generator().manual_seed(0)
    blocks = sum(-(-s // page) for _, s in rows)
    order = torch.randperm(blocks + 1, generator=gen).tolist()
    seqs, at = [], 0
    for i, (q, s) in enumerate(rows):
        n = -(-s // page)
        seqs.append(SequenceAllocation(i, s - q, q, s, (tuple(order[at : at + n]),)))
        at += n
    results = {}
    for mode in (AttentionMode.FULL, AttentionMode.CAUSAL):
        runner = PagedWorker(
            Platform(),
            RunnerConfig(
                max_model_len=80,
                max_rows_per_request=4,
                max_num_seqs=1,
                max_num_batched_tokens=200,
                device=torch.device("cpu"),
            ),
        )
        runner.register_kv_cache_layers({"l": PagedLayerSpec(heads, kv_heads, d, torch.float32, mode=mode)})
        runner.initialize_kv_cache(num_blocks=blocks + 1, block_size=page)
        runner.install(RequestAllocation("r", 0, tuple(seqs)))
        ks = [torch.randn(s, kv_heads, d, generator=gen) for _, s in rows]
        vs = [torch.randn(s, kv_heads, d, generator=gen) for _, s in rows]
        translator = runner.translator
        assert translator is not None
        prefill = translator.prepare(
            tuple(PagedRow("r", s, s, 0, sequence_id=i) for i, (_, s) in enumerate(rows))
        )
        with translator.activate(prefill):
            runner.forward("l", torch.zeros(sum(s for _, s in rows), heads, d), torch.cat(ks), torch.cat(vs))
        calls.clear()
        batch = translator.prepare(
            tuple(PagedRow("r", q, s, s - q, sequence_id=i) for i, (q, s) in enumerate(rows))
        )
        md = batch.attn_metadata["l"]
        backend, layer, cache = runner.backends[0], runner.layers["l"], runner.kv_caches["l"]
        query = torch.randn(sum(q for q, _ in rows), heads, d, generator=gen)
        got = backend.forward(layer, query, cache, md)
        dense = []
        for (q, s), k, v, qq in zip(rows, ks, vs, torch.split(query, [q for q, _ in rows]), strict=True):
            dense.append(
                torch.nn.functional.scaled_dot_product_attention(
                    qq.transpose(0, 1),
                    k.transpose(0, 1),
                    v.transpose(0, 1),
                    is_causal=False,
                    attn_mask=None if mode is AttentionMode.FULL else torch.ones(q, s).tril(s - q).bool(),
                    scale=layer.scale,
                    enable_gqa=heads != kv_heads,
                ).transpose(0, 1)
            )
        torch.testing.assert_close(got, torch.cat(dense), atol=2e-5, rtol=1e-5)
        results[mode] = (md, list(calls))
        runner.remove(["r"])
    md, handed = results[AttentionMode.FULL]
    assert "cudnn" in md.extra and md.reason == "full attention, compute-bound: cuDNN's paged SDPA in place"
    (plan,) = handed
    assert (
        plan.rows == 4 and plan.ragged and plan.max_q == 64 and plan.max_kv == 80
    )  # buckets: 32 -> 64; 70 -> 128 capped at 5 pages
    assert plan.seq_q.flatten().tolist() == [24, 8, 32, 24]
    assert plan.seq_kv.flatten().tolist() == [40, 8, 70, 40]
    assert plan.cum_q.tolist() == [0, 24, 32, 64, 88]
    assert plan.offsets_for(heads * d).flatten().tolist() == [0, 24 * 256, 32 * 256, 64 * 256, 88 * 256]
    causal_md, causal_calls = results[AttentionMode.CAUSAL]
    assert "cudnn" not in causal_md.extra and causal_calls == []  # paged's own way served it

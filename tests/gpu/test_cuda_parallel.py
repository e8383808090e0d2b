"""The cuda plugin's backends under strict Ulysses and decode context parallelism (DCP), on one
GPU: the ranks are simulated in one process (each rank is a worker of its own, as the
conformance kit does), so no second GPU is needed. Skipped without CUDA (see conftest).

* DCP: every backend's partials of ``cp_size`` 2 and 4 (interleave 1 and 16, causal and full,
  GQA 4:1, bf16) merged by ``merge_partial_attention`` equal dense attention, for a whole
  sequence (``paged`` takes gather + SDPA) and for a short suffix over cached pages (``paged``
  takes the Triton kernel, split-KV); each rank's log-sum-exp equals a float64 one over its
  own keys;
* strict Ulysses: workers with rank-local heads (degree 2 and 4) together equal the full layer;
* the DCP per-layer path does not synchronise with the host and replays from a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from diffusion_kv.conformance.harness import CapturePartials, PagedHarness
from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.graphs import CapturedStep
from diffusion_kv.core.parallel import merge_partial_attention
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.interface import ENV_BACKEND
from diffusion_kv.platforms.selection import get_platform

BACKENDS = ["paged", "triton", "sdpa"]
DTYPE = torch.bfloat16
HEADS, KV_HEADS, HEAD_SIZE = 8, 2, 128
BF16_TOL = 2e-2
"""Absolute and relative tolerance of a bf16 result against the float64 reference."""


def worker(**kw: object) -> PagedHarness:
    args: dict[str, object] = dict(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
        block_size=128,
        num_blocks=64,
        max_model_len=1280,
        max_rows_per_request=2,
        max_num_seqs=1,
        layer_names=("layer.0",),
    )
    args.update(kw)
    return PagedHarness(get_platform("cuda"), **args)  # type: ignore[arg-type]


def packed(
    data: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], rows: Sequence[PagedRow]
) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.cat([d[i][r.kv_start_pos : r.seq_len] for d, r in zip(data, rows, strict=True)])
        for i in range(3)
    )


def run(h: PagedHarness, rows: Sequence[PagedRow], data: Sequence[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    q, k, v = packed(data, rows)  # type: ignore[arg-type]
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        return h.executor.forward("layer.0", q, k, v)


def rows_for(seq_lens: Sequence[int], query_lens: Sequence[int]) -> tuple[PagedRow, ...]:
    return tuple(
        PagedRow("r", ql, n, n - ql, sequence_id=i)
        for i, (n, ql) in enumerate(zip(seq_lens, query_lens, strict=True))
    )


def expected(data: Sequence[tuple[torch.Tensor, ...]], rows: Sequence[PagedRow], mode: str) -> torch.Tensor:
    outs = []
    for (q, k, v), r in zip(data, rows, strict=True):
        mask = row_mask(AttentionMode(mode), r.kv_start_pos, r.query_len, r.seq_len)
        outs.append(dense_attention(q[r.kv_start_pos : r.seq_len], k, v, mask, HEAD_SIZE**-0.5))
    return torch.cat(outs)


def local_lse(
    data: Sequence[tuple[torch.Tensor, ...]],
    rows: Sequence[PagedRow],
    mode: str,
    cp_size: int,
    rank: int,
    interleave: int,
) -> torch.Tensor:
    """float64 ``[T, H]`` log-sum-exp over the keys rank ``rank`` holds (``-inf`` where none is
    visible), computed from the absolute positions directly."""
    outs = []
    group = HEADS // KV_HEADS
    for (q, k, _), r in zip(data, rows, strict=True):
        mask = row_mask(AttentionMode(mode), r.kv_start_pos, r.query_len, r.seq_len).to(q.device)
        mine = (torch.arange(r.seq_len, device=q.device) // interleave) % cp_size == rank
        mask = mask & mine[None, :]
        qq = q[r.kv_start_pos : r.seq_len].double()
        kk = k.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->qhk", qq, kk) * HEAD_SIZE**-0.5
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        outs.append(torch.logsumexp(scores, dim=-1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("mode", ["causal", "full"])
def test_dcp_partials_merge_to_dense_attention(
    backend: str, cp_size: int, interleave: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_BACKEND, f"cuda:{backend}")
    dev = torch.device("cuda")
    seq_lens = [1100, 700]
    g = torch.Generator(device=dev).manual_seed(cp_size * 10 + interleave)
    data = [
        tuple(
            torch.randn(n, heads, HEAD_SIZE, device=dev, dtype=DTYPE, generator=g)
            for heads in (HEADS, KV_HEADS, KV_HEADS)
        )
        for n in seq_lens
    ]
    phases = {
        "whole": rows_for(seq_lens, seq_lens),  # paged: gather + SDPA (long queries)
        "suffix": rows_for(seq_lens, [40, 40]),  # paged: Triton kernel, split-KV
    }
    attention = AttentionMode.CAUSAL if mode == "causal" else AttentionMode.FULL
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in phases}
    for rank in range(cp_size):
        capture = CapturePartials(cp_size, rank)
        h = worker(
            cp_size=cp_size,
            cp_rank=rank,
            cp_interleave=interleave,
            dcp_merger=capture,
            mode=attention,
            placement_seed=rank,
        )
        assert h.backend.name == backend
        h.install("r", seq_lens)
        for name, rows in phases.items():
            capture.parts.clear()
            run(h, rows, data)
            ((out, lse),) = capture.parts
            assert out.dtype == DTYPE and lse.dtype == torch.float32
            assert not out.isnan().any() and not lse.isnan().any()
            ref = local_lse(data, rows, mode, cp_size, rank, interleave)
            torch.testing.assert_close(lse.double(), ref, atol=1e-2, rtol=1e-3)
            parts[name].append((out, lse))
    for name, rows in phases.items():
        merged = merge_partial_attention([o for o, _ in parts[name]], [lse for _, lse in parts[name]])
        torch.testing.assert_close(
            merged.cpu().double(), expected(data, rows, mode).cpu(), atol=BF16_TOL, rtol=BF16_TOL
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("degree", [2, 4])
def test_ulysses_rank_local_heads(backend: str, degree: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Ulysses rank's worker is built with heads / degree query and KV heads; the ranks'
    outputs side by side equal the full layer's and dense attention."""
    monkeypatch.setenv(ENV_BACKEND, f"cuda:{backend}")
    dev = torch.device("cuda")
    heads, kv_heads = 16, 4
    seq_lens = [900, 333]
    g = torch.Generator(device=dev).manual_seed(degree)
    data = [
        tuple(
            torch.randn(n, hh, HEAD_SIZE, device=dev, dtype=DTYPE, generator=g)
            for hh in (heads, kv_heads, kv_heads)
        )
        for n in seq_lens
    ]
    rows = rows_for(seq_lens, seq_lens)
    full = worker(num_heads=heads, num_kv_heads=kv_heads)
    full.install("r", seq_lens)
    whole = run(full, rows, data)
    hq, hk = heads // degree, kv_heads // degree
    outs = []
    for rank in range(degree):
        h = worker(num_heads=hq, num_kv_heads=hk)
        assert h.backend.name == backend
        h.install("r", seq_lens)
        local = [
            (
                q[:, rank * hq : (rank + 1) * hq],
                k[:, rank * hk : (rank + 1) * hk],
                v[:, rank * hk : (rank + 1) * hk],
            )
            for q, k, v in data
        ]
        outs.append(run(h, rows, local))
    together = torch.cat(outs, dim=1)
    torch.testing.assert_close(together, whole, atol=BF16_TOL, rtol=BF16_TOL)
    torch.testing.assert_close(
        together.cpu().double(), expected(data, rows, "causal").cpu(), atol=BF16_TOL, rtol=BF16_TOL
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("query_len", [40, 700])
def test_dcp_layer_does_not_synchronise_and_replays_from_a_graph(
    backend: str, query_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DCP layer (K/V write + forward_partial, both ways) runs under torch's sync debug mode
    set to error, and a CUDA graph of it replays the eager partial output and LSE."""
    monkeypatch.setenv(ENV_BACKEND, f"cuda:{backend}")
    dev = torch.device("cuda")
    capture = CapturePartials(2, 1)
    h = worker(cp_size=2, cp_rank=1, cp_interleave=16, dcp_merger=capture)
    assert h.runner.supports_graph_capture
    seq_lens = [700, 700]
    h.install("r", seq_lens)
    g = torch.Generator(device=dev).manual_seed(0)
    data = [
        tuple(
            torch.randn(n, hh, HEAD_SIZE, device=dev, dtype=DTYPE, generator=g)
            for hh in (HEADS, KV_HEADS, KV_HEADS)
        )
        for n in seq_lens
    ]
    run(h, rows_for(seq_lens, seq_lens), data)  # prefill: every key written
    rows = rows_for(seq_lens, [query_len, query_len])
    q, k, v = packed(data, rows)  # type: ignore[arg-type]
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            capture.parts.clear()
            h.executor.forward("layer.0", q, k, v)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ((eager_out, eager_lse),) = capture.parts
        eager_out, eager_lse = eager_out.clone(), eager_lse.clone()
        capture.parts.clear()
        step = CapturedStep(h.translator, lambda x: h.executor.forward("layer.0", x, k, v), [q])
        graph_out, graph_lse = capture.parts[-1]  # the graph's static buffers
        step.replay(q)
        torch.cuda.synchronize()
    torch.testing.assert_close(graph_out, eager_out, atol=0, rtol=0)
    torch.testing.assert_close(graph_lse, eager_lse, atol=0, rtol=0)

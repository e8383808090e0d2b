"""The cuda plugin on a real GPU: conformance kit per backend, kernels against SDPA, the demo
and the bench. Skipped without CUDA (see conftest)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diffusion_kv.platforms.selection import get_platform, select_platform
from tests.kit_junit import run_kit


def _run(
    args: list[str], env: dict[str, str] | None = None, timeout: int = 900
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
def test_conformance_kit_passes_on_cuda(backend: str, tmp_path: Path) -> None:
    """Judged by the kit's exit status and its JUnit XML counts (tests/kit_junit.py), not by words
    in its output: the kit prints its matrix as "9 passed, 0 failed, 0 skipped"."""
    run = run_kit("cuda", backend, tmp_path / f"kit-{backend}.xml")
    assert run.returncode == 0, run.tail
    assert (run.counts.failures, run.counts.errors) == (0, 0), run.tail
    assert run.counts.passed > 0, run.counts


def test_auto_selection_picks_cuda() -> None:
    assert select_platform(None, warn=lambda _m: None).platform.name == "cuda"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_paged_kernel_matches_sdpa(
    dtype: torch.dtype, causal: bool, kv_heads: int, page: int, splits: int
) -> None:
    from torch.nn.attention.bias import causal_lower_right

    from diffusion_kv.platforms.cuda import kernels

    torch.manual_seed(0)
    dev = torch.device("cuda")
    H, D = 8, 128
    q_lens, seq_lens = [37, 256, 5], [300, 1024, 777]
    nblk = [-(-s // page) for s in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, page, kv_heads, D, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    at = 0
    for r, n in enumerate(nblk):
        table[r, :n] = torch.tensor(perm[at : at + n])
        at += n
    table = table.to(dev)
    T = sum(q_lens)
    q = torch.randn(T, H, D, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    group = H // kv_heads
    block_m = 64
    per_tile = block_m // group
    rows, q0s = [], []
    for r, n in enumerate(q_lens):
        for q0 in range(0, n, per_tile):
            rows.append(r)
            q0s.append(q0)
    kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        table,
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        qsl,
        torch.tensor(rows, dtype=torch.int32, device=dev),
        torch.tensor(q0s, dtype=torch.int32, device=dev),
        scale=D**-0.5,
        causal=causal,
        block_m=block_m,
        block_n=64,
        num_splits=splits,
    )
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        blocks = table[r, : nblk[r]].long()
        k = k_cache[blocks].reshape(-1, kv_heads, D)[:sl].float()
        v = v_cache[blocks].reshape(-1, kv_heads, D)[:sl].float()
        qr = q[int(qsl[r]) : int(qsl[r]) + ql].float()
        mask = causal_lower_right(ql, sl) if causal else None
        ref = torch.nn.functional.scaled_dot_product_attention(
            qr.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )[0].transpose(0, 1)
        got = out[int(qsl[r]) : int(qsl[r]) + ql].float()
        tol = 2e-2 if dtype == torch.float16 else 6e-2
        assert torch.allclose(got, ref, atol=tol, rtol=tol), (r, float((got - ref).abs().max()))


@pytest.mark.parametrize("modes", [(0, 0), (1, 1), (2, 1), (2, 0)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_triton_kernel_fp8_modes_match_dequantised_pages(modes: tuple[int, int], prefetch: bool) -> None:
    """e4m3 pages, every way of multiplying them (widened, float16 MMAs, fp8 MMAs with the
    two-term queries), GQA 4:1 packing, split KV and a ragged causal batch: the
    output matches attention over the dequantised pages (cosine >= 0.99995), and the default
    modes on this GPU give the same bytes as naming them."""
    from torch.nn.attention.bias import causal_lower_right

    from diffusion_kv.platforms.cuda import kernels

    torch.manual_seed(1)
    dev = torch.device("cuda")
    H, hkv, D, page = 32, 8, 128, 128
    q_lens, seq_lens = [32, 7, 32], [2080, 300, 4096]
    nblk = [-(-s // page) for s in seq_lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    at = 0
    for r, n in enumerate(nblk):
        table[r, :n] = perm[at : at + n].to(torch.int32)
        at += n
    table = table.to(dev)
    k_scale = torch.rand(hkv, device=dev) + 0.25
    v_scale = torch.rand(hkv, device=dev) + 0.25
    kf = torch.randn(num_blocks, page, hkv, D, device=dev) * k_scale[:, None]
    vf = torch.randn(num_blocks, page, hkv, D, device=dev) * v_scale[:, None]
    k_cache = (kf / k_scale[:, None]).to(torch.float8_e4m3fn)
    v_cache = (vf / v_scale[:, None]).to(torch.float8_e4m3fn)
    T = sum(q_lens)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    rows = torch.arange(len(q_lens), dtype=torch.int32, device=dev)
    q0s = torch.zeros(len(q_lens), dtype=torch.int32, device=dev)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=dev)

    def run(**kw: Any) -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        kernels.paged_attention(
            q, k_cache, v_cache, out, table, seq, qsl, rows, q0s,
            scale=D**-0.5, causal=True, block_m=128, block_n=64, num_splits=4, num_warps=8,
            k_scale=k_scale, v_scale=v_scale, prefetch_pages=prefetch, **kw,
        )  # fmt: skip
        return out

    got = run(qk_mode=modes[0], pv_mode=modes[1])
    assert not got.isnan().any()
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        blocks = table[r, : nblk[r]].long()
        k = (k_cache[blocks].float() * k_scale[:, None]).reshape(-1, hkv, D)[:sl]
        v = (v_cache[blocks].float() * v_scale[:, None]).reshape(-1, hkv, D)[:sl]
        qr = q[int(qsl[r]) : int(qsl[r]) + ql].float()
        ref = torch.nn.functional.scaled_dot_product_attention(
            qr.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=causal_lower_right(ql, sl), enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
        mine = got[int(qsl[r]) : int(qsl[r]) + ql].float()
        cos = torch.nn.functional.cosine_similarity(mine.flatten(), ref.flatten(), 0).item()
        assert cos >= 0.99995, (r, modes, cos)
    default = kernels.fp8_modes(dev, 128)
    if default == modes:
        assert torch.equal(run(), got)


def test_triton_kernel_small_tile_fp8_default_matches_dequantised_pages() -> None:
    """e4m3 pages in 32-row query tiles (MHA over 32 queries, regime B's shape at 2 rows, split
    KV): the default way on this GPU (float16 MMAs from SM90 on, widened before) matches
    attention over the dequantised pages (cosine >= 0.99995)."""
    from diffusion_kv.platforms.cuda import kernels

    torch.manual_seed(4)
    dev = torch.device("cuda")
    H, D, page, T, S = 32, 128, 128, 32, 2080
    nblk = -(-S // page)
    perm = torch.randperm(2 * nblk + 1)
    table = perm[: 2 * nblk].view(2, nblk).to(torch.int32).to(dev)
    k_scale = torch.rand(H, device=dev) + 0.25
    v_scale = torch.rand(H, device=dev) + 0.25
    k_cache = torch.randn(2 * nblk + 1, page, H, D, device=dev).to(torch.float8_e4m3fn)
    v_cache = torch.randn(2 * nblk + 1, page, H, D, device=dev).to(torch.float8_e4m3fn)
    q = torch.randn(2 * T, H, D, device=dev, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(
        q, k_cache, v_cache, out, table, torch.tensor([S, S], dtype=torch.int32, device=dev),
        torch.tensor([0, T, 2 * T], dtype=torch.int32, device=dev),
        torch.tensor([0, 1], dtype=torch.int32, device=dev), torch.zeros(2, dtype=torch.int32, device=dev),
        scale=D**-0.5, causal=True, block_m=32, block_n=128, num_splits=2, num_warps=4, num_stages=3,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if torch.cuda.get_device_capability(dev)[0] >= 9:
        assert kernels.fp8_modes(dev, 32) == kernels.SM90_FP8_MODES_SMALL_TILES
    from torch.nn.attention.bias import causal_lower_right

    for r in range(2):
        blocks = table[r].long()
        k = (k_cache[blocks].float() * k_scale[:, None]).reshape(-1, H, D)[:S]
        v = (v_cache[blocks].float() * v_scale[:, None]).reshape(-1, H, D)[:S]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[r * T : (r + 1) * T].float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=causal_lower_right(T, S),
        )[0].transpose(0, 1)  # fmt: skip
        mine = out[r * T : (r + 1) * T].float()
        cos = torch.nn.functional.cosine_similarity(mine.flatten(), ref.flatten(), 0).item()
        assert cos >= 0.99995, (r, cos)


def test_gather_dequant_on_the_gpu_equals_torch_dequantise() -> None:
    """``gather_dequant`` and ``dequant`` on the GPU: exactly ``kv_quant.dequantize`` of the same
    pages (float32 times the head's scale, rounded once to bfloat16), shuffled 128-token pages of
    one half of a combined K/V cache, rows cut inside a page."""
    from diffusion_kv.core.kv_quant import dequantize
    from diffusion_kv.platforms.cuda import kernels

    torch.manual_seed(3)
    dev = torch.device("cuda")
    nb, page, hkv, D = 40, 128, 8, 128
    both = (torch.randn(nb, 2, page, hkv, D, device=dev) * 50).to(torch.float8_e4m3fn)
    cache = both[:, 1]
    scale = torch.rand(hkv, device=dev) + 0.25
    index = torch.randperm(nb, device=dev)[:36]
    rows, keys = 4, 9 * page - 37
    want = dequantize(
        cache.index_select(0, index).view(rows, 9 * page, hkv, D)[:, :keys], scale, torch.bfloat16
    )
    assert torch.equal(kernels.gather_dequant(cache, index, rows, keys, scale, torch.bfloat16), want)
    view = cache[3:9, 5:100]
    assert torch.equal(kernels.dequant(view, scale, torch.bfloat16), dequantize(view, scale, torch.bfloat16))


def test_paged_e4m3_image_regime_takes_gather_sdpa_and_agrees_with_triton() -> None:
    """``cuda:paged`` over e4m3 pages in the image regime (two rows of 1024 queries after a
    512-token prefix, shuffled 128-token pages, per-head scales): the denoise batch takes gather
    + SDPA with the pages dequantised in the gather, equals dense attention over the values the
    pages hold within the kit's bf16 tolerance, and agrees with ``cuda:triton`` over the same
    inputs (cosine >= 0.9995; the Triton way quantises the queries for its fp8 MMAs)."""
    from diffusion_kv.conformance.test_paged_attention import (
        _stored,
        check,
        expected,
        harness,
        make_rows,
        rows_for,
        run,
    )
    from diffusion_kv.core.attention import AttentionMode
    from diffusion_kv.core.kv_quant import FP8_E4M3, FP8_MAX

    platform = get_platform("cuda")
    prefix, target = 512, 1024
    n = prefix + target
    outs: dict[str, torch.Tensor] = {}
    for name in ("paged", "triton"):
        backend = next(b for b in platform.backends if b.name == name)
        h = harness(
            platform, backend, kv_cache_dtype=FP8_E4M3, num_heads=16, num_kv_heads=8, head_size=128,
            dtype=torch.bfloat16, block_size=128, max_model_len=n, layer_names=("layer.0",),
            k_scale=[(4.0 + i) / FP8_MAX for i in range(8)], v_scale=[(5.0 - i / 4) / FP8_MAX for i in range(8)],
        )  # fmt: skip
        h.install("r", [n, n])
        data = make_rows(h, [n, n], seed=7)
        run(h, rows_for("r", [(0, n), (0, n)]), data)  # prefill: every token written
        denoise = rows_for("r", [(prefix, n), (prefix, n)])
        if name == "paged":
            md = h.translator.prepare(denoise).attn_metadata["layer.0"]
            assert md.way.name == "SDPA" and "dequantised" in md.reason, (md.way, md.reason)
        out = run(h, denoise, data)
        check(h, out, expected(h, denoise, _stored(h, data), AttentionMode.CAUSAL))
        outs[name] = out.float()
    cos = torch.nn.functional.cosine_similarity(outs["paged"].flatten(), outs["triton"].flatten(), 0).item()
    assert cos >= 0.9995, cos


def test_demo_selects_cuda_and_agrees_with_dense() -> None:
    proc = _run(["-m", "diffusion_kv.cli", "demo", "--json", "--steps", "4"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["platform"] == "cuda" and result["device"].startswith("cuda")
    assert result["agree"] is True and result["max_abs_diff"] <= result["tolerance"]
    # one-off costs apart: an untimed warm-up of each mode, and the capturing step (2) left out of
    # both runs' whole-run figure
    assert set(result["warmup_ms"]) == {"dense", "paged"}
    assert result["capture_step"] == 2 and result["capture_step_ms"] == result["paged_step_ms"][2]
    dense, paged = result["dense_step_ms"], result["paged_step_ms"]
    assert result["speedup_without_capture"] == pytest.approx(
        (sum(dense) - dense[2]) / (sum(paged) - paged[2])
    )


def test_bench_small_runs_on_cuda_and_paged_agrees() -> None:
    proc = _run(
        ["-m", "diffusion_kv.cli", "bench", "--sizes", "small", "--json", "--min-ms", "2", "--no-progress"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["platform"] == "cuda"
    variants = {v for r in report["attention"] for v in r["paged"]}
    assert {"paged", "triton", "sdpa"} <= variants
    timed = [p for r in report["attention"] for p in r["paged"].values() if "error" not in p]
    assert timed and all(p["agrees"] for p in timed)
    for h in report["host"]:
        assert h["launches"]["gather_slots"] <= 2


def test_cuda_platform_capabilities_are_honest() -> None:
    platform = get_platform("cuda")
    names = [b.name for b in platform.candidate_backends()]
    assert names[-4:] == ["paged", "triton", "sdpa", "cudnn"]
    own = {b.name: b.capabilities for b in platform.candidate_backends()}
    assert own["triton"].head_sizes == frozenset({64, 128}) and 96 in (own["sdpa"].head_sizes or ())
    assert torch.float32 not in platform.capabilities.dtypes
    assert all(own[n].supports_dcp and own[n].supports_ulysses for n in ("paged", "triton", "sdpa"))


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_prepare_and_layer_forward_do_not_synchronise(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's sync debug mode turns any host synchronisation into an error."""
    from diffusion_kv.bench.attention import AttentionCase, build_setup

    monkeypatch.setenv("DIFFUSION_KV_BACKEND", f"cuda:{backend}")
    dev = torch.device("cuda")
    case = AttentionCase(
        "B", rows=4, heads=8, kv_heads=2, head_size=128, prefix=600, target=40, block_size=16, cfg=1
    )
    setup = build_setup(get_platform("cuda"), case, dev, torch.bfloat16)
    translator, executor = setup.runner.translator, setup.runner.executor
    assert translator is not None and executor is not None
    k = torch.randn(4 * 40, 2, 128, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = translator.prepare(setup.denoise_rows)
        with translator.activate(batch):
            out = executor.forward("bench.attn", setup.query, k, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.shape == setup.query.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
def test_a_layer_with_full_attention_spans_does_not_synchronise(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's first layer with ``full_attn_spans`` builds the piecewise plan, whose query
    indices reach the device through pinned memory: no host sync, and the output equals the
    same batch without spans (spans covering every key change nothing on a full layer)."""
    from diffusion_kv.bench.attention import AttentionCase, build_setup
    from diffusion_kv.core.layer_context import AttentionMetadata

    monkeypatch.setenv("DIFFUSION_KV_BACKEND", f"cuda:{backend}")
    dev = torch.device("cuda")
    case = AttentionCase(
        "B", rows=4, heads=8, kv_heads=2, head_size=128, prefix=600, target=40, block_size=16, cfg=1
    )
    setup = build_setup(get_platform("cuda"), case, dev, torch.bfloat16)
    translator, runner = setup.runner.translator, setup.runner
    assert translator is not None
    k = torch.randn(4 * 40, 2, 128, device=dev, dtype=torch.bfloat16)
    spans = AttentionMetadata(full_attn_spans=[[(0, 640)] for _ in range(4)])
    batch = translator.prepare(setup.denoise_rows)
    with translator.activate(batch):
        plain = runner.forward("bench.attn", setup.query, k, k)
    torch.cuda.synchronize()
    batch = translator.prepare(setup.denoise_rows)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with translator.activate(batch):
            out = runner.forward("bench.attn", setup.query, k, k, spans)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(out, plain)


def test_a_metadata_copy_inside_a_graph_capture_is_refused() -> None:
    """``core.transfer.to_device`` inside a CUDA graph capture raises StateError before it
    copies anything (a captured copy would re-read a freed pinned buffer at every replay), and
    the same copy outside a capture still lands its values."""
    from diffusion_kv.core.errors import StateError
    from diffusion_kv.core.transfer import to_device

    host = torch.arange(7, dtype=torch.int32)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    refused = pytest.raises(StateError, match="CUDA graph is being captured")
    with torch.cuda.stream(stream), refused, torch.cuda.graph(graph, stream=stream):
        to_device(host, "cuda")
    torch.cuda.current_stream().wait_stream(stream)
    assert not torch.cuda.is_current_stream_capturing()
    out = to_device(host, "cuda")
    torch.cuda.synchronize()
    assert out.device.type == "cuda" and out.cpu().tolist() == list(range(7))


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
def test_install_and_remove_do_not_synchronise(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installing, growing and removing rows publish tables and counts without a host sync
    (pinned copies), and what the device then reads is exactly what was installed."""
    from diffusion_kv.bench.attention import AttentionCase, build_setup
    from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation

    monkeypatch.setenv("DIFFUSION_KV_BACKEND", f"cuda:{backend}")
    dev = torch.device("cuda")
    case = AttentionCase(
        "B", rows=2, heads=4, kv_heads=4, head_size=128, prefix=64, target=16, block_size=16, cfg=1
    )
    setup = build_setup(get_platform("cuda"), case, dev, torch.bfloat16)
    runner = setup.runner
    seqs = (SequenceAllocation(0, 32, 16, 48, ((1, 0, 2),)), SequenceAllocation(1, 16, 16, 32, ((4, 3),)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.remove("bench")
        runner.install(RequestAllocation("other", 0, seqs))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    registry = runner.registry
    assert registry is not None
    bt = registry.block_tables
    rows = [registry.resolve("other", i, None).row_index for i in (0, 1)]
    kernel = bt.kernel_block_sizes[0] if hasattr(bt, "kernel_block_sizes") else case.block_size
    split = case.block_size // kernel
    tables = bt.gather_block_tables(torch.tensor(rows, device=dev), 2)[0].cpu().tolist()
    want = [[b * split + k for b in ids for k in range(split)] for ids in ([1, 0, 2], [4, 3])]
    assert [t[: len(w)] for t, w in zip(tables, want, strict=True)] == want
    assert [int(bt.num_blocks.gpu[0, r]) for r in rows] == [len(w) for w in want]


@contextlib.contextmanager
def _denoise_step(backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any, list[Any]]]:
    """A two-row tiny-DiT batch on ``cuda:backend`` past its prefill step; yields the runner, the
    active runtime, a denoise ``step(target, t)`` and four target latents."""
    from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
    from diffusion_kv.core.rows import PagedRow, PhaseRows
    from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
    from diffusion_kv.models.demo import DemoConfig, build_model

    monkeypatch.setenv("DIFFUSION_KV_BACKEND", f"cuda:{backend}")
    dev = torch.device("cuda")
    cfg = DemoConfig(
        prefix_len=300, target_len=100, hidden=256, heads=2, kv_heads=2, layers=2, dtype=torch.bfloat16
    )
    model = build_model(cfg, dev)
    runner = PagedWorker(get_platform("cuda"), RunnerConfig(512, 2, 1, 1024, device=dev))
    mc = model.cfg
    runner.register_kv_cache_layers(
        {n: PagedLayerSpec(2, 2, mc.head_size, mc.dtype) for n in model.layer_names}
    )
    runner.initialize_kv_cache(num_blocks=16, block_size=128)
    assert runner.supports_graph_capture
    runner.install(
        RequestAllocation(
            "r",
            0,
            tuple(
                SequenceAllocation(i, 300, 100, 400, ((4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3),))
                for i in range(2)
            ),
        )
    )
    g = torch.Generator(device=dev).manual_seed(0)
    prefixes = torch.randn(2, 300, 256, device=dev, dtype=torch.bfloat16, generator=g)
    targets = [torch.randn(2, 100, 256, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4)]
    phases = PhaseRows(
        tuple(PagedRow("r", 400, 400, 0, sequence_id=i) for i in range(2)),
        tuple(PagedRow("r", 100, 400, 300, sequence_id=i) for i in range(2)),
    )

    def step(target: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model.paged_step(prefixes, target, t, 1, runner.forward)

    with torch.no_grad(), runner.activate(phases) as runtime:
        runtime.ensure_active(0)
        model.paged_step(prefixes, targets[0], 1.0, 0, runner.forward)
        runtime.ensure_active(1)
        yield runner, runtime, step, targets


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
def test_a_captured_step_replays_the_eager_step(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A denoise step captured as a CUDA graph gives the eager step's output on every replay, and
    is refused (not replayed stale) once the active batch changed."""
    from diffusion_kv import StaleBatchError

    with _denoise_step(backend, monkeypatch) as (runner, runtime, step, targets):
        t = torch.full((), 0.5, device="cuda")
        eager = [step(x, t).clone() for x in targets[1:]]
        captured = runner.capture(step, targets[1], t)
        torch.testing.assert_close(captured.warmup_output, eager[0], atol=0, rtol=0)
        for x, ref in zip(targets[1:], eager, strict=True):
            torch.testing.assert_close(captured.replay(x, t), ref, atol=0, rtol=0)
        assert captured.replays == 3
        runtime.ensure_active(0)  # a phase change: another batch is active now
        with pytest.raises(StaleBatchError, match="capture it again"):
            captured.replay(targets[1], t)


def test_an_unreachable_earlier_capture_is_not_destroyed_mid_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier captured step that only a reference cycle keeps alive becomes garbage during a
    new capture: the collector must not destroy its graph while the capture is underway (that
    invalidates the capture), and the new capture replays the eager step."""
    with _denoise_step("sdpa", monkeypatch) as (runner, _, step, targets):
        t = torch.full((), 0.5, device="cuda")
        eager = step(targets[2], t).clone()
        earlier = [runner.capture(step, targets[1], t)]
        calls = 0

        def step_dropping_the_earlier_capture(target: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 2:  # the call under capture (the first is the warm-up)
                cycle: list[Any] = [earlier.pop()]
                cycle.append(cycle)  # only the cycle holds the earlier capture now
                del cycle
                for _ in range(2000):  # enough allocations for the collector to run if enabled
                    _ = [[], {}]
            out: torch.Tensor = step(target, t)
            return out

        thresholds = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
        try:
            captured = runner.capture(step_dropping_the_earlier_capture, targets[1], t)
        finally:
            gc.set_threshold(*thresholds)
        assert calls == 2 and not earlier
        torch.testing.assert_close(captured.replay(targets[2], t), eager, atol=0, rtol=0)
        gc.collect()


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
def test_stream_mixed_batches_agree_and_replay_steady_compositions(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed-phase batches of mixed requests on the GPU agree with each request's dense run; a
    composition that stays steady is captured once and replayed (two requests arriving together
    share their denoise steps), and a changed composition is never replayed stale."""
    from diffusion_kv.models.stream import StreamConfig, run_stream

    monkeypatch.setenv("DIFFUSION_KV_BACKEND", f"cuda:{backend}")
    small = dict(
        prefix_len=256, target_len=64, hidden=256, heads=4, kv_heads=4, layers=2, dtype=torch.bfloat16
    )
    together = run_stream(
        get_platform("cuda"),
        StreamConfig(requests=3, steps=8, arrival_gap=0, pool_fraction=1.0, **small),  # type: ignore[arg-type]
    )
    assert together.agree, together.requests
    s = together.stream
    assert s["graph_captures"] >= 1 and s["graph_replays"] >= 1
    # every step is a whole-step capture, a replay, a per-bucket piecewise replay or eager
    assert s["graph_captures"] + s["graph_replays"] + s["bucket_steps"] + s["eager_steps"] == s["ticks"]
    staggered = run_stream(
        get_platform("cuda"),
        StreamConfig(requests=6, steps=4, arrival_gap=1, pool_fraction=0.6, **small),  # type: ignore[arg-type]
    )
    assert staggered.agree, staggered.requests
    assert staggered.stream["max_running"] > 1


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
def test_stream_with_shared_prefixes_hits_and_agrees(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix caching on the GPU under the stream's graph policy (whole-step captures and
    per-bucket graphs): six requests drawing their prefixes from two; the four that follow the
    first of each prefix hit all 16 prefix blocks of both rows and compute only their targets at
    their first step; every output agrees with the same stream uncached and with dense."""
    from diffusion_kv.models.stream import StreamConfig, run_stream

    monkeypatch.setenv("DIFFUSION_KV_BACKEND", f"cuda:{backend}")
    small = dict(
        prefix_len=256, target_len=64, hidden=256, heads=4, kv_heads=4, layers=2, dtype=torch.bfloat16
    )
    cfg = StreamConfig(
        requests=6, steps=4, arrival_gap=1, pool_fraction=1.0, shared_prefixes=2, block_size=16, **small
    )  # type: ignore[arg-type]
    result = run_stream(get_platform("cuda"), cfg)
    pc = result.prefix_cache
    assert pc is not None and result.agree, result.requests
    assert pc["agrees"], pc
    assert (pc["hit_tokens"], pc["blocks_saved"], pc["evictions"]) == (4 * 2 * 256, 4 * 2 * 16, 0)
    assert (pc["prefill_tokens"], pc["prefill_tokens_uncached"]) == (2 * 2 * 320 + 4 * 2 * 64, 6 * 2 * 320)
    assert pc["peak_blocks_held"] < pc["peak_blocks_held_uncached"]


def test_fp8_kv_cache_demo_and_stream_on_cuda() -> None:
    """fp8_e4m3 pages on the GPU (the Triton writer quantises, the Triton kernel reads them in
    place): the demo under CUDA-graph replay agrees with dense by cosine >= 0.999 with half the
    KV bytes of bf16 pages; the stream (mixed batches, bucket graphs) agrees per request."""
    from diffusion_kv.models.demo import DemoConfig, run_demo
    from diffusion_kv.models.stream import StreamConfig, run_stream

    cfg = DemoConfig(
        prefix_len=512, target_len=128, steps=4, hidden=256, heads=4, kv_heads=2, layers=2,
        dtype=torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn, max_model_len=1024,
    )  # fmt: skip
    fp8 = run_demo(get_platform("cuda"), cfg)
    bf16 = run_demo(get_platform("cuda"), dataclasses.replace(cfg, kv_cache_dtype=None))
    assert fp8.agree and fp8.cosine_similarity >= 0.999, (fp8.cosine_similarity, fp8.max_abs_diff)
    assert fp8.extra["graphs"] and fp8.extra["graph_replays"] >= 1
    assert fp8.kv_bytes_paged * 2 == bf16.kv_bytes_paged and fp8.kv_cache_dtype == "fp8_e4m3"
    small = dict(
        prefix_len=256, target_len=64, hidden=256, heads=4, kv_heads=4, layers=2, dtype=torch.bfloat16
    )
    result = run_stream(
        get_platform("cuda"),
        StreamConfig(requests=6, steps=4, arrival_gap=1, kv_cache_dtype=torch.float8_e4m3fn, **small),  # type: ignore[arg-type]
    )
    assert result.agree and result.min_cosine_similarity >= 0.999, result.requests

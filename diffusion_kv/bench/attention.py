"""Attention benchmark: a platform's paged backends against the best dense torch SDPA backend.

Every case builds the platform's real parts through :class:`PagedWorker` (BlockTables,
metadata builder, backend, caches), installs one request whose blocks are physically shuffled,
writes the whole sequence's K/V with one prefill forward, prepares the denoise rows
(queries = target tokens, full attention over prefix + target) and times the backend's
``forward`` with ``key``/``value`` None (pages only). The dense side gets the same logical
tensors, contiguous, and every SDPA backend that accepts them is timed; the fastest is the
baseline. Paged outputs are checked against the dense output before they are timed.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from diffusion_kv.bench.timing import synchronize, time_device
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.kv_quant import cache_dtype_name
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.interface import Platform

LAYER = "bench.attn"
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclass(frozen=True)
class AttentionCase:
    """One logical shape: ``rows`` rows of ``prefix + target`` keys, queries = target tokens."""

    regime: str
    rows: int
    heads: int
    kv_heads: int
    head_size: int
    prefix: int
    target: int
    block_size: int
    cfg: int
    placement: str = "shuffled"
    """``shuffled``: the blocks are a random permutation of the pool; ``contiguous``: the rows
    lie back to back (what the best-fit pool gives one request)."""

    @property
    def seq_len(self) -> int:
        return self.prefix + self.target

    @property
    def name(self) -> str:
        suffix = "" if self.placement == "shuffled" else f" {self.placement}"
        return (
            f"{self.regime} cfg{self.cfg} rows{self.rows} H{self.heads}/kv{self.kv_heads} bs{self.block_size}"
            + suffix
        )

    def flops(self) -> float:
        return 4.0 * self.rows * self.heads * self.target * self.seq_len * self.head_size

    def min_bytes(self, element_size: int) -> int:
        """Bytes every implementation must move: K and V once, Q read, O written."""
        kv = 2 * self.rows * self.seq_len * self.kv_heads * self.head_size
        qo = 2 * self.rows * self.target * self.heads * self.head_size
        return (kv + qo) * element_size


# Regime shapes at CFG 2 (the reference shapes); CFG 1 halves the rows.
FULL_REGIMES: dict[str, dict[str, int]] = {
    "A": dict(rows_per_branch=1, heads=24, gqa_kv_heads=8, head_size=128, prefix=2048, target=4096),
    "B": dict(rows_per_branch=8, heads=32, gqa_kv_heads=8, head_size=128, prefix=8160, target=32),
}
SMALL_REGIMES: dict[str, dict[str, int]] = {
    "A": dict(rows_per_branch=1, heads=4, gqa_kv_heads=2, head_size=64, prefix=256, target=512),
    "B": dict(rows_per_branch=4, heads=4, gqa_kv_heads=2, head_size=64, prefix=1008, target=16),
}


def attention_cases(
    sizes: str,
    *,
    regimes: Sequence[str] = ("A", "B"),
    block_sizes: Sequence[int] = (128, 16),
    cfgs: Sequence[int] = (1, 2),
    gqa: Sequence[bool] = (False, True),
    contiguous_regimes: Sequence[str] = ("A",),
) -> list[AttentionCase]:
    """Every combination, physically shuffled; the ``contiguous_regimes`` once more with the rows'
    pages back to back (regime A is where a gather costs: compute-bound, gather + SDPA)."""
    table = FULL_REGIMES if sizes == "full" else SMALL_REGIMES
    cases = []
    for regime in regimes:
        if regime not in table:
            raise ValueError(f"unknown regime {regime!r}; expected one of {sorted(table)}")
        r = table[regime]
        for grouped in gqa:
            for block in block_sizes:
                for cfg in cfgs:
                    cases.append(
                        AttentionCase(
                            regime=regime,
                            rows=r["rows_per_branch"] * cfg,
                            heads=r["heads"],
                            kv_heads=r["gqa_kv_heads"] if grouped else r["heads"],
                            head_size=r["head_size"],
                            prefix=r["prefix"],
                            target=r["target"],
                            block_size=block,
                            cfg=cfg,
                        )
                    )
                    if regime in contiguous_regimes:
                        cases.append(dataclasses.replace(cases[-1], placement="contiguous"))
    return cases


def _native_choice(md: Any) -> dict[str, Any]:
    """What a backend's metadata says it chose (the cuda backends' way and launch settings), for
    the report: ``backend`` is the way's name."""
    out: dict[str, Any] = {}
    way = getattr(md, "way", None)
    if way is not None:
        out["backend"] = getattr(way, "value", str(way))
    for attr in ("reason", "num_splits", "block_m", "block_n", "num_stages"):
        if hasattr(md, attr):
            out[attr] = getattr(md, attr)
    return out


def dense_backends(device: torch.device) -> list[tuple[str, Any]]:
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return [
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ]
    return [("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)]


def dense_fn(
    backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool
) -> Callable[[], torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    def run() -> torch.Tensor:
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)

    return run


def copy_bandwidth(device: torch.device) -> float:
    """Achievable device-memory copy bandwidth in GB/s (read + write bytes counted)."""
    n = (512 if device.type == "cuda" else 32) * 1024 * 1024
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_device(lambda: dst.copy_(src), device, min_ms=20.0)
    return 2 * n / (ms * 1e-3) / 1e9


@dataclass
class PagedSetup:
    runner: PagedWorker
    query: torch.Tensor  # packed [rows * target, H, D]
    dense_q: torch.Tensor  # [rows, H, target, D]
    dense_k: torch.Tensor  # [rows, Hkv, seq, D]
    dense_v: torch.Tensor
    denoise_rows: tuple[PagedRow, ...]


def build_setup(
    platform: Platform,
    case: AttentionCase,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    kv_cache_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> PagedSetup:
    S, R = case.seq_len, case.rows
    runner = PagedWorker(
        platform,
        RunnerConfig(
            max_model_len=S,
            max_rows_per_request=R,
            max_num_seqs=1,
            max_num_batched_tokens=R * S,
            device=device,
            kv_cache_dtype=kv_cache_dtype or "auto",
            backend=backend,
        ),
    )
    runner.register_kv_cache_layers(
        {LAYER: PagedLayerSpec(case.heads, case.kv_heads, case.head_size, dtype, mode=AttentionMode.FULL)}
    )
    nblk = cdiv(S, case.block_size)
    num_blocks = R * nblk + 1
    runner.initialize_kv_cache(num_blocks=num_blocks, block_size=case.block_size)
    gen = torch.Generator().manual_seed(seed)
    if case.placement == "contiguous":
        order = list(range(num_blocks))  # rows back to back
    else:
        order = torch.randperm(num_blocks, generator=gen).tolist()  # physically shuffled blocks
    seqs = tuple(
        SequenceAllocation(i, case.prefix, case.target, S, (tuple(order[i * nblk : (i + 1) * nblk]),))
        for i in range(R)
    )
    runner.install(RequestAllocation("bench", 0, seqs))
    dgen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(R, case.target, case.heads, case.head_size, generator=dgen, device=device, dtype=dtype)
    k = torch.randn(R, S, case.kv_heads, case.head_size, generator=dgen, device=device, dtype=dtype)
    v = torch.randn(R, S, case.kv_heads, case.head_size, generator=dgen, device=device, dtype=dtype)
    translator = runner.translator
    assert translator is not None
    # The prefill step writes every token through the executor (the pages become readable).
    prefill = translator.prepare(tuple(PagedRow("bench", S, S, 0, sequence_id=i) for i in range(R)))
    prefill_q = torch.randn(R * S, case.heads, case.head_size, generator=dgen, device=device, dtype=dtype)
    with translator.activate(prefill):
        runner.forward(
            LAYER,
            prefill_q,
            k.reshape(R * S, case.kv_heads, case.head_size),
            v.reshape(R * S, case.kv_heads, case.head_size),
        )
    del prefill, prefill_q
    return PagedSetup(
        runner=runner,
        query=q.reshape(R * case.target, case.heads, case.head_size),
        dense_q=q.transpose(1, 2),
        dense_k=k.transpose(1, 2),
        dense_v=v.transpose(1, 2),
        denoise_rows=tuple(PagedRow("bench", case.target, S, case.prefix, sequence_id=i) for i in range(R)),
    )


def run_case(
    platform: Platform,
    case: AttentionCase,
    device: torch.device,
    dtype: torch.dtype,
    bandwidth_gbs: float | None,
    *,
    min_ms: float = 20.0,
    kv_cache_dtypes: tuple[torch.dtype, ...] = (),
    backend: str | None = None,
) -> dict[str, Any]:
    """Dense SDPA backends, then every paged backend (``backend`` alone, when named) over the
    same K/V; with ``kv_cache_dtypes`` also every backend declaring one of them, its pages quantised (variant ``NAME fp8_e4m3``):
    time, ratio to the same backend's 16-bit pages, and the error against its 16-bit output."""
    setup = build_setup(platform, case, device, dtype)  # the dense side's tensors
    setup.runner.remove(["bench"])
    scale = case.head_size**-0.5
    gqa = case.heads != case.kv_heads
    result: dict[str, Any] = {"case": case.name, "shape": asdict(case), "dense": {}, "paged": {}}
    dense_out: torch.Tensor | None = None
    best: tuple[str, float] | None = None
    groups = case.heads // case.kv_heads
    for label, sdp in dense_backends(device):
        variants = [(label, setup.dense_k, setup.dense_v, gqa)]
        if gqa:  # some SDPA kernels take GQA only with K/V expanded to every query head
            variants.append(
                (
                    f"{label} (kv expanded)",
                    setup.dense_k.repeat_interleave(groups, dim=1),
                    setup.dense_v.repeat_interleave(groups, dim=1),
                    False,
                )
            )
        for name, k, v, flag in variants:
            fn = dense_fn(sdp, setup.dense_q, k, v, scale, flag)
            try:
                out = fn()
                synchronize(device)
            except RuntimeError as exc:
                result["dense"][name] = {"error": str(exc).splitlines()[0][:160]}
                continue
            ms = time_device(fn, device, min_ms=min_ms)
            result["dense"][name] = {"ms": ms, "tflops": case.flops() / ms / 1e9}
            if best is None or ms < best[1]:
                best = (name, ms)
                dense_out = out
            if flag == gqa:
                break  # the native variant worked: no need to time the expanded one
    if best is None or dense_out is None:
        raise RuntimeError(f"{case.name}: no dense SDPA backend accepted the inputs: {result['dense']}")
    result["best_dense"] = {"backend": best[0], "ms": best[1], "tflops": case.flops() / best[1] / 1e9}
    reference = dense_out.transpose(1, 2).reshape_as(setup.query).float()
    out = torch.empty_like(setup.query)
    outputs: dict[str, torch.Tensor] = {}
    peer_source: tuple[PagedSetup, Any, tuple[torch.Tensor, torch.Tensor]] | None = None
    chosen = [b for b in platform.candidate_backends() if backend is None or b.name == backend]
    for candidate in chosen:
        variant = candidate.name
        found = candidate.is_available()
        if not found:
            result["paged"][variant] = {"error": f"unavailable: {found.reason}"}
            continue
        try:  # a worker with this backend forced, over the same data
            paged = build_setup(platform, case, device, dtype, backend=variant)
            translator = paged.runner.translator
            assert translator is not None
            batch = translator.prepare(paged.denoise_rows)
        except Exception as exc:  # a backend that cannot serve the shape is a reported reason
            result["paged"][variant] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            continue
        md = batch.attn_metadata[LAYER]
        instance = paged.runner.backends[0]
        layer = paged.runner.layers[LAYER]
        cache = paged.runner.kv_caches[LAYER]

        def fn(md: Any = md, backend: Any = instance, layer: Any = layer, cache: Any = cache) -> torch.Tensor:
            result: torch.Tensor = backend.forward(layer, paged.query, cache, md, out)  # noqa: B023
            return result

        fn()
        synchronize(device)
        diff = float((out.float() - reference).abs().max())
        outputs[variant] = out.float().clone()
        ms = time_device(fn, device, min_ms=min_ms)
        entry: dict[str, Any] = {
            "ms": ms,
            "tflops": case.flops() / ms / 1e9,
            "ratio_vs_best_dense": ms / best[1],
            "max_abs_diff": diff,
            "agrees": diff <= TOLERANCE.get(dtype, 5e-2),
        }
        entry.update(_native_choice(md))
        if bandwidth_gbs:
            bound_ms = case.min_bytes(dtype.itemsize) / (bandwidth_gbs * 1e9) * 1e3
            entry["ratio_vs_bandwidth_bound"] = ms / bound_ms
        result["paged"][variant] = entry
        pages = _fa_pages(cache)
        if peer_source is None and pages is not None:
            peer_source = (paged, batch, pages)  # the same pages, for the peer below
        else:
            paged.runner.remove(["bench"])
    for cache_dtype in kv_cache_dtypes:
        for candidate in chosen:
            if cache_dtype not in candidate.capabilities.kv_cache_dtypes or not candidate.is_available():
                continue
            variant = f"{candidate.name} {cache_dtype_name(cache_dtype)}"
            try:
                quant = build_setup(
                    platform, case, device, dtype, kv_cache_dtype=cache_dtype, backend=candidate.name
                )
                q_translator = quant.runner.translator
                assert q_translator is not None
                q_batch = q_translator.prepare(quant.denoise_rows)
            except Exception as exc:
                result["paged"][variant] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
                continue
            q_md = q_batch.attn_metadata[LAYER]

            def q_fn(
                md: Any = q_md,
                backend: Any = quant.runner.backends[0],
                layer: Any = quant.runner.layers[LAYER],
                cache: Any = quant.runner.kv_caches[LAYER],
                setup: PagedSetup = quant,
            ) -> torch.Tensor:
                got: torch.Tensor = backend.forward(layer, setup.query, cache, md, out)
                return got

            q_fn()
            synchronize(device)
            got = out.float()
            base = outputs.get(candidate.name, reference)
            err = (got - base).abs()
            cos = float(torch.nn.functional.cosine_similarity(got.flatten(), base.flatten(), dim=0))
            ms = time_device(q_fn, device, min_ms=min_ms)
            same = result["paged"].get(candidate.name, {})
            entry = {
                "ms": ms,
                "tflops": case.flops() / ms / 1e9,
                "ratio_vs_best_dense": ms / best[1],
                "kv_cache_dtype": cache_dtype_name(cache_dtype),
                "max_abs_err_vs_16bit_paged": float(err.max()),
                "mean_abs_err_vs_16bit_paged": float(err.mean()),
                "cosine_vs_16bit_paged": cos,
                "max_abs_diff": float((got - reference).abs().max()),
                "agrees": cos >= 0.999,
            }
            if "ms" in same:
                entry["ratio_vs_16bit_paged"] = ms / same["ms"]
            entry.update(_native_choice(q_md))
            result["paged"][variant] = entry
            quant.runner.remove(["bench"])
    peer = _time_peer(case, peer_source, reference, best[1], device, dtype, min_ms)
    if peer is not None:
        result["peer"] = peer
        if "ms" in peer:
            for entry in result["paged"].values():
                if "ms" in entry:
                    entry["ratio_vs_peer"] = entry["ms"] / peer["ms"]
    if peer_source is not None:
        peer_source[0].runner.remove(["bench"])
    if bandwidth_gbs:
        result["bandwidth_bound_ms"] = case.min_bytes(dtype.itemsize) / (bandwidth_gbs * 1e9) * 1e3
    return result


def _fa_pages(cache: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(key_cache, value_cache)`` as ``[blocks, block_size, Hkv, D]`` when ``cache`` holds them
    that way (what FlashAttention's paged varlen reads), else None."""
    if isinstance(cache, tuple) and len(cache) == 2 and all(c.dim() == 4 for c in cache):
        return cache[0], cache[1]
    if isinstance(cache, torch.Tensor) and cache.dim() == 5 and cache.shape[0] == 2:
        return cache[0], cache[1]
    return None


def _time_peer(
    case: AttentionCase,
    source: tuple[PagedSetup, Any, tuple[torch.Tensor, torch.Tensor]] | None,
    reference: torch.Tensor,
    best_dense_ms: float,
    device: torch.device,
    dtype: torch.dtype,
    min_ms: float,
) -> dict[str, Any] | None:
    """vLLM's FA3 paged varlen on the same pages, when ``vllm.vllm_flash_attn`` is importable."""
    if device.type != "cuda":
        return None
    try:
        fa = importlib.import_module("vllm.vllm_flash_attn")
    except Exception as exc:  # absent, or present but unusable: a reason, not a failure
        return {
            "name": "vllm-fa3",
            "error": f"vllm.vllm_flash_attn not importable: {type(exc).__name__}: {exc}",
        }
    if source is None:
        return {"name": "vllm-fa3", "error": "no backend kept FlashAttention-shaped pages to compare on"}
    setup, batch, (k_cache, v_cache) = source
    common = batch.common
    out = torch.empty_like(setup.query)

    def fn() -> torch.Tensor:
        fa.flash_attn_varlen_func(
            setup.query,
            k_cache,
            v_cache,
            max_seqlen_q=common.max_query_len,
            cu_seqlens_q=common.query_start_loc,
            max_seqlen_k=common.max_seq_len,
            seqused_k=common.seq_lens,
            softmax_scale=case.head_size**-0.5,
            causal=False,
            block_table=common.block_tables[0],
            out=out,
            fa_version=3,
        )
        return out

    try:
        fn()
        synchronize(device)
    except Exception as exc:
        return {"name": "vllm-fa3", "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    diff = float((out.float() - reference).abs().max())
    ms = time_device(fn, device, min_ms=min_ms)
    return {
        "name": "vllm-fa3",
        "ms": ms,
        "tflops": case.flops() / ms / 1e9,
        "ratio_vs_best_dense": ms / best_dense_ms,
        "max_abs_diff": diff,
        "agrees": diff <= TOLERANCE.get(dtype, 5e-2),
    }

"""Tiny-DiT end to end: paged (cached prefix) denoise steps against dense recompute."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from diffusion_kv.core.kv_quant import cache_dtype_name
from diffusion_kv.models.demo import (
    FP8_COSINE_BOUND,
    TOLERANCE,
    DemoConfig,
    build_model,
    cosine,
    max_difference,
    run_dense,
    run_paged,
)
from diffusion_kv.platforms.interface import Platform

FULL = dict(prefix_len=4096, target_len=1024, hidden=1536, heads=12, kv_heads=12, layers=8, steps=8)
SMALL = dict(prefix_len=512, target_len=128, hidden=128, heads=2, kv_heads=2, layers=2, steps=4)


def end_to_end(
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    sizes: str,
    block_size: int | None = None,
    kv_cache_dtypes: tuple[torch.dtype, ...] = (),
    backend: str | None = None,
) -> dict[str, Any]:
    """Dense recompute against paged (graph replay where the plugin captures, and eager); with
    ``kv_cache_dtypes``, the paged run again per quantised cache dtype, its final latent
    compared with the 16-bit paged run's (cosine similarity, max abs difference)."""
    shape = FULL if sizes == "full" else SMALL
    cfg = DemoConfig(
        **shape,  # type: ignore[arg-type]
        cfg_rows=2,
        dtype=dtype,
        block_size=block_size,
        max_model_len=shape["prefix_len"] + shape["target_len"],
        backend=backend,
    )
    model = build_model(cfg, device)
    quiet = lambda _m, _i, _n: None  # noqa: E731
    run_dense(model, cfg, device, quiet)  # warm-up (kernel selection, allocator)
    dense_out, dense_ms = run_dense(model, cfg, device, quiet)
    paged_out, paged_ms, info = run_paged(model, cfg, platform, device, quiet)
    eager_cfg = dataclasses.replace(cfg, graphs=False)
    _, eager_ms, _ = run_paged(model, eager_cfg, platform, device, quiet)
    # Steady state: skip dense step 0 and paged steps 0 (full write), 1 (second prepare) and, with
    # graphs, 2 (the capture).
    dense_step = statistics.median(dense_ms[1:])
    skip = 3 if info["graphs"] else 2
    paged_step = statistics.median(paged_ms[skip:]) if len(paged_ms) > skip else paged_ms[-1]
    eager_step = statistics.median(eager_ms[2:]) if len(eager_ms) > 2 else eager_ms[-1]
    ideal = (cfg.prefix_len + cfg.target_len) / cfg.target_len
    diff = float(max_difference(dense_out, paged_out).item())
    quantized: dict[str, Any] = {}
    for cache_dtype in kv_cache_dtypes:
        name = cache_dtype_name(cache_dtype)
        try:
            q_cfg = dataclasses.replace(cfg, kv_cache_dtype=cache_dtype)
            q_out, q_ms, q_info = run_paged(model, q_cfg, platform, device, quiet)
        except Exception as exc:  # a platform without the cache dtype: its reason, reported
            quantized[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            continue
        q_skip = 3 if q_info["graphs"] else 2
        q_step = statistics.median(q_ms[q_skip:]) if len(q_ms) > q_skip else q_ms[-1]
        cos = cosine(paged_out, q_out)
        quantized[name] = {
            "paged_step_ms": q_step,
            "paged_graphs": q_info["graphs"],
            "speedup": dense_step / q_step,
            "ratio_vs_16bit_paged": q_step / paged_step,
            "kv_bytes_paged": q_info["kv_bytes_paged"],
            "kv_bytes_paged_16bit": info["kv_bytes_paged"],
            "cosine_vs_16bit_paged": cos,
            "max_abs_diff_vs_16bit_paged": float(max_difference(paged_out, q_out).item()),
            "cosine_vs_dense": cosine(dense_out, q_out),
            "cosine_bound": FP8_COSINE_BOUND,
            "agrees": cos >= FP8_COSINE_BOUND,
        }
    return {
        "shape": {**shape, "cfg_rows": cfg.cfg_rows, "block_size": info["block_size"]},
        "dense_step_ms": dense_step,
        "paged_step_ms": paged_step,
        "paged_step0_ms": paged_ms[0],
        "paged_graphs": info["graphs"],
        "paged_eager_step_ms": eager_step,
        "speedup_eager": dense_step / eager_step,
        "speedup": dense_step / paged_step,
        "ideal_speedup": ideal,
        "target_speedup": 0.8 * ideal,
        "meets_target": dense_step / paged_step >= 0.8 * ideal,
        "max_abs_diff": diff,
        "agrees": diff <= TOLERANCE.get(dtype, 1e-1),
        "kv_cache_dtypes": quantized,
    }

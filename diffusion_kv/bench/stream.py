"""Continuous batching: mixed tiny-DiT requests served together against one after another.

The workload is ``diffusion_kv.models.stream`` (the stream demo): ``requests`` of mixed shapes
arriving one scheduler step apart; the baseline is the same requests through the same
scheduler, runner and cache with one request at a time, under the same graph policy: where the
plugin supports CUDA graphs, both runs capture a composition that stays steady and replay it
(the top-level figures, capture time reported apart and left out of the speedup), and both
runs are also measured eager (``eager``). Every request's result is checked against its own
dense run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from diffusion_kv.core.kv_quant import cache_dtype_name
from diffusion_kv.models.stream import StreamConfig, run_stream, serve, setup_stream
from diffusion_kv.platforms.interface import Platform

FULL = dict(
    requests=8, prefix_len=4096, target_len=1024, steps=8, hidden=1536, heads=12, kv_heads=12, layers=8
)
SMALL = dict(requests=6, prefix_len=128, target_len=32, steps=4, hidden=64, heads=2, kv_heads=2, layers=2)
TARGET_SPEEDUP = 2.0
FULL_MIXED_STEP: tuple[tuple[int, int], ...] = (
    ((512, 2560),) * 2
    + ((512, 4608),)
    + ((512, 512),) * 2
    + ((1024, 5120),) * 2
    + ((1024, 1024),)
    + ((1024, 3072),) * 2
    + ((5120, 5120),)
)
"""The ``full`` stream's largest batched step, per row (queries, keys): 11 rows of 6 shapes, 12,800
query tokens (prefill and denoise rows of several requests; what the attention probes time)."""


def bench_config(
    shape: dict[str, int], dtype: torch.dtype, block_size: int | None, backend: str | None = None
) -> StreamConfig:
    """The bench's stream: ``shape``'s requests arriving one step apart, all allowed at once, a
    pool that holds them all."""
    return StreamConfig(
        **shape,  # type: ignore[arg-type]
        dtype=dtype,
        block_size=block_size,
        arrival_gap=1,
        max_running=shape["requests"],
        pool_fraction=1.0,
        backend=backend,
    )


def capacity(
    platform: Platform, cfg: StreamConfig, kv_cache_dtype: torch.dtype, pool_fraction: float = 0.5
) -> dict[str, Any]:
    """The same requests served together from a pool of equal memory (``pool_fraction`` of what
    they need at once in the model's dtype), its pages in the model's dtype and in
    ``kv_cache_dtype``: how many run at once, peak blocks, the pool's bytes (eager, no warm-up:
    what is compared is admission, not speed)."""
    out: dict[str, Any] = {"pool_fraction": pool_fraction}
    for label, cache in (("model_dtype", None), (cache_dtype_name(kv_cache_dtype), kv_cache_dtype)):
        c = dataclasses.replace(
            cfg, pool_fraction=pool_fraction, kv_cache_dtype=cache, graphs=False, warmup=False
        )
        st = setup_stream(platform, c, None)
        run = serve(
            st.model,
            st.runner,
            st.allocator(False),
            st.requests,
            st.inputs,
            c,
            max_running=st.concurrency,
            arrival_gap=0,
            graphs=False,
            label=label,
        )
        out[label] = {
            "pool_blocks": st.pool_blocks,
            "pool_bytes": st.pool_blocks * st.runner.kv_bytes_per_block(),
            "max_running": run.max_running,
            "peak_blocks": run.peak_blocks,
            "ticks": run.ticks,
        }
    first, second = out["model_dtype"], out[cache_dtype_name(kv_cache_dtype)]
    out["concurrency_ratio"] = second["max_running"] / first["max_running"]
    return out


def stream_throughput(
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    sizes: str,
    block_size: int | None = None,
    kv_cache_dtypes: tuple[torch.dtype, ...] = (),
    backend: str | None = None,
) -> dict[str, Any]:
    shape = FULL if sizes == "full" else SMALL
    cfg = bench_config(shape, dtype, block_size, backend)
    result = run_stream(platform, cfg, device=device)
    out = result.as_dict()
    out["shape"] = shape
    out["target_speedup"] = TARGET_SPEEDUP
    out["meets_target"] = result.speedup >= TARGET_SPEEDUP
    if result.stream["graph_captures"] or result.sequential["graph_captures"]:
        eager = run_stream(platform, dataclasses.replace(cfg, graphs=False), device=device)
        out["eager"] = {
            k: eager.as_dict()[k] for k in ("stream", "sequential", "speedup", "agree", "max_abs_diff")
        }
        out["eager"]["meets_target"] = eager.speedup >= TARGET_SPEEDUP
    out["capacity"] = {
        cache_dtype_name(d): capacity(platform, dataclasses.replace(cfg, requests=16, max_running=16), d)
        for d in kv_cache_dtypes
    }
    return out

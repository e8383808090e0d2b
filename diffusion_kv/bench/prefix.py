"""Prefix caching: what a hit saves, and what caching costs when nothing hits.

Three measurements on the tiny DiT (``diffusion_kv.models.stream``), ratios within one run:

* **prefill step**, hit against miss: the same requests (full prefix, full target, two CFG rows,
  one shared prefix) served one at a time for one step each, under the stream's graph policy
  (on CUDA the model's pieces replay per-token-bucket graphs captured in the warm-up, paged
  attention eager; elsewhere eager), once with the prefix cache (every request after the first
  hits) and once without; the medians of the timed steps;
* **shared stream**: ``requests`` sharing one prefix, arriving one scheduler step apart, served
  together with and without the prefix cache at equal pool memory: peak blocks the requests
  hold and throughput (capture time apart), every output checked against the uncached run;
* **no sharing**: the mixed stream workload (every request its own prefix) with the prefix
  cache on and off: the cost of hashing, lookups and sealing when nothing hits.

Both streams are served three times each way, alternating, and each figure is the fastest run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from diffusion_kv.bench.stream import bench_config
from diffusion_kv.core.scheduler import DiffusionScheduler, StepBatch
from diffusion_kv.models.demo import _sync
from diffusion_kv.models.stream import StreamConfig, StreamModel, model_identity, run_stream, setup_stream
from diffusion_kv.platforms.interface import Platform

FULL = dict(
    requests=8, prefix_len=4096, target_len=1024, steps=8, hidden=1536, heads=12, kv_heads=12, layers=8
)
SMALL = dict(requests=6, prefix_len=128, target_len=32, steps=4, hidden=64, heads=2, kv_heads=2, layers=2)
TARGETS = {
    "prefill_hit_vs_miss": 0.35,
    "blocks_held_ratio": 0.3,
    "shared_throughput_ratio": 1.5,
    "no_sharing_slowdown": 1.02,
}


def prefill_step_ms(
    platform: Platform, cfg: StreamConfig, device: torch.device, repeats: int = 2
) -> dict[str, Any]:
    """Median eager prefill step of a miss and of a hit (module docstring)."""
    st = setup_stream(platform, cfg, device)
    model_id = model_identity(cfg)
    one_step = [dataclasses.replace(r, steps=1) for r in st.requests]
    graphs = st.runner.supports_graph_capture if cfg.graphs is None else cfg.graphs
    buckets = st.buckets(graphs)

    def serve(caching: bool) -> list[float]:
        model = StreamModel(st.model, st.runner, st.inputs, cfg.guidance, graphs, buckets)
        times: list[float] = []

        def step(batch: StepBatch) -> None:
            _sync(st.device)
            began = time.perf_counter()
            model(batch)
            _sync(st.device)
            times.append((time.perf_counter() - began) * 1e3)

        allocator = st.allocator(caching)
        with DiffusionScheduler(
            st.runner, allocator, max_running=1, model_id=model_id if caching else None
        ) as scheduler:
            for r in one_step:
                scheduler.submit(r)
            while not scheduler.idle:
                scheduler.step(step)
        return times

    serve(False)  # warm-up: kernels compile, caches allocate
    serve(True)
    miss: list[float] = []
    hit: list[float] = []
    for _ in range(repeats):
        miss.extend(serve(False))
        hit.extend(serve(True)[1:])  # the first request of a run is a miss that publishes
    miss_ms, hit_ms = statistics.median(miss), statistics.median(hit)
    return {
        "graphs": "buckets" if buckets is not None else "eager",
        "miss_ms": miss_ms,
        "hit_ms": hit_ms,
        "ratio": hit_ms / miss_ms,
        "miss_samples": len(miss),
        "hit_samples": len(hit),
        "tokens_miss": 2 * (cfg.prefix_len + cfg.target_len),
        "tokens_hit": 2 * (cfg.prefix_len + cfg.target_len - cfg.prefix_len // st.block * st.block),
    }


def prefix_cache_bench(
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    sizes: str,
    block_size: int | None = None,
    backend: str | None = None,
) -> dict[str, Any]:
    shape = FULL if sizes == "full" else SMALL
    base = dataclasses.replace(bench_config(shape, dtype, block_size, backend), repeats=3)
    shared_cfg = dataclasses.replace(base, shared_prefixes=1)
    prefill = prefill_step_ms(platform, shared_cfg, device)
    shared = run_stream(platform, shared_cfg, device=device)
    mixed = run_stream(platform, dataclasses.replace(base, prefix_caching=True), device=device)
    assert shared.prefix_cache is not None and mixed.prefix_cache is not None
    sp, mp = shared.prefix_cache, mixed.prefix_cache
    slowdown = 1.0 / mp["throughput_ratio"]
    return {
        "shape": shape,
        "block_size": shared.block_size,
        "targets": TARGETS,
        "prefill": prefill,
        "shared": {k: v for k, v in sp.items()} | {"agree_with_dense": shared.agree},
        "no_sharing": {k: v for k, v in mp.items()} | {"slowdown": slowdown, "agree_with_dense": mixed.agree},
        "meets": {
            "prefill_hit_vs_miss": prefill["ratio"] <= TARGETS["prefill_hit_vs_miss"],
            "blocks_held_ratio": sp["blocks_held_ratio"] <= TARGETS["blocks_held_ratio"] + 1e-9,
            "shared_throughput_ratio": sp["throughput_ratio"] >= TARGETS["shared_throughput_ratio"],
            "no_sharing_slowdown": slowdown <= TARGETS["no_sharing_slowdown"],
        },
        "agrees": bool(sp["agrees"] and mp["agrees"] and shared.agree and mixed.agree),
    }


def format_prefix_cache(r: dict[str, Any]) -> list[str]:
    s = r["shape"]
    p, sh, ns = r["prefill"], r["shared"], r["no_sharing"]
    t = r["targets"]
    return [
        f"prefix cache ({s['requests']} requests, prefix {s['prefix_len']} + target {s['target_len']}, CFG 2, "
        f"hidden {s['hidden']}, {s['layers']} layers, block {r['block_size']})",
        f"  prefill step ({p['graphs']}): hit {p['hit_ms']:.3g} ms vs miss {p['miss_ms']:.3g} ms -> {p['ratio']:.2f}x "
        f"(target <= {t['prefill_hit_vs_miss']}x)",
        f"  one shared prefix: blocks held {sh['peak_blocks_held']} vs {sh['peak_blocks_held_uncached']} uncached "
        f"-> {sh['blocks_held_ratio']:.2f}x (target <= {t['blocks_held_ratio']}x); throughput "
        f"{sh['throughput_ratio']:.2f}x uncached (target >= {t['shared_throughput_ratio']}x; query tokens "
        f"{sh['token_ratio']:.2f}x fewer); "
        f"{sh['hit_tokens']} tokens hit, {sh['evictions']} evictions",
        f"  no sharing: {ns['slowdown']:.3f}x the time with caching off (target <= {t['no_sharing_slowdown']}x)",
        "  outputs: " + ("agree with the uncached runs and dense" if r["agrees"] else "DISAGREE"),
    ]


__all__ = ["FULL", "SMALL", "TARGETS", "format_prefix_cache", "prefill_step_ms", "prefix_cache_bench"]

"""Where one eager paged layer's host time goes, split by function (issue 24, item 1).

python benchmarks/profile_eager_layer.py [--sizes full|small] [--steps N] [--json FILE]

At the bench's end-to-end shape (``diffusion_kv.bench.e2e``: prefix 4096 + target 1024, 8
layers, CFG 2, bf16 on CUDA), a paged denoise loop runs eagerly (no CUDA graphs). Over its
steady-state steps (2..) every ``PagedWorker.forward`` call (one paged layer) is timed on the
host, and a cProfile of those calls attributes the package's per-layer time to its functions
(self time, per layer call, in microseconds; torch ops appear as their Python entry points). A
torch-profiler pass counts the kernels and host-side CUDA API calls each layer issues.

Host time here is what the Python thread spends before ``forward`` returns (launches are
asynchronous); the GPU time of the same layer is reported beside it, so the gap says whether
an eager step is host- or GPU-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import statistics
import sys
import time
from typing import Any

import torch

from diffusion_kv.bench.e2e import FULL, SMALL
from diffusion_kv.core.runner import PagedWorker
from diffusion_kv.models.demo import DemoConfig, build_model, run_paged
from diffusion_kv.platforms.selection import get_platform


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="full", choices=("full", "small"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    platform = get_platform()
    device = (
        torch.device(platform.device_for_rank(0))
        if hasattr(platform, "device_for_rank")
        else torch.device("cpu")
    )
    if device.type != "cpu":
        device = torch.empty(0, device=device).device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = FULL if args.sizes == "full" else SMALL
    cfg = DemoConfig(
        **{**shape, "steps": args.steps},
        cfg_rows=2,
        dtype=dtype,
        max_model_len=shape["prefix_len"] + shape["target_len"],
    )  # type: ignore[arg-type]
    if "graphs" in {f.name for f in dataclasses.fields(DemoConfig)}:
        cfg = dataclasses.replace(cfg, graphs=False)  # type: ignore[call-arg]
    model = build_model(cfg, device)
    quiet = lambda _m, _i, _n: None  # noqa: E731
    run_paged(model, cfg, platform, device, quiet)  # warm: kernels compiled, plans cached

    original = PagedWorker.forward
    profiler = cProfile.Profile()
    layer_host: list[float] = []
    state = {"steady": False}

    def timed(self: PagedWorker, *a: Any, **k: Any) -> torch.Tensor:
        if not state["steady"]:
            return original(self, *a, **k)
        profiler.enable()
        t0 = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            layer_host.append(time.perf_counter() - t0)
            profiler.disable()

    def progress(_mode: str, i: int, _n: int) -> None:
        state["steady"] = i >= 2  # the callback runs after step i-1; steps 2.. are steady

    PagedWorker.forward = timed  # type: ignore[method-assign]
    try:
        _, ms, _ = run_paged(model, cfg, platform, device, progress)
    finally:
        PagedWorker.forward = original  # type: ignore[method-assign]
    calls = len(layer_host)
    # an unprofiled pass for the plain per-layer host time (cProfile inflates Python calls)
    plain: list[float] = []

    def plain_timed(self: PagedWorker, *a: Any, **k: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            if state["steady"]:
                plain.append(time.perf_counter() - t0)

    PagedWorker.forward = plain_timed  # type: ignore[method-assign]
    try:
        _, plain_ms, _ = run_paged(model, cfg, platform, device, progress)
    finally:
        PagedWorker.forward = original  # type: ignore[method-assign]

    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{file.split('site-packages/')[-1].split('diffusion_kv/')[-1]}:{line}({func})",
                "calls_per_layer": round(nc / max(calls, 1), 2),
                "self_us_per_layer": round(tt / max(calls, 1) * 1e6, 2),
                "cum_us_per_layer": round(ct / max(calls, 1) * 1e6, 2),
            }
        )
    rows.sort(key=lambda r: -r["self_us_per_layer"])
    kernels_per_layer = None
    gpu_us_per_layer = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run_paged(model, cfg, platform, device, progress)
        kernels = [e for e in prof.events() if str(e.device_type) == "DeviceType.CUDA"]
        n_layers = cfg.layers * cfg.steps
        kernels_per_layer = round(len(kernels) / n_layers, 2)
        gpu_us_per_layer = round(
            sum(getattr(e, "device_time", 0.0) or e.cuda_time for e in kernels) / n_layers, 2
        )
    report = {
        "platform": platform.name,
        "shape": shape,
        "dtype": str(dtype),
        "steady_step_ms": round(statistics.median(plain_ms[2:]), 3),
        "steady_step_ms_profiled": round(statistics.median(ms[2:]), 3),
        "layer_calls_profiled": calls,
        "package_host_us_per_layer": round(statistics.median(plain) * 1e6, 1),
        "package_host_us_per_layer_profiled": round(statistics.median(layer_host) * 1e6, 1),
        "step_kernels_per_layer": kernels_per_layer,
        "step_gpu_us_per_layer": gpu_us_per_layer,
        "top_functions": rows[: args.top],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "top_functions"}, indent=1))
    for r in rows[: args.top]:
        print(f"{r['self_us_per_layer']:8.2f} us  {r['calls_per_layer']:6.2f}x  {r['function']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

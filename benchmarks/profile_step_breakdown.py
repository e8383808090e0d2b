"""Where a steady-state paged denoise step's time goes: the package, the tiny DiT, the GPU.

python benchmarks/profile_step_breakdown.py [--sizes full|small] [--json FILE]

For the bench's end-to-end shape (``diffusion_kv.bench.e2e``), per steady-state paged step
(steps 2.. of a warm run): wall time; host time spent inside ``PagedWorker.forward`` (the
package: layer checks, the write, the attention calls) and the rest of the host time (the tiny
DiT's own Python and launches); and GPU kernel time from the torch profiler. Eager steps, and
CUDA-graph replays where the package offers them. Works against any installed diffusion-kv
version (for before/after comparisons put the older package first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch

from diffusion_kv.bench.e2e import FULL, SMALL
from diffusion_kv.core.runner import PagedWorker
from diffusion_kv.models.demo import DemoConfig, build_model, run_paged
from diffusion_kv.platforms.selection import get_platform


def measure(platform: Any, cfg: DemoConfig, device: torch.device) -> dict[str, Any]:
    model = build_model(cfg, device)
    quiet = lambda _m, _i, _n: None  # noqa: E731
    run_paged(model, cfg, platform, device, quiet)  # warm: kernels compiled, plans cached
    inside = [0.0]
    steady: list[float] = []
    original = PagedWorker.forward

    def timed(self: PagedWorker, *args: Any, **kwargs: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    def progress(_mode: str, i: int, _n: int) -> None:
        if i >= 3:  # steps 3.. (index 2..): steady state
            steady.append(inside[0])
        inside[0] = 0.0

    PagedWorker.forward = timed  # type: ignore[method-assign]
    try:
        _, ms, info = run_paged(model, cfg, platform, device, progress)
    finally:
        PagedWorker.forward = original  # type: ignore[method-assign]
    skip = 3 if info.get("graphs") else 2  # with graphs, step 2 is the capture
    wall = statistics.median(ms[skip:])
    package = statistics.median(steady[skip - 2 :]) * 1e3 if steady[skip - 2 :] else 0.0
    gpu = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        marks: list[int] = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_paged(model, cfg, platform, device, lambda _m, i, _n: marks.append(i))
        kernels = [e for e in prof.events() if str(e.device_type) == "DeviceType.CUDA"]
        total_us = sum(getattr(e, "device_time", 0.0) or e.cuda_time for e in kernels)
        gpu = total_us / 1e3 / cfg.steps  # all steps, step 0's full write included
    return {
        "graphs": bool(info.get("graphs")),
        "steps_ms": [round(x, 3) for x in ms],
        "steady_wall_ms": wall,
        "steady_host_in_package_ms": package,
        "steady_host_elsewhere_ms": max(wall - package, 0.0),
        "gpu_kernel_ms_per_step_avg": gpu,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="full", choices=("full", "small"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    platform = get_platform()
    device = torch.device(platform.device_type if hasattr(platform, "device_type") else platform.device())
    if device.type != "cpu":
        device = torch.empty(0, device=device).device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = FULL if args.sizes == "full" else SMALL
    cfg = DemoConfig(
        **shape, cfg_rows=2, dtype=dtype, max_model_len=shape["prefix_len"] + shape["target_len"]
    )  # type: ignore[arg-type]
    report: dict[str, Any] = {"shape": shape, "dtype": str(dtype), "platform": platform.name}
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    modes = [("eager", False), ("graphs", True)] if "graphs" in fields else [("eager", None)]
    for label, graphs in modes:
        run_cfg = dataclasses.replace(cfg, graphs=graphs) if graphs is not None else cfg  # type: ignore[call-arg]
        try:
            report[label] = measure(platform, run_cfg, device)
        except NotImplementedError as exc:  # e.g. graph capture where no backend supports it
            report[label] = {"unsupported": str(exc)}
        print(label, json.dumps(report[label]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

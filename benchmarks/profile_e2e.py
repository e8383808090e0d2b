"""Profile the bench's tiny-DiT end-to-end run (dense recompute vs paged) with torch.profiler.

python benchmarks/profile_e2e.py [--sizes full|small] [--steady-json PATH]

The last table, "steady steps", is the kernel split of the steps after the paged run's graph
capture (steps 4..N: graph replays on cuda), per step, beside the dense run's same steps: where
the replayed step's GPU time goes against the token-count ideal. ``--steady-json`` writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from diffusion_kv.bench.e2e import FULL, SMALL
from diffusion_kv.models.demo import DemoConfig, build_model, run_dense, run_paged
from diffusion_kv.platforms.selection import get_platform


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="full")
    ap.add_argument("--steady-json", default=None, help="write the steady steps' kernel split here")
    args = ap.parse_args()
    platform = get_platform()
    device = platform.device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = FULL if args.sizes == "full" else SMALL
    cfg = DemoConfig(
        **shape,  # type: ignore[arg-type]
        cfg_rows=2,
        dtype=dtype,
        max_model_len=shape["prefix_len"] + shape["target_len"],
    )
    model = build_model(cfg, device)
    quiet = lambda _m, _i, _n: None  # noqa: E731
    run_dense(model, cfg, device, quiet)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, fn in (
        ("dense", lambda: run_dense(model, cfg, device, quiet)),
        ("paged", lambda: run_paged(model, cfg, platform, device, quiet)),
    ):
        with profile(activities=acts) as prof:
            _, ms, *_ = fn()
        print(f"== {name}: per-step ms {[round(x, 2) for x in ms]}")
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
    import cProfile
    import pstats

    run_paged(model, cfg, platform, device, quiet)  # warm: kernels compiled, graphs cached
    prof2 = cProfile.Profile()

    def steady(mode: str, i: int, n: int) -> None:  # profile steps 3.. only (steady state)
        if i == 2:
            prof2.enable()
        if i == n:
            prof2.disable()

    _, ms, _ = run_paged(model, cfg, platform, device, steady)
    print(f"== paged (warm) per-step ms {[round(x, 2) for x in ms]}; host profile of steps 3..{cfg.steps}:")
    pstats.Stats(prof2).sort_stats("cumulative").print_stats(45)
    if device.type == "cuda" or args.steady_json:
        split = {
            "dense": _steady_kernels(lambda cb: run_dense(model, cfg, device, cb), acts, cfg.steps, device),
            "paged": _steady_kernels(
                lambda cb: run_paged(model, cfg, platform, device, cb), acts, cfg.steps, device
            ),
        }
        for name, res in split.items():
            print(
                f"== steady steps {res['steps']}, {name}: {res['gpu_us_per_step']:.0f} us of kernels a step"
            )
            for cat, us in res["by_category_us_per_step"].items():
                print(f"   {cat:<12} {us:9.1f} us")
            for k in res["top_kernels"]:
                print(f"   {k['us_per_step']:9.1f} us x{k['calls_per_step']:<5g} {k['name'][:90]}")
        if args.steady_json:
            with open(args.steady_json, "w") as f:
                json.dump(
                    {
                        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                        "sizes": args.sizes,
                        "shape": shape,
                        "split": split,
                    },
                    f,
                    indent=1,
                )
    return 0


def _category(name: str) -> str:
    n = name.lower()
    if "memcpy" in n or "memset" in n:
        return "copy"
    if any(k in n for k in ("sdpa", "flash", "attn", "attention", "fmha")):
        return "attention"
    if any(k in n for k in ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas")):
        return "gemm"
    if any(k in n for k in ("_paged", "_prepare", "_write", "triton")):
        return "triton"
    return "other"


def _steady_kernels(
    run: Callable[[Callable[[str, int, int], None]], Any], acts: list[Any], steps: int, device: torch.device
) -> dict[str, Any]:
    """The CUDA kernels of steps 4..steps (after the paged run's capture at step 3), per step
    (on a CPU, every profiled op, nested ones too: a check of the plumbing, not a split)."""
    first = 4
    if steps < first:
        raise SystemExit(f"the steady split needs at least {first} steps; the shape has {steps}")
    cuda = device.type == "cuda"
    kind = "CUDA" if cuda else "CPU"
    prof = profile(activities=acts)

    def window(_mode: str, i: int, n: int) -> None:
        if i == first - 1:
            if cuda:
                torch.cuda.synchronize()
            prof.start()
        if i == n:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()

    run(window)
    count = steps - first + 1
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():  # type: ignore[no-untyped-call]
        if e.device_type.name == kind:
            per_kernel[e.name].append(e.time_range.elapsed_us())
    by_cat: dict[str, float] = defaultdict(float)
    for name, ts in per_kernel.items():
        by_cat[_category(name)] += sum(ts) / count
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "steps": f"{first}..{steps}",
        "gpu_us_per_step": sum(by_cat.values()),
        "by_category_us_per_step": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {"name": name, "us_per_step": sum(ts) / count, "calls_per_step": len(ts) / count}
            for name, ts in top
        ],
    }


if __name__ == "__main__":
    sys.exit(main())

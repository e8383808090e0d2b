"""Profile the bench's tiny-DiT end-to-end run (dense recompute vs paged) with torch.profiler.

python benchmarks/profile_e2e.py [--sizes full|small]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from diffusion_kv.bench.e2e import FULL, SMALL
from diffusion_kv.models.demo import DemoConfig, build_model, run_dense, run_paged
from diffusion_kv.platforms.selection import get_platform


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="full")
    args = ap.parse_args()
    platform = get_platform()
    device = platform.device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = FULL if args.sizes == "full" else SMALL
    cfg = DemoConfig(
        **shape, cfg_rows=2, dtype=dtype, max_model_len=shape["prefix_len"] + shape["target_len"]
    )  # type: ignore[arg-type]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

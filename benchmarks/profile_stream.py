"""Where the stream bench's time goes on a GPU: the batched stream against one after another.

python benchmarks/profile_stream.py [--sizes full|small] [--graphs on|off] [--json FILE]

The bench's stream workload (``diffusion_kv.bench.stream``), warmed up once both ways (buckets
and whole-step graphs captured), then each way served again under the torch profiler: wall
time, host time inside the batch's prepare, the paged attention calls and the model's step
(from a run of its own, without the profiler), GPU kernel time summed, the GPU's busy time (the union of kernel intervals, so the idle
part of the wall is ``wall - busy``), and kernel time by kind (attention kernels, matrix
products, copies and gathers, the rest), with the ten costliest kernels. Tells whether a way is
GPU-bound and which kernels make the difference. Needs a CUDA device for the GPU figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from diffusion_kv.bench.stream import FULL, SMALL, bench_config
from diffusion_kv.models.stream import serve, setup_stream
from diffusion_kv.platforms.selection import get_platform

KINDS = (
    ("attention", ("attn", "attention", "fmha", "flash", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "cublas")),
    ("copy/gather", ("copy", "gather", "index", "cat", "memcpy", "memset", "scatter", "write_kv")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class HostTimers:
    """Host time inside a few functions while a run is served (wrapped, restored after)."""

    TARGETS = (
        ("prepare", "diffusion_kv.core.translate", "Translator", "prepare"),
        ("paged_forward", "diffusion_kv.core.runner", "PagedWorker", "forward"),
        ("model_step", "diffusion_kv.models.stream", "StreamModel", "__call__"),
        ("prepare_graph_capture", "diffusion_kv.platforms.cuda.block_tables", None, "_capture"),
    )

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Any] = []

    def __enter__(self) -> HostTimers:
        import importlib

        for label, module_name, owner_name, attr in self.TARGETS:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            original = getattr(owner, attr)

            def timed(*a: Any, _f: Any = original, _l: str = label, **k: Any) -> Any:
                began = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.ms[_l] += (time.perf_counter() - began) * 1e3
                    self.calls[_l] += 1

            setattr(owner, attr, timed)
            self._undo.append((owner, attr, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def profiled(run: Any) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with HostTimers() as timers:  # a run of its own, without the profiler
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        timed_wall = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - began) * 1e3
    kernels = [e for e in prof.events() if str(e.device_type) == "DeviceType.CUDA"]
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    intervals = []
    for e in kernels:
        us = float(getattr(e, "device_time", 0.0) or e.cuda_time)
        by_kind[kind_of(e.name)] += us
        by_name[e.name] += us
        start = float(e.time_range.start)
        intervals.append((start, start + us))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {
        "host_timed_wall_ms": timed_wall,
        "host_ms": dict(timers.ms),
        "host_calls": dict(timers.calls),
        "wall_ms": wall,
        "run_wall_ms": out.wall_ms,
        "capture_ms": out.capture_ms,
        "kernel_ms": sum(by_kind.values()) / 1e3,
        "busy_ms": busy_us(intervals) / 1e3,
        "kernels": len(kernels),
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(by_kind.items())},
        "top": [{"name": n[:120], "ms": v / 1e3} for n, v in top],
        "steps": {
            "ticks": out.ticks,
            "graph_replays": out.graph_replays,
            "bucket_steps": out.bucket_steps,
            "eager_steps": out.eager_steps,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="full", choices=("full", "small"))
    ap.add_argument("--graphs", default="on", choices=("on", "off"))
    ap.add_argument("--backend", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    platform = get_platform("cuda")
    shape = FULL if args.sizes == "full" else SMALL
    cfg = dataclasses.replace(
        bench_config(shape, torch.bfloat16, None, args.backend), graphs=args.graphs == "on", warmup=False
    )
    st = setup_stream(platform, cfg)
    graphs = bool(cfg.graphs)
    buckets = st.buckets(graphs)

    def go(max_running: int, gap: int) -> Any:
        return serve(
            st.model,
            st.runner,
            st.allocator(False),
            st.requests,
            st.inputs,
            cfg,
            max_running=max_running,
            arrival_gap=gap,
            graphs=graphs,
            label="profile",
            buckets=buckets,
        )

    report: dict[str, Any] = {
        "shape": shape,
        "graphs": graphs,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backends": [b.name for b in st.runner.backends],
    }
    for label, mr, gap in (("stream", st.concurrency, cfg.arrival_gap), ("sequential", 1, 0)):
        go(mr, gap)  # warm: kernels compiled, buckets captured
        go(mr, gap)
        report[label] = profiled(lambda mr=mr, gap=gap: go(mr, gap))
        print(label, json.dumps(report[label]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

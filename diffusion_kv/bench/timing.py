"""Timing helpers: CUDA events on GPUs, ``perf_counter`` elsewhere; medians over repetitions."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_device(
    fn: Callable[[], object], device: torch.device, *, min_ms: float = 20.0, reps: int = 5, warmup: int = 2
) -> float:
    """Median milliseconds per call of ``fn`` (device time on CUDA, wall time elsewhere).

    The number of calls per repetition is chosen so that one repetition lasts about ``min_ms``.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    once_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    iters = max(1, min(1000, int(min_ms / once_ms)))
    samples: list[float] = []
    for _ in range(reps):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def time_host(fn: Callable[[], object], *, iters: int = 200, warmup: int = 20) -> float:
    """Median host microseconds of one call of ``fn`` (no device synchronisation inside)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)

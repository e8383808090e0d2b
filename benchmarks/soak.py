"""Soak: a long stream of one-shot requests through :class:`DiffusionScheduler` on ``cpu``.

Streams ``--requests`` one-shot requests, each carrying a 256 KiB tensor payload (its inputs,
as a host's latents would be: the model reads every Q/K/V of the request from it), through a
scheduler with prefix caching over a small block pool (back-pressure, evictions), and checks
every output against dense attention (``--check-every N`` checks every N-th request only). A
few requests are cancelled while waiting and while running. Reported, per 1,000 requests
served: resident memory (RSS), the tracked Python heap (``tracemalloc``) and the host time of
a step (the scheduler step less the dense check); slopes over the second half of the measured
requests; the pool, prefix cache, worker rows and every per-request map at the end.

Bounded windows fill by design before memory is flat: the worker's tombstones (the row
registry's ``generation_memory``, default 16,384 request ids) and the scheduler's recent
outcomes (``outcome_memory``). ``--warmup`` requests (default: the largest window, so every
window is full) are served first; they are drawn in the plot and listed in the samples but not
measured. ``--generation-memory``/``--outcome-memory`` shrink the windows (the CI's short run:
the warm-up then takes seconds and the measured part checks that nothing else grows).

Exit 1 when a bound is missed (``--max-rss-slope``, ``--max-heap-slope``, ``--max-time-ratio``,
any mismatch, anything left held at the end or a per-request map larger than its bound).

    python benchmarks/soak.py --requests 20000 [--json] [--output FILE] [--plot FILE]
    python benchmarks/soak.py --requests 2000 --generation-memory 256 --outcome-memory 64   # CI
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.allocator import DiffusionKVAllocator, FreeListPool
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.prefix_cache import ContentSpan, PrefixCache
from diffusion_kv.core.registry import DEFAULT_GENERATION_MEMORY
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.scheduler import (
    DEFAULT_OUTCOME_MEMORY,
    DiffusionRequest,
    DiffusionScheduler,
    RequestStatus,
    StepBatch,
    StepReport,
)
from diffusion_kv.platforms.cpu import CpuPlatform

H, HKV, D, BS = 2, 1, 16, 8
LAYERS = ("l0", "l1")
PAYLOAD_FLOATS = 256 * 1024 // 4  # a 256 KiB float32 tensor per request
PER_TOKEN = H * D + 2 * HKV * D  # q, k, v of one token in one layer
MAX_STEPS = 3
MAX_SEQ = 48
PREFIXES = 4  # distinct shared prefixes
SCALE = D**-0.5
ATOL = RTOL = 2e-5  # float32 against the float64 oracle


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; else the peak from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (nan with fewer than two points)."""
    if len(xs) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else math.nan


def request_shape(i: int) -> dict[str, Any]:
    """Request ``i``'s deterministic mix of shapes: with a shared prefix (cached), with a
    private prefix (never cached) or none; one or two CFG rows; 2 or 3 steps."""
    kind = i % 5
    prefix = (0, 16, 32, 32, 16)[kind]
    shared = kind in (2, 3, 4)
    return dict(
        prefix_len=prefix,
        target_len=(8, 16)[i % 2],
        steps=2 + (i % 3 == 0),
        cfg_rows=1 + (i % 4 == 1),
        pid=(i // 5) % PREFIXES if shared else None,
    )


class SoakModel:
    """Runs every paged layer on a step batch with Q/K/V read from each request's payload (a
    shared prefix's K/V from its prefix table, so every request naming it writes the same
    values), and checks each checked request's rows against dense attention over the row."""

    def __init__(self, runner: PagedWorker, check_every: int, seed: int) -> None:
        self.runner = runner
        self.check_every = check_every
        gen = torch.Generator().manual_seed(seed)
        # per shared prefix, per layer: K/V of its MAX_SEQ positions
        self.prefix_kv = torch.randn(PREFIXES, len(LAYERS), MAX_SEQ, 2 * HKV * D, generator=gen)
        self.mismatches = 0
        self.checked_rows = 0
        self.check_s = 0.0  # CPU time spent in the dense check (not the scheduler's)
        self.max_error = 0.0

    @staticmethod
    def _pid(req: DiffusionRequest) -> int | None:
        if not req.prefix_content:
            return None
        key = req.prefix_content[0][0].key
        return int(str(key).rsplit("-", 1)[1])

    def _inputs(self, req: DiffusionRequest, step: int, layer: int, row: int) -> torch.Tensor:
        """``[MAX_SEQ, PER_TOKEN]`` (q | k | v) of one row at one step and layer, from the payload."""
        payload: torch.Tensor = req.payload
        base = ((step * len(LAYERS) + layer) * 2 + row) * MAX_SEQ * PER_TOKEN
        return payload[base : base + MAX_SEQ * PER_TOKEN].view(MAX_SEQ, PER_TOKEN)

    def _row_kv(self, req: DiffusionRequest, step: int, layer: int, row: int) -> torch.Tensor:
        """``[seq_len, 2*HKV*D]``: the K/V the row holds at ``step`` (prefix from step 0 or the
        shared prefix table; target from this step)."""
        pid = self._pid(req)
        p, s = req.prefix_len, req.seq_len
        target = self._inputs(req, step, layer, row)[p:s, H * D :]
        if pid is not None:
            prefix = self.prefix_kv[pid, layer, :p]
        else:
            prefix = self._inputs(req, 0, layer, row)[:p, H * D :]
        return torch.cat([prefix, target])

    def __call__(self, batch: StepBatch) -> None:
        n = batch.num_tokens
        meta = AttentionMetadata(full_attn_spans=batch.full_attn_spans)
        for li, layer in enumerate(LAYERS):
            q = torch.empty(n, H, D)
            kv = torch.empty(n, 2 * HKV * D)
            for e in batch.entries:
                offset = e.token_offset
                for r, row in enumerate(e.rows):
                    lo, hi = row.kv_start_pos, row.seq_len
                    q[offset : offset + hi - lo] = self._inputs(e.request, e.step, li, r)[
                        lo:hi, : H * D
                    ].view(-1, H, D)
                    kv[offset : offset + hi - lo] = self._row_kv(e.request, e.step, li, r)[lo:hi]
                    offset += hi - lo
            k = kv[:, : HKV * D].reshape(n, HKV, D)
            v = kv[:, HKV * D :].reshape(n, HKV, D)
            out = self.runner.forward(layer, q, k, v, meta)
            t0 = time.thread_time()
            row_index = 0
            for e in batch.entries:
                number = int(e.request.request_id.rsplit("-", 1)[1])
                if number % self.check_every:
                    row_index += len(e.rows)
                    continue
                offset = e.token_offset
                for r, row in enumerate(e.rows):
                    lo, hi = row.kv_start_pos, row.seq_len
                    full = self._row_kv(e.request, e.step, li, r)
                    mask = row_mask(
                        AttentionMode.PIECEWISE, lo, hi - lo, hi, batch.full_attn_spans[row_index + r]
                    )
                    ref = dense_attention(
                        q[offset : offset + hi - lo],
                        full[:, : HKV * D].reshape(-1, HKV, D),
                        full[:, HKV * D :].reshape(-1, HKV, D),
                        mask,
                        SCALE,
                    )
                    got = out[offset : offset + hi - lo].to(torch.float64)
                    error = float((got - ref).abs().max())
                    self.max_error = max(self.max_error, error)
                    if not torch.allclose(got, ref, atol=ATOL, rtol=RTOL):
                        self.mismatches += 1
                    self.checked_rows += 1
                    offset += hi - lo
                row_index += len(e.rows)
            self.check_s += time.thread_time() - t0


@dataclass
class Soak:
    """Everything one run measured (the JSON output)."""

    config: dict[str, Any]
    samples: list[dict[str, float]] = field(default_factory=list)
    bins: list[dict[str, float]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    end_state: dict[str, Any] = field(default_factory=dict)
    bounds: dict[str, Any] = field(default_factory=dict)


def build(args: argparse.Namespace) -> tuple[PagedWorker, DiffusionKVAllocator]:
    runner = PagedWorker(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=MAX_SEQ, max_rows_per_request=2, max_num_seqs=16, max_num_batched_tokens=512
        ),
    )
    runner.register_kv_cache_layers({n: PagedLayerSpec(H, HKV, D, torch.float32) for n in LAYERS})
    runner.initialize_kv_cache(num_blocks=args.pool_blocks, block_size=BS)
    assert runner.layout is not None and runner.registry is not None
    runner.registry.generation_memory = args.generation_memory
    allocator = DiffusionKVAllocator(
        block_size=BS,
        max_model_len=MAX_SEQ,
        max_rows_per_request=2,
        worker_rows=runner.layout.max_num_reqs,
        pool=FreeListPool(args.pool_blocks),
        num_groups=len(runner.layout.groups),
        prefix_cache=PrefixCache(args.max_cached_blocks),
    )
    return runner, allocator


def soak(args: argparse.Namespace, log: Any) -> Soak:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    runner, allocator = build(args)
    model = SoakModel(runner, args.check_every, args.seed)
    warmup = args.warmup
    total = warmup + args.requests
    result = Soak(
        config={
            "requests": args.requests,
            "warmup": warmup,
            "payload_bytes": PAYLOAD_FLOATS * 4,
            "pool_blocks": args.pool_blocks,
            "max_cached_blocks": args.max_cached_blocks,
            "block_size": BS,
            "layers": len(LAYERS),
            "heads": [H, HKV, D],
            "max_running": args.max_running,
            "generation_memory": args.generation_memory,
            "outcome_memory": args.outcome_memory,
            "check_every": args.check_every,
            "cancel_every": args.cancel_every,
            "heap": "tracemalloc" if args.heap else "off",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        }
    )
    # per step: requests served after it and its host seconds, in arrays sized up front (a step
    # advances at least one request by a step), so the soak's own log does not grow the heap
    cap = total * MAX_STEPS + 16
    step_served = array.array("q", bytes(8 * cap))
    step_host = array.array("d", bytes(8 * cap))
    logged = 0
    if args.heap:
        tracemalloc.start(1)
    sched = DiffusionScheduler(
        runner, allocator, max_running=args.max_running, model_id="soak@1", outcome_memory=args.outcome_memory
    )
    submitted = served = 0
    counts = {s.value: 0 for s in RequestStatus if s.terminal}
    cancel_running: set[str] = set()
    next_sample = 0
    t_start = time.perf_counter()

    def sample() -> None:
        gc.collect()
        heap = tracemalloc.get_traced_memory()[0] if args.heap else 0
        result.samples.append(
            {
                "served": served,
                "measured": max(0, served - warmup),
                "rss_mib": rss_bytes() / 2**20,
                "heap_mib": heap / 2**20,
                "elapsed_s": time.perf_counter() - t_start,
            }
        )

    def take(report: StepReport) -> None:
        nonlocal served
        for rec in report.outcomes:
            counts[rec.status.value] += 1
            served += 1
            cancel_running.discard(rec.request.request_id)
            if rec.status is RequestStatus.FAILED:
                raise RuntimeError(f"request {rec.request.request_id!r} failed: {rec.error}")

    sample()
    while served < total:
        # keep a short queue in front of the scheduler (a server's arrivals)
        while submitted < total and len(sched.waiting) < args.max_running:
            shape = request_shape(submitted)
            pid = shape.pop("pid")
            rid = f"soak-{submitted:07d}"
            content: tuple[tuple[ContentSpan, ...], ...] = ()
            if pid is not None:
                content = tuple(
                    (ContentSpan(0, shape["prefix_len"], f"prefix-{pid}"),) for _ in range(shape["cfg_rows"])
                )
            sched.submit(
                DiffusionRequest(rid, **shape, payload=torch.randn(PAYLOAD_FLOATS), prefix_content=content)
            )
            if args.cancel_every and submitted % args.cancel_every == args.cancel_every // 2:
                sched.cancel(rid)  # cancelled while waiting
            elif args.cancel_every and submitted % args.cancel_every == 1:
                cancel_running.add(rid)  # cancelled once it runs, between steps
            submitted += 1
        for rid in [r for r in cancel_running if r in sched.running]:
            sched.cancel(rid)
        check_before = model.check_s
        t0 = time.thread_time()
        report = sched.step(model)
        host = time.thread_time() - t0 - (model.check_s - check_before)
        if report is None:
            raise RuntimeError(f"nothing ran with {len(sched.waiting)} requests waiting")
        take(report)
        if report.rows:
            step_served[logged], step_host[logged] = served, host
            logged += 1
        if served >= next_sample:
            sample()
            next_sample = served + args.sample_every
            if log is not None and len(result.samples) % 10 == 0:
                s = result.samples[-1]
                print(
                    f"[soak] {served:>7}/{total} served, rss {s['rss_mib']:.1f} MiB, heap {s['heap_mib']:.2f} MiB, "
                    f"{s['elapsed_s']:.0f} s",
                    file=log,
                    flush=True,
                )
    sched.close()
    for rec in sched.drain_outcomes():  # nothing is left to end; counted if something were
        counts[rec.status.value] += 1
    sample()
    wall = time.perf_counter() - t_start
    if args.heap:
        tracemalloc.stop()

    # per 1,000 requests served (measured part): memory at the bin's end, median host time per step
    step_log = list(zip(step_served[:logged], step_host[:logged], strict=True))
    measured_steps = [(s - warmup, t) for s, t in step_log if s > warmup]
    for lo in range(0, args.requests, 1000):
        hi = min(lo + 1000, args.requests)
        times = [t for s, t in measured_steps if lo < s <= hi]
        at = [x for x in result.samples if x["measured"] <= hi and x["served"] >= warmup]
        result.bins.append(
            {
                "requests": hi,
                "steps": len(times),
                "step_ms_median": statistics.median(times) * 1e3 if times else math.nan,
                "step_ms_mean": statistics.fmean(times) * 1e3 if times else math.nan,
                "rss_mib": at[-1]["rss_mib"] if at else math.nan,
                "heap_mib": at[-1]["heap_mib"] if at else math.nan,
            }
        )
    half = [x for x in result.samples if x["served"] >= warmup + args.requests / 2]
    xs = [x["measured"] / 1000 for x in half]
    tenth = args.requests / 10
    first = [t for s, t in measured_steps if s <= tenth]
    last = [t for s, t in measured_steps if s > args.requests - tenth]
    ratio = statistics.median(last) / statistics.median(first) if first and last else math.nan
    result.summary = {
        "wall_s": wall,
        "served": served,
        "outcomes": counts,
        "steps": len(step_log),
        "rss_slope_mib_per_1000": slope(xs, [x["rss_mib"] for x in half]),
        "heap_slope_mib_per_1000": slope(xs, [x["heap_mib"] for x in half]) if args.heap else None,
        "step_ms_first_tenth": statistics.median(first) * 1e3 if first else math.nan,
        "step_ms_last_tenth": statistics.median(last) * 1e3 if last else math.nan,
        "step_time_ratio_last_over_first": ratio,
        "host_ms_per_request": sum(t for _, t in measured_steps) * 1e3 / max(1, args.requests),
        "mismatches": model.mismatches,
        "checked_rows": model.checked_rows,
        "max_abs_error": model.max_error,
        "rss_mib_end": result.samples[-1]["rss_mib"],
        "heap_mib_end": result.samples[-1]["heap_mib"],
    }
    cache = allocator.prefix_cache
    registry = runner.registry
    assert cache is not None and registry is not None
    pool = allocator.pool
    result.end_state = {
        "pool_blocks": pool.num_total,
        "pool_used_blocks": pool.num_total - pool.num_free,
        "prefix_cache": cache.stats(),
        "allocator_reserved": len(allocator.reserved()),
        "worker_installed_requests": len(registry.installed_requests()),
        "worker_rows_in_use": registry.capacity - len(registry.free_rows),
        "maps": {
            "scheduler.live": len(sched._live),
            "scheduler.recent_outcomes": len(sched._recent),
            "scheduler.pending_outcomes": sched.pending_outcomes,
            "scheduler.cached_hits": len(sched._cached),
            "scheduler.prefix_keys": len(sched._keys),
            "scheduler.quarantined": len(sched.quarantined),
            "allocator.reserved": len(allocator._reserved),
            "prefix_cache.entries": len(cache),
            "registry.states": len(registry._states),
            "registry.rows": len(registry._rows),
            "registry.written": len(registry._written),
            "registry.bindings": len(registry._bindings),
            "registry.tombstones": len(registry._removed),
        },
        "map_bounds": {
            "scheduler.recent_outcomes": args.outcome_memory,
            "registry.tombstones": args.generation_memory,
            "prefix_cache.entries": args.pool_blocks,
        },
    }
    s, e = result.summary, result.end_state
    cached = cache.stats()["cached_blocks"]
    checks = {
        "rss_slope": (s["rss_slope_mib_per_1000"], args.max_rss_slope),
        "time_ratio": (s["step_time_ratio_last_over_first"], args.max_time_ratio),
    }
    if args.heap:
        checks["heap_slope"] = (s["heap_slope_mib_per_1000"], args.max_heap_slope)
    missed = [
        f"{name} {value:.4g} > {limit}" for name, (value, limit) in checks.items() if not value <= limit
    ]
    if s["mismatches"]:
        missed.append(f"{s['mismatches']} rows disagree with dense attention")
    if s["checked_rows"] == 0:
        missed.append("no row was checked against dense attention")
    if served != total or counts["failed"]:
        missed.append(f"{served} of {total} requests ended, {counts['failed']} failed")
    if e["pool_used_blocks"] != cached or cache.num_idle != cached:
        missed.append(
            f"the pool holds {e['pool_used_blocks']} blocks at the end, the prefix cache {cached} "
            f"({cache.num_idle} idle): something still holds blocks"
        )
    if e["allocator_reserved"] or e["worker_installed_requests"] or e["worker_rows_in_use"]:
        missed.append(f"requests still reserved or installed at the end: {e}")
    live_maps = (
        *("scheduler.live", "scheduler.pending_outcomes", "scheduler.cached_hits", "scheduler.prefix_keys"),
        *("allocator.reserved", "registry.states", "registry.rows", "registry.written", "registry.bindings"),
    )
    for name in live_maps:
        if e["maps"][name]:
            missed.append(f"{name} holds {e['maps'][name]} entries after every request ended")
    for name, limit in e["map_bounds"].items():
        if e["maps"][name] > limit:
            missed.append(f"{name} holds {e['maps'][name]} entries; its bound is {limit}")
    result.bounds = {
        "max_rss_slope_mib_per_1000": args.max_rss_slope,
        "max_heap_slope_mib_per_1000": args.max_heap_slope if args.heap else None,
        "max_time_ratio": args.max_time_ratio,
        "missed": missed,
        "ok": not missed,
    }
    return result


def plot(result: Soak, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"soak: --plot needs matplotlib ({exc}); pip install matplotlib") from None
    fig, (mem, step) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    served = [s["served"] for s in result.samples]
    mem.plot(served, [s["rss_mib"] for s in result.samples], label="RSS (MiB)")
    mem.set_ylabel("RSS (MiB)")
    if result.config["heap"] != "off":
        heap_axis = mem.twinx()
        heap_axis.plot(served, [s["heap_mib"] for s in result.samples], color="tab:orange", label="heap")
        heap_axis.set_ylabel("tracked heap (MiB)", color="tab:orange")
    warmup = result.config["warmup"]
    for axis in (mem, step):
        if warmup:
            axis.axvline(warmup, color="grey", linestyle=":", label="end of warm-up")
    bins = result.bins
    step.plot(
        [warmup + b["requests"] for b in bins],
        [b["step_ms_median"] for b in bins],
        marker="o",
        label="median",
    )
    step.set_ylabel("host time per step (ms)")
    step.set_xlabel("requests served")
    mem.set_title(
        f"soak: {result.config['requests']} one-shot requests, {result.config['payload_bytes'] // 1024} KiB payloads"
    )
    mem.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000, help="measured requests (default 20000)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests served before measuring (default: the largest window)",
    )
    p.add_argument("--generation-memory", type=int, default=DEFAULT_GENERATION_MEMORY)
    p.add_argument("--outcome-memory", type=int, default=DEFAULT_OUTCOME_MEMORY)
    p.add_argument("--pool-blocks", type=int, default=128)
    p.add_argument("--max-cached-blocks", type=int, default=16)
    p.add_argument("--max-running", type=int, default=12)
    p.add_argument(
        "--check-every", type=int, default=1, help="check every N-th request against dense (1: all)"
    )
    p.add_argument("--cancel-every", type=int, default=50, help="cancel 2 in every N requests (0: none)")
    p.add_argument("--sample-every", type=int, default=500, help="memory sample interval in requests")
    p.add_argument(
        "--no-heap", dest="heap", action="store_false", help="no tracemalloc (faster; no heap slope)"
    )
    p.add_argument("--max-rss-slope", type=float, default=0.5, help="MiB per 1000 requests")
    p.add_argument("--max-heap-slope", type=float, default=0.05, help="MiB per 1000 requests")
    p.add_argument("--max-time-ratio", type=float, default=1.1, help="host time per step, last tenth / first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--output", help="also write the JSON result to this file")
    p.add_argument("--plot", help="draw memory and step time against requests served (matplotlib)")
    args = p.parse_args(argv)
    for name in ("requests", "pool_blocks", "max_running", "check_every", "sample_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    for name in ("generation_memory", "outcome_memory", "cancel_every", "max_cached_blocks"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(args, name)}")
    if args.warmup is None:
        args.warmup = max(args.generation_memory, args.outcome_memory)
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0; got {args.warmup}")
    result = soak(args, None if args.json else sys.stderr)
    out = {
        "config": result.config,
        "summary": result.summary,
        "end_state": result.end_state,
        "bounds": result.bounds,
        "bins": result.bins,
        "samples": result.samples,
    }
    text = json.dumps(out, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(text)
    else:
        s, e = result.summary, result.end_state
        print(
            f"soak: {args.requests} requests measured after {args.warmup} warm-up, {s['wall_s']:.0f} s wall\n"
            f"  outcomes {s['outcomes']}, {s['checked_rows']} rows checked against dense, "
            f"{s['mismatches']} mismatches (max |err| {s['max_abs_error']:.2e})\n"
            f"  RSS slope {s['rss_slope_mib_per_1000']:.3f} MiB/1000 (end {s['rss_mib_end']:.1f} MiB), heap slope "
            + (f"{s['heap_slope_mib_per_1000']:.4f}" if s["heap_slope_mib_per_1000"] is not None else "n/a")
            + f" MiB/1000 (end {s['heap_mib_end']:.2f} MiB)\n"
            f"  host time per step: first tenth {s['step_ms_first_tenth']:.3f} ms, last tenth "
            f"{s['step_ms_last_tenth']:.3f} ms (ratio {s['step_time_ratio_last_over_first']:.3f}); "
            f"{s['host_ms_per_request']:.3f} ms per request\n"
            f"  end: pool {e['pool_used_blocks']}/{e['pool_blocks']} used, prefix cache {e['prefix_cache']}, "
            f"maps {e['maps']}"
        )
        for line in result.bounds["missed"]:
            print(f"  MISSED: {line}")
    return 0 if result.bounds["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

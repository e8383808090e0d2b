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

The session soak (``--sessions N``) opens and closes N sessions (:class:`SessionCache` on
``cpu``) of ``--chunks`` chunks or one more, ``--open`` at a time over a pool of exactly their
bound (chunk-causal, a window of 2 chunks and a sink of 1, so every session's window slides),
each carrying a 256 KiB payload (its conditioning, from which every chunk's Q/K/V are read)
that leaves with it. A tick appends a chunk to every open session and denoises them together
in ``--steps`` steps; one in ``--abort-every`` chunks is aborted after its first step (and
redone with other values), one in ``--fail-every`` ticks has a failing forward (every chunk of
the tick aborted), one in ``--mid-stream-every`` sessions ends with a chunk open. Every
``--check-every``-th session is checked against dense attention over the keys the mask shows,
at every chunk, step, layer and branch. Reported as above, per 1,000 sessions (host time per
denoise step of a tick that ran every open session, less the checks), with the size of every per-session map at each
sample and at the end (the session cache, the allocator and pool, the registry's states,
rows, provenance, bindings, block holders and tombstones, the translator's active batch).
The warm-up (``--warmup``, default ``--generation-memory``) is one-chunk sessions, unchecked,
that fill the tombstone window.

    python benchmarks/soak.py --sessions 2000 --chunks 20 --generation-memory 2048 --open 16
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
from diffusion_kv.core.sessions import Chunk, Session, SessionCache, SessionPolicy
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

    step_log = list(zip(step_served[:logged], step_host[:logged], strict=True))
    result.bins, result.summary = summarize(
        result.samples, step_log, warmup, args.requests, "requests", args.heap
    )
    result.summary = {
        "wall_s": wall,
        "served": served,
        "outcomes": counts,
        **result.summary,
        "mismatches": model.mismatches,
        "checked_rows": model.checked_rows,
        "max_abs_error": model.max_error,
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
    missed = check_bounds(args, s)
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
    result.bounds = bounds_of(args, missed)
    return result


def summarize(
    samples: list[dict[str, float]],
    step_log: list[tuple[int, float]],
    warmup: int,
    measured: int,
    unit: str,
    heap: bool,
) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Per 1,000 ``unit`` served (the measured part): memory at the bin's end and the median
    host time per step; slopes over the second half; the step time's last tenth over its first.
    ``step_log``: (served after the step, its host seconds) per step."""
    bins: list[dict[str, float]] = []
    measured_steps = [(s - warmup, t) for s, t in step_log if s > warmup]
    for lo in range(0, measured, 1000):
        hi = min(lo + 1000, measured)
        times = [t for s, t in measured_steps if lo < s <= hi]
        at = [x for x in samples if x["measured"] <= hi and x["served"] >= warmup]
        bins.append(
            {
                unit: hi,
                "steps": len(times),
                "step_ms_median": statistics.median(times) * 1e3 if times else math.nan,
                "step_ms_mean": statistics.fmean(times) * 1e3 if times else math.nan,
                "rss_mib": at[-1]["rss_mib"] if at else math.nan,
                "heap_mib": at[-1]["heap_mib"] if at else math.nan,
            }
        )
    # a sample taken while the last ones drain (nothing new admitted: fewer open) is not a slope's
    half = [x for x in samples if x["served"] >= warmup + measured / 2 and not x.get("draining")]
    xs = [x["measured"] / 1000 for x in half]
    tenth = measured / 10
    first = [t for s, t in measured_steps if s <= tenth]
    last = [t for s, t in measured_steps if s > measured - tenth]
    ratio = statistics.median(last) / statistics.median(first) if first and last else math.nan
    summary = {
        "steps": len(step_log),
        "rss_slope_mib_per_1000": slope(xs, [x["rss_mib"] for x in half]),
        "heap_slope_mib_per_1000": slope(xs, [x["heap_mib"] for x in half]) if heap else None,
        "step_ms_first_tenth": statistics.median(first) * 1e3 if first else math.nan,
        "step_ms_last_tenth": statistics.median(last) * 1e3 if last else math.nan,
        "step_time_ratio_last_over_first": ratio,
        f"host_ms_per_{unit.rstrip('s')}": sum(t for _, t in measured_steps) * 1e3 / max(1, measured),
        "rss_mib_end": samples[-1]["rss_mib"],
        "heap_mib_end": samples[-1]["heap_mib"],
    }
    return bins, summary


def check_bounds(args: argparse.Namespace, summary: dict[str, Any]) -> list[str]:
    """The slope and step-time bounds a run missed."""
    checks = {
        "rss_slope": (summary["rss_slope_mib_per_1000"], args.max_rss_slope),
        "time_ratio": (summary["step_time_ratio_last_over_first"], args.max_time_ratio),
    }
    if args.heap:
        checks["heap_slope"] = (summary["heap_slope_mib_per_1000"], args.max_heap_slope)
    return [f"{name} {value:.4g} > {limit}" for name, (value, limit) in checks.items() if not value <= limit]


def bounds_of(args: argparse.Namespace, missed: list[str]) -> dict[str, Any]:
    return {
        "max_rss_slope_mib_per_1000": args.max_rss_slope,
        "max_heap_slope_mib_per_1000": args.max_heap_slope if args.heap else None,
        "max_time_ratio": args.max_time_ratio,
        "missed": missed,
        "ok": not missed,
    }


# -- the session soak ---------------------------------------------------------------------------

SESSION_BS = 4  # a chunk of 6 tokens straddles blocks
CHUNK_TOKENS = 6
WINDOW_CHUNKS = 2
SINK_CHUNKS = 1
CHUNK_FLOATS = CHUNK_TOKENS * PER_TOKEN  # q | k | v of one chunk in one layer, one branch
PAYLOAD_STRIDE = 389  # a prime above CHUNK_FLOATS, coprime with the payload's usable length


class InjectedFailure(RuntimeError):
    """The failing forward the session soak injects now and then."""


@dataclass
class HostSession:
    """The soak's host-side view of one open session: its conditioning (the 256 KiB payload
    every chunk's Q/K/V are read from), how many chunks it runs, and which attempt each chunk
    redone after an abort committed (only chunks that were redone are listed)."""

    session: Session
    number: int
    payload: torch.Tensor
    target_chunks: int
    mid_stream: bool
    attempt: int = 0
    redone: dict[int, int] = field(default_factory=dict)

    def inputs(
        self, chunk: int, attempt: int, step: int, layer: int, branch: int, steps: int
    ) -> torch.Tensor:
        """``[CHUNK_TOKENS, PER_TOKEN]`` (q | k | v) of one chunk's branch at one step and layer,
        read from the payload (a distinct window of it for every chunk, attempt, step, layer
        and branch: the stride is coprime with the usable length)."""
        index = (((chunk * 16 + attempt % 16) * steps + step) * len(LAYERS) + layer) * 2 + branch
        offset = (index * PAYLOAD_STRIDE + self.number) % (PAYLOAD_FLOATS - CHUNK_FLOATS)
        return self.payload[offset : offset + CHUNK_FLOATS].view(CHUNK_TOKENS, PER_TOKEN)

    def committed_kv(self, chunk: int, layer: int, branch: int, steps: int) -> torch.Tensor:
        """``[CHUNK_TOKENS, 2*HKV*D]``: what chunk ``chunk`` committed (its last step's K/V)."""
        attempt = self.redone.get(chunk, 0)
        return self.inputs(chunk, attempt, steps - 1, layer, branch, steps)[:, H * D :]


def session_maps(
    cache: SessionCache, runner: PagedWorker, allocator: DiffusionKVAllocator, host: dict[str, HostSession]
) -> dict[str, int]:
    """The size of every map that holds per-session state (the soak's own included)."""
    registry, translator = runner.registry, runner.translator
    assert registry is not None and translator is not None
    return {
        "session_cache.sessions": len(cache.sessions),
        "allocator.reserved": len(allocator.reserved()),
        "pool.used_blocks": allocator.pool.num_total - allocator.pool.num_free,
        "registry.states": len(registry._states),
        "registry.rows": len(registry._rows),
        "registry.written": len(registry._written),
        "registry.bindings": len(registry._bindings),
        "registry.block_holders": sum(len(h) for h in registry._holders),
        "registry.tombstones": len(registry._removed),
        "translator.active_batches": int(translator.active_batch is not None),
        "host.sessions": len(host),
    }


def session_kv_bound() -> int:
    """Blocks one branch of a soak session holds at most (``SessionCache.kv_blocks_bound``)."""
    return (
        math.ceil(SINK_CHUNKS * CHUNK_TOKENS / SESSION_BS)
        + math.ceil((WINDOW_CHUNKS + 1) * CHUNK_TOKENS / SESSION_BS)
        + 1
    )


def build_sessions(args: argparse.Namespace) -> tuple[SessionCache, PagedWorker, DiffusionKVAllocator]:
    policy = SessionPolicy(CHUNK_TOKENS, window_chunks=WINDOW_CHUNKS, sink_chunks=SINK_CHUNKS)
    # the longest session: its chunks, one more (staggered ends) and one left open at its end
    max_len = (args.chunks + 2) * CHUNK_TOKENS
    runner = PagedWorker(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=max_len,
            max_rows_per_request=2,
            max_num_seqs=2 * args.open,
            max_num_batched_tokens=2 * args.open * CHUNK_TOKENS,
        ),
    )
    runner.register_kv_cache_layers(
        {n: PagedLayerSpec(H, HKV, D, torch.float32, mode=policy.mask) for n in LAYERS}
    )
    runner.initialize_kv_cache(num_blocks=args.pool_blocks, block_size=SESSION_BS)
    assert runner.layout is not None and runner.registry is not None
    runner.registry.generation_memory = args.generation_memory
    allocator = DiffusionKVAllocator(
        block_size=SESSION_BS,
        max_model_len=max_len,
        max_rows_per_request=2,
        worker_rows=runner.layout.max_num_reqs,
        pool=FreeListPool(args.pool_blocks),
        num_groups=len(runner.layout.groups),
    )
    cache = SessionCache(runner, allocator, policy)
    assert cache.kv_blocks_bound() == session_kv_bound()
    return cache, runner, allocator


def session_soak(args: argparse.Namespace, log: Any) -> Soak:
    """Opens and closes ``args.warmup`` one-chunk sessions (the tombstone window fills), then
    ``args.sessions`` measured sessions of ``args.chunks`` chunks or more, ``args.open`` at a
    time, every chunk denoised in ``args.steps`` steps batched over the open sessions."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    cache, runner, allocator = build_sessions(args)
    mask = cache.mask
    steps = args.steps
    warmup, total = args.warmup, args.warmup + args.sessions
    result = Soak(
        config={
            "mode": "sessions",
            "sessions": args.sessions,
            "chunks": args.chunks,
            "warmup": warmup,
            "warmup_chunks": 1,
            "open": args.open,
            "steps": steps,
            "chunk_tokens": CHUNK_TOKENS,
            "window_chunks": WINDOW_CHUNKS,
            "sink_chunks": SINK_CHUNKS,
            "payload_bytes": PAYLOAD_FLOATS * 4,
            "pool_blocks": args.pool_blocks,
            "block_size": SESSION_BS,
            "layers": len(LAYERS),
            "heads": [H, HKV, D],
            "generation_memory": args.generation_memory,
            "check_every": args.check_every,
            "abort_every": args.abort_every,
            "fail_every": args.fail_every,
            "mid_stream_every": args.mid_stream_every,
            "heap": "tracemalloc" if args.heap else "off",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        }
    )
    rng = torch.Generator().manual_seed(args.seed)
    # per tick: sessions ended after it and its host seconds per denoise step, in arrays sized
    # up front (every tick appends at least one chunk), so the soak's log does not grow the heap
    cap = 2 * (warmup * 2 + args.sessions * (args.chunks + 3)) + 16
    tick_served = array.array("q", bytes(8 * cap))
    tick_host = array.array("d", bytes(8 * cap))
    logged = 0
    if args.heap:
        tracemalloc.start(1)
    host: dict[str, HostSession] = {}
    started = served = appended = ticks = 0
    counts = {"chunks_committed": 0, "chunks_aborted": 0, "failed_forwards": 0, "ended_mid_stream": 0}
    mismatches = checked = 0
    max_error = check_s = 0.0
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
                "draining": int(started >= total),
                **session_maps(cache, runner, allocator, host),
            }
        )

    def check(
        hs: HostSession, chunk: Chunk, step: int, layer: int, branch: int, q: torch.Tensor, out: torch.Tensor
    ) -> None:
        """One branch's output of one chunk at one step and layer against dense attention over
        the keys the mask shows (the sink, the window and the chunk itself)."""
        nonlocal mismatches, checked, max_error
        full = mask.row_mask(chunk.start, chunk.tokens, chunk.end)
        cols = full.any(0).nonzero().flatten().tolist()
        seen = sorted({p // CHUNK_TOKENS for p in cols})
        parts = [
            hs.committed_kv(c, layer, branch, steps)
            if c < chunk.index
            else hs.inputs(c, hs.attempt, step, layer, branch, steps)[:, H * D :]
            for c in seen
        ]
        kv = torch.cat(parts)
        # the seen chunks' positions, in order: keep exactly the visible columns
        offsets = {c: i * CHUNK_TOKENS for i, c in enumerate(seen)}
        picked = torch.tensor([offsets[p // CHUNK_TOKENS] + p % CHUNK_TOKENS for p in cols])
        kv = kv.index_select(0, picked)
        ref = dense_attention(
            q,
            kv[:, : HKV * D].reshape(-1, HKV, D),
            kv[:, HKV * D :].reshape(-1, HKV, D),
            full[:, cols],
            SCALE,
        )
        got = out.to(torch.float64)
        max_error = max(max_error, float((got - ref).abs().max()))
        if not torch.allclose(got, ref, atol=ATOL, rtol=RTOL):
            mismatches += 1
        checked += 1

    def denoise(batch: list[tuple[HostSession, Chunk]], step: int, fail: bool) -> None:
        """One denoise step over every chunk of the tick: each layer writes the chunks' K/V and
        attends (a failing forward raises after the first layer wrote)."""
        nonlocal check_s
        rows = [row for _, chunk in batch for row in chunk.rows()]
        n = sum(c.tokens * c.branches for _, c in batch)
        with runner.stepper() as runtime:
            runtime.ensure_rows(rows)
            for li, layer in enumerate(LAYERS):
                if fail and li == 1:
                    raise InjectedFailure(f"injected failure in layer {layer!r} at step {step}")
                qkv = torch.cat(
                    [
                        hs.inputs(c.index, hs.attempt, step, li, b, steps)
                        for hs, c in batch
                        for b in range(c.branches)
                    ]
                )
                q = qkv[:, : H * D].reshape(n, H, D)
                k = qkv[:, H * D : H * D + HKV * D].reshape(n, HKV, D)
                v = qkv[:, H * D + HKV * D :].reshape(n, HKV, D)
                out = runner.forward(layer, q, k, v)
                t0 = time.thread_time()
                offset = 0
                for hs, c in batch:
                    checking = hs.number >= warmup and hs.number % args.check_every == 0
                    for b in range(c.branches):
                        if checking:
                            part = slice(offset, offset + c.tokens)
                            check(hs, c, step, li, b, q[part], out[part])
                        offset += c.tokens
                check_s += time.thread_time() - t0

    def end(hs: HostSession) -> None:
        nonlocal served
        cache.end_session(hs.session)
        del host[hs.session.session_id]  # its payload goes with it
        served += 1

    sample()
    while served < total:
        check_before = check_s
        t0 = time.thread_time()
        while started < total and len(host) < args.open:
            sid = f"sess-{started:07d}"
            measured = started >= warmup
            hs = HostSession(
                cache.begin_session(sid, branches=1 + (started % 3 == 1)),
                started,
                torch.randn(PAYLOAD_FLOATS, generator=rng),
                target_chunks=args.chunks + started % 2 if measured else 1,
                mid_stream=measured and args.mid_stream_every > 0 and started % args.mid_stream_every == 2,
            )
            host[sid] = hs
            started += 1
        batch: list[tuple[HostSession, Chunk]] = []
        for hs in list(host.values()):
            chunk = cache.append_chunk(hs.session)
            if chunk is not None:  # None: the pool is short, the session waits a tick
                batch.append((hs, chunk))
        if not batch:
            raise RuntimeError(
                f"no session could append a chunk: {len(host)} open, pool {allocator.pool.num_free} free"
            )
        cancelled = [
            (hs, c)
            for i, (hs, c) in enumerate(batch)
            if args.abort_every and (appended + i) % args.abort_every == args.abort_every // 2
        ]
        appended += len(batch)
        every_open = len(batch) == args.open  # the drain at the end runs fewer: not logged
        fail = args.fail_every > 0 and ticks % args.fail_every == args.fail_every - 1
        ran = 0
        try:
            for step in range(steps):
                if step == 1:
                    # after the first step: cancelled chunks are aborted, sessions ending mid-stream
                    # end with their open chunk
                    for hs, c in cancelled:
                        cache.abort(c)
                        hs.attempt += 1
                        counts["chunks_aborted"] += 1
                    leaving = [(hs, c) for hs, c in batch if hs.mid_stream and c.index == hs.target_chunks]
                    for hs, _ in leaving:
                        counts["ended_mid_stream"] += 1
                        end(hs)
                    gone = {id(c) for _, c in (*cancelled, *leaving)}
                    batch = [(hs, c) for hs, c in batch if id(c) not in gone]
                    if not batch:
                        break
                denoise(batch, step, fail and step == steps - 1)
                ran += 1
        except InjectedFailure:
            counts["failed_forwards"] += 1
            ran += 1
            for hs, c in batch:  # the failed step's chunks are aborted: each session as before
                cache.abort(c)
                hs.attempt += 1
                counts["chunks_aborted"] += 1
            batch = []
        for hs, c in batch:
            if hs.mid_stream and c.index == hs.target_chunks:
                counts["ended_mid_stream"] += 1  # a one-step run: it ends with the chunk open
                end(hs)
                continue
            cache.commit(c)
            counts["chunks_committed"] += 1
            if hs.attempt:
                hs.redone[c.index] = hs.attempt
                hs.attempt = 0
            if hs.session.chunks_committed == hs.target_chunks and not hs.mid_stream:
                end(hs)
        host_s = time.thread_time() - t0 - (check_s - check_before)
        if ran and every_open:
            if logged >= cap:
                raise RuntimeError(f"more than {cap} ticks: the tick log is full")
            tick_served[logged], tick_host[logged] = served, host_s / ran
            logged += 1
        ticks += 1
        if served >= next_sample:
            sample()
            next_sample = served + args.sample_every
            if log is not None and len(result.samples) % 10 == 0:
                s = result.samples[-1]
                print(
                    f"[soak] {served:>7}/{total} sessions, rss {s['rss_mib']:.1f} MiB, heap {s['heap_mib']:.2f} MiB, "
                    f"{s['elapsed_s']:.0f} s",
                    file=log,
                    flush=True,
                )
    sample()
    wall = time.perf_counter() - t_start
    if args.heap:
        tracemalloc.stop()
    result.bins, result.summary = summarize(
        result.samples,
        list(zip(tick_served[:logged], tick_host[:logged], strict=True)),
        warmup,
        args.sessions,
        "sessions",
        args.heap,
    )
    result.summary.update(
        {
            "wall_s": wall,
            "served": served,
            "outcomes": counts,
            "ticks": ticks,
            "mismatches": mismatches,
            "checked_chunk_rows": checked,
            "max_abs_error": max_error,
        }
    )
    maps = session_maps(cache, runner, allocator, host)
    result.end_state = {
        "pool_blocks": allocator.pool.num_total,
        "pool_used_blocks": maps["pool.used_blocks"],
        "kv_blocks_bound_per_branch": cache.kv_blocks_bound(),
        "maps": maps,
        "map_bounds": {"registry.tombstones": args.generation_memory},
    }
    s = result.summary
    missed = check_bounds(args, s)
    if mismatches:
        missed.append(f"{mismatches} chunk rows disagree with dense attention")
    if checked == 0:
        missed.append("no chunk was checked against dense attention")
    if served != total:
        missed.append(f"{served} of {total} sessions ended")
    for name, size in maps.items():
        bound = result.end_state["map_bounds"].get(name, 0)
        if size > bound:
            missed.append(f"{name} holds {size} after every session ended; its bound is {bound}")
    result.bounds = bounds_of(args, missed)
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
    unit = "sessions" if result.config.get("mode") == "sessions" else "requests"
    bins = result.bins
    step.plot(
        [warmup + b[unit] for b in bins],
        [b["step_ms_median"] for b in bins],
        marker="o",
        label="median",
    )
    step.set_ylabel("host time per step (ms)")
    step.set_xlabel(f"{unit} served")
    payload = f"{result.config['payload_bytes'] // 1024} KiB payloads"
    if unit == "sessions":
        c = result.config
        mem.set_title(
            f"session soak: {c['sessions']} sessions of >= {c['chunks']} chunks, {c['open']} open, {payload}"
        )
    else:
        mem.set_title(f"soak: {result.config['requests']} one-shot requests, {payload}")
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
    p.add_argument(
        "--pool-blocks",
        type=int,
        default=None,
        help="blocks in the pool (default 128; sessions: every open session's bound, 2 branches)",
    )
    p.add_argument("--max-cached-blocks", type=int, default=16)
    p.add_argument("--max-running", type=int, default=12)
    p.add_argument(
        "--check-every", type=int, default=1, help="check every N-th request against dense (1: all)"
    )
    p.add_argument("--cancel-every", type=int, default=50, help="cancel 2 in every N requests (0: none)")
    p.add_argument(
        "--sample-every",
        type=int,
        default=None,
        help="memory sample interval in requests (default 500) or sessions (default 100)",
    )
    p.add_argument(
        "--no-heap", dest="heap", action="store_false", help="no tracemalloc (faster; no heap slope)"
    )
    p.add_argument("--max-rss-slope", type=float, default=0.5, help="MiB per 1000 requests")
    p.add_argument("--max-heap-slope", type=float, default=0.05, help="MiB per 1000 requests")
    p.add_argument("--max-time-ratio", type=float, default=1.1, help="host time per step, last tenth / first")
    sessions = p.add_argument_group("session soak (--sessions N)")
    sessions.add_argument(
        "--sessions", type=int, default=None, help="measured sessions: the session soak instead of requests"
    )
    sessions.add_argument("--chunks", type=int, default=20, help="chunks per session at least (default 20)")
    sessions.add_argument("--open", type=int, default=4, help="sessions open at once (default 4)")
    sessions.add_argument("--steps", type=int, default=2, help="denoise steps per chunk (default 2)")
    sessions.add_argument(
        "--abort-every", type=int, default=37, help="abort one in every N chunks after a step (0: none)"
    )
    sessions.add_argument(
        "--fail-every", type=int, default=101, help="a failing forward in one in every N ticks (0: none)"
    )
    sessions.add_argument(
        "--mid-stream-every",
        type=int,
        default=10,
        help="one in every N sessions ends with a chunk open (0: none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--output", help="also write the JSON result to this file")
    p.add_argument("--plot", help="draw memory and step time against requests served (matplotlib)")
    args = p.parse_args(argv)
    if args.sessions is not None:
        return session_main(p, args)
    if args.pool_blocks is None:
        args.pool_blocks = 128
    if args.sample_every is None:
        args.sample_every = 500
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
    write_out(result, args)
    if not args.json:
        print_summary(result, args, ONE_SHOT_TEXT)
    return 0 if result.bounds["ok"] else 1


@dataclass(frozen=True)
class SummaryText:
    """What the one-shot and the session summary print differently; ``checked`` is formatted
    with the run's summary, ``end`` with its end state."""

    title: str
    unit: str  # the measured unit, singular: its count is ``args.<unit>s``
    checked: str  # what was served and checked, before "checked against dense"
    end: str  # end-state fields between the pool and the maps


ONE_SHOT_TEXT = SummaryText(
    "soak", "request", "outcomes {outcomes}, {checked_rows} rows", "prefix cache {prefix_cache}, "
)
SESSION_TEXT = SummaryText(
    "session soak", "session", "{outcomes}, {ticks} ticks; {checked_chunk_rows} chunk rows", ""
)


def print_summary(result: Soak, args: argparse.Namespace, text: SummaryText) -> None:
    """The run's summary as text (the JSON's figures), then every bound it missed."""
    s, e, unit = result.summary, result.end_state, text.unit
    heap = s["heap_slope_mib_per_1000"]
    print(
        f"{text.title}: {getattr(args, unit + 's')} {unit}s measured after {args.warmup} warm-up, "
        f"{s['wall_s']:.0f} s wall\n"
        f"  {text.checked.format(**s)} checked against dense, "
        f"{s['mismatches']} mismatches (max |err| {s['max_abs_error']:.2e})\n"
        f"  RSS slope {s['rss_slope_mib_per_1000']:.3f} MiB/1000 (end {s['rss_mib_end']:.1f} MiB), heap slope "
        + (f"{heap:.4f}" if heap is not None else "n/a")
        + f" MiB/1000 (end {s['heap_mib_end']:.2f} MiB)\n"
        f"  host time per step: first tenth {s['step_ms_first_tenth']:.3f} ms, last tenth "
        f"{s['step_ms_last_tenth']:.3f} ms (ratio {s['step_time_ratio_last_over_first']:.3f}); "
        f"{s[f'host_ms_per_{unit}']:.3f} ms per {unit}\n"
        f"  end: pool {e['pool_used_blocks']}/{e['pool_blocks']} used, {text.end.format(**e)}maps {e['maps']}"
    )
    for line in result.bounds["missed"]:
        print(f"  MISSED: {line}")


def write_out(result: Soak, args: argparse.Namespace) -> None:
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


def session_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The session soak's half of :func:`main`."""
    for name in ("sessions", "chunks", "open", "steps", "check_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    for name in ("generation_memory", "abort_every", "fail_every", "mid_stream_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(args, name)}")
    if args.steps < 2 and (args.abort_every or args.fail_every or args.mid_stream_every):
        p.error("--steps 1 leaves no step to abort, fail or end after: pass --steps >= 2")
    if args.pool_blocks is None:
        args.pool_blocks = args.open * 2 * session_kv_bound()
    if args.warmup is None:
        args.warmup = args.generation_memory
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0; got {args.warmup}")
    if args.sample_every is None:
        args.sample_every = 100
    if args.sample_every < 1:
        p.error(f"--sample-every must be >= 1; got {args.sample_every}")
    result = session_soak(args, None if args.json else sys.stderr)
    write_out(result, args)
    if not args.json:
        print_summary(result, args, SESSION_TEXT)
    return 0 if result.bounds["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

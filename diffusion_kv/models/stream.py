"""The stream mode of the main job: many tiny-DiT requests served together.

``N`` requests of mixed shapes (prefix lengths including none, target lengths, step counts, one
or two CFG rows) arrive a few scheduler steps apart and are stepped together by
:class:`~diffusion_kv.core.scheduler.DiffusionScheduler`: one paged batch per step, each request
at its own phase, rows packed along one token axis. Every request's result is checked against
its own dense run, and the stream's throughput against the same requests served one after
another through the same scheduler, runner and cache (``max_running=1``).

CUDA graphs: a captured step bakes in its batch (shapes, metadata addresses), so it can only be
replayed while the composition stays the same. With ``graphs`` on, a step is captured whole once
its composition has been active for two steps and is known to last at least ``GRAPH_MIN_STABLE``
steps (no request changes phase or finishes before); every other step runs the model's pieces
between paged layers from per-token-bucket graphs, with paged attention eager between them
(:mod:`diffusion_kv.models.buckets`), so a batch that changes every step still replays most of
its work. Both the stream and its one-after-another baseline follow this one policy; capture
time is counted apart (``capture_ms``).

Prefix caching (``shared_prefixes=K``): every request has the full prefix, the full target and
two CFG rows, its prefix drawn from ``K`` distinct ones (request ``i`` uses prefix ``i % K``),
and names its prefix by a digest of the conditioning latents of each row. Both the stream and
the one-after-another run use the prefix cache; the stream is also served with caching off, and
the result's ``prefix_cache`` reports the hits, the blocks saved, evictions, the peak of blocks
held, the throughput both ways and whether every output agrees with the uncached run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from diffusion_kv.core.allocator import DiffusionKVAllocator, FreeListPool
from diffusion_kv.core.errors import DiffusionKVError, ValidationError
from diffusion_kv.core.graphs import CapturedStep
from diffusion_kv.core.kv_quant import cache_dtype_name
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.prefix_cache import ContentSpan, PrefixCache
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.scheduler import (
    DiffusionRequest,
    DiffusionScheduler,
    Phase,
    RequestStatus,
    StepBatch,
    StepReport,
)
from diffusion_kv.core.transfer import to_device
from diffusion_kv.models.buckets import BucketGraphs, default_buckets
from diffusion_kv.models.demo import (
    FP8_COSINE_BOUND,
    TOLERANCE,
    _sync,
    build_model,
    combine_guidance,
    cosine,
    max_difference,
    paged_runner,
)
from diffusion_kv.models.demo import DemoConfig as _DemoConfig
from diffusion_kv.models.tiny_dit import TinyDiT
from diffusion_kv.platforms.interface import Platform

GRAPH_MIN_STABLE = 3


@dataclass(frozen=True)
class StreamConfig:
    requests: int = 6
    prefix_len: int = 256
    """The largest prefix; requests use it, half of it, or none."""
    target_len: int = 64
    """The largest target; requests use it or half of it."""
    steps: int = 6
    """Typical step count; requests use it, two more, or two fewer (at least 2)."""
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 4
    layers: int = 2
    block_size: int | None = None
    dtype: torch.dtype = torch.float32
    seed: int = 0
    guidance: float = 4.0
    arrival_gap: int = 1
    """Scheduler steps between two arrivals."""
    max_running: int = 8
    pool_fraction: float = 0.6
    """Pool size as a fraction of the blocks all requests need at once (at least the largest
    request's): below 1 some arrivals wait for blocks to free up."""
    graphs: bool | None = None
    """None: on CUDA when every backend supports capture; False: never; True: required."""
    warmup: bool | None = None
    """Run the workload untimed first, both ways: True: in full; None: in full on CUDA (kernels
    compile on first use), elsewhere a short pass (two steps per request) that pays one-time
    costs without doubling the run; False: not at all (the first timed run pays them)."""
    shared_prefixes: int | None = None
    """Draw every request's prefix from this many distinct ones and serve with prefix caching
    (module docstring); None: the mixed workload, each request with its own prefix."""
    prefix_caching: bool | None = None
    """Serve with the prefix cache (None: when ``shared_prefixes`` is set). With the mixed
    workload no prefix repeats, so this measures what caching costs when nothing hits."""
    max_cached_blocks: int | None = None
    """Cap on the blocks the prefix cache keeps (None: the pool is the only limit)."""
    kv_cache_dtype: torch.dtype | None = None
    """The pages' dtype (None: the model's). The pool holds the same bytes either way (blocks of a
    smaller dtype are smaller, so it has more of them), and with a quantised cache every request
    agrees with its dense run when their final latents' cosine similarity is at least
    ``FP8_COSINE_BOUND``."""
    repeats: int = 1
    """With prefix caching: how many times the stream is served with and without the cache,
    alternating; each figure is from its fastest run (capture time apart)."""
    backend: str | None = None
    """The paged backend every KV-cache group uses (None: the platform's priority list)."""

    def __post_init__(self) -> None:
        for name in (
            "requests",
            "prefix_len",
            "target_len",
            "steps",
            "hidden",
            "heads",
            "kv_heads",
            "layers",
        ):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValidationError(f"{name} must be a positive integer; got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValidationError(
                f"hidden={self.hidden} must divide by heads={self.heads} into an even head size, and heads by "
                f"kv_heads={self.kv_heads}"
            )
        if type(self.arrival_gap) is not int or self.arrival_gap < 0:
            raise ValidationError(f"arrival_gap must be an integer >= 0; got {self.arrival_gap!r}")
        if type(self.max_running) is not int or self.max_running <= 0:
            raise ValidationError(f"max_running must be a positive integer; got {self.max_running!r}")
        if not 0 < self.pool_fraction <= 1:
            raise ValidationError(f"pool_fraction must be in (0, 1]; got {self.pool_fraction!r}")
        if self.target_len < 2:
            raise ValidationError(
                f"target_len must be at least 2 (requests use it or half of it); got {self.target_len}"
            )
        if self.shared_prefixes is not None and (
            type(self.shared_prefixes) is not int or not 0 < self.shared_prefixes <= self.requests
        ):
            raise ValidationError(
                f"shared_prefixes must be an integer in [1, requests={self.requests}]; got {self.shared_prefixes!r}"
            )
        if type(self.repeats) is not int or self.repeats <= 0:
            raise ValidationError(f"repeats must be a positive integer; got {self.repeats!r}")
        if self.max_cached_blocks is not None and (
            type(self.max_cached_blocks) is not int or self.max_cached_blocks < 0
        ):
            raise ValidationError(
                f"max_cached_blocks must be None or an integer >= 0; got {self.max_cached_blocks!r}"
            )
        if self.max_cached_blocks is not None and not self.caching:
            raise ValidationError(
                f"max_cached_blocks={self.max_cached_blocks} caps the prefix cache, which is off (prefix_caching="
                f"{self.prefix_caching!r}, shared_prefixes={self.shared_prefixes!r})"
            )

    @property
    def caching(self) -> bool:
        return self.prefix_caching if self.prefix_caching is not None else self.shared_prefixes is not None


@dataclass
class RequestInputs:
    prefixes: torch.Tensor
    """``[cfg_rows, prefix_len, hidden]``."""
    latent: torch.Tensor
    """``[1, target_len, hidden]``."""


def make_requests(cfg: StreamConfig) -> list[DiffusionRequest]:
    """The workload: a deterministic mix of shapes (every kind appears from 6 requests on); with
    ``shared_prefixes``, the full prefix and target and two CFG rows for every request."""
    out = []
    for i in range(cfg.requests):
        if cfg.shared_prefixes is not None:
            steps = max(2, cfg.steps + (0, 2, -2)[(i // 3) % 3])
            out.append(DiffusionRequest(f"req-{i}", cfg.prefix_len, cfg.target_len, steps, 2))
            continue
        prefix = (cfg.prefix_len, cfg.prefix_len // 2, 0)[i % 3]
        target = (cfg.target_len, cfg.target_len // 2)[i % 2]
        steps = max(2, cfg.steps + (0, 2, -2)[(i // 3) % 3])
        cfg_rows = (2, 1)[(i // 2) % 2]
        out.append(DiffusionRequest(f"req-{i}", prefix, target, steps, cfg_rows))
    return out


def make_inputs(
    cfg: StreamConfig, request: DiffusionRequest, index: int, device: torch.device
) -> RequestInputs:
    g = torch.Generator().manual_seed(cfg.seed * 1000 + index + 1)
    prefixes = torch.randn(request.cfg_rows, request.prefix_len, cfg.hidden, generator=g)
    latent = torch.randn(1, request.target_len, cfg.hidden, generator=g)
    if cfg.shared_prefixes is not None:  # the prefix is one of shared_prefixes, by its own seed
        shared = torch.Generator().manual_seed(cfg.seed * 1000 + 500 + index % cfg.shared_prefixes)
        prefixes = torch.randn(request.cfg_rows, request.prefix_len, cfg.hidden, generator=shared)
    return RequestInputs(prefixes.to(device, cfg.dtype), latent.to(device, cfg.dtype))


def content_of(inputs: RequestInputs) -> tuple[tuple[ContentSpan, ...], ...]:
    """Per CFG row, the prefix named by a digest of its conditioning latents (what a host does
    for an image or embedding span: equal latents, equal K/V)."""
    out: list[tuple[ContentSpan, ...]] = []
    for row in inputs.prefixes:
        if row.shape[0] == 0:
            out.append(())
            continue
        data = row.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        digest = hashlib.blake2b(data, digest_size=16).digest()
        out.append((ContentSpan(0, row.shape[0], digest),))
    return tuple(out)


def model_identity(cfg: StreamConfig) -> str:
    """The tiny DiT's weights: its random initialisation is fixed by the seed and the shape."""
    return (
        f"tiny-dit seed={cfg.seed} hidden={cfg.hidden} heads={cfg.heads}/{cfg.kv_heads} layers={cfg.layers} "
        f"dtype={cfg.dtype}"
    )


def dense_run(
    model: TinyDiT, request: DiffusionRequest, inputs: RequestInputs, guidance: float
) -> torch.Tensor:
    """The request alone, recomputed densely at every step: the per-request reference."""
    latent = inputs.latent
    dt = 1.0 / request.steps
    with torch.no_grad():
        for step in range(request.steps):
            target = latent.expand(request.cfg_rows, -1, -1)
            velocity = model.dense_step(inputs.prefixes, target, 1.0 - step * dt)
            latent = latent - dt * combine_guidance(guidance, velocity)
    return latent


class StreamModel:
    """Runs the tiny DiT over a scheduler's step batches (rows packed along one token axis)."""

    def __init__(
        self,
        model: TinyDiT,
        runner: PagedWorker,
        inputs: dict[str, RequestInputs],
        guidance: float,
        graphs: bool,
        buckets: BucketGraphs | None = None,
    ) -> None:
        self.model = model
        self.runner = runner
        self.inputs = inputs
        self.latents: dict[str, torch.Tensor] = {rid: i.latent for rid, i in inputs.items()}
        self.guidance = guidance
        self.graphs = graphs
        self.device = runner.device
        self._layout_key: tuple[Any, ...] | None = None
        self._positions = torch.empty(0)
        self._out_index = torch.empty(0)
        self._captured: CapturedStep | None = None
        self.graph_captures = 0
        self.graph_replays = 0
        self.eager_steps = 0
        self.capture_ms = 0.0
        """Wall time spent capturing graphs (warm-up run and capture, synchronised)."""
        self.buckets: BucketGraphs | None = None
        """Per token bucket, the model's pieces between paged layers as CUDA graphs (the steps
        whose composition changes too soon for a whole-step capture)."""
        if graphs and self.device.type == "cuda":
            self.buckets = buckets or BucketGraphs(
                model, default_buckets(runner.config.max_num_batched_tokens), self.device
            )
        self.bucket_steps = 0

    def _layout(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute positions of the packed tokens and where the target tokens sit (cached per
        composition; one host-to-device copy, which does not block the host on CUDA)."""
        key = batch.rows
        if key != self._layout_key:
            positions: list[torch.Tensor] = []
            out_index: list[torch.Tensor] = []
            offset = 0
            for e in batch.entries:
                req = e.request
                for row in e.rows:
                    positions.append(torch.arange(row.kv_start_pos, row.seq_len))
                    first_target = offset + (req.prefix_len - row.kv_start_pos)
                    out_index.append(torch.arange(first_target, first_target + req.target_len))
                    offset += row.query_len
            # without blocking (core.transfer): a blocking copy at every composition change
            # (a stream's arrivals and finishes) would leave the GPU idle while the host
            # prepares each step
            both = to_device(torch.cat([*positions, *out_index]), self.device)
            n = sum(len(p) for p in positions)
            self._positions, self._out_index = both[:n], both[n:]
            self._layout_key = key
        return self._positions, self._out_index

    def _tokens(self, batch: StepBatch) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        for e in batch.entries:
            req = e.request
            t = 1.0 - e.step / req.steps
            target = self.latents[req.request_id][0] + self.model.timestep(t, self.device)
            for r, row in enumerate(e.rows):
                if e.phase is Phase.PREFILL:  # less what the prefix cache holds
                    parts.append(self.inputs[req.request_id].prefixes[r][row.kv_start_pos :])
                parts.append(target)
        return torch.cat(parts)[None]

    def __call__(self, batch: StepBatch) -> None:
        positions, out_index = self._layout(batch)
        meta = AttentionMetadata(full_attn_spans=batch.full_attn_spans)
        runner = self.runner

        def attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return runner.forward(name, q[0], k[0], v[0], meta)[None]

        def forward(x: torch.Tensor) -> torch.Tensor:
            return self.model.run_packed(x, positions, attention, out_index)

        with torch.no_grad():
            x = self._tokens(batch)
            if self._captured is not None and self._captured.valid:
                velocity = self._captured.replay(x)
                self.graph_replays += 1
            elif self.graphs and batch.composition_steps >= 2 and batch.stable_for >= GRAPH_MIN_STABLE:
                self._captured = None  # the previous graph goes now, not during the capture
                _sync(self.device)
                began = time.perf_counter()
                self._captured = runner.capture(forward, x)
                velocity = self._captured.warmup_output
                _sync(self.device)
                self.capture_ms += (time.perf_counter() - began) * 1e3
                self.graph_captures += 1
            elif self.buckets is not None and self.buckets.bucket_for(x.shape[1]) is not None:
                before = self.buckets.capture_ms
                velocity = self.buckets.run(x, positions, attention, out_index)
                self.capture_ms += self.buckets.capture_ms - before
                self.bucket_steps += 1
            else:
                velocity = forward(x)
                self.eager_steps += 1
            cursor = 0
            for e in batch.entries:
                req = e.request
                n = req.cfg_rows * req.target_len
                v = velocity[cursor : cursor + n].reshape(req.cfg_rows, req.target_len, -1)
                cursor += n
                dt = 1.0 / req.steps
                self.latents[req.request_id] = self.latents[req.request_id] - dt * combine_guidance(
                    self.guidance, v
                )


@dataclass
class ServeRun:
    wall_ms: float
    ticks: int
    preparations: int
    peak_blocks: int
    max_running: int
    mean_block_utilisation: float
    graph_captures: int
    graph_replays: int
    eager_steps: int
    capture_ms: float
    """Of ``wall_ms``, the time spent capturing CUDA graphs (a one-off per composition or bucket)."""
    bucket_steps: int
    """Steps replayed from the per-bucket piecewise graphs (paged attention eager between them)."""
    buckets_captured: tuple[int, ...]
    bucket_graph_bytes: int
    peak_blocks_held: int
    """The most blocks live requests held at once (cached blocks nobody holds apart)."""
    prefix_hit_tokens: int
    prefix_hit_blocks: int
    prefix_evictions: int
    prefix_published_blocks: int
    prefill_tokens: int
    """Tokens the requests' prefill steps computed (less prefix-cache hits)."""
    query_tokens: int
    """Tokens every step computed, summed over the run."""
    latents: dict[str, torch.Tensor] = field(repr=False)
    records: dict[str, Any] = field(repr=False)


Progress = Callable[[str, StepReport, int, int], None]


def serve(
    model: TinyDiT,
    runner: PagedWorker,
    allocator: DiffusionKVAllocator,
    requests: list[DiffusionRequest],
    inputs: dict[str, RequestInputs],
    cfg: StreamConfig,
    *,
    max_running: int,
    arrival_gap: int,
    graphs: bool,
    label: str,
    progress: Progress | None = None,
    model_id: str | None = None,
    buckets: BucketGraphs | None = None,
) -> ServeRun:
    """Serve ``requests`` (request ``i`` arrives at scheduler step ``i * arrival_gap``).
    ``buckets``: per-bucket graphs captured by an earlier run (a server captures them once)."""
    stream = StreamModel(model, runner, inputs, cfg.guidance, graphs, buckets)
    prefill_tokens = query_tokens = 0
    block = allocator.block_size
    arrivals = [r for _, r in sorted(((i * arrival_gap, i), r) for i, r in enumerate(requests))]
    due = [i * arrival_gap for i in range(len(requests))]
    utilisation: list[float] = []
    most_running = 0
    done = 0
    statuses: dict[str, str] = {}  # each request's outcome, as the step reports hand it back

    def step(batch: StepBatch) -> None:
        nonlocal most_running, prefill_tokens, query_tokens
        in_use = allocator.blocks_held  # held by exactly this batch's requests
        tokens = sum(e.request.cfg_rows * e.request.seq_len for e in batch.entries)
        utilisation.append(tokens / (in_use * block))
        prefill_tokens += sum(e.num_tokens for e in batch.entries if e.phase is Phase.PREFILL)
        query_tokens += batch.num_tokens
        most_running = max(most_running, len(batch.entries))
        stream(batch)

    _sync(runner.device)
    t0 = time.perf_counter()
    with DiffusionScheduler(runner, allocator, max_running=max_running, model_id=model_id) as scheduler:
        nxt = 0
        while nxt < len(arrivals) or not scheduler.idle:
            if scheduler.idle:  # nothing to run until the next arrival: it arrives now
                scheduler.submit(arrivals[nxt])
                nxt += 1
            while nxt < len(arrivals) and due[nxt] <= scheduler.tick:
                scheduler.submit(arrivals[nxt])
                nxt += 1
            report = scheduler.step(step)
            if report is None:
                continue
            statuses.update((rec.request.request_id, rec.status.value) for rec in report.outcomes)
            if report.failed:
                errors = {r.request.request_id: r.error for r in report.outcomes if r.error is not None}
                raise DiffusionKVError(f"stream requests failed: {errors}")
            done += len(report.finished)
            if progress is not None:
                progress(label, report, done, len(requests))
        preparations = scheduler.preparations
        peak = scheduler.peak_blocks_in_use
        peak_held = scheduler.peak_blocks_held
        hit_tokens, hit_blocks = scheduler.prefix_hit_tokens, scheduler.prefix_hit_blocks
        ticks = scheduler.tick
    cache_stats = allocator.prefix_cache.stats() if allocator.prefix_cache is not None else {}
    _sync(runner.device)
    wall = (time.perf_counter() - t0) * 1e3
    statuses.update((rec.request.request_id, rec.status.value) for rec in scheduler.drain_outcomes())
    bad = {rid: status for rid, status in statuses.items() if status != RequestStatus.FINISHED.value}
    if bad:
        raise DiffusionKVError(f"stream requests did not finish: {bad}")
    pool, cache = allocator.pool, allocator.prefix_cache
    cached = len(cache) if cache is not None else 0
    idle = cache.num_idle if cache is not None else 0
    installed = runner.registry.installed_requests() if runner.registry is not None else ()
    reserved = allocator.reserved()
    if pool.num_free + cached != pool.num_total or idle != cached or reserved or installed:
        raise DiffusionKVError(
            f"the {label} run left the block pool short: {pool.num_free} free + {cached} cached ({idle} idle) "
            f"of {pool.num_total}; still reserved: {list(reserved)}; worker rows installed: {list(installed)}"
        )
    return ServeRun(
        wall_ms=wall,
        ticks=ticks,
        preparations=preparations,
        peak_blocks=peak,
        max_running=most_running,
        mean_block_utilisation=statistics.mean(utilisation) if utilisation else float("nan"),
        graph_captures=stream.graph_captures,
        graph_replays=stream.graph_replays,
        eager_steps=stream.eager_steps,
        capture_ms=stream.capture_ms,
        bucket_steps=stream.bucket_steps,
        buckets_captured=stream.buckets.captured_buckets if stream.buckets is not None else (),
        bucket_graph_bytes=stream.buckets.graph_bytes if stream.buckets is not None else 0,
        peak_blocks_held=peak_held,
        prefix_hit_tokens=hit_tokens,
        prefix_hit_blocks=hit_blocks,
        prefix_evictions=cache_stats.get("evictions", 0),
        prefix_published_blocks=cache_stats.get("published_blocks", 0),
        prefill_tokens=prefill_tokens,
        query_tokens=query_tokens,
        latents=dict(stream.latents),
        records=statuses,
    )


@dataclass
class StreamResult:
    platform: str
    device: str
    dtype: str
    block_size: int
    pool_blocks: int
    requests: list[dict[str, Any]]
    max_abs_diff: float
    tolerance: float
    agree: bool
    stream: dict[str, Any]
    sequential: dict[str, Any]
    target_token_steps: int
    """Sum over requests of CFG rows x target tokens x steps: the denoising work done."""
    prefix_cache: dict[str, Any] | None = None
    """With prefix caching: the stream against the same stream with caching off (module
    docstring)."""
    kv_cache_dtype: str = "auto"
    kv_bytes_per_block: int = 0
    min_cosine_similarity: float = 1.0
    """Over every request, of its final latent against its dense run's."""
    backends: tuple[str, ...] = ()
    """The paged backend(s) that served the KV-cache groups (``platform:backend``)."""

    @property
    def speedup(self) -> float:
        """Throughput against one after another, both under the same graph policy, with each
        run's graph-capture time left out (captures are reported apart: a one-off cost per
        composition that a long-running server amortises)."""
        return float(
            (self.sequential["wall_ms"] - self.sequential["capture_ms"])
            / (self.stream["wall_ms"] - self.stream["capture_ms"])
        )

    @property
    def speedup_with_captures(self) -> float:
        return float(self.sequential["wall_ms"] / self.stream["wall_ms"])

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["speedup"] = self.speedup
        out["speedup_with_captures"] = self.speedup_with_captures
        return out


def _run_record(run: ServeRun, n: int, work: int) -> dict[str, Any]:
    seconds = run.wall_ms / 1e3
    out = {k: v for k, v in asdict(run).items() if k not in ("latents", "records")}
    out["requests_per_s"] = n / seconds
    out["target_tokens_per_s"] = work / seconds
    return out


@dataclass
class StreamSetup:
    """The pieces a stream run serves with: the model, the worker, the workload."""

    cfg: StreamConfig
    device: torch.device
    model: TinyDiT
    runner: PagedWorker
    requests: list[DiffusionRequest]
    inputs: dict[str, RequestInputs]
    block: int
    pool_blocks: int
    max_len: int
    concurrency: int

    def buckets(self, graphs: bool) -> BucketGraphs | None:
        """Per-token-bucket graphs of the model's pieces (CUDA with graphs on), to share between
        runs so that each bucket is captured once."""
        if not graphs or self.device.type != "cuda":
            return None
        return BucketGraphs(
            self.model, default_buckets(self.runner.config.max_num_batched_tokens), self.device
        )

    def allocator(self, caching: bool) -> DiffusionKVAllocator:
        """A fresh pool (and prefix cache) per run: no run hits what another cached."""
        assert self.runner.layout is not None
        return DiffusionKVAllocator(
            block_size=self.block,
            max_model_len=self.max_len,
            max_rows_per_request=max(r.cfg_rows for r in self.requests),
            worker_rows=self.runner.layout.max_num_reqs,
            pool=FreeListPool(self.pool_blocks),
            prefix_cache=PrefixCache(self.cfg.max_cached_blocks) if caching else None,
        )


def setup_stream(platform: Platform, cfg: StreamConfig, device: torch.device | None = None) -> StreamSetup:
    """Build the model, the worker (its pool sized by ``pool_fraction``) and the workload."""
    device = device or platform.device()
    model = build_model(
        _DemoConfig(
            hidden=cfg.hidden,
            heads=cfg.heads,
            kv_heads=cfg.kv_heads,
            layers=cfg.layers,
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=cfg.prefix_len + cfg.target_len,
            prefix_len=cfg.prefix_len,
            target_len=cfg.target_len,
        ),
        device,
    )
    requests = make_requests(cfg)
    inputs = {r.request_id: make_inputs(cfg, r, i, device) for i, r in enumerate(requests)}
    if cfg.caching:
        requests = [dataclasses.replace(r, prefix_content=content_of(inputs[r.request_id])) for r in requests]
    block = cfg.block_size or platform.default_block_size
    max_len = max(r.seq_len for r in requests)
    per_request = [r.cfg_rows * cdiv(r.seq_len, block) for r in requests]
    pool_blocks = max(max(per_request), math.ceil(cfg.pool_fraction * sum(per_request)))
    if cfg.kv_cache_dtype is not None and cfg.kv_cache_dtype != cfg.dtype:  # equal pool memory
        pool_blocks *= cfg.dtype.itemsize // cfg.kv_cache_dtype.itemsize
    concurrency = min(cfg.max_running, len(requests))
    mc = model.cfg
    runner = paged_runner(  # graph capture a selection requirement where the run wants graphs
        platform,
        RunnerConfig(
            max_model_len=max_len,
            max_rows_per_request=max(r.cfg_rows for r in requests),
            max_num_seqs=concurrency,
            max_num_batched_tokens=sum(
                sorted((r.step_tokens(0) for r in requests), reverse=True)[:concurrency]
            ),
            device=device,
            kv_cache_dtype=cfg.kv_cache_dtype or "auto",
            backend=cfg.backend,
        ),
        {name: PagedLayerSpec(mc.heads, mc.kv_heads, mc.head_size, mc.dtype) for name in model.layer_names},
        pool_blocks,
        block,
        cfg.graphs,
    )
    return StreamSetup(cfg, device, model, runner, requests, inputs, block, pool_blocks, max_len, concurrency)


def run_stream(
    platform: Platform,
    cfg: StreamConfig,
    progress: Progress | None = None,
    device: torch.device | None = None,
) -> StreamResult:
    st = setup_stream(platform, cfg, device)
    device, model, runner, requests, inputs = st.device, st.model, st.runner, st.requests, st.inputs
    block, pool_blocks, concurrency = st.block, st.pool_blocks, st.concurrency
    allocator = st.allocator
    model_id = model_identity(cfg)
    graphs = runner.supports_graph_capture if cfg.graphs is None else cfg.graphs
    buckets = st.buckets(graphs)  # one set for every run: captured once, in the warm-up
    full_warmup = cfg.warmup is True or (cfg.warmup is None and device.type == "cuda")

    def go(
        max_running: int,
        gap: int,
        label: str,
        show: Progress | None,
        reqs: list[DiffusionRequest] = requests,
        caching: bool = cfg.caching,
    ) -> ServeRun:
        return serve(
            model,
            runner,
            allocator(caching),
            reqs,
            inputs,
            cfg,
            max_running=max_running,
            arrival_gap=gap,
            graphs=graphs,
            label=label,
            progress=show,
            model_id=model_id if caching else None,
            buckets=buckets,
        )

    if cfg.warmup is not False:
        warm = requests if full_warmup else [dataclasses.replace(r, steps=2) for r in requests]
        go(concurrency, cfg.arrival_gap, "warmup", None, warm)
        go(1, 0, "warmup", None, warm)
        if cfg.caching:
            go(concurrency, cfg.arrival_gap, "warmup", None, warm, caching=False)
    sequential = go(1, 0, "one by one", progress)
    stream = go(concurrency, cfg.arrival_gap, "stream", progress)
    uncached = go(concurrency, cfg.arrival_gap, "uncached", progress, caching=False) if cfg.caching else None
    if uncached is not None:
        for _ in range(cfg.repeats - 1):  # alternating, the fastest of each (clock drift evens out)
            again = go(concurrency, cfg.arrival_gap, "uncached", None, caching=False)
            uncached = again if _busy(again) < _busy(uncached) else uncached
            again = go(concurrency, cfg.arrival_gap, "stream", None)
            stream = again if _busy(again) < _busy(stream) else stream
    diffs = []
    cosines = []
    rows = []
    refs = {r.request_id: dense_run(model, r, inputs[r.request_id], cfg.guidance) for r in requests}
    for r in requests:
        ref = refs[r.request_id]
        d_stream = float(max_difference(ref, stream.latents[r.request_id]).item())
        d_seq = float(max_difference(ref, sequential.latents[r.request_id]).item())
        diffs.extend([d_stream, d_seq])
        cos = min(cosine(ref, stream.latents[r.request_id]), cosine(ref, sequential.latents[r.request_id]))
        cosines.append(cos)
        rows.append(
            dict(
                request_id=r.request_id,
                prefix_len=r.prefix_len,
                target_len=r.target_len,
                steps=r.steps,
                cfg_rows=r.cfg_rows,
                max_abs_diff_stream=d_stream,
                max_abs_diff_sequential=d_seq,
                cosine_similarity=cos,
            )
        )
    tol = TOLERANCE.get(cfg.dtype, 1e-1)
    work = sum(r.cfg_rows * r.target_len * r.steps for r in requests)
    prefix_cache = None
    if uncached is not None:
        vs_uncached = 0.0
        for r in requests:
            ref = refs[r.request_id]
            diffs.append(float(max_difference(ref, uncached.latents[r.request_id]).item()))
            vs_uncached = max(
                vs_uncached,
                float(max_difference(uncached.latents[r.request_id], stream.latents[r.request_id]).item()),
            )
        prefix_cache = prefix_report(cfg, stream, uncached, vs_uncached, tol, work)
    worst = max(diffs)
    quantized = cfg.kv_cache_dtype is not None and cfg.kv_cache_dtype != cfg.dtype
    if prefix_cache is not None and quantized:  # both runs read the same e4m3 pages
        prefix_cache["agrees"] = prefix_cache["max_abs_diff_vs_uncached"] == 0.0 or prefix_cache["agrees"]
    return StreamResult(
        platform=platform.name,
        device=str(device),
        dtype=str(cfg.dtype).removeprefix("torch."),
        block_size=block,
        pool_blocks=pool_blocks,
        requests=rows,
        max_abs_diff=worst,
        tolerance=tol,
        agree=min(cosines) >= FP8_COSINE_BOUND if quantized else worst <= tol,
        stream=_run_record(stream, len(requests), work),
        sequential=_run_record(sequential, len(requests), work),
        target_token_steps=work,
        prefix_cache=prefix_cache,
        kv_cache_dtype=cache_dtype_name(cfg.kv_cache_dtype if quantized else None),
        kv_bytes_per_block=runner.kv_bytes_per_block(),
        min_cosine_similarity=min(cosines),
        backends=tuple(dict.fromkeys(f"{platform.name}:{b.name}" for b in runner.backends)),
    )


def _busy(run: ServeRun) -> float:
    return run.wall_ms - run.capture_ms


def prefix_report(
    cfg: StreamConfig, cached: ServeRun, uncached: ServeRun, max_diff: float, tol: float, work: int
) -> dict[str, Any]:
    """The stream with prefix caching against the same stream without (capture time apart)."""
    busy = cached.wall_ms - cached.capture_ms
    busy_uncached = uncached.wall_ms - uncached.capture_ms
    return {
        "shared_prefixes": cfg.shared_prefixes,
        "hit_tokens": cached.prefix_hit_tokens,
        "blocks_saved": cached.prefix_hit_blocks,
        "published_blocks": cached.prefix_published_blocks,
        "evictions": cached.prefix_evictions,
        "prefill_tokens": cached.prefill_tokens,
        "prefill_tokens_uncached": uncached.prefill_tokens,
        "query_tokens": cached.query_tokens,
        "query_tokens_uncached": uncached.query_tokens,
        # what the throughput ratio would be if a step cost its query tokens (prefill queries
        # attend fewer keys than target ones, so the measured ratio stays below it)
        "token_ratio": uncached.query_tokens / cached.query_tokens,
        "peak_blocks_held": cached.peak_blocks_held,
        "peak_blocks_held_uncached": uncached.peak_blocks_held,
        "blocks_held_ratio": cached.peak_blocks_held / uncached.peak_blocks_held,
        "peak_pool_blocks_in_use": cached.peak_blocks,
        "peak_pool_blocks_in_use_uncached": uncached.peak_blocks,
        "wall_ms": cached.wall_ms,
        "wall_ms_uncached": uncached.wall_ms,
        "capture_ms": cached.capture_ms,
        "capture_ms_uncached": uncached.capture_ms,
        "target_tokens_per_s": work / busy * 1e3,
        "target_tokens_per_s_uncached": work / busy_uncached * 1e3,
        "throughput_ratio": busy_uncached / busy,
        "max_abs_diff_vs_uncached": max_diff,
        "tolerance": tol,
        "agrees": max_diff <= tol,
    }


def format_stream(r: StreamResult) -> str:
    s, q = r.stream, r.sequential
    shapes = ", ".join(
        f"{x['request_id']}: {x['prefix_len']}+{x['target_len']} x{x['cfg_rows']} {x['steps']} steps"
        for x in r.requests
    )
    lines = [
        f"platform: {r.platform} (device {r.device}, {r.dtype})"
        + (f", paged backend {', '.join(r.backends)}" if r.backends else "")
        + f", block size {r.block_size}, pool {r.pool_blocks} blocks",
        f"requests ({len(r.requests)}, prefix+target x CFG rows): {shapes}",
        (
            f"max |dense - paged| over every request: {r.max_abs_diff:.3g} (tolerance {r.tolerance:g}) -> "
            if r.kv_cache_dtype == "auto"
            else f"KV cache {r.kv_cache_dtype} ({r.kv_bytes_per_block} bytes per block, pool memory as with the "
            f"model's dtype): lowest final-latent cosine similarity to dense {r.min_cosine_similarity:.6f} "
            f"(bound >= {FP8_COSINE_BOUND}), max |dense - paged| {r.max_abs_diff:.3g} -> "
        )
        + ("AGREE" if r.agree else "DISAGREE"),
        f"stream: {s['wall_ms']:.0f} ms, {s['requests_per_s']:.2f} requests/s, {s['target_tokens_per_s']:.0f} "
        f"target tokens/s; {s['ticks']} steps, up to {s['max_running']} requests at once, {s['preparations']} "
        "preparations",
        f"one after another: {q['wall_ms']:.0f} ms, {q['requests_per_s']:.2f} requests/s, "
        f"{q['target_tokens_per_s']:.0f} target tokens/s; {q['ticks']} steps",
        f"throughput: {r.speedup:.2f}x the one-after-another run (same graph policy, capture time apart; "
        f"{r.speedup_with_captures:.2f}x with it)",
        f"blocks: peak {s['peak_blocks']}/{r.pool_blocks} in use, mean utilisation {s['mean_block_utilisation']:.1%}",
    ]
    if s["graph_captures"] or q["graph_captures"]:
        lines.append(
            f"CUDA graphs: stream {s['graph_captures']} captures / {s['graph_replays']} replays / "
            f"{s['eager_steps']} eager steps; one after another {q['graph_captures']} / {q['graph_replays']} / "
            f"{q['eager_steps']}; capture time: stream {s['capture_ms']:.0f} ms, one after another "
            f"{q['capture_ms']:.0f} ms"
        )
    pc = r.prefix_cache
    if pc is not None:
        lines.append(
            f"prefix cache ({pc['shared_prefixes']} distinct prefixes): {pc['hit_tokens']} prefix tokens hit, "
            f"{pc['blocks_saved']} blocks saved, {pc['published_blocks']} published, {pc['evictions']} evictions; "
            f"prefill tokens {pc['prefill_tokens']} vs {pc['prefill_tokens_uncached']} uncached"
        )
        lines.append(
            f"  peak blocks held {pc['peak_blocks_held']} vs {pc['peak_blocks_held_uncached']} uncached "
            f"({pc['blocks_held_ratio']:.2f}x); throughput {pc['target_tokens_per_s']:.0f} vs "
            f"{pc['target_tokens_per_s_uncached']:.0f} target tokens/s uncached ({pc['throughput_ratio']:.2f}x); "
            f"max |cached - uncached| {pc['max_abs_diff_vs_uncached']:.3g} -> "
            + ("AGREE" if pc["agrees"] else "DISAGREE")
        )
    if s["bucket_steps"] or q["bucket_steps"]:
        lines.append(
            f"bucketed piecewise graphs (paged attention eager between them): stream {s['bucket_steps']} steps, "
            f"one after another {q['bucket_steps']}; buckets {list(s['buckets_captured'])} tokens, graph memory "
            f"{s['bucket_graph_bytes'] / 2**20:.0f} MiB"
        )
    return "\n".join(lines)

"""The main job: the tiny DiT denoised densely and through paged KV, on one platform.

Both modes use identical weights and inputs. The paged run goes through the whole stack a
worker uses: scheduler-side allocator -> allocation snapshot -> runner backend (registry,
translator, the platform's BlockTables, metadata builder, backend and caches) -> runtime.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from diffusion_kv.core.allocator import DiffusionKVAllocator, FreeListPool, KVRequest, SequenceRequest
from diffusion_kv.core.errors import StateError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.kv_quant import cache_dtype_name
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.models.tiny_dit import TinyDiT
from diffusion_kv.platforms.interface import Platform

TOLERANCE = {torch.float32: 2e-3, torch.float16: 6e-2, torch.bfloat16: 2.5e-1, torch.float64: 1e-8}
FP8_COSINE_BOUND = 0.999
"""With an fp8_e4m3 KV cache the final latent is checked by its cosine similarity to the dense
run's (e4m3 rounds each cached K/V element by up to 2**-4 relative, so an element-wise bound
that holds for every shape would say little): at least this."""


@dataclass(frozen=True)
class DemoConfig:
    prefix_len: int = 1024
    target_len: int = 256
    steps: int = 8
    cfg_rows: int = 2
    guidance: float = 4.0
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    layers: int = 4
    block_size: int | None = None
    dtype: torch.dtype = torch.float32
    max_model_len: int = 4096
    seed: int = 0
    inject_fault: bool = False
    """Testing aid: corrupt one cached prefix block after step 0 (the run must then fail)."""
    graphs: bool | None = None
    """Capture the steady-state paged step as a CUDA graph and replay it (None: whenever every
    backend supports it on a CUDA device; False: never; True: required)."""
    kv_cache_dtype: torch.dtype | None = None
    """The pages' dtype (None: the model's; ``torch.float8_e4m3fn``: fp8 pages, scales 1.0)."""
    backend: str | None = None
    """The paged backend every KV-cache group uses (its name; None: the platform's priority list
    picks, ``DIFFUSION_KV_BACKEND`` being its default): ``--backend``."""
    warmup: bool | None = None
    """Run each mode once, untimed, before the timed runs (None: on a CUDA device), so run-time
    compilation and library set-up are reported apart (``DemoResult.warmup_ms``)."""

    def __post_init__(self) -> None:
        for name in (
            "prefix_len",
            "target_len",
            "steps",
            "hidden",
            "heads",
            "kv_heads",
            "layers",
            "max_model_len",
        ):
            if type(getattr(self, name)) is not int or getattr(self, name) <= 0:
                raise ValidationError(f"{name} must be a positive integer; got {getattr(self, name)!r}")
        if self.cfg_rows not in (1, 2):
            raise ValidationError(f"cfg_rows must be 1 or 2; got {self.cfg_rows!r}")
        if self.prefix_len + self.target_len > self.max_model_len:
            raise ValidationError(
                f"prefix_len + target_len = {self.prefix_len + self.target_len} exceeds max_model_len {self.max_model_len}"
            )


@dataclass
class DemoResult:
    platform: str
    device: str
    dtype: str
    shapes: dict[str, int]
    steps: int
    cfg_rows: int
    block_size: int
    max_abs_diff: float
    tolerance: float
    agree: bool
    dense_step_ms: list[float]
    paged_step_ms: list[float]
    kv_bytes_paged: int
    kv_bytes_dense_max_len: int
    blocks_used: int
    block_utilisation: float
    extra: dict[str, Any] = field(default_factory=dict)
    kv_cache_dtype: str = "auto"
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)
    """K and V bytes one token takes over every layer, in the model's dtype and in fp8_e4m3."""
    cosine_similarity: float = 1.0
    """Of the final latents, paged against dense (the agreement check with an fp8 cache)."""
    warmup_ms: dict[str, float] = field(default_factory=dict)
    """Wall time of each mode's untimed warm-up pass (``dense``, ``paged``); empty without one."""
    capture_step: int | None = None
    """The paged step that captured the CUDA graph (one eager step plus the capture, a one-off
    cost); None when the paged run did not capture."""
    backends: tuple[str, ...] = ()
    """The paged backend(s) that served the KV-cache groups (``platform:backend``)."""

    @property
    def dense_total_ms(self) -> float:
        return sum(self.dense_step_ms)

    @property
    def paged_total_ms(self) -> float:
        return sum(self.paged_step_ms)

    @property
    def speedup(self) -> float:
        return self.dense_total_ms / self.paged_total_ms

    @property
    def capture_step_ms(self) -> float:
        """Wall time of the capturing paged step (0 without a capture)."""
        return self.paged_step_ms[self.capture_step] if self.capture_step is not None else 0.0

    @property
    def speedup_without_capture(self) -> float:
        """The whole-run speedup with the capturing step left out of both runs (the same as
        :attr:`speedup` when nothing was captured)."""
        k = self.capture_step
        if k is None:
            return self.speedup
        return (self.dense_total_ms - self.dense_step_ms[k]) / (self.paged_total_ms - self.paged_step_ms[k])

    @property
    def steady_speedup(self) -> float:
        """Median dense step over median paged step, step 0 (the full write) left out of both."""
        if len(self.paged_step_ms) < 2 or len(self.dense_step_ms) < 2:
            return float("nan")
        return statistics.median(self.dense_step_ms[1:]) / statistics.median(self.paged_step_ms[1:])

    @property
    def ideal_speedup(self) -> float:
        """Tokens a dense step computes per token a paged step computes: (prefix + target) /
        target. The projections and MLPs scale with it; attention less (a paged target query
        still reads every cached key)."""
        return float(self.shapes["seq_len"] / self.shapes["target_len"])

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            dense_total_ms=self.dense_total_ms,
            paged_total_ms=self.paged_total_ms,
            speedup=self.speedup,
            speedup_without_capture=self.speedup_without_capture,
            capture_step_ms=self.capture_step_ms,
            steady_state_speedup=self.steady_speedup,
            ideal_speedup=self.ideal_speedup,
        )
        return out


Progress = Callable[[str, int, int], None]


def _inputs(cfg: DemoConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    prefixes = torch.randn(cfg.cfg_rows, cfg.prefix_len, cfg.hidden, generator=g)
    latent = torch.randn(1, cfg.target_len, cfg.hidden, generator=g)
    return prefixes.to(device, cfg.dtype), latent.to(device, cfg.dtype)


def combine_guidance(guidance: float, velocity: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance over ``[cond, uncond]`` rows (one row: returned as is)."""
    if velocity.shape[0] == 1:
        return velocity
    cond, uncond = velocity[0:1], velocity[1:2]
    return uncond + guidance * (cond - uncond)


def _combine(cfg: DemoConfig, velocity: torch.Tensor) -> torch.Tensor:
    return combine_guidance(cfg.guidance, velocity)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_dense(
    model: TinyDiT, cfg: DemoConfig, device: torch.device, progress: Progress
) -> tuple[torch.Tensor, list[float]]:
    prefixes, latent = _inputs(cfg, device)
    times = []
    dt = 1.0 / cfg.steps
    with torch.no_grad():
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            target = latent.expand(cfg.cfg_rows, -1, -1)
            velocity = model.dense_step(prefixes, target, 1.0 - step * dt)
            latent = latent - dt * _combine(cfg, velocity)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            progress("dense", step + 1, cfg.steps)
    return latent, times


def run_paged(
    model: TinyDiT, cfg: DemoConfig, platform: Platform, device: torch.device, progress: Progress
) -> tuple[torch.Tensor, list[float], dict[str, Any]]:
    block = cfg.block_size or platform.default_block_size
    seq_len = cfg.prefix_len + cfg.target_len
    rows = cfg.cfg_rows
    num_blocks = rows * cdiv(seq_len, block) + 1
    mc = model.cfg
    runner = paged_runner(
        platform,
        RunnerConfig(
            max_model_len=cfg.max_model_len,
            max_rows_per_request=rows,
            max_num_seqs=1,
            max_num_batched_tokens=rows * seq_len,
            device=device,
            kv_cache_dtype=cfg.kv_cache_dtype or "auto",
            backend=cfg.backend,
        ),
        {name: PagedLayerSpec(mc.heads, mc.kv_heads, mc.head_size, mc.dtype) for name in model.layer_names},
        num_blocks,
        block,
        cfg.graphs,
    )
    allocator = DiffusionKVAllocator(
        block_size=block,
        max_model_len=cfg.max_model_len,
        max_rows_per_request=rows,
        worker_rows=runner.layout.max_num_reqs if runner.layout else rows,
        pool=FreeListPool(num_blocks),
    )
    request = KVRequest(
        "demo", tuple(SequenceRequest(i, cfg.prefix_len, cfg.target_len) for i in range(rows))
    )
    snapshot = allocator.reserve(request)
    if snapshot is None:  # pragma: no cover - the pool is sized for the request
        raise StateError("the demo's block pool cannot hold the request")
    prefixes, latent = _inputs(cfg, device)
    times: list[float] = []
    dt = 1.0 / cfg.steps
    phases = PhaseRows(
        tuple(PagedRow("demo", seq_len, seq_len, 0, sequence_id=i) for i in range(rows)),
        tuple(PagedRow("demo", cfg.target_len, seq_len, cfg.prefix_len, sequence_id=i) for i in range(rows)),
    )
    use_graphs = runner.supports_graph_capture if cfg.graphs is None else cfg.graphs
    captured = None
    capture_step: int | None = None

    def denoise_step(target: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model.paged_step(prefixes, target, t, 1, runner.forward)

    try:
        runner.install(snapshot)
        with torch.no_grad(), runner.activate(phases) as runtime:
            for step in range(cfg.steps):
                t0 = time.perf_counter()
                runtime.ensure_active(step)
                target = latent.expand(rows, -1, -1)
                if use_graphs and step >= 2:  # the denoise batch is settled: capture once, replay
                    inputs = (target.contiguous(), torch.full((), 1.0 - step * dt, device=device))
                    if captured is None or not captured.valid:
                        captured = runner.capture(denoise_step, *inputs)
                        velocity = captured.warmup_output
                        capture_step = step
                    else:
                        velocity = captured.replay(*inputs)
                else:
                    velocity = model.paged_step(prefixes, target, 1.0 - step * dt, step, runner.forward)
                latent = latent - dt * _combine(cfg, velocity)
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
                if step == 0 and cfg.inject_fault:
                    _corrupt(runner, snapshot.sequences[0].block_ids[0][0])
                progress("paged", step + 1, cfg.steps)
    finally:
        runner.remove(["demo"])
        allocator.free("demo")
    blocks_used = sum(len(s.block_ids[0]) for s in snapshot.sequences)
    info = {
        "block_size": block,
        "blocks_used": blocks_used,
        "kv_bytes_paged": blocks_used * runner.kv_bytes_per_block(),
        "tokens": rows * seq_len,
        "preparations": 2 if cfg.steps > 1 else 1,
        "graph_replays": captured.replays if captured is not None else 0,
        "graphs": bool(use_graphs),
        "capture_step": capture_step,
        "backends": served_by(runner),
    }
    return latent, times, info


def wants_graph_capture(graphs: bool | None, device: torch.device) -> bool:
    """Whether a run states graph capture as a selection requirement (``RunnerConfig.graph_capture``):
    ``graphs`` when given, else on a CUDA device (the only one that captures)."""
    return graphs if graphs is not None else device.type == "cuda"


def paged_runner(
    platform: Platform,
    config: RunnerConfig,
    layers: dict[str, PagedLayerSpec],
    num_blocks: int,
    block_size: int,
    graphs: bool | None,
) -> PagedWorker:
    """A runner with ``layers`` registered and its cache initialised, stating graph capture as a
    selection requirement where the run wants graphs (:func:`wants_graph_capture`), so a backend
    that cannot be captured is not picked for it. With ``graphs=None`` (capture where possible)
    and no backend able to serve the requirement (a forced one that cannot be captured, say),
    the runner is built without it and the run stays eager; ``graphs=True`` is refused then."""
    device = config.device if config.device is not None else platform.device()
    want = wants_graph_capture(graphs, torch.device(device))

    def build(capture: bool) -> PagedWorker:
        runner = PagedWorker(platform, dataclasses.replace(config, graph_capture=capture))
        runner.register_kv_cache_layers(layers)
        runner.initialize_kv_cache(num_blocks=num_blocks, block_size=block_size)
        return runner

    if not want:
        return build(False)
    try:
        return build(True)
    except UnsupportedRequirementsError:
        if graphs is not None:
            raise
        return build(False)


def served_by(runner: PagedWorker) -> tuple[str, ...]:
    """``platform:backend`` of each backend serving a KV-cache group of ``runner`` (once each)."""
    return tuple(dict.fromkeys(f"{runner.platform.name}:{b.name}" for b in runner.backends))


def _corrupt(runner: PagedWorker, block_id: int) -> None:
    name = next(iter(runner.kv_caches))
    cache = runner.kv_caches[name]
    tensors = cache if isinstance(cache, tuple) else (cache[0],)
    page = tensors[0][block_id]
    if page.dtype == torch.float8_e4m3fn:  # the largest key: every query then attends to this block
        page.copy_(torch.full(page.shape, 448.0, device=page.device).to(page.dtype))
    else:
        page.add_(1.0)


def build_model(cfg: DemoConfig, device: torch.device) -> TinyDiT:
    return TinyDiT.build(cfg, device)


def make_result(
    platform: Platform,
    cfg: DemoConfig,
    device: torch.device,
    max_abs_diff: float,
    dense_ms: list[float],
    paged_ms: list[float],
    info: dict[str, Any],
    extra: dict[str, Any] | None = None,
    cosine_similarity: float = 1.0,
) -> DemoResult:
    """The demo's report; ``max_abs_diff`` is ``inf`` when the paged output is not finite. With an
    fp8 cache the outputs agree when their cosine similarity is at least
    :data:`FP8_COSINE_BOUND` (the max difference is reported)."""
    head_size = cfg.hidden // cfg.heads
    tol = TOLERANCE.get(cfg.dtype, 1e-1)
    per_token = 2 * cfg.kv_heads * head_size * torch.empty((), dtype=cfg.dtype).element_size()
    quantized = cfg.kv_cache_dtype is not None and cfg.kv_cache_dtype != cfg.dtype
    agree = cosine_similarity >= FP8_COSINE_BOUND if quantized else max_abs_diff <= tol
    return DemoResult(
        platform=platform.name,
        device=str(device),
        dtype=str(cfg.dtype).removeprefix("torch."),
        shapes={
            "prefix_len": cfg.prefix_len,
            "target_len": cfg.target_len,
            "seq_len": cfg.prefix_len + cfg.target_len,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "kv_heads": cfg.kv_heads,
            "head_size": head_size,
            "layers": cfg.layers,
            "max_model_len": cfg.max_model_len,
        },
        steps=cfg.steps,
        cfg_rows=cfg.cfg_rows,
        block_size=info["block_size"],
        max_abs_diff=max_abs_diff,
        tolerance=tol,
        agree=agree,
        dense_step_ms=dense_ms,
        paged_step_ms=paged_ms,
        kv_bytes_paged=info["kv_bytes_paged"],
        kv_bytes_dense_max_len=cfg.cfg_rows * cfg.max_model_len * per_token * cfg.layers,
        blocks_used=info["blocks_used"],
        block_utilisation=info["tokens"] / (info["blocks_used"] * info["block_size"]),
        extra=extra or {},
        capture_step=info.get("capture_step"),
        kv_cache_dtype=cache_dtype_name(cfg.kv_cache_dtype if quantized else None),
        kv_bytes_per_token={
            str(cfg.dtype).removeprefix("torch."): per_token * cfg.layers,
            "fp8_e4m3": 2 * cfg.kv_heads * head_size * cfg.layers,
        },
        cosine_similarity=cosine_similarity,
        backends=tuple(b if ":" in b else f"{platform.name}:{b}" for b in info.get("backends", ())),
    )


def max_difference(dense: torch.Tensor, paged: torch.Tensor) -> torch.Tensor:
    """Largest absolute difference as a 1-element tensor; ``inf`` if paged is not finite."""
    if not bool(torch.isfinite(paged).all()):
        return torch.full((1,), float("inf"), device=paged.device)
    return (dense.float() - paged.float()).abs().max().reshape(1)


def run_demo(
    platform: Platform, cfg: DemoConfig, progress: Progress | None = None, device: torch.device | None = None
) -> DemoResult:
    device = device or platform.device()
    progress = progress or (lambda _mode, _i, _n: None)
    model = build_model(cfg, device)
    warmup_ms = warm_up(model, cfg, platform, device) if _warms_up(cfg, device) else {}
    dense_out, dense_ms = run_dense(model, cfg, device, progress)
    paged_out, paged_ms, info = run_paged(model, cfg, platform, device, progress)
    diff = float(max_difference(dense_out, paged_out).item())
    extra = {"graphs": info["graphs"], "graph_replays": info["graph_replays"]}
    result = make_result(
        platform, cfg, device, diff, dense_ms, paged_ms, info, extra, cosine(dense_out, paged_out)
    )
    result.warmup_ms = warmup_ms
    return result


def _warms_up(cfg: DemoConfig, device: torch.device) -> bool:
    return cfg.warmup if cfg.warmup is not None else device.type == "cuda"


def warm_up(model: TinyDiT, cfg: DemoConfig, platform: Platform, device: torch.device) -> dict[str, float]:
    """One untimed pass of each mode over the first two steps (the full write and the first
    cached step: every kernel shape the timed runs use), so run-time compilation and library
    set-up stay out of the timed steps; returns each pass's wall time (ms)."""
    short = dataclasses.replace(cfg, steps=min(cfg.steps, 2), inject_fault=False)
    quiet: Progress = lambda _mode, _i, _n: None  # noqa: E731
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    run_dense(model, short, device, quiet)
    out["dense"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    run_paged(model, short, platform, device, quiet)
    out["paged"] = (time.perf_counter() - t0) * 1e3
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two tensors as flat vectors (float64; 0 when one is not finite)."""
    x, y = a.double().flatten(), b.double().flatten()
    if not bool(torch.isfinite(y).all()):
        return 0.0
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0).item())


def _whole_run(r: DemoResult) -> str:
    if r.capture_step is None:
        return f"whole run {r.paged_total_ms:.0f} ms vs {r.dense_total_ms:.0f} ms ({r.speedup:.2f}x over {r.steps} steps)"
    k = r.capture_step
    return (
        f"whole run {r.paged_total_ms - r.paged_step_ms[k]:.0f} ms vs {r.dense_total_ms - r.dense_step_ms[k]:.0f} ms "
        f"({r.speedup_without_capture:.2f}x over {r.steps - 1} steps, step {k} left out of both: it captured "
        f"the CUDA graph, a one-off {r.capture_step_ms:.0f} ms for one eager step and the capture; "
        f"{r.speedup:.2f}x with it)"
    )


def format_result(r: DemoResult) -> str:
    mib = 1024 * 1024
    s = r.shapes
    lines = [
        f"platform: {r.platform} (device {r.device}, {r.dtype})"
        + (f", paged backend {', '.join(r.backends)}" if r.backends else ""),
        f"shapes: prefix {s['prefix_len']} + target {s['target_len']} tokens, hidden {s['hidden']}, "
        f"heads {s['heads']} (kv {s['kv_heads']}, head size {s['head_size']}), layers {s['layers']}",
        f"steps: {r.steps}, CFG rows: {r.cfg_rows}, block size: {r.block_size}",
        (
            f"max |dense - paged|: {r.max_abs_diff:.3g} (tolerance {r.tolerance:g}) -> {'AGREE' if r.agree else 'DISAGREE'}"
            if r.kv_cache_dtype == "auto"
            else f"fp8 KV cache ({r.kv_cache_dtype}): final latent cosine similarity to dense "
            f"{r.cosine_similarity:.6f} (bound >= {FP8_COSINE_BOUND}), max |dense - paged| {r.max_abs_diff:.3g} -> "
            + ("AGREE" if r.agree else "DISAGREE")
        ),
        "KV bytes per token (K and V, every layer): "
        + ", ".join(f"{k} {v}" for k, v in r.kv_bytes_per_token.items()),
        f"steady-state speedup: {r.steady_speedup:.2f}x per denoise step (median dense step "
        + (f"{statistics.median(r.dense_step_ms[1:]):.1f} ms" if len(r.dense_step_ms) > 1 else "-")
        + " / median paged step "
        + (f"{statistics.median(r.paged_step_ms[1:]):.1f} ms" if len(r.paged_step_ms) > 1 else "-")
        + ", step 0 left out)",
        f"ideal for this shape: about {r.ideal_speedup:.1f}x by token count (a paged step computes the "
        f"{s['target_len']} target tokens of {s['seq_len']}; its attention still reads every cached key)",
        f"step 0 (paged: writes every K/V): {r.paged_step_ms[0]:.1f} ms vs dense {r.dense_step_ms[0]:.1f} ms; "
        + _whole_run(r),
        f"KV memory: paged blocks {r.kv_bytes_paged / mib:.2f} MiB vs dense max-length cache "
        f"{r.kv_bytes_dense_max_len / mib:.2f} MiB (max_model_len {s['max_model_len']})",
        f"block utilisation: {r.block_utilisation:.1%} of {r.blocks_used} blocks",
    ]
    if r.extra.get("graphs"):
        lines.append(
            f"steady-state paged steps: CUDA graph replays ({r.extra['graph_replays']} after one capture)"
        )
    if r.warmup_ms:
        lines.append(
            "warm-up before timing (one-off: compilation, library set-up; in no figure above): "
            + ", ".join(f"{mode} {ms:.0f} ms" for mode, ms in r.warmup_ms.items())
        )
    par = r.extra.get("parallel")
    if par:
        lines.insert(
            3,
            f"parallel: {par['world_size']} ranks ({par['backend']}), Ulysses degree {par['ulysses_degree']}, "
            f"CFG-parallel size {par['cfg_parallel_size']}"
            + (
                f", DCP size {par['dcp_size']} (interleave {par['dcp_interleave']})"
                if par.get("dcp_size", 1) > 1
                else ""
            )
            + f"; per rank {par['rank_local_heads']} heads (kv {par['rank_local_kv_heads']})"
            + (f", paged backend {'/'.join(par['paged_backends'])}" if par.get("paged_backends") else "")
            + "; agreement is the largest difference over all ranks",
        )
        lines[-2] += " (rank 0's share)"
    return "\n".join(lines)

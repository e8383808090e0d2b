"""The main job's session mode: a stream of chunks through a paged session, against two dense
ways of doing the same work.

The tiny chunk-causal DiT (:mod:`.session_dit`) generates ``chunks`` chunks of ``chunk_tokens``
tokens, each denoised in ``steps`` steps from its own seeded noise; the K/V a chunk's last step
writes are what later chunks attend to (sink + window + the chunk itself). Three ways run the
same chunks, interleaved chunk by chunk so that a noisy machine slows all three alike:

* ``paged`` -- a :class:`~diffusion_kv.core.sessions.SessionCache` on the chosen platform and
  backend: each step writes only the chunk's K/V into its pages; commit keeps them and releases
  what slid out of the window;
* ``recompute`` -- no cache: every step runs the model over the visible chunks (the sink and
  the window, from the inputs they were committed with) and the chunk, block-causal by chunk;
* ``concat`` -- a dense rolling cache per layer, rebuilt with ``torch.cat`` (sink + window +
  the new chunk) at every commit and concatenated with the chunk's K/V at every step, the way
  LingBot-World's rolling cache does it.

A fourth, untimed run is the oracle: every chunk's K/V kept densely for the whole history and
attention under the session's own :class:`~diffusion_kv.core.attention.MaskSpec` row mask. The
paged chunks must match it within the conformance kit's tolerance (``agrees``); the torch.cat
chunks are compared with the paged ones too. ``recompute`` is a timing and memory baseline only:
the context chunks it re-runs see only what is still visible to the new chunk, so its outputs
differ from a cached session's by construction.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from diffusion_kv.core.allocator import DiffusionKVAllocator, FreeListPool
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import Chunk, SessionCache, SessionPolicy
from diffusion_kv.models.demo import combine_guidance, served_by
from diffusion_kv.models.session_dit import CrossContext, SessionDiT, cross_attention_context
from diffusion_kv.platforms.interface import Platform

MODES = ("paged", "recompute", "concat")
ALL_MODES = (*MODES, "contiguous", "chunk_only", "graphs")
"""``graphs`` (CUDA only): the paged session again, each denoise step run through CUDA graphs
kept per batch shape (:meth:`~diffusion_kv.core.runner.PagedWorker.step_graphs`): one graph per
window-fill shape where the backend gives a graph key (the cuda Triton way); a batch without one
(the gather + SDPA way) runs eagerly, as a capture per chunk costs more than its few replays save.
The captures are inside the chunks' times.
``contiguous``: the best dense rolling cache -- one preallocated buffer per layer holding sink,
window and chunk contiguously, the chunk's K/V written in place each step, the window shifted down
one chunk at commit (the GPU shape's FlashAttention baseline). ``chunk_only``: the floor no cache
can go under -- the model over the chunk alone, its self-attention over the chunk's own keys (no
sink, no window): the work every way does for the chunk itself, timed to say how far the
token-count ideal is reachable at a shape (:attr:`SessionResult.speedup_ceiling`)."""
KIT_TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
"""``(atol, rtol)`` per dtype: the conformance kit's defaults (``conformance.reference.tolerance``,
which this package layer may not import; a unit test keeps the two equal)."""
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class SessionConfig:
    chunks: int = 24
    chunk_tokens: int = 64
    window_chunks: int = 3
    sink_chunks: int = 1
    steps: int = 4
    branches: int = 1
    """CFG branches (2: conditional and unconditional rows, one session row each)."""
    guidance: float = 4.0
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    layers: int = 2
    text_tokens: int = 16
    block_size: int | None = None
    dtype: torch.dtype = torch.float32
    seed: int = 0
    backend: str | None = None
    repeats: int = 1
    """Whole streams run per mode; each chunk's time is its fastest over them."""
    abort_chunk: int | None = None
    """Before this chunk runs for good, it is appended, denoised and aborted once (untimed): the
    session must be exactly as before."""
    failing_session: bool = False
    """After the stream, a second session runs two chunks and fails in its third's denoise step."""
    modes: tuple[str, ...] = MODES
    """The ways timed besides the oracle: ``paged`` and any of ``recompute``, ``concat``,
    ``contiguous``, ``chunk_only``."""

    def __post_init__(self) -> None:
        for name in (
            "chunks",
            "chunk_tokens",
            "steps",
            "hidden",
            "heads",
            "kv_heads",
            "layers",
            "text_tokens",
            "repeats",
        ):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValidationError(f"session {name} must be a positive integer; got {value!r}")
        for name in ("window_chunks", "sink_chunks"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValidationError(f"session {name} must be an integer >= 0; got {value!r}")
        if self.branches not in (1, 2):
            raise ValidationError(f"session branches must be 1 or 2; got {self.branches!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValidationError(
                f"hidden {self.hidden} must divide by heads {self.heads} into an even head size, and heads by "
                f"kv_heads {self.kv_heads}"
            )
        if "paged" not in self.modes or any(m not in ALL_MODES for m in self.modes):
            raise ValidationError(
                f"session modes must include paged and come from {ALL_MODES}; got {self.modes}"
            )
        if self.abort_chunk is not None and not 0 <= self.abort_chunk < self.chunks:
            raise ValidationError(f"abort_chunk {self.abort_chunk} is not a chunk index below {self.chunks}")

    @property
    def policy(self) -> SessionPolicy:
        return SessionPolicy(self.chunk_tokens, self.window_chunks, self.sink_chunks)

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def window_filled_at(self) -> int:
        """The first chunk that sees a full sink and window."""
        return self.sink_chunks + self.window_chunks

    def visible_chunks(self, index: int) -> list[int]:
        """Earlier chunks chunk ``index`` attends to (sink first, then the window), ascending."""
        sink = list(range(min(self.sink_chunks, index)))
        return sink + list(range(max(self.sink_chunks, index - self.window_chunks), index))


@dataclass
class SessionResult:
    platform: str
    device: str
    dtype: str
    backends: tuple[str, ...]
    shapes: dict[str, int]
    block_size: int
    chunk_ms: dict[str, list[float]]
    """Per mode, each chunk's wall time (append, every denoise step, commit)."""
    kv_bytes: dict[str, list[int]]
    """Per mode, the K/V bytes held while each chunk runs (see ``format_session``)."""
    agrees: bool
    max_abs_diff: float
    """Paged chunk outputs against the dense oracle over the same mask, over every chunk."""
    tolerance: dict[str, float]
    baseline_max_abs_diff: dict[str, float]
    """Dense rolling caches (``concat``, ``contiguous``): their chunk outputs against the paged ones."""
    chunk_kv_bytes: int
    """One chunk's own K/V over every layer and branch, in the cache's dtype."""
    bytes_copied_per_chunk: int
    """Paged: bytes written into the cache to commit a chunk -- the committing step's write plus
    whatever commit moves (it only edits block tables) -- the largest over every chunk."""
    bytes_written_per_step: int
    """Paged: bytes one denoise step writes into the cache (the chunk's K/V, in place), the
    largest over every step."""
    baseline_bytes_copied: dict[str, dict[str, int]]
    """Dense rolling caches: bytes copied at a commit (``per_chunk``; torch.cat: the rebuild of
    sink + window + chunk, read and written; contiguous: the window shifted down) and by one
    denoise step (``per_step``; torch.cat: cache and chunk concatenated; contiguous: the chunk
    written in place), every layer, the largest seen."""
    kv_bytes_peak: int
    kv_bytes_bound: int
    pool_full_after: bool
    pool_checks: dict[str, bool]
    abort: dict[str, Any] | None = None
    failing_session: dict[str, Any] | None = None
    cross_context_bytes: int = 0
    dense_max_abs_diff: dict[str, float] = field(default_factory=dict)
    """The dense rolling caches timed beside the paged session (``concat``, ``contiguous``: they
    keep the chunks' K/V as the paged cache does; ``recompute`` recomputes them from the committed
    latents, another computation): their chunk outputs against the same oracle, over every chunk --
    how far the model's dtype alone takes a dense way from the oracle (deep 16-bit stacks drift
    past the kit's per-call tolerance)."""
    oracle_max_abs: float = 0.0
    """The largest magnitude of the oracle's chunk outputs (sets :attr:`rounding_step`)."""
    extra: dict[str, Any] = field(default_factory=dict)

    # -- figures -------------------------------------------------------------------------------

    @property
    def steady(self) -> range:
        """Chunks after the window filled."""
        return range(
            min(self.shapes["window_filled_at"], len(self.chunk_ms["paged"])), len(self.chunk_ms["paged"])
        )

    def _median(self, mode: str, chunks: range) -> float:
        times = [self.chunk_ms[mode][i] for i in chunks]
        return statistics.median(times) if times else float("nan")

    def _ratio(self, mode: str) -> float | None:
        """Median paged chunk time over ``mode``'s after the window filled (None: not run)."""
        if mode not in self.chunk_ms:
            return None
        return self._median("paged", self.steady) / self._median(mode, self.steady)

    @property
    def speedup_vs_recompute(self) -> float | None:
        ratio = self._ratio("recompute")
        return None if ratio is None else 1.0 / ratio

    @property
    def speedup_ceiling(self) -> float | None:
        """Recompute's median chunk time over ``chunk_only``'s: the speedup over recomputing a
        cache that cost nothing at all would reach at this shape (None: either way not run).
        Below :attr:`ideal_vs_recompute` where the model's per-chunk work does not scale with
        its tokens (small matrices, per-call overheads)."""
        if "recompute" not in self.chunk_ms or "chunk_only" not in self.chunk_ms:
            return None
        return self._median("recompute", self.steady) / self._median("chunk_only", self.steady)

    @property
    def ideal_vs_recompute(self) -> float:
        """Tokens a recompute step runs per token a paged step runs, after the window filled."""
        s = self.shapes
        return float(s["sink_chunks"] + s["window_chunks"] + 1)

    @property
    def rounding_step(self) -> float:
        """One rounding step of the model's dtype at the oracle's largest output magnitude (the
        spacing of representable values there; 0 when unknown)."""
        if self.oracle_max_abs <= 0 or not math.isfinite(self.oracle_max_abs):
            return 0.0
        eps = torch.finfo(getattr(torch, self.dtype)).eps
        return float(eps * 2.0 ** math.floor(math.log2(self.oracle_max_abs)))

    @property
    def agrees_as_dense(self) -> bool | None:
        """The paged chunks no further from the oracle than the furthest dense way of the same
        run (the same model in the same dtype), give or take one rounding step of that dtype at
        the outputs' largest magnitude (:attr:`rounding_step`: a kernel summing in another order
        may round one element of a deep 16-bit stack the other way): paging adds no error of
        its own. None when no dense way ran."""
        if not self.dense_max_abs_diff:
            return None
        return self.max_abs_diff <= max(self.dense_max_abs_diff.values()) + self.rounding_step

    @property
    def time_vs_concat(self) -> float | None:
        return self._ratio("concat")

    @property
    def time_vs_contiguous(self) -> float | None:
        return self._ratio("contiguous")

    @property
    def graphs_vs_paged(self) -> float | None:
        """Median chunk time with CUDA graphs over the eager paged one's, after the window
        filled (None: the graphs mode did not run)."""
        if "graphs" not in self.chunk_ms:
            return None
        return self._median("graphs", self.steady) / self._median("paged", self.steady)

    @property
    def graphs_vs_contiguous(self) -> float | None:
        """Median chunk time with CUDA graphs over the contiguous rolling cache's (eager)."""
        if "graphs" not in self.chunk_ms or "contiguous" not in self.chunk_ms:
            return None
        return self._median("graphs", self.steady) / self._median("contiguous", self.steady)

    @property
    def flatness(self) -> float:
        """Median paged chunk time over the last quarter of chunks / over as many chunks right
        after the window filled (nan when the stream is too short for both)."""
        n, first = len(self.chunk_ms["paged"]), self.shapes["window_filled_at"]
        q = max(1, n // 4)
        if n - q < first + q:
            return float("nan")
        return self._median("paged", range(n - q, n)) / self._median("paged", range(first, first + q))

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()}
        out["backends"] = list(self.backends)
        out.update(
            speedup_vs_recompute=self.speedup_vs_recompute,
            ideal_vs_recompute=self.ideal_vs_recompute,
            speedup_ceiling=self.speedup_ceiling,
            time_vs_concat=self.time_vs_concat,
            time_vs_contiguous=self.time_vs_contiguous,
            graphs_vs_paged=self.graphs_vs_paged,
            graphs_vs_contiguous=self.graphs_vs_contiguous,
            flatness=self.flatness,
            agrees_as_dense=self.agrees_as_dense,
            rounding_step=self.rounding_step,
            median_chunk_ms={m: self._median(m, self.steady) for m in self.chunk_ms},
        )
        return out


# -- the streams -------------------------------------------------------------------------------


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, L, H, D]`` layouts in and out; GQA by SDPA's own head grouping."""
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
    )
    return out.transpose(1, 2)


class _Base:
    def __init__(
        self, model: SessionDiT, cfg: SessionConfig, cross: CrossContext, device: torch.device
    ) -> None:
        self.model, self.cfg, self.cross, self.device = model, cfg, cross, device
        self.dt = 1.0 / cfg.steps
        self.count_copies = True
        """Whether the dense ways count the bytes each step copies (``run_session`` counts in
        its first run only)."""
        self.per_token_layer = (
            2 * cfg.kv_heads * cfg.head_size * torch.empty((), dtype=cfg.dtype).element_size()
        )
        """K and V bytes of one token in one layer and branch (the model's dtype)."""

    def positions(self, index: int) -> torch.Tensor:
        c = self.cfg.chunk_tokens
        return torch.arange(index * c, (index + 1) * c, device=self.device)

    def denoise(
        self, index: int, noise: torch.Tensor, step: Callable[[int, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The chunk's denoise loop: ``step(s, x)`` runs the model on the embedded chunk ``x``."""
        latent = noise
        for s in range(self.cfg.steps):
            x = self.model.embed(latent.expand(self.cfg.branches, -1, -1), 1.0 - s * self.dt)
            latent = latent - self.dt * combine_guidance(self.cfg.guidance, step(s, x))
        return latent


class PagedStream(_Base):
    """The session through :class:`SessionCache` (pool sized to the session's bound exactly: a
    chunk needing more fails)."""

    def __init__(
        self,
        model: SessionDiT,
        cfg: SessionConfig,
        cross: CrossContext,
        device: torch.device,
        platform: Platform,
        session_id: str = "session",
        count_writes: bool = True,
        graphs: bool = False,
    ) -> None:
        super().__init__(model, cfg, cross, device)
        policy = cfg.policy
        block = cfg.block_size or platform.default_block_size
        max_len = cfg.chunks * cfg.chunk_tokens + block
        self.worker = PagedWorker(
            platform,
            RunnerConfig(
                max_model_len=max_len,
                max_rows_per_request=cfg.branches,
                max_num_seqs=2,
                max_num_batched_tokens=cfg.branches * cfg.chunk_tokens,
                device=device,
                backend=cfg.backend,
            ),
        )
        self.worker.register_kv_cache_layers(
            {
                name: PagedLayerSpec(cfg.heads, cfg.kv_heads, cfg.head_size, cfg.dtype, mode=policy.mask)
                for name in model.layer_names
            }
        )
        self.block = block
        self.bound_blocks = self._bound_blocks(policy, block)
        self.num_blocks = cfg.branches * self.bound_blocks
        self.worker.initialize_kv_cache(num_blocks=self.num_blocks, block_size=block)
        self.pool = FreeListPool(self.num_blocks)
        allocator = DiffusionKVAllocator(
            block_size=block,
            max_model_len=max_len,
            max_rows_per_request=cfg.branches,
            worker_rows=self.worker.layout.max_num_reqs if self.worker.layout else 2 * cfg.branches,
            pool=self.pool,
        )
        self.cache = SessionCache(self.worker, allocator, policy)
        self.session = self.cache.begin_session(session_id, cfg.branches)
        self.bytes_per_block = self.worker.kv_bytes_per_block()
        self.written = 0
        if count_writes and graphs:
            raise ValidationError(
                "a graphed session stream cannot count its writes (replays run no host code)"
            )
        if count_writes:  # run_session counts in its first run only: later runs time the bare path
            self._count_writes()
        self.graphs = self.worker.step_graphs() if graphs else None
        """Captured denoise steps kept per batch shape (None: every step eager)."""

    @staticmethod
    def _bound_blocks(policy: SessionPolicy, block: int) -> int:
        """``SessionCache.kv_blocks_bound`` before a cache exists (the same sum)."""
        return (
            cdiv(policy.sink_chunks * policy.chunk_tokens, block)
            + cdiv(((policy.window_chunks or 0) + 1) * policy.chunk_tokens, block)
            + 1
        )

    def _count_writes(self) -> None:
        """Count the bytes every backend's K/V writer is handed (tokens x K and V rows in the
        cache's dtype): what the paged path copies into its cache. The caches' element sizes
        are looked up once per cache object, so the count costs the timed path next to
        nothing."""
        sizes: dict[int, int] = {}

        def bytes_per_element(kv_cache: Any) -> int:
            size = sizes.get(id(kv_cache))
            if size is None:
                kc, vc = key_value_caches(kv_cache)
                size = sizes[id(kv_cache)] = kc.element_size() + vc.element_size()
            return size

        for backend in dict.fromkeys(self.worker.backends):

            def counted(
                inner: Callable[..., None], valid: bool
            ) -> Callable[[Any, torch.Tensor, torch.Tensor, Any, torch.Tensor], None]:
                def write(
                    layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slots: torch.Tensor
                ) -> None:
                    inner(layer, key, value, kv_cache, slots)
                    per_token = key.numel() // key.shape[0] if key.shape[0] else 0
                    n = key.shape[0] if valid else int((slots.reshape(-1)[: key.shape[0]] >= 0).sum())
                    self.written += n * per_token * bytes_per_element(kv_cache)

                return write

            backend.write_kv_valid = counted(backend.write_kv_valid, True)  # type: ignore[method-assign,assignment]
            backend.write_kv = counted(backend.write_kv, False)  # type: ignore[method-assign,assignment]

    def held_bytes(self) -> int:
        return len(self.cache.allocator.blocks_of(self.session.session_id)) * self.bytes_per_block

    def _steps(self, chunk: Chunk, noise: torch.Tensor, record: list[int]) -> torch.Tensor:
        positions = self.positions(chunk.index)
        rows = chunk.rows()
        worker = self.worker
        with worker.stepper() as runtime:
            graphs = self.graphs
            if graphs is not None:

                def model_step(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
                    return self.model.run(x, at, worker.forward, self.cross, self.cfg.chunk_tokens)

                def replayed(_s: int, x: torch.Tensor) -> torch.Tensor:
                    runtime.ensure_rows(rows)
                    out: torch.Tensor = graphs.run(model_step, x, positions)
                    return out  # a static buffer of the graph: consumed before the next step

                return self.denoise(chunk.index, noise, replayed)

            def step(_s: int, x: torch.Tensor) -> torch.Tensor:
                runtime.ensure_rows(rows)
                before = self.written
                out = self.model.run(x, positions, worker.forward, self.cross, self.cfg.chunk_tokens)
                record.append(self.written - before)
                return out

            return self.denoise(chunk.index, noise, step)

    def append(self) -> Chunk:
        chunk = self.cache.append_chunk(self.session)
        if chunk is None:
            raise StateError(
                f"session {self.session.session_id!r}: the pool of {self.num_blocks} blocks (the session's bound) "
                f"cannot hold chunk {self.session.chunks_committed}"
            )
        return chunk

    def run(self, index: int, noise: torch.Tensor) -> tuple[torch.Tensor, int, list[int], int]:
        """One chunk: ``(latent, K/V bytes held while it ran, bytes each step wrote, bytes the
        commit path wrote)``."""
        chunk = self.append()
        if chunk.index != index:
            raise StateError(f"session chunk {chunk.index} where chunk {index} was expected")
        held = self.held_bytes()
        per_step: list[int] = []
        latent = self._steps(chunk, noise, per_step)
        before = self.written
        self.cache.commit(chunk)
        if not per_step:  # graphed: nothing counted
            return latent, held, per_step, 0
        return latent, held, per_step, per_step[-1] + (self.written - before)

    def abort_trial(self, index: int, noise: torch.Tensor) -> dict[str, Any]:
        """Append chunk ``index``, denoise it, abort it: is the session exactly as before?"""
        registry = self.worker.registry
        sid = self.session.session_id
        assert registry is not None

        def state() -> tuple[Any, ...]:
            snap = registry.snapshot_of(sid)
            return (
                snap.sequences if snap is not None else None,
                self.pool.num_free,
                tuple(registry.written_spans((sid, b, None)) for b in range(self.cfg.branches))
                if snap is not None
                else (),
                self.session.committed_tokens,
            )

        before = state()
        chunk = self.append()
        self._steps(chunk, noise, [])
        self.cache.abort(chunk)
        return {"chunk": index, "restored": state() == before}

    def end(self) -> bool:
        self.cache.end_session(self.session)
        return self.pool.num_free == self.pool.num_total

    def failing(self, noise: torch.Tensor) -> dict[str, Any]:
        """A second session on the same cache: two chunks commit, the third fails mid-step."""
        session = self.cache.begin_session("failing", self.cfg.branches)
        saved = self.session
        self.session = session
        try:
            for i in range(2):
                self.run(i, noise)
            chunk = self.append()

            def boom(_s: int, x: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("the model failed in a denoise step")

            error = ""
            try:
                self._steps(chunk, noise, [])  # one whole step first: the chunk's K/V are written
                self.denoise(chunk.index, noise, boom)
            except RuntimeError as exc:
                error = str(exc)
                self.cache.abort(chunk)
            restored = session.committed_tokens == 2 * self.cfg.chunk_tokens and session.open_chunk is None
            self.cache.end_session(session)
        finally:
            self.session = saved
        return {
            "chunks_committed": 2,
            "error": error,
            "restored": restored,
            "pool_full": self.pool.num_free == self.pool.num_total,
        }


class ConcatStream(_Base):
    """A dense rolling cache per layer rebuilt with ``torch.cat`` (LingBot-World's way)."""

    def __init__(
        self, model: SessionDiT, cfg: SessionConfig, cross: CrossContext, device: torch.device
    ) -> None:
        super().__init__(model, cfg, cross, device)
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.chunks_held: list[int] = []
        self.copied_step = 0
        self.copied_commit = 0

    def run(self, index: int, noise: torch.Tensor) -> tuple[torch.Tensor, int]:
        cfg = self.cfg
        positions = self.positions(index)
        pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        copied = [0]

        def attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pending[name] = (k, v)
            if name in self.keys:
                k = torch.cat([self.keys[name], k], dim=1)
                v = torch.cat([self.values[name], v], dim=1)
                if self.count_copies:
                    copied[0] += k.numel() * k.element_size() + v.numel() * v.element_size()
            return _sdpa(q, k, v)

        def step(_s: int, x: torch.Tensor) -> torch.Tensor:
            copied[0] = 0
            return self.model.run(x, positions, attention, self.cross, cfg.chunk_tokens)

        latent = self.denoise(index, noise, step)
        self.copied_step = max(self.copied_step, copied[0])
        held = sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))
        held += sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pending.values())
        # commit: the cache becomes sink + window + the chunk, rebuilt with one torch.cat
        old = len(self.chunks_held)
        self.chunks_held.append(index)
        keep = set(cfg.visible_chunks(index + 1))
        c = cfg.chunk_tokens
        runs: list[tuple[int, int]] = []  # cache slots to keep, merged into runs
        for slot, chunk in enumerate(self.chunks_held[:old]):
            if chunk in keep:
                if runs and runs[-1][1] == slot:
                    runs[-1] = (runs[-1][0], slot + 1)
                else:
                    runs.append((slot, slot + 1))
        copied_commit = 0
        for name, (k, v) in pending.items():
            for store, new in ((self.keys, k), (self.values, v)):
                pieces = [store[name][:, a * c : b * c] for a, b in runs] if name in store else []
                if index in keep:
                    pieces.append(new)
                store[name] = torch.cat(pieces, dim=1) if pieces else new[:, :0]
                copied_commit += store[name].numel() * store[name].element_size()
        self.chunks_held = [i for i in self.chunks_held if i in keep]
        self.copied_commit = max(self.copied_commit, copied_commit)
        return latent, held


class RecomputeStream(_Base):
    """No cache: every step runs the model over the visible chunks and the new one."""

    def __init__(
        self, model: SessionDiT, cfg: SessionConfig, cross: CrossContext, device: torch.device
    ) -> None:
        super().__init__(model, cfg, cross, device)
        self.inputs: dict[int, torch.Tensor] = {}
        """Each visible chunk's embedded input at its committing step."""

    def run(self, index: int, noise: torch.Tensor) -> tuple[torch.Tensor, int]:
        cfg = self.cfg
        c = cfg.chunk_tokens
        context = cfg.visible_chunks(index)
        order = [*context, index]
        positions = torch.cat([self.positions(i) for i in order])
        n = len(order) * c
        group = torch.arange(n, device=self.device) // c
        mask = group[None, :] <= group[:, None]  # block-causal over the chunks present
        ctx = [self.inputs[i] for i in context]
        last: list[torch.Tensor] = []

        def attention(_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _sdpa(q, k, v, mask if context else None)

        def step(_s: int, x: torch.Tensor) -> torch.Tensor:
            last[:] = [x]
            full = torch.cat([*ctx, x], dim=1) if ctx else x
            return self.model.run(full, positions, attention, self.cross, c)

        latent = self.denoise(index, noise, step)
        self.inputs[index] = last[0]
        keep = set(cfg.visible_chunks(index + 1))
        for i in [i for i in self.inputs if i not in keep]:
            del self.inputs[i]
        el = torch.empty((), dtype=cfg.dtype).element_size()
        held = sum(t.numel() for t in ctx) * el + n * cfg.branches * self.per_token_layer
        return latent, held


class ChunkOnlyStream(_Base):
    """The floor (``chunk_only`` in :data:`ALL_MODES`): every step runs the model over the chunk
    alone, its self-attention over the chunk's own keys. No cache serves the chunk with less
    work; its outputs are another computation (not compared with the oracle)."""

    def run(self, index: int, noise: torch.Tensor) -> tuple[torch.Tensor, int]:
        c = self.cfg.chunk_tokens
        positions = self.positions(index)

        def attention(_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _sdpa(q, k, v)

        latent = self.denoise(
            index, noise, lambda _s, x: self.model.run(x, positions, attention, self.cross, c)
        )
        # one layer's K/V of the chunk is alive at a time; nothing is held across chunks
        return latent, c * self.cfg.branches * self.per_token_layer


class OracleStream(_Base):
    """Every chunk's K/V kept densely, attention under the session's row mask (untimed; float64
    on the CPU, float32 on other devices)."""

    def __init__(
        self, model: SessionDiT, cfg: SessionConfig, cross: CrossContext, device: torch.device
    ) -> None:
        super().__init__(model, cfg, cross, device)
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    def run(self, index: int, noise: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        c = cfg.chunk_tokens
        start, end = index * c, (index + 1) * c
        mask = cfg.policy.mask.row_mask(start, c, end).to(self.device)
        positions = self.positions(index)
        pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pending[name] = (k, v)
            if name in self.keys:
                k = torch.cat([self.keys[name], k], dim=1)
                v = torch.cat([self.values[name], v], dim=1)
            # float64 on the CPU; float32 elsewhere, where float64 attention would take the math
            # kernel and materialise every score (the wan13b shape's last chunks: tens of GB)
            exact = torch.float64 if q.device.type == "cpu" else torch.float32
            return _sdpa(q.to(exact), k.to(exact), v.to(exact), mask).to(q.dtype)

        latent = self.denoise(
            index, noise, lambda _s, x: self.model.run(x, positions, attention, self.cross, c)
        )
        for name, (k, v) in pending.items():
            self.keys[name] = torch.cat([self.keys[name], k], dim=1) if name in self.keys else k
            self.values[name] = torch.cat([self.values[name], v], dim=1) if name in self.values else v
        return latent


class ContiguousStream(_Base):
    """The best dense rolling cache: per layer one preallocated ``[B, sink + window + chunk, Hkv,
    D]`` buffer; each step writes the chunk's K/V in place and attends over the filled prefix (a
    view, nothing concatenated); commit shifts the window down one chunk once it is full."""

    def __init__(
        self, model: SessionDiT, cfg: SessionConfig, cross: CrossContext, device: torch.device
    ) -> None:
        super().__init__(model, cfg, cross, device)
        c = cfg.chunk_tokens
        shape = (cfg.branches, (cfg.sink_chunks + cfg.window_chunks + 1) * c, cfg.kv_heads, cfg.head_size)
        self.keys = {n: torch.empty(shape, dtype=cfg.dtype, device=device) for n in model.layer_names}
        self.values = {n: torch.empty(shape, dtype=cfg.dtype, device=device) for n in model.layer_names}
        self.filled = 0
        """Context tokens in the buffers (sink, then window)."""
        self.copied_step = 0
        self.copied_commit = 0

    def run(self, index: int, noise: torch.Tensor) -> tuple[torch.Tensor, int]:
        cfg = self.cfg
        c, n = cfg.chunk_tokens, self.filled
        positions = self.positions(index)
        copied = [0]

        def attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kb, vb = self.keys[name], self.values[name]
            kb[:, n : n + c].copy_(k)
            vb[:, n : n + c].copy_(v)
            if self.count_copies:
                copied[0] += k.numel() * k.element_size() + v.numel() * v.element_size()
            return _sdpa(q, kb[:, : n + c], vb[:, : n + c])

        def step(_s: int, x: torch.Tensor) -> torch.Tensor:
            copied[0] = 0
            return self.model.run(x, positions, attention, self.cross, c)

        latent = self.denoise(index, noise, step)
        self.copied_step = max(self.copied_step, copied[0])
        held = sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))
        full = (cfg.sink_chunks + cfg.window_chunks) * c
        if n + c <= full:
            self.filled = n + c
        elif cfg.window_chunks:  # drop the window's oldest chunk: shift the rest down one chunk
            s0 = cfg.sink_chunks * c
            moved = 0
            for buf in (*self.keys.values(), *self.values.values()):
                tail = buf[:, s0 + c : full + c].clone()
                buf[:, s0:full].copy_(tail)
                moved += 2 * tail.numel() * tail.element_size()
            self.copied_commit = max(self.copied_commit, moved)
        return latent, held


# -- the run -----------------------------------------------------------------------------------


def build_session_model(cfg: SessionConfig, device: torch.device) -> SessionDiT:
    return SessionDiT.build(cfg, device)


def session_inputs(cfg: SessionConfig, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(text [branches, Lt, hidden], per-chunk noise [1, C, hidden])``: the conditional text and,
    with two branches, an all-zero unconditional one."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    text = torch.randn(1, cfg.text_tokens, cfg.hidden, generator=g)
    if cfg.branches == 2:
        text = torch.cat([text, torch.zeros_like(text)])
    noise = [torch.randn(1, cfg.chunk_tokens, cfg.hidden, generator=g) for _ in range(cfg.chunks)]
    return text.to(device, cfg.dtype), [n.to(device, cfg.dtype) for n in noise]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def run_session(
    platform: Platform,
    cfg: SessionConfig,
    progress: Progress | None = None,
    device: torch.device | None = None,
) -> SessionResult:
    device = device or platform.device()
    say = progress or (lambda _m, _i, _n: None)
    model = build_session_model(cfg, device)
    text, noise = session_inputs(cfg, device)
    cross = cross_attention_context(model, text)
    modes = cfg.modes
    times: dict[str, list[list[float]]] = {m: [] for m in modes}
    kv: dict[str, list[int]] = {m: [] for m in modes}
    outputs: dict[str, list[torch.Tensor]] = {m: [] for m in modes}
    step_writes: list[int] = []
    commit_writes: list[int] = []
    abort: dict[str, Any] | None = None
    checks: dict[str, bool] = {}
    failing: dict[str, Any] | None = None
    copied: dict[str, dict[str, int]] = {}
    paged: PagedStream | None = None
    total = cfg.repeats * cfg.chunks
    kinds: dict[str, type[RecomputeStream | ConcatStream | ContiguousStream | ChunkOnlyStream]] = {
        "recompute": RecomputeStream,
        "concat": ConcatStream,
        "contiguous": ContiguousStream,
        "chunk_only": ChunkOnlyStream,
    }
    if "graphs" in modes and device.type != "cuda":
        raise ValidationError(f"the session's graphs mode needs a CUDA device; the run is on {device}")
    graphed: PagedStream | None = None
    with torch.no_grad():
        for rep in range(cfg.repeats):
            # the first run counts the bytes every way copies (and is checked); later runs time
            # the ways bare (each chunk's time is its fastest over the runs)
            paged = PagedStream(model, cfg, cross, device, platform, count_writes=rep == 0)
            if "graphs" in modes:
                graphed = PagedStream(
                    model, cfg, cross, device, platform, session_id="graphed", count_writes=False, graphs=True
                )
            dense = {m: kinds[m](model, cfg, cross, device) for m in modes if m not in ("paged", "graphs")}
            for way in dense.values():
                way.count_copies = rep == 0
            for name in modes:
                times[name].append([])
            for i in range(cfg.chunks):
                if rep == 0 and cfg.abort_chunk == i:
                    abort = paged.abort_trial(i, noise[i])
                for k in range(len(modes)):  # rotate who goes first
                    name = modes[(i + k) % len(modes)]
                    t0 = time.perf_counter()
                    if name == "paged":
                        out, held, per_step, committed = paged.run(i, noise[i])
                    elif name == "graphs":
                        assert graphed is not None
                        out, held, _, _ = graphed.run(i, noise[i])
                    else:
                        out, held = dense[name].run(i, noise[i])
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times[name][rep].append((time.perf_counter() - t0) * 1e3)
                    if rep:
                        continue
                    kv[name].append(held)
                    outputs[name].append(out)
                    if name == "paged":
                        step_writes.extend(per_step)
                        commit_writes.append(committed)
                say("chunks", rep * cfg.chunks + i + 1, total)
            checks[f"session ended (run {rep + 1})"] = paged.end()
            if graphed is not None:
                checks[f"graphed session ended (run {rep + 1})"] = graphed.end()
            if rep == 0:
                copied = {
                    m: {"per_chunk": s.copied_commit, "per_step": s.copied_step}
                    for m, s in dense.items()
                    if isinstance(s, (ConcatStream, ContiguousStream))
                }
        assert paged is not None
        if cfg.failing_session:
            failing = paged.failing(noise[0])
            checks["failing session ended"] = bool(failing["pool_full"])
        oracle = OracleStream(model, cfg, cross, device)
        oracle_outputs = [oracle.run(i, noise[i]) for i in range(cfg.chunks)]
    atol, rtol = KIT_TOLERANCE.get(cfg.dtype, KIT_TOLERANCE[torch.bfloat16])
    mine = outputs["paged"]
    agrees = all(
        bool(torch.isfinite(p).all())
        and bool(torch.isclose(p.double(), o.double(), atol=atol, rtol=rtol).all())
        for p, o in zip(mine, oracle_outputs, strict=True)
    )
    el = torch.empty((), dtype=cfg.dtype).element_size()
    per_token = 2 * cfg.kv_heads * cfg.head_size * el * cfg.layers
    return SessionResult(
        platform=platform.name,
        device=str(device),
        dtype=str(cfg.dtype).removeprefix("torch."),
        backends=tuple(served_by(paged.worker)),
        shapes={
            "chunks": cfg.chunks,
            "chunk_tokens": cfg.chunk_tokens,
            "window_chunks": cfg.window_chunks,
            "sink_chunks": cfg.sink_chunks,
            "steps": cfg.steps,
            "branches": cfg.branches,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "kv_heads": cfg.kv_heads,
            "head_size": cfg.head_size,
            "layers": cfg.layers,
            "text_tokens": cfg.text_tokens,
            "repeats": cfg.repeats,
            "window_filled_at": cfg.window_filled_at,
        },
        block_size=paged.block,
        chunk_ms={m: [min(r[i] for r in times[m]) for i in range(cfg.chunks)] for m in modes},
        kv_bytes=kv,
        agrees=agrees,
        max_abs_diff=max(_diff(p, o) for p, o in zip(mine, oracle_outputs, strict=True)),
        tolerance={"atol": atol, "rtol": rtol},
        baseline_max_abs_diff={
            m: max(_diff(d, p) for d, p in zip(outputs[m], mine, strict=True)) for m in copied
        },
        dense_max_abs_diff={
            m: max(_diff(d, o) for d, o in zip(outputs[m], oracle_outputs, strict=True)) for m in copied
        },
        chunk_kv_bytes=cfg.chunk_tokens * cfg.branches * per_token,
        bytes_copied_per_chunk=max(commit_writes),
        bytes_written_per_step=max(step_writes),
        baseline_bytes_copied=copied,
        kv_bytes_peak=max(kv["paged"]),
        kv_bytes_bound=cfg.branches * paged.bound_blocks * paged.bytes_per_block,
        pool_full_after=all(checks.values()) and (abort is None or bool(abort["restored"])),
        pool_checks=checks,
        abort=abort,
        failing_session=failing,
        cross_context_bytes=cross.nbytes,
        oracle_max_abs=max(float(o.double().abs().max()) for o in oracle_outputs),
        extra={}
        if graphed is None or graphed.graphs is None
        else {
            "graphs": {
                "captures": graphed.graphs.captures,
                "replays": graphed.graphs.replays,
                "eager": graphed.graphs.eager,
                "max_abs_diff_vs_paged": max(
                    _diff(g, p) for g, p in zip(outputs["graphs"], mine, strict=True)
                ),
                "note": "the last run's steps; captures are inside the chunks' times; eager: batches without a graph key",
            }
        },
    )


def format_session(r: SessionResult) -> str:
    s = r.shapes
    kib = 1024
    modes = list(r.chunk_ms)
    label = {
        "paged": "paged",
        "recompute": "recompute",
        "concat": "torch.cat",
        "contiguous": "contiguous",
        "chunk_only": "chunk alone",
        "graphs": "paged+graphs",
    }
    lines = [
        f"platform: {r.platform} (device {r.device}, {r.dtype}), paged backend {', '.join(r.backends)}",
        f"session: {s['chunks']} chunks of {s['chunk_tokens']} tokens, sink {s['sink_chunks']} + window "
        f"{s['window_chunks']} chunks, {s['steps']} denoise steps per chunk, {s['branches']} branch(es); hidden "
        f"{s['hidden']}, heads {s['heads']} (kv {s['kv_heads']}, head size {s['head_size']}), layers {s['layers']}, "
        f"text context {s['text_tokens']} tokens (cross-attention K/V {r.cross_context_bytes / kib:.0f} KiB, once "
        f"per session); block size {r.block_size}",
        "chunk "
        + "".join(f"{label[m] + ' ms':>14}" for m in modes)
        + "".join(f"{label[m] + ' KiB':>16}" for m in modes),
    ]
    for i in range(len(r.chunk_ms["paged"])):
        lines.append(
            f"{i:5d} "
            + "".join(f"{r.chunk_ms[m][i]:14.1f}" for m in modes)
            + "".join(f"{r.kv_bytes[m][i] / kib:16.0f}" for m in modes)
        )
    med = {m: r._median(m, r.steady) for m in modes}
    parts = [f"paged {med['paged']:.1f} ms"]
    if r.speedup_vs_recompute is not None:
        parts.append(
            f"recompute {med['recompute']:.1f} ms (speedup vs recompute {r.speedup_vs_recompute:.2f}x; token-count "
            f"ideal {r.ideal_vs_recompute:.0f}x)"
        )
    for m in ("concat", "contiguous"):
        ratio = r._ratio(m)
        if ratio is not None:
            parts.append(f"{label[m]} {med[m]:.1f} ms (paged / {label[m]} {ratio:.2f})")
    graphs = r.extra.get("graphs")
    if graphs is not None and r.graphs_vs_paged is not None:
        parts.append(
            f"paged with CUDA graphs {med['graphs']:.1f} ms ({r.graphs_vs_paged:.2f} of eager paged; "
            f"{graphs['captures']} captures, {graphs['replays']} replays, {graphs.get('eager', 0)} eager steps; "
            f"max |graphs - paged| "
            f"{graphs['max_abs_diff_vs_paged']:.3g})"
        )
    if r.speedup_ceiling is not None:
        parts.append(
            f"the chunk alone {med['chunk_only']:.1f} ms (no context: the floor; a cache costing nothing would "
            f"reach {r.speedup_ceiling:.2f}x recompute)"
        )
    copies = "; ".join(
        f"{label[m]} {c['per_chunk']} at commit and {c['per_step']} per step"
        for m, c in r.baseline_bytes_copied.items()
    )
    agree = "; ".join(f"{label[m]} vs paged {d:.3g}" for m, d in r.baseline_max_abs_diff.items())
    lines += [
        f"after the window filled (chunk {s['window_filled_at']} on), median per chunk: "
        + ", ".join(parts)
        + f"; flatness {r.flatness:.2f} (last quarter / first chunks after the window filled)",
        f"KV memory: paged peak {r.kv_bytes_peak / kib:.0f} KiB (bound {r.kv_bytes_bound / kib:.0f} KiB: sink + window "
        f"+ one chunk + one block per branch, every layer)",
        f"bytes copied: paged {r.bytes_copied_per_chunk} per chunk to commit (the chunk's own K/V: {r.chunk_kv_bytes}; "
        f"each step writes {r.bytes_written_per_step} in place)" + (f"; {copies}" if copies else ""),
        f"max |paged - dense oracle over the same mask|: {r.max_abs_diff:.3g} (kit tolerance atol "
        f"{r.tolerance['atol']:g}, rtol {r.tolerance['rtol']:g}) -> {'AGREE' if r.agrees else 'DISAGREE'}"
        + (f"; {agree}" if agree else "")
        + (
            ""
            if r.agrees or r.agrees_as_dense is None
            else (
                "; the dense ways against the same oracle: "
                + ", ".join(f"{label[m]} {d:.3g}" for m, d in r.dense_max_abs_diff.items())
                + (
                    " -> paging adds no error of its own (the dtype's depth does)"
                    if r.agrees_as_dense
                    else " -> the paged way is further off than every dense way"
                )
            )
        ),
        "pool whole after every session: "
        + ("yes" if r.pool_full_after else f"NO {r.pool_checks}")
        + (f"; aborted chunk {r.abort['chunk']}: session restored {r.abort['restored']}" if r.abort else "")
        + (
            f"; failing session ({r.failing_session['error']}): restored {r.failing_session['restored']}"
            if r.failing_session
            else ""
        ),
    ]
    return "\n".join(lines)

"""vLLM-Omni's AR-diffusion engine (``vllm_omni.experimental.ar_diffusion``) on diffusion-kv sessions.

vLLM-Omni 0.30.0's AR-diffusion pipelines (DreamZero's ``CausalWanModel``, LingBot-World's
``CausalLingBotWorldTransformer3DModel``) reach their KV through two seams, both served here
without editing vLLM-Omni:

* **the session state** the runner binds to the pipeline (``bind_ar_diffusion_state``). It is
  duck-typed: pipelines call ``get_kv_caches(kv_branch, seq_len, commit_current)``,
  ``commit_paged_context``, the cross-attention methods, ``reset(keep_cross_attention=)`` and
  ``close``, and read ``kv_cache.cross_attention_lengths``. :class:`DiffusionKVARState` answers
  them from a :class:`DiffusionKVARCache`: one diffusion-kv ``SessionCache`` session per KV branch;
* **the attention op** every paged layer calls, ``torch.ops.vllm_omni.ar_diffusion_paged_write_attn``
  (a ``torch.library.custom_op``). :func:`install_kernel` registers a kernel for it on the
  cache's device type (``torch.library.register_kernel``; ``cpu``, or ``cuda`` for a cache built
  on a CUDA device): a call whose pools are a :class:`DiffusionKVARCache`'s markers is served by
  diffusion-kv's worker (write the chunk's K/V into the session's pages,
  attend under the session's chunk-causal + window + sink mask); any other call runs vLLM-Omni's
  own body (``_paged_write_attn_impl``) unchanged, so both paths share a process.

The mapping. vLLM-Omni pages one latent frame per block and slides by frames: a forward's
queries (one AR block of ``frames_per_block`` frames) see the sink frames and the last
``window_frames`` frames of history + block. diffusion-kv's session chunk is that AR block, so the
policy is ``SessionPolicy(chunk_tokens=F * tokens_per_frame, window_chunks=W / F - 1,
sink_chunks=S / F)`` (window and sink must be whole AR blocks). A forward with
``commit_current=False`` (a denoise probe; upstream writes scratch blocks) writes the open chunk's
positions; the ``commit_current=True`` forward writes them again and ``commit_paged_context``
commits the chunk (upstream's commit after success); a failure aborts the chunk
(:meth:`DiffusionKVARState.abort_pending`), so the session is exactly as before it. ``reset``
ends the branch sessions and begins fresh ones (DreamZero's window reset), ``close`` ends them.

DreamZero's action/state tokens (every denoise forward of its pipeline carries them) are scratch
K/V: the op gets them beside the video K/V, they are seen by that forward only and never reach
the pages. Every query (video and action) sees the chunk's visible session keys plus them, so
:meth:`DiffusionKVARForward.attend_with_scratch` writes the chunk and runs the worker's backend
as partial attention with its log-sum-exp, the action queries in the same call as the chunk's
own, which see the same keys under the chunk-causal mask (``forward_partial_extra``), attends
the scratch keys densely, and merges the two (``merge_partial_attention``).

A first AR block of another length (DreamZero's pipeline starts with its first frame alone,
then blocks of ``F`` frames; ``ARGeometry.first_block_frames``) is the session's first-block
prefix: a context of its own (:data:`PREFIX`) written by that block's forwards on the contexts'
FULL worker (it sees only itself), while the session's chunks start after it on the same
whole-block grid. A later block sees the prefix while the host's window does (the first ``sink``
frames -- 0 or the first block -- and the last ``window`` frames); its layers then attend the
prefix's keys (with the action tokens', concatenated) in the one dense partial they merge, and once no later block can see it
the prefix goes back to the pool. A window the host would slide through the middle of a block or
of the first block is refused at that forward (DreamZero's window of ``max_chunk_size * F + 1``
frames never slides: its pipeline resets first). Any later block of another length is refused.

Not served yet: CFG-parallel ranks.

Cross-attention pools (DreamZero's ``text``) are the core's session contexts
(``SessionContexts``, :class:`CrossAttentionStore`): paged on a FULL worker of their own, one
context per name and KV-branch session, written once by one forward of every layer's K/V,
released with the session; ``reset(keep_cross_attention=...)`` keeps the named ones
(``SessionCache.reset(keep_contexts=)``). They are read through :func:`read_context` (today the
core's gather, ``SessionCache.context_kv``).

Importing this module imports neither vLLM nor vLLM-Omni; :func:`install_kernel` and
:meth:`DiffusionKVARForward.layer_inputs` import vLLM-Omni lazily.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_kv.core.allocator import AdmissionError, DiffusionKVAllocator, FreeListPool
from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.errors import (
    StaleBatchError,
    StateError,
    UnsupportedFeatureError,
    ValidationError,
)
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.parallel import merge_partial_attention
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.sessions import Chunk, Session, SessionCache, SessionContexts, SessionPolicy

OP_NAME = "vllm_omni::ar_diffusion_paged_write_attn"
_PAGED_ATTENTION = "vllm_omni.experimental.ar_diffusion.kv_cache.paged_attention"

_MARKERS: dict[int, tuple[DiffusionKVARCache, int]] = {}
"""Marker tensor data pointer -> (cache, layer index): how the op's kernel recognises our layers."""

_INSTALLED: set[str] = set()
"""Device types whose kernel of the op is registered (:func:`install_kernel`)."""

PREPARED_KEPT = 8
"""Prepared batches a :class:`DiffusionKVARCache` keeps for reuse (a few rows sets: the CFG
branches' chunk rows and the first block's rows, on two workers)."""


def _layer_name(index: int) -> str:
    return f"layer{index}"


@dataclass(frozen=True)
class ARGeometry:
    """An AR-diffusion model's KV geometry (vLLM-Omni's ``ARDiffusionKVCacheSpec`` plus the
    deployment's window and sink, in frames)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_frame: int
    frames_per_block: int
    window_frames: int
    sink_frames: int = 0
    dtype: torch.dtype = torch.float32
    first_block_frames: int | None = None
    """Frames of the stream's first AR block when it differs from ``frames_per_block``
    (DreamZero: its first frame alone); None: every block has ``frames_per_block``."""

    @property
    def prefix_frames(self) -> int:
        """Frames held as the session's first-block prefix (0: uniform blocks)."""
        first = self.first_block_frames
        return 0 if first is None or first == self.frames_per_block else first

    def policy(self) -> SessionPolicy:
        """The session policy: one AR block per chunk; window and sink in whole blocks. With a
        first block of another length (held as a prefix beside the chunks), the chunks start
        after it; the sink must be 0 or that first block."""
        f, p = self.frames_per_block, self.prefix_frames
        w, sink = self.window_frames, self.sink_frames
        if self.first_block_frames is not None and self.first_block_frames <= 0:
            raise ValidationError(
                f"AR-diffusion first_block_frames must be positive; got {self.first_block_frames}"
            )
        if w < f:
            raise ValidationError(f"AR-diffusion window_frames={w} must cover one AR block ({f} frames)")
        if p == 0:
            for what, frames in (("window_frames", w), ("sink_frames", sink)):
                if frames % f:
                    raise UnsupportedFeatureError(
                        f"AR-diffusion {what}={frames} is not a multiple of frames_per_block={f}: "
                        "diffusion-kv sessions slide by whole AR blocks"
                    )
            return SessionPolicy(
                chunk_tokens=f * self.tokens_per_frame, window_chunks=w // f - 1, sink_chunks=sink // f
            )
        if sink not in (0, p):
            raise UnsupportedFeatureError(
                f"AR-diffusion sink_frames={sink} with a first block of {p} frames: diffusion-kv serves a sink of "
                "0 frames or exactly the first block"
            )
        # a window of whole blocks slides exactly; another one is served until it would slide
        chunks = w // f if w % f == 0 else (w + sink - p) // f
        if chunks < 1:
            raise ValidationError(
                f"AR-diffusion window_frames={w} with a first block of {p} frames leaves no room for a block of {f}"
            )
        return SessionPolicy(chunk_tokens=f * self.tokens_per_frame, window_chunks=chunks - 1)

    def prefix_visible(self, chunk_end_frames: int) -> bool:
        """Whether a block ending at session frame ``chunk_end_frames`` (after the first block)
        sees the first block, as the host's window does (the first ``sink`` frames and the last
        ``window`` frames of the stream); :class:`UnsupportedFeatureError` where the host's
        window would cut through the first block or through a block."""
        f, p, w, sink = self.frames_per_block, self.prefix_frames, self.window_frames, self.sink_frames
        end = p + chunk_end_frames  # host frames
        slid = end > w + sink
        if slid and w % f:
            raise UnsupportedFeatureError(
                f"AR-diffusion window of {w} frames slides through an AR block of {f} frames at frame {end}: "
                "diffusion-kv sessions slide by whole blocks (the host resets before, e.g. DreamZero's "
                "local_attn_size)"
            )
        if sink:
            return True
        if end <= w:
            return True
        if end - w < p:
            raise UnsupportedFeatureError(
                f"AR-diffusion window of {w} frames cuts through the {p}-frame first block at frame {end}"
            )
        return False


PREFIX = "ar_diffusion.first_block"
"""The session context that holds a first AR block of another length (its self-attention K/V)."""


def read_context(
    sessions: SessionCache, session: Session, name: str, layer: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One written context's keys and values ``[tokens, Hkv, D]`` for one cross-attention layer
    (the one place this adapter reads contexts: the core's gather, ``SessionCache.context_kv``)."""
    return sessions.context_kv(session, name, layer)


class CrossAttentionStore:
    """Named cross-attention K/V (vLLM-Omni's cross-attention pools) as diffusion-kv session
    contexts (``SessionContexts``): one context per name and KV-branch session, paged on a FULL
    worker whose layers are the model's cross-attention layers, written once (one forward of
    every layer's K/V), released with the session; a reset keeps the ones the host keeps."""

    def __init__(self, sessions: SessionCache, lengths: Mapping[str, int], geometry: ARGeometry) -> None:
        self.sessions = sessions
        self.lengths = dict(lengths)
        self.num_layers = geometry.num_layers
        self.geometry = geometry
        self.contexts = sessions.contexts

    def _known(self, name: str) -> int:
        if name not in self.lengths:
            raise ValidationError(f"unknown cross-attention cache {name!r}; declared: {sorted(self.lengths)}")
        return self.lengths[name]

    def populated(self, session: Session, name: str) -> bool:
        self._known(name)
        assert self.contexts is not None
        return self.written(session, name)

    def written(self, session: Session, name: str) -> bool:
        assert self.contexts is not None
        if name not in self.contexts.names(session.session_id):
            return False
        return not self.contexts.unwritten(self.contexts.get(session.session_id, name))

    def populate(
        self, session: Session, name: str, layer_kv: Iterable[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Check every layer's K/V, reserve the context and write it in one forward per layer;
        a refusal or failure leaves no context behind."""
        length = self._known(name)
        g = self.geometry
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, (k, v) in enumerate(layer_kv):
            if index >= self.num_layers:
                raise ValidationError(
                    f"cross-attention cache {name!r}: more than {self.num_layers} layers given"
                )
            expected = (1, length, g.num_kv_heads, g.head_size)
            if tuple(k.shape) != expected or v.shape != k.shape:
                raise ValidationError(
                    f"cross-attention cache {name!r} layer {index}: k/v shape {tuple(k.shape)}/{tuple(v.shape)}, "
                    f"expected {expected}"
                )
            layers.append((k[0].to(g.dtype), v[0].to(g.dtype)))
        if len(layers) != self.num_layers:
            raise ValidationError(
                f"cross-attention cache {name!r}: {len(layers)} layers given, expected {self.num_layers}"
            )
        assert self.contexts is not None
        if name in self.contexts.names(session.session_id):  # a half-written one (a failed populate)
            self.sessions.release_context(session, name)
        rows = self.sessions.set_context(session, name, length)
        if rows is None:
            raise AdmissionError(
                f"cross-attention cache {name!r} of session {session.session_id!r}: {length} tokens do not fit "
                f"the context pool ({self.contexts.allocator.pool.num_free} blocks free)"
            )
        worker = self.contexts.worker
        try:
            with worker.stepper() as runtime:
                runtime.ensure_rows(rows)
                for index, (k, v) in enumerate(layers):
                    worker.forward(_layer_name(index), k, k, v)  # the write is what counts
        except BaseException:
            self.sessions.release_context(session, name)
            raise

    def read(self, session: Session, name: str, layer: int) -> dict[str, torch.Tensor | bool]:
        if not self.populated(session, name):
            raise StateError(
                f"cross-attention cache {name!r} of session {session.session_id!r} read before it was populated"
            )
        k, v = read_context(self.sessions, session, name, _layer_name(layer))
        return {"is_init": True, "k": k.unsqueeze(0), "v": v.unsqueeze(0)}

    def names(self, session: Session) -> tuple[str, ...]:
        """The session's cross-attention contexts (not the first-block prefix)."""
        if self.contexts is None:
            return ()
        return tuple(n for n in self.contexts.names(session.session_id) if n in self.lengths)

    def release(self, session: Session) -> None:
        for name in self.names(session):
            self.sessions.release_context(session, name)


def _context_store(
    geometry: ARGeometry,
    lengths: Mapping[str, int],
    session_rows: int,
    *,
    platform: Any,
    backend: str | None,
    block_size: int,
    device: torch.device,
) -> SessionContexts:
    """The contexts' own worker (one FULL layer per cross-attention layer) and pool: room for
    every name of every resident KV-branch session."""
    rows = session_rows * len(lengths)
    longest = max(lengths.values())
    max_len = cdiv(longest, block_size) * block_size
    worker = PagedWorker(
        platform or _default_platform(device),
        RunnerConfig(max_len, 1, rows, max(max_len, rows * max_len), device=device, backend=backend),
    )
    spec = PagedLayerSpec(
        geometry.num_kv_heads,
        geometry.num_kv_heads,
        geometry.head_size,
        geometry.dtype,
        mode=AttentionMode.FULL,
    )
    worker.register_kv_cache_layers({_layer_name(i): spec for i in range(geometry.num_layers)})
    num_blocks = session_rows * sum(cdiv(n, block_size) for n in lengths.values())
    worker.initialize_kv_cache(num_blocks=num_blocks, block_size=block_size)
    allocator = DiffusionKVAllocator(
        block_size=block_size,
        max_model_len=max_len,
        max_rows_per_request=1,
        worker_rows=rows,
        pool=FreeListPool(num_blocks),
    )
    return SessionContexts(worker, allocator)


def _default_platform(device: torch.device) -> Any:
    """diffusion-kv's platform for a device type when the caller names none: ``cpu`` or ``cuda``."""
    if device.type == "cpu":
        from diffusion_kv.platforms.cpu import CpuPlatform

        return CpuPlatform()
    if device.type == "cuda":
        from diffusion_kv.platforms.cuda import CudaPlatform

        return CudaPlatform()
    raise UnsupportedFeatureError(
        f"DiffusionKVARCache device {device}: no default platform for device type {device.type!r} "
        "(cpu or cuda; pass platform=)"
    )


class DiffusionKVARCache:
    """One model's AR-diffusion KV on diffusion-kv: a worker whose layers attend under the
    session mask, its allocator and a :class:`SessionCache` (vLLM-Omni's ``ARDiffusionKVCache``'s
    place), on ``device`` (default CPU; the model's device: its forwards must run there)."""

    def __init__(
        self,
        geometry: ARGeometry,
        *,
        kv_branches: tuple[str, ...] = ("positive",),
        cross_attention_lengths: Mapping[str, int] | None = None,
        num_blocks: int | None = None,
        max_sessions: int = 1,
        max_frames: int = 4096,
        block_size: int | None = None,
        platform: Any = None,
        backend: str | None = None,
        context_block_size: int = 16,
        device: torch.device | str | None = None,
    ) -> None:
        if not kv_branches or len(set(kv_branches)) != len(kv_branches):
            raise ValidationError(f"kv_branches must be distinct names; got {kv_branches!r}")
        self.geometry = geometry
        self.policy = geometry.policy()
        self.kv_branches = tuple(kv_branches)
        self.chunk_tokens = self.policy.chunk_tokens
        block = block_size or geometry.tokens_per_frame
        max_model_len = max_frames * geometry.tokens_per_frame
        rows = max_sessions * len(self.kv_branches)
        wanted = torch.device(device) if device is not None else torch.device("cpu")
        self.worker = PagedWorker(
            platform or _default_platform(wanted),
            RunnerConfig(
                max_model_len,
                1,
                rows,
                max(max_model_len, self.chunk_tokens * rows),
                device=wanted,
                backend=backend,
            ),
        )
        self.device: torch.device = self.worker.device
        mask = self.policy.mask
        spec = PagedLayerSpec(
            geometry.num_kv_heads, geometry.num_kv_heads, geometry.head_size, geometry.dtype, mode=mask
        )
        self.worker.register_kv_cache_layers({_layer_name(i): spec for i in range(geometry.num_layers)})
        if num_blocks is None:  # every resident row's sink + window + chunk (SessionCache.kv_blocks_bound)
            p = self.policy
            window = p.window_chunks if p.window_chunks is not None else 0
            per_row = (
                cdiv(p.sink_chunks * p.chunk_tokens, block) + cdiv((window + 1) * p.chunk_tokens, block) + 1
            )
            num_blocks = per_row * rows
        self.worker.initialize_kv_cache(num_blocks=num_blocks, block_size=block)
        self.pool = FreeListPool(num_blocks)
        self.allocator = DiffusionKVAllocator(
            block_size=block,
            max_model_len=max_model_len,
            max_rows_per_request=1,
            worker_rows=rows,
            pool=self.pool,
        )
        lengths = dict(cross_attention_lengths or {})
        if PREFIX in lengths:
            raise ValidationError(f"cross-attention cache name {PREFIX!r} is reserved for the first block")
        self.prefix_tokens = geometry.prefix_frames * geometry.tokens_per_frame
        sized = dict(lengths)
        if self.prefix_tokens:
            sized[PREFIX] = self.prefix_tokens
        contexts = None
        if sized:
            contexts = _context_store(
                geometry,
                sized,
                rows,
                platform=platform,
                backend=backend,
                block_size=context_block_size,
                device=self.device,
            )
        self.sessions = SessionCache(self.worker, self.allocator, self.policy, contexts=contexts)
        self.cross = CrossAttentionStore(self.sessions, lengths, geometry)
        self.cross_attention_lengths = dict(lengths)
        self.block_size = block
        self._markers = [torch.zeros(1, device=self.device) for _ in range(geometry.num_layers)]
        for index, marker in enumerate(self._markers):
            _MARKERS[marker.data_ptr()] = (self, index)
        self.active: DiffusionKVARForward | None = None
        self.prepared: dict[tuple[int, tuple[PagedRow, ...]], Any] = {}
        """Per worker (by id) and rows, the batch last prepared for them, reused while valid:
        the CFG branches' forwards alternate, and where the worker's batches are retained
        (``Translator.retains_batches``) each branch's batch outlives the other's preparation.
        At most :data:`PREPARED_KEPT` entries (the oldest go first)."""

    def state(self, session_id: str) -> DiffusionKVARState:
        """A fresh session (one diffusion-kv session per KV branch)."""
        return DiffusionKVARState(self, session_id)

    def marker(self, layer: int) -> torch.Tensor:
        return self._markers[layer]

    def close(self) -> None:
        """Forget the layer markers (the op kernel stops recognising this cache)."""
        for marker in self._markers:
            _MARKERS.pop(marker.data_ptr(), None)


class DiffusionKVARForward:
    """One KV branch forward (vLLM-Omni's ``ARDiffusionPagedForwardContext`` place): the
    branch's open chunk (or its first-block prefix) and the worker stepper its layers run under.

    Three ways a layer attends: a chunk alone (the session worker's forward); a chunk with keys
    beside the session's pages -- action/state scratch K/V, a visible first-block prefix -- (the
    worker's partial attention merged by log-sum-exp with each extra key set); the first-block
    prefix itself (its context's FULL forward on the contexts' worker: it sees only itself)."""

    def __init__(
        self,
        state: DiffusionKVARState,
        branch: str,
        chunk: Chunk | None,
        commit_current: bool,
        *,
        prefix_rows: tuple[PagedRow, ...] | None = None,
        prefix_visible: bool = False,
    ) -> None:
        self.state = state
        self.cache = state.cache
        self.kv_branch = branch
        self.session = state._session(branch)
        self.chunk = chunk
        self.prefix_rows = prefix_rows
        if (chunk is None) == (prefix_rows is None):
            raise ValidationError("an AR-diffusion forward writes either a chunk or the first-block prefix")
        self.seq_len = chunk.tokens if chunk is not None else self.cache.prefix_tokens
        self.end = chunk.end if chunk is not None else self.cache.prefix_tokens
        self.prefix_visible = prefix_visible
        self.commit_current = commit_current
        self._prepared = False
        self._written: set[int] = set()
        self._stack: contextlib.ExitStack | None = None
        self._inputs: list[Any] = []
        self.action_len = 0

    @property
    def is_prefix(self) -> bool:
        return self.chunk is None

    def prepare(self, device: torch.device, action_len: int, query_len: int) -> None:
        """Once per forward, before the layers (as upstream's): refuse what is not served, make
        this the cache's active forward, build the per-layer op inputs."""
        if self._prepared:
            return
        if action_len < 0 or query_len != self.seq_len + action_len:
            raise ValidationError(
                f"AR-diffusion forward has {query_len} queries; its chunk holds {self.seq_len} video tokens "
                f"and {action_len} action/state tokens"
            )
        if action_len and self.is_prefix:
            raise UnsupportedFeatureError(
                f"AR-diffusion first block with action/state tokens ({action_len}): not served (the host's "
                "pipelines send none there)"
            )
        if action_len or self.prefix_visible:
            missing = [b.name for b in self.cache.worker.backends if not b.capabilities.supports_dcp]
            if missing:
                raise UnsupportedFeatureError(
                    "AR-diffusion keys beside the session's pages (action/state tokens, a first block) need "
                    f"partial attention with its log-sum-exp (forward_partial); backend(s) {missing} do not "
                    "declare it"
                )
        self.action_len = int(action_len)
        here = self.cache.device
        if torch.device(device).type != here.type:
            raise UnsupportedFeatureError(
                f"AR-diffusion forward on device {device}: this DiffusionKVARCache serves forwards on {here}"
            )
        self.cache.active = self
        paged = importlib.import_module(_PAGED_ATTENTION)
        empty = torch.empty(0, dtype=torch.long, device=here)
        meta = torch.zeros(1, dtype=torch.int32, device=here)
        self._inputs = [
            paged.ARDiffusionPagedLayerInputs(
                layer_idx=paged._layer_idx_tensor(i),
                key_pool=self.cache.marker(i),
                value_pool=self.cache.marker(i),
                block_size=int(self.cache.block_size),
                seq_len=int(self.seq_len),
                video_slots=empty,
                action_slots=empty,
                block_table=meta,
                query_start_loc=meta,
                seq_lens=meta,
                max_query_len=int(query_len),
                max_seq_len=int(self.end),
            )
            for i in range(self.cache.geometry.num_layers)
        ]
        self._prepared = True

    def layer_inputs(self, layer_idx: int) -> Any:
        if not self._prepared:
            raise StateError("DiffusionKVARForward.layer_inputs() before prepare()")
        return self._inputs[layer_idx]

    def _check(self, layer: int) -> None:
        if self.cache.active is not self:
            raise StateError(
                f"AR-diffusion layer {layer} of session {self.session.session_id!r} called outside its forward"
            )

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One layer without scratch tokens: write this forward's K/V into its pages and attend."""
        self._check(layer)
        if query.shape[0] != self.seq_len or key.shape[0] != self.seq_len:
            raise ValidationError(
                f"AR-diffusion layer {layer}: {query.shape[0]} queries / {key.shape[0]} keys, chunk holds {self.seq_len}"
            )
        if self.prefix_visible:
            return self._merged(layer, query, key, value, [])
        self._step()
        dtype = self.cache.geometry.dtype
        worker = self._worker()
        out = worker.forward(_layer_name(layer), query.to(dtype), key.to(dtype), value.to(dtype))
        self._wrote(layer)
        return out.to(query.dtype)

    def attend_with_scratch(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scratch_key: torch.Tensor,
        scratch_value: torch.Tensor,
    ) -> torch.Tensor:
        """One layer of a forward with action/state tokens (DreamZero): ``query`` is the chunk's
        video queries followed by ``A`` action/state queries; ``scratch_key``/``scratch_value``
        (``[A, Hkv, D]``) are their K/V, seen by this forward only and never written to the
        pages (vLLM-Omni's scratch blocks). Every query sees the session's keys the chunk sees
        plus the scratch keys (non-causal, as the host's block table of visible video blocks +
        scratch blocks)."""
        self._check(layer)
        t, a = self.seq_len, self.action_len
        if query.shape[0] != t + a or key.shape[0] != t or scratch_key.shape[0] != a:
            raise ValidationError(
                f"AR-diffusion layer {layer}: {query.shape[0]} queries / {key.shape[0]} keys / "
                f"{scratch_key.shape[0]} scratch keys; the forward holds {t} video + {a} action/state tokens"
            )
        return self._merged(layer, query, key, value, [(scratch_key, scratch_value)])

    def _merged(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        extra: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The chunk's K/V written and attended through the worker's backend, the keys beside
        the pages -- a visible first block, read from its context, and the extra key sets --
        concatenated: in one backend call where the backend takes them
        (``PagedBackend.forward_extra_keys``: the gather + SDPA backends, one SDPA over the
        chunk's visible keys and these); otherwise as partial attention with its log-sum-exp
        (queries past the chunk's in the same call, as the chunk's own:
        ``forward_partial_extra``) merged (``merge_partial_attention``) with one dense partial
        over the extra keys."""
        self._step()
        dtype = self.cache.geometry.dtype
        name = _layer_name(layer)
        q = query.to(dtype)
        sets = []
        if self.prefix_visible:
            sets.append(read_context(self.cache.sessions, self.session, PREFIX, name))
        sets += [(k.to(dtype), v.to(dtype)) for k, v in extra]
        extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        if len(sets) == 1:
            extra_kv = sets[0]
        elif sets:
            extra_kv = (torch.cat([k for k, _ in sets]), torch.cat([v for _, v in sets]))
        paged, merged = _session_partial(
            self.cache.worker, name, q, key.to(dtype), value.to(dtype), self.seq_len, extra_kv
        )
        if merged or extra_kv is None:
            self._wrote(layer)
            return paged[0].to(query.dtype)
        dense = _dense_partial(q, *extra_kv, self.cache.worker.layers[name].scale)
        out = merge_partial_attention([paged[0], dense[0]], [paged[1], dense[1]])
        self._wrote(layer)
        return out.to(query.dtype)

    def _worker(self) -> PagedWorker:
        if self.prefix_rows is not None:
            contexts = self.cache.sessions.contexts
            assert contexts is not None
            return contexts.worker
        return self.cache.worker

    def _step(self) -> None:
        """Activate this forward's rows on its worker (once per forward, at the first layer).

        The batch prepared for the same rows by an earlier forward is activated again while it
        is valid (no block table change since, and no other preparation unless the worker
        retains its batches: the translator refuses a stale batch with
        :class:`StaleBatchError`): a chunk's probe forwards and its committing forward prepare
        once between them, per CFG branch where batches are retained."""
        if self._stack is not None:
            return
        worker = self._worker()
        rows = self.prefix_rows if self.chunk is None else self.chunk.rows()
        assert rows is not None
        translator = worker.translator
        assert translator is not None
        stack = contextlib.ExitStack()
        prepared = self.cache.prepared
        key = (id(worker), tuple(rows))
        cached = prepared.get(key)
        if cached is not None:
            try:
                stack.enter_context(translator.activate(cached))
                self._stack = stack
                return
            except StaleBatchError:
                del prepared[key]
        batch = translator.prepare(rows)
        while len(prepared) >= PREPARED_KEPT:
            del prepared[next(iter(prepared))]
        prepared[key] = batch
        stack.enter_context(translator.activate(batch))
        self._stack = stack

    def _wrote(self, layer: int) -> None:
        self._written.add(layer)
        if len(self._written) == self.cache.geometry.num_layers:
            self.finish()

    @property
    def complete(self) -> bool:
        """Every layer wrote the chunk."""
        return len(self._written) == self.cache.geometry.num_layers

    def finish(self) -> None:
        """Close the worker stepper (after the last layer, or when the forward is dropped)."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()
        if self.cache.active is self:
            self.cache.active = None


class DiffusionKVARState:
    """vLLM-Omni's ``ARDiffusionKVState`` on diffusion-kv sessions (module docstring)."""

    def __init__(self, cache: DiffusionKVARCache, session_id: str) -> None:
        self.cache = cache
        self.kv_cache = cache  # pipelines read kv_cache.cross_attention_lengths
        self.session_id = session_id
        self.num_layers = cache.geometry.num_layers
        self._sessions: dict[str, Session] = {}
        self._chunks: dict[str, Chunk | None] = {}
        self._pending: dict[str, DiffusionKVARForward | None] = {}
        self._prefix: dict[str, str] = {}
        """Per branch, the first-block prefix: none, open, committed or released."""
        self._prefix_rows: dict[str, tuple[PagedRow, ...]] = {}
        self._closed = False
        self._begin()

    def _begin(self) -> None:
        for branch in self.cache.kv_branches:
            self._sessions[branch] = self.cache.sessions.begin_session(f"{self.session_id}/{branch}")
            self._chunks[branch] = None
            self._pending[branch] = None
            self._prefix[branch] = "none"

    @property
    def kv_branch_names(self) -> tuple[str, ...]:
        return self.cache.kv_branches

    def _session(self, branch: str) -> Session:
        if self._closed:
            raise StateError(f"AR-diffusion session {self.session_id!r} is closed")
        found = self._sessions.get(branch)
        if found is None:
            raise ValidationError(f"unknown KV branch {branch!r}; expected {self.cache.kv_branches}")
        return found

    def committed_tokens(self, branch: str) -> int:
        """Committed tokens of the branch's chunks (a first block of another length not counted)."""
        return self._session(branch).committed_tokens

    def first_block(self, branch: str) -> str:
        """The branch's first-block prefix: ``none``, ``open``, ``committed`` or ``released``."""
        self._session(branch)
        return self._prefix[branch]

    # -- self-attention ------------------------------------------------------------------------

    def get_kv_caches(
        self, kv_branch: str, seq_len: int | None = None, commit_current: bool = False
    ) -> list[Any]:
        """Per-layer contexts for one KV branch forward (vLLM-Omni's layer contexts, over a
        :class:`DiffusionKVARForward`); the branch's chunk is reserved at its first forward."""
        session = self._session(kv_branch)
        if seq_len is None:
            raise ValidationError("AR-diffusion paged self-attention needs seq_len in get_kv_caches()")
        tokens = int(seq_len)
        cache = self.cache
        first = cache.prefix_tokens and self._prefix[kv_branch] in ("none", "open")
        expected = cache.prefix_tokens if first else cache.chunk_tokens
        if tokens != expected:
            what = "its first AR block holds" if first else "diffusion-kv sessions take AR blocks of"
            raise UnsupportedFeatureError(
                f"AR-diffusion forward of {tokens} tokens in session {self.session_id!r} branch {kv_branch!r}: "
                f"{what} {expected} tokens (ARGeometry.frames_per_block / first_block_frames)"
            )
        visible = False
        if cache.prefix_tokens and not first:
            end_frames = (session.committed_tokens + cache.chunk_tokens) // cache.geometry.tokens_per_frame
            visible = cache.geometry.prefix_visible(end_frames)  # refuses a window cutting a block
        previous = self._pending.get(kv_branch)
        if previous is not None:
            if previous.commit_current and previous.complete:
                raise StateError(
                    f"session {self.session_id!r} branch {kv_branch!r}: a committing forward ran and was not "
                    "committed (commit_paged_context) before the next one"
                )
            previous.finish()
        if first:
            forward = self._prefix_forward(session, kv_branch, bool(commit_current))
        else:
            if cache.prefix_tokens and not visible and self._prefix[kv_branch] == "committed":
                cache.sessions.release_context(session, PREFIX)  # out of every later block's window
                self._prefix[kv_branch] = "released"
            forward = self._chunk_forward(session, kv_branch, bool(commit_current), visible)
        self._pending[kv_branch] = forward
        paged = importlib.import_module(_PAGED_ATTENTION)
        return [
            paged.ARDiffusionPagedLayerContext(layer_idx=i, forward_ctx=forward)
            for i in range(self.num_layers)
        ]

    def _prefix_forward(self, session: Session, kv_branch: str, commit_current: bool) -> DiffusionKVARForward:
        """The stream's first block of another length: its K/V in the session's prefix context
        (reserved at its first forward), attending over itself only."""
        if self._prefix[kv_branch] == "none":
            rows = self.cache.sessions.set_context(session, PREFIX, self.cache.prefix_tokens)
            if rows is None:
                contexts = self.cache.sessions.contexts
                assert contexts is not None
                raise AdmissionError(
                    f"session {self.session_id!r} branch {kv_branch!r}: its first block's "
                    f"{self.cache.prefix_tokens} tokens do not fit the context pool "
                    f"({contexts.allocator.pool.num_free} blocks free)"
                )
            self._prefix_rows[kv_branch] = rows
            self._prefix[kv_branch] = "open"
        return DiffusionKVARForward(
            self, kv_branch, None, commit_current, prefix_rows=self._prefix_rows[kv_branch]
        )

    def _chunk_forward(
        self, session: Session, kv_branch: str, commit_current: bool, visible: bool
    ) -> DiffusionKVARForward:
        chunk = self._chunks[kv_branch]
        if chunk is None:
            chunk = self.cache.sessions.append_chunk(session)
            if chunk is None:
                raise AdmissionError(
                    f"session {self.session_id!r} branch {kv_branch!r}: {self.cache.chunk_tokens} tokens do not fit "
                    f"the pool ({self.cache.pool.num_free} of {self.cache.pool.num_total} blocks free)"
                )
            self._chunks[kv_branch] = chunk
        return DiffusionKVARForward(self, kv_branch, chunk, commit_current, prefix_visible=visible)

    def commit_paged_context(self, kv_branch: str) -> None:
        """After a successful forward: a committing forward's chunk is committed (retention then
        releases what slid out of the window); a probe forward commits nothing."""
        self._session(kv_branch)
        forward = self._pending.get(kv_branch)
        if forward is None:
            return
        forward.finish()
        self._pending[kv_branch] = None
        if forward.commit_current and forward.complete and forward.is_prefix:
            self._prefix[kv_branch] = "committed"
        elif forward.commit_current and forward.complete:
            chunk = self._chunks[kv_branch]
            assert chunk is not None and chunk is forward.chunk
            self.cache.sessions.commit(chunk)
            self._chunks[kv_branch] = None

    def abort_pending(self) -> None:
        """After a failed forward: every branch's open chunk is aborted (its session exactly as
        before the chunk was reserved)."""
        for branch in self.cache.kv_branches:
            forward = self._pending.get(branch)
            if forward is not None:
                forward.finish()
            self._pending[branch] = None
            chunk = self._chunks.get(branch)
            if chunk is not None:
                self.cache.sessions.abort(chunk)
                self._chunks[branch] = None
            if self._prefix.get(branch) == "open":  # an uncommitted first block goes with it
                self.cache.sessions.release_context(self._sessions[branch], PREFIX)
                self._prefix[branch] = "none"

    # -- cross-attention -----------------------------------------------------------------------

    def is_cross_attention_populated(self, kv_branch: str, cache_name: str) -> bool:
        return self.cache.cross.populated(self._session(kv_branch), cache_name)

    def populate_cross_attention(
        self, kv_branch: str, cache_name: str, layer_kv: Iterable[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Write-once: the branch session's context ``cache_name`` (every layer's K/V)."""
        session = self._session(kv_branch)
        if self.cache.cross.populated(session, cache_name):
            raise StateError(
                f"cross-attention cache {cache_name!r} of session {self.session_id!r} branch {kv_branch!r} is "
                "populated already (write-once; reset or clear_cross_attention first)"
            )
        self.cache.cross.populate(session, cache_name, layer_kv)

    def get_cross_attention_kv(self, kv_branch: str, cache_name: str) -> list[dict[str, torch.Tensor | bool]]:
        session = self._session(kv_branch)
        return [self.cache.cross.read(session, cache_name, i) for i in range(self.num_layers)]

    def clear_cross_attention(self) -> None:
        """Release every context of every branch session (the self-attention KV stays)."""
        if self._closed:
            raise StateError(f"AR-diffusion session {self.session_id!r} is closed")
        for session in self._sessions.values():
            self.cache.cross.release(session)

    # -- lifetime ------------------------------------------------------------------------------

    def _end(self) -> None:
        self.abort_pending()
        for session in self._sessions.values():
            self.cache.sessions.end_session(session)
        self._sessions.clear()

    def close(self) -> None:
        """End every branch session: all blocks and every context back to their pools."""
        if self._closed:
            return
        self._end()
        self._closed = True

    def reset(self, *, keep_cross_attention: Collection[str] = ()) -> None:
        """Drop the self-attention history (positions restart at 0: ``SessionCache.reset``),
        keeping the named cross-attention contexts (DreamZero's window reset keeps ``text``)
        and releasing the others."""
        unknown = set(keep_cross_attention) - set(self.cache.cross_attention_lengths)
        if unknown:
            raise ValidationError(f"unknown cross-attention caches to keep: {sorted(unknown)}")
        if self._closed:
            self._closed = False
            self._begin()
            return
        self.abort_pending()
        for session in self._sessions.values():
            keep = [n for n in self.cache.cross.names(session) if n in set(keep_cross_attention)]
            self.cache.sessions.reset(session, keep_contexts=keep)  # the first block goes too
        for branch in self.cache.kv_branches:
            self._prefix[branch] = "none"


def _session_partial(
    worker: PagedWorker,
    layer_name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tokens: int,
    extra_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
    """Write the open chunk's K/V (``tokens`` of them) and attend every query in ``query``
    over what the chunk sees, through the worker's backend: ``((out [Q, H, D], lse [Q, H]),
    merged)``. With ``extra_kv`` (keys and values ``[X, Hkv, D]``, seen by every query) the
    backend is asked to attend them in the same call (``PagedBackend.forward_extra_keys``):
    ``merged`` says it did; otherwise the result is over the pages only and the caller merges
    its own partial over the extra keys.

    The first ``tokens`` queries are the chunk's own; any after them attend as the chunk's
    queries do -- under a chunk-causal mask every query of a chunk sees the same keys -- in the
    same backend call where the backend can (``PagedBackend.forward_partial_extra``: one SDPA
    over the chunk's visible keys in the gather + SDPA backends; by default, pieces of
    ``tokens`` rows over the same prepared metadata)."""
    executor = worker.executor
    if executor is None:
        raise StateError("the AR-diffusion worker's paged KV cache is not initialised")
    ctx = executor.context(layer_name, query[:tokens], key, value)
    if ctx.plan is not None:
        raise UnsupportedFeatureError(
            f"AR-diffusion layer {layer_name!r}: piecewise spans are not served here"
        )
    backend = executor.backends[layer_name]
    kv_cache = executor.kv_caches[layer_name]
    if ctx.slots_valid:
        backend.write_kv_valid(ctx.layer, ctx.key, ctx.value, kv_cache, ctx.slot_mapping)
    else:
        backend.write_kv(ctx.layer, ctx.key, ctx.value, kv_cache, ctx.slot_mapping)
    extra = query[tokens:]
    md = ctx.native_metadata
    if extra_kv is not None:
        both = backend.forward_extra_keys(ctx.layer, ctx.query, extra, *extra_kv, kv_cache, md)
        if both is not None:
            executor.translator.layer_done(layer_name)
            return both, True
    if extra.shape[0]:
        out, lse = backend.forward_partial_extra(ctx.layer, ctx.query, extra, kv_cache, md)
    else:
        out, lse = backend.forward_partial(ctx.layer, ctx.query, kv_cache, md)
    executor.translator.layer_done(layer_name)  # the write counts (commit checks every layer wrote)
    return (out, lse), False


DENSE_FUSED_MIN_KEYS = 16
"""From this many extra keys on (off the CPU), :func:`_dense_partial` runs one fused attention
kernel in the model's dtype (``sdpa_with_lse``) instead of float32 einsums."""


def _dense_partial(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query over every one of a set of keys (no mask): ``(out [Q, H, D], lse [Q, H])``.

    On the CPU, and for a few keys, float32 einsums (exact against the reference). On a device,
    a set of :data:`DENSE_FUSED_MIN_KEYS` keys or more (the first-block prefix: a frame of keys)
    is one ``sdpa_with_lse`` call in the model's dtype -- no ``[H, Q, K]`` float32 scores -- the
    ``G`` query heads of each KV head folded into its query rows (no K/V copy for GQA)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if query.device.type != "cpu" and key.shape[0] >= DENSE_FUSED_MIN_KEYS:
        return _fused_partial(query, key, value, scale)
    k, v = key.float(), value.float()
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v)
    return out.to(query.dtype), lse.transpose(0, 1).contiguous()


def _fused_partial(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_dense_partial` as one ``sdpa_with_lse`` call in the query's dtype: the ``G``
    query heads of each KV head folded into its query rows, ``[1, Hkv, G * Q, D]``."""
    from diffusion_kv.platforms.torch_sdpa import sdpa_with_lse

    q_len, heads, d = query.shape
    kv_heads = key.shape[1]
    per_kv = heads // kv_heads
    qf = query.reshape(q_len, kv_heads, per_kv, d).permute(1, 2, 0, 3).reshape(1, kv_heads, per_kv * q_len, d)
    k = key.to(query.dtype).transpose(0, 1).unsqueeze(0)
    v = value.to(query.dtype).transpose(0, 1).unsqueeze(0)
    o, lg = sdpa_with_lse(qf, k, v, None, scale)
    out = o.reshape(kv_heads, per_kv, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d)
    lse = lg.reshape(kv_heads, per_kv, q_len).permute(2, 0, 1).reshape(q_len, heads)
    return out, lse.float()


def _kernel(
    query: torch.Tensor,
    k_curr: torch.Tensor,
    v_curr: torch.Tensor,
    k_act: torch.Tensor | None,
    v_act: torch.Tensor | None,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_size: int,
    video_slots: torch.Tensor,
    action_slots: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    stage_key: torch.Tensor | None = None,
    stage_value: torch.Tensor | None = None,
    reuse_history: bool = False,
    stage_first_block: int = 0,
) -> torch.Tensor:
    """The op's kernel (CPU, or CUDA): diffusion-kv's layers by their markers, upstream's body otherwise."""
    found = _MARKERS.get(key_pool.data_ptr())
    if found is None:
        upstream = importlib.import_module(_PAGED_ATTENTION)._paged_write_attn_impl
        result: torch.Tensor = upstream(
            query, k_curr, v_curr, k_act, v_act, key_pool, value_pool, block_size, video_slots, action_slots,
            block_table, query_start_loc, seq_lens, max_query_len, max_seq_len, softmax_scale,
            stage_key, stage_value, reuse_history, stage_first_block,
        )  # fmt: skip
        return result
    cache, layer = found
    forward = cache.active
    if forward is None:
        raise StateError(f"AR-diffusion layer {layer} called with no prepared diffusion-kv forward")
    expected = forward.cache.geometry.head_size**-0.5
    if abs(softmax_scale - expected) > 1e-12 * expected:
        raise UnsupportedFeatureError(
            f"AR-diffusion layer {layer} softmax_scale {softmax_scale} differs from head_size**-0.5 = {expected}"
        )
    if k_act is not None and v_act is not None and k_act.shape[0] > 0:
        return forward.attend_with_scratch(layer, query, k_curr, v_curr, k_act, v_act)
    return forward.attend(layer, query, k_curr, v_curr)


def install_kernel(device_type: str = "cpu") -> None:
    """Register :func:`_kernel` as vLLM-Omni's AR-diffusion paged op's kernel for ``device_type``
    (``cpu`` or ``cuda``; once per type). Calls on other layers run upstream's own body, which on
    CUDA is its FlashAttention path, so both paths share a process."""
    if device_type not in ("cpu", "cuda"):
        raise UnsupportedFeatureError(
            f"AR-diffusion op kernel for device type {device_type!r}: served on 'cpu' and 'cuda'"
        )
    if device_type in _INSTALLED:
        return
    importlib.import_module(_PAGED_ATTENTION)  # defines the op
    torch.library.register_kernel(OP_NAME, device_type, _kernel)
    _INSTALLED.add(device_type)


def install_cpu_kernel() -> None:
    """Register :func:`_kernel` as the CPU kernel of vLLM-Omni's AR-diffusion paged op (once)."""
    install_kernel("cpu")


__all__ = [
    "PREFIX",
    "ARGeometry",
    "CrossAttentionStore",
    "DiffusionKVARCache",
    "DiffusionKVARForward",
    "DiffusionKVARState",
    "install_cpu_kernel",
    "install_kernel",
    "read_context",
]

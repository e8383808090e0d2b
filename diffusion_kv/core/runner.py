"""Worker-side runner backend: layer registration, KV-cache initialisation, and the wiring of
registry + translator + executor for one worker.

Lifecycle::

    backend = PagedWorker(platform, RunnerConfig(...))
    backend.register_kv_cache_layers({"blk.0.attn": PagedLayerSpec(...), ...})   # validates
    backend.initialize_kv_cache(num_blocks=...)           # or a CacheLayout / KVCacheConfig
    backend.install(snapshot)                             # per request
    with backend.activate(PhaseRows(...)) as runtime:     # per denoise loop
        runtime.ensure_active(step); backend.forward(layer, q, k, v, attn_metadata)
    backend.remove([request_id])                          # rows only; the scheduler frees blocks

Initialisation picks one paged backend per KV-cache group through the platform's priority list
(``platform.select_backend``), then builds the BlockTables the backends name (scheduler blocks
split into the kernel's blocks where the kernel block is smaller), one backend instance per
group and every layer's cache. It is atomic: if any part fails, nothing is published and the
backend stays registered-but-uninitialised.

Parallelism (see :mod:`diffusion_kv.core.parallel`): under strict Ulysses the layers are
registered and their KV allocated with rank-local heads (the all-to-all around the call is the
model's, through :class:`~diffusion_kv.core.parallel.UlyssesParallel`); under CFG-parallel each
rank installs and attends with its branch's rows only; under decode context parallelism
(``cp_size > 1``) every paged call is a partial one merged across the DCP group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, TypeVar

import torch

from diffusion_kv.core.allocation import RequestAllocation
from diffusion_kv.core.attention import AttentionMode, MaskSpec
from diffusion_kv.core.backend import BackendChoice, BackendProvider, GroupContext, PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry
from diffusion_kv.core.block_tables import BlockTables, BlockTablesGeometry, block_table_width
from diffusion_kv.core.capabilities import Requirements
from diffusion_kv.core.errors import (
    DiffusionKVError,
    NativeBackendError,
    StateError,
    UnsupportedFeatureError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.execute import PagedExecutor
from diffusion_kv.core.graphs import CapturedStep, StepGraphs, check_capture_args
from diffusion_kv.core.host import HostRuntime, check_host
from diffusion_kv.core.kv_quant import (
    QUANTIZED_CACHE_DTYPES,
    KVScales,
    check_scale,
    parse_kv_cache_dtype,
    resolve_cache_dtype,
)
from diffusion_kv.core.layout import AttentionSpec, CacheLayout, KVCacheGroup, cdiv
from diffusion_kv.core.memory import footprint, shared_memory
from diffusion_kv.core.parallel import (
    DCPMerger,
    PartialMerger,
    RankGroup,
    select_cfg_branch,
    select_cfg_rows,
)
from diffusion_kv.core.registry import KVCacheMode, RowBinding, RowRegistry, removal_entries
from diffusion_kv.core.rows import PhaseRows
from diffusion_kv.core.runtime import BatchStepper
from diffusion_kv.core.translate import Translator, resolve_device

T = TypeVar("T")


@dataclass(frozen=True)
class ParallelConfig:
    """Sequence parallelism of the model around the paged call.

    Only strict Ulysses is compatible with paged attention (heads are sharded by all-to-all
    before the call; each rank pages its own heads). Ring attention, all-gather-KV and
    non-strict Ulysses modes are rejected at registration.
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    allgather_degree: int = 1
    ulysses_mode: str = "strict"


class WorkerParts(NamedTuple):
    """The parts an initialised worker runs on, by name."""

    registry: RowRegistry
    translator: Translator
    executor: PagedExecutor


@dataclass(frozen=True)
class RunnerConfig:
    max_model_len: int
    max_rows_per_request: int
    max_num_seqs: int
    max_num_batched_tokens: int
    mode: KVCacheMode = KVCacheMode.PAGED
    parallel: ParallelConfig = ParallelConfig()
    device: torch.device | None = None
    cp_size: int = 1
    """Decode context parallel size (KV of every row interleaved across ``cp_size`` ranks)."""
    cp_rank: int = 0
    cp_interleave: int = 1
    """Consecutive tokens each DCP rank holds in turn; must divide every block size."""
    cfg_parallel_size: int = 1
    """CFG-parallel size: every request has one sequence per branch, one branch per rank."""
    cfg_parallel_rank: int = 0
    slot_mapping_dtype: torch.dtype | None = None
    """Slot dtype of the BlockTables (default: int64 where every chosen backend takes it)."""
    backend: BackendChoice = None
    """The backend every KV-cache group uses: its name or class (None: the platform's priority
    list picks per group; ``DIFFUSION_KV_BACKEND=<platform>:<backend>`` is only this default).
    A choice that cannot serve a group is refused with its reasons, never replaced."""
    kv_cache_dtype: torch.dtype | str = "auto"
    """The pages' dtype: ``auto`` (each layer's own), or ``fp8_e4m3`` (``float8_e4m3fn``: one byte
    per element, per-KV-head scales; ``diffusion_kv.core.kv_quant``); a backend must declare it."""
    graph_capture: bool = False
    """The host captures steps as CUDA graphs (:meth:`PagedWorker.capture`): a selection
    requirement (``Requirements.graph_capture``), so every group gets a backend declaring
    ``supports_graph_capture``; a forced choice that does not is refused with the reason."""


@dataclass(frozen=True)
class PagedLayerSpec:
    """A model attention layer that opts into paging (global, not rank-local, heads)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    mode: AttentionMode | MaskSpec = AttentionMode.CAUSAL
    """What the layer attends to: CAUSAL, FULL for a non-causal layer (vLLM's ``non_causal``),
    or a parametrised mask (``MaskSpec``: chunk-causal, a sliding window, sinks). Layers with
    different masks get different KV-cache groups."""
    scale: float | None = None
    skip_sequence_parallel: bool = False
    cache_role: str | None = None
    k_scale: float | Sequence[float] = 1.0
    """With a quantised KV cache: the key scale, one number or one per KV head (global heads;
    one number when the heads are split across Ulysses ranks). Pages hold ``k / k_scale``."""
    v_scale: float | Sequence[float] = 1.0


def group_masks(layers: Iterable[LayerGeometry]) -> list[MaskSpec]:
    """The distinct masks of ``layers``, one KV-cache group each: by kind in
    ``AttentionMode.layer_modes()`` order (causal before full), then first appearance."""
    order = {m: i for i, m in enumerate(AttentionMode.layer_modes())}
    masks = list(dict.fromkeys(g.mask for g in layers))
    return sorted(masks, key=lambda m: order[m.kind])


def _check_parallel(parallel: object) -> None:
    if not isinstance(parallel, ParallelConfig):
        raise ValidationError(
            f"RunnerConfig.parallel must be a ParallelConfig; got {type(parallel).__name__}"
        )
    for name in ("ulysses_degree", "ring_degree", "allgather_degree"):
        _positive(getattr(parallel, name), f"ParallelConfig.{name}")
    if type(parallel.ulysses_mode) is not str:
        raise ValidationError(f"ParallelConfig.ulysses_mode must be a string; got {parallel.ulysses_mode!r}")


def _positive(value: object, what: str) -> int:
    if type(value) is not int or value <= 0:
        raise ValidationError(f"{what} must be a positive integer; got {value!r}")
    return value


def _check_given_caches(kv_caches: object) -> None:
    """The host's caches: a mapping of layer name to a cache (its values are checked by
    :func:`_check_given_cache` when each is bound: a host mapping may make its views only once
    the backends are chosen)."""
    if isinstance(kv_caches, (str, bytes)) or not isinstance(kv_caches, Mapping):
        raise ValidationError(
            f"kv_caches must map each paged layer name to its cache; got {type(kv_caches).__name__}"
        )


def _check_given_cache(name: str, cache: object) -> None:
    """One bound cache: a tensor or a tuple of tensors, none of which requires grad (the cache
    never joins autograd)."""
    tensors = cache if isinstance(cache, tuple) else (cache,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValidationError(
            f"kv_caches[{name!r}] must be a tensor or a tuple of tensors; got "
            f"{[type(t).__name__ for t in tensors] if isinstance(cache, tuple) else type(cache).__name__}"
        )
    if any(t.requires_grad for t in tensors):
        raise ValidationError(
            f"kv_caches[{name!r}] requires grad; the KV cache never joins autograd: bind a tensor "
            "created under torch.no_grad() or detached (tensor.detach())"
        )


def _check_cache_memory(caches: Mapping[str, KVCache], *, bound: bool, platform: str) -> None:
    """Refuse caches that share memory: two layers (or a layer's key and value) writing one
    page would corrupt each other silently."""
    named: list[tuple[str, torch.Tensor]] = []
    for name, cache in caches.items():
        tensors = cache if isinstance(cache, tuple) else (cache,)
        parts = ("key", "value") if len(tensors) == 2 else tuple(f"part {i}" for i in range(len(tensors)))
        named.extend(
            (f"layer {name!r}" + (f" ({part})" if len(tensors) > 1 else ""), t)
            for part, t in zip(parts, tensors, strict=True)
            if isinstance(t, torch.Tensor)
        )
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            raise (ValidationError if bound else NativeBackendError)(
                f"the KV cache of layer {name!r} requires grad; the KV cache never joins autograd"
            )
    found = shared_memory(named)
    if found is None:
        return
    first, second, verdict = found
    by_name = dict(named)

    def where(name: str) -> str:
        fp = footprint(by_name[name])
        return f"{name} (bytes [{fp.start:#x}, {fp.end:#x}))" if fp is not None else name

    if second is None:
        what = f"{where(first)} {'may address' if verdict is None else 'addresses'} some bytes twice"
    else:
        what = f"{where(first)} and {where(second)} {'may share' if verdict is None else 'share'} memory"
    if verdict is None:
        what += " (their strides are too irregular to prove otherwise)"
    source = "the given kv_caches" if bound else f"the caches platform {platform!r} allocated"
    raise (ValidationError if bound else NativeBackendError)(
        f"{source}: {what}; one layer's K/V writes would overwrite another's pages. Give every layer "
        "(and its key and value) memory of its own: separate tensors or disjoint views"
    )


class PagedWorker:
    """Owns one worker's paged KV state; see the module docstring for the lifecycle."""

    def __init__(
        self,
        platform: BackendProvider,
        config: RunnerConfig,
        *,
        dcp_merger: PartialMerger | None = None,
        host: HostRuntime | None = None,
    ) -> None:
        """``dcp_merger`` merges partial attention across the DCP group when ``cp_size > 1``;
        by default a :class:`~diffusion_kv.core.parallel.DCPMerger` over the default
        ``torch.distributed`` group is built at KV-cache initialisation. ``host`` is the
        embedding host's runtime (:class:`~diffusion_kv.core.host.HostRuntime`): selection and
        every backend instance (``GroupContext.host``) get it; None: standalone."""
        host = check_host(host)
        missing = [
            m for m in ("name", "default_block_size", "device", "select_backend") if not hasattr(platform, m)
        ]
        if missing:
            raise ValidationError(
                f"PagedWorker needs a platform (get_platform()); {type(platform).__name__} lacks {missing}"
            )
        if not isinstance(config, RunnerConfig):
            raise ValidationError(f"PagedWorker needs a RunnerConfig; got {type(config).__name__}")
        if not isinstance(config.mode, KVCacheMode):
            raise ValidationError(
                f"RunnerConfig.mode must be KVCacheMode.PAGED or KVCacheMode.DENSE; got {config.mode!r}"
            )
        _check_parallel(config.parallel)
        if config.slot_mapping_dtype is not None and config.slot_mapping_dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise ValidationError(
                f"RunnerConfig.slot_mapping_dtype must be torch.int32, torch.int64 or None; got "
                f"{config.slot_mapping_dtype!r}"
            )
        for name in (
            "max_model_len",
            "max_rows_per_request",
            "max_num_seqs",
            "max_num_batched_tokens",
            "cp_size",
            "cp_interleave",
            "cfg_parallel_size",
        ):
            _positive(getattr(config, name), f"RunnerConfig.{name}")
        for size, rank in (("cp_size", "cp_rank"), ("cfg_parallel_size", "cfg_parallel_rank")):
            value = getattr(config, rank)
            if type(value) is not int or not 0 <= value < getattr(config, size):
                raise ValidationError(
                    f"RunnerConfig.{rank} must lie in [0, {size}={getattr(config, size)}); got {value!r}"
                )
        if type(config.graph_capture) is not bool:
            raise ValidationError(f"RunnerConfig.graph_capture must be a bool; got {config.graph_capture!r}")
        cache_dtype = parse_kv_cache_dtype(config.kv_cache_dtype)
        choice = config.backend
        if choice is not None and not (
            (isinstance(choice, str) and choice.strip())
            or (isinstance(choice, type) and issubclass(choice, PagedBackend))
        ):
            raise ValidationError(
                f"RunnerConfig.backend must be a backend name, a PagedBackend class or None; got {choice!r}"
            )
        wanted = config.device if config.device is not None else platform.device()
        try:
            device = resolve_device(wanted)
        except Exception as exc:  # a malformed name, a device type torch does not have here
            raise ValidationError(
                f"RunnerConfig.device={wanted!r} cannot be used here ({type(exc).__name__}: {exc})"
            ) from exc
        self.dcp_merger = dcp_merger
        self.platform = platform
        self.config = config
        self.host = host
        self.device = device
        self.cache_dtype: torch.dtype | None = cache_dtype
        """The requested cache dtype (None: each layer's own)."""
        self.layers: dict[str, LayerGeometry] = {}
        self.cache_roles: frozenset[str] = frozenset()
        self.layout: CacheLayout | None = None
        self.block_tables: BlockTables | None = None
        self.registry: RowRegistry | None = None
        self.translator: Translator | None = None
        self.executor: PagedExecutor | None = None
        self.kv_caches: dict[str, KVCache] = {}
        self.backends: tuple[PagedBackend, ...] = ()
        """One backend instance per KV-cache group, once initialised."""

    @property
    def initialized(self) -> bool:
        return self.layout is not None

    # -- registration -------------------------------------------------------------------------

    def _ulysses_degree(self, spec: PagedLayerSpec) -> int:
        if spec.skip_sequence_parallel:
            return 1
        p = self.config.parallel
        if p.ring_degree > 1:
            raise UnsupportedFeatureError(
                "paged attention does not support Ring or hybrid Ulysses+Ring attention"
            )
        if p.allgather_degree > 1:
            raise UnsupportedFeatureError(
                "paged attention does not support all-gather-KV sequence parallelism"
            )
        if p.ulysses_degree > 1 and p.ulysses_mode != "strict":
            raise UnsupportedFeatureError(
                f"paged attention supports only strict Ulysses; got ulysses_mode={p.ulysses_mode!r}"
            )
        return _positive(p.ulysses_degree, "ulysses_degree")

    def register_kv_cache_layers(self, layers: Mapping[str, PagedLayerSpec]) -> dict[str, LayerGeometry]:
        """Validate paged layers and return their rank-local geometry.

        May be called again (replacing the set) until the KV cache is initialised; a failed call
        leaves the previous registration in place.
        """
        if self.initialized:
            raise StateError("paged KV-cache layers cannot change after the KV cache is initialised")
        if not isinstance(layers, Mapping):
            raise ValidationError(
                f"register_kv_cache_layers takes a mapping of layer name to PagedLayerSpec; got {type(layers).__name__}"
            )
        if not layers:
            raise ValidationError("register at least one paged attention layer")
        geometry: dict[str, LayerGeometry] = {}
        roles: set[str] = set()
        for name, spec in layers.items():
            if type(name) is not str or not name:
                raise ValidationError(f"paged layer names must be non-empty strings; got {name!r}")
            if not isinstance(spec, PagedLayerSpec):
                raise ValidationError(
                    f"paged layer {name!r} needs a PagedLayerSpec; got {type(spec).__name__}"
                )
            heads = _positive(spec.num_heads, f"layer {name!r} num_heads")
            kv_heads = _positive(spec.num_kv_heads, f"layer {name!r} num_kv_heads")
            _positive(spec.head_size, f"layer {name!r} head_size")
            if heads % kv_heads:
                raise ValidationError(
                    f"layer {name!r}: num_heads={heads} must be a multiple of num_kv_heads={kv_heads}"
                )
            degree = self._ulysses_degree(spec)
            if heads % degree or kv_heads % degree:
                raise ValidationError(
                    f"layer {name!r}: num_heads={heads} and num_kv_heads={kv_heads} must be divisible by "
                    f"ulysses_degree={degree}"
                )
            if not isinstance(spec.dtype, torch.dtype):
                raise ValidationError(f"layer {name!r}: dtype must be a torch.dtype; got {spec.dtype!r}")
            if not isinstance(spec.mode, MaskSpec) and (
                not isinstance(spec.mode, AttentionMode)
                or not spec.mode.is_layer_mode
                or spec.mode is AttentionMode.CHUNK_CAUSAL
            ):
                raise ValidationError(
                    f"layer {name!r}: mode must be AttentionMode.CAUSAL, FULL or a MaskSpec "
                    f"(CHUNK_CAUSAL needs its chunk size); got {spec.mode!r}"
                )
            mask = MaskSpec.of(spec.mode)
            if spec.scale is not None and (
                isinstance(spec.scale, bool)
                or not isinstance(spec.scale, (int, float))
                or not math.isfinite(spec.scale)
                or spec.scale <= 0
            ):
                raise ValidationError(
                    f"layer {name!r}: scale must be a finite positive number or None; got {spec.scale!r}"
                )
            if spec.cache_role is not None:
                if type(spec.cache_role) is not str or not spec.cache_role:
                    raise ValidationError(f"layer {name!r}: cache_role must be a non-empty string or None")
                roles.add(spec.cache_role)
            cache_dtype = resolve_cache_dtype(spec.dtype, self.cache_dtype, f"layer {name!r}")
            scales = None
            if cache_dtype not in QUANTIZED_CACHE_DTYPES:  # unused on 16-bit pages, still well formed
                for what, value in (("k_scale", spec.k_scale), ("v_scale", spec.v_scale)):
                    check_scale(value, kv_heads, f"layer {name!r} {what}")
            if cache_dtype in QUANTIZED_CACHE_DTYPES:
                per_head = [
                    s for s in (spec.k_scale, spec.v_scale) if not isinstance(s, (int, float, torch.Tensor))
                ]
                if degree > 1 and per_head:
                    raise ValidationError(
                        f"layer {name!r}: per-KV-head k_scale/v_scale with Ulysses degree {degree}; give one "
                        "number each (the heads are split across ranks)"
                    )
                scales = KVScales(kv_heads // degree, self.device, spec.k_scale, spec.v_scale, name)
            geometry[name] = LayerGeometry(
                layer_name=name,
                num_heads=heads // degree,
                num_kv_heads=kv_heads // degree,
                head_size=spec.head_size,
                scale=float(spec.scale) if spec.scale is not None else spec.head_size**-0.5,
                dtype=spec.dtype,
                mode=mask.kind,
                cache_dtype=cache_dtype,
                kv_scales=scales,
                mask=mask,
            )
        shapes = {(g.num_heads, g.num_kv_heads, g.head_size, g.dtype) for g in geometry.values()}
        if len(shapes) > 1:
            raise ValidationError(
                "native metadata builders need one rank-local attention geometry "
                f"(num_heads, num_kv_heads, head_size, dtype); got {sorted(shapes, key=str)}"
            )
        for mask in group_masks(geometry.values()):
            layer = next(g for g in geometry.values() if g.mask == mask)
            requirements = self._requirements(layer)
            reasons = (
                self.platform.not_supported_reasons(requirements, host=self.host)
                if self.host is not None  # a platform written before hosts takes requirements only
                else self.platform.not_supported_reasons(requirements)
            )
            if reasons:
                raise UnsupportedRequirementsError(
                    f"platform {self.platform.name!r} cannot serve these layers ({requirements.describe()}): "
                    + "; ".join(reasons)
                )
        self.layers = geometry
        self.cache_roles = frozenset(roles)
        return dict(geometry)

    def _requirements(self, layer: LayerGeometry, block_size: int | None = None) -> Requirements:
        """What a group of layers like ``layer`` needs: its mask's kinds (spans refine plain
        causal and full layers into causal and full segments, so such a group needs piecewise
        attention too), window and sink."""
        return Requirements(
            dtype=layer.dtype,
            kv_cache_dtype=layer.cache_dtype,
            head_size=layer.head_size,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            block_size=block_size,
            attention_modes=layer.mask.required_modes,
            window=layer.mask.window,
            sink=layer.mask.sink,
            chunk=layer.mask.chunk,
            ulysses_degree=self.config.parallel.ulysses_degree,
            dcp_size=self.config.cp_size,
            graph_capture=self.config.graph_capture,
        )

    # -- initialisation -----------------------------------------------------------------------

    def layout_for(self, num_blocks: int, block_size: int | None = None) -> CacheLayout:
        """A layout for the registered layers: one group per mask (``group_masks`` order)."""
        if not self.layers:
            raise StateError("register paged layers before building a cache layout")
        block = block_size if block_size is not None else self.platform.default_block_size
        groups = []
        for mask in group_masks(self.layers.values()):
            names = tuple(n for n, g in self.layers.items() if g.mask == mask)
            g0 = self.layers[names[0]]
            groups.append(
                KVCacheGroup(
                    block,
                    names,
                    AttentionSpec(g0.num_kv_heads, g0.head_size, g0.dtype, mask.kind, g0.cache_dtype, mask),
                )
            )
        c = self.config
        return CacheLayout(
            groups=tuple(groups),
            num_blocks=num_blocks,
            max_model_len=c.max_model_len,
            max_rows_per_request=c.max_rows_per_request,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
        )

    def initialize_kv_cache(
        self,
        config: CacheLayout | Any | None = None,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        kv_caches: Mapping[str, KVCache] | None = None,
    ) -> CacheLayout:
        """Allocate caches and build the platform parts; atomic (see module docstring).

        ``config`` is a :class:`CacheLayout`, a vLLM ``KVCacheConfig``-shaped object, or None
        (then ``num_blocks`` and optionally ``block_size`` describe a layout for the layers).
        ``kv_caches`` (one per layer) binds caches the host owns instead of allocating them —
        e.g. the scheduler's ``KVCacheConfig`` tensors — after each backend checked its layout.
        """
        if self.initialized:
            raise StateError("the paged KV cache is already initialised")
        if not self.layers:
            raise StateError("register paged layers before initialising the KV cache")
        if config is None:
            if num_blocks is None:
                raise ValidationError("initialize_kv_cache needs a layout or num_blocks")
            layout = self.layout_for(num_blocks, block_size)
        elif isinstance(config, CacheLayout):
            layout = config
        else:
            c = self.config
            layout = CacheLayout.from_kv_cache_config(
                config,
                max_model_len=c.max_model_len,
                max_rows_per_request=c.max_rows_per_request,
                max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens,
            )
        configured = set(layout.layer_names)
        if kv_caches is not None:
            _check_given_caches(kv_caches)
        if kv_caches is not None and set(kv_caches) != set(self.layers):
            raise ValidationError(
                f"kv_caches must name every paged layer: missing {sorted(set(self.layers) - set(kv_caches))}, "
                f"unknown {sorted(set(kv_caches) - set(self.layers))}"
            )
        if configured != set(self.layers):
            raise ValidationError(
                f"KV-cache layout layers differ from the registered ones: registered={sorted(self.layers)}, "
                f"configured={sorted(configured)}"
            )
        c_cp = self.config.cp_size
        for g, group in enumerate(layout.groups):
            for name in group.layer_names:
                geom = self.layers[name]
                if (geom.num_kv_heads, geom.head_size, geom.dtype, geom.mask) != (
                    group.spec.num_kv_heads,
                    group.spec.head_size,
                    group.spec.dtype,
                    group.spec.mask,
                ):
                    raise ValidationError(
                        f"layer {name!r} does not match the spec of KV-cache group {g}: {group.spec}"
                    )
        chosen = self.select_backends(layout)  # one per group, by the platform's priority list
        kernels = []
        for g, (group, backend_cls) in enumerate(zip(layout.groups, chosen, strict=True)):
            kernel = backend_cls.capabilities.kernel_block_size_for(group.block_size)
            if kernel is None:  # its not_supported_reasons accepted a block size its capabilities do not
                raise NativeBackendError(
                    f"platform {self.platform.name!r} chose backend {backend_cls.name!r} for KV-cache group {g}, "
                    f"but its capabilities declare no kernel block size for block size {group.block_size} "
                    f"({', '.join(map(str, backend_cls.capabilities.kernel_block_sizes))}); nothing was initialised"
                )
            if c_cp > 1 and kernel % self.config.cp_interleave:
                raise ValidationError(
                    f"cp_interleave={self.config.cp_interleave} must divide the kernel block size {kernel} "
                    f"of KV-cache group {g} (backend {backend_cls.name!r})"
                )
            kernels.append(kernel)
        merger = self._dcp_merger()
        parts = self._build_parts(
            layout, chosen, kernels, merger, kv_caches
        )  # raises before anything is published
        self.layout = layout
        self.dcp_merger = merger
        (self.block_tables, self.registry, self.translator, self.executor, self.kv_caches, self.backends) = (
            parts
        )
        return layout

    def select_backends(self, layout: CacheLayout) -> list[type[PagedBackend]]:
        """The backend class each KV-cache group of ``layout`` gets (what
        :meth:`initialize_kv_cache` builds; selection is deterministic, so a host may ask first,
        e.g. to lay out caches it owns in the chosen page layouts). Changes nothing."""
        chosen: list[type[PagedBackend]] = []
        for group in layout.groups:
            layer = self.layers[group.layer_names[0]]
            chosen.append(
                self.platform.select_backend(
                    self._requirements(layer, group.block_size),
                    chosen,
                    force=self.config.backend,
                    host=self.host,
                )
            )
        return chosen

    def _dcp_merger(self) -> PartialMerger | None:
        c = self.config
        if c.cp_size == 1:
            return None
        merger = self.dcp_merger if self.dcp_merger is not None else DCPMerger(RankGroup.of(None))
        if (merger.size, merger.rank) != (c.cp_size, c.cp_rank):
            raise ValidationError(
                f"the DCP process group has size {merger.size} and this rank is {merger.rank}; "
                f"RunnerConfig says cp_size={c.cp_size}, cp_rank={c.cp_rank}"
            )
        return merger

    def _build_parts(
        self,
        layout: CacheLayout,
        chosen: list[type[PagedBackend]],
        kernels: list[int],
        merger: PartialMerger | None,
        given: Mapping[str, KVCache] | None = None,
    ) -> tuple[
        BlockTables, RowRegistry, Translator, PagedExecutor, dict[str, KVCache], tuple[PagedBackend, ...]
    ]:
        c = self.config
        platform = self.platform
        part = self._plugin_part
        slot_dtypes = frozenset.intersection(*(b.capabilities.slot_mapping_dtypes for b in chosen))
        slot_dtype = torch.int64 if torch.int64 in slot_dtypes else torch.int32
        align = self.host.block_table_alignment if self.host is not None else None
        if c.slot_mapping_dtype is not None:
            if c.slot_mapping_dtype not in slot_dtypes:
                raise ValidationError(
                    f"RunnerConfig.slot_mapping_dtype={c.slot_mapping_dtype} is not declared by the chosen "
                    f"backend(s) {[b.name for b in chosen]} (declared: {sorted(map(str, slot_dtypes))})"
                )
            slot_dtype = c.slot_mapping_dtype
        geometry = part(
            "BlockTables geometry",
            None,
            lambda: BlockTablesGeometry.of(
                block_sizes=layout.block_sizes,
                max_num_reqs=layout.max_num_reqs,
                max_num_batched_tokens=layout.max_num_batched_tokens,
                max_num_blocks_per_group=[
                    block_table_width(cdiv(layout.max_model_len, bs * c.cp_size), bs, align)
                    for bs in layout.block_sizes
                ],
                device=self.device,
                kernel_block_sizes=kernels,
                cp_size=c.cp_size,
                cp_rank=c.cp_rank,
                cp_interleave=c.cp_interleave,
                slot_mapping_dtype=slot_dtype,
            ),
        )
        block_tables = part("BlockTables", None, lambda: geometry.build(chosen[0].block_tables_cls()))
        backends: list[PagedBackend] = []
        for g, (group, backend_cls, kernel) in enumerate(zip(layout.groups, chosen, kernels, strict=True)):
            context = GroupContext(
                index=g,
                layers=tuple(self.layers[n] for n in group.layer_names),
                mode=group.spec.mode,
                block_size=group.block_size,
                kernel_block_size=kernel,
                num_blocks=layout.num_blocks,
                block_tables=block_tables,
                layout=layout,
                device=self.device,
                platform_name=platform.name,
                host=self.host,
            )
            backends.append(part(f"backend {backend_cls.name!r}", None, partial(backend_cls, context)))
        translator = Translator(
            layout=layout,
            block_tables=block_tables,
            backends=backends,
            rows=None,
            device=self.device,
            platform_name=platform.name,
        )
        registry = RowRegistry(
            layout,
            block_tables,
            mode=c.mode,
            before_mutation=translator.invalidate,
            cache_roles=self.cache_roles or None,
        )
        translator.rows = registry
        by_layer: dict[str, PagedBackend] = {}
        caches: dict[str, KVCache] = {}
        for group, backend in zip(layout.groups, backends, strict=True):
            for name in group.layer_names:
                by_layer[name] = backend
                if given is not None:
                    cache = given[name]
                    _check_given_cache(name, cache)
                    caches[name] = part(
                        "KV-cache binding",
                        name,
                        partial(backend.bind_kv_cache, self.layers[name], cache),
                    )
                else:
                    caches[name] = part(
                        "KV-cache allocation", name, partial(backend.allocate_kv_cache, self.layers[name])
                    )
        _check_cache_memory(caches, bound=given is not None, platform=platform.name)
        executor = PagedExecutor(translator, self.layers, by_layer, caches, merger, platform.name)
        return block_tables, registry, translator, executor, caches, tuple(backends)

    def _plugin_part(self, what: str, layer: str | None, build: Callable[[], T]) -> T:
        """Build one plugin part; a failure inside the plugin becomes a NativeBackendError."""
        try:
            return build()
        except DiffusionKVError:
            raise
        except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() is a plugin failure
            where = f" for layer {layer!r}" if layer is not None else ""
            raise NativeBackendError(
                f"platform {self.platform.name!r} failed to build its {what}{where} "
                f"({type(exc).__name__}: {exc}); nothing was initialised"
            ) from exc

    # -- per request --------------------------------------------------------------------------

    def _require(self) -> WorkerParts:
        if self.registry is None or self.translator is None or self.executor is None:
            raise StateError("the paged KV cache is not initialised")
        return WorkerParts(self.registry, self.translator, self.executor)

    def install(self, snapshot: RequestAllocation) -> bool:
        """Install a snapshot (under CFG-parallel: only this rank's branch, validated first)."""
        registry = self.registry
        if registry is None or self.translator is None or self.executor is None:
            self._require()  # the StateError naming it
        assert registry is not None
        c = self.config
        if c.cfg_parallel_size == 1 and type(snapshot) is RequestAllocation:
            return registry.install(snapshot)  # (select_cfg_branch's answer without CFG parallelism)
        return registry.install(select_cfg_branch(snapshot, c.cfg_parallel_size, c.cfg_parallel_rank))

    def seal(self, snapshot: RequestAllocation) -> bool:
        """Seal an installed request's grown cached prefix (the ``install`` to hand
        :meth:`~diffusion_kv.core.allocator.DiffusionKVAllocator.publish`): a request this worker
        does not hold is a :class:`StateError` (:meth:`RowRegistry.seal`)."""
        registry = self._require().registry
        c = self.config
        return registry.seal(select_cfg_branch(snapshot, c.cfg_parallel_size, c.cfg_parallel_rank))

    def adopt(
        self, snapshot: RequestAllocation, donor: str, readable: Sequence[tuple[int, int]] | None = None
    ) -> bool:
        """Take ``snapshot`` as a REPLACE of an installed request by its installed shadow
        ``donor`` (:meth:`~diffusion_kv.core.registry.RowRegistry.adopt`: a re-cache's commit;
        ``readable``: the spans readable from now on, when fewer than today's)."""
        registry = self._require().registry
        if self.config.cfg_parallel_size > 1:
            raise UnsupportedFeatureError("adopting a shadow's blocks under CFG parallelism is not supported")
        return registry.adopt(snapshot, donor, readable)

    def compact(self, snapshot: RequestAllocation, at: int, tokens: int) -> bool:
        """Take ``snapshot`` as a COMPACT of an installed request: its rows less the released
        tokens ``[at, at + tokens)``, later positions moved down by ``tokens``
        (:meth:`~diffusion_kv.core.registry.RowRegistry.compact`; under CFG-parallel only this
        rank's branch)."""
        registry = self._require().registry
        c = self.config
        return registry.compact(
            select_cfg_branch(snapshot, c.cfg_parallel_size, c.cfg_parallel_rank), at, tokens
        )

    def remove(self, requests: str | tuple[str, int] | Iterable[str | tuple[str, int]]) -> int:
        """Clear the rows of requests (one id, ``(id, generation)``, or an iterable of them)."""
        if self.registry is None:
            removal_entries(requests)  # bad input is an error even before initialisation
            return 0
        return self.registry.remove(requests)

    def retire(self, request_id: str, through_generation: int) -> int:
        """Remove a request's rows for good: every snapshot of it up to ``through_generation``
        is refused from now on, even one still in flight (see
        :meth:`~diffusion_kv.core.registry.RowRegistry.retire`)."""
        if self.registry is None:
            raise StateError("the paged KV cache is not initialised")
        return self.registry.retire(request_id, through_generation)

    @property
    def generation_high_water(self) -> int:
        """The highest allocation generation this worker has seen (-1: none, or uninitialised)."""
        return self.registry.generation_high_water if self.registry is not None else -1

    def resolve(self, request_id: str, sequence_id: int | None, context_id: str | None = None) -> RowBinding:
        if type(request_id) is not str or not request_id:
            raise ValidationError(f"resolve takes a non-empty request id string; got {request_id!r}")
        if sequence_id is not None and (type(sequence_id) is not int or sequence_id < 0):
            raise ValidationError(f"resolve: sequence_id must be an int >= 0 or None; got {sequence_id!r}")
        if context_id is not None and (type(context_id) is not str or not context_id):
            raise ValidationError(
                f"resolve: context_id must be a non-empty string or None; got {context_id!r}"
            )
        if self.registry is None:
            raise StateError("the paged KV cache is not initialised")
        return self.registry.resolve(request_id, sequence_id, context_id)

    def refresh_layout(self) -> None:
        if self.registry is not None:
            self.registry.refresh_layout()

    @contextmanager
    def activate(self, phases: PhaseRows) -> Iterator[BatchStepper]:
        """A runtime for one denoise loop; closed (and deactivated) on exit."""
        if not isinstance(phases, PhaseRows):
            raise ValidationError(f"activate takes PhaseRows; got {type(phases).__name__}")
        parts = self._require()
        registry, translator = parts.registry, parts.translator
        if self.config.cfg_parallel_size > 1:
            installed = {r.request_id for r in (*phases.prefill, *phases.denoise)}
            branches = [s for s in map(registry.snapshot_of, sorted(installed)) if s is not None]
            phases = select_cfg_rows(phases, branches)
        runtime = BatchStepper(translator, phases)
        with runtime.activate():
            yield runtime

    @contextmanager
    def stepper(self) -> Iterator[BatchStepper]:
        """A runtime for a scheduler that steps explicit rows, each request at its own phase
        (:meth:`BatchStepper.ensure_rows`); closed (and deactivated) on exit."""
        translator = self._require().translator
        if self.config.cfg_parallel_size > 1:
            raise UnsupportedFeatureError(
                "stepping explicit rows under CFG parallelism is not supported: pass this rank's rows "
                "through activate(PhaseRows) per request instead"
            )
        runtime = BatchStepper(translator)
        with runtime.activate():
            yield runtime

    def forward(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any | None = None,
    ) -> torch.Tensor:
        return self._require().executor.forward(layer_name, query, key, value, attn_metadata)

    @property
    def supports_graph_capture(self) -> bool:
        """Whether every chosen backend declares ``supports_graph_capture`` on a CUDA device."""
        return (
            self.device.type == "cuda"
            and bool(self.backends)
            and all(b.capabilities.supports_graph_capture for b in self.backends)
        )

    def capture(self, fn: Callable[..., Any], *inputs: torch.Tensor, warmups: int = 1) -> CapturedStep:
        """Record ``fn(*inputs)`` — one step of the model over the active batch — as a CUDA graph
        (see :mod:`diffusion_kv.core.graphs`); ``replay(*new_inputs)`` re-runs it."""
        check_capture_args(fn, inputs, warmups)
        translator = self._require().translator
        lacking = [b.name for b in self.backends if not b.capabilities.supports_graph_capture]
        if lacking:
            raise UnsupportedFeatureError(
                f"graph capture needs backends declaring supports_graph_capture; {lacking} of platform "
                f"{self.platform.name!r} do not"
            )
        return CapturedStep(translator, fn, inputs, warmups=warmups)

    def step_graphs(self, limit: int = 8, capture_unkeyed: bool = False) -> StepGraphs:
        """Captured steps kept by batch shape (:class:`~diffusion_kv.core.graphs.StepGraphs`):
        ``run(fn, *inputs)`` replays the graph serving the active batch or captures one -- one
        graph per window-fill shape for a session stream on backends giving a ``graph_key`` --
        and runs a batch without a key eagerly unless ``capture_unkeyed``."""
        return StepGraphs(self.capture, self._require().translator, limit, capture_unkeyed)

    # -- accounting ---------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """Bytes one block id occupies across every layer (K and V)."""
        if self.layout is None:
            raise StateError("the paged KV cache is not initialised")
        total = 0
        for group in self.layout.groups:
            total += len(group.layer_names) * group.block_size * group.spec.bytes_per_token()
        return total

    def blocks_for(self, num_tokens: int) -> list[int]:
        """Blocks a row of ``num_tokens`` tokens occupies in each KV-cache group."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValidationError(f"blocks_for takes a token count, an int >= 0; got {num_tokens!r}")
        if self.layout is None:
            raise StateError("the paged KV cache is not initialised")
        return [cdiv(num_tokens, g.block_size * self.config.cp_size) for g in self.layout.groups]


RunnerBackend = PagedWorker
"""The name :class:`PagedWorker` had before 2026-12-06 (it is the worker's paged KV state, not a
backend): an alias for one release (``docs/migration.md``)."""

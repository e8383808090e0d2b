"""vLLM-Omni's diffusion-KV worker module, re-implemented on diffusion-kv's core.

This is the *module replacement*: the classes vLLM-Omni 0.30.0 defines in
``vllm_omni/diffusion/diffusion_kv/model_runner_backend.py`` and ``paged_attention_adapter.py``,
with upstream's names, attributes and call semantics, backed by diffusion-kv's row registry,
translator and execution driver (:class:`~diffusion_kv.core.runner.PagedWorker`) and by the
paged backend the diffusion-kv platform selects per KV-cache group. The patch
``patches/vllm-omni-0.30.0.patch`` makes vLLM-Omni's model runner import them from here (two
import lines; the forward context's type-only import too); the runner, the forward context and
Omni's ``Attention`` layer stay upstream's.

=====================================  =========================================================
upstream call                          here
=====================================  =========================================================
``DiffusionKVModelRunnerBackend(...)`` stores the configs; validates nothing (the runner builds
                                       it in dense mode too)
``register_kv_cache_layers``           upstream's checks (frozen after init, an attention spec,
                                       ``supports_paged_kv``, strict Ulysses only, one rank-local
                                       geometry, ``set_attention_geometry``), then the core's
``initialize_kv_cache(cfg)``           upstream's checks; worker rows = ``max_num_seqs`` (a
                                       multiple of rows per request); table widths rounded like
                                       ``get_block_table_width``; DCP rank from vLLM's DCP group;
                                       caches bound to the ``KVCacheConfig``'s tensors in its
                                       layout (``kv_caches_by_layer`` are those tensors); vLLM's
                                       own backends run on the host's ``VllmConfig``
``install_diffusion_kv_metadata``      the registry's install (generations, ownership)
``get_diffusion_kv_row``               the registry's row (context id wins)
``activate_paged_attention_metadata``  ``(runtime, runtime.activate())``; the runtime has
                                       ``metadata``, ``adapter`` and ``ensure_active(step)`` as
                                       Omni's forward context expects
``adapter.prepare_layer_context``      a context Omni's ``forward_paged`` runs unchanged: its
                                       native impl runs the core's execution driver (one K/V
                                       write, piecewise segments, layout restored)
``remove_diffusion_kv_requests``       the registry's removal (``(id, generation)`` scoped);
                                       never frees scheduler blocks
``refresh_block_table_layout``         the registry's layout refresh (CuMem wake-up)
=====================================  =========================================================

Deliberate differences, from the core's guarantees (``docs/architecture.md``): a block listed
twice in one row, a block another live row writes, and a read of tokens nobody wrote are refused
before anything changes (upstream accepts them); layers are not registered in vLLM's
``static_forward_context`` (nothing of vLLM's attention machinery runs unless the selected
backend is a vLLM one, which keeps its own). ``AttentionMetadata`` fields the core cannot page
(``joint_attn_mask``, ``query_ranges``, ``video_layout``, ``packed_padding``, an arbitrary
``attn_mask``, ``extra``) are refused with ``NotImplementedError``.

vLLM and vLLM-Omni are imported lazily (their config, DCP group, KV-cache allocation and the
forward-context override), so the classes also run with plain attribute objects as configs.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.batch import KVCache
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import StateError, UnknownLayerError, UnsupportedFeatureError, ValidationError
from diffusion_kv.core.host import HostRuntime
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.core.parallel import DCPMerger, RankGroup
from diffusion_kv.core.registry import KVCacheMode
from diffusion_kv.core.rows import PagedRow, Phase
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, ParallelConfig, RunnerConfig
from diffusion_kv.core.runtime import BatchStepper
from diffusion_kv.core.translate import PreparedBatch
from diffusion_kv.integrations.vllm_omni.hooks import (
    TOKEN_ALIGNMENT,
    DiffusionKVPlatformHooks,
    group_cache_dtype,
)
from diffusion_kv.integrations.vllm_omni.native import page_view
from diffusion_kv.integrations.vllm_omni.records import (
    DiffusionPagedAttentionMetadata,
    DiffusionPagedAttentionRow,
    DiffusionPagedAttentionRowBinding,
    allocation_from_metadata,
    paged_row,
)
from diffusion_kv.platforms.interface import Platform

UNPAGEABLE_METADATA_FIELDS = ("packed_padding",)
"""Omni ``AttentionMetadata`` fields refused here on top of the core's own refusals."""


def _optional_import(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _is_vllm_config(config: Any) -> bool:
    return any(c.__name__ == "VllmConfig" and c.__module__.startswith("vllm.") for c in type(config).__mro__)


_last_mode: tuple[Any, bool] = (object(), False)
"""The last immutable mode object :func:`_is_paged` read, and its answer (one tuple: replaced whole)."""


def _is_paged(od_config: Any) -> bool:
    global _last_mode
    mode = getattr(od_config, "diffusion_kv_mode", None)
    last = _last_mode
    if mode is last[0]:  # the mode object of the last call (a request's install asks every time)
        return last[1]
    paged = str(getattr(mode, "value", mode) or "").lower() == "paged_scheduler"
    if type(mode) is str or isinstance(mode, enum.Enum):  # immutable: the answer stays valid
        _last_mode = (mode, paged)
    return paged


def _positive(value: Any, message: str) -> int:
    if type(value) is not int or value <= 0:
        raise ValidationError(message)
    return value


# --------------------------------------------------------------------------------------------
# Layer view and native impl handed to Omni's forward_paged
# --------------------------------------------------------------------------------------------


class CoreAttentionBackend:
    """The "native backend" of a layer: the core runs the write inside its forward."""

    forward_includes_kv_cache_update: ClassVar[bool] = True

    @staticmethod
    def get_name() -> str:
        return "DIFFUSION_KV_CORE"


class CoreImpl:
    """The native impl Omni's ``forward_paged`` calls for one layer.

    ``forward`` runs the core's execution driver for the layer: it validates the layer's Q/K/V
    and metadata, writes K/V once, runs every piecewise segment and returns the output in the
    caller's layout. When the platform asks Omni to pre-write (``do_kv_cache_update`` first,
    then ``forward`` without K/V), the write is held here and done by that ``forward`` (the core
    writes exactly once per layer and batch either way).
    """

    def __init__(self, adapter: DiffusionPagedAttentionAdapter, layer_name: str) -> None:
        self.adapter = adapter
        self.layer_name = layer_name
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slot_mapping: Any
    ) -> None:
        del layer, kv_cache, slot_mapping
        self._held = (key, value)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Any,
        attn_metadata: Any,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del layer, kv_cache, output
        if key is None or value is None:
            if self._held is None:
                raise StateError(
                    f"paged layer {self.layer_name!r} ran without K/V: neither passed nor written first"
                )
            key, value = self._held
        self._held = None
        return self.adapter.runner.forward(self.layer_name, query, key, value, attn_metadata)


class DiffusionPagedAttentionLayerAdapter:
    """One paged layer as Omni's ``forward_paged`` reads it (rank-local geometry)."""

    def __init__(
        self,
        *,
        layer_name: str,
        spec: Any,
        num_heads: int,
        softmax_scale: float,
        adapter: DiffusionPagedAttentionAdapter,
    ) -> None:
        self.layer_name = layer_name
        self.spec = spec
        self.num_heads = num_heads
        self.num_kv_heads = int(spec.num_kv_heads)
        self.head_size = int(spec.head_size)
        self.head_size_v = int(getattr(spec, "head_size_v", spec.head_size))
        self.softmax_scale = softmax_scale
        self.attn_backend = CoreAttentionBackend
        self.impl = CoreImpl(adapter, layer_name)
        self._adapter = adapter

    @property
    def kv_cache(self) -> KVCache:
        return self._adapter.runner.kv_caches[self.layer_name]


@dataclass(frozen=True, slots=True)
class DiffusionPagedAttentionContext:
    """One layer's inputs for Omni's ``forward_paged`` (upstream's field names).

    ``piecewise_plan`` is None and ``native_metadata`` is Omni's ``AttentionMetadata``: the
    core plans piecewise segments itself, and its output is already in the caller's layout.
    """

    layer: DiffusionPagedAttentionLayerAdapter
    query: torch.Tensor
    key_write: torch.Tensor
    value_write: torch.Tensor
    slot_mapping: torch.Tensor
    native_metadata: Any
    piecewise_plan: None = None
    piecewise_native_metadata: tuple[Any, ...] = ()
    query_token_shape: tuple[int, ...] = ()
    query_has_head_dims: bool = True
    output_scatter_indices: None = None

    def restore_output(self, output: torch.Tensor) -> torch.Tensor:
        return output


# --------------------------------------------------------------------------------------------
# Adapter and runtime
# --------------------------------------------------------------------------------------------


class DiffusionPagedAttentionAdapter:
    """Rows -> native metadata for every paged layer, through the core's translator."""

    def __init__(
        self,
        *,
        vllm_config: Any,
        device: torch.device,
        kv_cache_config: Any,
        runner: PagedWorker,
        specs: Mapping[str, Any],
        num_heads: Mapping[str, int],
        scales: Mapping[str, float],
    ) -> None:
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.kv_cache_config = kv_cache_config
        self.runner = runner
        self.block_tables = runner.block_tables
        self.layers = {
            name: DiffusionPagedAttentionLayerAdapter(
                layer_name=name,
                spec=spec,
                num_heads=num_heads[name],
                softmax_scale=scales[name],
                adapter=self,
            )
            for name, spec in specs.items()
        }

    @property
    def translator(self) -> Any:
        translator = self.runner.translator
        if translator is None:
            raise StateError("paged_scheduler native attention adapter is not initialized")
        return translator

    def prepare_batch(self, rows: Sequence[Any]) -> PreparedBatch:
        """Validate ``rows`` and build the metadata every paged layer of one forward shares."""
        rows = tuple(rows)
        if not rows:
            raise ValidationError("Paged attention batch must contain at least one row")
        return self.translator.prepare(tuple(paged_row(r) for r in rows))  # type: ignore[no-any-return]

    def invalidate_prepared_batches(self) -> None:
        self.translator.invalidate()

    @contextmanager
    def activate(self, batch: PreparedBatch) -> Iterator[DiffusionPagedAttentionAdapter]:
        """Make ``batch`` the active one and expose this adapter to Omni's ``Attention`` layers
        (``ForwardContext.paged_kv_adapter``) for the duration."""
        with ExitStack() as stack:
            stack.enter_context(self.translator.activate(batch))
            forward_context = _optional_import("vllm_omni.diffusion.forward_context")
            if forward_context is not None:
                stack.enter_context(forward_context.override_paged_kv_adapter(self))
            vllm_config_module = _optional_import("vllm.config")
            if vllm_config_module is not None and _is_vllm_config(self.vllm_config):
                stack.enter_context(vllm_config_module.set_current_vllm_config(self.vllm_config))
            yield self

    def prepare_layer_context(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        omni_attn_metadata: Any | None = None,
    ) -> DiffusionPagedAttentionContext:
        batch = self.translator.active_batch
        if batch is None:
            raise StateError("Paged attention forward must run inside adapter.activate(batch)")
        try:
            layer = self.layers[layer_name]
        except KeyError:
            raise UnknownLayerError(f"Unknown diffusion paged attention layer {layer_name!r}") from None
        unsupported = [
            name for name in UNPAGEABLE_METADATA_FIELDS if getattr(omni_attn_metadata, name, None) is not None
        ]
        if unsupported:
            raise UnsupportedFeatureError(
                f"Diffusion paged attention cannot translate Omni attention metadata fields {unsupported!r}"
            )
        return DiffusionPagedAttentionContext(
            layer=layer,
            query=query,
            key_write=key,
            value_write=value,
            slot_mapping=batch.slot_mappings_by_layer[layer_name],
            native_metadata=omni_attn_metadata,
            query_token_shape=tuple(query.shape[:-2]),
        )

    def forward(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        omni_attn_metadata: Any | None = None,
    ) -> torch.Tensor:
        """One paged layer directly (what ``forward_paged`` ends up running)."""
        context = self.prepare_layer_context(
            layer_name, query, key, value, omni_attn_metadata=omni_attn_metadata
        )
        return context.layer.impl.forward(context.layer, query, key, value, None, omni_attn_metadata)


_PREFILL = Phase.PREFILL  # (a module constant: an idle step compares against it)


class DiffusionPagedAttentionRuntime:
    """Activates the runner's rows as the denoise loop advances (upstream's runtime), on the
    core's :class:`~diffusion_kv.core.runtime.BatchStepper`.

    ``metadata`` (prefill and denoise rows) may be replaced between steps, as Omni's
    ``paged_kv_prefill`` does: a phase's rows are read when the phase begins, and
    ``ensure_active(step)`` prepares on a phase change only. Activation also exposes the
    adapter to Omni's forward context (:meth:`DiffusionPagedAttentionAdapter.activate`).
    """

    def __init__(self, adapter: DiffusionPagedAttentionAdapter, metadata: Any) -> None:
        self.adapter = adapter
        self.metadata = metadata
        self._runtime = BatchStepper(
            adapter.translator, phase_rows=self._rows_of, activation=adapter.activate
        )

    def _rows_of(self, phase: Phase) -> tuple[PagedRow, ...]:
        rows = tuple(self.metadata.prefill_rows if phase is Phase.PREFILL else self.metadata.denoise_rows)
        if not rows:
            raise ValidationError("Paged attention batch must contain at least one row")
        return tuple(paged_row(r) for r in rows)

    def ensure_active(self, step_idx: int | None) -> DiffusionPagedAttentionAdapter:
        active = self._runtime.phase  # (None once closed or deactivated)
        if (
            active is not None
            and type(step_idx) is int
            and step_idx >= 0
            and (step_idx == 0) is (active is _PREFILL)
        ):
            return self.adapter  # an idle step: this phase's rows are active, nothing to prepare
        if self._runtime.closed:
            raise StateError("Paged attention runtime is already closed")
        if type(step_idx) is not int or step_idx < 0:
            raise ValidationError(
                f"Paged attention requires a non-negative denoise step index, got {step_idx!r}"
            )
        self._runtime.ensure_active(step_idx)
        return self.adapter

    def close(self) -> None:
        self._runtime.close()

    @contextmanager
    def activate(self) -> Iterator[DiffusionPagedAttentionRuntime]:
        try:
            yield self
        finally:
            self.close()


# --------------------------------------------------------------------------------------------
# KV caches from the scheduler's KVCacheConfig
# --------------------------------------------------------------------------------------------


@dataclass
class _HostCaches(Mapping[str, KVCache]):
    """Per-layer caches viewing the ``KVCacheConfig``'s tensors, in each chosen backend's form.

    vLLM's own allocator lays the tensors out (``allocate_kv_cache`` with the config's layout and
    the chosen kernel block sizes, allocated on first access, once every group's backend is
    chosen); a vLLM-native backend binds vLLM's per-layer view as is, any other backend a
    zero-copy view of it in its page layout (:func:`~.native.page_view`).
    """

    kv_cache_config: Any
    layout: CacheLayout
    chosen: Sequence[type[PagedBackend]]
    """The backend class of each KV-cache group (``PagedWorker.select_backends``)."""
    device: torch.device
    layout_name: str
    names: frozenset[str]
    vllm_views: dict[str, torch.Tensor] = field(default_factory=dict)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.names))

    def __len__(self) -> int:
        return len(self.names)

    def _allocate(self) -> None:
        utils = importlib.import_module("vllm.v1.worker.utils")
        layout_enum = importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout
        kernels = []
        for group, backend in zip(self.layout.groups, self.chosen, strict=True):
            kernel = backend.capabilities.kernel_block_size_for(group.block_size)
            kernels.append(kernel if kernel is not None else group.block_size)
        views = utils.allocate_kv_cache(
            self.kv_cache_config, self.device, layout_enum[self.layout_name], kernels
        )
        self.vllm_views.update(views)

    def __getitem__(self, name: str) -> KVCache:
        if name not in self.names:
            raise KeyError(name)
        if not self.vllm_views:
            self._allocate()
        view = self.vllm_views[name]
        group = next(i for i, g in enumerate(self.layout.groups) if name in g.layer_names)
        backend = self.chosen[group]
        if backend.uses_host_kernels:
            return view
        return page_view(view, backend.page_layout, self.layout.groups[group].spec.head_size)


# --------------------------------------------------------------------------------------------
# The runner backend
# --------------------------------------------------------------------------------------------


class DiffusionKVModelRunnerBackend:
    """Native paged-KV state of one vLLM-Omni model runner (see the module docstring)."""

    def __init__(
        self,
        *,
        vllm_config: Any,
        od_config: Any,
        device: torch.device | str,
        platform: Platform | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.od_config = od_config
        self.device = torch.device(device)
        self.hooks = DiffusionKVPlatformHooks(platform)
        self.kv_cache_config: Any | None = None
        self.kv_caches: list[KVCache] = []
        self.block_tables: Any | None = None
        self.paged_attention_adapter: DiffusionPagedAttentionAdapter | None = None
        self.runner: PagedWorker | None = None
        self._layer_specs: dict[str, PagedLayerSpec] = {}
        self._canonical: dict[str, Any] = {}
        self._num_heads: dict[str, int] = {}
        self._scales: dict[str, float] = {}
        self._kv_caches_by_layer: dict[str, KVCache] = {}

    @property
    def platform(self) -> Platform:
        return self.hooks.platform

    # -- configuration read by attribute name ---------------------------------------------------

    def _parallel(self) -> ParallelConfig:
        parallel = getattr(self.od_config, "parallel_config", None)
        return ParallelConfig(
            ulysses_degree=int(getattr(parallel, "ulysses_degree", 1)),
            ring_degree=int(getattr(parallel, "ring_degree", 1)),
            allgather_degree=int(getattr(parallel, "allgather_degree", 1)),
            ulysses_mode=str(getattr(parallel, "ulysses_mode", "strict")),
        )

    def _get_max_rows_per_request(self) -> int:
        return _positive(
            getattr(self.od_config, "diffusion_kv_max_rows_per_request", None),
            "paged_scheduler requires a positive integer diffusion_kv_max_rows_per_request adapter limit",
        )

    def _get_max_model_len(self) -> int:
        return _positive(
            getattr(self.vllm_config.model_config, "max_model_len", None),
            "paged_scheduler requires a positive model_config.max_model_len",
        )

    def _mode(self) -> KVCacheMode:
        return KVCacheMode.PAGED if _is_paged(self.od_config) else KVCacheMode.DENSE

    # -- registration ---------------------------------------------------------------------------

    def register_kv_cache_layers(self, layers: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """``{name: (layer, kv_cache_spec)}`` -> ``{name: spec with rank-local num_kv_heads}``."""
        if self.kv_cache_config is not None:
            raise StateError("Diffusion KV cache layers cannot be changed after physical initialization")
        if layers and group_cache_dtype(self.vllm_config) is not None:
            raise UnsupportedFeatureError(
                f"the module replacement does not serve kv_cache_dtype="
                f"{self.vllm_config.cache_config.cache_dtype!r} yet (fp8 pages of a spec sized in the model "
                "dtype are not bound here); vLLM-Omni's own paged module (zero-patch) serves fp8_e4m3"
            )
        specs: dict[str, PagedLayerSpec] = {}
        scales: dict[str, float] = {}
        for name, entry in layers.items():
            layer, spec = entry
            is_spec = all(hasattr(spec, a) for a in ("block_size", "num_kv_heads", "head_size", "dtype"))
            if not is_spec:
                raise TypeError(
                    f"Diffusion KV layer {name!r} produced unsupported spec {type(spec).__name__}; "
                    "only native attention specs are supported"
                )
            backend = getattr(layer, "attn_backend", None)
            if not getattr(backend, "supports_paged_kv", False):
                get_name = getattr(backend, "get_name", None)
                selected = get_name() if callable(get_name) else repr(backend)
                raise UnsupportedFeatureError(
                    f"Diffusion paged KV layer {name!r} requires an Omni backend with paged support; selected {selected}"
                )
            if int(getattr(spec, "head_size_v", spec.head_size)) != int(spec.head_size):
                raise ValidationError(
                    "Diffusion native paged attention requires equal key/value head sizes; "
                    f"got head_size={spec.head_size}, head_size_v={spec.head_size_v}"
                )
            scale = float(layer.softmax_scale)
            specs[name] = PagedLayerSpec(
                num_heads=int(layer.num_heads),
                num_kv_heads=int(spec.num_kv_heads),
                head_size=int(spec.head_size),
                dtype=spec.dtype,
                mode=AttentionMode.FULL if getattr(spec, "non_causal", False) else AttentionMode.CAUSAL,
                scale=scale,
                skip_sequence_parallel=bool(getattr(layer, "skip_sequence_parallel", False)),
                cache_role=getattr(layer, "paged_kv_cache_role", None),
            )
            scales[name] = scale
        probe = PagedWorker(
            self.platform,
            RunnerConfig(
                max_model_len=1,
                max_rows_per_request=1,
                max_num_seqs=1,
                max_num_batched_tokens=1,
                parallel=self._parallel(),
                device=self.device,
            ),
        )
        geometry = probe.register_kv_cache_layers(specs) if specs else {}
        canonical = {
            name: dataclasses.replace(spec, num_kv_heads=geometry[name].num_kv_heads)
            if dataclasses.is_dataclass(spec) and not isinstance(spec, type)
            else spec
            for name, (_, spec) in layers.items()
        }
        if geometry:
            g0 = next(iter(geometry.values()))
            set_geometry = getattr(self.vllm_config.model_config, "set_attention_geometry", None)
            if not callable(set_geometry):
                raise StateError(
                    "Diffusion native paged attention requires a model config that exposes set_attention_geometry"
                )
            set_geometry(num_heads=g0.num_heads, num_kv_heads=g0.num_kv_heads, head_size=g0.head_size)
        self._layer_specs = specs
        self._canonical = canonical
        self._num_heads = {name: g.num_heads for name, g in geometry.items()}
        self._scales = scales
        return dict(canonical)

    # -- initialisation -------------------------------------------------------------------------

    def _dcp(self) -> tuple[int, int, int, DCPMerger | None]:
        parallel = self.vllm_config.parallel_config
        cp_size = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
        interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
        if cp_size == 1:
            return 1, 0, interleave, None
        group = importlib.import_module("vllm.distributed").get_dcp_group()
        device_group = getattr(group, "device_group", None)
        merger = DCPMerger(RankGroup(cp_size, int(group.rank_in_group), device_group))
        return cp_size, int(group.rank_in_group), interleave, merger

    def _layout_name(self, kv_cache_config: Any) -> str:
        """The config's physical layout, adopted into the worker's ``CacheConfig`` as upstream's
        ``adopt_kv_cache_layout`` does (vLLM-Omni's default ``LBNHC`` when none is recorded)."""
        cache = getattr(self.vllm_config, "cache_config", None)
        recorded = getattr(kv_cache_config, "kv_cache_layout", None)
        current = getattr(cache, "kv_cache_layout", None)
        if recorded is not None and current is not None and recorded != current:
            raise ValidationError(
                f"Worker KV cache layout {current!r} disagrees with the layout resolved by the control plane "
                f"({recorded!r})."
            )
        name = str(recorded or current or "LBNHC")
        if cache is not None and current is None and hasattr(cache, "kv_cache_layout"):
            cache.kv_cache_layout = name
        return name

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        """Choose a backend per group, build the parts and bind every layer's cache to the
        scheduler-owned ``KVCacheConfig`` tensors (atomic: on failure nothing is published)."""
        if self.kv_cache_config is not None:
            raise StateError("Diffusion native KV cache is already initialized")
        if not self._layer_specs:
            raise StateError("Diffusion KV cache layers must be registered before physical initialization")
        configured = {name for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
        if configured != set(self._layer_specs):
            raise ValidationError(
                "Rank-local Diffusion KVCacheConfig layer mismatch: "
                f"expected={sorted(self._layer_specs)}, configured={sorted(configured)}"
            )
        kv_cache_config = copy.deepcopy(kv_cache_config)
        max_len = self._get_max_model_len()
        rows = self._get_max_rows_per_request()
        scheduler = self.vllm_config.scheduler_config
        max_num_seqs = _positive(
            getattr(scheduler, "max_num_seqs", None),
            "paged_scheduler requires a positive scheduler_config.max_num_seqs",
        )
        if not kv_cache_config.kv_cache_groups:
            raise ValidationError("paged_scheduler requires at least one native KV cache group")
        for group in kv_cache_config.kv_cache_groups:
            _positive(
                group.kv_cache_spec.block_size,
                "native diffusion KV cache groups must have positive integer block sizes",
            )
        if max_num_seqs % rows:
            raise ValidationError(
                "scheduler_config.max_num_seqs must be a multiple of diffusion_kv_max_rows_per_request"
            )
        batched = _positive(
            getattr(scheduler, "max_num_batched_tokens", None),
            "scheduler_config.max_num_batched_tokens must be a positive integer",
        )
        cp_size, cp_rank, interleave, merger = self._dcp()
        config = RunnerConfig(
            max_model_len=max_len,
            max_rows_per_request=rows,
            max_num_seqs=max_num_seqs // rows,
            max_num_batched_tokens=batched,
            mode=self._mode(),
            parallel=self._parallel(),
            device=self.device,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=interleave,
        )
        host = HostRuntime(
            config=self.vllm_config if _is_vllm_config(self.vllm_config) else None,
            kv_cache_config=kv_cache_config,
            block_table_alignment=TOKEN_ALIGNMENT,
            name="vLLM-Omni",
        )
        runner = PagedWorker(self.platform, config, dcp_merger=merger, host=host)
        runner.register_kv_cache_layers(self._layer_specs)
        layout = CacheLayout.from_kv_cache_config(
            kv_cache_config,
            max_model_len=max_len,
            max_rows_per_request=rows,
            max_num_seqs=max_num_seqs // rows,
            max_num_batched_tokens=batched,
        )
        host_caches: _HostCaches | None = None
        if getattr(kv_cache_config, "kv_cache_tensors", None):
            host_caches = _HostCaches(
                kv_cache_config=kv_cache_config,
                layout=layout,
                chosen=runner.select_backends(layout),
                device=self.device,
                layout_name=self._layout_name(kv_cache_config),
                names=frozenset(self._layer_specs),
            )
        runner.initialize_kv_cache(layout, kv_caches=host_caches)
        counts = runner.block_tables.num_blocks if runner.block_tables is not None else None
        if counts is not None and not hasattr(counts, "np"):  # upstream reads the host counts as NumPy
            counts.np = counts.cpu.numpy()  # type: ignore[attr-defined]
        self.runner = runner
        self.block_tables = runner.block_tables
        by_layer: dict[str, KVCache] = (
            dict(host_caches.vllm_views) if host_caches is not None else dict(runner.kv_caches)
        )
        self._kv_caches_by_layer = by_layer
        self.kv_caches = [by_layer[name] for name in layout.layer_names]
        self.paged_attention_adapter = DiffusionPagedAttentionAdapter(
            vllm_config=self.vllm_config,
            device=self.device,
            kv_cache_config=kv_cache_config,
            runner=runner,
            specs=self._canonical,
            num_heads=self._num_heads,
            scales=self._scales,
        )
        self.kv_cache_config = kv_cache_config

    @property
    def kv_caches_by_layer(self) -> dict[str, KVCache]:
        """Every paged layer's cache: the ``KVCacheConfig`` tensors' views when bound (what vLLM's
        KV connectors register), else the caches the backends allocated."""
        return dict(self._kv_caches_by_layer)

    @property
    def chosen_backends(self) -> tuple[type[PagedBackend], ...]:
        """The diffusion-kv backend serving each KV-cache group, once initialised."""
        if self.runner is None:
            return ()
        return tuple(type(b) for b in self.runner.backends)

    # -- rows -----------------------------------------------------------------------------------

    def _require_paged(self) -> PagedWorker:
        if self._mode() is not KVCacheMode.PAGED or self.runner is None:
            raise StateError("paged_scheduler native BlockTables are not initialized")
        return self.runner

    def install_diffusion_kv_metadata(self, metadata: Any) -> bool:
        """Install one scheduler allocation snapshot; True when rows were newly installed."""
        if not _is_paged(self.od_config):  # (what _mode() answers, without the enum lookup)
            raise ValidationError("Dense diffusion execution must not install Diffusion KV metadata")
        runner = self.runner
        if runner is None:
            raise StateError("paged_scheduler native KV cache is not initialized")
        return runner.install(allocation_from_metadata(metadata))

    def get_diffusion_kv_row(
        self, request_id: str, sequence_id: int | None, context_id: str | None = None
    ) -> int:
        """The worker row of an identity (a context id wins over a sequence id)."""
        runner = self._require_paged()
        assert runner.registry is not None
        return runner.registry.row_of(request_id, sequence_id, context_id)

    def _resolve_paged_attention_row(
        self, request_id: str, sequence_id: int | None, context_id: str | None
    ) -> DiffusionPagedAttentionRowBinding:
        binding = self._require_paged().resolve(request_id, sequence_id, context_id)
        return DiffusionPagedAttentionRowBinding(binding.row_index, binding.max_seq_len, binding.block_ids)

    def get_paged_attention_adapter(self) -> DiffusionPagedAttentionAdapter:
        if self.paged_attention_adapter is None:
            raise StateError("paged_scheduler native attention adapter is not initialized")
        return self.paged_attention_adapter

    def activate_paged_attention_metadata(
        self, metadata: Any
    ) -> tuple[DiffusionPagedAttentionRuntime, AbstractContextManager[DiffusionPagedAttentionRuntime]]:
        """``(runtime, context manager)`` for one denoise loop."""
        runtime = DiffusionPagedAttentionRuntime(self.get_paged_attention_adapter(), metadata)
        return runtime, runtime.activate()

    def remove_diffusion_kv_requests(self, request_ids: Sequence[str | tuple[str, int]]) -> int:
        """Clear the rows of requests (``(id, generation)`` scopes a removal); never frees the
        scheduler's blocks. 0 in dense mode or before initialisation."""
        if self._mode() is not KVCacheMode.PAGED or self.runner is None:
            return 0
        return self.runner.remove(request_ids)

    def refresh_block_table_layout(self) -> None:
        """Rebuild BlockTables layout tensors after a CuMem KV-cache wake-up."""
        if self._mode() is not KVCacheMode.PAGED or self.runner is None:
            return
        self.runner.refresh_layout()


__all__ = [
    "CoreAttentionBackend",
    "CoreImpl",
    "DiffusionKVModelRunnerBackend",
    "DiffusionPagedAttentionAdapter",
    "DiffusionPagedAttentionContext",
    "DiffusionPagedAttentionLayerAdapter",
    "DiffusionPagedAttentionMetadata",
    "DiffusionPagedAttentionRow",
    "DiffusionPagedAttentionRowBinding",
    "DiffusionPagedAttentionRuntime",
]

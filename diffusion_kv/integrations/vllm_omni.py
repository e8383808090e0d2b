"""vLLM-Omni embedding: the four upstream platform hooks and a runner-backend facade.

vLLM-Omni's diffusion paged-KV path asks its platform object for four hooks and drives a
``DiffusionKVModelRunnerBackend``. This module provides both, backed by the selected
diffusion-kv platform plugin, so vLLM-Omni switches with small changes (``docs/vllm-omni.md``):

* :class:`DiffusionKVPlatformHooks` — ``get_diffusion_kv_block_tables_cls``,
  ``build_diffusion_kv_attn_metadata``, ``get_diffusion_paged_kv_attn_backend``,
  ``requires_diffusion_paged_kv_prewrite``, each delegating to the paged backend the platform
  selects (by its priority list; once the facade's KV cache is initialised, to the backends
  chosen for its KV-cache groups);
* :class:`DiffusionKVRunnerBackend` — the upstream method names over
  :class:`~diffusion_kv.core.runner.RunnerBackend`.

Upstream records (allocation metadata, layer specs, row metadata) are read by attribute name,
so vLLM-Omni's own objects are accepted as they are; diffusion-kv's records are accepted too.
Nothing here imports vLLM or vLLM-Omni.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.batch import KVCache, PagedBatch
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.core.registry import KVCacheMode
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, ParallelConfig, RunnerBackend, RunnerConfig
from diffusion_kv.core.runtime import PagedRuntime
from diffusion_kv.platforms.interface import Platform, Requirements

# --------------------------------------------------------------------------------------------
# The four platform hooks
# --------------------------------------------------------------------------------------------


class DiffusionKVPlatformHooks:
    """The upstream ``OmniPlatform`` diffusion-KV hooks, delegating to one platform's backends.

    ``platform`` defaults to :func:`diffusion_kv.platforms.get_platform` (explicit name,
    ``DIFFUSION_KV_PLATFORM``, or detection), resolved on first use. Until :meth:`bind` is
    called (the facade binds the backends it chose when its KV cache is initialised), a hook
    asks the platform's priority list for its backend.
    """

    def __init__(self, platform: Platform | None = None) -> None:
        self._platform = platform
        self._bound: tuple[type[PagedBackend], ...] = ()

    @property
    def platform(self) -> Platform:
        if self._platform is None:
            from diffusion_kv.platforms.selection import get_platform

            self._platform = get_platform()
        return self._platform

    def bind(self, backends: Sequence[type[PagedBackend]]) -> None:
        """The backend classes chosen for the KV-cache groups, group 0 first."""
        self._bound = tuple(backends)

    def selected_backend(self, requirements: Requirements | None = None) -> type[PagedBackend]:
        """Group 0's bound backend, else the one the platform selects for ``requirements``."""
        if self._bound:
            return self._bound[0]
        return self.platform.select_backend(requirements if requirements is not None else Requirements())

    def get_diffusion_kv_block_tables_cls(self) -> type:
        """The selected backend's BlockTables class (constructed with the upstream keywords)."""
        return self.selected_backend().block_tables_cls()

    def build_diffusion_kv_attn_metadata(
        self,
        *,
        attn_groups: Any,
        num_reqs: int,
        num_tokens: int,
        query_start_loc_gpu: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        block_tables: Sequence[torch.Tensor],
        slot_mappings: torch.Tensor,
        kv_cache_config: Any = None,
        seq_lens_cpu: torch.Tensor | None = None,
        seq_lens_cpu_upper_bound: torch.Tensor | None = None,
        dcp_local_seq_lens: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        causal: bool | Mapping[int, bool] = True,
        **extra: Any,
    ) -> dict[str, Any]:
        """Native metadata per layer for one batch.

        ``attn_groups`` is either diffusion-kv paged backend instances (one, or one per
        KV-cache group, as the facade holds them in ``backend.backends``) or vLLM's attention
        groups. Each backend builds its group's metadata from a :class:`PagedBatch` of the
        upstream keywords (its group's block table and slot mapping; ``causal``, for every
        group or per group index, can make a causal group full, never the reverse), and every
        layer of the group maps to it, as the core fans it out. vLLM's attention groups go to vLLM's own ``build_attn_metadata`` through the
        version seam (the upstream default behaviour).
        """
        backends: tuple[PagedBackend, ...] = ()
        if isinstance(attn_groups, PagedBackend):
            backends = (attn_groups,)
        elif (
            isinstance(attn_groups, Sequence)
            and attn_groups
            and all(isinstance(b, PagedBackend) for b in attn_groups)
        ):
            backends = tuple(attn_groups)
        if backends:
            if extra:
                raise TypeError(f"unsupported metadata arguments for diffusion-kv backends: {sorted(extra)}")
            host_seq = seq_lens_cpu if seq_lens_cpu is not None else seq_lens_cpu_upper_bound
            if host_seq is None:
                raise ValidationError(
                    "build_diffusion_kv_attn_metadata needs seq_lens_cpu (host copy of seq_lens)"
                )
            if positions is None:
                raise ValidationError("build_diffusion_kv_attn_metadata needs positions")
            out: dict[str, Any] = {}
            for backend in backends:
                group = backend.group
                wanted = causal.get(group.index, True) if isinstance(causal, Mapping) else causal
                is_causal = group.mode is AttentionMode.CAUSAL and bool(wanted)  # FULL groups stay full
                batch = PagedBatch(
                    num_reqs=num_reqs,
                    num_tokens=num_tokens,
                    query_start_loc=query_start_loc_gpu,
                    query_start_loc_cpu=query_start_loc_cpu,
                    max_query_len=max_query_len,
                    seq_lens=seq_lens,
                    seq_lens_cpu=host_seq,
                    max_seq_len=max_seq_len,
                    positions=positions,
                    block_table=block_tables[group.index],
                    slot_mapping=slot_mappings[group.index],
                    mode=AttentionMode.CAUSAL if is_causal else AttentionMode.FULL,
                    dcp_local_seq_lens=dcp_local_seq_lens,
                )
                metadata = backend.build(batch)
                out.update(dict.fromkeys(group.layer_names, metadata))
            return out
        from diffusion_kv.integrations.vllm.compat import installed_compat

        return installed_compat().call_build_attn_metadata(
            attn_groups=attn_groups,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            query_start_loc_gpu=query_start_loc_gpu,
            query_start_loc_cpu=query_start_loc_cpu,
            max_query_len=max_query_len,
            seq_lens=seq_lens,
            max_seq_len=max_seq_len,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            kv_cache_config=kv_cache_config,
            seq_lens_cpu_upper_bound=seq_lens_cpu_upper_bound,
            dcp_local_seq_lens=dcp_local_seq_lens,
            positions=positions,
            causal=causal,
            **extra,
        )

    def get_diffusion_paged_kv_attn_backend(self, attn_backend: type, *, ulysses_degree: int) -> type:
        """The backend to page with under strict Ulysses of ``ulysses_degree``.

        Unchanged when a backend serves that degree (the bound ones once the KV cache is
        initialised, else the platform's selection); otherwise ``NotImplementedError`` with every
        backend's reasons (rather than paging with a sequence-parallel kernel).
        """
        if type(ulysses_degree) is not int or ulysses_degree <= 0:
            raise ValidationError(f"ulysses_degree must be a positive integer; got {ulysses_degree!r}")
        if ulysses_degree > 1:
            requirements = Requirements(ulysses_degree=ulysses_degree)
            if self._bound:
                reasons = [
                    f"{b.name}: {r}"
                    for b in self._bound
                    for r in self.platform.backend_reasons(b, requirements)
                ]
            else:  # empty exactly when the platform's selection would find a backend
                reasons = self.platform.not_supported_reasons(requirements)
            if reasons:
                raise NotImplementedError(
                    f"platform {self.platform.name!r} cannot page under Ulysses degree {ulysses_degree}: "
                    + "; ".join(reasons)
                )
        return attn_backend

    def requires_diffusion_paged_kv_prewrite(self) -> bool:
        """Always True: the core writes each layer's K/V once (``write_kv``), then attention
        reads pages only, on every backend."""
        return True


# --------------------------------------------------------------------------------------------
# Conversions from upstream-shaped records
# --------------------------------------------------------------------------------------------


def _block_ids(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in value)


def allocation_from_metadata(metadata: Any) -> RequestAllocation:
    """A vLLM-Omni ``DiffusionKVMetadata`` (or a :class:`RequestAllocation`) as a snapshot."""
    if isinstance(metadata, RequestAllocation):
        return metadata
    try:
        sequences = tuple(
            SequenceAllocation(
                sequence_id=s.sequence_id,
                prefix_len=s.prefix_len,
                target_len=s.target_len,
                seq_len=s.seq_len,
                block_ids=_block_ids(s.block_ids),
                context_ids=tuple(getattr(s, "context_ids", ()) or ()),
                cached_prefix_len=getattr(s, "cached_prefix_len", 0),
            )
            for s in metadata.sequences
        )
        contexts = tuple(
            ContextAllocation(
                context_id=c.context_id,
                cache_role=c.cache_role,
                num_tokens=c.num_tokens,
                block_ids=_block_ids(c.block_ids),
            )
            for c in (getattr(metadata, "contexts", ()) or ())
        )
        return RequestAllocation(metadata.request_id, metadata.allocation_generation, sequences, contexts)
    except (AttributeError, TypeError) as exc:
        raise ValidationError(
            f"{type(metadata).__name__} is not DiffusionKVMetadata-shaped: {type(exc).__name__}: {exc}"
        ) from exc


def _row(row: Any) -> PagedRow:
    if isinstance(row, PagedRow):
        return row
    return PagedRow(
        request_id=row.request_id,
        query_len=row.query_len,
        seq_len=row.seq_len,
        kv_start_pos=getattr(row, "kv_start_pos", 0),
        sequence_id=getattr(row, "sequence_id", None),
        context_id=getattr(row, "context_id", None),
    )


def phase_rows_from_metadata(metadata: Any) -> PhaseRows:
    """A vLLM-Omni ``DiffusionPagedAttentionMetadata`` (or :class:`PhaseRows`) as phase rows."""
    if isinstance(metadata, PhaseRows):
        return metadata
    try:
        prefill, denoise = metadata.prefill_rows, metadata.denoise_rows
    except AttributeError as exc:
        raise ValidationError(
            f"{type(metadata).__name__} is not DiffusionPagedAttentionMetadata-shaped: {exc}"
        ) from exc
    return PhaseRows(tuple(_row(r) for r in prefill), tuple(_row(r) for r in denoise))


def _positive_attr(obj: Any, name: str, what: str) -> int:
    value = getattr(obj, name, None)
    if type(value) is not int or value <= 0:
        raise ValidationError(f"{what} must be a positive integer; got {value!r}")
    return value


def runner_config_from_vllm(
    vllm_config: Any, od_config: Any, device: torch.device | str | None
) -> RunnerConfig:
    """The :class:`RunnerConfig` a vLLM-Omni worker implies (read by attribute name)."""
    model = getattr(vllm_config, "model_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    od_parallel = getattr(od_config, "parallel_config", None)
    mode_value = str(
        getattr(
            getattr(od_config, "diffusion_kv_mode", None),
            "value",
            getattr(od_config, "diffusion_kv_mode", ""),
        )
    )
    paged = mode_value.lower() in ("paged_scheduler", "paged", "kvcachemode.paged")
    cp_size = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    return RunnerConfig(
        max_model_len=_positive_attr(model, "max_model_len", "model_config.max_model_len"),
        max_rows_per_request=_positive_attr(
            od_config, "diffusion_kv_max_rows_per_request", "diffusion_kv_max_rows_per_request"
        ),
        max_num_seqs=_positive_attr(scheduler, "max_num_seqs", "scheduler_config.max_num_seqs"),
        max_num_batched_tokens=_positive_attr(
            scheduler, "max_num_batched_tokens", "scheduler_config.max_num_batched_tokens"
        ),
        mode=KVCacheMode.PAGED if paged else KVCacheMode.DENSE,
        parallel=ParallelConfig(
            ulysses_degree=int(getattr(od_parallel, "ulysses_degree", 1) or 1),
            ring_degree=int(getattr(od_parallel, "ring_degree", 1) or 1),
            allgather_degree=int(getattr(od_parallel, "allgather_degree", 1) or 1),
            ulysses_mode=str(getattr(od_parallel, "ulysses_mode", "strict")),
        ),
        device=torch.device(device) if device is not None else None,
        cp_size=cp_size,
        cp_rank=0,
        cp_interleave=int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1),
    )


# --------------------------------------------------------------------------------------------
# The runner-backend facade
# --------------------------------------------------------------------------------------------


class DiffusionKVRunnerBackend:
    """vLLM-Omni's ``DiffusionKVModelRunnerBackend`` surface over :class:`RunnerBackend`.

    Construct with ``config=RunnerConfig(...)``, or with vLLM-Omni's ``vllm_config`` /
    ``od_config`` (read by attribute name). In dense mode installs are refused, lookups fail
    and cleanup is a no-op, as upstream.
    """

    def __init__(
        self,
        *,
        platform: Platform | None = None,
        config: RunnerConfig | None = None,
        vllm_config: Any | None = None,
        od_config: Any | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if config is None:
            if vllm_config is None or od_config is None:
                raise ValidationError(
                    "DiffusionKVRunnerBackend needs config=RunnerConfig(...) or vllm_config and od_config"
                )
            config = runner_config_from_vllm(vllm_config, od_config, device)
        self.hooks = DiffusionKVPlatformHooks(platform)
        self.backend = RunnerBackend(self.hooks.platform, config)
        self.vllm_config = vllm_config
        self.od_config = od_config
        self._specs: dict[str, Any] = {}

    @property
    def platform(self) -> Platform:
        return self.hooks.platform

    @property
    def kv_caches_by_layer(self) -> dict[str, KVCache]:
        return dict(self.backend.kv_caches)

    # -- registration and initialisation -------------------------------------------------------

    def register_kv_cache_layers(self, layers: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """``{name: (layer, spec)}`` -> ``{name: spec with rank-local num_kv_heads}``.

        ``layer`` needs ``num_heads`` (and optionally ``softmax_scale`` / ``scale``,
        ``skip_sequence_parallel``, ``paged_kv_cache_role``, ``attn_backend``); ``spec`` needs
        ``num_kv_heads``, ``head_size``, ``dtype`` and optionally ``non_causal``. A layer whose
        ``attn_backend`` declares ``supports_paged_kv = False`` is refused, as upstream.
        """
        specs: dict[str, PagedLayerSpec] = {}
        for name, entry in layers.items():
            try:
                layer, spec = entry
            except (TypeError, ValueError):
                raise TypeError(f"paged layer {name!r} must map to a (layer, kv_cache_spec) pair") from None
            backend = getattr(layer, "attn_backend", None)
            if backend is not None and getattr(backend, "supports_paged_kv", True) is False:
                selected = backend.get_name() if hasattr(backend, "get_name") else repr(backend)
                raise NotImplementedError(
                    f"diffusion paged KV layer {name!r} requires a backend with paged support; selected {selected}"
                )
            for attr in ("num_kv_heads", "head_size", "dtype"):
                if not hasattr(spec, attr):
                    raise TypeError(
                        f"diffusion KV layer {name!r} produced unsupported spec {type(spec).__name__} (no {attr!r}); "
                        "only attention specs are supported"
                    )
            scale = getattr(layer, "softmax_scale", getattr(layer, "scale", None))
            specs[name] = PagedLayerSpec(
                num_heads=getattr(layer, "num_heads", None),  # type: ignore[arg-type]
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
                mode=AttentionMode.FULL if getattr(spec, "non_causal", False) else AttentionMode.CAUSAL,
                scale=float(scale) if scale is not None else None,
                skip_sequence_parallel=bool(getattr(layer, "skip_sequence_parallel", False)),
                cache_role=getattr(layer, "paged_kv_cache_role", None),
            )
        geometry = self.backend.register_kv_cache_layers(specs)
        out: dict[str, Any] = {}
        for name, (_, spec) in layers.items():
            local = geometry[name].num_kv_heads
            if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
                out[name] = dataclasses.replace(spec, num_kv_heads=local)
            else:
                out[name] = spec
        self._specs = out
        return out

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        """Choose a backend per KV-cache group, allocate caches and bind the hooks to those
        backends, for a ``KVCacheConfig``-shaped object."""
        self.backend.initialize_kv_cache(kv_cache_config)
        self.hooks.bind([type(b) for b in self.backend.backends])

    @property
    def layout(self) -> CacheLayout | None:
        return self.backend.layout

    # -- rows ----------------------------------------------------------------------------------

    def install_diffusion_kv_metadata(self, metadata: Any) -> bool:
        """Install one scheduler allocation; True when rows were newly installed."""
        if self.backend.config.mode is not KVCacheMode.PAGED:
            raise ValidationError("dense diffusion execution must not install Diffusion KV metadata")
        return self.backend.install(allocation_from_metadata(metadata))

    def get_diffusion_kv_row(
        self, request_id: str, sequence_id: int | None, context_id: str | None = None
    ) -> int:
        """The worker row of an identity (a context id wins over a sequence id)."""
        if self.backend.registry is None:
            raise StateError("paged_scheduler native BlockTables are not initialized")
        return self.backend.registry.row_of(request_id, sequence_id, context_id)

    def remove_diffusion_kv_requests(self, request_ids: Iterable[str | tuple[str, int]]) -> int:
        """Clear the rows of requests (``(id, generation)`` scopes a removal); never frees blocks."""
        return self.backend.remove(request_ids)

    def refresh_block_table_layout(self) -> None:
        """Rebuild BlockTables layout tensors after the cache storage moved (CuMem wake-up)."""
        self.backend.refresh_layout()

    # -- execution -----------------------------------------------------------------------------

    def activate_paged_attention_metadata(
        self, metadata: Any
    ) -> tuple[PagedRuntime, AbstractContextManager[PagedRuntime]]:
        """``(runtime, context manager)`` for one denoise loop; ``runtime.ensure_active(step)``
        switches from prefill rows (step 0) to denoise rows, preparing once per phase."""
        translator = self.backend.translator
        if translator is None:
            raise StateError("paged_scheduler native attention adapter is not initialized")
        runtime = PagedRuntime(translator, phase_rows_from_metadata(metadata))
        return runtime, runtime.activate()

    def forward(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        omni_attn_metadata: Any | None = None,
    ) -> torch.Tensor:
        """One paged layer against the active batch (``full_attn_spans`` honoured)."""
        return self.backend.forward(layer_name, query, key, value, omni_attn_metadata)


__all__ = [
    "DiffusionKVPlatformHooks",
    "DiffusionKVRunnerBackend",
    "allocation_from_metadata",
    "phase_rows_from_metadata",
    "runner_config_from_vllm",
]

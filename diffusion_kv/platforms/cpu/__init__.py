"""The ``cpu`` reference platform: pure torch, always available, the test oracle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.layout import CacheLayout
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
        supports_ulysses=False,
        supports_dcp=False,
        supports_graph_capture=False,
    )
    kv_write_policy: ClassVar[KVWritePolicy] = KVWritePolicy.PREWRITE
    default_block_size: ClassVar[int] = 16
    is_reference: ClassVar[bool] = True

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, f"pure torch {torch.__version__}; always available")

    def block_tables_cls(self) -> type[BlockTables]:
        return TorchBlockTables

    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> MetadataBuilder:
        return CpuMetadataBuilder(layout, block_tables)

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> PagedAttentionBackend:
        return CpuPagedBackend(layer)

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
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        return torch.zeros(shape, dtype=dtype, device=device)

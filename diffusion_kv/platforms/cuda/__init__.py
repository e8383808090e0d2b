"""The ``cuda`` platform plugin (NVIDIA GPUs).

Detection uses torch only; Triton and vLLM are imported lazily by the parts that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from diffusion_kv.core.block_tables import BlockTables
from diffusion_kv.core.layout import CacheLayout
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

_NOT_BUILT = "the CUDA plugin's {part} (standalone Triton tier) is not built yet"


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    description: ClassVar[str] = "NVIDIA GPUs: Triton paged attention (vLLM FlashAttention when importable)"
    capabilities: ClassVar[Capabilities] = Capabilities(
        device_type="cuda",
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=frozenset({64, 128}),
        kernel_block_sizes=(MultipleOf(16),),
        slot_mapping_dtype=torch.int64,
        attention_modes=frozenset(AttentionMode),
        supports_gqa=True,
        supports_ulysses=False,
        supports_dcp=False,
        supports_graph_capture=False,
    )
    kv_write_policy: ClassVar[KVWritePolicy] = KVWritePolicy.PREWRITE
    default_block_size: ClassVar[int] = 128

    @classmethod
    def is_available(cls) -> Availability:
        if not torch.cuda.is_available():
            build = torch.version.cuda
            why = (
                "torch is a CPU-only build" if build is None else f"torch (CUDA {build}) sees no CUDA device"
            )
            return Availability(False, why)
        count = torch.cuda.device_count()
        return Availability(True, f"{count} CUDA device(s): {torch.cuda.get_device_name(0)}")

    def block_tables_cls(self) -> type[BlockTables]:
        raise NotImplementedError(_NOT_BUILT.format(part="BlockTables"))

    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> MetadataBuilder:
        raise NotImplementedError(_NOT_BUILT.format(part="metadata builder"))

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> PagedAttentionBackend:
        raise NotImplementedError(_NOT_BUILT.format(part="paged attention backend"))

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
        raise NotImplementedError(_NOT_BUILT.format(part="KV-cache allocation"))

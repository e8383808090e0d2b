"""The ``npu`` platform plugin (Huawei Ascend through torch_npu / vllm-ascend).

``torch_npu`` is imported only inside methods: discovery must work on any machine.
"""

from __future__ import annotations

import importlib
import importlib.util
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
    PagedAttentionBackend,
    Platform,
)

_NOT_BUILT = "the Ascend NPU plugin's {part} (direct torch_npu tier) is not built yet"


class NpuPlatform(Platform):
    name: ClassVar[str] = "npu"
    description: ClassVar[str] = "Huawei Ascend NPUs: fused-infer-attention over paged K/V"
    capabilities: ClassVar[Capabilities] = Capabilities(
        device_type="npu",
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=frozenset({64, 128}),
        kernel_block_sizes=(128,),
        slot_mapping_dtype=torch.int32,
        attention_modes=frozenset(AttentionMode),
        supports_gqa=True,
        supports_ulysses=False,
        supports_dcp=False,
        needs_host_lengths=True,
        supports_graph_capture=False,
        max_rows_per_call=4096,
        max_kv_heads_x_head_size=65535,
        max_gqa_ratio=64,
    )
    kv_write_policy: ClassVar[KVWritePolicy] = KVWritePolicy.PREWRITE
    default_block_size: ClassVar[int] = 128

    @classmethod
    def is_available(cls) -> Availability:
        if importlib.util.find_spec("torch_npu") is None:
            return Availability(False, "torch_npu is not installed")
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:  # e.g. CANN toolkit missing: the reason says so
            return Availability(False, f"torch_npu failed to import: {type(exc).__name__}: {exc}")
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return Availability(False, "torch_npu is importable but no NPU device is visible")
        return Availability(True, f"{npu.device_count()} NPU device(s)")

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
        return (num_blocks, block_size, num_kv_heads, head_size)

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

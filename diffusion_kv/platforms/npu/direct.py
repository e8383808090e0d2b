"""The direct torch_npu tier: BlockTables, metadata builder and paged backend.

Data flow per layer (the core's :attr:`KVWritePolicy.PREWRITE` policy):

1. ``write_kv``: one ``npu_scatter_pa_kv_cache`` (or ``_npu_reshape_and_cache``) of the whole
   span's K/V at int32 slots;
2. ``forward`` once per piecewise segment: one ``npu_fused_infer_attention_score`` that reads
   the pages only (``key``/``value`` are None), with that segment's metadata.

Everything FIA needs on the host (cumulative query ends, per-row KV lengths) is taken from the
``*_cpu`` tensors the core prepared, once per batch, so per-layer code never syncs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_kv.core.batch import CommonBatchMetadata, KVCache, LayerGeometry
from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.platforms.interface import Capabilities, Requirements, capability_reasons
from diffusion_kv.platforms.npu.kernels import AscendKernels, compressed_causal_mask


class NpuBlockTables(TorchBlockTables):
    """The core's torch BlockTables, fixed to the int32 slot mappings the Ascend writers take.

    It deliberately has no ``slot_mapping_dtype`` parameter: int64 slots are not an option on
    this platform.
    """

    def __init__(
        self,
        *,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: Sequence[int],
        device: torch.device | str,
        kernel_block_sizes: Sequence[int] | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
    ) -> None:
        super().__init__(
            block_sizes=block_sizes,
            max_num_reqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_blocks_per_group=max_num_blocks_per_group,
            device=device,
            kernel_block_sizes=kernel_block_sizes,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
            slot_mapping_dtype=torch.int32,
        )


@dataclass(frozen=True)
class NpuAttentionMetadata:
    """The FIA arguments of one call (one KV-cache group, one batch or piecewise segment)."""

    block_table: torch.Tensor
    """``[num_reqs, width]`` int32 kernel block ids (device)."""
    actual_seq_lengths: tuple[int, ...]
    """Cumulative query ends per row (FIA's TND convention), host ints."""
    actual_seq_lengths_kv: tuple[int, ...]
    """KV length of each row (not cumulative, FIA's PageAttention convention), host ints."""
    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32 (device), for callers that want the device copy."""
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32 (device)."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` int32 slots of this call's query tokens."""
    causal: bool
    attn_mask: torch.Tensor | None
    """The compressed causal mask for causal calls; None for full calls."""
    block_size: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int


class NpuMetadataBuilder:
    """``CommonBatchMetadata`` -> one :class:`NpuAttentionMetadata` per layer.

    FIA's TND layout handles rows of any query length in one call, so no row order is imposed
    (``reorder_batch_threshold`` is None).
    """

    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        capabilities: Capabilities,
        device: torch.device,
    ) -> None:
        if block_tables.cp_size > 1:
            raise NotImplementedError(
                "the npu plugin's direct tier does not implement decode context parallelism (cp_size > 1)"
            )
        kernel_sizes = list(block_tables.kernel_block_sizes)
        bad = [
            f"group {g}: kernel block size {bs} (supported: "
            f"{', '.join(str(r) for r in capabilities.kernel_block_sizes)})"
            for g, bs in enumerate(kernel_sizes)
            if not capabilities.supports_block_size(bs)
        ]
        if bad:
            raise ValidationError("npu: unsupported block geometry: " + "; ".join(bad))
        if block_tables.slot_mapping_dtype != torch.int32:
            raise ValidationError(
                f"npu: the K/V writers take int32 slot mappings; this BlockTables produces "
                f"{block_tables.slot_mapping_dtype}"
            )
        self.layout = layout
        self.kernel_block_sizes = kernel_sizes
        self.capabilities = capabilities
        self.device = torch.device(device)
        self._mask: torch.Tensor | None = None

    def _causal_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = compressed_causal_mask(self.device)
        return self._mask

    def build(self, batch: CommonBatchMetadata) -> Mapping[str, Any]:
        reasons = capability_reasons(self.capabilities, Requirements(num_rows=batch.num_reqs))
        if reasons:
            raise ValidationError("npu: batch rejected before any call: " + "; ".join(reasons))
        cumulative = tuple(int(x) for x in batch.query_start_loc_cpu[1:].tolist())
        kv_lens = tuple(int(x) for x in batch.seq_lens_cpu.tolist())
        starts = (0, *cumulative[:-1])
        out: dict[str, NpuAttentionMetadata] = {}
        for g, group in enumerate(self.layout.groups):
            causal = batch.causal_for_group(g)
            if causal:
                short = [
                    (r, end - start, kv)
                    for r, (start, end, kv) in enumerate(zip(starts, cumulative, kv_lens, strict=True))
                    if kv < end - start
                ]
                if short:
                    raise ValidationError(
                        "npu: causal FIA (sparse_mode=3) needs kv_len >= query_len for every row; "
                        f"(row, query_len, kv_len) = {short}"
                    )
            table = batch.block_tables[g]
            if table.dtype != torch.int32:
                raise ValidationError(f"npu: FIA takes an int32 block table; group {g} has {table.dtype}")
            md = NpuAttentionMetadata(
                block_table=table,
                actual_seq_lengths=cumulative,
                actual_seq_lengths_kv=kv_lens,
                query_start_loc=batch.query_start_loc,
                seq_lens=batch.seq_lens,
                slot_mapping=batch.slot_mappings[g],
                causal=causal,
                attn_mask=self._causal_mask() if causal else None,
                block_size=self.kernel_block_sizes[g],
                num_actual_tokens=batch.num_tokens,
                max_query_len=batch.max_query_len,
                max_seq_len=batch.max_seq_len,
            )
            for name in group.layer_names:
                out[name] = md
        return out


def split_kv_cache(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(key_cache, value_cache)`` pair of an npu layer cache."""
    if not isinstance(kv_cache, tuple) or len(kv_cache) != 2:
        raise ValidationError(
            "npu: a layer's KV cache is a (key_cache, value_cache) tuple of "
            "[num_blocks, block_size, kv_heads, head_size] tensors"
        )
    return kv_cache[0], kv_cache[1]


class NpuPagedBackend:
    """One layer's paged attention through the kernel seam (direct torch_npu tier)."""

    name = "npu-direct-fia"

    def __init__(self, layer: LayerGeometry, kernels: AscendKernels) -> None:
        self.layer = layer
        self.kernels = kernels

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
    ) -> None:
        key_cache, value_cache = split_kv_cache(kv_cache)
        tokens = key.shape[0]
        if slot_mapping.dtype != torch.int32:
            raise ValidationError(f"npu: slot mappings must be int32; got {slot_mapping.dtype}")
        if slot_mapping.shape[0] < tokens:
            raise ValidationError(
                f"npu: {tokens} K/V tokens but only {slot_mapping.shape[0]} slots (layer {self.layer.layer_name!r})"
            )
        self.kernels.write_kv(key, value, key_cache, value_cache, slot_mapping[:tokens])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: NpuAttentionMetadata = metadata
        if (key is None) != (value is None):
            raise ValidationError("key and value must both be given or both be None")
        if query.shape[0] != md.num_actual_tokens:
            raise ValidationError(
                f"npu: query has {query.shape[0]} tokens; the metadata describes {md.num_actual_tokens}"
            )
        if key is not None and value is not None:
            self.write_kv(key, value, kv_cache, md.slot_mapping)
        key_cache, value_cache = split_kv_cache(kv_cache)
        layer = self.layer
        result = self.kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            block_table=md.block_table,
            actual_seq_lengths=md.actual_seq_lengths,
            actual_seq_lengths_kv=md.actual_seq_lengths_kv,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            scale=layer.scale,
            causal=md.causal,
            causal_mask=md.attn_mask,
        )
        if out is None:
            return result
        out.copy_(result)
        return out

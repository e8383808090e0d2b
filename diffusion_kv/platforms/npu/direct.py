"""The ``direct`` paged backend of the npu platform: torch_npu operators through the kernel seam.

One instance serves one KV-cache group. Per batch, :meth:`NpuDirectBackend.build` turns the
group's :class:`~diffusion_kv.core.batch.PagedBatch` into the fused-infer-attention (FIA)
arguments (:class:`NpuAttentionMetadata`), shared by every layer of the group. Per layer:

1. ``write_kv``: one ``npu_scatter_pa_kv_cache`` (or ``_npu_reshape_and_cache``) of the whole
   span's K/V at int32 slots, ``-1`` (padding) slots dropped first (:mod:`.slots`);
2. ``forward`` once per attention call (once, or once per piecewise segment): one
   ``npu_fused_infer_attention_score`` that reads the pages only, with that call's metadata.

Block tables are the core's :class:`~diffusion_kv.core.block_tables.TorchBlockTables`; the
backend declares int32 slot mappings only, so that is what the runner builds. Everything FIA
needs on the host (cumulative query ends, per-row KV lengths) is taken from the ``*_cpu``
tensors the core prepared, once per batch, so per-layer code never syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffusion_kv.core.capabilities import dtype_name
from diffusion_kv.core.errors import UnsupportedFeatureError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.host import HostRuntime
from diffusion_kv.platforms.interface import (
    Availability,
    Capabilities,
    GroupContext,
    KVCache,
    KVPageLayout,
    LayerGeometry,
    PagedBackend,
    PagedBatch,
    Requirements,
    capability_reasons,
)
from diffusion_kv.platforms.npu.constraints import (
    DIRECT_CAPABILITIES,
    MAX_TOKENS_PER_CALL,
    head_count_reasons,
    planned_mask_reasons,
    unverified_notes,
)
from diffusion_kv.platforms.npu.kernels import AscendKernels, compressed_causal_mask, torch_npu_availability
from diffusion_kv.platforms.npu.slots import PaddingFilter


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
    """Kernel block size (tokens per cache block)."""
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int


def split_kv_cache(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(key_cache, value_cache)`` pair of an npu layer cache."""
    if not isinstance(kv_cache, tuple) or len(kv_cache) != 2:
        raise ValidationError(
            "npu: a layer's KV cache is a (key_cache, value_cache) tuple of "
            "[num_blocks, block_size, kv_heads, head_size] tensors"
        )
    return kv_cache[0], kv_cache[1]


def layer_requirements(layer: LayerGeometry) -> Requirements:
    return Requirements(
        dtype=layer.dtype,
        head_size=layer.head_size,
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
    )


def batch_reasons(capabilities: Capabilities, batch: PagedBatch) -> list[str]:
    """Why FIA cannot take ``batch`` in one call (rows, tokens, causal row lengths); empty: it can."""
    reasons = capability_reasons(capabilities, Requirements(num_rows=batch.num_reqs))
    if batch.num_tokens > MAX_TOKENS_PER_CALL:
        reasons.append(
            f"num_tokens={batch.num_tokens} exceeds {MAX_TOKENS_PER_CALL} query tokens per call "
            "(the TND limit of npu_fused_infer_attention_score)"
        )
    if batch.causal:
        cumulative = [int(x) for x in batch.query_start_loc_cpu.tolist()]
        kv_lens = [int(x) for x in batch.seq_lens_cpu.tolist()]
        short = [
            (r, end - start, kv)
            for r, (start, end, kv) in enumerate(zip(cumulative[:-1], cumulative[1:], kv_lens, strict=True))
            if kv < end - start
        ]
        if short:
            reasons.append(
                "causal FIA (sparse_mode=3) needs kv_len >= query_len for every row; "
                f"(row, query_len, kv_len) = {short}"
            )
    return reasons


def require_layers(backend: type[PagedBackend], layers: tuple[LayerGeometry, ...]) -> None:
    """Reject a layer the Ascend operators cannot serve, with every reason, before any call."""
    for layer in layers:
        reasons = backend.not_supported_reasons(layer_requirements(layer))
        if reasons:
            raise UnsupportedRequirementsError(
                f"npu cannot serve layer {layer.layer_name!r} "
                f"(dtype={dtype_name(layer.dtype)}, num_heads={layer.num_heads}, "
                f"num_kv_heads={layer.num_kv_heads}, head_size={layer.head_size}): " + "; ".join(reasons)
            )


class NpuDirectBackend(PagedBackend):
    """Paged attention through torch_npu's scatter-PA writer and fused-infer-attention.

    FIA's TND layout handles rows of any query length in one call, so no row order is imposed
    (``reorder_batch_threshold`` is None).
    """

    name: ClassVar[str] = "direct"
    platform: ClassVar[str] = "npu"
    priority: ClassVar[int] = 100
    description: ClassVar[str] = "torch_npu scatter-PA write + fused-infer-attention, TND + block table"
    capabilities: ClassVar[Capabilities] = DIRECT_CAPABILITIES
    page_layout: ClassVar[KVPageLayout] = KVPageLayout.SEPARATE

    reorder_batch_threshold: int | None = None

    # --- selection ----------------------------------------------------------------------------

    @classmethod
    def is_available(cls) -> Availability:
        """Available wherever ``torch_npu`` imports (the installed emulator counts)."""
        return torch_npu_availability()

    @classmethod
    def not_supported_reasons(cls, requirements: Requirements) -> list[str]:
        reasons = (
            super().not_supported_reasons(requirements)
            + head_count_reasons(requirements)
            + planned_mask_reasons(requirements)
        )
        return reasons + unverified_notes(requirements) if reasons else reasons

    @classmethod
    def prepare_worker(cls, host: HostRuntime | None) -> None:
        """Worker start (called by the platform when this backend is the one selected): resolve
        the operators now, so a missing one fails fast, naming the operator and the fix."""
        del host
        AscendKernels.load()

    # --- one instance per KV-cache group ------------------------------------------------------

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        block_tables = group.block_tables
        if block_tables.cp_size > 1:
            raise UnsupportedFeatureError(
                "the npu plugin's direct backend does not implement decode context parallelism (cp_size > 1)"
            )
        caps = self.capabilities
        if caps.kernel_block_size_for(group.kernel_block_size) != group.kernel_block_size:
            raise ValidationError(
                f"npu: unsupported block geometry: group {group.index}: kernel block size "
                f"{group.kernel_block_size} (supported: {', '.join(str(r) for r in caps.kernel_block_sizes)})"
            )
        if block_tables.slot_mapping_dtype != torch.int32:
            raise ValidationError(
                f"npu: the K/V writers take int32 slot mappings; this BlockTables produces "
                f"{block_tables.slot_mapping_dtype}"
            )
        require_layers(type(self), group.layers)
        self.kernels = AscendKernels.load()
        self.padding = PaddingFilter()
        self._mask: torch.Tensor | None = None

    def _causal_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = compressed_causal_mask(self.group.device)
        return self._mask

    def build(self, batch: PagedBatch) -> NpuAttentionMetadata:
        if batch.block_plan is not None:
            return self._build_planned(batch)
        reasons = batch_reasons(self.capabilities, batch)
        if reasons:
            raise ValidationError("npu: batch rejected before any call: " + "; ".join(reasons))
        self.padding.reset()
        cumulative = tuple(int(x) for x in batch.query_start_loc_cpu[1:].tolist())
        kv_lens = tuple(int(x) for x in batch.seq_lens_cpu.tolist())
        if batch.block_table.dtype != torch.int32:
            raise ValidationError(
                f"npu: FIA takes an int32 block table; group {self.group.index} has {batch.block_table.dtype}"
            )
        return NpuAttentionMetadata(
            block_table=batch.block_table,
            actual_seq_lengths=cumulative,
            actual_seq_lengths_kv=kv_lens,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            slot_mapping=batch.slot_mapping,
            causal=batch.causal,
            attn_mask=self._causal_mask() if batch.causal else None,
            block_size=self.group.kernel_block_size,
            num_actual_tokens=batch.num_tokens,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
        )

    def _build_planned(self, batch: PagedBatch) -> NpuAttentionMetadata:
        """A chunk-causal batch (with its window and sink) as full-attention FIA rows: each row's
        queries are cut at chunk boundaries, and each piece -- whose queries all see the same
        keys, the sink's and the window's whole pages up to the chunk's end -- becomes one FIA row
        whose block table lists only those pages (released ones are never listed), its KV
        length their visible keys. ``sparse_mode=0``, no mask."""
        mask = self.group.mask
        page = self.group.kernel_block_size
        chunk = mask.chunk
        if chunk is None or chunk % page or (mask.window or 0) % page or mask.sink % page:
            raise UnsupportedFeatureError(
                f"npu: the direct backend serves chunk-causal masks on {page}-token page boundaries; "
                f"group {self.group.index} has {mask.describe()}"
            )
        qsl = [int(x) for x in batch.query_start_loc_cpu.tolist()]
        seq = [int(x) for x in batch.seq_lens_cpu.tolist()]
        ends: list[int] = []
        kv_lens: list[int] = []
        rows: list[int] = []
        pages: list[list[int]] = []
        for r, sl in enumerate(seq):
            p = sl - (qsl[r + 1] - qsl[r])  # the row's first query position (a suffix)
            at = qsl[r]
            while p < sl:
                raw = (p // chunk + 1) * chunk
                hi = min(raw, sl)
                lo = max(raw - mask.window, 0) if mask.window is not None else 0
                sink_pages = list(range(-(-min(mask.sink, hi) // page)))
                seen = sink_pages + [b for b in range(lo // page, -(-hi // page)) if b >= len(sink_pages)]
                at += hi - p
                ends.append(at)
                kv_lens.append((len(seen) - 1) * page + hi - seen[-1] * page)
                rows.append(r)
                pages.append(seen)
                p = hi
        if len(ends) > (self.capabilities.max_rows_per_call or len(ends)):
            raise ValidationError(
                f"npu: batch rejected before any call: {len(ends)} chunk rows exceed "
                f"{self.capabilities.max_rows_per_call} rows per call"
            )
        if batch.num_tokens > MAX_TOKENS_PER_CALL:
            raise ValidationError(
                f"npu: batch rejected before any call: num_tokens={batch.num_tokens} exceeds "
                f"{MAX_TOKENS_PER_CALL} query tokens per call"
            )
        width = max(len(x) for x in pages)
        row_index = torch.tensor([[r] * width for r in rows], dtype=torch.long)
        page_index = torch.tensor([x + [x[-1]] * (width - len(x)) for x in pages], dtype=torch.long)
        device = batch.block_table.device
        table = batch.block_table[row_index.to(device), page_index.to(device)].to(torch.int32)
        self.padding.reset()
        return NpuAttentionMetadata(
            block_table=table,
            actual_seq_lengths=tuple(ends),
            actual_seq_lengths_kv=tuple(kv_lens),
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            slot_mapping=batch.slot_mapping,
            causal=False,
            attn_mask=None,
            block_size=page,
            num_actual_tokens=batch.num_tokens,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
        )

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache, value_cache = split_kv_cache(kv_cache)
        tokens = key.shape[0]
        if slot_mapping.dtype != torch.int32:
            raise ValidationError(f"npu: slot mappings must be int32; got {slot_mapping.dtype}")
        if slot_mapping.shape[0] < tokens:
            raise ValidationError(
                f"npu: {tokens} K/V tokens but only {slot_mapping.shape[0]} slots (layer {layer.layer_name!r})"
            )
        kept = self.padding.keep(key, value, slot_mapping[:tokens])
        if not kept.empty:
            self.kernels.write_kv(kept.key, kept.value, key_cache, value_cache, kept.slots)

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: NpuAttentionMetadata = metadata
        if query.shape[0] != md.num_actual_tokens:
            raise ValidationError(
                f"npu: query has {query.shape[0]} tokens; the metadata describes {md.num_actual_tokens}"
            )
        key_cache, value_cache = split_kv_cache(kv_cache)
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

"""A complete diffusion-kv platform plugin: one device type, one paged backend, pure torch.

The backend keeps separate K and V caches, addresses fixed kernel blocks of 64 tokens (the
core splits larger scheduler blocks into them) and takes int32 slot mappings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffusion_kv import (
    AttentionMode,
    Availability,
    Capabilities,
    KVPageLayout,
    LayerGeometry,
    PagedBackend,
    PagedBatch,
    Platform,
)


@dataclass(frozen=True)
class ToyMetadata:
    """What ``forward`` needs for one batch of one KV-cache group."""

    query_start_loc: tuple[int, ...]  # host ints: row r queries tokens [qsl[r], qsl[r + 1])
    seq_lens: tuple[int, ...]  # host ints: row r attends over its first seq_lens[r] keys
    block_table: torch.Tensor  # [rows, width] kernel block ids
    causal: bool


class ToyBackend(PagedBackend):
    name: ClassVar[str] = "toy-kernel"
    platform: ClassVar[str] = "toy"
    priority: ClassVar[int] = 100
    description: ClassVar[str] = "separate K/V pages of 64 tokens, int32 slots"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16}),
        head_sizes=frozenset({64, 128}),
        kernel_block_sizes=(64,),
        slot_mapping_dtypes=frozenset({torch.int32}),
        attention_modes=frozenset(AttentionMode),
    )
    page_layout: ClassVar[KVPageLayout] = KVPageLayout.SEPARATE

    def build(self, batch: PagedBatch) -> ToyMetadata:
        # Host copies were made when the batch was prepared: reading them never syncs.
        return ToyMetadata(
            query_start_loc=tuple(batch.query_start_loc_cpu.tolist()),
            seq_lens=tuple(batch.seq_lens_cpu.tolist()),
            block_table=batch.block_table,
            causal=batch.causal,
        )

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: Any,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache, value_cache = kv_cache  # each [kernel_blocks, 64, Hkv, D]
        slots = slot_mapping[: key.shape[0]]
        keep = slots >= 0  # -1 marks padding: never written
        index = slots[keep].long()
        key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, index, key[keep].to(key_cache.dtype))
        value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, index, value[keep].to(value_cache.dtype))

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: Any,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: ToyMetadata = metadata
        key_cache, value_cache = kv_cache
        page = key_cache.shape[1]
        result = out if out is not None else torch.empty_like(query)
        repeat = layer.num_heads // layer.num_kv_heads
        for row, n in enumerate(md.seq_lens):
            q0, q1 = md.query_start_loc[row], md.query_start_loc[row + 1]
            if q1 == q0:
                continue
            pages = md.block_table[row, : -(-n // page)].long()
            k = key_cache[pages].flatten(0, 1)[:n].repeat_interleave(repeat, dim=1).float()
            v = value_cache[pages].flatten(0, 1)[:n].repeat_interleave(repeat, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * layer.scale
            if md.causal:  # bottom-right aligned: the queries are the row's last tokens
                positions = torch.arange(n - (q1 - q0), n, device=query.device)[:, None]
                visible = torch.arange(n, device=query.device)[None, :] <= positions
                scores = scores.masked_fill(~visible, float("-inf"))
            result[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(result.dtype)
        return result


class ToyPlatform(Platform):
    name: ClassVar[str] = "toy"
    description: ClassVar[str] = "a toy accelerator (the CPU, when TOY_DEVICE=1)"
    device_type: ClassVar[str] = "cpu"
    default_block_size: ClassVar[int] = 64
    backends: ClassVar[tuple[type[PagedBackend], ...]] = (ToyBackend,)

    @classmethod
    def is_available(cls) -> Availability:
        # A real plugin imports its SDK here (never at module import) and asks the driver.
        if os.environ.get("TOY_DEVICE") == "1":
            return Availability(True, "TOY_DEVICE=1")
        return Availability(False, "no toy device (set TOY_DEVICE=1)")

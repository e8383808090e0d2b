"""A complete diffusion-kv platform plugin: one device type, one paged backend, pure torch.

The backend keeps separate K and V pages of 64 tokens (the core splits larger scheduler blocks
into them) and takes int32 slots. It keeps PagedBackend's default ``build`` (the metadata is
the PagedBatch itself) and ``write_kv`` (indexed copies into the declared page layout).
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

import diffusion_kv as dkv


class ToyBackend(dkv.PagedBackend):
    name: ClassVar[str] = "toy-kernel"
    platform: ClassVar[str] = "toy"
    priority: ClassVar[int] = 100
    description: ClassVar[str] = "separate K/V pages of 64 tokens, int32 slots"
    capabilities: ClassVar[dkv.Capabilities] = dkv.Capabilities(
        dtypes=frozenset({torch.float32, torch.float16}),
        head_sizes=frozenset({64, 128}),
        kernel_block_sizes=(64,),
        slot_mapping_dtypes=frozenset({torch.int32}),
    )
    page_layout: ClassVar[dkv.KVPageLayout] = dkv.KVPageLayout.SEPARATE

    def forward(
        self,
        layer: dkv.LayerGeometry,
        query: torch.Tensor,
        kv_cache: dkv.KVCache,
        metadata: dkv.PagedBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache  # each [kernel_blocks, 64, Hkv, D]
        starts = metadata.query_start_loc_cpu.tolist()  # host copies: reading them never syncs
        result = out if out is not None else torch.empty_like(query)
        repeat = layer.num_heads // layer.num_kv_heads
        for row, n in enumerate(metadata.seq_lens_cpu.tolist()):
            q0, q1 = starts[row], starts[row + 1]
            if q1 == q0:
                continue
            pages = metadata.block_table[row, : -(-n // 64)].long()
            k = key_cache[pages].flatten(0, 1)[:n].repeat_interleave(repeat, dim=1).float()
            v = value_cache[pages].flatten(0, 1)[:n].repeat_interleave(repeat, dim=1).float()
            scores = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * layer.scale
            if metadata.causal:  # bottom-right aligned: the queries are the row's last tokens
                visible = torch.arange(n)[None, :] <= torch.arange(n - (q1 - q0), n)[:, None]
                scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
            result[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(result.dtype)
        return result


class ToyPlatform(dkv.Platform):
    name: ClassVar[str] = "toy"
    description: ClassVar[str] = "a toy accelerator (the CPU, when TOY_DEVICE=1)"
    device_type: ClassVar[str] = "cpu"
    default_block_size: ClassVar[int] = 64
    backends: ClassVar[tuple[type[dkv.PagedBackend], ...]] = (ToyBackend,)

    @classmethod
    def is_available(cls) -> dkv.Availability:
        # A real plugin imports its SDK here (never at module import) and asks the driver.
        if os.environ.get("TOY_DEVICE") == "1":
            return dkv.Availability(True, "TOY_DEVICE=1")
        return dkv.Availability(False, "no toy device (set TOY_DEVICE=1)")

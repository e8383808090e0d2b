"""The cpu platform's fast backend: gather (or view) each row's pages, then torch's SDPA.

The reference backend (:mod:`.backend`) stays the oracle: obviously-correct per-row float32
math. This one serves the same requests fast on the host, with the plan the ``cuda`` plugin's
``sdpa`` way makes from host lengths alone (rows of one shape in one SDPA call; a row whose
pages form one evenly spaced run read as a strided view of the cache, no gather), and torch's
fused CPU attention kernel (FlashAttention for CPU) instead of materialising the score matrix.
K/V are written by one indexed copy per cache, or by slice copies where the batch's slots
form a few runs (found at ``build``). Decode context parallelism returns the partial
with its log-sum-exp from the same CPU kernel.

The gather + SDPA code is the platforms' shared device-neutral module
(:mod:`diffusion_kv.platforms.torch_sdpa`, which the ``cuda`` plugin extends with its Triton
way); nothing of Triton or CUDA is imported or run here.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.capabilities import BASE_MODES
from diffusion_kv.platforms.interface import (
    Availability,
    Capabilities,
    KVCache,
    LayerGeometry,
    MultipleOf,
)
from diffusion_kv.platforms.torch_sdpa import TorchSdpaBackend


class CpuSdpaBackend(TorchSdpaBackend):
    """Gather or view + torch SDPA on the host (the ``cpu`` platform's default)."""

    name: ClassVar[str] = "sdpa"
    platform: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 120
    description: ClassVar[str] = "rows of one shape per SDPA call over their pages (views when contiguous)"
    packed_query: ClassVar[bool] = True  # SDPA takes the rows' query views at any token stride
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        head_sizes=frozenset(range(8, 257, 8)),
        kernel_block_sizes=(MultipleOf(16),),
        slot_mapping_dtypes=frozenset({torch.int64}),
        attention_modes=BASE_MODES | {AttentionMode.CHUNK_CAUSAL},
        supports_gqa=True,
        supports_ulysses=True,
        supports_dcp=True,
        supports_graph_capture=False,
        max_window=None,
        max_sink=None,
        supports_live_from=True,
    )
    """Chunk-causal, windowed and sink masks: only the block plan's live blocks are gathered, one
    SDPA per row shape (and ``live_from``: a re-cache's window forward) with the exact mask where
    a block is PARTIAL (``planned_row_groups``); not with decode context parallelism (refused
    with that reason)."""

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, f"torch {torch.__version__} SDPA on the host")

    @classmethod
    def block_tables_cls(cls) -> type[BlockTables]:
        return TorchBlockTables

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        slots = slot_mapping[: key.shape[0]].long()
        keep = slots >= 0
        if not bool(keep.all()):  # the host knows at once: drop the padding tokens
            slots, key, value = slots[keep], key[keep], value[keep]
        self.write_kv_valid(layer, key, value, kv_cache, slots)  # one indexed copy per cache

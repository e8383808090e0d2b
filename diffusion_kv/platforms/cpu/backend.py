"""The cpu reference backend: a simple metadata record, and pure-torch paged attention.

This is the oracle other platforms are compared with, so it favours obviously-correct code over
speed: per row it gathers the row's pages into contiguous K/V and applies the exact mask
(bottom-right causal, or full) in float32 (float64 for float64 inputs), with GQA by head
repetition.

Decode context parallelism: with ``cp_size > 1`` a rank holds only the keys of its interleave
slots (the core's slot mapping writes nothing else), and the metadata carries the rank-local
KV lengths. :meth:`CpuPagedBackend.forward_partial` attends over those local keys, with the
causal mask applied on absolute key positions, and returns the output with its log-sum-exp;
the core merges the partials across the DCP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffusion_kv.core.attention import BlockPlan, MaskSpec
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.errors import UnsupportedFeatureError, ValidationError
from diffusion_kv.core.kv_quant import FP8_E4M3, dequantize
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.parallel import dcp_key_positions
from diffusion_kv.core.translate import dcp_local_seq_lens
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Capabilities,
    GroupContext,
    KVCache,
    LayerGeometry,
    MultipleOf,
    PagedBackend,
    PagedBatch,
)


def _gather_bytes(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` for a float8 cache, gathered as bytes."""
    return cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)


@dataclass(frozen=True)
class CpuPagedMetadata:
    """Native metadata of the reference backend for one KV-cache group."""

    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_table: torch.Tensor
    """``[num_reqs, width]`` kernel block ids."""
    mode: AttentionMode
    """CAUSAL or FULL (a piecewise segment's); the mask is the mode's own row mask."""
    block_size: int
    """Kernel block size (tokens per cache block)."""
    local_seq_lens: tuple[int, ...] | None = None
    """Keys of each row held by this DCP rank (``None`` without DCP)."""
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    mask: MaskSpec | None = None
    """The group's mask when it is not plain (chunk, window, sink): applied instead of ``mode``'s."""
    plan: BlockPlan | None = None
    """The batch's block plan for such a mask: only the blocks it does not skip are gathered."""


class CpuReferenceBackend(PagedBackend):
    """Writes K/V by slot mapping; attends by gathering each row's pages (the oracle)."""

    name: ClassVar[str] = "reference"
    platform: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 100
    description: ClassVar[str] = "pure torch: gather each row's pages, exact mask, float64 math"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64}),
        head_sizes=None,
        kernel_block_sizes=(MultipleOf(1),),
        slot_mapping_dtypes=frozenset({torch.int64, torch.int32}),
        attention_modes=frozenset(AttentionMode),
        supports_gqa=True,
        supports_ulysses=True,
        supports_dcp=True,
        kv_cache_dtypes=frozenset({FP8_E4M3}),
        max_window=None,
        max_sink=None,
        supports_live_from=True,
    )
    retains_metadata: ClassVar[bool] = True  # build only reads the batch: nothing is shared or reused

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        self._bind_dcp()

    def build(self, batch: PagedBatch) -> CpuPagedMetadata:
        local: tuple[int, ...] | None = None
        if self.cp_size > 1:
            host = batch.dcp_local_seq_lens_cpu
            if host is None:
                host = dcp_local_seq_lens(batch.seq_lens_cpu, self.cp_size, self.cp_rank, self.cp_interleave)
            local = tuple(int(x) for x in host.tolist())
        return CpuPagedMetadata(
            query_start_loc=tuple(int(x) for x in batch.query_start_loc_cpu.tolist()),
            seq_lens=tuple(int(x) for x in batch.seq_lens_cpu.tolist()),
            block_table=batch.block_table,
            mode=batch.mode,
            block_size=self.group.kernel_block_size,
            local_seq_lens=local,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            cp_interleave=self.cp_interleave,
            mask=self.group.mask if batch.block_plan is not None else None,
            plan=batch.block_plan,
        )

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: CpuPagedMetadata = metadata
        if md.cp_size > 1:
            raise ValidationError(
                f"reference metadata is DCP-sharded (cp_size={md.cp_size}): attention over one rank's "
                "keys is partial; use forward_partial and merge across the DCP group"
            )
        # Without DCP the partial over this rank's keys is the whole attention.
        result, _ = self.forward_partial(layer, query, kv_cache, md)
        if out is None:
            return result
        out.copy_(result)
        return out

    def forward_partial(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over this rank's keys: ``(out [T, H, D], lse [T, H] float32)``.

        Without DCP the local keys are all keys, and ``out`` equals :meth:`forward`'s.
        """
        return self._partial(layer, query, kv_cache, metadata, None)

    def forward_partial_extra(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        extra_query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``PagedBackend.forward_partial_extra`` as the oracle: the one row with queries
        attends its queries and ``extra_query`` together, the extra queries under the row's
        visibility, which must be the same for every query of the row
        (:class:`UnsupportedFeatureError` otherwise, or with several rows with queries)."""
        md: CpuPagedMetadata = metadata
        qsl = md.query_start_loc
        with_queries = [r for r in range(len(md.seq_lens)) if qsl[r + 1] > qsl[r]]
        if len(with_queries) != 1 or qsl[with_queries[0] + 1] - qsl[with_queries[0]] != query.shape[0]:
            raise UnsupportedFeatureError(
                f"backend {self.name!r} forward_partial_extra: {len(with_queries)} rows with queries "
                f"({query.shape[0]} queries given); extra queries attend beside exactly one row's"
            )
        return self._partial(layer, query, kv_cache, md, extra_query)

    def _partial(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: CpuPagedMetadata,
        extra_query: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_partial`; with ``extra_query`` (one row with queries, checked by the
        caller) those queries appended to the row's, attending under its uniform visibility."""
        key_cache, value_cache = key_value_caches(kv_cache)
        extra = 0 if extra_query is None else extra_query.shape[0]
        groups = layer.num_heads // layer.num_kv_heads
        # float64 whatever the pages' dtype: the oracle's own rounding stays far below any
        # tolerance it is held to. (In float32 on two threads, the first call in a fresh process
        # measured 7e-5 off the exact result in 2 of 30 processes on the 2-core host -- every
        # later call, and every call on one thread, 6e-7 -- which failed the kit's fp32 bound.)
        compute = torch.float64
        device = query.device
        total = query.shape[0] + extra
        out = torch.zeros((total, *query.shape[1:]), dtype=query.dtype, device=device)
        lse_out = torch.full((total, query.shape[1]), float("-inf"), dtype=torch.float32, device=device)
        local_lens = md.local_seq_lens if md.local_seq_lens is not None else md.seq_lens
        for r in range(len(md.seq_lens)):
            q0, q1 = md.query_start_loc[r], md.query_start_loc[r + 1]
            n_local = local_lens[r]
            if q1 == q0 or n_local == 0:
                continue
            sl = md.seq_lens[r]
            if md.plan is not None:  # only the blocks some query sees (released ones are skipped)
                live = md.plan.live_blocks(r)
                blocks = md.block_table[r].to(torch.long)[live.to(md.block_table.device)]
                offsets = torch.arange(md.block_size)
                key_pos = (live[:, None] * md.block_size + offsets[None, :]).flatten()
                n_keys = int((key_pos < sl).sum())  # positions ascend: the tail past seq_len drops
                key_pos = key_pos[:n_keys].to(device)
            else:
                blocks = md.block_table[r, : cdiv(n_local, md.block_size)].to(torch.long)
                n_keys = n_local
                key_pos = dcp_key_positions(n_local, md.cp_size, md.cp_rank, md.cp_interleave, device)
            shape = (-1, layer.num_kv_heads, layer.head_size)
            sc = layer.kv_scales
            if sc is None:
                k = key_cache.index_select(0, blocks).reshape(shape)[:n_keys]
                v = value_cache.index_select(0, blocks).reshape(shape)[:n_keys]
            else:  # e4m3 pages: gather the bytes, dequantise in the compute dtype
                k = dequantize(_gather_bytes(key_cache, blocks).reshape(shape)[:n_keys], sc.k_scale, compute)
                v = dequantize(
                    _gather_bytes(value_cache, blocks).reshape(shape)[:n_keys], sc.v_scale, compute
                )
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            q_rows = query[q0:q1]
            if extra_query is not None:
                q_rows = torch.cat((q_rows, extra_query.to(query.dtype)))
            q = q_rows.to(compute).transpose(0, 1)  # [H, Lq (+ extra), D]
            scores = torch.matmul(q, k.to(compute).permute(1, 2, 0)) * layer.scale  # [H, Lq, n_keys]
            # the mask over the row's keys, at the global positions of the keys gathered
            if md.mask is not None:  # over the gathered keys alone (their count, not the row's length)
                live_from = md.plan.row_live_from(r) if md.plan is not None else 0
                visible = md.mask.key_mask(
                    sl - (q1 - q0), q1 - q0, sl, key_pos.cpu(), live_from=live_from
                ).to(device)
            else:
                visible = md.mode.row_mask(sl - (q1 - q0), q1 - q0, sl).to(device)[:, key_pos]
            if extra_query is not None:
                if not bool((visible == visible[:1]).all()):
                    raise UnsupportedFeatureError(
                        f"backend {self.name!r} forward_partial_extra: row {r}'s {q1 - q0} queries see "
                        "different keys; extra queries need a row whose queries all see the same ones"
                    )
                visible = torch.cat((visible, visible[:1].expand(extra, -1)))
            scores = scores.masked_fill(~visible, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf where no local key is visible
            finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            probs = torch.exp(scores - finite[..., None])
            o = torch.matmul(probs, v.to(compute).transpose(0, 1))  # [H, Lq, D]
            end = q1 if extra_query is None else total  # the extra queries after the row's
            out[q0:end] = o.transpose(0, 1).to(out.dtype)
            lse_out[q0:end] = lse.transpose(0, 1).to(torch.float32)
        return out, lse_out

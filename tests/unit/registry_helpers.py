"""Helpers shared by the registry tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.layout import CacheLayout, single_group_layout
from diffusion_kv.core.registry import RowRegistry


class FlakyBlockTables(TorchBlockTables):
    """TorchBlockTables that can fail on the n-th ``append_block_ids`` or on apply."""

    fail_append_at: int | None = None
    fail_apply: bool = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.appends = 0
        self.applies = 0

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        self.appends += 1
        if self.fail_append_at is not None and self.appends >= self.fail_append_at:
            self.fail_append_at = None
            raise RuntimeError("injected append failure")
        super().append_block_ids(req_index, new_block_ids, overwrite)

    def apply_staged_writes(self) -> None:
        self.applies += 1
        if self.fail_apply:
            self.fail_apply = False
            raise RuntimeError("injected apply failure")
        super().apply_staged_writes()


def layout(
    block_size: int = 4, max_model_len: int = 32, rows_per_request: int = 3, max_num_seqs: int = 2
) -> CacheLayout:
    return single_group_layout(
        ["layer.0", "layer.1"],
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float32,
        block_size=block_size,
        num_blocks=64,
        max_model_len=max_model_len,
        max_rows_per_request=rows_per_request,
        max_num_seqs=max_num_seqs,
    )


def make_registry(lay: CacheLayout | None = None, **kwargs: Any) -> tuple[RowRegistry, FlakyBlockTables]:
    lay = lay or layout()
    bt = FlakyBlockTables(
        block_sizes=lay.block_sizes,
        max_num_reqs=lay.max_num_reqs,
        max_num_batched_tokens=lay.max_num_batched_tokens,
        max_num_blocks_per_group=lay.max_blocks_per_row(),
        device="cpu",
    )
    return RowRegistry(lay, bt, **kwargs), bt


def seq(sid: int, seq_len: int, blocks: list[int], **kw: Any) -> SequenceAllocation:
    return SequenceAllocation(
        sequence_id=sid,
        prefix_len=kw.pop("prefix_len", 0),
        target_len=kw.pop("target_len", seq_len),
        seq_len=seq_len,
        block_ids=(tuple(blocks),),
        **kw,
    )


def request(rid: str = "r", gen: int = 0, seqs: tuple = (), contexts: tuple = ()) -> RequestAllocation:
    if not seqs:
        seqs = (seq(0, 5, [1, 2]),)
    return RequestAllocation(rid, gen, tuple(seqs), tuple(contexts))


def context(cid: str, num_tokens: int, blocks: list[int], role: str = "image") -> ContextAllocation:
    return ContextAllocation(cid, role, num_tokens, (tuple(blocks),))


def owned_mirrors_writer(reg: RowRegistry) -> None:
    """The registry's set of written blocks per group is exactly ``_writer``'s nonzero entries,
    and a request's claimed sets (the plain install's) hold exactly its claimed arrays."""
    assert reg._owned == [set(np.flatnonzero(w).tolist()) for w in reg._writer]
    for rid, (arrays, sets) in reg._claimed.items():
        if sets is not None:
            assert sets == [set(a.tolist()) for a in arrays], rid


def state_of(reg: RowRegistry) -> tuple:
    owned_mirrors_writer(reg)
    bt = reg.block_tables
    return (
        reg.rows,
        reg.free_rows,
        {rid: reg.generation_of(rid) for rid in reg.installed_requests()},
        bt.num_blocks.cpu.clone().tolist(),
        bt.num_blocks.gpu.clone().tolist(),  # type: ignore[attr-defined]
        [t.gpu.clone().tolist() for t in bt.block_tables],  # type: ignore[attr-defined]
        [{b: dict(h) for b, h in group.items()} for group in reg._holders],
        dict(reg._written),
        dict(reg._removed),
        [sorted(owned) for owned in reg._owned],
    )

"""The BlockTables protocol: the duck type the core talks to.

A BlockTables object owns the worker-side block tables of every KV-cache group: one row per
installed identity, staged (host-side) writes applied in one step, a host view of how many
(kernel) blocks each row holds, and the per-batch gather of table rows and slot mappings.

The names follow vLLM's model-runner-V2 ``BlockTables`` so that vLLM's own class (and
vllm-ascend's) fits the same seam through a thin adapter in ``integrations/vllm``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class HostBlockCounts(Protocol):
    """Host view of the number of *kernel* blocks installed per ``[group, row]``."""

    @property
    def cpu(self) -> torch.Tensor:
        """``[num_groups, max_num_reqs]`` int32 CPU tensor; the source of truth."""
        ...

    def copy_to_uva(self) -> None:
        """Publish the host values to the device-side view."""
        ...


@runtime_checkable
class StagedGroupTable(Protocol):
    """One group's table; only the rollback hook is part of the protocol."""

    def clear_staged_writes(self) -> None: ...


@runtime_checkable
class BlockTables(Protocol):
    """Worker block tables for all KV-cache groups."""

    block_sizes: Sequence[int]
    """KV-manager block size per group (what the scheduler allocates)."""
    kernel_block_sizes: Sequence[int]
    """Block size the attention kernel addresses, per group (divides ``block_sizes``)."""
    blocks_per_kv_block: Sequence[int]
    """``block_sizes[g] // kernel_block_sizes[g]``."""
    max_num_reqs: int
    max_num_batched_tokens: int
    cp_size: int
    cp_rank: int
    cp_interleave: int
    slot_mapping_dtype: torch.dtype
    num_blocks: HostBlockCounts
    block_tables: Sequence[StagedGroupTable]

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        """Stage a write of manager block ids for one row (all groups); updates ``num_blocks``."""
        ...

    def apply_staged_writes(self) -> None:
        """Apply every staged write to the device tables and publish ``num_blocks``."""
        ...

    def gather_block_tables(
        self, idx_mapping: torch.Tensor, num_reqs_padded: int
    ) -> tuple[torch.Tensor, ...]:
        """Per group, the table rows of ``idx_mapping`` (``[num_reqs_padded, width]``, int32)."""
        ...

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> torch.Tensor:
        """``[num_groups, num_tokens_padded]`` slots; ``-1`` for padding and non-local tokens."""
        ...

    def init_block_table_layout_tensors(self) -> None:
        """Rebuild derived layout tensors (after the underlying storage was reallocated)."""
        ...

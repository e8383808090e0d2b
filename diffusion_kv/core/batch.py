"""The neutral per-batch record handed to a platform's metadata builder.

It plays the role of vLLM's ``CommonAttentionMetadata``: everything a native builder needs to
describe one paged attention call over several rows, in platform-neutral tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommonBatchMetadata:
    """One batch of paged rows, already resolved to worker rows.

    Device tensors live on the worker device; ``*_cpu`` tensors are host copies made at
    preparation time (never read back from the device).
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32 cumulative query lengths (device)."""
    query_start_loc_cpu: torch.Tensor
    max_query_len: int
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32 total KV length of each row after this call's write (device)."""
    seq_lens_cpu: torch.Tensor
    max_seq_len: int
    positions: torch.Tensor
    """``[num_tokens]`` int64 absolute position of every query token (device)."""
    block_tables: tuple[torch.Tensor, ...]
    """Per KV-cache group, ``[num_reqs, width]`` int32 block ids (device)."""
    slot_mappings: torch.Tensor
    """``[num_groups, num_tokens]`` slot of every query token, ``-1`` where nothing is written."""
    causal: bool | Mapping[int, bool]
    """One mode for every group, or per group index."""
    dcp_local_seq_lens: torch.Tensor | None = None
    """Rank-local KV lengths under decode context parallelism, else ``None``."""

    def causal_for_group(self, group_index: int) -> bool:
        if isinstance(self.causal, bool):
            return self.causal
        return bool(self.causal.get(group_index, True))

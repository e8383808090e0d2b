"""Records and protocols shared by the core and the platform plugins.

* :class:`CommonBatchMetadata` plays the role of vLLM's ``CommonAttentionMetadata``: everything
  a native metadata builder needs to describe one paged attention call over several rows.
* :class:`LayerGeometry`, :class:`KVWritePolicy`, :class:`MetadataBuilder` and
  :class:`PagedAttentionBackend` are the parts of the plugin contract the core itself calls;
  ``platforms.interface`` re-exports them next to the ``Platform`` base class.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

KVCache = torch.Tensor | tuple[torch.Tensor, ...]
"""A layer's KV cache: one tensor or a tuple (e.g. separate K and V caches)."""


class KVWritePolicy(enum.Enum):
    """Who writes a layer's new K/V into the pages."""

    PREWRITE = "prewrite"
    """The core writes the whole span once per layer (``backend.write_kv``) before attention;
    the backend's ``forward`` then reads K/V from the cache only (``key``/``value`` are None)."""
    BACKEND_WRITES = "backend_writes"
    """The backend writes the K/V it is given inside ``forward``; under piecewise attention
    each segment call receives only its own tokens, so every token is written exactly once."""


@dataclass(frozen=True)
class LayerGeometry:
    """Rank-local shape of one paged attention layer, as the backend sees it."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    dtype: torch.dtype
    causal: bool = True


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
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    """Host copy of ``dcp_local_seq_lens`` (computed on the host, never read back)."""

    def causal_for_group(self, group_index: int) -> bool:
        if isinstance(self.causal, bool):
            return self.causal
        return bool(self.causal.get(group_index, True))


@runtime_checkable
class MetadataBuilder(Protocol):
    """Turns a :class:`CommonBatchMetadata` into native metadata per layer name.

    ``reorder_batch_threshold``: when not None, the native kernel expects rows whose
    ``query_len`` is at most the threshold ("decode" rows) before longer rows; the translator
    enforces this order at preparation time for causal groups.
    """

    reorder_batch_threshold: int | None

    def build(self, batch: CommonBatchMetadata) -> Mapping[str, Any]: ...


@runtime_checkable
class PagedAttentionBackend(Protocol):
    """One layer's native paged attention.

    ``write_kv`` writes ``key``/``value`` (``[T, Hkv, D]``) into ``kv_cache`` at
    ``slot_mapping`` (``[T]``; ``-1`` entries are skipped). ``forward`` computes attention for
    ``query`` (``[T, H, D]``) over the row's pages described by ``metadata`` into ``out`` (or a
    new tensor) and returns it; with :attr:`KVWritePolicy.PREWRITE` the core passes ``None``
    for ``key`` and ``value``.
    """

    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class PartialAttentionBackend(PagedAttentionBackend, Protocol):
    """A paged backend that can serve decode context parallelism (DCP).

    ``forward_partial`` attends ``query`` over the keys this rank holds (the metadata carries the
    rank-local lengths) and returns the output, softmax-normalised over those keys, together
    with its ``[T, H]`` float32 log-sum-exp (``-inf`` where no local key is visible). The core
    merges the partials of every DCP rank by log-sum-exp.
    """

    def forward_partial(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

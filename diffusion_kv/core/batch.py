"""Records shared by the core and the paged backends.

* :class:`LayerGeometry` — one paged layer's rank-local shape, as a backend sees it;
* :class:`PagedBatch` — one batch of rows for one KV-cache group: what a backend's ``build``
  turns into its native metadata (the role of vLLM's ``CommonAttentionMetadata``);
* :class:`CommonBatchMetadata` — the translator's record for every group at once; it hands
  each group's backend ``batch.for_group(g)``.

A worked example (block size 4, one KV-cache group, two rows): row 0 has 6 keys and queries
its last 2 tokens, row 1 has 9 keys and queries all of them::

    num_reqs=2  num_tokens=11  max_query_len=9  max_seq_len=9
    query_start_loc = [0, 2, 11]          seq_lens = [6, 9]
    positions       = [4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    block_table     = [[0, 1, 0], [2, 3, 4]]      (row 1's blocks are 2, 3, 4)
    slot_mapping    = [4, 5, 8, 9, 10, 11, 12, 13, 14, 15, 16]   (block * 4 + offset)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffusion_kv.core.attention import AttentionMode, BlockPlan, MaskSpec
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.kv_quant import QUANTIZED_CACHE_DTYPES, KVScales, quantize

KVCache = torch.Tensor | tuple[torch.Tensor, ...]
"""A layer's KV cache: one tensor or a tuple (e.g. separate K and V caches)."""


def key_value_caches(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches of a layer cache that is either one stacked ``[2, ...]``
    tensor or a ``(key_cache, value_cache)`` pair (views; nothing is copied)."""
    if isinstance(kv_cache, torch.Tensor):
        key_cache, value_cache = kv_cache.unbind(0)  # one op for both views
        return key_cache, value_cache
    key_cache, value_cache = kv_cache
    return key_cache, value_cache


def write_pages(
    cache: torch.Tensor,
    slots: torch.Tensor,
    src: torch.Tensor,
    scale: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
) -> None:
    """Write ``src`` ``[T, ...]`` into ``cache`` ``[blocks, page, ...]`` at flat slots
    ``block * page + offset``, every one of them real (``>= 0``): one indexed copy when the
    pages flatten in place, else an indexed assignment by (block, offset). No host sync.
    A quantised cache (e4m3) takes ``src / scale`` (``scale [Hkv]``), saturations counted into
    ``counter``; its bytes are copied as ``uint8`` (indexed copies of float8 are not served
    everywhere)."""
    nb, page = cache.shape[0], cache.shape[1]
    if slots.dtype != torch.long:
        slots = slots.long()
    if cache.dtype in QUANTIZED_CACHE_DTYPES:
        if scale is None:
            raise ValidationError(f"writing {cache.dtype} pages needs the layer's scales")
        src = quantize(src, scale, counter).view(torch.uint8)
        cache = cache.view(torch.uint8)
    src = src.to(cache.dtype)
    if cache.stride(0) == page * cache.stride(1):
        cache.view(nb * page, *cache.shape[2:]).index_copy_(0, slots, src)
    else:
        cache[slots // page, slots % page] = src


@dataclass(frozen=True)
class LayerGeometry:
    """Rank-local shape of one paged attention layer, as the backend sees it."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    dtype: torch.dtype
    mode: AttentionMode = AttentionMode.CAUSAL
    """The mask's kind (CAUSAL, FULL or CHUNK_CAUSAL): how the layer attends when no spans
    refine it; always ``mask.kind``."""
    cache_dtype: torch.dtype | None = None
    """The pages' dtype when it differs from ``dtype`` (``float8_e4m3fn``); None: ``dtype``."""
    kv_scales: KVScales | None = field(default=None, compare=False, repr=False)
    """Per-KV-head ``k_scale``/``v_scale`` of a quantised cache (``diffusion_kv.core.kv_quant``)."""
    mask: MaskSpec = field(default=None)  # type: ignore[assignment]
    """What the layer attends to (``diffusion_kv.core.attention.MaskSpec``); None at
    construction: the plain mask of ``mode``."""

    def __post_init__(self) -> None:
        if self.mask is None:
            object.__setattr__(self, "mask", MaskSpec.of(self.mode))
        elif not isinstance(self.mask, MaskSpec):
            raise ValidationError(f"LayerGeometry.mask must be a MaskSpec; got {self.mask!r}")
        elif self.mode is not self.mask.kind:
            if self.mode is not AttentionMode.CAUSAL:
                raise ValidationError(
                    f"layer {self.layer_name!r}: mode {self.mode.name} disagrees with its mask {self.mask.describe()}"
                )
            object.__setattr__(self, "mode", self.mask.kind)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the layer's pages hold."""
        return self.cache_dtype if self.cache_dtype is not None else self.dtype


@dataclass(frozen=True)
class PagedBatch:
    """One batch of paged rows for one KV-cache group (see the module's worked example).

    Device tensors live on the worker device; ``*_cpu`` tensors are host copies made when the
    batch was prepared (reading them never synchronises with the device).
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32 cumulative query lengths (device)."""
    query_start_loc_cpu: torch.Tensor
    max_query_len: int
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32 keys each row attends over, this call's write included (device)."""
    seq_lens_cpu: torch.Tensor
    max_seq_len: int
    positions: torch.Tensor
    """``[num_tokens]`` int64 absolute position of every query token (device)."""
    block_table: torch.Tensor
    """``[num_reqs, width]`` int32 kernel block ids; entries past a row's blocks are 0."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` slot (``kernel_block * kernel_block_size + offset``) of every query
    token, in the BlockTables' slot dtype; ``-1`` where nothing may be written."""
    mode: AttentionMode
    """The mask's kind for this call: CAUSAL (bottom-right aligned) or FULL for a plain layer's
    (piecewise) segment, or the group's own kind (CHUNK_CAUSAL)."""
    dcp_local_seq_lens: torch.Tensor | None = None
    """Under decode context parallelism, the keys of each row this rank holds (device)."""
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    block_plan: BlockPlan | None = None
    """For a group whose mask is not plain (chunk, window or sink): per row, which kv-blocks its
    queries skip, read in full or partially, in kernel blocks (built once at prepare). Skipped
    blocks may be released (their table entries are then the null entry, block 0): a backend
    that declares ``max_window``/``max_sink`` reads only the live blocks."""
    host_block_ids: tuple[tuple[int, ...], ...] = ()
    """Per row, its scheduler block ids on the host (before the kernel-block split: scheduler
    block ``b`` is kernel blocks ``b * r .. b * r + r - 1``, ``r = block_size //
    kernel_block_size``); lets a backend plan by placement (e.g. read a contiguous run as a
    view) without reading the device table."""

    @property
    def causal(self) -> bool:
        return self.mode is AttentionMode.CAUSAL


@dataclass(frozen=True)
class CommonBatchMetadata:
    """One batch of rows for every KV-cache group (the translator's record)."""

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    max_query_len: int
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_seq_len: int
    positions: torch.Tensor
    block_tables: tuple[torch.Tensor, ...]
    """Per KV-cache group, ``[num_reqs, width]`` int32 kernel block ids (device)."""
    slot_mappings: torch.Tensor
    """``[num_groups, num_tokens]`` slot of every query token, ``-1`` where nothing is written."""
    modes: tuple[AttentionMode, ...]
    """Per KV-cache group, its mask's kind."""
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    block_plans: tuple[BlockPlan | None, ...] = ()
    """Per KV-cache group, its block plan (None for a plain mask)."""
    host_block_ids: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Per KV-cache group, per row, the scheduler block ids (host)."""

    def for_group(self, group: int) -> PagedBatch:
        return PagedBatch(
            num_reqs=self.num_reqs,
            num_tokens=self.num_tokens,
            query_start_loc=self.query_start_loc,
            query_start_loc_cpu=self.query_start_loc_cpu,
            max_query_len=self.max_query_len,
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens_cpu,
            max_seq_len=self.max_seq_len,
            positions=self.positions,
            block_table=self.block_tables[group],
            slot_mapping=self.slot_mappings[group],
            mode=self.modes[group],
            dcp_local_seq_lens=self.dcp_local_seq_lens,
            dcp_local_seq_lens_cpu=self.dcp_local_seq_lens_cpu,
            block_plan=self.block_plans[group] if self.block_plans else None,
            host_block_ids=self.host_block_ids[group] if self.host_block_ids else (),
        )

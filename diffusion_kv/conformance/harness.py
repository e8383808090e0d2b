"""A small end-to-end wiring of one platform's parts, for the conformance kit.

It builds exactly what a worker builds (layout, the platform's BlockTables class, registry,
translator, the platform's metadata builder, per-layer backends and KV caches) and lets a case
install rows with a chosen physical block placement, run layers, and inspect call counts.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.batch import KVCache, LayerGeometry, PagedAttentionBackend
from diffusion_kv.core.execute import PagedExecutor
from diffusion_kv.core.layout import cdiv, single_group_layout
from diffusion_kv.core.registry import RowRegistry
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.translate import Translator
from diffusion_kv.platforms.interface import Platform


class CountingBackend:
    """Wraps a backend and records every write and forward call (``key is None`` or not)."""

    def __init__(self, inner: PagedAttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.writes: list[int] = []
        self.forwards: list[tuple[int, bool]] = []

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
    ) -> None:
        self.writes.append(int(key.shape[0]))
        self.inner.write_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.forwards.append((int(query.shape[0]), key is not None))
        return self.inner.forward(query, key, value, kv_cache, metadata, out)


@dataclass
class PagedHarness:
    platform: Platform
    num_heads: int = 4
    num_kv_heads: int = 4
    head_size: int = 64
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    num_blocks: int = 64
    max_model_len: int = 256
    max_rows_per_request: int = 4
    max_num_seqs: int = 2
    causal: bool = True
    layer_names: tuple[str, ...] = ("layer.0", "layer.1")
    slot_mapping_dtype: torch.dtype | None = None
    device: torch.device | None = None
    placement_seed: int = 0
    _next_block: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device) if self.device is not None else self.platform.device()
        self.layout = single_group_layout(
            self.layer_names,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            max_rows_per_request=self.max_rows_per_request,
            max_num_seqs=self.max_num_seqs,
            causal=self.causal,
        )
        cls = self.platform.block_tables_cls()
        kwargs: dict[str, Any] = dict(
            block_sizes=self.layout.block_sizes,
            max_num_reqs=self.layout.max_num_reqs,
            max_num_batched_tokens=self.layout.max_num_batched_tokens,
            max_num_blocks_per_group=self.layout.max_blocks_per_row(),
            device=self.device,
            kernel_block_sizes=self.layout.block_sizes,
            cp_size=1,
            cp_rank=0,
            cp_interleave=1,
        )
        if self.slot_mapping_dtype is not None:
            if "slot_mapping_dtype" not in inspect.signature(cls).parameters:
                raise TypeError(f"{cls.__name__} does not take slot_mapping_dtype")
            kwargs["slot_mapping_dtype"] = self.slot_mapping_dtype
        self.block_tables = cls(**kwargs)
        self.geometry = {
            name: LayerGeometry(
                layer_name=name,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                scale=self.head_size**-0.5,
                dtype=self.dtype,
                causal=self.causal,
            )
            for name in self.layer_names
        }
        self.translator = Translator(
            layout=self.layout,
            block_tables=self.block_tables,
            builder=self.platform.metadata_builder(
                self.layout, self.block_tables, list(self.geometry.values()), self.device
            ),
            rows=None,
            device=self.device,
            platform_name=self.platform.name,
        )
        self.registry = RowRegistry(
            self.layout, self.block_tables, before_mutation=self.translator.invalidate
        )
        self.translator.rows = self.registry
        self.backends = {
            name: CountingBackend(self.platform.paged_backend(geom, self.device))
            for name, geom in self.geometry.items()
        }
        self.kv_caches = {
            name: self.platform.allocate_kv_cache(
                self.num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.dtype, self.device
            )
            for name in self.layer_names
        }
        self.executor = PagedExecutor(
            self.translator,
            self.geometry,
            self.backends,
            self.kv_caches,
            self.platform.kv_write_policy,
            platform_name=self.platform.name,
        )
        gen = torch.Generator().manual_seed(self.placement_seed)
        self._block_order = torch.randperm(self.num_blocks, generator=gen).tolist()

    def take_blocks(self, n: int, placement: str) -> list[int]:
        """``n`` block ids: ``contiguous`` (0, 1, 2...), ``reversed`` or ``permuted`` (shuffled)."""
        start = self._next_block
        if start + n > self.num_blocks:
            raise ValueError(f"harness out of blocks: {start + n} > {self.num_blocks}")
        self._next_block += n
        if placement == "contiguous":
            return list(range(start, start + n))
        if placement == "reversed":
            return [self.num_blocks - 1 - b for b in range(start, start + n)]
        if placement == "permuted":
            return self._block_order[start : start + n]
        raise ValueError(f"unknown placement {placement!r}")

    def install(
        self, request_id: str, seq_lens: Sequence[int], placement: str = "permuted", generation: int = 0
    ) -> RequestAllocation:
        seqs = tuple(
            SequenceAllocation(
                sequence_id=i,
                prefix_len=0,
                target_len=n,
                seq_len=n,
                block_ids=(tuple(self.take_blocks(cdiv(n, self.block_size), placement)),),
            )
            for i, n in enumerate(seq_lens)
        )
        snapshot = RequestAllocation(request_id, generation, seqs)
        self.registry.install(snapshot)
        return snapshot

    def cache_snapshot(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for cache in self.kv_caches.values():
            tensors = cache if isinstance(cache, tuple) else (cache,)
            out.extend(t.detach().clone() for t in tensors)
        return out

    def writes(self) -> int:
        return sum(len(b.writes) for b in self.backends.values())

    def prefill(
        self,
        request_id: str,
        seq_lens: Sequence[int],
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        seed: int = 0,
    ) -> None:
        """Write the whole sequence of rows ``0..len(seq_lens)-1`` through every layer (the
        prefill step), so later batches may read those pages; counts restart from zero.

        ``kv[i]`` is row ``i``'s ``(key, value)`` of shape ``[seq_len, Hkv, D]``; random when
        omitted."""
        rows = tuple(PagedRow(request_id, n, n, 0, sequence_id=i) for i, n in enumerate(seq_lens))
        total = sum(seq_lens)
        gen = torch.Generator().manual_seed(seed)
        if kv is None:
            shape = (total, self.num_kv_heads, self.head_size)
            key, value = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        else:
            key, value = torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])
        query = torch.randn(total, self.num_heads, self.head_size, generator=gen)
        device, dtype = self.device, self.dtype
        q, k, v = (t.to(device=device, dtype=dtype) for t in (query, key, value))
        batch = self.translator.prepare(rows)
        with self.translator.activate(batch):
            for name in self.layer_names:
                self.executor.forward(name, q, k, v)
        self.reset_counts()

    def reset_counts(self) -> None:
        """Forget the recorded writes and forwards (after a setup step)."""
        for backend in self.backends.values():
            backend.writes.clear()
            backend.forwards.clear()

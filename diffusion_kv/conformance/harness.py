"""A worker built the way a real one is, for the conformance kit.

:class:`PagedHarness` builds a :class:`~diffusion_kv.core.runner.PagedWorker` for one
platform (``backend_choice`` names the one under test; without it the platform's priority list
chooses), lets a case install rows with a chosen physical block placement,
run layers, and inspect every K/V write and attention call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.attention import AttentionMode, MaskSpec
from diffusion_kv.core.backend import BackendChoice, LayerRunner, PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.parallel import PartialMerger
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.interface import Platform


class CountingBackend(PagedBackend):
    """Wraps a backend instance and records every K/V write (tokens) and attention call.

    Transparent to the backend's own paths: the core reaches the inner backend's
    ``write_kv_valid``, ``bind_layer`` / ``bind_layer_like`` (a runner it returns is counted as
    one write and one attention call per call), ``forward_partial_extra`` and
    ``forward_extra_keys`` through it, so the kit checks what the backend runs in service, not
    only its general ``write_kv`` and ``forward``."""

    name = "counting"

    def __init__(self, inner: PagedBackend) -> None:  # no super().__init__: a transparent proxy
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.capabilities = type(inner).capabilities  # type: ignore[misc]
        self.group = inner.group
        self.reorder_batch_threshold = inner.reorder_batch_threshold
        self.writes: list[int] = []
        self.forwards: list[int] = []
        self.partials: list[int] = []

    def build(self, batch: Any) -> Any:
        return self.inner.build(batch)

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        self.writes.append(int(key.shape[0]))
        self.inner.write_kv(layer, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.forwards.append(int(query.shape[0]))
        return self.inner.forward(layer, query, kv_cache, metadata, out)

    def forward_partial(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.partials.append(int(query.shape[0]))
        return self.inner.forward_partial(layer, query, kv_cache, metadata)

    def write_kv_valid(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        self.writes.append(int(key.shape[0]))
        self.inner.write_kv_valid(layer, key, value, kv_cache, slot_mapping)

    def forward_partial_extra(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        extra_query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.partials.append(int(query.shape[0] + extra_query.shape[0]))
        return self.inner.forward_partial_extra(layer, query, extra_query, kv_cache, metadata)

    def forward_extra_keys(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        extra_query: torch.Tensor,
        extra_key: torch.Tensor,
        extra_value: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = self.inner.forward_extra_keys(
            layer, query, extra_query, extra_key, extra_value, kv_cache, metadata
        )
        if out is not None:
            self.partials.append(int(query.shape[0] + extra_query.shape[0]))
        return out

    def _counted(self, run: LayerRunner | None) -> LayerRunner | None:
        if run is None:
            return None

        def counted(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            self.writes.append(int(key.shape[0]))
            self.forwards.append(int(query.shape[0]))
            return run(query, key, value)

        return counted

    def bind_layer(
        self, layer: LayerGeometry, kv_cache: KVCache, metadata: Any, slot_mapping: torch.Tensor
    ) -> LayerRunner | None:
        return self._counted(self.inner.bind_layer(layer, kv_cache, metadata, slot_mapping))

    def bind_layer_like(
        self,
        layer: LayerGeometry,
        kv_cache: KVCache,
        metadata: Any,
        slot_mapping: torch.Tensor,
        like: LayerGeometry,
        like_kv_cache: KVCache,
    ) -> LayerRunner | None:
        return self._counted(
            self.inner.bind_layer_like(layer, kv_cache, metadata, slot_mapping, like, like_kv_cache)
        )


class CapturePartials:
    """A DCP merger for one rank that keeps its partials (``(output, lse)``) instead of merging."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def merge(self, output: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        self.parts.append((output, lse))
        return output


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
    mode: AttentionMode | MaskSpec = AttentionMode.CAUSAL
    """The layers' mask: a plain kind or a parametrised ``MaskSpec``."""
    layer_names: tuple[str, ...] = ("layer.0", "layer.1")
    slot_mapping_dtype: torch.dtype | None = None
    device: torch.device | None = None
    placement_seed: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    dcp_merger: PartialMerger | None = None
    kv_cache_dtype: torch.dtype | str = "auto"
    backend_choice: BackendChoice = None
    """The backend under test (None: the platform's priority list picks)."""
    k_scale: float | Sequence[float] = 1.0
    v_scale: float | Sequence[float] = 1.0
    _next_block: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device) if self.device is not None else self.platform.device()
        self.runner = PagedWorker(
            self.platform,
            RunnerConfig(
                max_model_len=self.max_model_len,
                max_rows_per_request=self.max_rows_per_request,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_model_len * self.max_rows_per_request * self.max_num_seqs,
                device=self.device,
                cp_size=self.cp_size,
                cp_rank=self.cp_rank,
                cp_interleave=self.cp_interleave,
                slot_mapping_dtype=self.slot_mapping_dtype,
                kv_cache_dtype=self.kv_cache_dtype,
                backend=self.backend_choice,
            ),
            dcp_merger=self.dcp_merger,
        )
        spec = PagedLayerSpec(
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.dtype,
            mode=self.mode,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        self.runner.register_kv_cache_layers({name: spec for name in self.layer_names})
        self.layout = self.runner.initialize_kv_cache(num_blocks=self.num_blocks, block_size=self.block_size)
        runner = self.runner
        assert runner.registry is not None and runner.translator is not None and runner.executor is not None
        assert runner.block_tables is not None
        self.block_tables = runner.block_tables
        self.registry = runner.registry
        self.translator = runner.translator
        self.executor = runner.executor
        self.kv_caches = runner.kv_caches
        self.backend = runner.backends[0]
        """The backend instance under test (KV-cache group 0)."""
        self.geometry = dict(runner.layers)
        self.backends: dict[str, CountingBackend] = {}
        for name, inner in list(self.executor.backends.items()):
            self.backends[name] = CountingBackend(inner)
            self.executor.backends[name] = self.backends[name]
        gen = torch.Generator().manual_seed(self.placement_seed)
        self._block_order = torch.randperm(self.num_blocks, generator=gen).tolist()
        self._taken: set[int] = set()

    @property
    def kernel_block_size(self) -> int:
        return self.backend.group.kernel_block_size

    def take_blocks(self, n: int, placement: str) -> list[int]:
        """``n`` block ids: ``contiguous`` (0, 1, 2...), ``reversed`` or ``permuted`` (shuffled)."""
        start = self._next_block
        if start + n > self.num_blocks:
            raise ValueError(f"harness out of blocks: {start + n} > {self.num_blocks}")
        if placement == "contiguous":
            ids = list(range(start, start + n))
        elif placement == "reversed":
            ids = [self.num_blocks - 1 - b for b in range(start, start + n)]
        elif placement == "permuted":
            ids = self._block_order[start : start + n]
        else:
            raise ValueError(f"unknown placement {placement!r}")
        taken = self._taken.intersection(ids)
        if taken:  # placements mixed in one harness may meet (reversed ids are permuted ones too)
            raise ValueError(f"harness placement {placement!r} gives blocks {sorted(taken)} out twice")
        self._next_block += n
        self._taken.update(ids)
        return ids

    def install(
        self, request_id: str, seq_lens: Sequence[int], placement: str = "permuted", generation: int = 0
    ) -> RequestAllocation:
        tokens_per_block = self.block_size * self.cp_size
        seqs = tuple(
            SequenceAllocation(
                sequence_id=i,
                prefix_len=0,
                target_len=n,
                seq_len=n,
                block_ids=(tuple(self.take_blocks(cdiv(n, tokens_per_block), placement)),),
            )
            for i, n in enumerate(seq_lens)
        )
        snapshot = RequestAllocation(request_id, generation, seqs)
        self.registry.install(snapshot)
        return snapshot

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

    def cache_snapshot(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for cache in self.kv_caches.values():
            tensors = cache if isinstance(cache, tuple) else (cache,)
            out.extend(t.detach().clone() for t in tensors)
        return out

    def writes(self) -> int:
        return sum(len(b.writes) for b in self.backends.values())

    def reset_counts(self) -> None:
        """Forget the recorded writes and attention calls (after a setup step)."""
        for backend in self.backends.values():
            backend.writes.clear()
            backend.forwards.clear()
            backend.partials.clear()

"""BlockTables for the CUDA tier: the core torch implementation with the per-batch work done by
Triton kernels and no host synchronisation.

``prepare_batch`` (the hook ``Translator.prepare`` calls) stages the batch's per-row integers
through a persistent pinned buffer into a persistent device buffer (one host-to-device copy)
and fills persistent positions / slot-mapping / block-table buffers with one fused launch per
KV-cache group. A batch shape (rows, tokens, query chunks) seen a second time is captured once as
a CUDA graph of that copy and those launches and replayed afterwards: the copy reads the pinned
buffer's contents at replay, so only the host-side launch cost changes (one graph launch instead
of a copy and a Triton launch per group). ``gather_block_tables`` and ``compute_slot_mappings``
stay available for direct callers (one launch each per group)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import NamedTuple

import torch

from diffusion_kv.core.block_tables import DeviceBatch, HostBatch, TorchBlockTables
from diffusion_kv.core.transfer import pinned_memory_available


class _RowViews(NamedTuple):
    """Views of the staging buffers for a batch of ``n`` rows (cached per ``n``)."""

    host: torch.Tensor  # [4n + 1] of the pinned host buffer
    meta: torch.Tensor  # [4n + 1] of the device buffer
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    row_indices: torch.Tensor
    tables: tuple[torch.Tensor, ...]  # per group [n, width] of the gathered tables


class _TokenViews(NamedTuple):
    """Views of the output buffers for a batch of ``num_tokens`` tokens (cached per size)."""

    positions: torch.Tensor  # [num_tokens]
    slots: torch.Tensor  # [groups, num_tokens]
    group_slots: tuple[torch.Tensor, ...]  # slots[g]


TOKEN_VIEWS_CACHED = 64
"""Batch token counts whose output views a BlockTables keeps (the oldest is dropped first)."""
PREPARE_GRAPHS_CACHED = 16
"""Prepare graphs (one per batch shape) a BlockTables keeps (the oldest is dropped first)."""


class _BatchBuffers:
    """Persistent buffers behind ``prepare_batch``, sized from the BlockTables' capacities.

    ``host`` (pinned on CUDA) and ``meta`` (device) hold ``[query_start_loc (n+1) | seq_lens (n)
    | row_indices (n) | kv_start_pos (n)]`` int32 for ``n <= max_num_reqs`` rows; ``positions``,
    ``slots`` (``[groups * num_tokens]``, viewed ``[groups, num_tokens]``) and ``tables`` (per group
    ``[max_num_reqs, width]``) are the fused kernel's outputs. A batch gets views of them, so the
    same batch shape always gets the same addresses (what CUDA-graph replay needs).
    """

    def __init__(self, bt: TritonBlockTables, num_reqs: int, num_tokens: int) -> None:
        device = bt.device
        if device.type == "cuda" and device.index is None:
            device = torch.empty(0, device=device).device
        self.max_num_reqs = max_reqs = max(bt.max_num_reqs, num_reqs)
        self.max_num_tokens = max_tokens = max(bt.max_num_batched_tokens, num_tokens)
        capacity = 4 * max_reqs + 1
        pin = device.type == "cuda" and pinned_memory_available()
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.meta = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slots = torch.zeros(
            bt.num_kv_cache_groups * max_tokens, dtype=bt.slot_mapping_dtype, device=device
        )
        self.tables = tuple(
            torch.zeros((max_reqs, table.width), dtype=torch.int32, device=device)
            for table in bt.block_tables
        )
        self.device = device
        # The host buffer is reused by every preparation while the previous non-blocking copy
        # out of it may still be queued behind earlier GPU work. One event, recorded after each
        # copy and waited on before the host buffer is written again, keeps that safe; the wait
        # only blocks when the GPU has not yet reached the *previous* preparation's copy, which
        # the stream orders before that batch's own forward work. A second buffer would only
        # move the rare stall one preparation later, so one buffer it is.
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.copy_pending = False
        self.counts = tuple(bt.num_blocks.gpu[g] for g in range(bt.num_kv_cache_groups))
        self.views: dict[int, _RowViews] = {}
        self.token_views: dict[int, _TokenViews] = {}
        self.shapes_seen: set[tuple[int, int, int]] = set()
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}

    def views_for(self, n: int) -> _RowViews:
        views = self.views.get(n)
        if views is None:
            size = 4 * n + 1
            meta = self.meta[:size]
            qsl, seq, rows, _ = torch.split(meta, [n + 1, n, n, n])
            tables = tuple(t[:n] for t in self.tables)
            views = self.views[n] = _RowViews(self.host[:size], meta, qsl, seq, rows, tables)
        return views

    def token_views_for(self, num_tokens: int) -> _TokenViews:
        views = self.token_views.get(num_tokens)
        if views is None:
            groups = len(self.counts)
            slots = self.slots[: groups * num_tokens].view(groups, num_tokens)
            views = _TokenViews(self.positions[:num_tokens], slots, tuple(slots))
            if len(self.token_views) >= TOKEN_VIEWS_CACHED:
                del self.token_views[next(iter(self.token_views))]
            self.token_views[num_tokens] = views
        return views


def _may_capture(device: torch.device) -> bool:
    """A prepare graph is captured on CUDA only, never inside someone else's capture."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def _capture(launch: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """``launch`` (a copy from pinned memory and kernels) captured on a side stream; nothing
    runs during the capture itself, so the caller replays it once for this batch."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    # The garbage collector stays off while the capture runs: a collection there destroys
    # whatever unreachable objects hold (a pinned host tensor's free queries CUDA events, an
    # earlier graph's destruction), which a capture forbids, and the capture is lost ("operation
    # not permitted when stream is capturing"; seen on an H100 under load). Unlike the step
    # capture (core.graphs) nothing is collected first: this capture is small and frequent.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            launch()
    finally:
        if was_enabled:
            gc.enable()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


class TritonBlockTables(TorchBlockTables):
    retains_batches = False  # prepare_batch fills persistent buffers: a new batch overwrites the last
    _buffers: _BatchBuffers | None = None

    def init_block_table_layout_tensors(self) -> None:
        super().init_block_table_layout_tensors()
        self._buffers = None  # they hold views of num_blocks; made again at the next batch

    def prepare_batch(self, host: HostBatch) -> DeviceBatch:
        """Positions, slots and gathered tables for one batch: one host-to-device copy and one
        fused launch per KV-cache group, into persistent buffers (the returned tensors are views
        that the next call overwrites; see :meth:`TorchBlockTables.prepare_batch`)."""
        from diffusion_kv.platforms.cuda import kernels

        n, num_tokens = host.num_reqs, host.num_tokens
        buffers = self._buffers
        if buffers is None or n > buffers.max_num_reqs or num_tokens > buffers.max_num_tokens:
            # first use, or the capacities grew since: size the buffers again (batches holding
            # views of the old ones keep them alive)
            buffers = self._buffers = _BatchBuffers(self, n, num_tokens)
        views = buffers.views_for(n)
        if buffers.copy_pending:
            assert buffers.copied is not None
            buffers.copied.synchronize()  # the previous copy out of the host buffer is done
        buffers.host_np[: 4 * n + 1] = host.packed.numpy()
        out = buffers.token_views_for(num_tokens)
        tables = views.tables

        def stage_and_launch() -> None:
            views.meta.copy_(views.host, non_blocking=True)
            for g, table in enumerate(self.block_tables):
                kernels.prepare_batch(
                    buffers.meta,
                    table.gpu,
                    buffers.counts[g],
                    tables[g],
                    out.positions,
                    out.group_slots[g],
                    num_reqs=n,
                    max_query_len=host.max_query_len,
                    block_size=self.block_sizes[g],
                    kernel_block_size=self.kernel_block_sizes[g],
                    cp_size=self.cp_size,
                    cp_rank=self.cp_rank,
                    cp_interleave=self.cp_interleave,
                    write_positions=g == 0,
                )

        shape = (n, num_tokens, kernels.prepare_chunks(host.max_query_len))
        graph = buffers.graphs.get(shape)
        if graph is not None:
            graph.replay()
        elif shape in buffers.shapes_seen and _may_capture(buffers.device):
            graph = _capture(stage_and_launch, buffers.device)
            if len(buffers.graphs) >= PREPARE_GRAPHS_CACHED:
                del buffers.graphs[next(iter(buffers.graphs))]
            buffers.graphs[shape] = graph
            graph.replay()
        else:
            buffers.shapes_seen.add(shape)
            stage_and_launch()
        if buffers.copied is not None:
            buffers.copied.record(torch.cuda.current_stream(buffers.device))
            buffers.copy_pending = True
        return DeviceBatch(
            views.query_start_loc, views.seq_lens, views.row_indices, out.positions, tables, out.slots
        )

    def gather_block_tables(
        self, idx_mapping: torch.Tensor, num_reqs_padded: int
    ) -> tuple[torch.Tensor, ...]:
        from diffusion_kv.platforms.cuda import kernels

        idx = idx_mapping.to(device=self.device, dtype=torch.int32)
        return tuple(
            kernels.gather_block_table(table.gpu, self.num_blocks.gpu[g], idx, num_reqs_padded)
            for g, table in enumerate(self.block_tables)
        )

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> torch.Tensor:
        from diffusion_kv.platforms.cuda import kernels

        idx = idx_mapping.to(device=self.device, dtype=torch.int32)
        qsl = query_start_loc.to(device=self.device, dtype=torch.int32)
        out = torch.empty(
            (self.num_kv_cache_groups, num_tokens_padded), dtype=self.slot_mapping_dtype, device=self.device
        )
        for g, table in enumerate(self.block_tables):
            kernels.compute_slots(
                table.gpu,
                self.num_blocks.gpu[g],
                idx,
                qsl,
                positions,
                out[g],
                block_size=self.block_sizes[g],
                kernel_block_size=self.kernel_block_sizes[g],
                cp_size=self.cp_size,
                cp_rank=self.cp_rank,
                cp_interleave=self.cp_interleave,
            )
        return out

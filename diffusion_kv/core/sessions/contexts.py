"""Cross-attention contexts of sessions (text, image, action): paged KV of their own.

A :class:`SessionContexts` runs on a worker of its own whose layers are the model's
cross-attention layers, all FULL attention (non-causal, no spans, no window), and its own
allocator. A context is one request on that worker, one row per CFG branch, ``tokens`` long:

* ``set(session_id, name, tokens, branches)`` reserves and installs it and returns its rows; the
  host runs one forward over them (each cross-attention layer's K/V projections of the context;
  the attention output of that pass is not needed) -- write-once: a second ``set`` of a live
  name is a :class:`StateError` (a re-cache stages a new one instead, :meth:`stage`);
* ``attend(session_id, name, layer, q)`` -- a denoise step's cross-attention over the context's
  pages: the worker's own backend runs FULL attention over the context rows (one row per
  branch, batched), reading the pages in place -- no write, no K/V copied out per step (the
  backend decides how it reads: the cpu reference gathers per row, ``sdpa`` views a contiguous
  run). Its native metadata is built once per (context, query length) by :meth:`reader` and
  reused by every layer and step while the context lives; ``reader`` also batches several
  sessions' contexts into one call per layer;
* ``kv(session_id, name, layer, branch)`` gathers the context's K/V pages of one layer (a copy;
  for a host that runs its own attention), refused until every layer wrote every token; the
  device index of its blocks is made at the first read and reused until the context is released;
* ``release`` / ``release_session`` return its blocks to the pool at once.

:class:`~diffusion_kv.core.sessions.cache.SessionCache` owns one (its ``contexts`` keyword) and
releases a session's contexts with the session.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_kv.core.allocator import DiffusionKVAllocator, KVRequest, SequenceRequest
from diffusion_kv.core.attention import AttentionMode, MaskSpec
from diffusion_kv.core.backend import KVPageLayout
from diffusion_kv.core.batch import PagedBatch, key_value_caches
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.kv_quant import QUANTIZED_CACHE_DTYPES
from diffusion_kv.core.registry import missing_spans
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedWorker

FULL = MaskSpec.of(AttentionMode.FULL)


@dataclass(frozen=True)
class ContextReader:
    """Cross-attention over the pages of some contexts, one call per layer: rows are every
    branch of each context in order, each with ``query_tokens`` queries (built by
    :meth:`SessionContexts.reader`; the native metadata of each KV-cache group, built once)."""

    owner: SessionContexts = field(repr=False, compare=False)
    contexts: tuple[Context, ...]
    query_tokens: int
    metadata: tuple[Any, ...] = field(repr=False, compare=False)
    """Per KV-cache group of the context worker, the backend's native metadata."""

    @property
    def num_rows(self) -> int:
        return sum(c.branches for c in self.contexts)

    @property
    def num_tokens(self) -> int:
        """Query tokens of one call: ``query_tokens`` per row, rows in order."""
        return self.num_rows * self.query_tokens

    def attend(self, layer: str, q: torch.Tensor) -> torch.Tensor:
        """``q`` ``[num_tokens, num_heads, head_size]`` (each row's queries, rows in order) over
        the contexts' K/V of ``layer``: ``[num_tokens, num_heads, head_size]``. Refused
        (:class:`StateError`) once a context was released or replaced."""
        return self.owner._attend(self, layer, q)


@dataclass(frozen=True)
class Context:
    """One written-once context: ``tokens`` keys per branch in request ``request_id``."""

    session_id: str
    name: str
    request_id: str
    tokens: int
    branches: int

    def rows(self) -> tuple[PagedRow, ...]:
        """One row per branch writing (and attending over) the whole context."""
        return tuple(
            PagedRow(self.request_id, self.tokens, self.tokens, 0, sequence_id=b)
            for b in range(self.branches)
        )


class SessionContexts:
    """Contexts of sessions on one FULL-attention worker and its allocator (module docstring)."""

    def __init__(self, worker: PagedWorker, allocator: DiffusionKVAllocator) -> None:
        if not isinstance(worker, PagedWorker) or worker.layout is None:
            raise ValidationError("SessionContexts takes a PagedWorker whose KV cache is initialised")
        if not isinstance(allocator, DiffusionKVAllocator):
            raise ValidationError(
                f"SessionContexts takes a DiffusionKVAllocator; got {type(allocator).__name__}"
            )
        others = [g.spec.mask.describe() for g in worker.layout.groups if g.spec.mask != FULL]
        if others:
            raise ValidationError(
                f"context layers attend with full attention (non-causal, no spans); the worker's attend with {others}"
            )
        if allocator.block_size != worker.layout.groups[0].block_size:
            raise ValidationError(
                f"allocator block size {allocator.block_size} differs from the worker's "
                f"{worker.layout.groups[0].block_size}"
            )
        self.worker = worker
        self.allocator = allocator
        self._live: dict[tuple[str, str], Context] = {}
        self._staged: dict[tuple[str, str], Context] = {}
        self._serial = 0
        self._readers: dict[tuple[str, str, int], ContextReader] = {}
        self._indices: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        """Per (context request, branch, device): its kernel-block index for :meth:`kv`."""
        self._complete: set[str] = set()
        """Context requests every branch of which was found fully written (until released)."""

    # -- writing -------------------------------------------------------------------------------

    def set(self, session_id: str, name: str, tokens: int, branches: int) -> Context | None:
        """Reserve and install a new context (write-once); None when the pool is short."""
        if (session_id, name) in self._live:
            raise StateError(
                f"context {name!r} of session {session_id!r} is written already (write-once; a re-cache replaces it)"
            )
        return self._reserve(session_id, name, tokens, branches, self._live)

    def stage(self, session_id: str, name: str, tokens: int, branches: int) -> Context | None:
        """A context that replaces ``name`` at :meth:`swap` (a re-cache's); None when short."""
        if (session_id, name) in self._staged:
            raise StateError(f"context {name!r} of session {session_id!r} is staged already")
        return self._reserve(session_id, name, tokens, branches, self._staged)

    def _reserve(
        self, session_id: str, name: str, tokens: int, branches: int, into: dict[tuple[str, str], Context]
    ) -> Context | None:
        if type(name) is not str or not name:
            raise ValidationError(f"a context name is a non-empty string; got {name!r}")
        if type(tokens) is not int or tokens <= 0:
            raise ValidationError(
                f"context {name!r} of session {session_id!r}: tokens must be a positive int; got {tokens!r}"
            )
        self._serial += 1
        rid = f"{session_id}/ctx/{name}/{self._serial}"
        request = KVRequest(rid, tuple(SequenceRequest(b, 0, tokens) for b in range(branches)))
        snapshot = self.allocator.reserve(request)  # AdmissionError: it can never fit
        if snapshot is None:
            return None
        try:
            self.worker.install(snapshot)
        except BaseException:
            self.allocator.free(rid)
            raise
        context = Context(session_id, name, rid, tokens, branches)
        into[(session_id, name)] = context
        return context

    def swap(self, session_id: str, names: Iterable[str]) -> None:
        """The staged contexts ``names`` become the live ones (the old ones released)."""
        for name in names:
            staged = self._staged.pop((session_id, name))
            old = self._live.pop((session_id, name), None)
            if old is not None:
                self._free(old)
            self._live[(session_id, name)] = staged

    def drop_staged(self, session_id: str) -> None:
        for key in [k for k in self._staged if k[0] == session_id]:
            self._free(self._staged.pop(key))

    # -- reading -------------------------------------------------------------------------------

    def get(self, session_id: str, name: str, *, staged: bool = False) -> Context:
        found = (self._staged if staged else self._live).get((session_id, name))
        if found is None:
            raise ValidationError(
                f"session {session_id!r} has no {'staged ' if staged else ''}context {name!r}"
            )
        return found

    def names(self, session_id: str) -> tuple[str, ...]:
        return tuple(n for s, n in self._live if s == session_id)

    def unwritten(self, context: Context) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
        """``(branch, token spans)`` of the context that no forward wrote yet."""
        gaps = []
        for b in range(context.branches):
            gap = missing_spans(self.worker.resolve(context.request_id, b).written, 0, context.tokens)
            if gap:
                gaps.append((b, gap))
        return gaps

    def written(self, session_id: str, name: str) -> Context:
        context = self.get(session_id, name)
        if context.request_id in self._complete:  # written spans only grow while it lives
            return context
        gaps = self.unwritten(context)
        if gaps:
            raise StateError(
                f"context {name!r} of session {session_id!r}: (branch, tokens) {gaps} were never written; run a "
                "forward over its rows first"
            )
        self._complete.add(context.request_id)
        return context

    def kv(
        self, session_id: str, name: str, layer: str, branch: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's keys and values of ``layer`` for ``branch``, ``[tokens, Hkv, D]`` each,
        gathered from its pages (fresh tensors)."""
        context = self.written(session_id, name)
        geometry = self.worker.layers.get(layer)
        if geometry is None:
            raise ValidationError(
                f"context worker has no layer {layer!r}; layers: {sorted(self.worker.layers)}"
            )
        if type(branch) is not int or not 0 <= branch < context.branches:
            raise ValidationError(
                f"context {name!r} of session {session_id!r} has branches [0, {context.branches}); got {branch!r}"
            )
        if geometry.cache_dtype in QUANTIZED_CACHE_DTYPES or self.worker.config.cp_size > 1:
            raise NotImplementedError(
                f"reading context {name!r} of layer {layer!r}: gathering fp8 pages or DCP-sharded pages is not implemented"
            )
        keys, values = key_value_caches(self.worker.kv_caches[layer])
        if self.worker.backends[0].page_layout is KVPageLayout.HEAD_FIRST:
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        kernel = self._kernel_index(context, branch, keys.device)
        shape = (-1, geometry.num_kv_heads, geometry.head_size)
        return (
            keys.index_select(0, kernel).reshape(shape)[: context.tokens],
            values.index_select(0, kernel).reshape(shape)[: context.tokens],
        )

    def _kernel_index(self, context: Context, branch: int, device: torch.device) -> torch.Tensor:
        """The kernel-block index of one branch of a written context on ``device``, made once
        and reused by every layer and forward while the context lives (its blocks never move:
        contexts are not offloaded); dropped when the context is released or replaced."""
        key = (context.request_id, branch, device)
        found = self._indices.get(key)
        if found is None:
            tables = self.worker.block_tables
            assert tables is not None
            ratio = tables.blocks_per_kv_block[0]
            ids = self.worker.resolve(context.request_id, branch).block_ids[0]
            index = torch.tensor([b * ratio + k for b in ids for k in range(ratio)], dtype=torch.long)
            found = self._indices[key] = index.to(device)
        return found

    def reader(self, contexts: Sequence[tuple[str, str]], query_tokens: int) -> ContextReader:
        """A cross-attention reader over the written contexts ``(session_id, name)`` (each
        branch a row, every row ``query_tokens`` queries): the native metadata is built here,
        once; :meth:`ContextReader.attend` then runs one backend call per layer over the pages."""
        if type(query_tokens) is not int or query_tokens <= 0:
            raise ValidationError(
                f"a context reader's query_tokens must be a positive int; got {query_tokens!r}"
            )
        if not contexts:
            raise ValidationError("a context reader needs at least one (session_id, name)")
        found = tuple(self.written(sid, name) for sid, name in contexts)
        worker = self.worker
        if worker.config.cp_size > 1 or worker.config.parallel.ulysses_degree > 1:
            raise NotImplementedError(
                "paged cross-attention reads under decode context parallelism or Ulysses sequence parallelism "
                f"(cp_size {worker.config.cp_size}, ulysses_degree {worker.config.parallel.ulysses_degree})"
            )
        tables, layout = worker.block_tables, worker.layout
        assert tables is not None and layout is not None
        rows = [(c, b) for c in found for b in range(c.branches)]
        if len(rows) > tables.max_num_reqs:
            raise ValidationError(
                f"a context reader over {len(rows)} rows exceeds the context worker's {tables.max_num_reqs} rows"
            )
        bindings = [worker.resolve(c.request_id, b) for c, b in rows]
        device = worker.device
        n, tokens = len(rows), len(rows) * query_tokens
        qsl = torch.arange(0, tokens + 1, query_tokens, dtype=torch.int32)
        seq = torch.tensor([c.tokens for c, _ in rows], dtype=torch.int32)
        metadata = []
        for g in range(len(layout.groups)):
            ratio = tables.blocks_per_kv_block[g]
            ids = [binding.block_ids[g] for binding in bindings]
            kernel = [[blk * ratio + k for blk in row for k in range(ratio)] for row in ids]
            table = torch.zeros(n, max(len(k) for k in kernel), dtype=torch.int32)
            for r, k in enumerate(kernel):
                table[r, : len(k)] = torch.tensor(k, dtype=torch.int32)
            batch = PagedBatch(
                num_reqs=n,
                num_tokens=tokens,
                query_start_loc=qsl.to(device),
                query_start_loc_cpu=qsl,
                max_query_len=query_tokens,
                seq_lens=seq.to(device),
                seq_lens_cpu=seq,
                max_seq_len=int(seq.max()),
                positions=torch.zeros(tokens, dtype=torch.long, device=device),
                block_table=table.to(device),
                slot_mapping=torch.full((tokens,), -1, dtype=tables.slot_mapping_dtype, device=device),
                mode=AttentionMode.FULL,
                host_block_ids=tuple(ids),
            )
            metadata.append(worker.backends[g].build(batch))
        return ContextReader(self, found, query_tokens, tuple(metadata))

    def attend(self, session_id: str, name: str, layer: str, q: torch.Tensor) -> torch.Tensor:
        """Cross-attention of ``q`` (``[branches * Lq, num_heads, head_size]``: each branch's
        ``Lq`` queries in branch order) over the context's pages of ``layer``, every branch in
        one backend call; the reader (native metadata) for ``Lq`` is built on first use and
        reused while the context lives."""
        context = self.get(session_id, name)
        if q.dim() != 3 or q.shape[0] % context.branches:
            raise ValidationError(
                f"context {name!r} of session {session_id!r}: q must be [branches * Lq, heads, head_size] with "
                f"{context.branches} branches; got {tuple(q.shape)}"
            )
        key = (session_id, name, q.shape[0] // context.branches)
        found = self._readers.get(key)
        if found is None or found.contexts[0] is not context:
            found = self._readers[key] = self.reader([(session_id, name)], key[2])
        return found.attend(layer, q)

    def _attend(self, reader: ContextReader, layer: str, q: torch.Tensor) -> torch.Tensor:
        for c in reader.contexts:
            if self._live.get((c.session_id, c.name)) is not c:
                raise StateError(
                    f"context {c.name!r} of session {c.session_id!r} was released or replaced since the reader "
                    "was built: build a new one"
                )
        geometry = self.worker.layers.get(layer)
        if geometry is None:
            raise ValidationError(
                f"context worker has no layer {layer!r}; layers: {sorted(self.worker.layers)}"
            )
        want = (reader.num_tokens, geometry.num_heads, geometry.head_size)
        if tuple(q.shape) != want or q.dtype != geometry.dtype:
            raise ValidationError(
                f"cross-attention of layer {layer!r}: q must be {list(want)} {geometry.dtype}; got "
                f"{list(q.shape)} {q.dtype}"
            )
        layout = self.worker.layout
        assert layout is not None
        g = next(i for i, grp in enumerate(layout.groups) if layer in grp.layer_names)
        return self.worker.backends[g].forward(
            geometry, q, self.worker.kv_caches[layer], reader.metadata[g], None
        )

    # -- release -------------------------------------------------------------------------------

    def release(self, session_id: str, name: str) -> None:
        self._free(self._live.pop((session_id, name)))

    def release_session(self, session_id: str, keep: Iterable[str] = ()) -> None:
        """Release every context of ``session_id`` (staged ones too) except the live ``keep``."""
        kept = set(keep)
        self.drop_staged(session_id)
        for key in [k for k in self._live if k[0] == session_id and k[1] not in kept]:
            self._free(self._live.pop(key))

    def _free(self, context: Context) -> None:
        for key in [k for k, r in self._readers.items() if context in r.contexts]:
            del self._readers[key]
        for index_key in [k for k in self._indices if k[0] == context.request_id]:
            del self._indices[index_key]
        self._complete.discard(context.request_id)
        self.worker.retire(context.request_id, self.allocator.generation)
        self.allocator.free(context.request_id)

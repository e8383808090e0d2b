"""Metadata translation: paged rows -> worker rows -> native attention metadata.

``Translator.prepare(rows)`` validates a batch once, builds the neutral
:class:`~diffusion_kv.core.batch.CommonBatchMetadata`, hands each KV-cache group's view of it
(:class:`~diffusion_kv.core.batch.PagedBatch`) to that group's backend, fans the native
metadata out to the group's layers, and returns a :class:`PreparedBatch` shared by every layer
of one forward.

Prepared batches are stamped with their translator and a generation. Any BlockTables mutation
(through :meth:`Translator.invalidate`, the registry's ``before_mutation`` hook) makes older
batches stale, and so does a newer preparation -- unless the batch is *retained*: its BlockTables
declare ``retains_batches`` and every backend ``retains_metadata`` (each preparation makes tensors
of its own and no later one writes into them), in which case it stays valid until the tables
change. Activating a stale batch is an error. While a batch is active, preparation and
BlockTables mutation are refused.

Page provenance: ``prepare`` refuses a row that would read a token its row source does not
report as written (:class:`~diffusion_kv.core.errors.StateError`) or that would write inside
its read-only cached prefix. A batch's write spans are reported back to the row source when
its activation ends, and only if every paged layer of the layout ran on it: a token counts as
written once it is in the pages of every layer. A row declaring ``live_from`` (a session's
re-cache after its window slid) reads, and so needs readable, only the sink and the keys from
``live_from`` on; the block plan carries it to the backends, which must declare
``supports_live_from``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from diffusion_kv.core.attention import AttentionMode, build_block_plan
from diffusion_kv.core.backend import PagedBackend, tensor_address
from diffusion_kv.core.batch import CommonBatchMetadata
from diffusion_kv.core.block_tables import (
    RETAINING_METHODS,
    BlockTables,
    DeviceBatch,
    HostBatch,
    declared,
    prepare_batch_torch,
)
from diffusion_kv.core.errors import (
    DiffusionKVError,
    NativeBackendError,
    StaleBatchError,
    StateError,
    UnsupportedFeatureError,
    ValidationError,
)
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.core.piecewise import PiecewisePlan, build_piecewise_plan, freeze_spans
from diffusion_kv.core.registry import Identity, RowBinding, TokenSpans, WrittenSpan, missing_spans
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.transfer import pinned_memory_available, to_device


class RowSource(Protocol):
    """Where the translator resolves identities and reports written tokens (the registry). A
    source may also offer ``resolve_identities(identities) -> list[RowBinding]`` (the core
    registry does), which the translator then calls once per batch instead of ``resolve`` per
    row; it must answer exactly as those calls would, errors included."""

    def resolve(
        self, request_id: str, sequence_id: int | None, context_id: str | None = None
    ) -> RowBinding: ...

    def record_writes(self, spans: Iterable[WrittenSpan]) -> None: ...


@dataclass(frozen=True)
class PreparedBatch:
    """Native metadata shared by every paged layer of one forward."""

    rows: tuple[PagedRow, ...]
    row_indices: torch.Tensor
    common: CommonBatchMetadata
    attn_metadata: Mapping[str, Any]
    slot_mappings_by_layer: Mapping[str, torch.Tensor]
    num_tokens: int
    owner: object = field(repr=False, compare=False)
    generation: int = field(repr=False, compare=False)
    mutation: int = field(default=0, repr=False, compare=False)
    """The translator's count of BlockTables changes when the batch was prepared."""
    retained: bool = field(default=False, repr=False, compare=False)
    """Later preparations leave the batch valid (module docstring); a BlockTables change does not."""
    write_spans: tuple[WrittenSpan, ...] = field(default=(), repr=False, compare=False)
    """What the batch writes into each row; recorded once every paged layer ran on it."""
    slots_valid: bool = field(default=False, compare=False)
    """Every slot of the batch is a real one (no padding, no other DCP rank's token): the
    translator validated that each row's positions lie in its installed blocks."""

    @property
    def query_lens(self) -> tuple[int, ...]:
        return tuple(r.query_len for r in self.rows)


class _HostLengths(NamedTuple):
    query_start_loc: torch.Tensor  # int32 [rows + 1]
    seq_lens: torch.Tensor  # int32 [rows]
    max_query_len: int
    max_seq_len: int


@dataclass
class _ActiveState:
    batch: PreparedBatch
    plan: PiecewisePlan | None = None
    segment_metadata: tuple[Mapping[str, Any], ...] | None = None
    packing: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    layers_done: set[str] = field(default_factory=set)
    layer_plans: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    """Per layer-input signature, what :func:`~diffusion_kv.core.layer_context.build_layer_context`
    decided for this batch (reused by every later layer of that signature)."""
    bound_layers: dict[str, Any] = field(default_factory=dict)
    """Per layer name, the backend's fast path for that layer's later calls in this activation
    (:meth:`~diffusion_kv.core.backend.PagedBackend.bind_layer`, held by the executor as a
    :class:`~diffusion_kv.core.layer_context.BoundLayer`)."""
    twins: dict[Any, tuple[str, Any]] = field(default_factory=dict)
    """Per twin key (:meth:`~diffusion_kv.core.execute.PagedExecutor.forward`), the first layer
    bound in this activation and its :class:`~diffusion_kv.core.layer_context.BoundLayer`: its
    twins' first calls ask the backend to bind from it
    (:meth:`~diffusion_kv.core.backend.PagedBackend.bind_layer_like`)."""
    no_twin: set[str] = field(default_factory=set)
    """Layers whose backend declined to bind from a twin in this activation (not asked again)."""


class Translator:
    """Turns rows into prepared batches for one worker (one layout, one BlockTables)."""

    def __init__(
        self,
        *,
        layout: CacheLayout,
        block_tables: BlockTables,
        backends: Sequence[PagedBackend],
        rows: RowSource | None,
        device: torch.device,
        platform_name: str = "?",
    ) -> None:
        """``backends[g]`` serves KV-cache group ``g``. ``rows`` may be bound later
        (``translator.rows = registry``) when the registry is built after the translator;
        ``platform_name`` appears in wrapped backend errors."""
        if len(backends) != len(layout.groups):
            raise ValidationError(f"{len(backends)} backends for {len(layout.groups)} KV-cache groups")
        self.layout = layout
        self.block_tables = block_tables
        self.backends = tuple(backends)
        self.rows = rows
        self.platform_name = platform_name
        self._layer_names = frozenset(layout.layer_names)
        self.device = resolve_device(device)
        self._owner = object()
        self._generation = 0
        self._mutation = 0
        self._retaining: tuple[type, bool] | None = None
        self._active: _ActiveState | None = None
        # pinned staging where the host runtime supports it
        self._pin = self.device.type != "cpu" and pinned_memory_available()
        self._modes = tuple(grp.spec.mode for grp in layout.groups)
        self._masks = tuple(grp.spec.mask for grp in layout.groups)
        if block_tables.cp_size > 1 and not all(m.is_plain for m in self._masks):
            raise UnsupportedFeatureError(
                "masks with a chunk, window or sink ("
                + ", ".join(m.describe() for m in self._masks if not m.is_plain)
                + f") under decode context parallelism (cp_size {block_tables.cp_size}) are not served"
            )
        # Page provenance asks only for the keys a row's queries see: with a window in every
        # group, keys that slid out (and may have been released) need not be readable.
        self._windowed = bool(self._masks) and all(m.releases for m in self._masks)
        self._all_plain = all(m.is_plain for m in self._masks)  # no block plan to build
        self._causal_groups = tuple(g for g, m in enumerate(self._modes) if m.is_causal)
        thresholds = [
            t for g in self._causal_groups if (t := self.backends[g].reorder_batch_threshold) is not None
        ]
        self._reorder_threshold: int | None = min(thresholds) if thresholds else None

    # -- state --------------------------------------------------------------------------------

    @property
    def active_batch(self) -> PreparedBatch | None:
        return self._active.batch if self._active is not None else None

    @property
    def active_state(self) -> _ActiveState | None:
        """The active batch's per-activation state (None while no batch is active)."""
        return self._active

    def invalidate(self) -> None:
        """Make every prepared batch stale (called before any BlockTables mutation)."""
        if self._active is not None:
            raise StateError("cannot change paged BlockTables while a prepared batch is active")
        self._generation += 1
        self._mutation += 1

    @property
    def retains_batches(self) -> bool:
        """Whether a batch prepared now stays valid after later preparations (until the
        BlockTables change): the BlockTables class declares ``retains_batches`` and every
        backend ``retains_metadata``, each for the methods that keep the promise
        (:func:`~diffusion_kv.core.block_tables.declared`)."""
        cls = type(self.block_tables)
        known = self._retaining
        if known is None or known[0] is not cls:
            retains = declared(cls, "retains_batches", RETAINING_METHODS) and all(
                declared(type(b), "retains_metadata", ("build",)) for b in self.backends
            )
            known = self._retaining = (cls, retains)
        return known[1]

    def graph_key(self, batch: PreparedBatch) -> tuple[Any, ...] | None:
        """What a CUDA graph captured over ``batch`` depends on, or None where it serves that
        batch only: every group's :meth:`PagedBackend.graph_key`, plus what the core hands the
        layers (the rows' query lengths, the slot mappings' and the common tensors' memory).
        Two batches with equal keys are served by one graph (``diffusion_kv.core.graphs``)."""
        if batch.owner is not self._owner:
            raise ValidationError("the prepared batch belongs to a different translator")
        parts: list[Any] = [batch.query_lens, batch.num_tokens, batch.slots_valid]
        for g, group in enumerate(self.layout.groups):
            key = self.backends[g].graph_key(batch.attn_metadata[group.layer_names[0]])
            if key is None:
                return None
            parts.append(key)
        seen: set[int] = set()
        for slots in batch.slot_mappings_by_layer.values():
            if id(slots) not in seen:
                seen.add(id(slots))
                parts.append(tensor_address(slots))
        common = batch.common
        for t in (common.query_start_loc, common.seq_lens, common.positions, batch.row_indices):
            parts.append(tensor_address(t))
        return tuple(parts)

    # -- preparation --------------------------------------------------------------------------

    def _validate(self, rows: tuple[PagedRow, ...]) -> tuple[list[RowBinding], list[Identity]]:
        """Every check of a batch, before anything changes; the rows' bindings and identities."""
        if not rows:
            raise ValidationError("a paged batch must contain at least one row")
        for r in rows:
            if not isinstance(r, PagedRow):
                raise ValidationError("a paged batch takes PagedRow records")
        bt = self.block_tables
        if len(rows) > bt.max_num_reqs:
            raise ValidationError(f"paged batch has {len(rows)} rows; worker capacity is {bt.max_num_reqs}")
        identities = [r.identity for r in rows]
        if len(set(identities)) != len(identities):
            dup = sorted({i for i in identities if identities.count(i) > 1}, key=repr)
            raise ValidationError(f"paged batch contains duplicate row identities {dup!r}")
        if self.rows is None:
            raise StateError("the translator has no row source (registry) bound")
        resolve_all = getattr(self.rows, "resolve_identities", None)
        if resolve_all is not None:  # the core registry: one call for the batch
            bindings = resolve_all(identities)
        else:
            resolve = self.rows.resolve
            bindings = [resolve(r.request_id, r.sequence_id, r.context_id) for r in rows]
        indices = [b.row_index for b in bindings]
        if len(set(indices)) != len(indices):
            raise ValidationError(f"paged batch resolves several rows to the same worker row: {indices}")
        # One pass over the rows; a row failing the first checks raises at once, and the first
        # failure of each later check is raised after the pass, so the error a batch gets is
        # the one of the first check (in this order) that any row fails.
        counts = bt.num_blocks.cpu.tolist()  # one conversion, not one per row and group
        groups = [
            (g, counts[g], block_size * bt.cp_size, ratio)
            for g, (block_size, ratio) in enumerate(zip(bt.block_sizes, bt.blocks_per_kv_block, strict=True))
        ]
        max_rows = bt.max_num_reqs
        short_of_blocks: tuple[PagedRow, int, int, int, int] | None = None
        unread_by: tuple[PagedRow, RowBinding, TokenSpans] | None = None
        num_tokens = 0
        for row, binding in zip(rows, bindings, strict=True):
            row_index = binding.row_index
            if type(row_index) is not int or not 0 <= row_index < max_rows:
                raise ValidationError(f"row {row.identity!r} resolved to invalid worker row {row_index!r}")
            if type(binding.max_seq_len) is not int or binding.max_seq_len < 0:
                raise ValidationError(
                    f"row {row.identity!r} resolved to invalid logical capacity {binding.max_seq_len!r}"
                )
            seq_len = row.seq_len
            if seq_len > binding.max_seq_len:
                raise ValidationError(
                    f"row {row.identity!r} uses seq_len={seq_len}, but its installed allocation has logical "
                    f"length {binding.max_seq_len}"
                )
            start = row.kv_start_pos
            end = start + row.query_len
            if start < binding.read_only_tokens:
                raise ValidationError(
                    f"row {row.identity!r} would write tokens [{start}, {end}) "
                    f"inside its read-only cached prefix [0, {binding.read_only_tokens})"
                )
            num_tokens += row.query_len
            if short_of_blocks is None:
                for g, group_counts, tokens_per_block, ratio in groups:
                    required = -(-seq_len // tokens_per_block)  # cdiv, inlined: runs per row
                    installed = group_counts[row_index]
                    if required * ratio > installed:
                        short_of_blocks = (row, g, required, installed, ratio)
                        break
            if row.live_from:
                self._check_live_from(row)
            written = binding.written
            if unread_by is None and not _reads_written(written, start, end, seq_len):
                if self._windowed and start > 0:
                    lo = max(min(m.first_visible(start, seq_len) for m in self._masks), row.live_from)
                    sink = min(max(m.sink for m in self._masks), lo)
                    unread = (
                        missing_spans(written, 0, sink)
                        + missing_spans(written, lo, start)
                        + missing_spans(written, end, seq_len)
                    )
                else:
                    unread = missing_spans(written, 0, start) + missing_spans(written, end, seq_len)
                if unread:
                    unread_by = (row, binding, unread)
        threshold = self._reorder_threshold
        if threshold is not None:
            seen_long = False
            for row in rows:
                if row.query_len > threshold:
                    seen_long = True
                elif seen_long:
                    raise ValidationError(
                        f"causal paged rows must place short-query rows (query_len <= {threshold}) before "
                        f"long-query rows; row {row.identity!r} (query_len {row.query_len}) comes after a long one"
                    )
        if short_of_blocks is not None:
            row, g, required, installed, ratio = short_of_blocks
            raise ValidationError(
                f"row {row.identity!r} needs {required} blocks in cache group {g} for seq_len={row.seq_len}, "
                f"but its worker row holds only {installed // ratio}"
            )
        if num_tokens > bt.max_num_batched_tokens:
            raise ValidationError(
                f"paged batch has {num_tokens} tokens; worker capacity is {bt.max_num_batched_tokens}"
            )
        if unread_by is not None:
            row, binding, unread = unread_by
            raise StateError(
                f"row {row.identity!r} would read tokens {list(unread)} that were never written since its "
                f"install (readable: {list(binding.written)}); write them first (the prefill phase) or "
                "declare them computed with cached_prefix_len"
                + ("; keys a sliding window released are gone for good" if self._windowed else "")
            )
        return bindings, identities

    def _check_live_from(self, row: PagedRow) -> None:
        """A row skipping keys past the sink needs a window in every group and backends that
        apply it (``Capabilities.supports_live_from``)."""
        if not self._windowed:
            raise ValidationError(
                f"row {row.identity!r} declares live_from={row.live_from}, but not every layer's mask has a window "
                f"({', '.join(m.describe() for m in self._masks)})"
            )
        lacking = [b.name for b in self.backends if not b.capabilities.supports_live_from]
        if lacking:
            raise UnsupportedFeatureError(
                f"row {row.identity!r} declares live_from={row.live_from} (keys past the sink skipped), which "
                f"backends {lacking} of platform {self.platform_name!r} do not serve (supports_live_from)"
            )

    @staticmethod
    def _lengths(query_lens: Sequence[int], seq_lens: Sequence[int]) -> _HostLengths:
        qsl_cpu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        return _HostLengths(
            qsl_cpu, torch.tensor(seq_lens, dtype=torch.int32), max(query_lens), max(seq_lens)
        )

    def _common(
        self,
        host: _HostLengths,
        lengths: Sequence[torch.Tensor],
        positions: torch.Tensor,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        modes: tuple[AttentionMode, ...],
        host_block_ids: tuple[tuple[tuple[int, ...], ...], ...] = (),
    ) -> CommonBatchMetadata:
        """Common metadata from host lengths and their device copies (already staged)."""
        qsl_cpu, seq_cpu = host.query_start_loc, host.seq_lens
        bt = self.block_tables
        dcp = dcp_cpu = None
        if bt.cp_size > 1:
            dcp_cpu = dcp_local_seq_lens(seq_cpu, bt.cp_size, bt.cp_rank, bt.cp_interleave)
            dcp = to_device(dcp_cpu, self.device)
        return CommonBatchMetadata(
            num_reqs=len(seq_cpu),
            num_tokens=int(qsl_cpu[-1]),
            query_start_loc=lengths[0],
            query_start_loc_cpu=qsl_cpu,
            max_query_len=host.max_query_len,
            seq_lens=lengths[1],
            seq_lens_cpu=seq_cpu,
            max_seq_len=host.max_seq_len,
            positions=positions,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            modes=modes,
            dcp_local_seq_lens=dcp,
            dcp_local_seq_lens_cpu=dcp_cpu,
            host_block_ids=host_block_ids,
        )

    def _stage(self, *host: torch.Tensor) -> list[torch.Tensor]:
        """Copy small host tensors of one dtype to the device in a single transfer (from pinned
        memory on accelerators, so the copy does not block the host); returns device views."""
        sizes = [t.numel() for t in host]
        if self.device.type == "cpu":
            return list(host)
        staging = torch.empty(sum(sizes), dtype=host[0].dtype, pin_memory=self._pin)
        torch.cat(host, out=staging)
        on_device = staging.to(self.device, non_blocking=True)
        return list(torch.split(on_device, sizes))

    def prepare(self, rows: Sequence[PagedRow]) -> PreparedBatch:
        """Validate rows and build the native metadata shared by every layer of one forward."""
        if self._active is not None:
            raise StateError("cannot prepare a paged batch while another batch is active")
        rows = tuple(rows)
        bindings, identities = self._validate(rows)
        # Persistent native buffers may be reused by the next preparation: every earlier batch
        # that is not retained is stale from here on, even if the builder below fails.
        self._generation += 1
        generation = self._generation
        retained = self.retains_batches
        n = len(rows)
        query_lens = [r.query_len for r in rows]
        seq_lens = [r.seq_len for r in rows]
        starts = [r.kv_start_pos for r in rows]
        floors = [r.live_from for r in rows] if any(r.live_from for r in rows) else None
        qsl = [0, *accumulate(query_lens)]
        num_tokens = qsl[-1]
        # Every per-row integer in one int32 host array (one numpy conversion; the BlockTables
        # copies it to the device in one transfer): [qsl | seq_lens | rows | kv_start_pos].
        packed = torch.from_numpy(
            np.array(qsl + seq_lens + [b.row_index for b in bindings] + starts, dtype=np.int32)
        )
        host = HostBatch(packed, n, num_tokens, max(query_lens))
        bt = self.block_tables
        hook = getattr(bt, "prepare_batch", None)
        on_device: DeviceBatch = (
            hook(host) if hook is not None else prepare_batch_torch(bt, host, self.device)
        )
        qsl_cpu, seq_cpu = packed[: n + 1], packed[n + 1 : 2 * n + 1]
        dcp = dcp_cpu = None
        if bt.cp_size > 1:
            dcp_cpu = dcp_local_seq_lens(seq_cpu, bt.cp_size, bt.cp_rank, bt.cp_interleave)
            dcp = to_device(dcp_cpu, self.device)
        num_groups = len(self.layout.groups)
        common = CommonBatchMetadata(
            num_reqs=n,
            num_tokens=num_tokens,
            query_start_loc=on_device.query_start_loc,
            query_start_loc_cpu=qsl_cpu,
            max_query_len=host.max_query_len,
            seq_lens=on_device.seq_lens,
            seq_lens_cpu=seq_cpu,
            max_seq_len=max(seq_lens),
            positions=on_device.positions,
            block_tables=on_device.block_tables,
            slot_mappings=on_device.slot_mappings,
            modes=self._modes,
            dcp_local_seq_lens=dcp,
            dcp_local_seq_lens_cpu=dcp_cpu,
            block_plans=()
            if self._all_plain
            else tuple(
                None
                if mask.is_plain
                else build_block_plan(
                    mask, starts, query_lens, seq_lens, bt.kernel_block_sizes[g], live_from=floors
                )
                for g, mask in enumerate(self._masks)
            ),
            host_block_ids=tuple(
                tuple([b.block_ids[g] if g < len(b.block_ids) else () for b in bindings])
                for g in range(num_groups)
            ),
        )
        attn_metadata = self._build(common, range(num_groups))
        slots = on_device.slot_mappings
        by_layer: dict[str, torch.Tensor] = {}
        for g, group in enumerate(self.layout.groups):
            slots_g = slots[g]
            for name in group.layer_names:
                by_layer[name] = slots_g
        return PreparedBatch(
            rows=rows,
            row_indices=on_device.row_indices,
            common=common,
            attn_metadata=attn_metadata,
            slot_mappings_by_layer=by_layer,
            num_tokens=num_tokens,
            owner=self._owner,
            generation=generation,
            mutation=self._mutation,
            retained=retained,
            write_spans=tuple(
                [
                    (identity, b.install_serial, start, start + query_len)
                    for identity, b, start, query_len in zip(
                        identities, bindings, starts, query_lens, strict=True
                    )
                ]
            ),
            slots_valid=bt.cp_size == 1,
        )

    def _build(self, common: CommonBatchMetadata, groups: Sequence[int]) -> dict[str, Any]:
        """Each group's native metadata, once, fanned out to its layers; a failure inside a
        backend is a NativeBackendError naming it."""
        out: dict[str, Any] = {}
        for g in groups:
            backend = self.backends[g]
            group = self.layout.groups[g]
            try:
                metadata = backend.build(common.for_group(g))
            except DiffusionKVError:
                raise
            except Exception as exc:
                raise NativeBackendError(
                    f"platform {self.platform_name!r} backend {backend.name!r} failed to build metadata for "
                    f"KV-cache group {g} (layers {list(group.layer_names)}) ({type(exc).__name__}: {exc})"
                ) from exc
            for name in group.layer_names:
                out[name] = metadata
        return out

    @contextmanager
    def activate(self, batch: PreparedBatch) -> Iterator[PreparedBatch]:
        """Make ``batch`` the one every paged layer uses until the block exits."""
        if not isinstance(batch, PreparedBatch) or batch.owner is not self._owner:
            raise ValidationError("the prepared batch belongs to a different translator")
        if batch.mutation != self._mutation:
            raise StaleBatchError(
                f"the prepared batch is stale (generation {batch.generation}; current {self._generation}): "
                "BlockTables changed since"
            )
        if batch.generation != self._generation and not batch.retained:
            raise StaleBatchError(
                f"the prepared batch is stale (generation {batch.generation}; current {self._generation}): "
                "a newer batch was prepared since, and these BlockTables or backends reuse their buffers"
            )
        if self._active is not None:
            raise StateError("a prepared batch is already active")
        state = self._active = _ActiveState(batch)
        try:
            yield batch
        finally:
            self._active = None
            if self.rows is not None and state.layers_done >= self._layer_names:
                self.rows.record_writes(batch.write_spans)

    def layer_done(self, layer_name: str) -> None:
        """A paged layer finished on the active batch (its K/V are in the pages)."""
        if self._active is not None:
            self._active.layers_done.add(layer_name)

    # -- per-batch caches used by layer contexts -------------------------------------------------

    def require_active(self) -> _ActiveState:
        if self._active is None:
            raise StateError("paged attention ran without an active prepared batch (no dense fallback)")
        return self._active

    def piecewise_plan(self, full_attn_spans: Sequence[Sequence[Sequence[int]]]) -> PiecewisePlan:
        """The batch's plan for these spans; built once, and spans must not change between layers."""
        state = self.require_active()
        if state.plan is not None:
            if state.plan.spans != freeze_spans(full_attn_spans):
                raise ValidationError("full_attn_spans changed between layers within one active batch")
            return state.plan
        rows = state.batch.rows
        not_suffix = [r.identity for r in rows if not r.is_suffix]
        if not_suffix:
            raise ValidationError(
                f"piecewise paged attention needs every query span to end at seq_len; invalid rows={not_suffix!r}"
            )
        state.plan = build_piecewise_plan(
            full_attn_spans,
            [r.kv_start_pos for r in rows],
            [r.query_len for r in rows],
            [r.seq_len for r in rows],
            device=self.device,
            reorder_threshold=self._reorder_threshold,
        )
        return state.plan

    def segment_metadata(self, plan: PiecewisePlan) -> tuple[Mapping[str, Any], ...]:
        """Native metadata per segment, built once per active batch and reused by every layer."""
        state = self.require_active()
        if state.segment_metadata is not None:
            return state.segment_metadata
        batch = state.batch
        out = []
        for seg in plan.segments:
            q_lens = [s.q_end - s.q_start for s in seg.row_segments]
            kv_lens = [s.kv_end for s in seg.row_segments]
            if seg.query_range is not None:
                a, b = seg.query_range
                positions = batch.common.positions[a:b]
                slots = batch.common.slot_mappings[:, a:b]
            else:
                positions = batch.common.positions.index_select(0, seg.query_indices)
                slots = batch.common.slot_mappings.index_select(1, seg.query_indices)
            host = self._lengths(q_lens, kv_lens)
            tables = batch.common.block_tables
            host_block_ids = batch.common.host_block_ids
            if not seg.all_rows:  # the call serves a subset of the batch's rows, in its order
                (picked,) = self._stage(torch.tensor(seg.rows, dtype=torch.int32))
                picked = picked.to(torch.long)
                tables = tuple(t.index_select(0, picked) for t in tables)
                host_block_ids = tuple(tuple(ids[r] for r in seg.rows) for ids in host_block_ids)
            common = self._common(
                host,
                self._stage(host.query_start_loc, host.seq_lens),
                positions,
                tables,
                slots,
                tuple(seg.mode for _ in self._modes),
                host_block_ids,
            )
            out.append(self._build(common, range(len(self._modes))))  # spans apply to every group
        state.segment_metadata = tuple(out)
        return state.segment_metadata

    def packing_indices(self, tokens_per_row: int) -> torch.Tensor:
        """Indices of the real tokens of a right-padded ``[B, tokens_per_row]`` layout (cached)."""
        state = self.require_active()
        key = (tokens_per_row, str(self.device))
        if key not in state.packing:
            lens = torch.tensor(state.batch.query_lens, dtype=torch.long)
            grid = torch.arange(len(lens))[:, None] * tokens_per_row + torch.arange(tokens_per_row)[None, :]
            keep = torch.arange(tokens_per_row)[None, :] < lens[:, None]
            state.packing[key] = to_device(grid[keep], self.device)
        return state.packing[key]


def _reads_written(spans: Sequence[tuple[int, int]], start: int, end: int, seq_len: int) -> bool:
    """Whether a row writing ``[start, end)`` of ``seq_len`` keys reads only written tokens
    because one span holds ``[0, start)`` and one holds ``[end, seq_len)`` (the common case,
    checked without building the missing spans; False means: measure them exactly)."""
    head = start <= 0
    tail = end >= seq_len
    for a, b in spans:
        head = head or (a <= 0 and start <= b)
        tail = tail or (a <= end and seq_len <= b)
    return head and tail


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:0``), as tensors report it."""
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.empty(0, device=dev).device
    return dev


def dcp_local_seq_lens(seq_lens: torch.Tensor, cp_size: int, cp_rank: int, interleave: int) -> torch.Tensor:
    """Keys of each row that live on ``cp_rank`` under DCP interleaving (vLLM semantics)."""
    seq = seq_lens.to(torch.long)
    round_tokens = interleave * cp_size
    full_rounds = seq // round_tokens
    rest = seq - full_rounds * round_tokens
    local_rest = (rest - cp_rank * interleave).clamp(min=0, max=interleave)
    return (full_rounds * interleave + local_rest).to(torch.int32)

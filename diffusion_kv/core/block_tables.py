"""The BlockTables protocol: the duck type the core talks to.

A BlockTables object owns the worker-side block tables of every KV-cache group: one row per
installed identity, staged (host-side) writes applied in one step, a host view of how many
(kernel) blocks each row holds, and the per-batch gather of table rows and slot mappings.

The names follow vLLM's model-runner-V2 ``BlockTables`` so that vLLM's own class (and
vllm-ascend's) fits the same seam through a thin adapter in ``integrations/vllm``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from typing_extensions import Self

from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.transfer import pinned_memory_available, to_device


@runtime_checkable
class HostBlockCounts(Protocol):
    """Host view of the number of *kernel* blocks installed per ``[group, row]``."""

    @property
    def cpu(self) -> torch.Tensor:
        """``[num_groups, max_num_reqs]`` int32 CPU tensor; the source of truth."""
        ...

    def copy_to_uva(self) -> None:
        """Publish the host values to the device-side view: device work queued after the call
        (on the current stream) reads them, and ``cpu`` may change right after it returns. The
        core calls it at every install and removal, so it should not wait for the device."""
        ...


@runtime_checkable
class StagedGroupTable(Protocol):
    """One group's table; only the rollback hook is part of the protocol."""

    def clear_staged_writes(self) -> None: ...


@runtime_checkable
class BlockTables(Protocol):
    """Worker block tables for all KV-cache groups."""

    def __init__(
        self,
        *,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: Sequence[int],
        device: torch.device | str,
        kernel_block_sizes: Sequence[int] | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_mapping_dtype: torch.dtype = torch.int64,
    ) -> None: ...

    # Read-only members: plain attributes of an implementation satisfy them.
    @property
    def block_sizes(self) -> Sequence[int]:
        """KV-manager block size per group (what the scheduler allocates)."""
        ...

    @property
    def kernel_block_sizes(self) -> Sequence[int]:
        """Block size the attention kernel addresses, per group (divides ``block_sizes``)."""
        ...

    @property
    def blocks_per_kv_block(self) -> Sequence[int]:
        """``block_sizes[g] // kernel_block_sizes[g]``."""
        ...

    @property
    def max_num_reqs(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def cp_size(self) -> int: ...

    @property
    def cp_rank(self) -> int: ...

    @property
    def cp_interleave(self) -> int: ...

    @property
    def slot_mapping_dtype(self) -> torch.dtype: ...

    @property
    def num_blocks(self) -> HostBlockCounts: ...

    @property
    def block_tables(self) -> Sequence[StagedGroupTable]: ...

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


# --------------------------------------------------------------------------------------------
# One batch's per-row integers and what prepare puts on the device
# --------------------------------------------------------------------------------------------


class HostBatch(NamedTuple):
    """One batch's per-row integers on the host, packed in one int32 CPU tensor so they travel
    in one transfer: ``[query_start_loc (n+1) | seq_lens (n) | row_indices (n) | kv_start_pos (n)]``.
    Row ``i`` queries tokens ``[kv_start_pos[i], kv_start_pos[i] + query_len[i])`` of worker row
    ``row_indices[i]``."""

    packed: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(query_start_loc, seq_lens, row_indices, kv_start_pos)`` of ``packed``."""
        n = self.num_reqs
        qsl, seq, rows, starts = torch.split(self.packed, [n + 1, n, n, n])
        return qsl, seq, rows, starts


class DeviceBatch(NamedTuple):
    """What ``prepare_batch`` puts on the device for one batch (see :class:`BlockTables`)."""

    query_start_loc: torch.Tensor
    """``[n + 1]`` int32."""
    seq_lens: torch.Tensor
    """``[n]`` int32."""
    row_indices: torch.Tensor
    """``[n]`` int32 worker rows."""
    positions: torch.Tensor
    """``[num_tokens]`` int64: ``kv_start_pos[i] + j`` for the ``j``-th query token of row ``i``."""
    block_tables: tuple[torch.Tensor, ...]
    """Per group ``[n, width]`` int32 (``gather_block_tables``)."""
    slot_mappings: torch.Tensor
    """``[groups, num_tokens]`` (``compute_slot_mappings``)."""


def declared(cls: type, flag: str, methods: Sequence[str]) -> bool:
    """Whether class ``cls`` holds boolean class attribute ``flag`` true *for the methods that
    make it so*: the class of ``cls``'s MRO that sets ``flag`` must also be where each of
    ``methods`` comes from (or below it), so a subclass that replaces one of them without
    setting ``flag`` again does not inherit a promise it may break."""
    mro = cls.__mro__
    owner = next((k for k in mro if flag in vars(k)), None)
    if owner is None or vars(owner)[flag] is not True:
        return False
    at = mro.index(owner)
    for name in methods:
        definer = next((k for k in mro if name in vars(k)), None)
        if definer is not None and mro.index(definer) < at:
            return False
    return True


RETAINING_METHODS = ("prepare_batch", "_prepare_batch_host", "gather_block_tables", "compute_slot_mappings")
"""What a BlockTables' ``retains_batches`` speaks for (:func:`declared`)."""


def prepare_batch_torch(bt: BlockTables, host: HostBatch, device: torch.device) -> DeviceBatch:
    """The default ``prepare_batch``, for any BlockTables: positions built on the host, the
    per-row integers and the positions copied in two transfers (from pinned memory on
    accelerators, so the copies do not block the host), then ``bt.gather_block_tables`` and
    ``bt.compute_slot_mappings``. Every call returns fresh tensors."""
    n, num_tokens = host.num_reqs, host.num_tokens
    qsl_h, _, _, starts_h = host.split()
    lens = (qsl_h[1:] - qsl_h[:-1]).long()
    positions = torch.arange(num_tokens, dtype=torch.long) + torch.repeat_interleave(
        (starts_h - qsl_h[:-1]).long(), lens, output_size=num_tokens
    )
    packed = to_device(host.packed, device)
    positions = to_device(positions, device)
    qsl, seq, rows, _ = torch.split(packed, [n + 1, n, n, n])
    tables = bt.gather_block_tables(rows, num_reqs_padded=n)
    slots = bt.compute_slot_mappings(rows, qsl, positions, num_tokens_padded=num_tokens)
    return DeviceBatch(qsl, seq, rows, positions, tuple(tables), slots)


# --------------------------------------------------------------------------------------------
# Pure-torch implementation (any torch device)
# --------------------------------------------------------------------------------------------

PAD_SLOT_ID = -1


def block_table_width(max_num_blocks: int, block_size: int, token_alignment: int | None = 128) -> int:
    """Table width for ``max_num_blocks`` blocks, rounded up so the row spans a multiple of
    ``token_alignment`` tokens (vLLM's ``get_block_table_width`` rule)."""
    if token_alignment is not None:
        alignment = token_alignment // math.gcd(token_alignment, block_size)
        max_num_blocks = -(-max_num_blocks // alignment) * alignment
    return max_num_blocks


class HostCounts:
    """``num_blocks`` host view: ``.cpu`` is the source of truth, ``.gpu`` the device copy."""

    def __init__(self, num_groups: int, max_num_reqs: int, device: torch.device) -> None:
        self.cpu = torch.zeros((num_groups, max_num_reqs), dtype=torch.int32)
        self.np = self.cpu.numpy()
        """NumPy view of ``.cpu`` (the same memory): element access without torch dispatch."""
        self.gpu = torch.zeros((num_groups, max_num_reqs), dtype=torch.int32, device=device)

    def copy_to_uva(self) -> None:
        """Copy ``.cpu`` to ``.gpu``. On an accelerator the values go through a pinned snapshot
        (torch's caching host allocator keeps it until the copy is done) without blocking the
        host, so installing and removing rows never waits for the device; ``.cpu`` may change
        right after the call. Without pinned memory the copy blocks."""
        if self.gpu.device.type == "cpu":
            self.gpu.copy_(self.cpu)
        elif pinned_memory_available():
            self.gpu.copy_(self.cpu.pin_memory(), non_blocking=True)
        else:
            self.gpu.copy_(self.cpu, non_blocking=False)


class StagedTable:
    """One group's device table plus its pending (host-side) writes."""

    def __init__(self, max_num_reqs: int, width: int, device: torch.device) -> None:
        self.gpu = torch.zeros((max_num_reqs, width), dtype=torch.int32, device=device)
        self.width = width
        self._staged: list[tuple[int, int, list[int]]] = []
        self._host = self.gpu.numpy() if self.gpu.device.type == "cpu" else None
        """A host table's NumPy view (the same memory): slice writes without torch dispatch."""

    def stage_write(self, row: int, start: int, ids: list[int]) -> None:
        self._staged.append((row, start, ids))

    def clear_staged_writes(self) -> None:
        self._staged.clear()

    def apply_write(self) -> None:
        """Apply every staged write (one indexed copy on an accelerator, NumPy slice writes on
        the host), then clear them."""
        staged = [(row, start, ids) for row, start, ids in self._staged if ids]
        if staged and self._host is not None:
            table = self._host
            for row, start, ids in staged:
                table[row, start : start + len(ids)] = ids
        elif staged:
            # rows, columns and values in one pinned [3, n] buffer: one copy that does not
            # block the host (the caching host allocator keeps the buffer until it is done)
            n = sum(len(ids) for _, _, ids in staged)
            pin = pinned_memory_available()
            host = torch.empty((3, n), dtype=torch.long, pin_memory=pin)
            view = host.numpy()
            at = 0
            for row, start, ids in staged:
                end = at + len(ids)
                view[0, at:end] = row
                view[1, at:end] = np.arange(start, start + len(ids))
                view[2, at:end] = ids
                at = end
            moved = host.to(self.gpu.device, non_blocking=pin)
            self.gpu.index_put_((moved[0], moved[1]), moved[2].to(torch.int32))
        self._staged.clear()


@dataclass(frozen=True)
class BlockTablesGeometry:
    """Everything a BlockTables is built from, validated once: the keyword arguments of every
    BlockTables class (vLLM's, the core's, a plugin's) as one record. The runner builds one
    and constructs the backend's class with :meth:`kwargs`."""

    block_sizes: tuple[int, ...]
    """Tokens per scheduler block, one per KV-cache group."""
    max_num_reqs: int
    max_num_batched_tokens: int
    max_num_blocks_per_group: tuple[int, ...]
    """Scheduler blocks a row can hold, per group (the table width before kernel splitting)."""
    device: torch.device
    kernel_block_sizes: tuple[int, ...]
    """Tokens per kernel block, per group; each divides its block size."""
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    slot_mapping_dtype: torch.dtype = torch.int64

    @classmethod
    def of(
        cls,
        *,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: Sequence[int],
        device: torch.device | str,
        kernel_block_sizes: Sequence[int] | None = None,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_mapping_dtype: torch.dtype = torch.int64,
    ) -> BlockTablesGeometry:
        """The record from BlockTables keywords (``kernel_block_sizes`` defaults to the block
        sizes); every problem is a :class:`ValidationError`."""
        blocks = tuple(block_sizes)
        return cls(
            block_sizes=blocks,
            max_num_reqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_blocks_per_group=tuple(max_num_blocks_per_group),
            device=torch.device(device),
            kernel_block_sizes=tuple(kernel_block_sizes) if kernel_block_sizes is not None else blocks,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
            slot_mapping_dtype=slot_mapping_dtype,
        )

    def __post_init__(self) -> None:
        block_sizes, kernel, caps = (
            list(self.block_sizes),
            list(self.kernel_block_sizes),
            list(self.max_num_blocks_per_group),
        )
        if not block_sizes or len(kernel) != len(block_sizes) or len(caps) != len(block_sizes):
            raise ValidationError(
                f"BlockTables needs one block size, kernel block size and capacity per group; got "
                f"block_sizes={block_sizes}, kernel_block_sizes={kernel}, max_num_blocks_per_group={caps}"
            )
        for g, (bs, kbs, cap) in enumerate(zip(block_sizes, kernel, caps, strict=True)):
            if type(bs) is not int or type(kbs) is not int or bs <= 0 or kbs <= 0 or bs % kbs:
                raise ValidationError(
                    f"group {g}: kernel block size {kbs!r} must be a positive divisor of block size {bs!r}"
                )
            if type(cap) is not int or cap <= 0:
                raise ValidationError(f"group {g}: max_num_blocks_per_group must be positive; got {cap!r}")
        for name, value in (
            ("max_num_reqs", self.max_num_reqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
        ):
            if type(value) is not int or value <= 0:
                raise ValidationError(f"{name} must be a positive integer; got {value!r}")
        cp_size, cp_rank = self.cp_size, self.cp_rank
        if type(cp_size) is not int or cp_size <= 0 or not (type(cp_rank) is int and 0 <= cp_rank < cp_size):
            raise ValidationError(
                f"cp_rank must lie in [0, cp_size); got cp_size={cp_size!r}, cp_rank={cp_rank!r}"
            )
        if type(self.cp_interleave) is not int or self.cp_interleave <= 0:
            raise ValidationError(f"cp_interleave must be a positive integer; got {self.cp_interleave!r}")
        if cp_size > 1 and any(bs % self.cp_interleave for bs in block_sizes):
            raise ValidationError(
                f"cp_interleave={self.cp_interleave} must divide every block size {block_sizes}"
            )
        if self.slot_mapping_dtype not in (torch.int32, torch.int64):
            raise ValidationError(
                f"slot_mapping_dtype must be torch.int32 or torch.int64; got {self.slot_mapping_dtype}"
            )

    @property
    def blocks_per_kv_block(self) -> tuple[int, ...]:
        """Kernel blocks per scheduler block, per group."""
        return tuple(bs // kbs for bs, kbs in zip(self.block_sizes, self.kernel_block_sizes, strict=True))

    def build(self, cls: type[BlockTables]) -> BlockTables:
        """An instance of the BlockTables class ``cls``: from this record when the class takes
        one (``from_geometry``, as :class:`TorchBlockTables` and its subclasses do), else from
        :meth:`kwargs` (vLLM's classes, and any class written to the keyword protocol)."""
        from_geometry = getattr(cls, "from_geometry", None)
        if callable(from_geometry):
            return from_geometry(self)  # type: ignore[no-any-return]
        return cls(**self.kwargs())

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments a BlockTables class is constructed with."""
        return {
            "block_sizes": list(self.block_sizes),
            "max_num_reqs": self.max_num_reqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_blocks_per_group": list(self.max_num_blocks_per_group),
            "device": self.device,
            "kernel_block_sizes": list(self.kernel_block_sizes),
            "cp_size": self.cp_size,
            "cp_rank": self.cp_rank,
            "cp_interleave": self.cp_interleave,
            "slot_mapping_dtype": self.slot_mapping_dtype,
        }


class TorchBlockTables:
    """BlockTables in plain torch: the ``cpu`` plugin's, usable on any torch device.

    Semantics follow vLLM's model-runner-V2 ``BlockTables`` with kernel block sizes: a manager
    block id ``b`` of group ``g`` is stored as the ``blocks_per_kv_block[g]`` kernel ids
    ``b * r + k``; ``num_blocks`` counts kernel blocks; slot mappings use the decode-context
    parallel (DCP) interleave when ``cp_size > 1`` and write ``-1`` for padding tokens, for
    tokens owned by another DCP rank, and for positions beyond a row's installed blocks.
    Everything per token is vectorised; no host synchronisation happens in gather or slots.
    """

    retains_batches: ClassVar[bool] = True
    """Every prepared batch's tensors are its own: :meth:`prepare_batch` (and the methods it
    calls) makes new tensors each time and never writes into an earlier batch's, so a batch
    stays valid after later preparations until the tables change. A BlockTables class that
    fills persistent buffers says False (or leaves the attribute out); a subclass replacing
    one of these methods must set it again to keep it (``diffusion_kv.core.block_tables.declared``)."""

    def __init__(self, geometry: BlockTablesGeometry | None = None, /, **keywords: Any) -> None:
        """From the geometry record (what the runner hands over), or from its ten keywords
        (``block_sizes=..., max_num_reqs=...``: vLLM's ``BlockTables`` signature, which the
        protocol keeps so that vLLM's class serves as it is)."""
        if geometry is None:
            geometry = BlockTablesGeometry.of(**keywords)
        elif keywords or not isinstance(geometry, BlockTablesGeometry):
            raise ValidationError(
                "TorchBlockTables takes a BlockTablesGeometry or its keywords, not both; got "
                f"{type(geometry).__name__} and {sorted(keywords)}"
            )
        self.geometry = geometry
        max_num_reqs, max_num_batched_tokens = geometry.max_num_reqs, geometry.max_num_batched_tokens
        cp_size, cp_rank, cp_interleave = geometry.cp_size, geometry.cp_rank, geometry.cp_interleave
        slot_mapping_dtype = geometry.slot_mapping_dtype
        self.device = geometry.device
        self.block_sizes = block_sizes = list(geometry.block_sizes)
        self.kernel_block_sizes = list(geometry.kernel_block_sizes)
        self.blocks_per_kv_block = list(geometry.blocks_per_kv_block)
        self.max_num_blocks_per_group = caps = list(geometry.max_num_blocks_per_group)
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.cp_interleave = cp_interleave
        self.slot_mapping_dtype = slot_mapping_dtype
        self.num_kv_cache_groups = len(block_sizes)
        self.block_tables = [
            StagedTable(max_num_reqs, cap * r, self.device)
            for cap, r in zip(caps, self.blocks_per_kv_block, strict=True)
        ]
        self.num_blocks = HostCounts(len(block_sizes), max_num_reqs, self.device)
        self.init_block_table_layout_tensors()
        self._host_rows = all(r == 1 for r in self.blocks_per_kv_block) and all(
            table._host is not None for table in self.block_tables
        )
        """``write_rows`` writes host slices directly (one kernel block per manager block)."""

    @classmethod
    def from_geometry(cls, geometry: BlockTablesGeometry) -> Self:
        """The tables for ``geometry`` (the runner's way in; subclasses inherit it). A subclass
        that overrides ``__init__`` with the protocol's keywords gets them."""
        if cls.__init__ is TorchBlockTables.__init__:
            return cls(geometry)
        return cls(**geometry.kwargs())

    # -- staged writes -----------------------------------------------------------------------

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        if type(req_index) is not int or not 0 <= req_index < self.max_num_reqs:
            raise ValidationError(f"row {req_index!r} is outside [0, {self.max_num_reqs})")
        if len(new_block_ids) != self.num_kv_cache_groups:
            raise ValidationError(
                f"row {req_index}: {len(new_block_ids)} block groups given; expected {self.num_kv_cache_groups}"
            )
        plans = []
        for g, ids in enumerate(new_block_ids):
            r = self.blocks_per_kv_block[g]
            start = 0 if overwrite else int(self.num_blocks.np[g, req_index])
            kernel_ids = [b * r + k for b in ids for k in range(r)] if r > 1 else list(ids)
            end = start + len(kernel_ids)
            if end > self.block_tables[g].width:
                raise ValidationError(
                    f"row {req_index} group {g}: {end} kernel blocks exceed the table width "
                    f"{self.block_tables[g].width}"
                )
            plans.append((start, kernel_ids, end))
        for g, (start, kernel_ids, end) in enumerate(plans):  # all checks passed: now mutate
            self.block_tables[g].stage_write(req_index, start, kernel_ids)
            self.num_blocks.np[g, req_index] = end

    def apply_staged_writes(self) -> None:
        for table in self.block_tables:
            table.apply_write()
        self.num_blocks.copy_to_uva()

    def write_rows(
        self, rows: Sequence[int], block_ids: Sequence[tuple[Any, ...]], *, checked: bool = True
    ) -> None:
        """Overwrite whole rows: what ``append_block_ids(row, ids, overwrite=True)`` for each
        row and then ``apply_staged_writes()`` do, with the same checks first (nothing changes
        when one fails), in one pass on a host table (a slice write per row and group). Kernel
        blocks smaller than the manager's, a device table or writes already staged take exactly
        those calls. A group's ids may be any sequence of ints, a NumPy array too.
        ``checked=False`` skips the checks on a host table: the caller guarantees distinct rows
        in ``[0, max_num_reqs)``, one id list per group and none wider than its table (the
        registry's plain install, whose row capacity it compared with the widths once)."""
        tables = self.block_tables
        staged = False
        for table in tables:  # (not any() of a comprehension: a call of its own before 3.12)
            if table._staged:
                staged = True
                break
        if not self._host_rows or staged:
            for row, ids in zip(rows, block_ids, strict=True):
                self.append_block_ids(row, tuple(map(list, ids)), overwrite=True)
            self.apply_staged_writes()
            return
        max_num_reqs, num_groups = self.max_num_reqs, len(tables)
        for row, ids in zip(rows, block_ids, strict=True) if checked else ():
            if type(row) is not int or not 0 <= row < max_num_reqs:
                raise ValidationError(f"row {row!r} is outside [0, {max_num_reqs})")
            if len(ids) != num_groups:
                raise ValidationError(f"row {row}: {len(ids)} block groups given; expected {num_groups}")
            for g, group in enumerate(ids):
                if len(group) > tables[g].width:
                    raise ValidationError(
                        f"row {row} group {g}: {len(group)} kernel blocks exceed the table width {tables[g].width}"
                    )
        counts = self.num_blocks.np
        if num_groups == 1:  # the common layout: no per-group loop
            host, row_counts = tables[0]._host, counts[0]
            for row, (group,) in zip(rows, block_ids, strict=True):
                n = len(group)
                if n:
                    host[row, :n] = group  # type: ignore[index]
                row_counts[row] = n
        else:
            hosts = [table._host for table in tables]
            for row, ids in zip(rows, block_ids, strict=True):
                for g, group in enumerate(ids):
                    n = len(group)
                    if n:
                        hosts[g][row, :n] = group  # type: ignore[index]
                    counts[g, row] = n
        num_blocks = self.num_blocks
        mirror = self.__dict__.get("_counts_mirror")
        if mirror is not None and mirror[0] is num_blocks.gpu:
            mirror[1][...] = counts  # the device counts live in host memory too: a NumPy copy
        elif type(num_blocks) is HostCounts and num_blocks.gpu.device.type == "cpu":
            self.__dict__["_counts_mirror"] = (num_blocks.gpu, num_blocks.gpu.numpy())
            num_blocks.copy_to_uva()
        else:
            num_blocks.copy_to_uva()

    def clear_staged_writes(self) -> None:
        for table in self.block_tables:
            table.clear_staged_writes()

    def init_block_table_layout_tensors(self) -> None:
        self._kernel_sizes_t = torch.tensor(self.kernel_block_sizes, dtype=torch.long, device=self.device)
        self._block_sizes_t = torch.tensor(self.block_sizes, dtype=torch.long, device=self.device)

    # -- per batch ---------------------------------------------------------------------------

    def prepare_batch(self, host: HostBatch) -> DeviceBatch:
        """One batch's device metadata: the rows' integers, positions, tables and slots.

        The hook the translator calls once per ``prepare`` (BlockTables without it get
        :func:`prepare_batch_torch`). An override may return views of persistent buffers that
        the next call overwrites: the translator never prepares while a batch is active, and a
        new preparation makes every earlier batch stale -- unless the class declares
        :attr:`retains_batches`, which such an override does not (a subclass overriding this
        method loses the inherited declaration).

        On the host (``device`` is the CPU) without DCP, each row's tokens are one run of
        positions, so a row's slots are a slice of its block grid (``table[b] * kbs + o``)
        built from host integers: a few tensor ops per row instead of per-token searches."""
        if self.device.type != "cpu" or self.cp_size != 1:
            return prepare_batch_torch(self, host, self.device)
        return self._prepare_batch_host(host)

    def _prepare_batch_host(self, host: HostBatch) -> DeviceBatch:
        """The host path of :meth:`prepare_batch` in NumPy, over the tables' NumPy views (the
        same memory): a row's gathered table is a slice copy, its slots one arithmetic over its
        slice of block ids -- a few microseconds a row, where torch dispatch costs that per op."""
        n, num_tokens = host.num_reqs, host.num_tokens
        p = host.packed  # the views host.split() gives, as plain slices (no split dispatch)
        qsl, seq, rows = p[: n + 1], p[n + 1 : 2 * n + 1], p[2 * n + 1 : 3 * n + 1]
        packed = p.numpy()
        qsl_l = packed[: n + 1].tolist()
        rows_l = packed[2 * n + 1 : 3 * n + 1].tolist()
        starts_l = packed[3 * n + 1 :].tolist()
        positions = np.empty(num_tokens, dtype=np.int64)
        for i in range(n):
            q0, q1 = qsl_l[i], qsl_l[i + 1]
            positions[q0:q1] = np.arange(starts_l[i], starts_l[i] + q1 - q0)
        slot_dtype = np.int64 if self.slot_mapping_dtype == torch.int64 else np.int32
        slots = np.full((self.num_kv_cache_groups, num_tokens), PAD_SLOT_ID, dtype=slot_dtype)
        counts = self.num_blocks.np
        tables = []
        for g, table in enumerate(self.block_tables):
            ids = table._host
            assert ids is not None  # a host table (the device is the CPU)
            kbs = self.kernel_block_sizes[g]
            gathered = np.zeros((n, table.width), dtype=np.int32)
            for i in range(n):
                row = rows_l[i]
                if row < 0:  # a padding row: no blocks, writes nothing
                    continue
                count = int(counts[g, row])
                gathered[i, :count] = ids[row, :count]
                q0, q1, start = qsl_l[i], qsl_l[i + 1], starts_l[i]
                end = min(start + q1 - q0, count * kbs)  # -1 past the installed blocks
                if end <= start:
                    continue
                b0, b1 = start // kbs, -(-end // kbs)
                grid = (ids[row, b0:b1].astype(np.int64) * kbs)[:, None] + np.arange(kbs)
                lo = start - b0 * kbs
                slots[g, q0 : q0 + end - start] = grid.reshape(-1)[lo : lo + end - start]
            tables.append(torch.from_numpy(gathered))
        return DeviceBatch(
            qsl, seq, rows, torch.from_numpy(positions), tuple(tables), torch.from_numpy(slots)
        )

    def gather_block_tables(
        self, idx_mapping: torch.Tensor, num_reqs_padded: int
    ) -> tuple[torch.Tensor, ...]:
        idx = idx_mapping.to(device=self.device, dtype=torch.long)
        num_reqs = idx.shape[0]
        valid = idx >= 0
        safe = idx.clamp(min=0)
        out = []
        for g, table in enumerate(self.block_tables):
            rows = table.gpu.index_select(0, safe)
            counts = self.num_blocks.gpu[g].index_select(0, safe)
            keep = (torch.arange(table.width, device=self.device)[None, :] < counts[:, None]) & valid[:, None]
            gathered = torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=self.device))
            if num_reqs_padded > num_reqs:
                pad = torch.zeros(
                    (num_reqs_padded - num_reqs, table.width), dtype=torch.int32, device=self.device
                )
                gathered = torch.cat([gathered, pad])
            out.append(gathered[:num_reqs_padded])
        return tuple(out)

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> torch.Tensor:
        device = self.device
        idx = idx_mapping.to(device=device, dtype=torch.long)
        qsl = query_start_loc.to(device=device, dtype=torch.long)
        num_real = min(positions.shape[0], num_tokens_padded)
        out = torch.full(
            (self.num_kv_cache_groups, num_tokens_padded),
            PAD_SLOT_ID,
            dtype=self.slot_mapping_dtype,
            device=device,
        )
        n = idx.shape[0]
        if n == 0 or num_real == 0:
            return out
        # the batch row of every real token: row i owns [qsl[i], qsl[i + 1]); tokens at or past
        # qsl[-1] are padding (their slot stays -1)
        if device.type == "cpu" and int(qsl[0]) == 0:  # host integers: no synchronisation
            num_real = min(num_real, int(qsl[n]))
            lens = (qsl[1 : n + 1] - qsl[:n]).clamp(min=0)
            token_row = torch.repeat_interleave(torch.arange(n), lens)[:num_real]
            num_real = token_row.shape[0]
            valid = idx.index_select(0, token_row) >= 0
        else:
            token = torch.arange(num_real, device=device)
            token_row = torch.searchsorted(qsl[1:].contiguous(), token, right=True).clamp(max=n - 1)
            valid = (token < qsl[-1]) & (idx.index_select(0, token_row) >= 0)
        safe_req = idx.index_select(0, token_row).clamp(min=0)
        pos = positions[:num_real].to(device=device, dtype=torch.long)
        for g, table in enumerate(self.block_tables):
            bs = self.block_sizes[g]
            kbs = self.kernel_block_sizes[g]
            if self.cp_size == 1:
                local_pos = pos
                local = valid
            else:
                virtual = bs * self.cp_size
                offset = pos % virtual
                local = valid & ((offset // self.cp_interleave) % self.cp_size == self.cp_rank)
                local_pos = (
                    (pos // virtual) * bs
                    + (offset // (self.cp_interleave * self.cp_size)) * self.cp_interleave
                    + offset % self.cp_interleave
                )
            kernel_block = local_pos // kbs
            installed = self.num_blocks.gpu[g].index_select(0, safe_req)
            local = local & (kernel_block < installed)
            flat = safe_req * table.width + kernel_block.clamp(max=table.width - 1)
            slots = table.gpu.view(-1).index_select(0, flat).long() * kbs + local_pos % kbs
            out[g, :num_real] = slots.masked_fill_(~local, PAD_SLOT_ID)
        return out

"""Row registry: allocation identities -> worker block-table rows.

An identity is ``(request_id, sequence_id, None)`` for a sequence or
``(request_id, None, context_id)`` for a request-scoped context; one identity owns exactly one
worker row, and a context shared by several sequences is one row.

Rules (each has a test):

* every check runs before anything changes (BlockTables, maps, free rows);
* a native failure while writing rows rolls back the staged writes and ``num_blocks``;
* generations: the same generation and snapshot is a no-op (``False``); an older generation is
  rejected; a different snapshot for an installed request is a conflict; a newer generation
  with the same snapshot is recorded and keeps the rows;
* removal may be generation-scoped, ``(request_id, generation)``, so a late cleanup of an old
  allocation cannot remove a newer reinstall; removal is idempotent;
* free rows are handed out lowest first;
* the registry never frees scheduler blocks: it only clears its worker rows.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from diffusion_kv.core.allocation import RequestAllocation
from diffusion_kv.core.block_tables import BlockTables
from diffusion_kv.core.errors import (
    GenerationError,
    NativeBackendError,
    StateError,
    UnknownIdentityError,
    ValidationError,
)
from diffusion_kv.core.layout import CacheLayout, cdiv

Identity = tuple[str, int | None, str | None]
"""``(request_id, sequence_id, context_id)``; exactly one of the last two is not None."""


class KVCacheMode(enum.Enum):
    DENSE = "dense"
    """No paged KV: installs are refused, lookups fail, cleanup is a no-op."""
    PAGED = "paged"
    """The scheduler allocates blocks; the worker installs snapshots into rows."""


@dataclass(frozen=True)
class RowInstall:
    """One validated row of a snapshot."""

    identity: Identity
    token_len: int
    block_ids: tuple[tuple[int, ...], ...]
    cache_role: str | None = None


@dataclass(frozen=True)
class RowBinding:
    """What the translator needs to know about an installed identity."""

    row_index: int
    max_seq_len: int
    block_ids: tuple[tuple[int, ...], ...] = ()
    cache_role: str | None = None


@dataclass(frozen=True)
class _RequestState:
    generation: int
    snapshot: RequestAllocation
    installs: tuple[RowInstall, ...]


def identity_of(request_id: str, sequence_id: int | None, context_id: str | None) -> Identity:
    """The identity a lookup refers to; a context id wins over a sequence id."""
    return (request_id, None, context_id) if context_id is not None else (request_id, sequence_id, None)


class RowRegistry:
    """Installs allocation snapshots into BlockTables rows and resolves identities to rows.

    ``before_mutation`` is called before any BlockTables mutation (the translator uses it to
    invalidate prepared batches; it raises when a batch is active, which leaves everything
    unchanged). ``cache_roles``, when given, is the set of context roles some paged layer
    serves; a context with another role is rejected.
    """

    def __init__(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        *,
        mode: KVCacheMode = KVCacheMode.PAGED,
        before_mutation: Callable[[], None] | None = None,
        cache_roles: frozenset[str] | None = None,
    ) -> None:
        if len(block_tables.block_sizes) != len(layout.groups):
            raise ValidationError(
                f"BlockTables has {len(block_tables.block_sizes)} groups; the layout has {len(layout.groups)}"
            )
        self.layout = layout
        self.block_tables = block_tables
        self.mode = mode
        self.before_mutation = before_mutation
        self.cache_roles = cache_roles
        self._rows: dict[Identity, int] = {}
        self._states: dict[str, _RequestState] = {}
        self._free: list[int] = list(range(block_tables.max_num_reqs - 1, -1, -1))  # pop() gives lowest

    # -- views --------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.block_tables.max_num_reqs

    @property
    def free_rows(self) -> tuple[int, ...]:
        return tuple(reversed(self._free))

    @property
    def rows(self) -> dict[Identity, int]:
        return dict(self._rows)

    def generation_of(self, request_id: str) -> int | None:
        state = self._states.get(request_id)
        return state.generation if state is not None else None

    def installed_requests(self) -> tuple[str, ...]:
        return tuple(self._states)

    def snapshot_of(self, request_id: str) -> RequestAllocation | None:
        """The snapshot installed for ``request_id`` (None when it is not installed)."""
        state = self._states.get(request_id)
        return state.snapshot if state is not None else None

    # -- validation ---------------------------------------------------------------------------

    def _validate_row(
        self,
        identity: Identity,
        token_len: object,
        block_ids: object,
        seen: set[Identity],
        cache_role: str | None = None,
    ) -> RowInstall:
        if identity in seen:
            raise ValidationError(f"duplicate row identity {identity!r} in one snapshot")
        seen.add(identity)
        if type(token_len) is not int or token_len < 0:
            raise ValidationError(
                f"row {identity!r} has invalid token length {token_len!r}; expected an int >= 0"
            )
        groups = self.layout.groups
        # Under decode context parallelism one block id covers block_size tokens on each of the
        # cp_size ranks (vLLM's virtual block of block_size * cp_size tokens).
        cp_size = self.block_tables.cp_size
        if not isinstance(block_ids, tuple) or len(block_ids) != len(groups):
            got = len(block_ids) if isinstance(block_ids, (tuple, list)) else "invalid"
            raise ValidationError(f"row {identity!r} has {got} block groups; expected {len(groups)}")
        normalized: list[tuple[int, ...]] = []
        for g, (ids, group) in enumerate(zip(block_ids, groups, strict=True)):
            if not isinstance(ids, tuple):
                raise ValidationError(f"row {identity!r} group {g} block ids must be a tuple; got {ids!r}")
            tokens_per_block = group.block_size * cp_size
            expected = cdiv(token_len, tokens_per_block)
            if len(ids) != expected:
                raise ValidationError(
                    f"row {identity!r} group {g} has {len(ids)} blocks; expected {expected} for {token_len} "
                    f"tokens at block size {group.block_size}"
                    + (f" x cp_size {cp_size}" if cp_size > 1 else "")
                )
            capacity = cdiv(self.layout.max_model_len, tokens_per_block)
            if len(ids) > capacity:
                raise ValidationError(
                    f"row {identity!r} group {g} needs {len(ids)} blocks; row capacity is {capacity} "
                    f"(max_model_len {self.layout.max_model_len})"
                )
            for block_id in ids:
                if type(block_id) is not int:
                    raise ValidationError(f"row {identity!r} group {g} has non-integer block id {block_id!r}")
                if not 0 <= block_id < self.layout.num_blocks:
                    raise ValidationError(
                        f"row {identity!r} group {g} block id {block_id} is outside [0, {self.layout.num_blocks})"
                    )
            normalized.append(ids)
        return RowInstall(identity, token_len, tuple(normalized), cache_role)

    def _prepare(self, snapshot: RequestAllocation) -> list[RowInstall]:
        if not isinstance(snapshot, RequestAllocation):
            raise ValidationError(f"expected a RequestAllocation; got {type(snapshot).__name__}")
        rid = snapshot.request_id
        if type(rid) is not str or not rid:
            raise ValidationError(f"request_id must be a non-empty string; got {rid!r}")
        gen = snapshot.allocation_generation
        if type(gen) is not int or gen < 0:
            raise ValidationError(f"request {rid!r} allocation_generation must be an int >= 0; got {gen!r}")
        if not snapshot.sequences:
            raise ValidationError(f"request {rid!r} must contain at least one sequence")
        context_ids = {c.context_id for c in snapshot.contexts}
        seen: set[Identity] = set()
        installs: list[RowInstall] = []
        for seq in snapshot.sequences:
            sid = seq.sequence_id
            if type(sid) is not int or sid < 0:
                raise ValidationError(f"request {rid!r} sequence_id must be an int >= 0; got {sid!r}")
            identity: Identity = (rid, sid, None)
            for name in ("prefix_len", "target_len", "cached_prefix_len"):
                value = getattr(seq, name)
                if type(value) is not int or value < 0:
                    raise ValidationError(f"row {identity!r} {name} must be an int >= 0; got {value!r}")
            if type(seq.seq_len) is not int or seq.seq_len < 0:
                raise ValidationError(
                    f"row {identity!r} has invalid token length {seq.seq_len!r}; expected an int >= 0"
                )
            if seq.prefix_len + seq.target_len > seq.seq_len:
                raise ValidationError(
                    f"row {identity!r} prefix_len {seq.prefix_len} + target_len {seq.target_len} exceeds "
                    f"seq_len {seq.seq_len}"
                )
            if seq.cached_prefix_len > seq.prefix_len:
                raise ValidationError(
                    f"row {identity!r} cached_prefix_len {seq.cached_prefix_len} must lie within the stable "
                    f"prefix (prefix_len {seq.prefix_len})"
                )
            unknown = [c for c in seq.context_ids if c not in context_ids]
            if unknown:
                raise ValidationError(
                    f"row {identity!r} refers to context id(s) {unknown} not in the snapshot"
                )
            installs.append(self._validate_row(identity, seq.seq_len, seq.block_ids, seen))
        for ctx in snapshot.contexts:
            cid = ctx.context_id
            if type(cid) is not str or not cid:
                raise ValidationError(f"request {rid!r} context_id must be a non-empty string; got {cid!r}")
            identity = (rid, None, cid)
            if type(ctx.cache_role) is not str or not ctx.cache_role:
                raise ValidationError(f"row {identity!r} cache_role must be a non-empty string")
            if self.cache_roles is not None and ctx.cache_role not in self.cache_roles:
                raise ValidationError(
                    f"row {identity!r} has unregistered cache role {ctx.cache_role!r}; "
                    f"registered roles: {sorted(self.cache_roles)}"
                )
            installs.append(self._validate_row(identity, ctx.num_tokens, ctx.block_ids, seen, ctx.cache_role))
        limit = self.layout.max_rows_per_request
        if len(installs) > limit:
            raise ValidationError(
                f"request {rid!r} requires {len(installs)} rows; the per-request limit is {limit}"
            )
        return installs

    # -- mutation -----------------------------------------------------------------------------

    def _write_rows(self, rows: list[int], block_ids: list[tuple[tuple[int, ...], ...]]) -> None:
        """Stage and apply rows; on failure restore staged writes and ``num_blocks``."""
        if self.before_mutation is not None:
            self.before_mutation()
        bt = self.block_tables
        previous = bt.num_blocks.cpu[:, rows].clone()
        try:
            for row, ids in zip(rows, block_ids, strict=True):
                bt.append_block_ids(row, tuple(list(group) for group in ids), overwrite=True)
            bt.apply_staged_writes()
        except Exception as exc:
            for table in bt.block_tables:
                table.clear_staged_writes()
            bt.num_blocks.cpu[:, rows] = previous
            bt.num_blocks.copy_to_uva()
            raise NativeBackendError(
                f"BlockTables failed while writing rows {rows} ({type(exc).__name__}: {exc}); "
                "staged writes and num_blocks were rolled back"
            ) from exc

    def install(self, snapshot: RequestAllocation) -> bool:
        """Install a snapshot; ``True`` when rows were newly installed (see module rules)."""
        if self.mode is not KVCacheMode.PAGED:
            raise ValidationError("dense execution must not install paged KV allocation snapshots")
        installs = self._prepare(snapshot)
        rid, gen = snapshot.request_id, snapshot.allocation_generation
        state = self._states.get(rid)
        if state is not None:
            if gen < state.generation:
                raise GenerationError(
                    f"stale allocation generation {gen} for request {rid!r}; installed generation is {state.generation}"
                )
            if snapshot.content_key() != state.snapshot.content_key():
                raise GenerationError(
                    f"conflicting allocation snapshot for installed request {rid!r} (generation {gen} vs "
                    f"{state.generation}); remove the request before replacing its rows"
                )
            if gen > state.generation:
                self._states[rid] = _RequestState(gen, snapshot, state.installs)
            return False
        orphans = [i.identity for i in installs if i.identity in self._rows]
        if orphans:
            raise StateError(f"row registry holds orphaned identities for request {rid!r}: {orphans!r}")
        if len(installs) > len(self._free):
            raise ValidationError(
                f"request {rid!r} requires {len(installs)} rows, but only {len(self._free)} of "
                f"{self.capacity} rows are free"
            )
        rows = [self._free[-1 - k] for k in range(len(installs))]
        self._write_rows(rows, [i.block_ids for i in installs])
        del self._free[len(self._free) - len(installs) :]
        for install, row in zip(installs, rows, strict=True):
            self._rows[install.identity] = row
        self._states[rid] = _RequestState(gen, snapshot, tuple(installs))
        return True

    def remove(self, requests: Iterable[str | tuple[str, int]]) -> int:
        """Clear the rows of the given requests; returns the number of rows cleared.

        An entry ``(request_id, generation)`` removes only if that generation is installed.
        Unknown requests are ignored (idempotent). Scheduler blocks are never freed here.
        """
        if self.mode is not KVCacheMode.PAGED:
            return 0
        targets: set[str] = set()
        for entry in requests:
            if isinstance(entry, tuple):
                if len(entry) != 2 or type(entry[0]) is not str or type(entry[1]) is not int:
                    raise ValidationError(
                        f"removal entry must be request_id or (request_id, generation); got {entry!r}"
                    )
                state = self._states.get(entry[0])
                if state is not None and state.generation == entry[1]:
                    targets.add(entry[0])
            elif type(entry) is str:
                targets.add(entry)
            else:
                raise ValidationError(
                    f"removal entry must be request_id or (request_id, generation); got {entry!r}"
                )
        doomed = [(identity, row) for identity, row in self._rows.items() if identity[0] in targets]
        rows = [row for _, row in doomed]
        if rows:
            empty = tuple(() for _ in self.layout.groups)
            self._write_rows(rows, [empty] * len(rows))
        for identity, _ in doomed:
            del self._rows[identity]
        for rid in targets:
            self._states.pop(rid, None)
        self._free.extend(rows)
        self._free.sort(reverse=True)
        return len(rows)

    def refresh_layout(self) -> None:
        """Rebuild BlockTables layout tensors (after KV-cache storage was reallocated)."""
        if self.mode is not KVCacheMode.PAGED:
            return
        if self.before_mutation is not None:
            self.before_mutation()
        self.block_tables.init_block_table_layout_tensors()

    # -- lookup -------------------------------------------------------------------------------

    def row_of(self, request_id: str, sequence_id: int | None, context_id: str | None = None) -> int:
        if self.mode is not KVCacheMode.PAGED:
            raise StateError("paged KV rows are not available in dense mode")
        identity = identity_of(request_id, sequence_id, context_id)
        try:
            return self._rows[identity]
        except KeyError:
            raise UnknownIdentityError(f"no worker row is installed for {identity!r}") from None

    def resolve(self, request_id: str, sequence_id: int | None, context_id: str | None = None) -> RowBinding:
        row = self.row_of(request_id, sequence_id, context_id)
        identity = identity_of(request_id, sequence_id, context_id)
        state = self._states.get(request_id)
        if state is not None:
            for install in state.installs:
                if install.identity == identity:
                    return RowBinding(row, install.token_len, install.block_ids, install.cache_role)
        raise StateError(f"registry state is missing the logical length of {identity!r}")

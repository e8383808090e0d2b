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
* generations stay monotonic after removal: a snapshot whose generation is not newer than
  the one a removed request had is refused (late or duplicated delivery). The registry
  remembers the last generation of at most ``generation_memory`` removed request ids (least
  recently removed forgotten first; about 200 bytes each);
* retirement is removal for good: ``retire(request_id, through)`` removes the rows and leaves
  a tombstone, so every snapshot of that request up to generation ``through`` (the scheduler's
  generation when it freed the blocks: every snapshot it ever sent for them) is refused, even
  one newer than the installed generation that was still in flight. Tombstones share the
  removed-generation memory; ``generation_high_water`` is the highest generation the worker
  has seen, where a scheduler that starts over continues;
* block ownership, per KV-cache group: a block that backs a token a row will write (anything
  outside its declared cached prefix) belongs to that row alone. A block lying wholly inside
  a row's cached prefix is read-only for it and may be held by several rows, provided none of
  them writes it. A block listed twice in one row is refused;
* page provenance: a row may read only tokens written since its install (recorded by the
  translator once every paged layer ran over them) or declared computed by its snapshot
  (``cached_prefix_len``, block-aligned); it may never write inside its cached prefix;
* free rows are handed out lowest first;
* the registry never frees scheduler blocks: it only clears its worker rows;
* the row transitions are named (:class:`RowTransition`): INSTALL (a request's rows appear),
  EXTEND (a newer snapshot appends blocks to a row whose length grows), TRUNCATE (a newer
  snapshot shrinks a row back, dropping its trailing tokens and the blocks only they used: an
  aborted chunk; never together with another transition), SLIDE (a newer
  snapshot releases leading blocks, ``NULL_BLOCK`` in their place, in groups whose mask has a
  window, never the sink's), SEAL (a newer snapshot grows ``cached_prefix_len`` over written
  tokens), REMOVE; one newer snapshot may extend, slide and seal at once. Anything else is a
  conflict (remove the request first). Released tokens leave the row's readable spans. Two
  transitions come only through their own calls: REPLACE (:meth:`RowRegistry.adopt`, a
  re-cache's commit) and COMPACT (:meth:`RowRegistry.compact`: a run of released places cut
  out of a windowed row, the later positions moved down by whole chunks, so a long session's
  row stays as long as its live keys).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from typing import Any, NamedTuple, NoReturn, cast

import numpy as np

from diffusion_kv.core.allocation import NULL_BLOCK, RequestAllocation, SequenceAllocation
from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.errors import (
    GenerationError,
    NativeBackendError,
    StateError,
    UnknownIdentityError,
    ValidationError,
)
from diffusion_kv.core.layout import CacheLayout, cdiv

_INT_ONLY = frozenset({int})
"""The element types of a valid block-id list (``bool`` is not a block id)."""

Identity = tuple[str, int | None, str | None]
"""``(request_id, sequence_id, context_id)``; exactly one of the last two is not None."""

TokenSpans = tuple[tuple[int, int], ...]
"""Sorted, disjoint, non-adjacent half-open token ranges ``[a, b)``."""

DEFAULT_GENERATION_MEMORY = 16384
"""Removed request ids whose last generation the registry remembers (see module rules)."""


def add_span(spans: TokenSpans, start: int, end: int) -> TokenSpans:
    """``spans`` with ``[start, end)`` merged in."""
    if end <= start:
        return spans
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if b < start or a > end:
            out.append((a, b))
        else:
            start, end = min(a, start), max(b, end)
    out.append((start, end))
    return tuple(sorted(out))


def missing_spans(spans: TokenSpans, start: int, end: int) -> TokenSpans:
    """The parts of ``[start, end)`` that ``spans`` does not cover."""
    out: list[tuple[int, int]] = []
    cursor = start
    for a, b in spans:
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        out.append((cursor, end))
    return tuple(out)


class KVCacheMode(enum.Enum):
    DENSE = "dense"
    """No paged KV: installs are refused, lookups fail, cleanup is a no-op."""
    PAGED = "paged"
    """The scheduler allocates blocks; the worker installs snapshots into rows."""


class RowTransition(enum.Enum):
    """How an installed request's rows may change (module rules); ``install`` returns the
    transitions a snapshot made (:attr:`RowRegistry.last_transitions`)."""

    INSTALL = "install"
    EXTEND = "extend"
    TRUNCATE = "truncate"
    SLIDE = "slide"
    SEAL = "seal"
    REPLACE = "replace"
    COMPACT = "compact"
    REMOVE = "remove"


_INSTALLED = frozenset({RowTransition.INSTALL})
_COMPACTED = frozenset({RowTransition.COMPACT})


def remove_span(spans: TokenSpans, start: int, end: int) -> TokenSpans:
    """``spans`` less ``[start, end)``."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if b <= start or a >= end:
            out.append((a, b))
            continue
        if a < start:
            out.append((a, start))
        if b > end:
            out.append((end, b))
    return tuple(out)


class RowInstall(NamedTuple):
    """One validated row of a snapshot (a named tuple: an install builds one per row)."""

    identity: Identity
    token_len: int
    block_ids: tuple[tuple[int, ...], ...]
    cache_role: str | None = None
    read_only_tokens: int = 0
    """The declared cached prefix: computed elsewhere, never written by this row."""


@dataclass(frozen=True)
class RowBinding:
    """What the translator needs to know about an installed identity."""

    row_index: int
    max_seq_len: int
    block_ids: tuple[tuple[int, ...], ...] = ()
    cache_role: str | None = None
    read_only_tokens: int = 0
    """Tokens ``[0, read_only_tokens)`` are the row's cached prefix: readable, never written."""
    written: TokenSpans = ()
    """Tokens readable now: written since the install, or declared computed."""
    install_serial: int = -1
    """Which install of the identity this binding describes (writes are recorded against it)."""


WrittenSpan = tuple[Identity, int, int, int]
"""``(identity, install_serial, start, end)``: tokens a finished forward wrote into a row."""


class _RequestState:
    """An installed request: its generation, snapshot and rows (a slotted record: an install
    builds one; nothing changes it afterwards)."""

    __slots__ = ("by_identity", "generation", "installs", "snapshot")

    def __init__(
        self,
        generation: int,
        snapshot: RequestAllocation,
        installs: tuple[RowInstall, ...],
        by_identity: dict[Identity, RowInstall] | None = None,
    ) -> None:
        self.generation = generation
        self.snapshot = snapshot
        self.installs = installs
        if by_identity is None:
            by_identity = {}
            for install in installs:
                by_identity.setdefault(install.identity, install)
        self.by_identity = by_identity
        """``installs`` by identity (the first install of each), so a lookup is not a scan."""


def identity_of(request_id: str, sequence_id: int | None, context_id: str | None) -> Identity:
    """The identity a lookup refers to; a context id wins over a sequence id."""
    return (request_id, None, context_id) if context_id is not None else (request_id, sequence_id, None)


class RowRegistry:
    """Installs allocation snapshots into BlockTables rows and resolves identities to rows.

    ``before_mutation`` is called before any BlockTables mutation (the translator uses it to
    invalidate prepared batches; it raises when a batch is active, which leaves everything
    unchanged). ``cache_roles``, when given, is the set of context roles some paged layer
    serves; a context with another role is rejected. ``generation_memory`` bounds how many
    removed request ids keep their last generation (see module rules).
    """

    def __init__(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        *,
        mode: KVCacheMode = KVCacheMode.PAGED,
        before_mutation: Callable[[], None] | None = None,
        cache_roles: frozenset[str] | None = None,
        generation_memory: int = DEFAULT_GENERATION_MEMORY,
    ) -> None:
        if len(block_tables.block_sizes) != len(layout.groups):
            raise ValidationError(
                f"BlockTables has {len(block_tables.block_sizes)} groups; the layout has {len(layout.groups)}"
            )
        if type(generation_memory) is not int or generation_memory < 0:
            raise ValidationError(f"generation_memory must be an int >= 0; got {generation_memory!r}")
        self.layout = layout
        self.block_tables = block_tables
        self.mode = mode
        self.before_mutation = before_mutation
        self.cache_roles = cache_roles
        self.generation_memory = generation_memory
        self._rows: dict[Identity, int] = {}
        self._states: dict[str, _RequestState] = {}
        self._free: list[int] = list(range(block_tables.max_num_reqs - 1, -1, -1))  # pop() gives lowest
        # Block ownership per group, kept so install and remove do a few array operations per
        # row instead of Python work per block: 1 + the worker row that writes each block (0:
        # none), and the rows holding a block read-only (cached-prefix blocks only), in the
        # order they took it. _claimed: per installed request and group, the blocks its rows
        # write (what removal releases).
        self._writer: list[np.ndarray] = [np.zeros(layout.num_blocks, dtype=np.int32) for _ in layout.groups]
        # the same per group as a set: the blocks some live row writes (``_writer``'s nonzero
        # entries; every write to ``_writer`` updates it alike), so the plain install's
        # ownership check is one C set operation on the set its duplicate check built
        self._owned: list[set[int]] = [set() for _ in layout.groups]
        self._sharers: list[dict[int, dict[Identity, None]]] = [{} for _ in layout.groups]
        self._identity_at: list[Identity | None] = [None] * block_tables.max_num_reqs  # row -> identity
        # the core's own tables (not a subclass, which may stage differently) write whole rows at once
        self._whole_rows = type(block_tables) is TorchBlockTables and block_tables._host_rows
        # per group: tokens per block id (block_size x cp_size), blocks a row can hold
        self._geometry = tuple(
            (
                g.block_size * block_tables.cp_size,
                cdiv(layout.max_model_len, g.block_size * block_tables.cp_size),
            )
            for g in layout.groups
        )
        # the plain install's table write needs no per-row checks: its rows come from the free
        # list, and a row's blocks fit the table when every group's row capacity does
        self._plain_fits = self._whole_rows and all(
            capacity <= table.width
            for (_, capacity), table in zip(
                self._geometry, cast(TorchBlockTables, block_tables).block_tables, strict=True
            )
        )
        # per request: per group its blocks as an array, and as a set where the plain install built one
        self._claimed: dict[str, tuple[list[np.ndarray], list[set[int]] | None]] = {}
        self._written: dict[Identity, tuple[int, TokenSpans]] = {}  # identity -> (install serial, spans)
        # resolve()'s answers: each depends on _rows, _states and _written of its identity only,
        # and is dropped whenever one of them changes (install, a record_writes that adds tokens,
        # remove).
        self._bindings: dict[Identity, RowBinding] = {}
        self._serial = 0
        self._removed: OrderedDict[str, int] = OrderedDict()  # request id -> last generation
        self._high_water = -1  # the highest generation installed, recorded or retired
        self.last_transitions: frozenset[RowTransition] = frozenset()
        """What the last :meth:`install` that changed rows did (INSTALL, or a newer snapshot's
        EXTEND / SLIDE / SEAL)."""

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

    def removed_generation(self, request_id: str) -> int | None:
        """The last generation of a removed request (for a retired one, the generation it was
        retired through), while the registry remembers it."""
        return self._removed.get(request_id)

    @property
    def generation_high_water(self) -> int:
        """The highest allocation generation this worker has installed, recorded or retired
        (-1: none). A scheduler that starts over hands out generations above it."""
        return self._high_water

    def holders_of(self, group: int, block_id: int) -> dict[Identity, bool]:
        """The live rows holding ``block_id`` in KV-cache ``group``, each with whether it writes it."""
        writer, sharers = self._writer[group], self._sharers[group]
        if type(block_id) is not int or not 0 <= block_id < len(writer):
            return {}
        label = int(writer[block_id])
        if label:
            return {self._identity_at[label - 1]: True}  # type: ignore[dict-item]
        return dict.fromkeys(sharers.get(block_id, ()), False)

    @property
    def _holders(self) -> list[dict[int, dict[Identity, bool]]]:
        """Every held block per group, ``{block id: holders_of(group, block id)}`` (a view)."""
        out: list[dict[int, dict[Identity, bool]]] = []
        for writer, sharers in zip(self._writer, self._sharers, strict=True):
            group: dict[int, dict[Identity, bool]] = {
                int(b): {self._identity_at[int(writer[b]) - 1]: True}  # type: ignore[dict-item]
                for b in np.flatnonzero(writer)
            }
            group.update({b: dict.fromkeys(holders, False) for b, holders in sharers.items()})
            out.append(group)
        return out

    def written_spans(self, identity: Identity) -> TokenSpans:
        """Tokens of an installed row that may be read (written since install, or declared)."""
        entry = self._written.get(identity)
        return entry[1] if entry is not None else ()

    # -- validation ---------------------------------------------------------------------------

    def _validate_row(
        self,
        identity: Identity,
        token_len: object,
        block_ids: object,
        seen: set[Identity],
        cache_role: str | None = None,
        read_only_tokens: int = 0,
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
            # one pass in C for the common, valid case; the loop below names the first offence
            real = ids if NULL_BLOCK not in ids else tuple([b for b in ids if b != NULL_BLOCK])
            if real and not (
                set(map(type, real)) == _INT_ONLY
                and min(real) >= 0
                and max(real) < self.layout.num_blocks
                and len(set(real)) == len(real)
            ):
                self._explain_block_ids(identity, g, real)
            if len(real) != len(ids):
                self._check_released(identity, g, ids, read_only_tokens)
            normalized.append(ids)
        if read_only_tokens:
            for g, group in enumerate(groups):
                tokens_per_block = group.block_size * cp_size
                if read_only_tokens % tokens_per_block:
                    raise ValidationError(
                        f"row {identity!r} cached_prefix_len {read_only_tokens} must be a multiple of group {g}'s "
                        f"{tokens_per_block} tokens per block (a cached prefix is whole blocks)"
                    )
        return RowInstall(identity, token_len, tuple(normalized), cache_role, read_only_tokens)

    def _check_released(
        self, identity: Identity, g: int, ids: tuple[int, ...], read_only_tokens: int
    ) -> None:
        """``NULL_BLOCK`` places of ``ids`` only where the group's mask releases keys: a window,
        outside the sink and the cached prefix (the places are listed only for an error: a
        long session's row is mostly released places)."""
        spec = self.layout.groups[g].spec
        tokens_per_block = self.layout.groups[g].block_size * self.block_tables.cp_size
        if not spec.mask.releases:
            positions = [p for p, b in enumerate(ids) if b == NULL_BLOCK]
            raise ValidationError(
                f"row {identity!r} group {g} releases blocks at positions {positions}, but the group's mask "
                f"{spec.mask.describe()} keeps every key (only a windowed mask releases)"
            )
        first_free = max(-(-spec.mask.sink // tokens_per_block), -(-read_only_tokens // tokens_per_block))
        if NULL_BLOCK not in ids[:first_free]:
            return
        pinned = [p for p, b in enumerate(ids[:first_free]) if b == NULL_BLOCK]
        if pinned:
            raise ValidationError(
                f"row {identity!r} group {g} releases blocks {pinned}, which hold sink or cached-prefix tokens "
                f"(the first {first_free} blocks are kept)"
            )

    @staticmethod
    def _released_tokens(install: RowInstall, g: int, tokens_per_block: int) -> list[tuple[int, int]]:
        """The token ranges of the row's released (null) blocks in group ``g``, adjacent ones
        merged (a session's slid-out history is one run, however long it grew)."""
        ids = install.block_ids[g]
        if NULL_BLOCK not in ids:
            return []
        # the runs of null places in C (a long session's row is mostly one run of them)
        places = np.flatnonzero(np.fromiter(ids, dtype=np.intp, count=len(ids)) == NULL_BLOCK)
        breaks = np.flatnonzero(places[1:] != places[:-1] + 1).tolist()  # a run ends before each
        firsts = [int(places[0]), *(int(places[i + 1]) for i in breaks)]
        lasts = [*(int(places[i]) for i in breaks), int(places[-1])]
        return [
            (first * tokens_per_block, min((last + 1) * tokens_per_block, install.token_len))
            for first, last in zip(firsts, lasts, strict=True)
        ]

    def _explain_block_ids(self, identity: Identity, g: int, ids: tuple[object, ...]) -> None:
        """Raise the error for the first invalid block id of ``ids`` (group ``g``)."""
        first_at: dict[object, int] = {}
        for position, block_id in enumerate(ids):
            if type(block_id) is not int:
                raise ValidationError(f"row {identity!r} group {g} has non-integer block id {block_id!r}")
            if not 0 <= block_id < self.layout.num_blocks:
                raise ValidationError(
                    f"row {identity!r} group {g} block id {block_id} is outside [0, {self.layout.num_blocks})"
                )
            if block_id in first_at:
                raise ValidationError(
                    f"row {identity!r} group {g} lists block {block_id} twice (positions "
                    f"{first_at[block_id]} and {position}); a block backs one place of one row"
                )
            first_at[block_id] = position
        raise ValidationError(f"row {identity!r} group {g} has invalid block ids {ids!r}")  # unreachable

    def _prepare(self, snapshot: RequestAllocation) -> list[RowInstall]:
        plain = self._prepare_plain(snapshot)
        return plain[0] if plain is not None else self._prepare_checked(snapshot)

    def _prepare_plain(self, snapshot: RequestAllocation) -> tuple[list[RowInstall], list[list[int]]] | None:
        """The rows of the common snapshot -- sequences only, no released places, no block
        listed twice in the request, every check of :meth:`_prepare_checked` passing -- with
        O(1) Python work per row and group (the per-block checks run in C), and per group every
        block the rows list; ``None`` for anything else, which the checked path then validates
        (or refuses, naming the offence)."""
        if type(snapshot) is not RequestAllocation or snapshot.contexts:
            return None
        rid = snapshot.request_id
        gen = snapshot.allocation_generation
        sequences = snapshot.sequences
        if (
            type(rid) is not str
            or not rid
            or type(gen) is not int
            or gen < 0
            or not sequences
            or len(sequences) > self.layout.max_rows_per_request
        ):
            return None
        geometry = self._geometry
        num_blocks = self.layout.num_blocks
        seen: set[int] = set()
        installs: list[RowInstall] = []
        listed: list[list[int]] = [[] for _ in geometry]
        for seq in sequences:
            sid, seq_len, cached, block_ids = (
                seq.sequence_id,
                seq.seq_len,
                seq.cached_prefix_len,
                seq.block_ids,
            )
            prefix_len, target_len = seq.prefix_len, seq.target_len
            if not (
                type(sid) is int
                and sid >= 0
                and sid not in seen
                and type(seq_len) is int
                and type(prefix_len) is int
                and type(target_len) is int
                and type(cached) is int
                and 0 <= cached <= prefix_len
                and target_len >= 0
                and prefix_len + target_len <= seq_len
                and not seq.context_ids
                and type(block_ids) is tuple
                and len(block_ids) == len(geometry)
            ):
                return None
            seen.add(sid)
            for ids, (tokens_per_block, capacity), blocks in zip(block_ids, geometry, listed, strict=True):
                if not (
                    type(ids) is tuple
                    and len(ids) == -(-seq_len // tokens_per_block) <= capacity
                    and not cached % tokens_per_block
                ):
                    return None
                if ids:
                    if NULL_BLOCK in ids or set(map(type, ids)) != _INT_ONLY:
                        return None  # released places (a session's slid row) take the checked path
                    ordered = sorted(ids)  # (an int-only sort runs a specialised comparison)
                    if ordered[0] < 0 or ordered[-1] >= num_blocks:
                        return None  # NULL_BLOCK (released places) lands here too
                    blocks += ids
            installs.append(RowInstall((rid, sid, None), seq_len, block_ids, None, cached))
        for blocks in listed:
            if len(set(blocks)) != len(blocks):
                return None  # listed twice in a row (refused) or by two rows (ownership decides)
        return installs, listed

    def _prepare_checked(self, snapshot: RequestAllocation) -> list[RowInstall]:
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
            installs.append(
                self._validate_row(identity, seq.seq_len, seq.block_ids, seen, None, seq.cached_prefix_len)
            )
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

    def _check_ownership(
        self, installs: Sequence[RowInstall], listed: list[list[int]] | None = None
    ) -> list[tuple[np.ndarray, list[int]]]:
        """Refuse any block a new row writes that another live (or new) row holds, and any
        cached-prefix block another row writes (module rules). Returns, per group, the blocks
        the rows write (one array, row after row, released places dropped) and how many each
        row writes (what :meth:`_claim` records). ``listed``: from :meth:`_prepare_plain`."""
        claims: list[tuple[np.ndarray, list[int]]] = []
        if listed is not None and not any(install.read_only_tokens for install in installs):
            # every listed block is written, no place is released, none is listed twice
            for g, every in enumerate(listed):
                array = np.fromiter(every, dtype=np.intp, count=len(every))
                claims.append((array, [len(install.block_ids[g]) for install in installs]))
                sharers = self._sharers[g]
                if self._writer[g][array].any() or (sharers and not sharers.keys().isdisjoint(every)):
                    self._explain_ownership(g, self._geometry[g][0], installs)
            return claims
        for g, (tokens_per_block, written, counts, shared) in enumerate(self._held_blocks(installs)):
            blocks = np.fromiter(written, dtype=np.intp, count=len(written))
            claims.append((blocks, counts))
            # the common case in a few C-level passes: no written block is held by anybody or
            # listed twice, no shared block is written by a live or new row
            writer, sharers = self._writer[g], self._sharers[g]
            if (
                not writer[blocks].any()
                and (not sharers or sharers.keys().isdisjoint(written))
                and (len(installs) == 1 or len(set(written)) == len(written))
                and (
                    not shared
                    or (
                        not writer[np.fromiter(shared, dtype=np.intp)].any()
                        and set(shared).isdisjoint(written)
                    )
                )
            ):
                continue
            self._explain_ownership(g, tokens_per_block, installs)
        return claims

    def _held_blocks(
        self, installs: Sequence[RowInstall]
    ) -> Iterator[tuple[int, list[int], list[int], list[int]]]:
        """Per group: tokens per block, the blocks ``installs`` write (row after row, released
        places dropped), how many each row writes, and their cached-prefix blocks."""
        cp = self.block_tables.cp_size
        for g, group in enumerate(self.layout.groups):
            tokens_per_block = group.block_size * cp
            written: list[int] = []
            counts: list[int] = []
            shared: list[int] = []
            for install in installs:
                ids = install.block_ids[g]
                read_only_blocks = install.read_only_tokens // tokens_per_block
                if read_only_blocks:
                    shared += ids[:read_only_blocks]
                    ids = ids[read_only_blocks:]
                if NULL_BLOCK in ids:  # a released place is held by nobody
                    ids = tuple([b for b in ids if b != NULL_BLOCK])
                written += ids
                counts.append(len(ids))
            yield tokens_per_block, written, counts, shared

    def _claim(
        self, rid: str, claims: list[tuple[np.ndarray, list[int]]], installs: Sequence[RowInstall]
    ) -> None:
        """Record the blocks of request ``rid``'s rows (``claims`` from :meth:`_check_ownership`
        over ``installs``, every row of the request, installed)."""
        rows = [self._rows[install.identity] + 1 for install in installs]
        for writer, owned, (blocks, counts) in zip(self._writer, self._owned, claims, strict=True):
            owned.update(blocks.tolist())
            if len(rows) == 1:
                writer[blocks] = rows[0]
                continue
            start = 0
            for label, count in zip(rows, counts, strict=True):
                writer[blocks[start : start + count]] = label
                start += count
        self._claimed[rid] = ([blocks for blocks, _ in claims], None)
        for install in installs:
            if install.read_only_tokens:
                self._share(install)

    def _explain_ownership(self, g: int, tokens_per_block: int, installs: Sequence[RowInstall]) -> None:
        """Raise the error for the first block of group ``g`` that ``installs`` may not hold."""
        proposed: dict[int, tuple[Identity, bool]] = {}
        for install in installs:
            read_only_blocks = install.read_only_tokens // tokens_per_block
            for position, block_id in enumerate(install.block_ids[g]):
                if block_id == NULL_BLOCK:
                    continue
                writes = position >= read_only_blocks
                holders = self.holders_of(g, block_id)
                if block_id in proposed:
                    other, other_writes = proposed[block_id]
                    holders[other] = other_writes
                for owner, owner_writes in holders.items():
                    if writes:
                        raise ValidationError(
                            f"row {install.identity!r} group {g}: block {block_id} backs tokens this row "
                            f"writes, but row {owner!r} of request {owner[0]!r} holds it; a written block "
                            "belongs to one live row"
                        )
                    if owner_writes:
                        raise ValidationError(
                            f"row {install.identity!r} group {g}: block {block_id} lies in its cached prefix, "
                            f"but row {owner!r} of request {owner[0]!r} writes it; only blocks no live row "
                            "writes may be shared"
                        )
                if block_id not in proposed or writes:
                    proposed[block_id] = (install.identity, writes)

    # -- mutation -----------------------------------------------------------------------------

    def _write_rows(
        self,
        rows: list[int],
        block_ids: list[tuple[tuple[int, ...], ...]],
        released: bool = True,
        claims: list[tuple[np.ndarray, list[int]]] | None = None,
    ) -> None:
        """Stage and apply rows; on failure restore staged writes and ``num_blocks``.
        ``released=False``: no place of ``block_ids`` is ``NULL_BLOCK`` (nothing to map).
        ``claims``: the same ids as arrays (:meth:`_check_ownership` of a plain snapshot), which
        the core's host tables copy without converting Python ints again."""
        if self.before_mutation is not None:
            self.before_mutation()
        bt = self.block_tables
        counts = getattr(bt.num_blocks, "np", None)  # NumPy view of the host counts, where offered
        # (the whole host array: a copy of a few hundred ints is cheaper than a column gather)
        previous = counts.copy() if counts is not None else bt.num_blocks.cpu[:, rows]
        try:
            if released:  # a released place reads as the null entry (block 0, as past a row's end)
                block_ids = [
                    tuple(
                        tuple([b if b >= 0 else 0 for b in group]) if NULL_BLOCK in group else group
                        for group in ids
                    )
                    for ids in block_ids
                ]
            if self._whole_rows:
                if claims is not None:  # each row's run of each group's array (no int conversion)
                    runs: list[list[np.ndarray]] = []
                    for blocks, sizes in claims:
                        runs.append([])
                        start = 0
                        for count in sizes:
                            runs[-1].append(blocks[start : start + count])
                            start += count
                    bt.write_rows(rows, list(zip(*runs, strict=True)))  # type: ignore[attr-defined]
                    return
                bt.write_rows(rows, block_ids)  # type: ignore[attr-defined]
            else:
                for row, ids in zip(rows, block_ids, strict=True):
                    bt.append_block_ids(row, tuple(map(list, ids)), overwrite=True)
                bt.apply_staged_writes()
        except Exception as exc:
            self._restore_tables(rows, previous, exc)

    def _install_plain(self, snapshot: RequestAllocation) -> bool:
        """Install the common snapshot in one pass over its block ids per group: a request not
        installed (never, or removed at an older generation), sequences only, no cached prefix,
        no released place, no block listed twice in the request or held by a live row, enough
        free rows, the core's own host tables. Per group the set of the request's ids (its
        duplicate check) gives the ownership check against the blocks live rows write
        (``_owned``) and the claim, one array of them the table rows and the writer record.
        ``False``, nothing changed, for any other snapshot: :meth:`install`'s general path
        then installs it or refuses it, naming the offence, exactly as it always did."""
        if type(snapshot) is not RequestAllocation or snapshot.contexts or not self._plain_fits:
            return False
        rid, gen, sequences = snapshot.request_id, snapshot.allocation_generation, snapshot.sequences
        if type(rid) is not str or not rid or type(gen) is not int or gen < 0 or rid in self._states:
            return False
        removed_at = self._removed.get(rid)
        if removed_at is not None and gen <= removed_at:
            return False
        free, live = self._free, self._rows
        n = len(sequences)
        if not 0 < n <= len(free) or n > self.layout.max_rows_per_request:
            return False
        geometry = self._geometry
        num_groups = len(geometry)
        # (no comprehension: a function call of its own before Python 3.12)
        listed: list[list[int]] = [[]] if num_groups == 1 else [[] for _ in geometry]
        one_group = listed[0] if num_groups == 1 else None  # the common layout: no group loop
        tokens_per_block, capacity = geometry[0]
        installs: list[RowInstall] = []
        by_identity: dict[Identity, RowInstall] = {}
        new_tuple = tuple.__new__
        for seq in sequences:
            sid, seq_len, block_ids, cached = (
                seq.sequence_id,
                seq.seq_len,
                seq.block_ids,
                seq.cached_prefix_len,
            )
            prefix_len, target_len = seq.prefix_len, seq.target_len
            if not (
                type(sid) is int
                and sid >= 0
                and type(seq_len) is int
                and type(prefix_len) is int
                and type(target_len) is int
                and type(cached) is int
                and cached == 0
                and prefix_len >= 0
                and target_len >= 0
                and prefix_len + target_len <= seq_len
                and not seq.context_ids
                and type(block_ids) is tuple
                and len(block_ids) == num_groups
            ):
                return False
            if one_group is not None:
                ids = block_ids[0]
                if type(ids) is not tuple or not len(ids) == -(-seq_len // tokens_per_block) <= capacity:
                    return False
                one_group += ids
            else:
                for ids, (per_block, limit), blocks in zip(block_ids, geometry, listed, strict=True):
                    if type(ids) is not tuple or not len(ids) == -(-seq_len // per_block) <= limit:
                        return False
                    blocks += ids
            identity: Identity = (rid, sid, None)
            if identity in by_identity or identity in live:
                return False  # a sequence id twice, or an orphaned identity: the general path refuses
            # RowInstall(identity, seq_len, block_ids), built in C
            install = by_identity[identity] = new_tuple(RowInstall, (identity, seq_len, block_ids, None, 0))
            installs.append(install)
        num_blocks = self.layout.num_blocks
        arrays: list[np.ndarray] = []
        claimed: list[set[int]] = []
        for g, blocks in enumerate(listed):
            if not blocks:
                arrays.append(np.empty(0, dtype=np.int64))
                claimed.append(set())
                continue
            # in C: ints only (bool is no block id), none twice, within [0, num_blocks)
            unique = set(blocks)
            if not _INT_ONLY.issuperset(map(type, blocks)) or len(unique) != len(blocks):
                return False
            ordered = sorted(blocks)
            if ordered[0] < 0 or ordered[-1] >= num_blocks:
                return False
            sharers = self._sharers[g]
            if sharers and not sharers.keys().isdisjoint(unique):
                return False  # read by a live row's cached prefix
            if not self._owned[g].isdisjoint(unique):
                return False  # written by a live row
            # the ids as int64 (checked ints in range): one NumPy conversion, cheaper than
            # array.array plus np.frombuffer when the caches are cold between requests
            arrays.append(np.array(blocks, dtype=np.int64))
            claimed.append(unique)
        # every check passed: the n lowest free rows, each row's run of each group's array
        rows = free[: -n - 1 : -1]
        runs: list[list[np.ndarray]] = [[] for _ in installs]
        for g, array in enumerate(arrays):
            start = 0
            for install, run in zip(installs, runs, strict=True):
                end = start + len(install.block_ids[g])
                run.append(array[start:end])
                start = end
        if self.before_mutation is not None:
            self.before_mutation()
        bt = self.block_tables
        counts = bt.num_blocks.np  # type: ignore[attr-defined]
        previous = counts.copy()
        try:
            bt.write_rows(rows, runs, checked=False)  # type: ignore[attr-defined]
        except Exception as exc:
            self._restore_tables(rows, previous, exc)
        for g, writer in enumerate(self._writer):
            for run, row in zip(runs, rows, strict=True):
                writer[run[g]] = row + 1
            self._owned[g] |= claimed[g]
        self._bindings.clear()
        del free[-n:]
        identity_at, written = self._identity_at, self._written
        serial = self._serial
        for install, row in zip(installs, rows, strict=True):
            live[install.identity] = row
            identity_at[row] = install.identity
            serial += 1
            written[install.identity] = (serial, ())
        self._serial = serial
        self._claimed[rid] = (arrays, claimed)
        self._states[rid] = _RequestState(gen, snapshot, tuple(installs), by_identity)
        if removed_at is not None:
            del self._removed[rid]
        if gen > self._high_water:
            self._high_water = gen
        self.last_transitions = _INSTALLED
        return True

    def _restore_tables(self, rows: list[int], previous: Any, exc: Exception) -> NoReturn:
        """After a failed table write: drop staged writes, restore ``num_blocks`` (``previous``:
        the host counts before it) and raise :class:`NativeBackendError`."""
        bt = self.block_tables
        for table in bt.block_tables:
            table.clear_staged_writes()
        counts = getattr(bt.num_blocks, "np", None)
        if counts is not None:
            counts[...] = previous  # only the rows written here changed
        else:
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
        if self._install_plain(snapshot):
            return True
        plain = self._prepare_plain(snapshot)
        installs, listed = plain if plain is not None else (self._prepare_checked(snapshot), None)
        rid, gen = snapshot.request_id, snapshot.allocation_generation
        state = self._states.get(rid)
        removed_at = self._removed.get(rid)
        if state is None and removed_at is not None and gen <= removed_at:
            raise GenerationError(
                f"stale allocation generation {gen} for request {rid!r}: the request was removed at "
                f"generation {removed_at}; only a newer snapshot may install it again (late or duplicated delivery)"
            )
        if state is not None:
            if gen < state.generation:
                raise GenerationError(
                    f"stale allocation generation {gen} for request {rid!r}; installed generation is {state.generation}"
                )
            if snapshot.content_key() != state.snapshot.content_key():
                transitions = self._transitions(state.snapshot, snapshot) if gen > state.generation else None
                if transitions is None:
                    raise GenerationError(
                        f"conflicting allocation snapshot for installed request {rid!r} (generation {gen} vs "
                        f"{state.generation}); only a newer snapshot that extends, slides or seals its rows "
                        "changes them: remove the request before replacing its rows"
                    )
                self._update(state, snapshot, installs, transitions)
                return False
            if gen > state.generation:
                self._states[rid] = _RequestState(gen, snapshot, state.installs)
                self._bindings.clear()
                self._high_water = max(self._high_water, gen)
            return False
        orphans = [i.identity for i in installs if i.identity in self._rows]
        if orphans:
            raise StateError(f"row registry holds orphaned identities for request {rid!r}: {orphans!r}")
        claims = self._check_ownership(installs, listed)
        if len(installs) > len(self._free):
            raise ValidationError(
                f"request {rid!r} requires {len(installs)} rows, but only {len(self._free)} of "
                f"{self.capacity} rows are free"
            )
        rows = [self._free[-1 - k] for k in range(len(installs))]
        self._write_rows(
            rows,
            [i.block_ids for i in installs],
            released=listed is None,
            # the claimed blocks are every block of the rows when none has a cached prefix
            claims=claims if listed is not None and not any(i.read_only_tokens for i in installs) else None,
        )
        self._bindings.clear()
        del self._free[len(self._free) - len(installs) :]
        for install, row in zip(installs, rows, strict=True):
            self._rows[install.identity] = row
            self._identity_at[row] = install.identity
            self._serial += 1
            declared: TokenSpans = ((0, install.read_only_tokens),) if install.read_only_tokens else ()
            self._written[install.identity] = (self._serial, declared)
        self._claim(rid, claims, installs)
        self._states[rid] = _RequestState(gen, snapshot, tuple(installs))
        self._removed.pop(rid, None)
        self._high_water = max(self._high_water, gen)
        self.last_transitions = _INSTALLED
        return True

    def seal(self, snapshot: RequestAllocation) -> bool:
        """Take ``snapshot`` only as a seal of a request this registry holds (what prefix
        caching's publish hands over): :class:`StateError` when the request is not installed --
        its rows never wrote the tokens the seal declares computed, and a fresh install would
        declare them all the same -- and otherwise exactly :meth:`install`."""
        if (
            self.mode is KVCacheMode.PAGED
            and isinstance(snapshot, RequestAllocation)
            and snapshot.request_id not in self._states
        ):
            raise StateError(
                f"cannot seal request {snapshot.request_id!r}: it is not installed, so its rows wrote "
                "none of the tokens the seal would declare computed"
            )
        return self.install(snapshot)

    def adopt(
        self, snapshot: RequestAllocation, donor: str, readable: Sequence[tuple[int, int]] | None = None
    ) -> bool:
        """REPLACE: take ``snapshot`` -- one generation newer than the installed one, the same
        rows, lengths and released places, other blocks at the live places -- where those blocks
        are exactly the rows of the installed request ``donor`` (same sequence ids, lengths and
        released places), whose rows wrote every token ``snapshot``'s rows can read now. Every
        check runs first; then the donor's rows are removed and the request's rows point at the
        donor's blocks with their readable spans unchanged (a re-cache's commit: the donor was a
        shadow row the host recomputed). ``readable``: the token spans every row may read from
        now on, when that is fewer than today's (within them; a re-cache after the window slid
        recomputes the live keys only) -- the donor must have written those, and the rest stops
        being readable. A row may drop its cached prefix (``cached_prefix_len`` 0 in
        ``snapshot``): the donor's private blocks replace the shared ones, which the row stops
        holding, and its tokens there stay readable (the donor wrote them). Returns False (rows
        changed, none added)."""
        if self.mode is not KVCacheMode.PAGED:
            raise StateError("paged KV rows are not available in dense mode")
        installs = self._prepare(snapshot)
        rid = snapshot.request_id
        state, source = self._states.get(rid), self._states.get(donor) if type(donor) is str else None
        if state is None or source is None or donor == rid:
            raise StateError(f"adopt: request {rid!r} and a different donor {donor!r} must both be installed")
        if snapshot.allocation_generation <= state.generation:
            raise GenerationError(
                f"adopt of request {rid!r}: generation {snapshot.allocation_generation} is not newer than the "
                f"installed {state.generation}"
            )
        old, given = state.snapshot, source.snapshot
        narrowed: TokenSpans | None = None
        if readable is not None:
            narrowed = ()
            for a0, b0 in readable:
                if type(a0) is not int or type(b0) is not int or not 0 <= a0 < b0:
                    raise ValidationError(
                        f"adopt of request {rid!r}: readable spans must be (start < end); got {readable!r}"
                    )
                narrowed = add_span(narrowed, a0, b0)
        if (
            old.contexts
            or snapshot.contexts
            or given.contexts
            or not (len(old.sequences) == len(snapshot.sequences) == len(given.sequences))
        ):
            raise ValidationError(
                f"adopt of request {rid!r} from {donor!r}: the rows must match one to one (sequences only)"
            )
        for a, b, d in zip(old.sequences, snapshot.sequences, given.sequences, strict=True):
            kept = replace_ids(a)
            if b.cached_prefix_len == 0 and a.cached_prefix_len:  # the donor's blocks replace shared ones
                kept = dc_replace(kept, cached_prefix_len=0)
            if kept != replace_ids(b) or (d.sequence_id, d.seq_len, d.block_ids) != (
                b.sequence_id,
                b.seq_len,
                b.block_ids,
            ):
                raise ValidationError(
                    f"adopt of request {rid!r} sequence {b.sequence_id}: the new snapshot must keep the row's "
                    f"lengths and take donor {donor!r}'s blocks {d.block_ids!r} exactly"
                )
            for old_ids, new_ids in zip(a.block_ids, b.block_ids, strict=True):
                if [x == NULL_BLOCK for x in old_ids] != [x == NULL_BLOCK for x in new_ids]:
                    raise ValidationError(
                        f"adopt of request {rid!r} sequence {b.sequence_id}: released places differ "
                        f"({old_ids!r} vs {new_ids!r})"
                    )
            now = self.written_spans((rid, b.sequence_id, None))
            if narrowed is not None:
                beyond = tuple(g for a0, b0 in narrowed for g in missing_spans(now, a0, b0))
                if beyond:
                    raise ValidationError(
                        f"adopt of request {rid!r} sequence {b.sequence_id}: readable spans {list(narrowed)} "
                        f"reach tokens {list(beyond)} the row cannot read now"
                    )
            donor_spans = self.written_spans((donor, d.sequence_id, None))
            wanted = narrowed if narrowed is not None else now
            gap = tuple(g for a0, b0 in wanted for g in missing_spans(donor_spans, a0, b0))
            if gap:
                raise StateError(
                    f"adopt of request {rid!r} sequence {b.sequence_id}: donor {donor!r} never wrote tokens "
                    f"{list(gap)} the row reads"
                )
        self.remove(donor)  # the donor's blocks are the rows' now (a failure below keeps the old rows)
        self._update(state, snapshot, installs, frozenset({RowTransition.REPLACE}))
        if narrowed is not None:
            for install in installs:
                entry = self._written.get(install.identity)
                if entry is not None:
                    self._written[install.identity] = (entry[0], narrowed)
                    self._bindings.pop(install.identity, None)
        return False

    def compact(self, snapshot: RequestAllocation, at: int, tokens: int) -> bool:
        """COMPACT: take ``snapshot`` -- one generation newer than the installed one -- whose rows
        are the installed rows with the token range ``[at, at + tokens)`` cut out. Every place of
        that range must be released (``NULL_BLOCK``) in every row and group, ``at`` and ``tokens``
        whole blocks of every group, ``at`` at or past each group's sink and every row's prefix,
        and the shift invisible to the masks: a CHUNK_CAUSAL group's ``tokens`` a multiple of its
        chunk. The rows' lengths drop by ``tokens``; a token at ``t >= at + tokens`` moves to
        ``t - tokens`` with its readable span; the blocks held stay held. Every query page
        provenance accepted before sees the same keys after (it read nothing in the cut, so its
        window starts at or past ``at + tokens``, and the mask is the same shifted by whole
        chunks). What keeps a session's row as long as its live keys, however long the stream
        (``docs/sessions.md``). Every check runs first; returns False (rows changed, none added)."""
        if self.mode is not KVCacheMode.PAGED:
            raise StateError("paged KV rows are not available in dense mode")
        if not isinstance(snapshot, RequestAllocation):
            raise ValidationError(f"compact takes a RequestAllocation; got {type(snapshot).__name__}")
        rid = snapshot.request_id
        state = self._states.get(rid) if type(rid) is str else None
        if state is None:
            raise StateError(f"compact of request {rid!r}, which is not installed")
        if type(at) is not int or type(tokens) is not int or at < 0 or tokens <= 0:
            raise ValidationError(
                f"compact of request {rid!r} takes a start >= 0 and a positive token count; got at={at!r}, "
                f"tokens={tokens!r}"
            )
        gen = snapshot.allocation_generation
        if type(gen) is not int or gen <= state.generation:
            raise GenerationError(
                f"compact of request {rid!r}: generation {gen!r} is not newer than the installed {state.generation}"
            )
        places: list[tuple[int, int]] = []  # per group: (first place cut, places cut)
        for g, ((tokens_per_block, _), group) in enumerate(
            zip(self._geometry, self.layout.groups, strict=True)
        ):
            mask = group.spec.mask
            if at % tokens_per_block or tokens % tokens_per_block:
                raise ValidationError(
                    f"compact of request {rid!r}: [{at}, {at + tokens}) is not whole blocks of group {g} "
                    f"({tokens_per_block} tokens per block)"
                )
            if not mask.releases or at < mask.sink:
                raise ValidationError(
                    f"compact of request {rid!r}: group {g}'s mask {mask.describe()} "
                    + (
                        "keeps every key"
                        if not mask.releases
                        else f"pins its first {mask.sink} tokens (the sink)"
                    )
                    + f"; tokens from {at} cannot be cut"
                )
            if mask.chunk is not None and tokens % mask.chunk:
                raise ValidationError(
                    f"compact of request {rid!r}: {tokens} tokens is not whole chunks of group {g}'s mask "
                    f"{mask.describe()} (the chunk boundaries would move)"
                )
            places.append((at // tokens_per_block, tokens // tokens_per_block))
        old = state.snapshot
        if snapshot.contexts or old.contexts or len(snapshot.sequences) != len(old.sequences):
            raise ValidationError(f"compact of request {rid!r}: the same sequences, no contexts")
        for a, b in zip(old.sequences, snapshot.sequences, strict=True):
            if a.seq_len < at + tokens or max(a.prefix_len, a.cached_prefix_len) > at:
                raise ValidationError(
                    f"compact of request {rid!r} sequence {a.sequence_id}: [{at}, {at + tokens}) must lie in the "
                    f"row's target ({a.seq_len} tokens, prefix {a.prefix_len}, cached {a.cached_prefix_len})"
                )
            cut = []
            for (first, count), ids in zip(places, a.block_ids, strict=True):
                if any(x != NULL_BLOCK for x in ids[first : first + count]):
                    raise ValidationError(
                        f"compact of request {rid!r} sequence {a.sequence_id}: places {first}..{first + count - 1} "
                        "must all be released (NULL_BLOCK) before they are cut"
                    )
                cut.append(ids[:first] + ids[first + count :])
            want = dc_replace(
                a, seq_len=a.seq_len - tokens, target_len=a.target_len - tokens, block_ids=tuple(cut)
            )
            if b != want:
                raise ValidationError(
                    f"compact of request {rid!r} sequence {a.sequence_id}: the new snapshot must be the row less "
                    f"[{at}, {at + tokens}) ({want!r}); got {b!r}"
                )
        installs = self._prepare(snapshot)
        spans: dict[Identity, tuple[int, TokenSpans]] = {}
        for install in installs:
            entry = self._written.get(install.identity)
            if entry is None:
                continue
            if missing_spans(entry[1], at, at + tokens) != ((at, at + tokens),):
                raise StateError(
                    f"compact of request {rid!r}: row {install.identity!r} can still read tokens in "
                    f"[{at}, {at + tokens}) ({list(entry[1])})"
                )
            spans[install.identity] = (
                entry[0],
                tuple((x, y) if y <= at else (x - tokens, y - tokens) for x, y in entry[1]),
            )
        rows = [self._rows[i.identity] for i in installs]
        self._write_rows(rows, [i.block_ids for i in installs])  # rolls back on a native failure
        self._written.update(spans)
        self._states[rid] = _RequestState(gen, snapshot, tuple(installs))
        self._bindings.clear()
        self._high_water = max(self._high_water, gen)
        self.last_transitions = _COMPACTED
        return False

    @staticmethod
    def _transitions(old: RequestAllocation, new: RequestAllocation) -> frozenset[RowTransition] | None:
        """What a newer snapshot does to the installed rows, or None when it is none of the
        named transitions (module rules): the same rows and contexts; per row, a length that
        grows (EXTEND: blocks appended) or shrinks (TRUNCATE: trailing tokens and the blocks
        only they used dropped), places that only turn into ``NULL_BLOCK`` (SLIDE), a cached
        prefix that only grows (SEAL)."""
        if old.contexts != new.contexts or len(old.sequences) != len(new.sequences):
            return None
        found: set[RowTransition] = set()
        for a, b in zip(old.sequences, new.sequences, strict=True):
            if (a.sequence_id, a.prefix_len, a.context_ids) != (b.sequence_id, b.prefix_len, b.context_ids):
                return None
            if b.cached_prefix_len < a.cached_prefix_len or len(a.block_ids) != len(b.block_ids):
                return None
            if b.seq_len - a.seq_len != b.target_len - a.target_len:
                return None  # the target grows or shrinks with the row, the prefix stays
            if b.seq_len > a.seq_len:
                found.add(RowTransition.EXTEND)
            elif b.seq_len < a.seq_len:
                if b.cached_prefix_len > b.seq_len:
                    return None
                found.add(RowTransition.TRUNCATE)
            if b.cached_prefix_len > a.cached_prefix_len:
                found.add(RowTransition.SEAL)
            for old_ids, new_ids in zip(a.block_ids, b.block_ids, strict=True):
                if len(new_ids) > len(old_ids) and NULL_BLOCK in new_ids[len(old_ids) :]:
                    return None
                common = min(len(old_ids), len(new_ids))
                if old_ids[:common] == new_ids[:common]:
                    continue  # no place changed (an EXTEND or TRUNCATE): compared in C
                # the shorter list's places, in C: each changed place must turn into NULL_BLOCK
                before = np.fromiter(old_ids[:common], dtype=np.intp, count=common)
                after = np.fromiter(new_ids[:common], dtype=np.intp, count=common)
                if (after[before != after] != NULL_BLOCK).any():
                    return None  # a place changed its block: a replacement, not a transition
                found.add(RowTransition.SLIDE)
        if RowTransition.TRUNCATE in found and len(found) > 1:
            return None  # a truncation (an aborted chunk) comes alone
        return frozenset(found) if found else None

    def _update(
        self,
        state: _RequestState,
        snapshot: RequestAllocation,
        installs: list[RowInstall],
        transitions: frozenset[RowTransition],
    ) -> None:
        """Apply an EXTEND / TRUNCATE / SLIDE / SEAL snapshot: every check first (sealed tokens written,
        appended blocks owned by nobody), then the tables, holders and readable spans."""
        rid = snapshot.request_id
        changed = [i for i in installs if i != state.by_identity[i.identity]]
        for install in changed:
            before = state.by_identity[install.identity]
            if install.read_only_tokens > before.read_only_tokens:
                gap = missing_spans(self.written_spans(install.identity), 0, install.read_only_tokens)
                if gap:
                    raise StateError(
                        f"row {install.identity!r} cannot seal its first {install.read_only_tokens} tokens as a "
                        f"cached prefix: tokens {list(gap)} were never written"
                    )
        befores = [state.by_identity[i.identity] for i in changed]
        for before in befores:
            self._hold(before, release=True)
        try:
            self._check_ownership(changed)  # appended blocks: nobody else may hold them
        except ValidationError:
            for before in befores:
                self._hold(before)
            raise
        relaid = [i for i, b in zip(changed, befores, strict=True) if i.block_ids != b.block_ids]
        try:
            if relaid:
                self._write_rows([self._rows[i.identity] for i in relaid], [i.block_ids for i in relaid])
            elif self.before_mutation is not None:
                self.before_mutation()
        except Exception:
            for before in befores:
                self._hold(before)
            raise
        cp = self.block_tables.cp_size
        for install in changed:
            self._hold(install)
            entry = self._written.get(install.identity)
            if entry is None:
                continue
            spans = remove_span(entry[1], install.token_len, self.layout.max_model_len + 1)
            for g, group in enumerate(self.layout.groups):
                for start, end in self._released_tokens(install, g, group.block_size * cp):
                    spans = remove_span(spans, start, end)
            self._written[install.identity] = (entry[0], spans)
        self._claimed[rid] = (
            [
                np.fromiter(written, dtype=np.intp, count=len(written))
                for _, written, _, _ in self._held_blocks(installs)
            ],
            None,
        )
        self._states[rid] = _RequestState(snapshot.allocation_generation, snapshot, tuple(installs))
        self._bindings.clear()
        self._high_water = max(self._high_water, snapshot.allocation_generation)
        self.last_transitions = transitions

    def _share(self, install: RowInstall, release: bool = False) -> None:
        """Record (or, ``release``, drop) ``install``'s row as a read-only holder of its
        cached-prefix blocks."""
        cp = self.block_tables.cp_size
        identity = install.identity
        for g, group in enumerate(self.layout.groups):
            read_only_blocks = install.read_only_tokens // (group.block_size * cp)
            sharers = self._sharers[g]
            for block_id in install.block_ids[g][:read_only_blocks]:
                if release:
                    entry = sharers.get(block_id)
                    if entry is not None:
                        entry.pop(identity, None)
                        if not entry:
                            del sharers[block_id]
                else:
                    sharers.setdefault(block_id, {})[identity] = None

    def _hold(self, install: RowInstall, release: bool = False) -> None:
        """Record (or, ``release``, drop) the blocks one installed row holds (a transition
        re-holds its changed rows; :meth:`_claim` records whole requests)."""
        label = 0 if release else self._rows[install.identity] + 1
        for writer, owned, (_, written, _, _) in zip(
            self._writer, self._owned, self._held_blocks((install,)), strict=True
        ):
            if written:
                writer[np.fromiter(written, dtype=np.intp, count=len(written))] = label
                if release:
                    owned.difference_update(written)
                else:
                    owned.update(written)
        if install.read_only_tokens:
            self._share(install, release)

    def _release(self, rid: str, installs: Sequence[RowInstall]) -> None:
        """Drop every block request ``rid``'s rows (``installs``) hold."""
        arrays, sets = self._claimed.pop(rid)
        for g, (writer, owned, blocks) in enumerate(zip(self._writer, self._owned, arrays, strict=True)):
            writer[blocks] = 0
            owned -= sets[g] if sets is not None else set(blocks.tolist())
        for install in installs:
            if install.read_only_tokens:
                self._share(install, release=True)

    def record_writes(self, spans: Iterable[WrittenSpan]) -> None:
        """Mark tokens as written (the translator calls this when every paged layer of a batch
        ran); spans of an identity that was removed or reinstalled since are ignored."""
        for identity, serial, start, end in spans:
            entry = self._written.get(identity)
            if entry is None or entry[0] != serial or end <= start:
                continue
            for a, b in entry[1]:
                if a <= start and end <= b:  # written already (a denoise step rewrites its span):
                    break  # nothing changes, and the kept binding stays valid
            else:
                self._written[identity] = (serial, add_span(entry[1], start, end))
                self._bindings.pop(identity, None)

    def remove(self, requests: str | tuple[str, int] | Iterable[str | tuple[str, int]]) -> int:
        """Clear the rows of the given requests; returns the number of rows cleared.

        ``requests`` is one entry or an iterable of entries; an entry is a request id, or
        ``(request_id, generation)``, which removes only if that generation is installed.
        Unknown requests are ignored (idempotent). Scheduler blocks are never freed here.
        """
        entries = removal_entries(requests)
        if self.mode is not KVCacheMode.PAGED:
            return 0
        targets: set[str] = set()
        for entry in entries:
            if isinstance(entry, tuple):
                state = self._states.get(entry[0])
                if state is not None and state.generation == entry[1]:
                    targets.add(entry[0])
            elif entry in self._states:
                targets.add(entry)
        doomed = [
            (install.identity, self._rows[install.identity])
            for rid in targets
            for install in self._states[rid].installs
            if install.identity in self._rows
        ]
        rows = [row for _, row in doomed]
        if targets:
            self._bindings.clear()
        if rows:
            empty = tuple(() for _ in self.layout.groups)
            self._write_rows(rows, [empty] * len(rows), released=False)
        for identity, row in doomed:
            del self._rows[identity]
            self._identity_at[row] = None
            self._written.pop(identity, None)
        for rid in targets:
            state = self._states.pop(rid)
            self._release(rid, state.installs)
            self._remember_removed(rid, state.generation)
        self._free.extend(rows)
        self._free.sort(reverse=True)
        return len(rows)

    def retire(self, request_id: str, through_generation: int) -> int:
        """Remove ``request_id`` for good: its rows are cleared (as :meth:`remove` does) and every
        snapshot of it with a generation up to ``through_generation`` is refused from now on
        (see module rules). Retiring a request that is not installed only leaves the tombstone.
        A request installed at a generation newer than ``through_generation`` belongs to a later
        reservation: :class:`GenerationError`, nothing changes. Returns the rows cleared."""
        if type(request_id) is not str or not request_id:
            raise ValidationError(f"retire takes a non-empty request id string; got {request_id!r}")
        if type(through_generation) is not int or through_generation < 0:
            raise ValidationError(
                f"retire of request {request_id!r}: through_generation must be an int >= 0; "
                f"got {through_generation!r}"
            )
        if self.mode is not KVCacheMode.PAGED:
            return 0
        state = self._states.get(request_id)
        if state is not None and state.generation > through_generation:
            raise GenerationError(
                f"request {request_id!r} is installed at generation {state.generation}, newer than the "
                f"retirement through generation {through_generation}: a later reservation owns it"
            )
        cleared = self.remove(request_id) if state is not None else 0
        last = max(through_generation, self._removed.get(request_id, -1))
        self._remember_removed(request_id, last)
        self._high_water = max(self._high_water, through_generation)
        return cleared

    def _remember_removed(self, request_id: str, generation: int) -> None:
        if self.generation_memory == 0:
            return
        self._removed.pop(request_id, None)
        self._removed[request_id] = generation
        while len(self._removed) > self.generation_memory:
            self._removed.popitem(last=False)

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

    def resolve_identities(self, identities: Sequence[Identity]) -> list[RowBinding]:
        """:meth:`resolve` of each ``(request_id, sequence_id, context_id)``, in order: the
        translator's one call per batch. Identities with an answer kept since the last change
        are found in one pass; any other (or dense mode) goes through :meth:`resolve`, which
        refuses it exactly as a call of its own would."""
        if self.mode is KVCacheMode.PAGED:
            get = self._bindings.get
            found = [get(identity) for identity in identities]
            if all(found):  # a RowBinding is always true: no None among them
                return found  # type: ignore[return-value]
        return [self.resolve(*identity) for identity in identities]

    def resolve(self, request_id: str, sequence_id: int | None, context_id: str | None = None) -> RowBinding:
        # identity_of, inlined: the translator resolves every row of every batch
        identity = (
            (request_id, None, context_id) if context_id is not None else (request_id, sequence_id, None)
        )
        if self.mode is KVCacheMode.PAGED:
            binding = self._bindings.get(identity)
            if binding is not None:
                return binding
        row = self.row_of(request_id, sequence_id, context_id)
        state = self._states.get(request_id)
        install = state.by_identity.get(identity) if state is not None else None
        if install is not None:
            serial, written = self._written[identity]
            binding = self._bindings[identity] = RowBinding(
                row,
                install.token_len,
                install.block_ids,
                install.cache_role,
                install.read_only_tokens,
                written,
                serial,
            )
            return binding
        raise StateError(f"registry state is missing the logical length of {identity!r}")


def replace_ids(seq: SequenceAllocation) -> SequenceAllocation:
    """``seq`` without its block ids (what a REPLACE keeps)."""
    return dc_replace(seq, block_ids=())


def removal_entries(requests: object) -> list[str | tuple[str, int]]:
    """Normalise what ``remove`` accepts: one entry or an iterable of entries (module rules)."""

    def entry_ok(entry: object) -> bool:
        if isinstance(entry, tuple):
            return (
                len(entry) == 2
                and type(entry[0]) is str
                and bool(entry[0])
                and type(entry[1]) is int
                and entry[1] >= 0
            )
        return type(entry) is str and bool(entry)

    if type(requests) is str or (
        isinstance(requests, tuple) and len(requests) == 2 and type(requests[1]) is int
    ):
        candidates: list[object] = [requests]
    elif isinstance(requests, (bytes, Mapping)) or not isinstance(requests, Iterable):
        raise ValidationError(
            "remove takes a request id, a (request_id, generation) pair, or an iterable of them; "
            f"got {type(requests).__name__} {requests!r}"
        )
    else:
        candidates = list(requests)
    for entry in candidates:
        if not entry_ok(entry):
            raise ValidationError(
                f"removal entry must be a non-empty request_id or (request_id, generation >= 0); got {entry!r}"
            )
    return candidates  # type: ignore[return-value]

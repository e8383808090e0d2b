"""Scheduler-side block allocation for standalone use.

:class:`DiffusionKVAllocator` reserves, all or nothing, the blocks of every sequence (CFG row)
of a request plus its request-scoped contexts (each context once, however many sequences use
it), and produces the :class:`~diffusion_kv.core.allocation.RequestAllocation` the worker
installs. ``reserve`` answers:

* a snapshot, when everything fits now;
* ``None`` ("wait"), when the request fits an empty pool but not the current one, or when the
  worker has too few free rows (back-pressure, checked before any block is taken);
* :class:`AdmissionError`, when it can never fit (too many rows, longer than
  ``max_model_len``, more blocks than the pool has).

Reserving an already-reserved request again with the same :class:`KVRequest` returns the same
blocks with a new generation; a different request under a reserved id is an
:class:`AdmissionError` (free it first). The allocator applies the worker's rules to ids,
lengths and contexts (non-empty string ids, integer ``sequence_id >= 0``, integer lengths
``>= 0``, never a bool or a float), so nothing the worker would refuse is ever reserved.
``free`` is idempotent per request; :meth:`FreeListPool.free` refuses a block listed twice and
any double free, atomically. Generations increase monotonically across all requests, and
:meth:`DiffusionKVAllocator.advance_generation` moves them past what a worker has already seen
(a scheduler starting over on a live worker continues above its high-water mark).

A worker with several KV-cache groups (causal and full layers, say) needs blocks in every
group: ``num_groups`` gives each row the same block ids in each of them (one block id is one
block of every layer, as :meth:`~diffusion_kv.core.runner.PagedWorker.kv_bytes_per_block`
counts it).

The block source is a :class:`BlockPool`; vLLM's own ``KVCacheManager`` can take the
allocator's place in vLLM-Omni, since the worker only sees snapshots.

**Prefix caching** (``prefix_cache=PrefixCache(...)``; off by default). A sequence may carry
``prefix_keys``: the chained keys of the leading full blocks of its prefix that may be shared
(:mod:`diffusion_kv.core.prefix_cache` computes them). ``reserve`` reuses the blocks of the
longest leading run of keys that is cached -- the snapshot declares them as the row's
``cached_prefix_len``, read-only -- takes a reference to each, and allocates only the rest;
when the pool is short it evicts unreferenced cached blocks, least recently used first.
Once the request has written its prefix, :meth:`DiffusionKVAllocator.publish` seals the rest
of its keyed blocks (a new snapshot whose ``cached_prefix_len`` covers them, handed first to
the worker's :meth:`~diffusion_kv.core.runner.PagedWorker.seal`, which refuses a request it
does not hold or tokens its rows never wrote) and caches them under their keys, so later
requests hit them while it is still live. ``free`` drops the request's references; its
unpublished blocks go back to the pool, its cached ones stay until evicted. A snapshot
references a cached block only under the key it was published with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from diffusion_kv.core.allocation import NULL_BLOCK, ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.prefix_cache import PrefixCache


class AdmissionError(ValidationError):
    """The request can never be admitted, whatever is freed."""


class BlockPool(Protocol):
    @property
    def num_total(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int] | None:
        """``n`` block ids, or None (and nothing taken) when fewer are free."""
        ...

    def free(self, block_ids: Sequence[int]) -> None: ...


def free_runs(free: Iterable[int]) -> list[tuple[int, int]]:
    """``(first, length)`` of every run of consecutive ids in ``free``, in id order."""
    runs: list[tuple[int, int]] = []
    for b in sorted(free):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class FreeListPool:
    """Block ids ``0 .. num_blocks-1``, handed out as contiguous runs where possible.

    ``allocate(n)`` takes the first ``n`` ids of the smallest free run that holds ``n`` (best
    fit; the lowest such run on a tie), so one request's rows land back to back and the large
    runs stay whole; only when no run is long enough does it take whole runs, longest first.
    Contiguous pages let a backend read a row (or all rows of a request) as one strided view
    instead of gathering them. :meth:`fragmentation` reports how split the free space is.
    """

    def __init__(self, num_blocks: int) -> None:
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValidationError(f"num_blocks must be a positive integer; got {num_blocks!r}")
        self._total = num_blocks
        self._free: set[int] = set(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if type(n) is not int or n < 0:
            raise ValidationError(f"allocate takes a block count, an int >= 0; got {n!r}")
        if n > len(self._free):
            return None
        runs = free_runs(self._free)
        fitting = [run for run in runs if run[1] >= n]
        if fitting:
            first, _ = min(fitting, key=lambda run: (run[1], run[0]))
            out = list(range(first, first + n))
        else:  # fragmented: whole runs, longest first, then the rest of the last one
            out = []
            for first, length in sorted(runs, key=lambda run: (-run[1], run[0])):
                out.extend(range(first, first + min(length, n - len(out))))
                if len(out) == n:
                    break
        self._free.difference_update(out)
        self._used.update(out)
        return out

    def fragmentation(self) -> dict[str, float | int]:
        """Free blocks, free runs, the longest run, and ``1 - longest / free`` (0: one run)."""
        runs = free_runs(self._free)
        longest = max((length for _, length in runs), default=0)
        return {
            "free_blocks": len(self._free),
            "free_runs": len(runs),
            "longest_free_run": longest,
            "fragmentation": 1 - longest / len(self._free) if self._free else 0.0,
        }

    def free(self, block_ids: Sequence[int]) -> None:
        """Return blocks to the pool; all or nothing (a bad id frees none of them)."""
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Iterable):
            raise ValidationError(f"free takes a sequence of block ids; got {block_ids!r}")
        ids = list(block_ids)
        seen: set[int] = set()
        for b in ids:
            if type(b) is not int or not 0 <= b < self._total:
                raise ValidationError(f"block id {b!r} is not an int in [0, {self._total})")
            if b in seen:
                raise ValidationError(f"block {b} is listed twice in one free call")
            if b not in self._used:
                raise ValidationError(f"block {b} is not allocated (double free?)")
            seen.add(b)
        for b in ids:
            self._used.discard(b)
            self._free.add(b)


@dataclass(frozen=True)
class SequenceRequest:
    sequence_id: int
    prefix_len: int
    target_len: int
    context_ids: tuple[str, ...] = ()
    prefix_keys: tuple[bytes, ...] = ()
    """Chained keys of the leading full prefix blocks that may be shared (prefix caching);
    empty: the row is never cached and never hits."""


@dataclass(frozen=True)
class ContextRequest:
    context_id: str
    cache_role: str
    num_tokens: int


@dataclass(frozen=True)
class KVRequest:
    """What the scheduler must reserve for one public request."""

    request_id: str
    sequences: tuple[SequenceRequest, ...]
    contexts: tuple[ContextRequest, ...] = ()

    @property
    def num_rows(self) -> int:
        return len(self.sequences) + len(self.contexts)


@dataclass
class _Reservation:
    request: KVRequest
    allocation: RequestAllocation
    block_ids: list[int] = field(default_factory=list)
    """Every block the request's rows use (hit, published and its own)."""
    private: list[int] = field(default_factory=list)
    """Blocks taken from the pool for this request alone (returned to it by ``free``)."""
    held: list[list[bytes]] = field(default_factory=list)
    """Per sequence, the cached keys it holds a reference to (hit or published), in order."""


def _resized(
    alloc: SequenceAllocation, target_len: int, seq_len: int, block_ids: tuple[tuple[int, ...], ...]
) -> SequenceAllocation:
    """``replace(alloc, target_len=..., seq_len=..., block_ids=...)`` for fields already in
    normal form, without ``dataclasses.replace``'s per-call field walk (a session's every
    append, commit and abort builds one per branch)."""
    return SequenceAllocation.normalised(
        alloc.sequence_id,
        alloc.prefix_len,
        target_len,
        seq_len,
        block_ids,
        alloc.context_ids,
        alloc.cached_prefix_len,
    )


def _check_id(request_id: object, call: str) -> None:
    if type(request_id) is not str or not request_id:
        raise ValidationError(f"{call} takes a non-empty request id string; got {request_id!r}")


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


class DiffusionKVAllocator:
    """All-or-nothing multi-row reservation over one block pool (one KV-cache group)."""

    def __init__(
        self,
        *,
        block_size: int,
        max_model_len: int,
        max_rows_per_request: int,
        worker_rows: int,
        pool: BlockPool,
        num_groups: int = 1,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_model_len", max_model_len),
            ("max_rows_per_request", max_rows_per_request),
            ("worker_rows", worker_rows),
            ("num_groups", num_groups),
        ):
            if type(value) is not int or value <= 0:
                raise ValidationError(f"{name} must be a positive integer; got {value!r}")
        missing = [m for m in ("num_total", "num_free", "allocate", "free") if not hasattr(pool, m)]
        if missing:
            raise ValidationError(
                f"pool must be a BlockPool (num_total, num_free, allocate, free); {type(pool).__name__} "
                f"lacks {missing}"
            )
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_rows_per_request = max_rows_per_request
        self.worker_rows = worker_rows
        self.num_groups = num_groups
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise ValidationError(
                f"prefix_cache must be a PrefixCache or None; got {type(prefix_cache).__name__}"
            )
        self.pool = pool
        self.prefix_cache = prefix_cache
        self._reserved: dict[str, _Reservation] = {}
        self._generation = 0

    # -- views --------------------------------------------------------------------------------

    @property
    def rows_in_use(self) -> int:
        return sum(r.allocation.num_rows for r in self._reserved.values())

    @property
    def free_rows(self) -> int:
        return self.worker_rows - self.rows_in_use

    def reserved(self) -> tuple[str, ...]:
        return tuple(self._reserved)

    @property
    def blocks_held(self) -> int:
        """Blocks live requests hold (the pool's used blocks less cached ones nobody holds)."""
        idle = self.prefix_cache.num_idle if self.prefix_cache is not None else 0
        return self.pool.num_total - self.pool.num_free - idle

    def blocks_of(self, request_id: str) -> list[int]:
        _check_id(request_id, "blocks_of")
        res = self._reserved.get(request_id)
        return list(res.block_ids) if res is not None else []

    @property
    def generation(self) -> int:
        """The last generation handed out (0: none yet): every snapshot issued so far has a
        generation up to it, and every later one a higher one."""
        return self._generation

    def advance_generation(self, at_least: int) -> None:
        """Hand out generations above ``at_least`` from now on (never lowers them): a scheduler
        starting over on a live worker continues above the worker's high-water mark, so its
        snapshots are not mistaken for late deliveries of the requests it had before."""
        if type(at_least) is not int or at_least < -1:
            raise ValidationError(f"advance_generation takes an int >= -1; got {at_least!r}")
        self._generation = max(self._generation, at_least)

    # -- reservation --------------------------------------------------------------------------

    def _check(self, request: KVRequest) -> list[int]:
        """Blocks each row needs, in order (sequences, then contexts); AdmissionError if never."""
        if not isinstance(request, KVRequest):
            raise AdmissionError(f"reserve takes a KVRequest; got {type(request).__name__}")
        rid = request.request_id
        if type(rid) is not str or not rid:
            raise AdmissionError(f"request_id must be a non-empty string; got {rid!r}")
        for name, kind in (("sequences", SequenceRequest), ("contexts", ContextRequest)):
            items = getattr(request, name)
            if not isinstance(items, tuple) or any(not isinstance(i, kind) for i in items):
                raise AdmissionError(
                    f"request {rid!r} {name} must be a tuple of {kind.__name__}; got {items!r}"
                )
        if not request.sequences:
            raise AdmissionError(f"request {rid!r} has no sequences")
        for s in request.sequences:
            if not _count(s.sequence_id):
                raise AdmissionError(
                    f"request {rid!r} sequence_id must be an int >= 0; got {s.sequence_id!r}"
                )
            for name in ("prefix_len", "target_len"):
                if not _count(getattr(s, name)):
                    raise AdmissionError(
                        f"request {rid!r} sequence {s.sequence_id} {name} must be an int >= 0; "
                        f"got {getattr(s, name)!r}"
                    )
            keys = s.prefix_keys
            if not isinstance(keys, tuple) or any(type(k) is not bytes or not k for k in keys):
                raise AdmissionError(
                    f"request {rid!r} sequence {s.sequence_id} prefix_keys must be a tuple of non-empty "
                    f"bytes; got {keys!r}"
                )
            if len(keys) * self.block_size > s.prefix_len:
                raise AdmissionError(
                    f"request {rid!r} sequence {s.sequence_id} has {len(keys)} prefix keys of "
                    f"{self.block_size} tokens each, more than its prefix_len {s.prefix_len}"
                )
            if len(set(keys)) != len(keys):
                raise AdmissionError(
                    f"request {rid!r} sequence {s.sequence_id} lists a prefix key twice (keys chain: "
                    "each block's key differs)"
                )
            if not isinstance(s.context_ids, tuple) or any(
                type(c) is not str or not c for c in s.context_ids
            ):
                raise AdmissionError(
                    f"request {rid!r} sequence {s.sequence_id} context_ids must be a tuple of non-empty "
                    f"strings; got {s.context_ids!r}"
                )
        for c in request.contexts:
            if type(c.context_id) is not str or not c.context_id:
                raise AdmissionError(
                    f"request {rid!r} context_id must be a non-empty string; got {c.context_id!r}"
                )
            if type(c.cache_role) is not str or not c.cache_role:
                raise AdmissionError(
                    f"request {rid!r} context {c.context_id!r} cache_role must be a non-empty string; "
                    f"got {c.cache_role!r}"
                )
            if not _count(c.num_tokens):
                raise AdmissionError(
                    f"request {rid!r} context {c.context_id!r} num_tokens must be an int >= 0; got {c.num_tokens!r}"
                )
        if request.num_rows > self.max_rows_per_request:
            raise AdmissionError(
                f"request {rid!r} needs {request.num_rows} rows; the per-request limit is {self.max_rows_per_request}"
            )
        if request.num_rows > self.worker_rows:
            raise AdmissionError(
                f"request {rid!r} needs {request.num_rows} rows; the worker has {self.worker_rows}"
            )
        context_ids = [c.context_id for c in request.contexts]
        if len(set(context_ids)) != len(context_ids):
            raise AdmissionError(f"request {rid!r} lists a context more than once: {context_ids}")
        seq_ids = [s.sequence_id for s in request.sequences]
        if len(set(seq_ids)) != len(seq_ids):
            raise AdmissionError(f"request {rid!r} lists a sequence more than once: {seq_ids}")
        needs = []
        for s in request.sequences:
            if s.prefix_len + s.target_len <= 0:
                raise AdmissionError(
                    f"request {rid!r} sequence {s.sequence_id}: lengths must be >= 0 and not both 0"
                )
            unknown = set(s.context_ids) - set(context_ids)
            if unknown:
                raise AdmissionError(
                    f"request {rid!r} sequence {s.sequence_id} uses unknown contexts {sorted(unknown)}"
                )
            needs.append(s.prefix_len + s.target_len)
        needs.extend(c.num_tokens for c in request.contexts)
        too_long = [n for n in needs if n > self.max_model_len]
        if too_long:
            raise AdmissionError(
                f"request {rid!r} has a row of {max(too_long)} tokens; max_model_len is {self.max_model_len}"
            )
        blocks = [cdiv(n, self.block_size) for n in needs]
        if sum(blocks) > self.pool.num_total:
            raise AdmissionError(
                f"request {rid!r} needs {sum(blocks)} blocks; the pool has {self.pool.num_total} in total"
            )
        return blocks

    def check(self, request: KVRequest) -> int:
        """Blocks ``request`` needs in all; :class:`AdmissionError` if it can never be admitted.
        Reserves nothing (a scheduler checks at submission, reserves at admission)."""
        return sum(self._check(request))

    def reserve(self, request: KVRequest) -> RequestAllocation | None:
        """Reserve every row of ``request`` (see module docstring for the three outcomes)."""
        if not isinstance(request, KVRequest):
            raise AdmissionError(f"reserve takes a KVRequest; got {type(request).__name__}")
        if type(request.request_id) is not str or not request.request_id:
            raise AdmissionError(f"request_id must be a non-empty string; got {request.request_id!r}")
        existing = self._reserved.get(request.request_id)
        if existing is not None:
            if request != existing.request:
                raise AdmissionError(
                    f"request {request.request_id!r} is already reserved with a different shape "
                    f"({existing.request!r}); free it before reserving it again"
                )
            self._generation += 1
            old = existing.allocation
            existing.allocation = RequestAllocation(
                old.request_id, self._generation, old.sequences, old.contexts
            )
            return existing.allocation
        blocks = self._check(request)
        if request.num_rows > self.free_rows:
            return None  # worker back-pressure: nothing taken
        cache = self.prefix_cache
        hits: list[list[int]] = [[] for _ in request.sequences]
        hit_keys: list[list[bytes]] = [[] for _ in request.sequences]
        if cache is not None:
            for i, s in enumerate(request.sequences):
                hits[i] = cache.lookup(s.prefix_keys)
                hit_keys[i] = list(s.prefix_keys[: len(hits[i])])
        keep = [k for keys in hit_keys for k in keys]
        need = sum(blocks) - sum(len(h) for h in hits)
        if need > self.pool.num_free:
            short = need - self.pool.num_free
            if cache is None or cache.evictable(keep) < short:
                return None  # wait: nothing taken, nothing evicted
            self.pool.free(cache.evict(short, keep))
        taken = self.pool.allocate(need)
        if taken is None:
            return None
        if cache is not None:
            for keys in hit_keys:
                cache.acquire(keys)
                cache.hits += len(keys)
        cursor = 0
        per_row: list[tuple[int, ...]] = []
        for i, n in enumerate(blocks):
            hit = hits[i] if i < len(hits) else []
            fresh = n - len(hit)
            per_row.append((*hit, *taken[cursor : cursor + fresh]))
            cursor += fresh
        sequences = tuple(
            SequenceAllocation(
                sequence_id=s.sequence_id,
                prefix_len=s.prefix_len,
                target_len=s.target_len,
                seq_len=s.prefix_len + s.target_len,
                block_ids=(per_row[i],) * self.num_groups,
                context_ids=s.context_ids,
                cached_prefix_len=len(hits[i]) * self.block_size,
            )
            for i, s in enumerate(request.sequences)
        )
        offset = len(request.sequences)
        contexts = tuple(
            ContextAllocation(
                c.context_id, c.cache_role, c.num_tokens, (per_row[offset + i],) * self.num_groups
            )
            for i, c in enumerate(request.contexts)
        )
        self._generation += 1
        allocation = RequestAllocation(request.request_id, self._generation, sequences, contexts)
        used = list(dict.fromkeys(b for row in per_row for b in row))
        self._reserved[request.request_id] = _Reservation(request, allocation, used, list(taken), hit_keys)
        return allocation

    def restore(self, request: KVRequest, released: Sequence[int]) -> RequestAllocation | None:
        """Reserve ``request`` (every sequence a target of ``prefix_len + target_len`` tokens, no
        prefix keys, no contexts) with ``NULL_BLOCK`` at block positions ``released`` of every row:
        only the live places take a block from the pool, all or nothing -- what bringing back a
        windowed stream whose early blocks slid out needs (an offloaded session's reload). None
        when the pool or the worker rows are short (nothing taken); :class:`AdmissionError` when
        the live blocks can never fit, a row is longer than ``max_model_len`` or the id is
        reserved already."""
        if not isinstance(request, KVRequest):
            raise AdmissionError(f"restore takes a KVRequest; got {type(request).__name__}")
        rid = request.request_id
        _check_id(rid, "restore")
        if rid in self._reserved:
            raise AdmissionError(f"request {rid!r} is reserved already; free it before restoring it")
        if request.contexts or any(s.prefix_keys for s in request.sequences) or not request.sequences:
            raise AdmissionError(
                f"restore of request {rid!r} takes sequences without prefix keys or contexts"
            )
        if isinstance(released, (str, bytes)) or any(type(p) is not int or p < 0 for p in released):
            raise AdmissionError(
                f"restore of request {rid!r}: released positions must be ints >= 0; got {released!r}"
            )
        holes = set(released)
        if request.num_rows > min(self.max_rows_per_request, self.worker_rows):
            raise AdmissionError(
                f"request {rid!r} needs {request.num_rows} rows; the limit is "
                f"{min(self.max_rows_per_request, self.worker_rows)}"
            )
        rows: list[int] = []
        for s in request.sequences:
            n = s.prefix_len + s.target_len
            if not _count(s.sequence_id) or not _count(s.prefix_len) or not _count(s.target_len) or n == 0:
                raise AdmissionError(f"restore of request {rid!r}: malformed sequence {s!r}")
            if n > self.max_model_len:
                raise AdmissionError(
                    f"request {rid!r} has a row of {n} tokens; max_model_len is {self.max_model_len}"
                )
            if holes and max(holes) >= cdiv(n, self.block_size):
                raise AdmissionError(
                    f"restore of request {rid!r}: released positions {sorted(holes)} lie outside its "
                    f"{cdiv(n, self.block_size)} blocks"
                )
            rows.append(cdiv(n, self.block_size))
        need = sum(n - len(holes) for n in rows)
        if need > self.pool.num_total:
            raise AdmissionError(
                f"request {rid!r} needs {need} live blocks; the pool has {self.pool.num_total} in total"
            )
        if request.num_rows > self.free_rows:
            return None
        taken = self.pool.allocate(need)
        if taken is None:
            return None
        cursor = 0
        sequences = []
        for s, n in zip(request.sequences, rows, strict=True):
            row = []
            for p in range(n):
                if p in holes:
                    row.append(NULL_BLOCK)
                else:
                    row.append(taken[cursor])
                    cursor += 1
            sequences.append(
                SequenceAllocation(
                    sequence_id=s.sequence_id,
                    prefix_len=s.prefix_len,
                    target_len=s.target_len,
                    seq_len=s.prefix_len + s.target_len,
                    block_ids=(tuple(row),) * self.num_groups,
                )
            )
        self._generation += 1
        allocation = RequestAllocation(rid, self._generation, tuple(sequences))
        held: list[list[bytes]] = [[] for _ in request.sequences]
        self._reserved[rid] = _Reservation(request, allocation, list(taken), list(taken), held)
        return allocation

    def publish(
        self, request_id: str, install: Callable[[RequestAllocation], object] | None = None
    ) -> RequestAllocation | None:
        """Seal and cache the keyed prefix blocks ``request_id`` has written (call once its
        prefill step ran). Builds a snapshot one generation newer whose ``cached_prefix_len``
        covers every keyed block, hands it to ``install`` (the worker's ``seal``; an exception
        leaves the allocator unchanged and propagates), then caches each block whose key is not
        cached yet, while the cap leaves room. Returns the new snapshot; None when there is
        nothing to seal (no prefix caching, no keys, or sealed already)."""
        _check_id(request_id, "publish")
        res = self._reserved.get(request_id)
        if res is None:
            raise ValidationError(f"publish of request {request_id!r}, which is not reserved")
        cache = self.prefix_cache
        if cache is None:
            return None
        old = res.allocation
        sequences = list(old.sequences)
        offers: list[tuple[int, bytes, int]] = []  # (sequence index, key, block)
        for i, (s, alloc) in enumerate(zip(res.request.sequences, old.sequences, strict=True)):
            cut = len(s.prefix_keys) * self.block_size
            if cut <= alloc.cached_prefix_len:
                continue
            first = alloc.cached_prefix_len // self.block_size
            row = alloc.block_ids[0]
            offers.extend((i, s.prefix_keys[b], row[b]) for b in range(first, len(s.prefix_keys)))
            sequences[i] = replace(alloc, cached_prefix_len=cut)
        if not offers:
            return None
        snapshot = RequestAllocation(request_id, self._generation + 1, tuple(sequences), old.contexts)
        if install is not None:
            install(snapshot)
        self._generation += 1
        res.allocation = snapshot
        for i, key, block in offers:
            if key in cache or cache.room() <= 0 or block not in res.private:
                continue  # a key cached already keeps its block: nothing to make room for
            if cache.max_blocks is not None and len(cache) >= cache.max_blocks:
                self.pool.free(cache.evict(1))
            if cache.publish(key, block):
                res.private.remove(block)
                res.held[i].append(key)
        return snapshot

    def _reservation_rows(
        self, call: str, request_id: str, sequence_id: int | None
    ) -> tuple[_Reservation, list[int]]:
        """The reservation and the indices of the sequences a row change applies to (every
        sequence for ``None``)."""
        _check_id(request_id, call)
        res = self._reserved.get(request_id)
        if res is None:
            raise ValidationError(f"{call} of request {request_id!r}, which is not reserved")
        if sequence_id is None:
            return res, list(range(len(res.allocation.sequences)))
        index = next(
            (i for i, s in enumerate(res.allocation.sequences) if s.sequence_id == sequence_id), None
        )
        if index is None:
            raise ValidationError(f"request {request_id!r} has no sequence {sequence_id!r}")
        return res, [index]

    def _publish_rows(
        self,
        res: _Reservation,
        sequences: list[SequenceAllocation],
        install: Callable[[RequestAllocation], object] | None,
    ) -> RequestAllocation:
        """A snapshot one generation newer with ``sequences``, handed to ``install`` first (an
        exception leaves the allocator unchanged and propagates), then recorded."""
        old = res.allocation
        snapshot = RequestAllocation(old.request_id, self._generation + 1, tuple(sequences), old.contexts)
        if install is not None:
            install(snapshot)
        self._generation += 1
        res.allocation = snapshot
        return snapshot

    def _give_back(self, res: _Reservation, blocks: Sequence[int]) -> None:
        if blocks:
            gone = set(blocks)
            res.private = [b for b in res.private if b not in gone]
            res.block_ids = [b for b in res.block_ids if b not in gone]
            self.pool.free(list(blocks))

    def release(
        self,
        request_id: str,
        sequence_id: int | None,
        positions: Sequence[int],
        install: Callable[[RequestAllocation], object] | None = None,
    ) -> RequestAllocation:
        """Release the blocks at ``positions`` (indices into a row's block list) of one sequence
        (every sequence for ``None``) while the request runs -- what a sliding window no longer
        needs (``MaskSpec.retention(...).releasable_blocks(block_size)``). Builds a snapshot one
        generation newer with ``NULL_BLOCK`` at those places in every group, hands it to
        ``install`` (the worker's ``install``: a SLIDE; an exception leaves the allocator
        unchanged and propagates), then returns the blocks to the pool at once. Only blocks the
        request took for itself are released (a cached prefix block is shared). Places already
        null are skipped; the new snapshot is returned."""
        res, indices = self._reservation_rows("release", request_id, sequence_id)
        if isinstance(positions, (str, bytes)) or any(type(p) is not int for p in positions):
            raise ValidationError(f"release takes block positions (ints); got {positions!r}")
        sequences = list(res.allocation.sequences)
        freed: list[int] = []
        for index in indices:
            alloc = sequences[index]
            row = list(alloc.block_ids[0])
            bad = [p for p in positions if not 0 <= p < len(row)]
            if bad:
                raise ValidationError(
                    f"request {request_id!r} sequence {alloc.sequence_id}: positions {bad} lie outside its "
                    f"{len(row)} blocks"
                )
            mine = [row[p] for p in dict.fromkeys(positions) if row[p] != NULL_BLOCK]
            shared = [b for b in mine if b not in res.private]
            if shared:
                raise ValidationError(
                    f"request {request_id!r} sequence {alloc.sequence_id}: blocks {shared} are shared (a cached "
                    "prefix); only blocks the request took for itself are released"
                )
            for p in positions:
                row[p] = NULL_BLOCK
            sequences[index] = _resized(
                alloc, alloc.target_len, alloc.seq_len, (tuple(row),) * self.num_groups
            )
            freed.extend(mine)
        snapshot = self._publish_rows(res, sequences, install)
        self._give_back(res, freed)
        return snapshot

    def extend(
        self,
        request_id: str,
        sequence_id: int | None,
        tokens: int,
        install: Callable[[RequestAllocation], object] | None = None,
    ) -> RequestAllocation | None:
        """Grow one sequence's target (every sequence's for ``None``) by ``tokens`` (the next
        chunk of a stream), appending the blocks it needs from the pool: a snapshot one
        generation newer, handed to ``install`` (the worker's EXTEND; an exception returns the
        new blocks and propagates). None when the pool is short (nothing taken);
        :class:`AdmissionError` past ``max_model_len``."""
        res, indices = self._reservation_rows("extend", request_id, sequence_id)
        if not _count(tokens) or tokens == 0:
            raise ValidationError(f"extend takes a positive token count; got {tokens!r}")
        sequences = list(res.allocation.sequences)
        need = 0
        for index in indices:
            alloc = sequences[index]
            if alloc.seq_len + tokens > self.max_model_len:
                raise AdmissionError(
                    f"request {request_id!r} sequence {alloc.sequence_id}: {alloc.seq_len + tokens} tokens exceed "
                    f"max_model_len {self.max_model_len}"
                )
            need += cdiv(alloc.seq_len + tokens, self.block_size) - len(alloc.block_ids[0])
        taken = self.pool.allocate(need) if need else []
        if taken is None:
            return None
        cursor = 0
        for index in indices:
            alloc = sequences[index]
            n = cdiv(alloc.seq_len + tokens, self.block_size) - len(alloc.block_ids[0])
            row = (*alloc.block_ids[0], *taken[cursor : cursor + n])
            cursor += n
            sequences[index] = _resized(
                alloc, alloc.target_len + tokens, alloc.seq_len + tokens, (row,) * self.num_groups
            )
        try:
            snapshot = self._publish_rows(res, sequences, install)
        except BaseException:
            if taken:
                self.pool.free(taken)
            raise
        res.private.extend(taken)
        res.block_ids.extend(taken)
        return snapshot

    def truncate(
        self,
        request_id: str,
        sequence_id: int | None,
        tokens: int,
        install: Callable[[RequestAllocation], object] | None = None,
    ) -> RequestAllocation:
        """Shrink one sequence's target (every sequence's for ``None``) by ``tokens``: the
        reverse of :meth:`extend` (an aborted chunk). A snapshot one generation newer, handed to
        ``install`` (the worker's TRUNCATE; an exception leaves the allocator unchanged and
        propagates); then the blocks only the dropped tokens used go back to the pool."""
        res, indices = self._reservation_rows("truncate", request_id, sequence_id)
        if not _count(tokens) or tokens == 0:
            raise ValidationError(f"truncate takes a positive token count; got {tokens!r}")
        sequences = list(res.allocation.sequences)
        dropped: list[int] = []
        for index in indices:
            alloc = sequences[index]
            if tokens > alloc.target_len or alloc.seq_len - tokens < alloc.cached_prefix_len:
                raise ValidationError(
                    f"request {request_id!r} sequence {alloc.sequence_id}: cannot drop {tokens} tokens of a "
                    f"{alloc.target_len}-token target"
                )
            keep = cdiv(alloc.seq_len - tokens, self.block_size)
            row = alloc.block_ids[0]
            dropped.extend(b for b in row[keep:] if b != NULL_BLOCK)
            sequences[index] = _resized(
                alloc, alloc.target_len - tokens, alloc.seq_len - tokens, (row[:keep],) * self.num_groups
            )
        snapshot = self._publish_rows(res, sequences, install)
        self._give_back(res, dropped)
        return snapshot

    def compact(
        self,
        request_id: str,
        at: int,
        tokens: int,
        install: Callable[[RequestAllocation], object] | None = None,
    ) -> RequestAllocation:
        """Cut the released tokens ``[at, at + tokens)`` (whole blocks, every place
        ``NULL_BLOCK``, past every row's prefix) out of every sequence of ``request_id``: each
        row's later places move down, its length and target shrink by ``tokens``, no block
        changes hands. A snapshot one generation newer, handed to ``install`` (the worker's
        ``compact``: a COMPACT; an exception leaves the allocator unchanged and propagates).
        What keeps a long session's rows within ``max_model_len``: positions on the host's
        timeline are the session's to keep (:mod:`diffusion_kv.core.sessions`)."""
        res, indices = self._reservation_rows("compact", request_id, None)
        bs = self.block_size
        if type(at) is not int or type(tokens) is not int or at < 0 or tokens <= 0 or at % bs or tokens % bs:
            raise ValidationError(
                f"compact of request {request_id!r} takes whole blocks of {bs} tokens (at >= 0, tokens > 0); "
                f"got at={at!r}, tokens={tokens!r}"
            )
        if res.allocation.contexts:
            raise ValidationError(
                f"compact of request {request_id!r}: a request with contexts is not compacted"
            )
        first, count = at // bs, tokens // bs
        sequences = list(res.allocation.sequences)
        for index in indices:
            alloc = sequences[index]
            row = alloc.block_ids[0]
            if (
                alloc.seq_len < at + tokens
                or max(alloc.prefix_len, alloc.cached_prefix_len) > at
                or any(b != NULL_BLOCK for b in row[first : first + count])
            ):
                raise ValidationError(
                    f"compact of request {request_id!r} sequence {alloc.sequence_id}: tokens [{at}, {at + tokens}) "
                    f"must be released places of its target ({alloc.seq_len} tokens, prefix {alloc.prefix_len})"
                )
            kept = row[:first] + row[first + count :]
            sequences[index] = _resized(
                alloc, alloc.target_len - tokens, alloc.seq_len - tokens, (kept,) * self.num_groups
            )
        return self._publish_rows(res, sequences, install)

    def shadow(self, request_id: str, shadow_id: str) -> RequestAllocation | None:
        """Reserve ``shadow_id``: rows with ``request_id``'s sequence ids, lengths and released
        places (``NULL_BLOCK``), a fresh block at every live place (a re-cache writes there while
        ``request_id`` keeps its KV). None when the pool or the worker rows are short (nothing
        taken); hand the result to the worker's ``install`` and, at the end, to :meth:`adopt` or
        :meth:`free`."""
        res, _ = self._reservation_rows("shadow", request_id, None)
        _check_id(shadow_id, "shadow")
        if shadow_id in self._reserved:
            raise ValidationError(f"shadow request {shadow_id!r} is reserved already")
        if res.allocation.contexts:
            raise ValidationError(f"request {request_id!r} has contexts; a shadow copies sequences only")
        rows = [s.block_ids[0] for s in res.allocation.sequences]
        need = sum(1 for row in rows for b in row if b != NULL_BLOCK)
        if len(rows) > self.free_rows:
            return None
        taken = self.pool.allocate(need) if need else []
        if taken is None:
            return None
        fresh = iter(taken)
        sequences = tuple(
            replace(
                s,
                prefix_len=0,
                target_len=s.seq_len,
                cached_prefix_len=0,
                context_ids=(),
                block_ids=(tuple(NULL_BLOCK if b == NULL_BLOCK else next(fresh) for b in row),)
                * self.num_groups,
            )
            for s, row in zip(res.allocation.sequences, rows, strict=True)
        )
        request = KVRequest(shadow_id, tuple(SequenceRequest(s.sequence_id, 0, s.seq_len) for s in sequences))
        self._generation += 1
        allocation = RequestAllocation(shadow_id, self._generation, sequences)
        self._reserved[shadow_id] = _Reservation(
            request, allocation, list(taken), list(taken), [[] for _ in rows]
        )
        return allocation

    def adopt(
        self, request_id: str, donor_id: str, install: Callable[[RequestAllocation], object] | None = None
    ) -> RequestAllocation:
        """Give ``request_id``'s rows the blocks of its shadow ``donor_id`` (:meth:`shadow`): a
        snapshot one generation newer, handed to ``install`` (the worker's ``adopt``: a REPLACE;
        an exception leaves the allocator unchanged and propagates); then the request's old
        blocks go back to the pool and the donor's reservation ends (its blocks are the
        request's now).

        A request whose leading blocks are shared through the prefix cache (a hit, or blocks it
        published) gets the donor's private blocks there too: the new snapshot has no cached
        prefix, the request drops its references (a block another request holds stays with it;
        one nobody holds stays cached, idle) and forgets its prefix keys, so it never publishes
        the new K/V under the old content's keys."""
        res, _ = self._reservation_rows("adopt", request_id, None)
        donor, _ = self._reservation_rows("adopt", donor_id, None)
        theirs = {s.sequence_id: s for s in donor.allocation.sequences}
        sequences = []
        for s in res.allocation.sequences:
            d = theirs.get(s.sequence_id)
            if d is None or d.seq_len != s.seq_len:
                raise ValidationError(
                    f"adopt: donor {donor_id!r} has no sequence {s.sequence_id} of {s.seq_len} tokens for "
                    f"request {request_id!r}"
                )
            sequences.append(replace(s, block_ids=d.block_ids, cached_prefix_len=0))
        snapshot = self._publish_rows(res, sequences, install)
        old, held = res.private, res.held
        res.private = list(donor.private)
        res.block_ids = list(donor.block_ids)
        if any(held):
            res.held = [[] for _ in held]
            if self.prefix_cache is not None:
                for keys in held:
                    self.prefix_cache.release(keys)
        if any(s.prefix_keys for s in res.request.sequences):
            res.request = replace(
                res.request, sequences=tuple(replace(s, prefix_keys=()) for s in res.request.sequences)
            )
        del self._reserved[donor_id]
        self.pool.free(old)
        return snapshot

    def free(self, request_id: str) -> int:
        """Release a request's blocks (idempotent): its own blocks go back to the pool, its
        references to cached blocks are dropped. Returns how many blocks went back to the pool."""
        _check_id(request_id, "free")
        res = self._reserved.pop(request_id, None)
        if res is None:
            return 0
        if self.prefix_cache is not None:
            for keys in res.held:
                self.prefix_cache.release(keys)
        self.pool.free(res.private)
        return len(res.private)

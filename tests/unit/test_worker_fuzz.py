"""Model-based fuzz of the whole worker path: allocator, prefix cache, registry, runtime, cpu forward.

A seeded random driver issues valid and invalid operations — reservations (good and malformed,
with prefix keys drawn from a few shared key chains), installs (fresh, replays of old snapshots,
late snapshots of requests retired for good, forged overlapping or repeated block ids, pinned
prefixes shared read-only), denoise steps in any order (prefill, denoise before prefill, writes
into a cached prefix), removals (by id, by generation, for good through a generation,
malformed), scheduler frees in the wrong order, double frees, scheduler restarts (a new
allocator and prefix cache on the live worker), reaping of rows no reservation owns, cache
bindings (the worker's caches are host tensors — disjoint slices or interleaved halves of one
buffer — and random bindings of a second worker, aliased ones included), and injected plugin
faults (metadata builder, a layer's K/V writer, BlockTables). Prefix caching adds:

* publish: seal and cache a request's keyed blocks once its prefill wrote them (the worker takes
  the seal, then the blocks are cached while the cap leaves room, evicting idle ones at the
  cap); too early — rows that never wrote their keyed tokens, or a request the worker does not
  hold — the worker refuses with StateError and nothing changes;
* hit: reserve and install a request whose leading keys are cached while their publisher is
  still live: the cached blocks come back read-only as its cached prefix;
* evict: a reservation under pool pressure evicts idle cached blocks, least recently used first
  (never one it hits), or waits with nothing evicted;
* replay: re-install the pre-seal snapshot of a sealed request: refused as stale.

The driver frees in the wrong order and delivers late snapshots, but never a late snapshot of
a freed request that would write a block published since (noted and skipped): the worker
cannot know a block is cached, and a scheduler retires a request before freeing it.

An independent model — block refcounts, reservations, generations, tombstones, and the prefix
cache's key -> block map, reference counts, idle LRU and each cached block's published content —
predicts every outcome. After every operation:

* no block is written by one live row while another live row holds it, and every block's
  holders are the model's refcount;
* no block leaks: the pool's free list, every reservation's own blocks and the cached blocks are
  disjoint (no block is both free and cached) and together the whole pool;
* the prefix cache is the model's (``blocks()``, ``stats()``, ``refs``, the idle order), every
  cached key's references are the reservations holding it, and ``blocks_held`` counts the rest;
* no live row writes a cached block, and a cached block's K/V in every layer stays what its
  publisher wrote (the pages are checked against the publisher's own K/V at publish and
  snapshotted) until it is evicted;
* a rejected operation left registry, allocator, prefix cache and every cache byte-identical;
* every paged output equals dense attention over that row's own K/V (per layer); a hit row's
  cached prefix is its publisher's K/V.

At the end every reservation is retired and freed, every snapshot ever issued is replayed, and
what the allocator does not reserve is reaped: the worker holds zero rows and zero blocks, every
cached block is idle, and pool plus cache account for every block until the cache is emptied.

``DKV_FUZZ_OPS`` (default 10,000 in all, shared by the seeds) and ``DKV_FUZZ_SEED`` (a list of
seeds, default 1-4) widen a run; each seed runs at least 2,500 operations (the default share),
enough to meet every outcome the run must see, however many seeds are listed.
"""

from __future__ import annotations

import os
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from diffusion_kv import AttentionMetadata
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.allocator import (
    AdmissionError,
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    SequenceRequest,
)
from diffusion_kv.core.errors import GenerationError, NativeBackendError, StateError, ValidationError
from diffusion_kv.core.prefix_cache import PrefixCache
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.scheduler import reap_unreserved
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend

from .registry_helpers import FlakyBlockTables, owned_mirrors_writer, state_of

H, HKV, D, BS = 2, 1, 4, 4
LAYERS = ("l0", "l1")
NUM_BLOCKS, MAX_LEN, ROWS_PER_REQ, MAX_SEQS = 40, 24, 2, 4
WORKER_ROWS = ROWS_PER_REQ * MAX_SEQS
RIDS = ("r0", "r1", "r2", "r3", "r4", "r5")
PINNED, PINNED_BLOCKS = "pinned", 4  # blocks the scheduler pins (computed elsewhere, shared read-only)
CACHE_CAP = 4  # blocks the prefix cache may keep (few: publishing at the cap evicts)
CHAINS = 3  # shared content: a sequence's prefix keys are a leading run of one chain
STATS = ("cached_blocks", "idle_blocks", "hit_blocks", "published_blocks", "evictions")

TOTAL_OPS = int(os.environ.get("DKV_FUZZ_OPS", "10000"))
MIN_OPS_PER_SEED = 2500
SEEDS = [int(s) for s in os.environ.get("DKV_FUZZ_SEED", "1,2,3,4").split(",")]


def chain(c: int, n: int) -> tuple[bytes, ...]:
    """The keys of the first ``n`` blocks of content chain ``c``: the same bytes for the same
    content, so every prefix of a chain is a prefix of its keys."""
    return tuple(f"chain{c}-{i}".encode() for i in range(n))


# --- a cpu platform whose parts can be told to fail ---------------------------------------------


class Faults:
    def __init__(self) -> None:
        self.builder = False
        self.write_layer: str | None = None


FAULTS = Faults()


class FaultyBackend(CpuReferenceBackend):
    """The reference backend with switchable faults in its builder and K/V writer, over
    BlockTables whose apply can fail."""

    name = "faulty"

    @classmethod
    def block_tables_cls(cls) -> Any:
        return FlakyBlockTables

    def build(self, batch: Any) -> Any:
        if FAULTS.builder:
            raise RuntimeError("injected builder fault")
        return super().build(batch)

    def write_kv(self, layer: Any, *args: Any) -> None:
        if FAULTS.write_layer == layer.layer_name:
            raise RuntimeError("injected write fault")
        super().write_kv(layer, *args)


class FaultyCpu(CpuPlatform):
    backends = (FaultyBackend,)

    def __init__(self) -> None:
        super().__init__()
        self.faults = FAULTS


# --- the independent model ---------------------------------------------------------------------


@dataclass
class RowModel:
    prefix: int
    seq_len: int
    cached: int
    blocks: tuple[int, ...]
    written: set[int]
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer -> logical K, V [seq_len, HKV, D]
    hit: bool = False  # its cached prefix holds blocks the prefix cache published

    def writes_block(self, index: int) -> bool:
        return index >= self.cached // BS


@dataclass
class Reservation:
    request: KVRequest
    snap: RequestAllocation  # the allocator's current snapshot of it
    private: list[int]  # blocks the pool gave it alone: what ``free`` returns
    held: list[list[bytes]]  # per sequence, the cached keys it references (hits, then published)


@dataclass
class Model:
    free: set[int]  # the pool's free block ids
    reserved: dict[str, Reservation] = field(default_factory=dict)
    generation: int = 0
    installed: dict[str, tuple[RequestAllocation, int]] = field(
        default_factory=dict
    )  # rid -> (snapshot, gen)
    removed: dict[str, int] = field(default_factory=dict)  # rid -> last generation or tombstone
    finished: dict[str, int] = field(default_factory=dict)  # rid -> generation it was retired at
    rows: dict[tuple[str, int], RowModel] = field(default_factory=dict)
    row_index: dict[tuple[str, int], int] = field(default_factory=dict)
    history: dict[str, list[RequestAllocation]] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)  # block -> live rows holding it
    high_water: int = -1  # the highest generation the worker installed, recorded or retired
    presealed: dict[str, RequestAllocation] = field(default_factory=dict)  # rid -> before its seal
    # the prefix cache
    cache: dict[bytes, int] = field(default_factory=dict)  # key -> block
    crefs: dict[bytes, int] = field(default_factory=dict)  # key -> reservations referencing it
    idle: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # crefs 0, LRU first
    pages: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> K/V when published
    publisher: dict[bytes, str] = field(default_factory=dict)
    cstats: Counter[str] = field(default_factory=Counter)

    def hold(self, row: RowModel, sign: int) -> None:
        for b in row.blocks:
            self.refs[b] = self.refs.get(b, 0) + sign
            if not self.refs[b]:
                del self.refs[b]

    def drop(self, rid: str) -> RequestAllocation:
        """The worker's rows of ``rid`` go (removal, retirement, reaping)."""
        snap, gen = self.installed.pop(rid)
        self.removed[rid] = max(self.removed.get(rid, -1), gen)
        for s in snap.sequences:
            self.hold(self.rows.pop((rid, s.sequence_id)), -1)
            del self.row_index[(rid, s.sequence_id)]
        return snap

    def retire(self, rid: str, through: int) -> None:
        if rid in self.installed:
            self.finished[rid] = self.installed[rid][1]
            self.drop(rid)
        self.removed[rid] = max(self.removed.get(rid, -1), through)
        self.high_water = max(self.high_water, through)

    def zombies(self) -> set[str]:
        """Installed requests no reservation owns: what reaping retires."""
        return set(self.installed) - set(self.reserved)

    def holders(self) -> dict[int, list[tuple[tuple[str, int], bool]]]:
        out: dict[int, list[tuple[tuple[str, int], bool]]] = {}
        for key, row in self.rows.items():
            for i, b in enumerate(row.blocks):
                out.setdefault(b, []).append((key, row.writes_block(i)))
        return out

    def conflicts(self, snap: RequestAllocation) -> bool:
        """Would installing ``snap`` (fresh) break ownership (independent of the registry)?"""
        held = self.holders()
        proposed: dict[int, list[bool]] = {b: [w for _, w in hs] for b, hs in held.items()}
        for s in snap.sequences:
            for i, b in enumerate(s.block_ids[0]):
                writes = i >= s.cached_prefix_len // BS
                others = proposed.setdefault(b, [])
                if others and (writes or any(others)):
                    return True
                others.append(writes)
        return False

    # -- the prefix cache ----------------------------------------------------------------------

    def lookup(self, keys: tuple[bytes, ...]) -> list[bytes]:
        """The longest leading run of ``keys`` that is cached."""
        out: list[bytes] = []
        for key in keys:
            if key not in self.cache:
                break
            out.append(key)
        return out

    def acquire(self, keys: list[bytes]) -> None:
        for key in keys:
            self.crefs[key] += 1
            self.idle.pop(key, None)

    def release(self, keys: list[bytes]) -> None:
        """Drop one reference to each key; the last key of a chain goes idle first."""
        for key in reversed(keys):
            self.crefs[key] -= 1
            assert self.crefs[key] >= 0
            if not self.crefs[key]:
                self.idle[key] = None

    def evict(self, keys: list[bytes]) -> None:
        """Idle ``keys`` leave the cache; their blocks go back to the pool."""
        for key in keys:
            del self.idle[key]
            del self.crefs[key]
            block = self.cache.pop(key)
            self.pages.pop(block)
            self.publisher.pop(key)
            assert block not in self.free
            self.free.add(block)
            self.cstats["evictions"] += 1

    def forget_cache(self) -> None:
        """A scheduler that starts over starts with an empty prefix cache."""
        for d in (self.cache, self.crefs, self.idle, self.pages, self.publisher, self.cstats):
            d.clear()


def key_of(row: PagedRow) -> tuple[str, int]:
    """The model's key of a sequence row."""
    assert row.sequence_id is not None
    return row.request_id, row.sequence_id


def best_fit(free: set[int], n: int) -> list[int]:
    """What the pool must hand out: the first ``n`` ids of the shortest free run holding ``n``
    (lowest on a tie), else whole runs longest first (an independent restatement)."""
    runs: list[list[int]] = []
    for b in range(NUM_BLOCKS):
        if b in free:
            if runs and runs[-1][-1] == b - 1:
                runs[-1].append(b)
            else:
                runs.append([b])
    fitting = sorted((r for r in runs if len(r) >= n), key=lambda r: (len(r), r[0]))
    if fitting:
        return fitting[0][:n]
    out: list[int] = []
    for r in sorted(runs, key=lambda r: (-len(r), r[0])):
        out.extend(r[: n - len(out)])
    return out[:n]


def repeated(snap: RequestAllocation) -> bool:
    return any(len(set(s.block_ids[0])) != len(s.block_ids[0]) for s in snap.sequences)


def is_seal(old: RequestAllocation, new: RequestAllocation) -> bool:
    """``new`` only grows some rows' cached prefix over ``old`` (an independent restatement)."""
    if old.contexts != new.contexts or len(old.sequences) != len(new.sequences):
        return False
    grew = False
    for a, b in zip(old.sequences, new.sequences, strict=True):
        if replace(a, cached_prefix_len=0) != replace(b, cached_prefix_len=0):
            return False
        if b.cached_prefix_len < a.cached_prefix_len:
            return False
        grew |= b.cached_prefix_len > a.cached_prefix_len
    return grew


def used_blocks(snap: RequestAllocation) -> list[int]:
    return list(dict.fromkeys(b for s in snap.sequences for b in s.block_ids[0]))


# --- the driver --------------------------------------------------------------------------------


class Fuzz:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.platform = FaultyCpu()
        self.runner = PagedWorker(
            self.platform,
            RunnerConfig(MAX_LEN, ROWS_PER_REQ, MAX_SEQS, WORKER_ROWS * MAX_LEN),
        )
        spec = PagedLayerSpec(H, HKV, D, torch.float32)
        self.runner.register_kv_cache_layers({name: spec for name in LAYERS})
        # The worker's caches are host tensors: disjoint slices of one buffer (even seeds) or
        # interleaved halves of one buffer's last dimension (odd seeds). One aliased binding
        # first: refused, and the worker stays uninitialised.
        if seed % 2:
            self.host = torch.zeros(2, NUM_BLOCKS, BS, HKV, len(LAYERS) * D)
            caches = {n: self.host[..., i * D : (i + 1) * D] for i, n in enumerate(LAYERS)}
            aliased = {n: self.host[..., :D] for n in LAYERS}
        else:
            self.host = torch.zeros(len(LAYERS), 2, NUM_BLOCKS, BS, HKV, D)
            caches = {n: self.host[i] for i, n in enumerate(LAYERS)}
            aliased = dict.fromkeys(LAYERS, self.host[0])
        with pytest.raises(ValidationError, match="share memory"):
            self.runner.initialize_kv_cache(num_blocks=NUM_BLOCKS, block_size=BS, kv_caches=aliased)
        assert not self.runner.initialized
        self.runner.initialize_kv_cache(num_blocks=NUM_BLOCKS, block_size=BS, kv_caches=caches)
        assert all(self.runner.kv_caches[n] is caches[n] for n in LAYERS)
        assert self.runner.registry is not None and self.runner.translator is not None
        self.registry = self.runner.registry
        self.bt: FlakyBlockTables = self.registry.block_tables  # type: ignore[assignment]
        self.caches = [caches[n] for n in LAYERS]
        self.model = Model(free=set(range(NUM_BLOCKS)))
        self.pinned_request = KVRequest(PINNED, (SequenceRequest(0, PINNED_BLOCKS * BS, 0),))
        self.pinned_blocks = list(range(PINNED_BLOCKS))
        self.new_scheduler()
        for cache in self.caches:
            cache[:, self.pinned_blocks] = torch.randn(cache[:, self.pinned_blocks].shape, generator=self.gen)
        self.counts: dict[str, int] = {}

    def new_scheduler(self) -> None:
        """A pool, a prefix cache and an allocator over them; the pinned blocks reserved first
        (they come back as the same ids)."""
        m = self.model
        self.pool = FreeListPool(NUM_BLOCKS)
        self.cache = PrefixCache(max_blocks=CACHE_CAP)
        self.alloc = DiffusionKVAllocator(
            block_size=BS,
            max_model_len=MAX_LEN,
            max_rows_per_request=ROWS_PER_REQ,
            worker_rows=WORKER_ROWS,
            pool=self.pool,
            prefix_cache=self.cache,
        )
        self.alloc.advance_generation(self.runner.generation_high_water)
        m.generation = max(m.high_water, 0)
        pinned = self.alloc.reserve(self.pinned_request)
        m.generation += 1
        assert pinned is not None and pinned.allocation_generation == m.generation
        assert list(pinned.sequences[0].block_ids[0]) == best_fit(m.free, PINNED_BLOCKS) == self.pinned_blocks
        m.free -= set(self.pinned_blocks)
        m.reserved[PINNED] = Reservation(self.pinned_request, pinned, list(self.pinned_blocks), [[]])

    # -- state ---------------------------------------------------------------------------------

    def state(self) -> tuple[Any, ...]:
        reservations = {
            rid: (r.request, r.allocation, tuple(r.block_ids), tuple(r.private), tuple(map(tuple, r.held)))
            for rid, r in self.alloc._reserved.items()
        }
        cached = (
            sorted((k, e.block, e.refs) for k, e in self.cache._entries.items()),
            list(self.cache._idle),
            self.cache.stats(),
        )
        snapshots = {rid: self.registry.snapshot_of(rid) for rid in self.registry.installed_requests()}
        return (
            state_of(self.registry),
            snapshots,
            reservations,
            self.alloc.generation,
            cached,
            sorted(self.pool._free),
            [c.clone() for c in self.caches],
        )

    def same(self, a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
        return a[:-1] == b[:-1] and all(torch.equal(x, y) for x, y in zip(a[-1], b[-1], strict=True))

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def rejected(self, before: tuple[Any, ...], what: str) -> None:
        assert self.same(before, self.state()), f"{what}: a rejection changed state"
        self.note(f"rejected {what}")

    def pages(self, block: int) -> torch.Tensor:
        """A block's K/V in every layer: [layer, k/v, BS, HKV, D]."""
        return torch.stack([c[:, block] for c in self.caches])

    # -- reservations ----------------------------------------------------------------------------

    def random_request(self, rid: str) -> KVRequest:
        n = self.rng.choice((1, 2))
        seqs = []
        for i in range(n):
            p = self.rng.randint(1, 14)
            t = self.rng.randint(1, min(8, MAX_LEN - p))
            keyed = p >= BS and self.rng.random() < 0.7
            keys = chain(self.rng.randrange(CHAINS), self.rng.randint(1, p // BS)) if keyed else ()
            seqs.append(SequenceRequest(i, p, t, prefix_keys=keys))
        return KVRequest(rid, tuple(seqs))

    def reserve(self, request: KVRequest) -> RequestAllocation | None:
        """Reserve a request not reserved yet; the model predicts the hits, the evictions and
        the blocks, or a wait that changed nothing."""
        m, rid = self.model, request.request_id
        assert rid not in m.reserved
        needs = [-(-(s.prefix_len + s.target_len) // BS) for s in request.sequences]
        rows_used = sum(len(r.request.sequences) for r in m.reserved.values())
        hits = [m.lookup(s.prefix_keys) for s in request.sequences]
        keep = {k for h in hits for k in h}
        need = sum(needs) - sum(len(h) for h in hits)
        short = need - len(m.free)
        evictable = [k for k in m.idle if k not in keep]
        before = self.state()
        snap = self.alloc.reserve(request)
        if len(request.sequences) > WORKER_ROWS - rows_used or short > len(evictable):
            assert snap is None and self.same(before, self.state())
            rows = len(request.sequences) > WORKER_ROWS - rows_used
            self.note("reserve: wait" + ("" if rows or short <= 0 else " (too few idle cached blocks)"))
            return None
        assert snap is not None
        if short > 0:
            m.evict(evictable[:short])
            self.note("evicted under pool pressure")
        taken = best_fit(m.free, need)
        m.free -= set(taken)
        for h in hits:
            m.acquire(h)
            m.cstats["hit_blocks"] += len(h)
        m.generation += 1
        assert snap.allocation_generation == m.generation
        cursor = 0
        for s, n, h in zip(snap.sequences, needs, hits, strict=True):
            fresh = n - len(h)
            row = tuple(m.cache[k] for k in h) + tuple(taken[cursor : cursor + fresh])
            assert s.block_ids[0] == row, "allocator handed out other blocks"
            assert s.cached_prefix_len == len(h) * BS
            cursor += fresh
        m.reserved[rid] = Reservation(request, snap, list(taken), [list(h) for h in hits])
        m.history.setdefault(rid, []).append(snap)
        if keep:
            self.note("reserve: prefix hit")
        return snap

    def op_reserve(self) -> None:
        m, rid = self.model, self.rng.choice(RIDS)
        if self.rng.random() < 0.15:  # malformed: the allocator applies the worker's rules
            bad = self.rng.choice(
                [
                    KVRequest(rid, (SequenceRequest(-1, 1, 1),)),
                    KVRequest(rid, (SequenceRequest(0, 1.0, 1),)),  # type: ignore[arg-type]
                    KVRequest(rid, (SequenceRequest("0", 1, 1),)),  # type: ignore[arg-type]
                    KVRequest(rid, (SequenceRequest(0, True, 1),)),
                    KVRequest(rid, (SequenceRequest(0, MAX_LEN, 1),)),
                    KVRequest(
                        rid, (SequenceRequest(0, 1, 1), SequenceRequest(1, 1, 1), SequenceRequest(2, 1, 1))
                    ),
                    KVRequest(rid, (SequenceRequest(0, 7, 1, prefix_keys=chain(0, 2)),)),  # 2 keys > 7 tokens
                    KVRequest(rid, (SequenceRequest(0, 9, 1, prefix_keys=chain(0, 1) * 2),)),  # a key twice
                    KVRequest(rid, (SequenceRequest(0, 9, 1, prefix_keys=("chain0-0",)),)),  # type: ignore[arg-type]
                ]
            )
            before = self.state()
            with pytest.raises(AdmissionError):
                self.alloc.reserve(bad)
            self.rejected(before, "malformed reservation")
            return
        res = m.reserved.get(rid)
        request = res.request if res is not None and self.rng.random() < 0.5 else self.random_request(rid)
        before = self.state()
        if res is not None:
            if request != res.request:
                with pytest.raises(AdmissionError, match="already reserved with a different shape"):
                    self.alloc.reserve(request)
                self.rejected(before, "reservation under a reserved id")
                return
            self.re_reserve(rid)
            return
        snap = self.reserve(request)
        if snap is None:
            return
        if self.rng.random() < 0.3 and not any(s.prefix_keys for s in request.sequences):
            m.history[rid][-1] = self.with_pinned_prefix(snap)  # leading blocks: the pinned ones
        self.note("reserve")

    def re_reserve(self, rid: str) -> None:
        """Reserve a reserved request again: its snapshot under a new generation."""
        m = self.model
        res = m.reserved[rid]
        snap = self.alloc.reserve(res.request)
        m.generation += 1
        assert snap == RequestAllocation(rid, m.generation, res.snap.sequences, res.snap.contexts)
        res.snap = snap
        m.history[rid].append(snap)
        self.note("re-reserve")

    def with_pinned_prefix(self, snap: RequestAllocation) -> RequestAllocation:
        seqs = []
        for s in snap.sequences:
            k = min(self.rng.choice((1, 2)), s.prefix_len // BS, PINNED_BLOCKS)
            blocks = tuple(self.pinned_blocks[:k]) + s.block_ids[0][k:]
            seqs.append(
                SequenceAllocation(
                    s.sequence_id, s.prefix_len, s.target_len, s.seq_len, (blocks,), cached_prefix_len=k * BS
                )
            )
        return RequestAllocation(snap.request_id, snap.allocation_generation, tuple(seqs))

    def spare_ids(self) -> list[str]:
        """Request ids a new reservation may take: neither reserved nor held by the worker. A
        scheduler retires a request on the worker before its id serves another one; an id the
        worker still holds would make the new request's first snapshot a newer generation of the
        old one, which the registry takes as a transition where the blocks allow one (TRUNCATE,
        EXTEND: its own tests cover them) and this model, which knows INSTALL and SEAL only,
        would call a conflict."""
        m = self.model
        return [r for r in RIDS if r not in m.reserved and r not in m.installed]

    def op_hit(self) -> None:
        """Reserve and install a request whose leading keys are cached while their publisher
        still holds them: the cached blocks come back read-only as its cached prefix."""
        m = self.model
        spare = self.spare_ids()
        live = [
            c
            for c in range(CHAINS)
            if (key := chain(c, 1)[0]) in m.cache
            and (pub := m.reserved.get(m.publisher[key])) is not None
            and any(key in h for h in pub.held)
        ]
        if not spare or not live:
            return
        c = self.rng.choice(live)
        n = self.rng.randint(1, 3)
        p = self.rng.randint(n * BS, 14)
        seqs = [SequenceRequest(0, p, self.rng.randint(1, min(8, MAX_LEN - p)), prefix_keys=chain(c, n))]
        if self.rng.random() < 0.3:
            seqs.append(replace(self.random_request("x").sequences[0], sequence_id=1))
        snap = self.reserve(KVRequest(self.rng.choice(spare), tuple(seqs)))
        if snap is None:
            return
        assert snap.sequences[0].cached_prefix_len >= BS, "a cached leading key did not hit"
        self.note("hit while its publisher is live")
        self.install(snap, "hit", faults=False)

    def sized(self, rid: str, n: int) -> KVRequest:
        """A request without prefix keys that needs exactly ``n`` blocks (one or two rows)."""
        most = MAX_LEN // BS
        seqs = []
        for i, size in enumerate([n] if n <= most else [most, n - most]):
            t = self.rng.randint(1, min(8, size * BS - 1))
            seqs.append(SequenceRequest(i, size * BS - t, t))
        return KVRequest(rid, tuple(seqs))

    def op_evict(self) -> None:
        """Reserve a little more than the pool has free while idle cached blocks exist (a filler
        reservation first when the pool has plenty): the allocator evicts the least recently
        used of them, never one the request hits, or waits, evicting nothing."""
        m = self.model
        holding = [r for r, res in m.reserved.items() if any(res.held)]
        if not m.idle and holding:  # a request holding cached blocks finishes: they may go idle
            self.finish(self.rng.choice(holding))
        spare = self.spare_ids()
        most = 2 * (MAX_LEN // BS)
        if not m.idle or not spare:
            return
        if len(m.free) >= most and len(spare) > 1:
            self.reserve(self.sized(spare.pop(), min(most, len(m.free) - self.rng.randint(0, 2))))
        want = len(m.free) + self.rng.randint(1, len(m.idle) + 1)  # one more than idle: a wait
        if want <= most:
            self.reserve(self.sized(self.rng.choice(spare), want))

    def forged(self) -> RequestAllocation | None:
        """A snapshot that must be refused: a repeated block, or a block another live row writes
        (or reads while this one writes)."""
        m = self.model
        if self.rng.random() < 0.4:
            candidates = [
                s
                for hist in m.history.values()
                for s in hist
                if any(len(q.block_ids[0]) > 1 for q in s.sequences)
            ]
            if not candidates:
                return None
            snap = self.rng.choice(candidates)
            seqs = list(snap.sequences)
            i = next(k for k, q in enumerate(seqs) if len(q.block_ids[0]) > 1)
            ids = list(seqs[i].block_ids[0])
            ids[-1] = ids[0]
            q = seqs[i]
            seqs[i] = SequenceAllocation(
                q.sequence_id,
                q.prefix_len,
                q.target_len,
                q.seq_len,
                (tuple(ids),),
                cached_prefix_len=q.cached_prefix_len,
            )
            return RequestAllocation(snap.request_id, snap.allocation_generation, tuple(seqs))
        held = m.holders()
        if not held:
            return None
        block = self.rng.choice(sorted(held))
        spare = [r for r in RIDS if r not in m.installed]
        if not spare:
            return None
        rid = self.rng.choice(spare)
        gen = max([m.removed.get(rid, -1), m.generation]) + 1
        cached = BS if (self.rng.random() < 0.5 and not any(w for _, w in held[block])) else 0
        if cached and self.rng.random() < 0.5:
            cached = 0  # this row would write a block others read
        free = [b for b in range(NUM_BLOCKS) if b not in held and b != block][:2]
        snap = RequestAllocation(
            rid, gen, (SequenceAllocation(0, 4, 4, 8, ((block, free[0]),), cached_prefix_len=cached),)
        )
        return snap if m.conflicts(snap) else None

    def op_install(self) -> None:
        m = self.model
        roll = self.rng.random()
        if roll < 0.2:
            snap = self.forged()
            kind = "forged"
        elif roll < 0.35 and m.history:
            snap = self.rng.choice(self.rng.choice(list(m.history.values())))
            kind = "replay"
        else:
            fresh = [h[-1] for r, h in m.history.items() if r not in m.installed or self.rng.random() < 0.3]
            snap = self.rng.choice(fresh) if fresh else None
            kind = "install"
        if snap is None:
            return
        self.install(snap, kind)

    def predict(
        self, snap: RequestAllocation, fault: bool, seal: bool = False
    ) -> tuple[type[Exception] | None, str]:
        """What the worker must answer to ``snap`` (independent of the registry): the error it
        raises (None: taken) and the outcome. ``seal``: the allocator's publish hands it over,
        which only a request the worker holds can take."""
        m = self.model
        rid, gen = snap.request_id, snap.allocation_generation
        current = m.installed.get(rid)
        if repeated(snap):
            return ValidationError, "repeated block"
        if current is None and seal:
            return StateError, "not installed"
        if current is not None:
            if gen < current[1]:
                return GenerationError, "stale"
            if snap.content_key() == current[0].content_key():
                return None, "no-op"
            if gen > current[1] and is_seal(current[0], snap):
                for s in snap.sequences:
                    row = m.rows[(rid, s.sequence_id)]
                    if (
                        s.cached_prefix_len > row.cached
                        and not set(range(s.cached_prefix_len)) <= row.written
                    ):
                        return StateError, "never written"
                return None, "sealed"
            return GenerationError, "conflicting"
        if rid in m.removed and gen <= m.removed[rid]:
            if rid in m.finished and gen > m.finished[rid]:
                return GenerationError, "late snapshot of a finished request"  # refused all the same
            return GenerationError, "removed"
        if m.conflicts(snap) or len(snap.sequences) > WORKER_ROWS - len(m.row_index):
            return ValidationError, "ownership"
        return (NativeBackendError, "fault") if fault else (None, "installed")

    def over_cached(self, snap: RequestAllocation) -> bool:
        """Would ``snap`` — of a request the scheduler no longer reserves with these blocks (a
        late delivery) — write a block published since? A scheduler retires a request on the
        worker before it frees its blocks, so such a snapshot never reaches a worker; the driver
        does not send it (what it would write is no longer the request's)."""
        res = self.model.reserved.get(snap.request_id)
        if res is not None and [s.block_ids for s in res.snap.sequences] == [
            s.block_ids for s in snap.sequences
        ]:
            return False
        return any(
            b in self.model.pages for s in snap.sequences for b in s.block_ids[0][s.cached_prefix_len // BS :]
        )

    def install(self, snap: RequestAllocation, kind: str, faults: bool = True) -> None:
        fault = faults and self.rng.random() < 0.05
        before = self.state()
        expected, outcome = self.predict(snap, fault)
        if outcome == "late snapshot of a finished request":
            kind = outcome
        if expected is None and outcome == "installed" and self.over_cached(snap):
            self.note("late snapshot over a cached block: not sent")
            return
        self.bt.fail_apply = expected is NativeBackendError
        if expected is not None:
            with pytest.raises(expected):
                self.registry.install(snap)
            self.bt.fail_apply = False
            self.rejected(before, f"{kind} install ({expected.__name__})")
            return
        result = self.registry.install(snap)
        assert result is (outcome == "installed")
        self.taken(snap, outcome)
        self.note(f"{kind}: {outcome}")

    def taken(self, snap: RequestAllocation, outcome: str) -> None:
        """The model of a snapshot the worker took (``outcome`` as predicted)."""
        m = self.model
        rid, gen = snap.request_id, snap.allocation_generation
        m.high_water = max(m.high_water, gen)
        if outcome == "no-op":
            current = m.installed[rid]
            m.installed[rid] = (current[0], max(gen, current[1]))
            return
        if outcome == "sealed":
            for s in snap.sequences:
                m.rows[(rid, s.sequence_id)].cached = s.cached_prefix_len
            m.installed[rid] = (snap, gen)
            return
        assert outcome == "installed"
        used = set(m.row_index.values())
        free_rows = [r for r in range(WORKER_ROWS) if r not in used]
        for s, row in zip(snap.sequences, free_rows, strict=False):
            key = (rid, s.sequence_id)
            m.row_index[key] = row
            kv = {}
            hit = False
            for li, name in enumerate(LAYERS):
                k = torch.full((s.seq_len, HKV, D), float("nan"))
                v = torch.full((s.seq_len, HKV, D), float("nan"))
                for t in range(s.cached_prefix_len):  # declared computed: what its pages hold
                    b = s.block_ids[0][t // BS]
                    # a published block: its publisher's K/V (the invariants keep the pages so)
                    page = m.pages[b] if b in m.pages else self.pages(b)
                    hit |= b in m.pages
                    k[t], v[t] = page[li, 0, t % BS], page[li, 1, t % BS]
                kv[name] = (k, v)
            m.rows[key] = RowModel(
                s.prefix_len,
                s.seq_len,
                s.cached_prefix_len,
                s.block_ids[0],
                set(range(s.cached_prefix_len)),
                kv,
                hit,
            )
            m.hold(m.rows[key], +1)
        m.installed[rid] = (snap, gen)
        m.removed.pop(rid, None)
        m.finished.pop(rid, None)

    # -- prefix caching ----------------------------------------------------------------------------

    def op_publish(self) -> None:
        """Seal and cache a request's keyed blocks: once its prefill wrote them, or too early."""
        m = self.model
        keyed = [r for r, res in m.reserved.items() if any(s.prefix_keys for s in res.request.sequences)]
        if not keyed:
            return
        unsealed = [
            r
            for r in keyed
            if any(
                len(s.prefix_keys) * BS > a.cached_prefix_len
                for s, a in zip(m.reserved[r].request.sequences, m.reserved[r].snap.sequences, strict=True)
            )
        ]
        held = [r for r in unsealed if r in m.installed]
        roll = self.rng.random()
        if roll < 0.75 and unsealed:
            # the scheduler's path: installed (a generation newer than any removal of it), its
            # prefill ran, then published; or too early: published before the prefill
            rid = self.rng.choice(unsealed)
            if rid not in m.installed:
                self.re_reserve(rid)
                self.install(m.reserved[rid].snap, "install before publish", faults=False)
            current = m.installed.get(rid)
            if (
                roll < 0.6
                and current is not None
                and current[0].content_key() == m.reserved[rid].snap.content_key()
            ):
                self.op_step(rid)
        else:  # whatever the worker holds of it, if anything
            rid = self.rng.choice(held if held and roll < 0.9 else keyed)
        res = m.reserved[rid]
        offers: list[tuple[int, bytes, int]] = []
        seqs = list(res.snap.sequences)
        for i, (s, a) in enumerate(zip(res.request.sequences, res.snap.sequences, strict=True)):
            cut = len(s.prefix_keys) * BS
            if cut > a.cached_prefix_len:
                first = a.cached_prefix_len // BS
                offers += [(i, s.prefix_keys[b], a.block_ids[0][b]) for b in range(first, len(s.prefix_keys))]
                seqs[i] = replace(a, cached_prefix_len=cut)
        before = self.state()
        if not offers:
            assert self.alloc.publish(rid, self.runner.seal) is None
            assert self.same(before, self.state())
            self.note("publish: nothing to seal")
            return
        seal = RequestAllocation(rid, m.generation + 1, tuple(seqs), res.snap.contexts)
        expected, outcome = self.predict(seal, fault=False, seal=True)
        if expected is not None:
            why = {"not installed": "not installed", "never written": "never written"}.get(outcome)
            with pytest.raises(expected, match=why):
                self.alloc.publish(rid, self.runner.seal)
            self.rejected(before, f"publish ({outcome})")
            return
        assert outcome in ("sealed", "no-op")  # no-op: the worker holds these rows sealed already
        assert self.alloc.publish(rid, self.runner.seal) == seal
        m.generation += 1
        self.taken(seal, outcome)
        m.presealed[rid] = res.snap
        res.snap = seal
        m.history[rid].append(seal)
        for i, key, block in offers:
            if key in m.cache:
                self.note("publish: key cached already")
                continue
            if CACHE_CAP - len(m.cache) + len(m.idle) <= 0:
                self.note("publish: cache full")
                continue
            if len(m.cache) >= CACHE_CAP:
                m.evict([next(iter(m.idle))])
                self.note("evicted at the cap")
            # the pages hold what the publisher wrote: that is what every hit will read
            row = m.rows[(rid, res.request.sequences[i].sequence_id)]
            j = row.blocks.index(block)
            page = self.pages(block).clone()
            span = slice(j * BS, (j + 1) * BS)
            wrote = torch.stack([torch.stack((row.kv[n][0][span], row.kv[n][1][span])) for n in LAYERS])
            assert torch.equal(page, wrote), f"block {block} does not hold what its publisher {rid!r} wrote"
            m.cache[key], m.crefs[key], m.pages[block], m.publisher[key] = block, 1, page, rid
            m.cstats["published_blocks"] += 1
            res.private.remove(block)
            res.held[i].append(key)
        self.note("publish")

    def op_replay(self) -> None:
        """Re-install the snapshot a sealed request had before its seal (stale: refused) or the
        one it has now (a no-op)."""
        m = self.model
        sealed = [r for r in sorted(m.presealed) if r in m.installed]
        if not sealed:
            return
        rid = self.rng.choice(sealed)
        if self.rng.random() < 0.7:
            snap = m.presealed[rid]
            assert self.predict(snap, fault=False) == (GenerationError, "stale")
            self.install(snap, "pre-seal replay")
        else:
            self.install(m.installed[rid][0], "sealed replay")

    def op_remove(self) -> None:
        m = self.model
        roll = self.rng.random()
        rid = self.rng.choice(RIDS)
        before = self.state()
        if roll < 0.1:
            bad = self.rng.choice([None, 3, [None], [("x",)], [""]])
            with pytest.raises(ValidationError):
                self.registry.remove(bad)  # type: ignore[arg-type]
            self.rejected(before, "malformed removal")
            return
        if roll < 0.3:
            self.retire(rid)
            return
        scoped = roll < 0.5
        entry: Any = (rid, self.rng.randint(max(0, m.generation - 3), m.generation)) if scoped else rid
        targeted = rid in m.installed and (not scoped or m.installed[rid][1] == entry[1])
        fault = targeted and self.rng.random() < 0.05
        self.bt.fail_apply = fault
        if fault:
            with pytest.raises(NativeBackendError):
                self.registry.remove(entry if self.rng.random() < 0.5 else [entry])
            self.bt.fail_apply = False
            self.rejected(before, "removal (BlockTables fault)")
            return
        n = self.registry.remove(entry if self.rng.random() < 0.5 else [entry])
        if not targeted:
            assert n == 0 and self.same(before, self.state())
            return
        snap = m.drop(rid)
        assert n == len(snap.sequences)
        self.note("remove")

    def retire(self, rid: str) -> None:
        """Removal for good, as the scheduler does it: through the allocator's generation, or
        (a careless caller) through one below the installed generation."""
        m = self.model
        installed = m.installed.get(rid)
        through = m.generation if self.rng.random() < 0.8 else self.rng.randint(0, m.generation + 1)
        assert self.alloc.generation == m.generation
        before = self.state()
        if installed is not None and installed[1] > through:
            with pytest.raises(
                GenerationError, match=f"newer than the retirement through generation {through}"
            ):
                self.runner.retire(rid, through)
            self.rejected(before, "retirement below the installed generation")
            return
        fault = installed is not None and self.rng.random() < 0.05
        self.bt.fail_apply = fault
        if fault:
            with pytest.raises(NativeBackendError):
                self.runner.retire(rid, through)
            self.bt.fail_apply = False
            self.rejected(before, "retirement (BlockTables fault)")
            return
        n = self.runner.retire(rid, through)
        assert n == (len(installed[0].sequences) if installed is not None else 0)
        m.retire(rid, through)
        self.note("retire" if installed is not None else "retire: tombstone only")

    def op_reap(self) -> None:
        """What a scheduler does at every step: retire rows no reservation owns."""
        m = self.model
        zombies = m.zombies()
        through = {rid: max(m.generation, m.installed[rid][1]) for rid in zombies}
        before = self.state()
        reaped = reap_unreserved(self.runner, self.alloc)
        assert set(reaped) == zombies and len(reaped) == len(zombies)
        if not zombies:
            assert self.same(before, self.state())
            return
        for rid in zombies:
            m.retire(rid, through[rid])
        self.note("reaped")

    def op_restart(self) -> None:
        """The scheduler side starts over on the live worker: a new pool, prefix cache and
        allocator (every reservation and cached block forgotten), continuing above the worker's
        generations; the pinned blocks are reserved again (they come back as the same ids)."""
        m = self.model
        assert self.runner.generation_high_water == m.high_water
        m.reserved.clear()
        m.forget_cache()
        m.free = set(range(NUM_BLOCKS))
        self.new_scheduler()
        self.note("restart")

    def finish(self, rid: str) -> None:
        """The scheduler's terminal path: retire on the worker through its generation, then free
        (its own blocks go back to the pool, its cached ones lose a reference)."""
        m = self.model
        assert self.runner.retire(rid, m.generation) == len(
            m.installed[rid][0].sequences if rid in m.installed else ()
        )
        m.retire(rid, m.generation)
        res = m.reserved.pop(rid)
        assert self.alloc.free(rid) == len(res.private)
        m.free |= set(res.private)
        for keys in res.held:
            m.release(keys)
        self.note("finished")

    def op_free(self) -> None:
        m = self.model
        roll = self.rng.random()
        before = self.state()
        if roll < 0.2:  # double frees and duplicates straight into the pool
            used = [b for res in m.reserved.values() for b in res.private]
            choices = [[b] for b in sorted(m.free)[:3]] + ([[used[0], used[0]]] if used else [])
            if not choices:
                return
            with pytest.raises(ValidationError):
                self.pool.free(self.rng.choice(choices))
            self.rejected(before, "pool double free")
            return
        live = [r for r in m.reserved if r != PINNED]
        if not live:
            return
        rid = self.rng.choice(live)
        # the scheduler should release after the worker removed the rows; sometimes it does not
        if rid in m.installed and self.rng.random() < 0.7:
            return
        res = m.reserved.pop(rid)
        assert self.alloc.free(rid) == len(res.private)
        assert self.alloc.free(rid) == 0
        m.free |= set(res.private)
        for keys in res.held:
            m.release(keys)
        self.note("free" + (" (worker still holds)" if rid in m.installed else ""))

    def op_bind(self) -> None:
        """Bind random host caches to a second worker; the model decides, by enumerating the
        storage elements each view covers, whether two layers (or a layer's two halves) share
        memory. A refused binding leaves that worker uninitialised and this one untouched."""
        shape = (2, NUM_BLOCKS, BS, HKV, D)
        numel = 2 * NUM_BLOCKS * BS * HKV * D
        buffer = torch.zeros(4 * numel)
        base = torch.arange(buffer.numel())

        def view(offset: int, interleave: int = 1, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
            stride = [NUM_BLOCKS * BS * HKV * D, BS * HKV * D, HKV * D, D, 1]
            stride = [s * interleave for s in stride[:-1]] + [1]
            args = (shape, tuple(stride), offset + part * D)
            return buffer.as_strided(*args), base.as_strided(*args)

        kind = self.rng.choice(("disjoint", "same", "overlap", "interleaved", "broadcast", "grad"))
        if kind == "disjoint":
            pairs = [view(0), view(numel + self.rng.randint(0, numel))]
        elif kind == "same":
            pairs = [view(0), view(0)]
        elif kind == "overlap":
            pairs = [view(0), view(self.rng.randint(1, numel - 1))]
        elif kind == "interleaved":
            pairs = [view(0, 2, 0), view(0, 2, self.rng.choice((0, 1)))]
        elif kind == "broadcast":
            one = buffer[: BS * HKV * D].view(1, 1, BS, HKV, D).expand(shape)
            pairs = [view(numel), (one, base[: BS * HKV * D].view(1, 1, BS, HKV, D).expand(shape))]
        else:
            pairs = [view(0), view(numel)]
        caches = {n: t for n, (t, _) in zip(LAYERS, pairs, strict=True)}
        if kind == "grad":
            caches["l1"] = caches["l1"].detach().requires_grad_()
        covered = [idx.reshape(-1).tolist() for _, idx in pairs]
        shares = len(set(covered[0]) & set(covered[1])) > 0 or any(len(set(c)) < len(c) for c in covered)
        worker = PagedWorker(
            CpuPlatform(), RunnerConfig(MAX_LEN, ROWS_PER_REQ, MAX_SEQS, WORKER_ROWS * MAX_LEN)
        )
        worker.register_kv_cache_layers({n: PagedLayerSpec(H, HKV, D, torch.float32) for n in LAYERS})
        before = self.state()
        if shares or kind == "grad":
            with pytest.raises(ValidationError, match="requires grad" if kind == "grad" else "memory"):
                worker.initialize_kv_cache(num_blocks=NUM_BLOCKS, block_size=BS, kv_caches=caches)
            assert not worker.initialized and torch.count_nonzero(buffer) == 0
            self.rejected(before, f"binding ({kind})")
            return
        worker.initialize_kv_cache(num_blocks=NUM_BLOCKS, block_size=BS, kv_caches=caches)
        assert all(worker.kv_caches[n] is caches[n] for n in LAYERS)
        assert self.same(before, self.state())
        self.note(f"binding accepted ({kind})")

    def op_step(self, rid: str | None = None) -> None:
        """A step of random installed requests at a random phase (``rid``: that request's
        prefill, without faults, as the scheduler runs it)."""
        m = self.model
        if not m.installed:
            return
        if rid is None:
            rids = self.rng.sample(sorted(m.installed), self.rng.randint(1, len(m.installed)))
            step = self.rng.choice((0, 0, 1, 2, 5))
            into_cached = self.rng.random() < 0.1
        else:
            rids, step, into_cached = [rid], 0, False
        keys = [(rid, s.sequence_id) for rid in rids for s in m.installed[rid][0].sequences]
        prefill = tuple(
            PagedRow(k[0], m.rows[k].seq_len - start, m.rows[k].seq_len, start, sequence_id=k[1])
            for k in keys
            for start in [0 if into_cached else m.rows[k].cached]
        )
        denoise = tuple(
            PagedRow(
                k[0],
                m.rows[k].seq_len - m.rows[k].prefix,
                m.rows[k].seq_len,
                m.rows[k].prefix,
                sequence_id=k[1],
            )
            for k in keys
        )
        rows = prefill if step == 0 else denoise
        builder_fault = self.rng.random() < 0.04 and rid is None
        write_fault = self.rng.random() < 0.04 and rid is None
        expected: tuple[type[Exception], str] | None = None
        for r in rows:
            row = m.rows[key_of(r)]
            if r.kv_start_pos < row.cached:
                expected = (ValidationError, "read-only cached prefix")
                break
        if expected is None:
            for r in rows:
                row = m.rows[key_of(r)]
                if not set(range(r.kv_start_pos)) <= row.written:
                    expected = (StateError, "never written")
                    break
        if expected is None and builder_fault:
            expected = (NativeBackendError, "injected builder fault")
        total = sum(r.query_len for r in rows)
        q = torch.randn(total, H, D, generator=self.gen)
        k = torch.randn(total, HKV, D, generator=self.gen)
        v = torch.randn(total, HKV, D, generator=self.gen)
        spans = AttentionMetadata(full_attn_spans=[[(m.rows[key_of(r)].prefix, r.seq_len)] for r in rows])
        before = self.state()
        self.platform.faults.builder = builder_fault
        self.platform.faults.write_layer = "l1" if write_fault else None
        outputs: dict[str, torch.Tensor] = {}
        try:
            with self.runner.activate(PhaseRows(prefill, denoise)) as runtime:
                if expected is not None:
                    with pytest.raises(expected[0], match=expected[1]):
                        runtime.ensure_active(step)
                        for name in LAYERS:
                            self.runner.forward(name, q, k, v, spans)
                    self.rejected(before, f"step ({expected[1]})")
                    return
                runtime.ensure_active(step)
                for name in LAYERS:
                    try:
                        outputs[name] = self.runner.forward(name, q, k, v, spans)
                    except NativeBackendError as exc:
                        assert write_fault and name == "l1" and "injected write fault" in str(exc)
        finally:
            self.platform.faults.builder = False
            self.platform.faults.write_layer = None
        # the model: every layer that ran wrote its span; provenance only if every layer ran
        offset = 0
        for r in rows:
            row = m.rows[key_of(r)]
            span = slice(r.kv_start_pos, r.seq_len)
            for name in outputs:
                row.kv[name][0][span] = k[offset : offset + r.query_len]
                row.kv[name][1][span] = v[offset : offset + r.query_len]
            if len(outputs) == len(LAYERS):
                row.written |= set(range(r.kv_start_pos, r.seq_len))
            for name, out in outputs.items():
                ref = dense_reference(q[offset : offset + r.query_len], row, name, r.kv_start_pos)
                torch.testing.assert_close(
                    out[offset : offset + r.query_len].double(), ref, atol=1e-5, rtol=1e-5
                )
            offset += r.query_len
        self.note("step" + (" (write fault)" if write_fault else ""))
        if outputs and any(m.rows[key_of(r)].hit for r in rows):
            self.note("step over a prefix hit")

    # -- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        m = self.model
        owned_mirrors_writer(self.registry)
        held: dict[int, list[tuple[Any, bool]]] = {}
        for g in range(1):
            for b in range(NUM_BLOCKS):
                holders = self.registry.holders_of(g, b)
                if holders:
                    held[b] = list(holders.items())
                    writers = [h for h, w in holders.items() if w]
                    assert not writers or len(holders) == 1, (
                        f"block {b} written by {writers} while held by {holders}"
                    )
        expected = {b: sorted(((k[0], k[1], None), w) for k, w in hs) for b, hs in m.holders().items()}
        assert {b: sorted(hs) for b, hs in held.items()} == expected
        # every block is free, a reservation's own, or cached: exactly one of them
        private = [b for res in m.reserved.values() for b in res.private]
        cached = set(m.cache.values())
        assert len(private) == len(set(private)) and len(cached) == len(m.cache)
        assert (
            set(private).isdisjoint(m.free) and set(private).isdisjoint(cached) and cached.isdisjoint(m.free)
        )
        assert sorted(self.pool._free) == sorted(m.free)
        assert set(self.cache.blocks()).isdisjoint(self.pool._free), "a block is both free and cached"
        assert len(private) + len(cached) + self.pool.num_free == NUM_BLOCKS, "a block leaked"
        for rid, res in m.reserved.items():
            assert self.alloc.blocks_of(rid) == used_blocks(res.snap)
        # the prefix cache is the model's
        assert self.cache.blocks() == {m.cache[k]: m.crefs[k] for k in m.cache}
        assert all(self.cache.refs(k) == m.crefs[k] and self.cache.key_of(b) == k for k, b in m.cache.items())
        assert list(self.cache._idle) == list(m.idle), "the eviction order differs"
        assert self.cache.stats() == {
            **{s: m.cstats[s] for s in STATS},
            "cached_blocks": len(m.cache),
            "idle_blocks": len(m.idle),
        }
        holding = Counter(k for res in m.reserved.values() for keys in res.held for k in keys)
        assert holding == +Counter(m.crefs), "a cached key's references are not the reservations holding it"
        assert set(m.idle) == {k for k, n in m.crefs.items() if not n}
        assert self.alloc.blocks_held == NUM_BLOCKS - len(m.free) - len(m.idle)
        # a cached block: nobody writes it, and it holds what its publisher wrote
        for b in cached:
            assert not any(w for _, w in held.get(b, ())), f"a live row writes cached block {b}"
        if cached:
            blocks = sorted(cached)
            now = torch.stack([c[:, blocks] for c in self.caches])
            then = torch.stack([m.pages[b] for b in blocks], dim=2)
            assert torch.equal(now, then), "a cached block's K/V changed since it was published"
        assert {k: v for k, v in self.registry.rows.items()} == {
            (r, s, None): i for (r, s), i in m.row_index.items()
        }
        assert {r: self.registry.generation_of(r) for r in self.registry.installed_requests()} == {
            r: g for r, (_, g) in m.installed.items()
        }
        for (rid, sid), row in m.rows.items():
            spans = self.registry.written_spans((rid, sid, None))
            assert {t for a, b in spans for t in range(a, b)} == row.written
        assert {b: len(hs) for b, hs in held.items()} == m.refs, "a block's holders differ from its refcount"
        assert sum(m.refs.values()) == sum(len(r.blocks) for r in m.rows.values())
        assert self.registry.generation_high_water == m.high_water
        assert {r: self.registry.removed_generation(r) for r in m.removed} == m.removed
        assert set(self.registry.installed_requests()) - set(self.alloc.reserved()) == m.zombies()

    # -- the end ---------------------------------------------------------------------------------

    def drain(self) -> None:
        """Retire and free every reservation (the scheduler's terminal path), replay every
        snapshot ever issued, reap what no reservation owns: zero rows, zero blocks held; every
        cached block is idle, and evicting them all returns the pool to all but the pinned."""
        m = self.model
        for rid in sorted(set(m.reserved) - {PINNED}):
            self.finish(rid)
            self.check()
        snapshots = [snap for hist in m.history.values() for snap in hist]
        for snap in snapshots:
            self.install(snap, "final replay", faults=False)
            self.check()
        self.op_reap()
        self.check()
        assert self.registry.rows == {} and self.registry.installed_requests() == ()
        assert self.registry.free_rows == tuple(range(WORKER_ROWS)) and m.refs == {}
        assert all(not self.registry.holders_of(0, b) for b in range(NUM_BLOCKS))
        assert self.alloc.reserved() == (PINNED,) and self.alloc.blocks_held == PINNED_BLOCKS
        assert all(n == 0 for n in self.cache.blocks().values()) and self.cache.num_idle == len(self.cache)
        assert self.pool.num_free + len(self.cache) == NUM_BLOCKS - PINNED_BLOCKS
        self.pool.free(self.cache.evict(len(self.cache)))
        m.evict(list(m.idle))
        self.check()
        assert len(self.cache) == 0 and self.pool.num_free == NUM_BLOCKS - PINNED_BLOCKS


def dense_reference(q: torch.Tensor, row: RowModel, layer: str, start: int) -> torch.Tensor:
    """Attention of ``q`` (positions ``start..seq_len``) over the row's own logical K/V: causal,
    with the target span ``[prefix, seq_len)`` bidirectional."""
    k, v = (t.double().repeat_interleave(H // HKV, dim=1) for t in row.kv[layer])
    assert not torch.isnan(k).any() and not torch.isnan(v).any(), "the row read a token never written"
    qpos = torch.arange(start, row.seq_len)[:, None]
    kpos = torch.arange(row.seq_len)[None, :]
    allowed = (kpos <= qpos) | (qpos >= row.prefix)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


OPS = ("reserve", "install", "install", "step", "step", "remove", "free", "reap", "publish", "hit")
RARE = (("restart", 0.006), ("bind", 0.01), ("evict", 0.04), ("replay", 0.03))  # instead of one of OPS


@pytest.mark.parametrize("seed", SEEDS)
def test_worker_holds_its_guarantees_under_random_operations(seed: int) -> None:
    fuzz = Fuzz(seed)
    ops = max(TOTAL_OPS // len(SEEDS), MIN_OPS_PER_SEED)
    for i in range(ops):
        roll = fuzz.rng.random()
        op = next((name for name, p in RARE if (roll := roll - p) < 0), None) or fuzz.rng.choice(OPS)
        try:
            getattr(fuzz, f"op_{op}")()
            fuzz.check()
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, operation {i} ({op}): {exc}") from exc
    fuzz.drain()
    # the run must have exercised every kind of outcome, not only the easy ones
    seen = " | ".join(sorted(fuzz.counts))
    for kind in (
        "forged install",
        "replay install",
        "never written",
        "read-only cached prefix",
        "step (write fault)",
        "pool double free",
        "free (worker still holds)",
        "injected builder fault",
        "remove",
        "installed",
        "retire",
        "late snapshot of a finished request",
        "reaped",
        "restart",
        "binding (",
        "binding accepted",
        "final replay",
        "publish |",
        "publish (never written)",
        "publish (not installed)",
        "reserve: prefix hit",
        "hit while its publisher is live",
        "hit: installed",
        "step over a prefix hit",
        "evicted under pool pressure",
        "evicted at the cap",
        "pre-seal replay install (GenerationError)",
    ):
        assert kind in seen, f"seed {seed}: no '{kind}' outcome in {ops} operations: {seen}"

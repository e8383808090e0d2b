"""Model-based fuzz of the whole worker path: allocator + registry + runtime + ``cpu`` forward.

A seeded random driver issues valid and invalid operations — reservations (good and malformed),
installs (fresh, replays of old snapshots, late snapshots of requests retired for good, forged
overlapping or repeated block ids, cached prefixes shared read-only), denoise steps in any
order (prefill, denoise before prefill, writes into a cached prefix), removals (by id, by
generation, for good through a generation, malformed), scheduler frees in the wrong order,
double frees, scheduler restarts (a new allocator on the live worker), reaping of rows no
reservation owns, cache bindings (the worker's caches are host tensors — disjoint slices or
interleaved halves of one buffer — and random bindings of a second worker, aliased ones
included), and injected plugin faults (metadata builder, a layer's K/V writer, BlockTables). An
independent model — block refcounts, reservations, generations, tombstones — predicts every
outcome. After every operation:

* no block is written by one live row while another live row holds it, and every block's
  holders are the model's refcount;
* no block leaks: the pool's free list plus every reservation is the whole pool;
* a rejected operation left registry, allocator and every cache byte-identical;
* every paged output equals dense attention over that row's own K/V (per layer).

At the end every reservation is retired and freed, every snapshot ever issued is replayed, and
what the allocator does not reserve is reaped: the worker holds zero rows and zero blocks.

``DKV_FUZZ_OPS`` (default 10,000 in all) and ``DKV_FUZZ_SEED`` (a list of seeds) widen a run.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
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
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, RunnerBackend, RunnerConfig
from diffusion_kv.core.scheduler import reap_unreserved
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend

from .registry_helpers import FlakyBlockTables, state_of

H, HKV, D, BS = 2, 1, 4, 4
LAYERS = ("l0", "l1")
NUM_BLOCKS, MAX_LEN, ROWS_PER_REQ, MAX_SEQS = 40, 24, 2, 4
WORKER_ROWS = ROWS_PER_REQ * MAX_SEQS
RIDS = ("r0", "r1", "r2", "r3", "r4", "r5")
PREFIX_POOL = 4  # blocks the scheduler's prefix cache holds (declared computed, shared read-only)

TOTAL_OPS = int(os.environ.get("DKV_FUZZ_OPS", "10000"))
SEEDS = [int(s) for s in os.environ.get("DKV_FUZZ_SEED", "1,2,3,4").split(",")]


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

    def writes_block(self, index: int) -> bool:
        return index >= self.cached // BS


@dataclass
class Model:
    free: set[int]  # the pool's free block ids
    reserved: dict[str, tuple[KVRequest, list[int]]] = field(default_factory=dict)
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


# --- the driver --------------------------------------------------------------------------------


class Fuzz:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.platform = FaultyCpu()
        self.runner = RunnerBackend(
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
        self.pool = FreeListPool(NUM_BLOCKS)
        self.alloc = DiffusionKVAllocator(
            block_size=BS,
            max_model_len=MAX_LEN,
            max_rows_per_request=ROWS_PER_REQ,
            worker_rows=WORKER_ROWS,
            pool=self.pool,
        )
        self.model = Model(free=set(range(NUM_BLOCKS)))
        # The scheduler's prefix cache: blocks it holds for good, with content computed elsewhere.
        prefix = self.alloc.reserve(KVRequest("prefix-cache", (SequenceRequest(0, PREFIX_POOL * BS, 0),)))
        assert prefix is not None
        self.prefix_blocks = list(prefix.sequences[0].block_ids[0])
        self.model.generation = 1
        self.prefix_request = KVRequest("prefix-cache", (SequenceRequest(0, PREFIX_POOL * BS, 0),))
        self.model.reserved["prefix-cache"] = (
            KVRequest("prefix-cache", (SequenceRequest(0, PREFIX_POOL * BS, 0),)),
            self.prefix_blocks,
        )
        self.model.free -= set(range(PREFIX_POOL))
        for cache in self.runner.kv_caches.values():
            assert isinstance(cache, torch.Tensor)
            cache[:, self.prefix_blocks] = torch.randn(cache[:, self.prefix_blocks].shape, generator=self.gen)
        self.counts: dict[str, int] = {}

    # -- state ---------------------------------------------------------------------------------

    def state(self) -> tuple[Any, ...]:
        caches = [c.clone() for c in self.runner.kv_caches.values()]  # type: ignore[union-attr]
        return (state_of(self.registry), dict(self.alloc._reserved), sorted(self.pool._free), caches)

    def same(self, a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
        return a[:3] == b[:3] and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True))

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def rejected(self, before: tuple[Any, ...], what: str) -> None:
        assert self.same(before, self.state()), f"{what}: a rejection changed state"
        self.note(f"rejected {what}")

    # -- operations ----------------------------------------------------------------------------

    def random_request(self, rid: str) -> KVRequest:
        n = self.rng.choice((1, 2))
        seqs = []
        for i in range(n):
            p = self.rng.randint(1, 14)
            t = self.rng.randint(1, min(8, MAX_LEN - p))
            seqs.append(SequenceRequest(i, p, t))
        return KVRequest(rid, tuple(seqs))

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
                ]
            )
            before = self.state()
            with pytest.raises(AdmissionError):
                self.alloc.reserve(bad)
            self.rejected(before, "malformed reservation")
            return
        request = (
            m.reserved[rid][0] if rid in m.reserved and self.rng.random() < 0.5 else self.random_request(rid)
        )
        before = self.state()
        if rid in m.reserved:
            if request != m.reserved[rid][0]:
                with pytest.raises(AdmissionError, match="already reserved with a different shape"):
                    self.alloc.reserve(request)
                self.rejected(before, "reservation under a reserved id")
                return
            snap = self.alloc.reserve(request)
            m.generation += 1
            assert snap is not None and snap.allocation_generation == m.generation
            m.history.setdefault(rid, []).append(snap)
            self.note("re-reserve")
            return
        needs = [-(-(s.prefix_len + s.target_len) // BS) for s in request.sequences]
        rows_used = sum(len(r.sequences) for r, _ in m.reserved.values())
        snap = self.alloc.reserve(request)
        if len(request.sequences) > WORKER_ROWS - rows_used or sum(needs) > len(m.free):
            assert snap is None and self.same(before, self.state())
            self.note("reserve: wait")
            return
        assert snap is not None
        taken = best_fit(m.free, sum(needs))
        m.free -= set(taken)
        m.generation += 1
        assert snap.allocation_generation == m.generation
        cursor = 0
        for s, n in zip(snap.sequences, needs, strict=True):
            assert list(s.block_ids[0]) == taken[cursor : cursor + n], "allocator handed out other blocks"
            cursor += n
        m.reserved[rid] = (request, taken)
        if self.rng.random() < 0.3:  # a prefix-cache hit: leading blocks come from the prefix cache
            snap = self.with_cached_prefix(snap)
        m.history.setdefault(rid, []).append(snap)
        self.note("reserve")

    def with_cached_prefix(self, snap: RequestAllocation) -> RequestAllocation:
        seqs = []
        for s in snap.sequences:
            k = min(self.rng.choice((1, 2)), s.prefix_len // BS, PREFIX_POOL)
            blocks = tuple(self.prefix_blocks[:k]) + s.block_ids[0][k:]
            seqs.append(
                SequenceAllocation(
                    s.sequence_id, s.prefix_len, s.target_len, s.seq_len, (blocks,), cached_prefix_len=k * BS
                )
            )
        return RequestAllocation(snap.request_id, snap.allocation_generation, tuple(seqs))

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

    def install(self, snap: RequestAllocation, kind: str, faults: bool = True) -> None:
        m = self.model
        fault = faults and self.rng.random() < 0.05
        before = self.state()
        rid, gen = snap.request_id, snap.allocation_generation
        current = m.installed.get(rid)
        expected: type[Exception] | None
        if repeated(snap):
            expected = ValidationError
        elif current is not None:
            same = snap.content_key() == current[0].content_key()
            expected = GenerationError if (gen < current[1] or not same) else None
        elif rid in m.removed and gen <= m.removed[rid]:
            expected = GenerationError
            if rid in m.finished and gen > m.finished[rid]:
                kind = "late snapshot of a finished request"  # newer than it ran at: refused all the same
        elif m.conflicts(snap) or len(snap.sequences) > WORKER_ROWS - len(m.row_index):
            expected = ValidationError
        else:
            expected = NativeBackendError if fault else None
        if expected is None or expected is NativeBackendError:
            self.bt.fail_apply = fault and current is None
        if expected is not None:
            with pytest.raises(expected):
                self.registry.install(snap)
            self.bt.fail_apply = False
            self.rejected(before, f"{kind} install ({expected.__name__})")
            return
        result = self.registry.install(snap)
        self.bt.fail_apply = False
        if current is not None:
            assert result is False
            m.installed[rid] = (current[0], max(gen, current[1]))
            m.high_water = max(m.high_water, gen)
            self.note("install: no-op")
            return
        assert result is True
        used = set(m.row_index.values())
        free_rows = [r for r in range(WORKER_ROWS) if r not in used]
        for s, row in zip(snap.sequences, free_rows, strict=False):
            key = (rid, s.sequence_id)
            m.row_index[key] = row
            kv = {}
            for name in LAYERS:
                k = torch.full((s.seq_len, HKV, D), float("nan"))
                v = torch.full((s.seq_len, HKV, D), float("nan"))
                cache = self.runner.kv_caches[name]
                assert isinstance(cache, torch.Tensor)
                for t in range(s.cached_prefix_len):  # declared computed: what the pages hold now
                    b = s.block_ids[0][t // BS]
                    k[t], v[t] = cache[0, b, t % BS], cache[1, b, t % BS]
                kv[name] = (k, v)
            m.rows[key] = RowModel(
                s.prefix_len,
                s.seq_len,
                s.cached_prefix_len,
                s.block_ids[0],
                set(range(s.cached_prefix_len)),
                kv,
            )
            m.hold(m.rows[key], +1)
        m.installed[rid] = (snap, gen)
        m.removed.pop(rid, None)
        m.finished.pop(rid, None)
        m.high_water = max(m.high_water, gen)
        self.note(f"{kind}: installed")

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
        """The scheduler side starts over on the live worker: a new pool and allocator (every
        reservation forgotten), continuing above the worker's generations; the prefix cache is
        reserved again (its blocks come back as the same ids)."""
        m = self.model
        self.pool = FreeListPool(NUM_BLOCKS)
        self.alloc = DiffusionKVAllocator(
            block_size=BS,
            max_model_len=MAX_LEN,
            max_rows_per_request=ROWS_PER_REQ,
            worker_rows=WORKER_ROWS,
            pool=self.pool,
        )
        assert self.runner.generation_high_water == m.high_water
        self.alloc.advance_generation(self.runner.generation_high_water)
        m.reserved.clear()
        m.free = set(range(NUM_BLOCKS))
        m.generation = max(m.high_water, 0)
        prefix = self.alloc.reserve(self.prefix_request)
        m.generation += 1
        assert prefix is not None and prefix.allocation_generation == m.generation
        assert list(prefix.sequences[0].block_ids[0]) == best_fit(m.free, PREFIX_POOL) == self.prefix_blocks
        m.free -= set(self.prefix_blocks)
        m.reserved["prefix-cache"] = (self.prefix_request, self.prefix_blocks)
        self.note("restart")

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
        worker = RunnerBackend(
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

    def op_free(self) -> None:
        m = self.model
        roll = self.rng.random()
        before = self.state()
        if roll < 0.2:  # double frees and duplicates straight into the pool
            used = [b for _, blocks in m.reserved.values() for b in blocks]
            choices = [[b] for b in sorted(m.free)[:3]] + ([[used[0], used[0]]] if used else [])
            if not choices:
                return
            with pytest.raises(ValidationError):
                self.pool.free(self.rng.choice(choices))
            self.rejected(before, "pool double free")
            return
        live = [r for r in m.reserved if r != "prefix-cache"]
        if not live:
            return
        rid = self.rng.choice(live)
        # the scheduler should release after the worker removed the rows; sometimes it does not
        if rid in m.installed and self.rng.random() < 0.7:
            return
        _, blocks = m.reserved.pop(rid)
        assert self.alloc.free(rid) == len(blocks)
        assert self.alloc.free(rid) == 0
        m.free |= set(blocks)
        self.note("free" + (" (worker still holds)" if rid in m.installed else ""))

    def op_step(self) -> None:
        m = self.model
        if not m.installed:
            return
        rids = self.rng.sample(sorted(m.installed), self.rng.randint(1, len(m.installed)))
        step = self.rng.choice((0, 0, 1, 2, 5))
        into_cached = self.rng.random() < 0.1
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
        builder_fault = self.rng.random() < 0.04
        write_fault = self.rng.random() < 0.04
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

    # -- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        m = self.model
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
        reserved = [b for _, blocks in m.reserved.values() for b in blocks]
        assert len(reserved) == len(set(reserved)) and set(reserved).isdisjoint(m.free)
        assert len(reserved) + self.pool.num_free == NUM_BLOCKS, "a block leaked"
        assert sorted(self.pool._free) == sorted(m.free)
        assert {k: v for k, v in self.registry.rows.items()} == {
            (r, s, None): i for (r, s), i in m.row_index.items()
        }
        assert {r: self.registry.generation_of(r) for r in self.registry.installed_requests()} == {
            r: g for r, (_, g) in m.installed.items()
        }
        for (rid, sid), row in m.rows.items():
            spans = self.registry.written_spans((rid, sid, None))
            assert {t for a, b in spans for t in range(a, b)} == row.written
        refs = {b: len(self.registry.holders_of(0, b)) for b in range(NUM_BLOCKS)}
        assert {b: n for b, n in refs.items() if n} == m.refs, "a block's holders differ from its refcount"
        assert sum(m.refs.values()) == sum(len(r.blocks) for r in m.rows.values())
        assert self.registry.generation_high_water == m.high_water
        assert {r: self.registry.removed_generation(r) for r in m.removed} == m.removed
        assert set(self.registry.installed_requests()) - set(self.alloc.reserved()) == m.zombies()

    # -- the end ---------------------------------------------------------------------------------

    def drain(self) -> None:
        """Retire and free every reservation (the scheduler's terminal path), replay every
        snapshot ever issued, reap what no reservation owns: zero rows, zero blocks held."""
        m = self.model
        for rid in sorted(set(m.reserved) - {"prefix-cache"}):
            assert self.runner.retire(rid, m.generation) == len(
                m.installed[rid][0].sequences if rid in m.installed else ()
            )
            m.retire(rid, m.generation)
            _, blocks = m.reserved.pop(rid)
            assert self.alloc.free(rid) == len(blocks)
            m.free |= set(blocks)
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
        assert self.pool.num_free == NUM_BLOCKS - PREFIX_POOL and self.alloc.reserved() == ("prefix-cache",)


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


OPS = ("reserve", "install", "install", "step", "step", "step", "remove", "free", "reap")
RARE = (("restart", 0.006), ("bind", 0.01))  # per operation, instead of one of OPS


@pytest.mark.parametrize("seed", SEEDS)
def test_worker_holds_its_guarantees_under_random_operations(seed: int) -> None:
    fuzz = Fuzz(seed)
    ops = TOTAL_OPS // len(SEEDS)
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
    ):
        assert kind in seen, f"seed {seed}: no '{kind}' outcome in {ops} operations: {seen}"

"""Scheduler-side allocator: admission, back-pressure, all-or-nothing, accounting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusion_kv.core.allocator import (
    AdmissionError,
    ContextRequest,
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    SequenceRequest,
)
from diffusion_kv.core.errors import ValidationError

from .registry_helpers import make_registry


def alloc(num_blocks: int = 16, worker_rows: int = 6, rows_per_request: int = 3) -> DiffusionKVAllocator:
    return DiffusionKVAllocator(
        block_size=4,
        max_model_len=32,
        max_rows_per_request=rows_per_request,
        worker_rows=worker_rows,
        pool=FreeListPool(num_blocks),
    )


def req(rid: str, *lens: int, ctx: int = 0) -> KVRequest:
    contexts = (ContextRequest("ref", "image", ctx),) if ctx else ()
    refs = ("ref",) if ctx else ()
    return KVRequest(rid, tuple(SequenceRequest(i, 0, n, refs) for i, n in enumerate(lens)), contexts)


def test_reserve_all_rows_and_shared_context_once() -> None:
    a = alloc()
    snap = a.reserve(req("r", 5, 5, ctx=6))
    assert snap is not None and snap.allocation_generation == 1
    assert [s.block_ids for s in snap.sequences] == [((0, 1),), ((2, 3),)]
    assert snap.contexts[0].block_ids == ((4, 5),)
    assert a.pool.num_free == 10 and a.free_rows == 3
    reg, _ = make_registry()
    assert reg.install(snap) is True  # the worker accepts what the allocator produces


def test_rereserve_bumps_generation_keeps_blocks() -> None:
    a = alloc()
    first = a.reserve(req("r", 5))
    second = a.reserve(req("r", 5))
    assert first is not None and second is not None
    assert second.allocation_generation == 2 and second.content_key() == first.content_key()
    assert a.pool.num_free == 14


def test_wait_versus_permanent_admission_errors() -> None:
    a = alloc(num_blocks=8)
    assert a.reserve(req("a", 20)) is not None  # 5 blocks
    before = a.pool.num_free
    assert a.reserve(req("b", 16)) is None  # fits an empty pool, not now: wait
    assert a.pool.num_free == before
    with pytest.raises(AdmissionError, match="needs 9 blocks; the pool has 8 in total"):
        a.reserve(req("c", 20, 16))
    with pytest.raises(AdmissionError, match="max_model_len is 32"):
        a.reserve(req("d", 33))
    with pytest.raises(AdmissionError, match="needs 4 rows; the per-request limit is 3"):
        a.reserve(req("e", 1, 1, 1, ctx=1))


def test_worker_row_back_pressure_before_blocks() -> None:
    a = alloc(num_blocks=64, worker_rows=3)
    assert a.reserve(req("a", 4, 4)) is not None
    free = a.pool.num_free
    assert a.reserve(req("b", 4, 4)) is None
    assert a.pool.num_free == free  # nothing taken
    a.free("a")
    assert a.reserve(req("b", 4, 4)) is not None


def test_free_is_idempotent() -> None:
    a = alloc()
    a.reserve(req("r", 9))
    assert a.free("r") == 3 and a.free("r") == 0 and a.pool.num_free == 16


def test_invalid_requests() -> None:
    a = alloc()
    with pytest.raises(AdmissionError, match="no sequences"):
        a.reserve(KVRequest("r", ()))
    with pytest.raises(AdmissionError, match="unknown contexts"):
        a.reserve(KVRequest("r", (SequenceRequest(0, 0, 4, ("ghost",)),)))
    with pytest.raises(AdmissionError, match="more than once"):
        a.reserve(KVRequest("r", (SequenceRequest(0, 0, 4), SequenceRequest(0, 0, 4))))
    with pytest.raises(ValidationError, match="double free"):
        a.pool.free([3])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("reserve"),
                st.sampled_from("abcde"),
                st.lists(st.integers(1, 32), min_size=1, max_size=3),
            ),
            st.tuples(st.just("free"), st.sampled_from("abcde"), st.just([])),
        ),
        max_size=30,
    )
)
def test_accounting_under_random_reserve_free(ops: list) -> None:
    a = alloc(num_blocks=20, worker_rows=5)
    held: dict[str, list[int]] = {}
    rows: dict[str, int] = {}
    for kind, rid, lens in ops:
        if kind == "reserve":
            try:
                snap = a.reserve(req(rid, *lens))
            except AdmissionError as exc:
                # never admissible, or the id is reserved with another shape
                assert rid not in held or "already reserved with a different shape" in str(exc)
                continue
            if snap is not None and rid not in held:
                held[rid] = [b for s in snap.sequences for b in s.block_ids[0]]
                rows[rid] = snap.num_rows
        else:
            assert a.free(rid) == len(held.pop(rid, []))
            rows.pop(rid, None)
        used = [b for blocks in held.values() for b in blocks]
        assert len(used) == len(set(used)), "a block is reserved twice"
        assert a.pool.num_free + len(used) == 20
        assert a.rows_in_use == sum(rows.values()) <= 5
        assert set(a.reserved()) == set(held)
        for r, blocks in held.items():
            assert a.blocks_of(r) == blocks


def test_best_fit_keeps_requests_contiguous_and_reports_fragmentation() -> None:
    pool = FreeListPool(16)
    assert pool.fragmentation() == {
        "free_blocks": 16,
        "free_runs": 1,
        "longest_free_run": 16,
        "fragmentation": 0.0,
    }
    a, b, c = pool.allocate(4), pool.allocate(3), pool.allocate(5)
    assert (a, b, c) == ([0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11])
    assert a is not None and b is not None
    pool.free(b)  # free runs: 4..6 (3 blocks) and 12..15 (4 blocks)
    assert pool.allocate(3) == [4, 5, 6]  # the run that fits best, not the first free ids
    pool.free([4, 5, 6])
    pool.free(a)  # runs: 0..6 (7), 12..15 (4)
    assert pool.allocate(4) == [12, 13, 14, 15]  # best fit leaves the larger run whole
    frag = pool.fragmentation()
    assert (frag["free_blocks"], frag["free_runs"], frag["longest_free_run"]) == (7, 1, 7)
    pool.free([13])  # runs: 0..6 (7), 13 (1)
    assert pool.fragmentation()["fragmentation"] == 1 - 7 / 8
    assert pool.allocate(8) == [0, 1, 2, 3, 4, 5, 6, 13]  # fragmented: longest runs first
    assert pool.allocate(1) is None and pool.num_free == 0


def test_every_kv_cache_group_gets_the_rows_blocks() -> None:
    a = DiffusionKVAllocator(
        block_size=4,
        max_model_len=32,
        max_rows_per_request=3,
        worker_rows=6,
        pool=FreeListPool(16),
        num_groups=2,
    )
    snap = a.reserve(req("r", 5, 3, ctx=6))
    assert snap is not None
    assert [s.block_ids for s in snap.sequences] == [((0, 1), (0, 1)), ((2,), (2,))]
    assert [c.block_ids for c in snap.contexts] == [((3, 4), (3, 4))]
    assert a.free("r") == 5 and a.pool.num_free == 16


def test_generations_continue_above_what_a_worker_has_seen() -> None:
    a = alloc()
    assert a.generation == 0
    a.advance_generation(41)
    snap = a.reserve(req("r", 4))
    assert snap is not None and snap.allocation_generation == 42 and a.generation == 42
    a.advance_generation(7)  # never lowers them
    assert a.generation == 42
    for bad in (-2, 1.5, None, True):
        with pytest.raises(ValidationError, match="advance_generation takes an int >= -1"):
            a.advance_generation(bad)  # type: ignore[arg-type]
    assert a.generation == 42


@pytest.mark.parametrize(
    ("call", "fact"),
    [
        (lambda: FreeListPool(4).allocate(-1), "allocate takes a block count, an int >= 0; got -1"),
        (lambda: FreeListPool(4).allocate(1.5), "allocate takes a block count, an int >= 0; got 1.5"),  # type: ignore[arg-type]
        (lambda: FreeListPool(4).allocate("2"), "allocate takes a block count, an int >= 0; got '2'"),  # type: ignore[arg-type]
        (lambda: alloc().blocks_of(["r"]), r"blocks_of takes a non-empty request id string; got \['r'\]"),  # type: ignore[arg-type]
        (
            lambda: alloc().reserve(KVRequest(["r"], ())),  # type: ignore[arg-type]
            r"request_id must be a non-empty string; got \['r'\]",
        ),
        (
            lambda: DiffusionKVAllocator(
                block_size=4,
                max_model_len=32,
                max_rows_per_request=1,
                worker_rows=1,
                pool=None,  # type: ignore[arg-type]
            ),
            r"pool must be a BlockPool \(num_total, num_free, allocate, free\); NoneType lacks",
        ),
        (
            lambda: DiffusionKVAllocator(
                block_size=4,
                max_model_len=32,
                max_rows_per_request=1,
                worker_rows=1,
                pool=FreeListPool(4),
                num_groups=0,
            ),
            "num_groups must be a positive integer; got 0",
        ),
    ],
)
def test_bad_allocator_input_is_a_validation_error(call: object, fact: str) -> None:
    with pytest.raises(ValidationError, match=fact):
        call()  # type: ignore[operator]


def test_a_refused_allocate_takes_nothing() -> None:
    pool = FreeListPool(4)
    for bad in (-1, 1.5):
        with pytest.raises(ValidationError):
            pool.allocate(bad)  # type: ignore[arg-type]
    assert pool.num_free == 4 and pool.allocate(4) == [0, 1, 2, 3]

"""The continuous-batching scheduler: admission with back-pressure, one mixed batch per step,
retirement on every terminal path, and per-row agreement with an independent dense oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.allocator import (
    AdmissionError,
    DiffusionKVAllocator,
    FreeListPool,
    KVRequest,
    SequenceRequest,
)
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import GenerationError, StateError, ValidationError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.core.scheduler import (
    DiffusionRequest,
    DiffusionScheduler,
    Phase,
    RequestStatus,
    StepBatch,
)
from diffusion_kv.platforms.cpu import CpuPlatform

H, HKV, D, BS = 4, 2, 16, 8
LAYERS = ("l0", "l1")


def make_runner(
    pool_blocks: int = 64,
    max_seqs: int = 4,
    max_tokens: int = 512,
    modes: dict[str, AttentionMode] | None = None,
) -> PagedWorker:
    runner = PagedWorker(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=128,
            max_rows_per_request=2,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
        ),
    )
    modes = modes or dict.fromkeys(LAYERS, AttentionMode.CAUSAL)
    runner.register_kv_cache_layers(
        {n: PagedLayerSpec(H, HKV, D, torch.float64, mode=m) for n, m in modes.items()}
    )
    runner.initialize_kv_cache(num_blocks=pool_blocks, block_size=BS)
    return runner


def make_allocator(runner: PagedWorker, **kw: object) -> DiffusionKVAllocator:
    assert runner.layout is not None
    args: dict[str, object] = dict(
        block_size=BS,
        max_model_len=128,
        max_rows_per_request=2,
        worker_rows=runner.layout.max_num_reqs,
        pool=FreeListPool(runner.layout.num_blocks),
        num_groups=len(runner.layout.groups),
    )
    args.update(kw)
    return DiffusionKVAllocator(**args)  # type: ignore[arg-type]


def make(pool_blocks: int = 64, max_seqs: int = 4, max_tokens: int = 512, **kw: object) -> DiffusionScheduler:
    runner = make_runner(pool_blocks, max_seqs, max_tokens)
    return DiffusionScheduler(runner, make_allocator(runner), **kw)  # type: ignore[arg-type]


class Oracle:
    """Runs every layer on each step batch with fresh random Q/K/V for the rows' query tokens,
    keeps each row's logical K/V, and checks every row's output against dense attention over
    that row alone (causal, with the row's spans bidirectional)."""

    def __init__(self, sched: DiffusionScheduler, seed: int = 0, full: tuple[str, ...] = ()) -> None:
        self.sched = sched
        self.full = full  # layers registered non-causal: they attend over every key
        self.gen = torch.Generator().manual_seed(seed)
        self.kv: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.batches: list[StepBatch] = []

    def __call__(self, batch: StepBatch) -> None:
        self.batches.append(batch)
        n = batch.num_tokens
        meta = AttentionMetadata(full_attn_spans=batch.full_attn_spans)
        for layer in self.sched.runner.layers:
            q = torch.randn(n, H, D, generator=self.gen, dtype=torch.float64)
            k = torch.randn(n, HKV, D, generator=self.gen, dtype=torch.float64)
            v = torch.randn(n, HKV, D, generator=self.gen, dtype=torch.float64)
            # spans refine every layer they are passed to (vLLM-Omni's rule): a layer registered
            # non-causal that must see every key is called without them
            out = self.sched.runner.forward(layer, q, k, v, None if layer in self.full else meta)
            offset = 0
            for row, spans in zip(batch.rows, batch.full_attn_spans, strict=True):
                key = (row.request_id, int(row.sequence_id or 0), layer)
                if key not in self.kv or row.kv_start_pos == 0:
                    self.kv[key] = (torch.full((row.seq_len, HKV, D), float("nan"), dtype=torch.float64),) * 2
                    self.kv[key] = (self.kv[key][0].clone(), self.kv[key][1].clone())
                rk, rv = self.kv[key]
                span = slice(row.kv_start_pos, row.seq_len)
                rk[span], rv[span] = k[offset : offset + row.query_len], v[offset : offset + row.query_len]
                mode = AttentionMode.FULL if layer in self.full else AttentionMode.PIECEWISE
                mask = row_mask(mode, row.kv_start_pos, row.query_len, row.seq_len, spans)
                ref = dense_attention(q[offset : offset + row.query_len], rk, rv, mask, D**-0.5)
                torch.testing.assert_close(out[offset : offset + row.query_len], ref, atol=1e-10, rtol=1e-10)
                offset += row.query_len


def test_mixed_phases_share_one_batch_and_agree_with_dense() -> None:
    sched = make()
    oracle = Oracle(sched)
    sched.submit(DiffusionRequest("a", 20, 9, steps=3, cfg_rows=2))
    first = sched.step(oracle)
    assert first is not None and first.admitted == ("a",) and first.prepared
    sched.submit(DiffusionRequest("b", 0, 11, steps=2))  # no prefix: prefill phase at every step
    sched.submit(DiffusionRequest("c", 13, 5, steps=2, full_attn_spans=((2, 6), (13, 18))))
    second = sched.step(oracle)
    assert second is not None and second.admitted == ("b", "c")
    batch = oracle.batches[-1]
    # denoise rows (short) first, then the prefill rows, in admission order
    assert [(e.request.request_id, e.phase, e.query_len) for e in batch.entries] == [
        ("a", Phase.DENOISE, 9),
        ("b", Phase.PREFILL, 11),
        ("c", Phase.PREFILL, 18),
    ]
    assert [(r.request_id, r.kv_start_pos, r.query_len) for r in batch.rows] == [
        ("a", 20, 9),
        ("a", 20, 9),
        ("b", 0, 11),
        ("c", 0, 18),
    ]
    assert batch.full_attn_spans == (((20, 29),), ((20, 29),), ((0, 11),), ((2, 6), (13, 18)))
    assert [e.token_offset for e in batch.entries] == [0, 18, 29]
    records = sched.run(oracle)
    assert {rid: r.status for rid, r in records.items()} == dict.fromkeys("abc", RequestStatus.FINISHED)
    assert {rid: r.steps_done for rid, r in records.items()} == {"a": 3, "b": 2, "c": 2}
    assert sched.blocks_in_use == 0 and sched.runner.registry is not None
    assert sched.runner.registry.installed_requests() == ()
    sched.close()


def test_composition_is_prepared_once_while_it_lasts() -> None:
    sched = make()
    oracle = Oracle(sched)
    sched.submit(DiffusionRequest("a", 16, 8, steps=5))
    reports = []
    while not sched.idle:
        r = sched.step(oracle)
        assert r is not None
        reports.append(r)
    assert [r.prepared for r in reports] == [True, True, False, False, False]  # prefill, then denoise
    assert [b.composition_steps for b in oracle.batches] == [1, 1, 2, 3, 4]
    assert [b.stable_for for b in oracle.batches] == [1, 4, 3, 2, 1]
    assert oracle.batches[2].prepared is oracle.batches[1].prepared
    assert sched.preparations == 2


def test_back_pressure_waits_for_blocks_and_never_over_commits() -> None:
    # each request needs 2 rows x 4 blocks; the pool holds 12 blocks: one request at a time
    sched = make(pool_blocks=12)
    oracle = Oracle(sched)
    for rid in "abc":
        sched.submit(DiffusionRequest(rid, 24, 8, steps=2, cfg_rows=2))
    seen = []
    while not sched.idle:
        r = sched.step(oracle)
        assert r is not None
        assert sched.peak_blocks_in_use <= 12
        seen.append((r.tick, r.admitted, r.finished, len(sched.waiting)))
    assert seen == [
        (0, ("a",), (), 2),
        (1, (), ("a",), 2),
        (2, ("b",), (), 1),
        (3, (), ("b",), 1),
        (4, ("c",), (), 0),
        (5, (), ("c",), 0),
    ]
    assert sched.peak_blocks_in_use == 8 and sched.allocator.pool.num_free == 12


def test_token_budget_and_max_running_hold_requests_back() -> None:
    sched = make(max_batch_tokens=40, max_running=2)
    oracle = Oracle(sched)
    for rid in "abc":
        sched.submit(DiffusionRequest(rid, 12, 4, steps=3))
    r0 = sched.step(oracle)
    assert r0 is not None and r0.admitted == ("a", "b") and r0.tokens == 32  # c: 32 + 16 > 40
    r1 = sched.step(oracle)
    assert r1 is not None and r1.admitted == () and sched.waiting == ("c",)  # max_running 2
    sched.run(oracle)
    assert all(r.status is RequestStatus.FINISHED for r in sched.records.values())


def test_a_failing_step_fails_its_requests_and_frees_their_blocks() -> None:
    sched = make(pool_blocks=12)
    oracle = Oracle(sched)
    sched.submit(DiffusionRequest("a", 24, 8, steps=3, cfg_rows=2))
    sched.submit(DiffusionRequest("b", 24, 8, steps=2, cfg_rows=2))  # waits for a's blocks
    assert sched.step(oracle) is not None

    def broken(batch: StepBatch) -> None:
        raise RuntimeError("model exploded")

    r = sched.step(broken)
    assert r is not None and r.failed == ("a",)
    rec = sched.records["a"]
    assert rec.status is RequestStatus.FAILED and rec.error == "RuntimeError: model exploded"
    assert sched.allocator.pool.num_free == 12 and sched.runner.registry is not None
    assert sched.runner.registry.installed_requests() == ()
    sched.run(oracle)  # b still runs
    assert sched.records["b"].status is RequestStatus.FINISHED


def test_a_step_that_skips_layers_cannot_read_unwritten_pages() -> None:
    sched = make()
    sched.submit(DiffusionRequest("a", 16, 8, steps=3))
    assert sched.step(lambda batch: None) is not None  # no layer ran: nothing was written
    r = sched.step(Oracle(sched))
    assert r is not None and r.failed == ("a",)
    assert "never written" in str(sched.records["a"].error)
    assert sched.blocks_in_use == 0


def test_cancellation_frees_blocks_on_every_path() -> None:
    sched = make()
    oracle = Oracle(sched)
    for rid in "abcd":
        sched.submit(DiffusionRequest(rid, 16, 8, steps=4))
    assert sched.cancel("d")  # waiting
    assert sched.step(oracle) is not None
    assert sched.cancel("a")  # running, between steps: retired now
    assert sched.records["a"].status is RequestStatus.CANCELLED and "a" not in sched.running

    def cancel_b_inside(batch: StepBatch) -> None:
        assert sched.cancel("b")
        assert "b" in sched.running  # the batch is still running
        oracle(batch)

    r = sched.step(cancel_b_inside)
    assert r is not None and r.cancelled == ("b",)
    assert not sched.cancel("b") and not sched.cancel("unknown")
    assert sched.running == ("c",)
    sched.run(oracle)
    statuses = {rid: rec.status.value for rid, rec in sched.records.items()}
    assert statuses == {"a": "cancelled", "b": "cancelled", "c": "finished", "d": "cancelled"}
    assert sched.blocks_in_use == 0


def test_interrupt_cancels_everything_and_propagates() -> None:
    sched = make()
    sched.submit(DiffusionRequest("a", 16, 8, steps=4))
    sched.submit(DiffusionRequest("b", 16, 8, steps=4))

    def interrupted(batch: StepBatch) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sched.step(interrupted)
    assert {r.status for r in sched.records.values()} == {RequestStatus.CANCELLED}
    assert sched.blocks_in_use == 0
    with pytest.raises(StateError, match="closed"):
        sched.step(Oracle(sched))


def test_failed_removal_quarantines_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = make()
    sched.submit(DiffusionRequest("a", 16, 8, steps=1))

    def fail(request_id: object, through_generation: object) -> int:
        raise RuntimeError("worker lost")

    monkeypatch.setattr(sched.runner, "retire", fail)
    r = sched.step(Oracle(sched))
    assert r is not None and r.finished == () and r.failed == ("a",)
    assert sched.records["a"].status is RequestStatus.FAILED
    assert "worker lost" in str(sched.records["a"].error)
    assert sched.quarantined == {"a": "RuntimeError: worker lost"}
    assert sched.blocks_in_use == 3  # never handed to another request
    with pytest.raises(ValidationError, match="quarantined"):
        sched.submit(DiffusionRequest("a", 16, 8, steps=1))


BadSubmit = Callable[[DiffusionScheduler], object]


@pytest.mark.parametrize(
    ("action", "error", "message"),
    [
        (lambda s: s.submit("a"), ValidationError, "takes a DiffusionRequest"),
        (lambda s: s.submit(DiffusionRequest("x", 200, 8, steps=1)), AdmissionError, "max_model_len"),
        (lambda s: s.submit(DiffusionRequest("x", 100, 28, steps=1, cfg_rows=2)), AdmissionError, "tokens"),
        (lambda s: DiffusionRequest("x", 4, 0, steps=1), ValidationError, "target_len"),
        (lambda s: DiffusionRequest("x", 4, 4, steps=0), ValidationError, "steps"),
        (lambda s: DiffusionRequest("", 4, 4, steps=1), ValidationError, "request_id"),
        (lambda s: DiffusionRequest("x", 4, 4, 1, full_attn_spans=((3, 9),)), ValidationError, "inside"),
        (
            lambda s: DiffusionRequest("x", 4, 4, 1, full_attn_spans=((4, 6), (2, 3))),
            ValidationError,
            "sorted",
        ),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(action: BadSubmit, error: type, message: str) -> None:
    sched = make(max_tokens=200)
    with pytest.raises(error, match=message):
        action(sched)
    assert sched.idle and sched.records == {} and sched.blocks_in_use == 0


def test_duplicate_ids_are_refused_until_the_first_is_over() -> None:
    sched = make()
    sched.submit(DiffusionRequest("a", 8, 8, steps=1))
    with pytest.raises(ValidationError, match="already waiting"):
        sched.submit(DiffusionRequest("a", 8, 8, steps=1))
    sched.run(Oracle(sched))
    sched.submit(DiffusionRequest("a", 8, 8, steps=1))  # over: the id may be used again
    sched.run(Oracle(sched))
    assert sched.records["a"].status is RequestStatus.FINISHED


def test_step_inside_a_step_is_refused() -> None:
    sched = make()
    sched.submit(DiffusionRequest("a", 8, 8, steps=2))
    errors: list[Exception] = []

    def nested(batch: StepBatch) -> None:
        try:
            sched.step(lambda b: None)
        except StateError as exc:
            errors.append(exc)
        Oracle(sched)(batch)

    assert sched.step(nested) is not None
    assert len(errors) == 1 and "inside a step" in str(errors[0])


# --- the scheduler and the allocator it shares -----------------------------------------------------


def scheduler_state(sched: DiffusionScheduler) -> tuple[object, ...]:
    assert sched.runner.registry is not None
    return (
        {rid: (r.status, r.steps_done, r.error) for rid, r in sched.records.items()},
        sched.waiting,
        sched.running,
        sched.allocator.reserved(),
        {rid: sched.allocator.blocks_of(rid) for rid in sched.allocator.reserved()},
        sched.allocator.pool.num_free,
        sched.allocator.generation,
        sched.runner.registry.installed_requests(),
        sched.tick,
    )


def test_an_id_another_owner_reserves_is_refused_at_submit() -> None:
    sched = make()
    other = sched.allocator.reserve(KVRequest("x", (SequenceRequest(0, 8, 8),)))
    assert other is not None
    before = scheduler_state(sched)
    for shape in ((8, 8), (4, 8)):  # the other owner's shape, or another one: neither is ours
        with pytest.raises(
            ValidationError,
            match=r"request id 'x' is already reserved in the allocator by another owner \(blocks \[0, 1\]\)",
        ):
            sched.submit(DiffusionRequest("x", *shape, steps=1))
        assert scheduler_state(sched) == before
    sched.submit(DiffusionRequest("y", 8, 8, steps=2))
    records = sched.run(Oracle(sched))  # the scheduler goes on with everything else
    assert records["y"].status is RequestStatus.FINISHED and "x" not in records
    assert sched.allocator.blocks_of("x") == [0, 1]  # the other owner's blocks, untouched


@pytest.mark.parametrize("same_shape", [True, False])
def test_an_id_taken_after_submission_fails_alone(same_shape: bool) -> None:
    sched = make()
    sched.submit(DiffusionRequest("x", 8, 8, steps=1))
    sched.submit(DiffusionRequest("y", 8, 8, steps=1))
    shape = (8, 8) if same_shape else (4, 4)
    assert sched.allocator.reserve(KVRequest("x", (SequenceRequest(0, *shape),))) is not None
    theirs = sched.allocator.blocks_of("x")
    report = sched.step(Oracle(sched))
    assert report is not None and report.admitted == ("y",) and report.failed == ("x",)
    assert report.finished == ("y",)
    assert sched.records["x"].status is RequestStatus.FAILED
    assert "reserved in the allocator by another owner before admission" in str(sched.records["x"].error)
    assert sched.allocator.blocks_of("x") == theirs  # never adopted, never freed by the scheduler
    assert sched.step(Oracle(sched)) is None  # not wedged: nothing left to do


def test_causal_and_full_layers_two_kv_cache_groups() -> None:
    modes = {"causal": AttentionMode.CAUSAL, "full": AttentionMode.FULL}
    runner = make_runner(modes=modes)
    assert runner.layout is not None and len(runner.layout.groups) == 2
    with pytest.raises(
        ValidationError,
        match=r"the worker has 2 KV-cache group\(s\) \(causal layers, block size 8; full layers, block size 8\) "
        r"but the allocator reserves blocks for 1: build it with num_groups=2",
    ):
        DiffusionScheduler(runner, make_allocator(runner, num_groups=1))
    sched = DiffusionScheduler(runner, make_allocator(runner))
    sched.submit(DiffusionRequest("a", 16, 8, steps=3, cfg_rows=2))
    sched.submit(DiffusionRequest("b", 0, 12, steps=2))
    records = sched.run(Oracle(sched, full=("full",)))
    assert {rid: r.status for rid, r in records.items()} == dict.fromkeys("ab", RequestStatus.FINISHED)
    assert (
        sched.blocks_in_use == 0
        and runner.registry is not None
        and runner.registry.installed_requests() == ()
    )


@pytest.mark.parametrize(
    ("kw", "fact"),
    [
        (dict(pool=FreeListPool(65)), "allocator pool blocks 65 exceeds the worker's 64"),
        (dict(max_model_len=129), "allocator max_model_len 129 exceeds the worker's 128"),
        (dict(max_rows_per_request=3), "allocator max_rows_per_request 3 exceeds the worker's 2"),
        (dict(worker_rows=9), "allocator worker_rows 9 exceeds the worker's 8"),
        (dict(block_size=16), r"allocator block size 16 does not match the worker's \[8\]"),
    ],
)
def test_an_allocator_that_does_not_describe_the_worker_is_refused(kw: dict[str, object], fact: str) -> None:
    runner = make_runner()
    allocator = make_allocator(runner, **kw)
    assert runner.translator is not None
    with pytest.raises(ValidationError, match=r"^the allocator does not describe this worker: " + fact):
        DiffusionScheduler(runner, allocator)
    assert allocator.generation == 0 and runner.translator.active_batch is None
    DiffusionScheduler(runner, make_allocator(runner)).close()  # the runner is still free to use


def test_a_request_the_worker_refuses_fails_instead_of_wedging_run(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = make()

    def refuse(snapshot: object) -> bool:
        raise ValidationError("row ('a', 0, None) has 1 block groups; expected 2")

    monkeypatch.setattr(sched.runner, "install", refuse)
    sched.submit(DiffusionRequest("a", 8, 8, steps=1))
    records = sched.run(Oracle(sched))  # no "requests [] wait" StateError
    assert records["a"].status is RequestStatus.FAILED
    assert (
        records["a"].error
        == "install failed: ValidationError: row ('a', 0, None) has 1 block groups; expected 2"
    )
    assert sched.blocks_in_use == 0 and sched.idle


def test_a_scheduler_started_again_on_a_live_worker_reuses_ids() -> None:
    runner = make_runner()
    first = DiffusionScheduler(runner, make_allocator(runner))
    first.submit(DiffusionRequest("z", 8, 8, steps=2))
    first.run(Oracle(first))
    first.close()
    assert runner.generation_high_water == 1
    again = DiffusionScheduler(runner, make_allocator(runner))  # a new allocator starts at 0...
    assert again.allocator.generation == 1  # ...and continues above the worker's high-water mark
    again.submit(DiffusionRequest("z", 8, 8, steps=2))
    records = again.run(Oracle(again))
    assert records["z"].status is RequestStatus.FINISHED and records["z"].error is None


def test_close_inside_a_step_cancels_and_is_never_overwritten() -> None:
    sched = make()
    oracle = Oracle(sched)
    sched.submit(DiffusionRequest("ends", 8, 8, steps=1))
    sched.submit(DiffusionRequest("goes-on", 8, 8, steps=3))
    sched.submit(DiffusionRequest("waits", 8, 8, steps=1))
    sched.max_running = 2

    def closing(batch: StepBatch) -> None:
        oracle(batch)
        sched.close()
        with pytest.raises(StateError, match="closing at the end of this step"):
            sched.submit(DiffusionRequest("late", 8, 8, steps=1))

    report = sched.step(closing)
    assert report is not None and report.finished == ("ends",) and report.cancelled == ("goes-on",)
    statuses = {rid: (r.status, r.steps_done) for rid, r in sched.records.items()}
    assert statuses == {
        "ends": (RequestStatus.FINISHED, 1),  # its last step ran
        "goes-on": (RequestStatus.CANCELLED, 1),
        "waits": (RequestStatus.CANCELLED, 0),
    }
    assert sched.blocks_in_use == 0 and sched.runner.registry is not None
    assert sched.runner.registry.installed_requests() == ()
    with pytest.raises(StateError, match="the scheduler is closed"):
        sched.step(oracle)
    sched.close()  # idempotent
    assert {rid: (r.status, r.steps_done) for rid, r in sched.records.items()} == statuses


# --- late snapshots and what the worker holds without a reservation ---------------------------------


def test_a_late_snapshot_of_a_finished_request_is_refused() -> None:
    sched = make()
    oracle = Oracle(sched)
    late: list[RequestAllocation] = []

    def resend(batch: StepBatch) -> None:  # the scheduler re-sends the snapshot; it arrives late
        oracle(batch)
        if not late:
            again = sched.allocator.reserve(batch.entries[0].request.kv_request())
            assert again is not None
            late.append(again)

    sched.submit(DiffusionRequest("a", 8, 8, steps=2))
    sched.run(resend)
    assert sched.records["a"].status is RequestStatus.FINISHED
    assert sched.runner.registry is not None
    before = sched.runner.registry.installed_requests(), sched.blocks_in_use
    with pytest.raises(
        GenerationError,
        match=f"stale allocation generation {late[0].allocation_generation} for request 'a': the request was "
        f"removed at generation {sched.allocator.generation}",
    ):
        sched.runner.install(late[0])  # newer than the generation it ran at: still refused
    assert (sched.runner.registry.installed_requests(), sched.blocks_in_use) == before == ((), 0)
    sched.submit(DiffusionRequest("b", 8, 8, steps=1))  # the next owner of those blocks
    assert sched.run(Oracle(sched))["b"].status is RequestStatus.FINISHED


def test_rows_the_allocator_does_not_reserve_are_reaped() -> None:
    sched = make()
    registry = sched.runner.registry
    assert registry is not None
    # a snapshot installed behind the scheduler's back, on blocks the allocator has free
    sched.runner.install(RequestAllocation("zombie", 7, (SequenceAllocation(0, 8, 8, 16, ((0, 1),)),)))
    sched.submit(DiffusionRequest("a", 8, 8, steps=1))  # the allocator hands it blocks 0 and 1
    report = sched.step(Oracle(sched))
    assert report is not None and report.reaped == ("zombie",) and report.finished == ("a",)
    assert sched.records["a"].error is None and "zombie" not in sched.records
    assert registry.installed_requests() == () and registry.removed_generation("zombie") == 7
    with pytest.raises(GenerationError):  # reaped for good
        sched.runner.install(RequestAllocation("zombie", 7, (SequenceAllocation(0, 8, 8, 16, ((0, 1),)),)))
    sched.runner.install(RequestAllocation("zombie2", 9, (SequenceAllocation(0, 8, 8, 16, ((5, 6),)),)))
    report = sched.step(Oracle(sched))  # nothing to run: the reaping alone is reported
    assert report is not None and report.reaped == ("zombie2",) and report.rows == 0
    assert sched.step(Oracle(sched)) is None


@pytest.mark.parametrize(
    ("action", "fact"),
    [
        (lambda s: s.step(None), "step takes the model callback fn\\(batch\\); got NoneType None"),
        (lambda s: s.step(3), "step takes the model callback fn\\(batch\\); got int 3"),
        (lambda s: s.run(None), "run takes the model callback fn\\(batch\\); got NoneType"),
        (
            lambda s: s.run(lambda b: None, on_step=3),
            "on_step takes a callback on_step\\(report\\) or None; got int",
        ),
        (lambda s: s.cancel(["a"]), "cancel takes a non-empty request id string; got \\['a'\\]"),
        (lambda s: s.cancel(None), "cancel takes a non-empty request id string; got None"),
    ],
)
def test_bad_calls_are_refused_before_anything_runs(
    action: Callable[[DiffusionScheduler], object], fact: str
) -> None:
    sched = make()
    sched.submit(DiffusionRequest("a", 8, 8, steps=2))
    before = scheduler_state(sched)
    with pytest.raises(ValidationError, match=fact):
        action(sched)
    assert scheduler_state(sched) == before  # nothing admitted, nothing failed


@pytest.mark.parametrize(
    ("runner", "allocator", "error", "fact"),
    [
        (None, "ok", ValidationError, "the scheduler needs a PagedWorker; got NoneType"),
        ("ok", None, ValidationError, "the scheduler needs a DiffusionKVAllocator; got NoneType"),
        ("dense", "ok", ValidationError, "the scheduler needs a paged runner"),
    ],
)
def test_bad_scheduler_parts_are_refused(runner: object, allocator: object, error: type, fact: str) -> None:
    from diffusion_kv.core.registry import KVCacheMode

    real = make_runner()
    if runner == "dense":
        real = PagedWorker(CpuPlatform(), dataclasses.replace(real.config, mode=KVCacheMode.DENSE))
        real.register_kv_cache_layers({n: PagedLayerSpec(H, HKV, D, torch.float64) for n in LAYERS})
        real.initialize_kv_cache(num_blocks=64, block_size=BS)
    with pytest.raises(error, match=fact):
        DiffusionScheduler(
            real if runner in ("ok", "dense") else runner,  # type: ignore[arg-type]
            make_allocator(real) if allocator == "ok" else allocator,  # type: ignore[arg-type]
        )


# --- nothing grows with the work served ----------------------------------------------------------


class Payload:
    """A payload a weak reference can follow (the scheduler must drop it when the request ends)."""


def per_request_sizes(sched: DiffusionScheduler) -> dict[str, int]:
    registry = sched.runner.registry
    assert registry is not None
    cache = sched.allocator.prefix_cache
    return {
        "scheduler.live": len(sched._live),
        "scheduler.recent": len(sched._recent),
        "scheduler.pending": sched.pending_outcomes,
        "scheduler.cached": len(sched._cached),
        "scheduler.keys": len(sched._keys),
        "scheduler.quarantined": len(sched._quarantined),
        "allocator.reserved": len(sched.allocator._reserved),
        "prefix_cache.entries": len(cache) if cache is not None else 0,
        "registry.states": len(registry._states),
        "registry.rows": len(registry._rows),
        "registry.written": len(registry._written),
        "registry.bindings": len(registry._bindings),
        "registry.tombstones": len(registry._removed),
    }


@pytest.mark.parametrize("served", [20, 60])
def test_per_request_maps_are_bounded_by_their_windows_not_by_requests_served(served: int) -> None:
    import gc
    import weakref

    from diffusion_kv.core.prefix_cache import ContentSpan, PrefixCache

    runner = make_runner(pool_blocks=24)
    assert runner.registry is not None
    runner.registry.generation_memory = 32
    cache = PrefixCache(max_blocks=6)
    sched = DiffusionScheduler(
        runner, make_allocator(runner, prefix_cache=cache), model_id="m@1", max_running=3, outcome_memory=8
    )
    oracle = Oracle(sched)
    payloads = []
    handed_back: list[str] = []
    for i in range(served):
        payload = Payload()
        payloads.append(weakref.ref(payload))
        content = ((ContentSpan(0, 16, f"p{i % 3}"),),) if i % 2 else ()
        sched.submit(DiffusionRequest(f"r{i}", 16, 8, steps=2, payload=payload, prefix_content=content))
        del payload
        if i % 7 == 3:
            assert sched.cancel(f"r{i}")  # ends while waiting, between steps
        report = sched.step(oracle)
        assert report is not None
        handed_back.extend(r.request.request_id for r in report.outcomes)
    while not sched.idle:
        report = sched.step(oracle)
        assert report is not None
        handed_back.extend(r.request.request_id for r in report.outcomes)
    assert sorted(handed_back) == sorted(f"r{i}" for i in range(served))  # each outcome once
    assert sched.drain_outcomes() == () and sched.step(oracle) is None
    oracle.batches.clear()  # the test's own references to the step batches
    gc.collect()
    assert [ref() for ref in payloads] == [None] * served  # every payload released
    cached = len(cache)
    installed = served - len(range(3, served, 7))  # those cancelled while waiting never reached the worker
    assert per_request_sizes(sched) == {
        "scheduler.live": 0,
        "scheduler.recent": 8,  # outcome_memory
        "scheduler.pending": 0,
        "scheduler.cached": 0,
        "scheduler.keys": 0,
        "scheduler.quarantined": 0,
        "allocator.reserved": 0,
        "prefix_cache.entries": cached,
        "registry.states": 0,
        "registry.rows": 0,
        "registry.written": 0,
        "registry.bindings": 0,
        "registry.tombstones": min(32, installed),  # generation_memory
    }
    assert 0 < cached <= 6 and cache.num_idle == cached
    assert sched.blocks_in_use == cached  # the pool is back to its cached blocks
    assert list(sched.records) == handed_back[-8:]  # the most recent outcomes, in the order they ended
    assert all(rec.request.payload is None for rec in sched.records.values())


def test_outcomes_are_handed_back_once_in_step_reports_or_by_drain() -> None:
    sched = make(max_running=1)
    oracle = Oracle(sched)
    for rid in "abc":
        sched.submit(DiffusionRequest(rid, 8, 8, steps=2, payload=torch.zeros(4)))
    first = sched.step(oracle)
    assert first is not None and first.admitted == ("a",) and first.outcomes == ()
    assert sched.cancel("c") and sched.pending_outcomes == 1  # between steps: handed back next step
    second = sched.step(oracle)
    assert second is not None and second.finished == ("a",) and second.cancelled == ()
    assert [(r.request.request_id, r.status) for r in second.outcomes] == [
        ("c", RequestStatus.CANCELLED),
        ("a", RequestStatus.FINISHED),
    ]
    assert all(r.request.payload is None for r in second.outcomes)
    assert sched.pending_outcomes == 0 and sched.drain_outcomes() == ()
    assert sched.step(oracle) is not None  # b is admitted
    sched.close()  # b is cancelled outside any step: drain hands it back
    drained = sched.drain_outcomes()
    assert [(r.request.request_id, r.status, r.steps_done) for r in drained] == [
        ("b", RequestStatus.CANCELLED, 1)
    ]
    assert sched.drain_outcomes() == ()
    # the window still answers status queries for recent outcomes
    assert (sched.status("a"), sched.status("b"), sched.status("c")) == (
        RequestStatus.FINISHED,
        RequestStatus.CANCELLED,
        RequestStatus.CANCELLED,
    )
    assert sched.status("nobody") is None and sched.record("nobody") is None


def test_a_cancellation_on_an_idle_scheduler_is_reported_by_the_next_step() -> None:
    sched = make()
    sched.submit(DiffusionRequest("a", 8, 8, steps=1))
    assert sched.cancel("a")
    report = sched.step(Oracle(sched))  # nothing to run, but an outcome to hand back
    assert report is not None and report.rows == 0 and report.cancelled == ()
    assert [(r.request.request_id, r.status) for r in report.outcomes] == [("a", RequestStatus.CANCELLED)]
    assert sched.step(Oracle(sched)) is None


def test_the_records_view_copies_nothing_and_the_window_forgets_oldest_first() -> None:
    from diffusion_kv.core.scheduler import RecordsView

    sched = make(outcome_memory=2)
    assert sched.outcome_memory == 2
    for rid in "abc":
        sched.submit(DiffusionRequest(rid, 8, 8, steps=1))
    view = sched.records
    assert isinstance(view, RecordsView) and not isinstance(view, dict)
    assert len(view) == 3 and view["a"].status is RequestStatus.WAITING
    sched.run(Oracle(sched))
    assert len(view) == 2 and list(view) == ["b", "c"] and "a" not in view  # live: no copy was taken
    assert sched.record("a") is None and sched.status("c") is RequestStatus.FINISHED
    sched.submit(DiffusionRequest("b", 8, 8, steps=1))  # a resubmitted id supersedes its old outcome
    assert list(view) == ["b", "c"] and view["b"].status is RequestStatus.WAITING and len(view) == 2
    with pytest.raises(KeyError):
        view["a"]


def test_outcome_memory_zero_keeps_no_outcome_but_still_hands_each_back() -> None:
    sched = make(outcome_memory=0)
    sched.submit(DiffusionRequest("a", 8, 8, steps=1))
    records = sched.run(Oracle(sched))
    assert list(records) == ["a"] and records["a"].status is RequestStatus.FINISHED
    assert len(sched.records) == 0 and sched.status("a") is None


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_a_bad_outcome_memory_is_refused(value: object) -> None:
    runner = make_runner()
    allocator = make_allocator(runner)
    with pytest.raises(ValidationError, match=f"^outcome_memory must be an int >= 0; got {value!r}$"):
        DiffusionScheduler(runner, allocator, outcome_memory=value)  # type: ignore[arg-type]
    assert allocator.generation == 0
    DiffusionScheduler(runner, allocator).close()  # nothing was taken: the runner is still free

"""The continuous-batching scheduler: admission with back-pressure, one mixed batch per step,
retirement on every terminal path, and per-row agreement with an independent dense oracle."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.allocator import AdmissionError, DiffusionKVAllocator, FreeListPool
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.runner import PagedLayerSpec, RunnerBackend, RunnerConfig
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


def make(pool_blocks: int = 64, max_seqs: int = 4, max_tokens: int = 512, **kw: object) -> DiffusionScheduler:
    runner = RunnerBackend(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=128,
            max_rows_per_request=2,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
        ),
    )
    runner.register_kv_cache_layers({n: PagedLayerSpec(H, HKV, D, torch.float64) for n in LAYERS})
    runner.initialize_kv_cache(num_blocks=pool_blocks, block_size=BS)
    assert runner.layout is not None
    allocator = DiffusionKVAllocator(
        block_size=BS,
        max_model_len=128,
        max_rows_per_request=2,
        worker_rows=runner.layout.max_num_reqs,
        pool=FreeListPool(pool_blocks),
    )
    return DiffusionScheduler(runner, allocator, **kw)  # type: ignore[arg-type]


class Oracle:
    """Runs every layer on each step batch with fresh random Q/K/V for the rows' query tokens,
    keeps each row's logical K/V, and checks every row's output against dense attention over
    that row alone (causal, with the row's spans bidirectional)."""

    def __init__(self, sched: DiffusionScheduler, seed: int = 0) -> None:
        self.sched = sched
        self.gen = torch.Generator().manual_seed(seed)
        self.kv: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.batches: list[StepBatch] = []

    def __call__(self, batch: StepBatch) -> None:
        self.batches.append(batch)
        n = batch.num_tokens
        meta = AttentionMetadata(full_attn_spans=batch.full_attn_spans)
        for layer in LAYERS:
            q = torch.randn(n, H, D, generator=self.gen, dtype=torch.float64)
            k = torch.randn(n, HKV, D, generator=self.gen, dtype=torch.float64)
            v = torch.randn(n, HKV, D, generator=self.gen, dtype=torch.float64)
            out = self.sched.runner.forward(layer, q, k, v, meta)
            offset = 0
            for row, spans in zip(batch.rows, batch.full_attn_spans, strict=True):
                key = (row.request_id, int(row.sequence_id or 0), layer)
                if key not in self.kv or row.kv_start_pos == 0:
                    self.kv[key] = (torch.full((row.seq_len, HKV, D), float("nan"), dtype=torch.float64),) * 2
                    self.kv[key] = (self.kv[key][0].clone(), self.kv[key][1].clone())
                rk, rv = self.kv[key]
                span = slice(row.kv_start_pos, row.seq_len)
                rk[span], rv[span] = k[offset : offset + row.query_len], v[offset : offset + row.query_len]
                mask = row_mask("piecewise", row.kv_start_pos, row.query_len, row.seq_len, spans)
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

    def fail(requests: object) -> int:
        raise RuntimeError("worker lost")

    monkeypatch.setattr(sched.runner, "remove", fail)
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

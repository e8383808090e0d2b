"""The registry's cheap install path (plain snapshots, array ownership, whole-row table writes)
agrees with the checked path it stands in for: same rows, holders, tables and refusals."""

from __future__ import annotations

import pickle

import pytest

from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.core.registry import RowRegistry
from diffusion_kv.core.rows import Phase

from .registry_helpers import layout, make_registry, request, seq, state_of


def plain_registry(lay: CacheLayout | None = None) -> tuple[RowRegistry, TorchBlockTables]:
    """A registry over the core's own tables (the whole-row write path)."""
    lay = lay or layout()
    bt = TorchBlockTables(
        block_sizes=lay.block_sizes,
        max_num_reqs=lay.max_num_reqs,
        max_num_blocks_per_group=lay.max_blocks_per_row(),
        max_num_batched_tokens=lay.max_num_batched_tokens,
        device="cpu",
    )
    return RowRegistry(lay, bt), bt


def tables(bt: TorchBlockTables) -> tuple[list[list[int]], list[list[list[int]]]]:
    return bt.num_blocks.cpu.tolist(), [t.gpu.tolist() for t in bt.block_tables]


CFG = request("r", 0, seqs=(seq(0, 9, [5, 6, 7]), seq(1, 9, [8, 9, 10])))


def test_plain_path_builds_the_checked_rows() -> None:
    reg, _ = plain_registry()
    plain = reg._prepare_plain(CFG)
    assert plain is not None
    installs, listed = plain
    assert installs == reg._prepare_checked(CFG)
    assert listed == [[5, 6, 7, 8, 9, 10]]
    cached = request("c", 0, seqs=(seq(0, 12, [1, 2, 3], prefix_len=8, target_len=4, cached_prefix_len=8),))
    assert reg._prepare_plain(cached)[0] == reg._prepare_checked(cached)  # type: ignore[index]


@pytest.mark.parametrize(
    "snapshot",
    [
        request("r", 0, seqs=(seq(0, 9, [5, 6, 6]),)),  # a block twice in one row
        request("r", 0, seqs=(seq(0, 9, [5, 6, True]),)),  # bool is not a block id
        request("r", 0, seqs=(seq(0, 9, [5, 6, 64]),)),  # outside [0, 64)
        request("r", 0, seqs=(seq(0, 9, [5, 6]),)),  # too few blocks
        request("r", 0, seqs=(seq(0, 9, [5, -1, 7]),)),  # a released place (no window: refused)
    ],
)
def test_plain_path_declines_and_the_checked_path_names_the_offence(snapshot: RequestAllocation) -> None:
    reg, _ = plain_registry()
    assert reg._prepare_plain(snapshot) is None
    with pytest.raises(ValidationError) as checked:
        reg._prepare_checked(snapshot)
    before = state_of(reg)
    with pytest.raises(ValidationError) as installed:
        reg.install(snapshot)
    assert str(installed.value) == str(checked.value)
    assert state_of(reg) == before


def test_a_block_in_two_rows_of_one_request_is_refused_by_ownership() -> None:
    twice = request("r", 0, seqs=(seq(0, 9, [5, 6, 7]), seq(1, 9, [8, 9, 7])))
    for reg, _ in (plain_registry(), make_registry()):
        assert reg._prepare_plain(twice) is None  # listed twice in the request
        before = state_of(reg)
        with pytest.raises(ValidationError, match=r"row \('r', 1, None\) group 0: block 7 backs tokens"):
            reg.install(twice)
        assert state_of(reg) == before


def test_both_table_paths_leave_the_same_rows_holders_and_tables() -> None:
    fast, fast_bt = plain_registry()
    staged, staged_bt = make_registry()  # a TorchBlockTables subclass: append + apply
    other = request("o", 0, seqs=(seq(0, 8, [20, 21]),))
    for reg in (fast, staged):
        assert reg.install(CFG) and reg.install(other)
    assert tables(fast_bt) == tables(staged_bt)
    assert fast._holders == staged._holders
    assert fast.holders_of(0, 9) == {("r", 1, None): True}
    assert fast.holders_of(0, 11) == {} and fast.holders_of(0, 10_000) == {} and fast.holders_of(0, -1) == {}
    for reg in (fast, staged):
        assert reg.remove("r") == 2
    assert tables(fast_bt) == tables(staged_bt)
    assert fast._holders == staged._holders == [{20: {("o", 0, None): True}, 21: {("o", 0, None): True}}]
    assert fast.rows == staged.rows == {("o", 0, None): 2}


def test_a_written_block_of_a_live_row_is_refused_on_the_plain_path() -> None:
    reg, _ = plain_registry()
    reg.install(CFG)
    before = state_of(reg)
    with pytest.raises(
        ValidationError, match=r"block 6 backs tokens this row writes, but row \('r', 0, None\)"
    ):
        reg.install(request("b", 0, seqs=(seq(0, 4, [6]),)))
    assert state_of(reg) == before


def test_shared_prefix_blocks_keep_their_readers_in_order() -> None:
    reg, _ = plain_registry()
    reg.install(
        request("a", 0, seqs=(seq(0, 12, [1, 2, 3], prefix_len=8, target_len=4, cached_prefix_len=8),))
    )
    reg.install(
        request("b", 0, seqs=(seq(0, 12, [1, 2, 4], prefix_len=8, target_len=4, cached_prefix_len=8),))
    )
    assert reg.holders_of(0, 1) == {("a", 0, None): False, ("b", 0, None): False}
    assert list(reg.holders_of(0, 2)) == [("a", 0, None), ("b", 0, None)]
    assert reg.holders_of(0, 4) == {("b", 0, None): True}
    with pytest.raises(
        ValidationError, match=r"block 2 backs tokens this row writes, but row \('a', 0, None\)"
    ):
        reg.install(request("c", 0, seqs=(seq(0, 8, [2, 9]),)))
    reg.remove("a")
    assert reg.holders_of(0, 1) == {("b", 0, None): False} and reg.holders_of(0, 3) == {}


def test_write_rows_checks_every_row_first() -> None:
    _, bt = plain_registry()
    bt.write_rows([0], [((1, 2),)])
    before = tables(bt)
    with pytest.raises(ValidationError, match=r"row 9 is outside \[0, "):
        bt.write_rows([1, 9], [((3,),), ((4,),)])
    with pytest.raises(ValidationError, match=r"row 1 group 0: 99 kernel blocks exceed the table width"):
        bt.write_rows([1], [(tuple(range(99)),)])
    assert tables(bt) == before


def test_normalised_sequence_record_equals_the_constructed_one() -> None:
    made = SequenceAllocation(0, 1024, 4096, 5120, ((1, 2),), ("ctx",), 0)
    fast = SequenceAllocation.normalised(0, 1024, 4096, 5120, ((1, 2),), ("ctx",), 0)
    assert fast == made and hash(fast) == hash(made) and repr(fast) == repr(made)
    assert pickle.loads(pickle.dumps(fast)) == made
    assert RequestAllocation("r", 0, (fast,)) == RequestAllocation("r", 0, (made,))


def test_an_idle_step_reuses_the_active_batch() -> None:
    from diffusion_kv.core.runtime import BatchStepper

    class Translator:
        def __init__(self) -> None:
            self.active_batch: object = None

        def prepare(self, rows: tuple[object, ...]) -> object:
            return ("batch", rows)

        def activate(self, batch: object) -> object:
            outer = self

            class Ctx:
                def __enter__(self) -> None:
                    outer.active_batch = batch

                def __exit__(self, *exc: object) -> None:
                    outer.active_batch = None

            return Ctx()

    stepper = BatchStepper(Translator(), phase_rows=lambda phase: (phase.value,))  # type: ignore[arg-type, return-value]
    first = stepper.ensure_active(1)
    assert stepper.phase is Phase.DENOISE and stepper.ensure_active(2) is first and stepper.preparations == 1
    with pytest.raises(ValidationError):
        stepper.ensure_active(-1)
    prefill: object = stepper.ensure_active(0)
    assert prefill == ("batch", (Phase.PREFILL.value,)) and stepper.preparations == 2
    stepper.close()
    assert stepper.phase is None
    with pytest.raises(StateError, match="closed"):
        stepper.ensure_active(0)

"""The registry's one-pass install of a plain snapshot (sequences only, no cached prefix, no
released place) leaves exactly what the general path leaves, declines everything else with
nothing changed, and the general path then refuses it with the message it always gave."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch

from diffusion_kv.core.allocation import NULL_BLOCK, RequestAllocation, SequenceAllocation
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.errors import GenerationError, NativeBackendError, StateError, ValidationError
from diffusion_kv.core.layout import AttentionSpec, CacheLayout, KVCacheGroup
from diffusion_kv.core.registry import RowRegistry, RowTransition
from diffusion_kv.integrations.vllm_omni.records import allocation_from_metadata

from .registry_helpers import context, layout, make_registry, request, seq, state_of


def host_registry(lay: CacheLayout | None = None) -> tuple[RowRegistry, TorchBlockTables]:
    lay = lay or layout()
    bt = TorchBlockTables(
        block_sizes=lay.block_sizes,
        max_num_reqs=lay.max_num_reqs,
        max_num_blocks_per_group=lay.max_blocks_per_row(),
        max_num_batched_tokens=lay.max_num_batched_tokens,
        device="cpu",
    )
    return RowRegistry(lay, bt), bt


def full_state(reg: RowRegistry) -> tuple[Any, ...]:
    """Everything an install may change, the generation bookkeeping included."""
    return (
        state_of(reg),
        {rid: reg.snapshot_of(rid) for rid in reg.installed_requests()},
        reg.generation_high_water,
        reg._serial,
        {rid: [a.tolist() for a in arrays] for rid, (arrays, _) in reg._claimed.items()},
        [w.tolist() for w in reg._writer],
    )


CFG = request("r", 3, seqs=(seq(0, 9, [5, 6, 7]), seq(1, 9, [8, 9, 10])))


def test_the_plain_install_leaves_what_the_general_path_leaves() -> None:
    fast, fast_bt = host_registry()
    general, general_bt = make_registry()  # a TorchBlockTables subclass: the general path
    assert fast._plain_fits and not general._plain_fits
    for reg in (fast, general):
        assert reg.install(request("o", 0, seqs=(seq(0, 8, [20, 21]),))) is True
        assert reg.install(CFG) is True
        assert reg.last_transitions == frozenset({RowTransition.INSTALL})
    assert fast.rows == general.rows == {("o", 0, None): 0, ("r", 0, None): 1, ("r", 1, None): 2}
    assert fast.free_rows == general.free_rows == (3, 4, 5)
    assert fast_bt.num_blocks.cpu.tolist() == general_bt.num_blocks.cpu.tolist() == [[2, 3, 3, 0, 0, 0]]
    assert fast_bt.num_blocks.gpu.tolist() == fast_bt.num_blocks.cpu.tolist()
    assert fast_bt.block_tables[0].gpu[1, :3].tolist() == [5, 6, 7]
    assert fast_bt.block_tables[0].gpu[2, :3].tolist() == [8, 9, 10]
    assert [t.gpu.tolist() for t in fast_bt.block_tables] == [t.gpu.tolist() for t in general_bt.block_tables]
    assert fast._holders == general._holders
    assert fast.holders_of(0, 9) == {("r", 1, None): True}
    for reg in (fast, general):
        binding = reg.resolve("r", 1)
        assert (binding.row_index, binding.max_seq_len, binding.block_ids, binding.written) == (
            2,
            9,
            ((8, 9, 10),),
            (),
        )
        assert reg.snapshot_of("r") is CFG and reg.generation_of("r") == 3 and reg.generation_high_water == 3
        assert reg.install(CFG) is False  # the same snapshot again: a no-op
    assert fast.remove("r") == general.remove("r") == 2
    assert fast._holders == general._holders == [{20: {("o", 0, None): True}, 21: {("o", 0, None): True}}]
    assert fast_bt.num_blocks.gpu.tolist() == [[2, 0, 0, 0, 0, 0]]


def test_a_removed_request_comes_back_only_newer_and_then_forgets_the_removal() -> None:
    reg, _ = host_registry()
    reg.install(CFG)
    reg.remove("r")
    before = full_state(reg)
    with pytest.raises(
        GenerationError, match=r"stale allocation generation 3 for request 'r': the request was removed"
    ):
        reg.install(CFG)
    assert full_state(reg) == before
    newer = request("r", 4, seqs=CFG.sequences)
    assert reg._install_plain(newer) is True
    assert reg.removed_generation("r") is None and reg.generation_of("r") == 4
    assert reg.written_spans(("r", 0, None)) == ()


def test_a_request_of_zero_tokens_installs_empty_rows() -> None:
    reg, bt = host_registry()
    empty = request("e", 0, seqs=(seq(0, 0, []),))
    assert reg._install_plain(empty) is True
    assert reg.rows == {("e", 0, None): 0} and bt.num_blocks.cpu.tolist()[0][0] == 0
    assert reg.remove("e") == 1


def _general_error(snapshot: RequestAllocation, setup: list[RequestAllocation]) -> str:
    reg, _ = make_registry()
    for item in setup:
        reg.install(item)
    with pytest.raises((ValidationError, GenerationError, StateError)) as info:
        reg.install(snapshot)
    return f"{type(info.value).__name__}: {info.value}"


SHARED = request("a", 0, seqs=(seq(0, 12, [1, 2, 3], prefix_len=8, target_len=4, cached_prefix_len=8),))
LIVE = request("l", 0, seqs=(seq(0, 8, [30, 31]),))
NUMPY_ID = request("r", 0, seqs=(seq(0, 9, [5, 6, np.int64(7)]),))  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("snapshot", "setup", "message"),
    [
        (request("r", 0, seqs=(seq(0, 9, [5, 6, 6]),)), [], "lists block 6 twice"),
        (request("r", 0, seqs=(seq(0, 9, [5, 6, 7]), seq(1, 9, [8, 9, 7]))), [], "block 7 backs tokens"),
        (request("r", 0, seqs=(seq(0, 9, [5, 6, True]),)), [], "non-integer block id True"),
        (NUMPY_ID, [], r"non-integer block id np.int64\(7\)"),
        (request("r", 0, seqs=(seq(0, 9, [5, 6, 64]),)), [], r"block id 64 is outside \[0, 64\)"),
        (request("r", 0, seqs=(seq(0, 9, [5, 6, 2**70]),)), [], "is outside"),
        (request("r", 0, seqs=(seq(0, 9, [5, NULL_BLOCK, 7]),)), [], "releases blocks at positions"),
        (request("r", 0, seqs=(seq(0, 9, [5, 6]),)), [], "has 2 blocks; expected 3"),
        (
            request("r", 0, seqs=(seq(0, 40, list(range(10))),)),
            [],
            "has 10 blocks; expected 10|needs 10 blocks",
        ),
        (request("r", 0, seqs=(seq(0, 9, [5, 6, 7]), seq(0, 9, [8, 9, 10]))), [], "duplicate row identity"),
        (request("r", 0, seqs=(seq(-1, 9, [5, 6, 7]),)), [], "sequence_id must be an int >= 0"),
        (request("r", 0, seqs=(seq(0, 9, [5, 6, 7], prefix_len=5, target_len=5),)), [], "exceeds seq_len"),
        (request("r", 0, seqs=(seq(0, 4, [30]),)), [LIVE], "block 30 backs tokens this row writes"),
        (request("r", 0, seqs=(seq(0, 4, [2]),)), [SHARED], "block 2 backs tokens this row writes"),
        (
            request("r", 0, seqs=(seq(0, 4, [9]), seq(1, 4, [10]), seq(2, 4, [11]), seq(3, 4, [12]))),
            [],
            "per-request limit",
        ),
        (request("r", 0, seqs=(seq(0, 9, [5, 6, 7], context_ids=("c",)),)), [], "not in the snapshot"),
        (request("", 0, seqs=(seq(0, 9, [5, 6, 7]),)), [], "request_id must be a non-empty string"),
        (request("r", -1, seqs=(seq(0, 9, [5, 6, 7]),)), [], "allocation_generation must be an int >= 0"),
        (request("l", 0, seqs=(seq(0, 4, [40]),)), [LIVE], "conflicting allocation snapshot"),
    ],
)
def test_every_other_snapshot_is_declined_unchanged_and_refused_as_before(
    snapshot: RequestAllocation, setup: list[RequestAllocation], message: str
) -> None:
    reg, _ = host_registry()
    for item in setup:
        reg.install(item)
    before = full_state(reg)
    assert reg._install_plain(snapshot) is False
    assert full_state(reg) == before
    with pytest.raises((ValidationError, GenerationError, StateError)) as info:
        reg.install(snapshot)
    assert f"{type(info.value).__name__}: {info.value}" == _general_error(snapshot, setup)
    assert info.match(message)
    assert full_state(reg) == before


def test_snapshots_the_general_path_takes_are_declined_and_then_installed() -> None:
    for snapshot in (
        SHARED,  # a cached prefix
        request("c", 0, seqs=(seq(0, 8, [1, 2], context_ids=("img",)),), contexts=(context("img", 4, [3]),)),
    ):
        reg, _ = host_registry()
        general, _ = make_registry()
        assert reg._install_plain(snapshot) is False
        assert reg.install(snapshot) is True and general.install(snapshot) is True
        assert reg.rows == general.rows and reg._holders == general._holders


def test_too_few_free_rows_is_declined_and_refused() -> None:
    lay = layout(max_num_seqs=1, rows_per_request=3)
    reg, _ = host_registry(lay)
    reg.install(request("a", 0, seqs=(seq(0, 4, [1]), seq(1, 4, [2]))))
    big = request("b", 0, seqs=(seq(0, 4, [3]), seq(1, 4, [4])))
    before = full_state(reg)
    assert reg._install_plain(big) is False
    with pytest.raises(ValidationError, match=r"requires 2 rows, but only 1 of 3 rows are free"):
        reg.install(big)
    assert full_state(reg) == before


def test_an_orphaned_identity_is_declined_and_refused() -> None:
    reg, _ = host_registry()
    reg._rows[("r", 0, None)] = 5  # a registry whose maps disagree
    before = full_state(reg)
    assert reg._install_plain(CFG) is False
    with pytest.raises(StateError, match="orphaned identities"):
        reg.install(CFG)
    assert full_state(reg) == before


def test_a_table_failure_rolls_back_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    reg, bt = host_registry()
    reg.install(LIVE)
    before = full_state(reg)
    real = TorchBlockTables.write_rows

    def half_then_fail(self: TorchBlockTables, rows: Any, block_ids: Any, *, checked: bool = True) -> None:
        real(self, rows[:1], block_ids[:1], checked=checked)  # the first row lands, then it fails
        raise RuntimeError("injected table failure")

    monkeypatch.setattr(TorchBlockTables, "write_rows", half_then_fail)
    with pytest.raises(
        NativeBackendError, match=r"rows \[1, 2\] \(RuntimeError: injected table failure\); staged"
    ):
        reg.install(CFG)
    # the row counts are restored (what a row reads ends there); ids written past a free
    # row's count are unreachable, as after any rolled-back table write
    after = full_state(reg)
    assert after[0][:5] == before[0][:5] and after[0][6:] == before[0][6:] and after[1:] == before[1:]
    assert bt.num_blocks.gpu.tolist() == bt.num_blocks.cpu.tolist() == [[2, 0, 0, 0, 0, 0]]
    monkeypatch.undo()
    assert reg.install(CFG) is True and reg.rows[("r", 1, None)] == 2  # the rows are free again


def test_a_failing_before_mutation_hook_changes_nothing() -> None:
    reg, _ = host_registry()

    def busy() -> None:
        raise StateError("cannot change paged BlockTables while a prepared batch is active")

    reg.before_mutation = busy
    before = full_state(reg)
    with pytest.raises(StateError, match="prepared batch is active"):
        reg.install(CFG)
    assert full_state(reg) == before


def test_two_groups_take_the_plain_path_with_one_array_each() -> None:
    spec = AttentionSpec(2, 8, torch.float32)
    lay = CacheLayout(
        groups=(KVCacheGroup(4, ("a",), spec), KVCacheGroup(8, ("b",), spec)),
        num_blocks=64,
        max_model_len=32,
        max_rows_per_request=2,
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    reg, bt = host_registry(lay)
    general, _ = make_registry(lay)
    snapshot = RequestAllocation(
        "t",
        0,
        (SequenceAllocation(0, 0, 9, 9, ((1, 2, 3), (4, 5))), SequenceAllocation(1, 0, 4, 4, ((6,), (7,)))),
    )
    assert reg._install_plain(snapshot) is True and general.install(snapshot) is True
    assert bt.num_blocks.cpu[:, :2].tolist() == [[3, 1], [2, 1]]
    assert bt.block_tables[1].gpu[0, :2].tolist() == [4, 5]
    assert reg.holders_of(1, 5) == {("t", 0, None): True} and reg.holders_of(0, 5) == {}
    assert reg._holders == general._holders and reg.rows == general.rows
    before = full_state(reg)
    clash = RequestAllocation("u", 0, (SequenceAllocation(0, 0, 4, 4, ((9,), (6,))),))  # 6 is free in group 1
    assert reg._install_plain(clash) is True
    taken = RequestAllocation("v", 0, (SequenceAllocation(0, 0, 4, 4, ((10,), (7,))),))  # 7: row ('t', 1)
    after = full_state(reg)
    assert reg._install_plain(taken) is False and full_state(reg) == after != before
    with pytest.raises(ValidationError, match=r"group 1: block 7 backs tokens this row writes"):
        reg.install(taken)


def test_write_rows_unchecked_writes_what_checked_writes() -> None:
    _, checked = host_registry()
    _, unchecked = host_registry()
    ids = [(np.array([3, 4, 5]),), ((7,),)]
    checked.write_rows([0, 2], ids)
    unchecked.write_rows([0, 2], ids, checked=False)
    unchecked.write_rows([1], [((9, 8),)], checked=False)  # the counts' device copy, again
    checked.write_rows([1], [((9, 8),)])
    for bt in (checked, unchecked):
        assert bt.num_blocks.cpu.tolist() == bt.num_blocks.gpu.tolist() == [[3, 2, 1, 0, 0, 0]]
        assert bt.block_tables[0].gpu[:3, :3].tolist() == [[3, 4, 5], [9, 8, 0], [7, 0, 0]]


class _Seq:
    def __init__(self, sid: int, ids: list[int], **kw: Any) -> None:
        self.sequence_id, self.prefix_len, self.target_len, self.seq_len = (
            sid,
            1,
            len(ids) * 4 - 1,
            len(ids) * 4,
        )
        self.block_ids = (ids,)
        self.context_ids: Any = kw.get("context_ids", ())
        self.cached_prefix_len = 0


class _Meta:
    def __init__(self, *seqs: _Seq) -> None:
        self.request_id, self.allocation_generation, self.sequences, self.contexts = "m", 2, seqs, ()


def test_records_from_metadata_equal_the_constructed_records() -> None:
    made = allocation_from_metadata(_Meta(_Seq(0, [1, 2]), _Seq(1, [3, 4], context_ids=["x"])))
    expected = RequestAllocation(
        "m", 2, (SequenceAllocation(0, 1, 7, 8, ((1, 2),)), SequenceAllocation(1, 1, 7, 8, ((3, 4),), ("x",)))
    )
    assert made == expected and hash(made) == hash(expected) and repr(made) == repr(expected)
    assert pickle.loads(pickle.dumps(made)) == expected
    assert RequestAllocation.normalised("m", 2, expected.sequences) == expected
    assert type(made.sequences) is tuple and type(made.sequences[1].context_ids) is tuple
    with pytest.raises(ValidationError, match="_Meta is not DiffusionKVMetadata-shaped: AttributeError"):
        bad = _Meta(_Seq(0, [1]))
        del bad.sequences[0].seq_len
        allocation_from_metadata(bad)

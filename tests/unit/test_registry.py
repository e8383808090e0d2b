"""Row registry: every install/resolve/remove rule, with error facts and unchanged state."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.errors import (
    GenerationError,
    NativeBackendError,
    StateError,
    UnknownIdentityError,
    ValidationError,
)
from diffusion_kv.core.registry import KVCacheMode, RowRegistry

from .registry_helpers import context, layout, make_registry, request, seq, state_of


def test_install_assigns_lowest_rows_and_writes_tables() -> None:
    reg, bt = make_registry()
    snap = request("a", 0, (seq(0, 5, [7, 3]), seq(1, 4, [9])))
    assert reg.install(snap) is True
    assert reg.rows == {("a", 0, None): 0, ("a", 1, None): 1}
    assert reg.free_rows == (2, 3, 4, 5)
    assert bt.gather_block_tables(torch.tensor([0, 1]), 2)[0].tolist()[0][:2] == [7, 3]
    assert bt.num_blocks.cpu[0, :2].tolist() == [2, 1]
    binding = reg.resolve("a", 1)
    assert (binding.row_index, binding.max_seq_len, binding.block_ids, binding.cache_role) == (
        1,
        4,
        ((9,),),
        None,
    )
    assert (binding.read_only_tokens, binding.written) == (0, ())


def test_shared_context_is_one_row_across_sequences() -> None:
    reg, _ = make_registry()
    snap = request(
        "a",
        0,
        (seq(0, 4, [1], context_ids=("ref",)), seq(1, 4, [2], context_ids=("ref",))),
        (context("ref", 6, [5, 6]),),
    )
    reg.install(snap)
    assert reg.row_of("a", 0, "ref") == reg.row_of("a", 1, "ref") == 2
    binding = reg.resolve("a", None, "ref")
    assert (binding.row_index, binding.max_seq_len, binding.block_ids, binding.cache_role) == (
        2,
        6,
        ((5, 6),),
        "image",
    )
    assert len(reg.rows) == 3


def test_repeated_block_ids_within_a_row_are_refused() -> None:
    reg, bt = make_registry()
    before = state_of(reg)
    with pytest.raises(
        ValidationError, match=r"row \('a', 0, None\) group 0 lists block 4 twice \(positions 0 and 2\)"
    ):
        reg.install(request("a", 0, (seq(0, 12, [4, 5, 4]),)))
    assert state_of(reg) == before and bt.appends == 0


def test_zero_length_row_has_no_blocks() -> None:
    reg, bt = make_registry()
    reg.install(request("a", 0, (seq(0, 0, []),)))
    assert reg.resolve("a", 0).max_seq_len == 0 and bt.num_blocks.cpu[0, 0].item() == 0


def test_generations() -> None:
    reg, bt = make_registry()
    snap = request("a", 3)
    assert reg.install(snap) is True
    appends = bt.appends
    assert reg.install(snap) is False  # same generation, same snapshot: no-op
    newer = RequestAllocation("a", 5, snap.sequences, snap.contexts)
    assert reg.install(newer) is False  # newer, same content: recorded, rows kept
    assert reg.generation_of("a") == 5 and bt.appends == appends
    before = state_of(reg)
    with pytest.raises(
        GenerationError, match="stale allocation generation 4 for request 'a'; installed generation is 5"
    ):
        reg.install(RequestAllocation("a", 4, snap.sequences))
    with pytest.raises(GenerationError, match="conflicting allocation snapshot for installed request 'a'"):
        reg.install(request("a", 6, (seq(0, 5, [1, 3]),)))
    assert state_of(reg) == before


def test_generation_scoped_removal() -> None:
    reg, _ = make_registry()
    reg.install(request("a", 2))
    assert reg.remove([("a", 1)]) == 0  # a late cleanup of an older allocation
    assert reg.rows == {("a", 0, None): 0}
    assert reg.remove([("a", 2)]) == 1
    assert reg.rows == {} and reg.free_rows == tuple(range(6))


def test_remove_is_idempotent_and_rows_are_reused_lowest_first() -> None:
    reg, bt = make_registry()
    reg.install(request("a", 0, (seq(0, 4, [1]), seq(1, 4, [2]))))
    reg.install(request("b", 0, (seq(0, 4, [3]),)))
    assert reg.remove(["a", "missing"]) == 2
    assert reg.remove(["a"]) == 0
    assert bt.num_blocks.cpu[0, :3].tolist() == [0, 0, 1]
    assert reg.free_rows == (0, 1, 3, 4, 5)
    reg.install(request("c", 0, (seq(0, 4, [9]),)))
    assert reg.row_of("c", 0) == 0


def test_remove_never_touches_other_requests() -> None:
    reg, _ = make_registry()
    reg.install(request("a"))
    reg.install(request("ab", 0, (seq(0, 5, [3, 4]),)))
    reg.remove(["a"])
    assert reg.rows == {("ab", 0, None): 1}


def test_native_append_failure_rolls_back() -> None:
    reg, bt = make_registry()
    reg.install(request("x", 0, (seq(0, 4, [7]),)))
    before = state_of(reg)
    bt.fail_append_at = bt.appends + 2  # the second row of the next install fails
    with pytest.raises(NativeBackendError, match="injected append failure.*rolled back"):
        reg.install(request("a", 0, (seq(0, 4, [1]), seq(1, 8, [2, 3]))))
    assert state_of(reg) == before
    assert reg.install(request("a", 0, (seq(0, 4, [1]), seq(1, 8, [2, 3])))) is True


def test_native_apply_failure_rolls_back() -> None:
    reg, bt = make_registry()
    before = state_of(reg)
    bt.fail_apply = True
    with pytest.raises(NativeBackendError, match="injected apply failure"):
        reg.install(request("a"))
    assert state_of(reg) == before
    assert all(not t._staged for t in bt.block_tables)


def test_failed_removal_keeps_rows() -> None:
    reg, bt = make_registry()
    reg.install(request("a"))
    before = state_of(reg)
    bt.fail_apply = True
    with pytest.raises(NativeBackendError):
        reg.remove(["a"])
    assert state_of(reg) == before


def test_before_mutation_hook_runs_and_can_veto() -> None:
    calls: list[str] = []
    veto = {"on": False}

    def hook() -> None:
        calls.append("mutate")
        if veto["on"]:
            raise StateError("a batch is active")

    reg, _ = make_registry(before_mutation=hook)
    reg.install(request("a"))
    reg.refresh_layout()
    assert calls == ["mutate", "mutate"]
    veto["on"] = True
    before = state_of(reg)
    with pytest.raises(StateError, match="a batch is active"):
        reg.install(request("b", 0, (seq(0, 5, [8, 9]),)))
    with pytest.raises(StateError):
        reg.remove(["a"])
    assert state_of(reg) == before


def test_dense_mode() -> None:
    reg, _ = make_registry(mode=KVCacheMode.DENSE)
    with pytest.raises(ValidationError, match="dense execution must not install"):
        reg.install(request())
    with pytest.raises(StateError, match="dense mode"):
        reg.row_of("r", 0)
    assert reg.remove(["r"]) == 0
    reg.refresh_layout()


def test_unknown_identity() -> None:
    reg, _ = make_registry()
    with pytest.raises(UnknownIdentityError, match=r"no worker row is installed for \('r', 0, None\)"):
        reg.row_of("r", 0)
    reg.install(request())
    with pytest.raises(KeyError):
        reg.resolve("r", None, "nope")


def test_resolve_follows_every_change() -> None:
    """resolve() keeps its answers between changes; each install, write record, removal or
    mode change is seen by the next lookup."""
    reg, _ = make_registry()
    ident = ("a", 0, None)
    reg.install(request("a", 0, (seq(0, 5, [1, 2]),)))
    first = reg.resolve("a", 0)
    assert reg.resolve("a", 0) == first and first.written == ()
    reg.record_writes([(ident, first.install_serial, 0, 3)])
    assert reg.resolve("a", 0).written == ((0, 3),)
    reg.record_writes([(ident, first.install_serial - 1, 3, 5)])  # an older install's write: ignored
    assert reg.resolve("a", 0).written == ((0, 3),)
    assert reg.install(request("a", 1, (seq(0, 5, [1, 2]),))) is False  # newer generation, same rows
    assert reg.resolve("a", 0).written == ((0, 3),)
    reg.remove("a")
    with pytest.raises(UnknownIdentityError):
        reg.resolve("a", 0)
    reg.install(request("a", 2, (seq(0, 9, [4, 5, 6]),)))
    again = reg.resolve("a", 0)
    assert (again.max_seq_len, again.block_ids, again.written) == (9, ((4, 5, 6),), ())
    assert again.install_serial > first.install_serial
    reg.mode = KVCacheMode.DENSE
    with pytest.raises(StateError, match="dense mode"):
        reg.resolve("a", 0)


def test_record_writes_of_written_tokens_keeps_the_binding() -> None:
    """A denoise step rewrites the span it wrote before: recording it changes nothing, so the
    kept binding stays (the same object, the next batch's rows found in one pass). A write that
    adds tokens -- past the span, bridging two spans, or after an empty write -- is merged and
    seen by the next lookup; an empty span and an older install's write change nothing."""
    reg, _ = make_registry()
    ident = ("a", 0, None)
    reg.install(request("a", 0, (seq(0, 9, [1, 2, 3]),)))
    serial = reg.resolve("a", 0).install_serial
    reg.record_writes([(ident, serial, 0, 4)])
    kept = reg.resolve("a", 0)
    assert kept.written == ((0, 4),)
    for start, end in ((0, 4), (1, 3), (2, 4), (5, 5), (7, 6)):  # inside, or empty: no change
        reg.record_writes([(ident, serial, start, end)])
        assert reg.resolve("a", 0) is kept and reg.resolve_identities([ident])[0] is kept
    reg.record_writes([(ident, serial - 1, 4, 9)])  # an older install's write: ignored
    assert reg.resolve("a", 0) is kept
    reg.record_writes([(ident, serial, 6, 8)])
    assert reg.resolve("a", 0).written == ((0, 4), (6, 8))
    reg.record_writes([(ident, serial, 3, 7)])  # bridges the two spans
    assert reg.resolve("a", 0).written == ((0, 8),)
    reg.record_writes([(ident, serial, 5, 9)])  # past the end of the only span
    after = reg.resolve("a", 0)
    assert after.written == ((0, 9),) and after is not kept


def test_resolve_identities_answers_as_resolve_does_for_each() -> None:
    """The translator's one call per batch: the same bindings, in order, as one resolve() per
    identity, before and after the answers are kept; an unknown identity, a context row and
    dense mode give what resolve() gives."""
    reg, _ = make_registry()
    reg.install(
        request(
            "a",
            0,
            (seq(0, 4, [1], context_ids=("ref",)), seq(1, 4, [2], context_ids=("ref",))),
            (context("ref", 6, [5, 6]),),
        )
    )
    reg.install(request("b", 0, (seq(0, 5, [7, 3]),)))
    idents = [("b", 0, None), ("a", None, "ref"), ("a", 1, None), ("a", 0, None)]
    cold = reg.resolve_identities(idents)  # nothing kept yet: each through resolve()
    assert cold == [reg.resolve(*i) for i in idents]
    assert [b.row_index for b in cold] == [3, 2, 1, 0]
    assert reg.resolve_identities(idents) == cold  # kept answers, one pass
    with pytest.raises(UnknownIdentityError, match=r"no worker row is installed for \('c', 0, None\)"):
        reg.resolve_identities([("b", 0, None), ("c", 0, None)])
    reg.record_writes([(("b", 0, None), cold[0].install_serial, 0, 5)])  # a change: seen
    assert reg.resolve_identities(idents)[0].written == ((0, 5),)
    reg.mode = KVCacheMode.DENSE
    with pytest.raises(StateError, match="dense mode"):
        reg.resolve_identities(idents)


def test_orphaned_identity_is_detected() -> None:
    reg, _ = make_registry()
    reg._rows[("a", 0, None)] = 5  # an inconsistent registry (e.g. a bug elsewhere)
    before = state_of(reg)
    with pytest.raises(StateError, match=r"orphaned identities for request 'a': \[\('a', 0, None\)\]"):
        reg.install(request("a"))
    assert state_of(reg) == before


def test_not_enough_free_rows() -> None:
    reg, _ = make_registry(layout(rows_per_request=3, max_num_seqs=1))
    reg.install(request("a", 0, (seq(0, 4, [1]), seq(1, 4, [2]))))
    before = state_of(reg)
    with pytest.raises(ValidationError, match=r"request 'b' requires 2 rows, but only 1 of 3 rows are free"):
        reg.install(request("b", 0, (seq(0, 4, [3]), seq(1, 4, [4]))))
    assert state_of(reg) == before


Case = tuple[Callable[[], RequestAllocation], str]

INVALID: dict[str, Case] = {
    "empty request id": (lambda: request(""), "request_id must be a non-empty string"),
    "negative generation": (lambda: request("a", -1), "allocation_generation must be an int >= 0; got -1"),
    "bool generation": (lambda: request("a", True), "allocation_generation must be an int >= 0; got True"),  # type: ignore[arg-type]
    "no sequences": (lambda: RequestAllocation("a", 0, ()), "request 'a' must contain at least one sequence"),
    "negative sequence id": (
        lambda: request("a", 0, (seq(-1, 4, [1]),)),
        "sequence_id must be an int >= 0; got -1",
    ),
    "negative prefix": (
        lambda: request("a", 0, (seq(0, 4, [1], prefix_len=-1, target_len=4),)),
        "prefix_len must be an int >= 0",
    ),
    "prefix+target > seq_len": (
        lambda: request("a", 0, (seq(0, 4, [1], prefix_len=2, target_len=3),)),
        r"prefix_len 2 \+ target_len 3 exceeds seq_len 4",
    ),
    "cached prefix beyond prefix": (
        lambda: request("a", 0, (seq(0, 4, [1], prefix_len=2, target_len=2, cached_prefix_len=3),)),
        "cached_prefix_len 3 must lie within the stable prefix",
    ),
    "unknown context": (
        lambda: request("a", 0, (seq(0, 4, [1], context_ids=("ghost",)),)),
        r"refers to context id\(s\) \['ghost'\] not in the snapshot",
    ),
    "duplicate identity": (
        lambda: request("a", 0, (seq(0, 4, [1]), seq(0, 4, [2]))),
        r"duplicate row identity \('a', 0, None\)",
    ),
    "negative token length": (
        lambda: request("a", 0, (SequenceAllocation(0, 0, 0, -1, ((),)),)),
        "invalid token length -1",
    ),
    "wrong group count": (
        lambda: request("a", 0, (SequenceAllocation(0, 0, 4, 4, ((1,), (2,))),)),
        "has 2 block groups; expected 1",
    ),
    "too few blocks": (
        lambda: request("a", 0, (seq(0, 5, [1]),)),
        "group 0 has 1 blocks; expected 2 for 5 tokens at block size 4",
    ),
    "too many blocks": (
        lambda: request("a", 0, (seq(0, 4, [1, 2]),)),
        "has 2 blocks; expected 1 for 4 tokens",
    ),
    "beyond row capacity": (
        lambda: request("a", 0, (seq(0, 36, list(range(9))),)),
        "needs 9 blocks; row capacity is 8 \\(max_model_len 32\\)",
    ),
    "float block id": (lambda: request("a", 0, (seq(0, 4, [1.0]),)), "non-integer block id 1.0"),  # type: ignore[list-item]
    "bool block id": (lambda: request("a", 0, (seq(0, 4, [True]),)), "non-integer block id True"),
    "block id out of range": (
        lambda: request("a", 0, (seq(0, 4, [64]),)),
        r"block id 64 is outside \[0, 64\)",
    ),
    "negative block id": (lambda: request("a", 0, (seq(0, 4, [-2]),)), r"block id -2 is outside \[0, 64\)"),
    # -1 is NULL_BLOCK, a released place: only a windowed group's mask releases keys
    "released block in a causal group": (
        lambda: request("a", 0, (seq(0, 4, [-1]),)),
        r"releases blocks at positions \[0\], but the group's mask causal keeps every key",
    ),
    "empty context id": (
        lambda: request("a", 0, (seq(0, 4, [1]),), (context("", 4, [1]),)),
        "context_id must be a non-empty string",
    ),
    "empty cache role": (
        lambda: request("a", 0, (seq(0, 4, [1]),), (context("c", 4, [1], role=""),)),
        "cache_role must be a non-empty string",
    ),
    "unregistered cache role": (
        lambda: request("a", 0, (seq(0, 4, [1]),), (context("c", 4, [1], role="audio"),)),
        r"unregistered cache role 'audio'; registered roles: \['image'\]",
    ),
    "too many rows": (
        lambda: request("a", 0, (seq(0, 4, [1]), seq(1, 4, [1]), seq(2, 4, [1]), seq(3, 4, [1]))),
        "request 'a' requires 4 rows; the per-request limit is 3",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_snapshots_change_nothing(case: str) -> None:
    build, message = INVALID[case]
    reg, bt = make_registry(cache_roles=frozenset({"image"}))
    reg.install(request("other", 0, (seq(0, 4, [9]),)))
    before = state_of(reg)
    appends = bt.appends
    with pytest.raises(ValidationError, match=message):
        reg.install(build())
    assert state_of(reg) == before
    assert bt.appends == appends


def test_non_snapshot_is_rejected() -> None:
    reg, _ = make_registry()
    with pytest.raises(ValidationError, match="expected a RequestAllocation; got dict"):
        reg.install({"request_id": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize("entry", [("a",), ("a", "1"), 3, None])
def test_malformed_removal_entries(entry: object) -> None:
    reg, _ = make_registry()
    reg.install(request("a"))
    with pytest.raises(ValidationError, match="removal entry must be a non-empty request_id or"):
        reg.remove([entry])  # type: ignore[list-item]
    assert reg.rows == {("a", 0, None): 0}


def test_registry_requires_matching_group_count() -> None:
    _, bt = make_registry()
    from diffusion_kv.core.layout import AttentionSpec, CacheLayout, KVCacheGroup

    spec = AttentionSpec(2, 8, torch.float32)
    two = CacheLayout(
        groups=(KVCacheGroup(4, ("a",), spec), KVCacheGroup(4, ("b",), spec)),
        num_blocks=8,
        max_model_len=16,
        max_rows_per_request=1,
        max_num_seqs=1,
        max_num_batched_tokens=16,
    )
    with pytest.raises(ValidationError, match="BlockTables has 1 groups; the layout has 2"):
        RowRegistry(two, bt)


def test_context_allocation_round_trip_in_registry_binding() -> None:
    reg, _ = make_registry()
    ctx = ContextAllocation("c", "image", 3, [[4]])  # type: ignore[arg-type]
    reg.install(request("a", 0, (seq(0, 4, [1], context_ids=("c",)),), (ctx,)))
    assert reg.resolve("a", 0, "c").block_ids == ((4,),)

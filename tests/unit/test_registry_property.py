"""Property test: random install / reinstall / conflict / stale / remove / failures vs a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusion_kv.core.allocation import RequestAllocation
from diffusion_kv.core.errors import GenerationError, NativeBackendError, ValidationError

from .registry_helpers import context, make_registry, seq, state_of

REQUESTS = ["a", "b", "c", "d"]


def snapshot(rid: str, gen: int, variant: int) -> RequestAllocation:
    """Variant picks the shape: 1-2 sequences, 0-1 shared context. Requests never share blocks
    (ownership has its own model-based test); the variant moves blocks within the request's own."""
    base = REQUESTS.index(rid) * 16 + variant
    n_seq = 1 + variant % 2
    ctx = variant >= 2
    seqs = tuple(
        seq(s, 5 + variant, [base + 2 * s, base + 2 * s + 1], context_ids=("ctx",) if ctx else ())
        for s in range(n_seq)
    )
    contexts = (context("ctx", 3, [base + 7]),) if ctx else ()
    return RequestAllocation(rid, gen, seqs, contexts)


def rows_needed(variant: int) -> int:
    return 1 + variant % 2 + (1 if variant >= 2 else 0)


@dataclass
class Model:
    capacity: int
    installed: dict[str, tuple[int, int]] = field(default_factory=dict)  # rid -> (gen, variant)
    rows: dict[str, list[int]] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)  # rid -> generation it was removed at

    def free(self) -> list[int]:
        used = {r for rows in self.rows.values() for r in rows}
        return sorted(set(range(self.capacity)) - used)


op = st.one_of(
    st.tuples(st.just("install"), st.sampled_from(REQUESTS), st.integers(0, 4), st.integers(0, 3)),
    st.tuples(st.just("remove"), st.sampled_from(REQUESTS), st.none(), st.none()),
    st.tuples(st.just("remove_gen"), st.sampled_from(REQUESTS), st.integers(0, 4), st.none()),
    st.tuples(st.just("fail_install"), st.sampled_from(REQUESTS), st.integers(0, 4), st.integers(0, 3)),
    st.tuples(st.just("fail_remove"), st.sampled_from(REQUESTS), st.none(), st.none()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=25))
def test_registry_matches_model(ops: list[tuple]) -> None:
    reg, bt = make_registry()
    model = Model(capacity=reg.capacity)
    for kind, rid, gen, variant in ops:
        before = state_of(reg)
        if kind in ("install", "fail_install"):
            snap = snapshot(rid, gen, variant)
            current = model.installed.get(rid)
            if kind == "fail_install":
                bt.fail_apply = True
            try:
                result = reg.install(snap)
            except GenerationError:
                if current is None:  # a late or duplicated snapshot of a removed request
                    assert rid in model.removed and gen <= model.removed[rid]
                else:
                    assert gen < current[0] or variant != current[1]
                assert state_of(reg) == before
            except ValidationError:
                assert current is None and rows_needed(variant) > len(model.free())
                assert state_of(reg) == before
            except NativeBackendError:
                assert kind == "fail_install" and current is None
                assert state_of(reg) == before
            else:
                if current is None:
                    assert kind == "install" and result is True
                    assert gen > model.removed.get(rid, -1)
                    model.removed.pop(rid, None)
                    expected_rows = model.free()[: rows_needed(variant)]
                    assert sorted(r for (q, _, _), r in reg.rows.items() if q == rid) == expected_rows
                    model.installed[rid] = (gen, variant)
                    model.rows[rid] = expected_rows
                else:
                    assert result is False and variant == current[1] and gen >= current[0]
                    model.installed[rid] = (gen, variant)
                    before_rows = {k: v for k, v in before[0].items()}
                    assert reg.rows == before_rows
            bt.fail_apply = False
        elif kind == "fail_remove":
            bt.fail_apply = True
            try:
                n = reg.remove([rid])
            except NativeBackendError:
                assert rid in model.installed
                assert state_of(reg) == before
            else:
                assert rid not in model.installed and n == 0
            bt.fail_apply = False
        else:
            entry = rid if kind == "remove" else (rid, gen)
            n = reg.remove([entry])
            current = model.installed.get(rid)
            if current is not None and (kind == "remove" or current[0] == gen):
                assert n == len(model.rows[rid])
                model.removed[rid] = current[0]
                del model.installed[rid]
                del model.rows[rid]
            else:
                assert n == 0 and state_of(reg) == before
        # invariants after every step
        used = list(reg.rows.values())
        assert len(used) == len(set(used)), "a row is shared by two identities"
        assert len(used) + len(reg.free_rows) == reg.capacity
        assert set(used).isdisjoint(reg.free_rows)
        assert {rid: g for rid, (g, _) in model.installed.items()} == {
            r: reg.generation_of(r) for r in reg.installed_requests()
        }
        assert sorted(used) == sorted(r for rows in model.rows.values() for r in rows)
        counts = bt.num_blocks.cpu[0]
        for r in reg.free_rows:
            assert counts[r].item() == 0, f"free row {r} still holds blocks"
        for (q, s, c), r in reg.rows.items():
            binding = reg.resolve(q, s, c)
            assert counts[r].item() == len(binding.block_ids[0])
            table = bt.gather_block_tables(torch.tensor([r]), 1)[0][0].tolist()
            assert table[: len(binding.block_ids[0])] == list(binding.block_ids[0])

"""Retained prepared batches: where the BlockTables and every backend promise that a preparation
makes tensors of its own (``retains_batches`` / ``retains_metadata``), a batch stays valid after
later preparations -- a host alternating between compositions re-activates each one's batch --
and only a BlockTables change makes it stale. Elsewhere the old rule holds: a newer preparation
makes every earlier batch stale."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from diffusion_kv.conformance.harness import PagedHarness
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.batch import PagedBatch
from diffusion_kv.core.block_tables import (
    RETAINING_METHODS,
    DeviceBatch,
    HostBatch,
    TorchBlockTables,
    declared,
)
from diffusion_kv.core.errors import StaleBatchError
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.translate import Translator
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend
from diffusion_kv.platforms.cuda.block_tables import TritonBlockTables

ROWS_A = (PagedRow("a", 8, 40, 32, sequence_id=0),)
ROWS_B = (PagedRow("b", 4, 20, 16, sequence_id=0),)


def _harness(
    backend: str = "sdpa", block_tables: type | None = None, wrap: type | None = None
) -> PagedHarness:
    h = PagedHarness(CpuPlatform(), backend_choice=backend, block_size=16, num_blocks=32, max_model_len=64)
    if block_tables is not None or wrap is not None:
        bt = h.block_tables
        if block_tables is not None:
            bt.__class__ = block_tables  # the same tables, another class's methods and promises
        backend_obj = h.backend
        if wrap is not None:
            backend_obj.__class__ = wrap
        h.translator = Translator(
            layout=h.layout, block_tables=bt, backends=[backend_obj], rows=h.registry, device=h.device
        )
        h.registry.before_mutation = h.translator.invalidate
        h.executor.translator = h.translator
    h.install("a", [40])
    h.install("b", [20])
    for rid, n in (("a", 32), ("b", 16)):  # every token before the batches' own
        _attend(h, h.translator.prepare((PagedRow(rid, n, n, 0, sequence_id=0),)), seed=0)
    return h


def _attend(h: PagedHarness, batch: Any, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = batch.num_tokens
    q = torch.randn(n, h.num_heads, h.head_size, generator=g)
    k = torch.randn(n, h.num_kv_heads, h.head_size, generator=g)
    v = torch.randn(n, h.num_kv_heads, h.head_size, generator=g)
    with h.translator.activate(batch):
        return [h.executor.forward(name, q, k, v) for name in h.layer_names]


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_retained_batch_serves_again_after_another_preparation(backend: str) -> None:
    h = _harness(backend)
    assert h.translator.retains_batches
    assert h.registry.written_spans(("a", 0, None)) == ((0, 32),)
    a = h.translator.prepare(ROWS_A)
    b = h.translator.prepare(ROWS_B)
    assert a.retained and b.retained
    first_b = _attend(h, b, seed=2)
    again_a = _attend(h, a, seed=1)  # prepared before b: still valid
    # the re-activated batch's writes were recorded: the row's written span is whole
    assert h.registry.written_spans(("a", 0, None)) == ((0, 40),)
    fresh = _attend(h, h.translator.prepare(ROWS_A), seed=1)
    for x, y in zip(again_a, fresh, strict=True):
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(first_b, _attend(h, b, seed=2), strict=True))


def test_a_block_tables_change_makes_a_retained_batch_stale() -> None:
    h = _harness()
    a = h.translator.prepare(ROWS_A)
    h.install("c", [16])  # the registry writes the tables: every batch is stale
    with pytest.raises(StaleBatchError, match=r"BlockTables changed since"), h.translator.activate(a):
        pass
    b = h.translator.prepare(ROWS_B)  # a batch prepared after the change is valid
    with h.translator.activate(b):
        pass


class _PersistentTables(TorchBlockTables):
    """Replaces how batches are made (here: the same, through the torch default) without
    promising anything: inherits ``retains_batches`` from a class whose ``prepare_batch`` it
    overrode, so the promise does not hold for it."""

    def prepare_batch(self, host: HostBatch) -> DeviceBatch:
        return super().prepare_batch(host)


class _PromisingTables(_PersistentTables):
    retains_batches: ClassVar[bool] = True


class _RebuildingBackend(CpuSdpaBackend):
    def build(self, batch: PagedBatch) -> Any:
        return super().build(batch)


class _RebuildingPromise(_RebuildingBackend):
    retains_metadata: ClassVar[bool] = True


@pytest.mark.parametrize(
    ("tables", "backend", "retained"),
    [
        (_PersistentTables, None, False),
        (_PromisingTables, None, True),
        (None, _RebuildingBackend, False),
        (None, _RebuildingPromise, True),
    ],
)
def test_without_both_promises_a_newer_preparation_makes_older_batches_stale(
    tables: type | None, backend: type | None, retained: bool
) -> None:
    h = _harness(block_tables=tables or TorchBlockTables, wrap=backend)
    assert h.translator.retains_batches is retained
    a = h.translator.prepare(ROWS_A)
    b = h.translator.prepare(ROWS_B)
    assert a.retained is retained
    if retained:
        _attend(h, a, seed=1)
    else:
        with (
            pytest.raises(
                StaleBatchError, match=r"a newer batch was prepared since, and these BlockTables or backends"
            ),
            h.translator.activate(a),
        ):
            pass
    _attend(h, b, seed=2)  # the newest batch is always valid


def test_declared_follows_the_class_that_made_the_promise() -> None:
    class Base:
        flag: ClassVar[bool] = True

        def make(self) -> None: ...

    class Inherits(Base):
        pass

    class Overrides(Base):
        def make(self) -> None: ...

    class Again(Overrides):
        flag = True

    class Withdraws(Base):
        flag = False

    class NotAFlag(Base):
        flag = 1  # type: ignore[assignment]

    assert declared(Base, "flag", ("make",))
    assert declared(Inherits, "flag", ("make",))
    assert not declared(Overrides, "flag", ("make",))
    assert declared(Again, "flag", ("make",))
    assert not declared(Withdraws, "flag", ("make",))
    assert not declared(NotAFlag, "flag", ("make",))
    assert not declared(object, "flag", ())
    assert declared(TorchBlockTables, "retains_batches", RETAINING_METHODS)
    assert not declared(TritonBlockTables, "retains_batches", RETAINING_METHODS)  # persistent buffers
    assert declared(CpuSdpaBackend, "retains_metadata", ("build",))
    assert declared(CpuReferenceBackend, "retains_metadata", ("build",))
    assert not declared(PagedBackend, "retains_metadata", ("build",))

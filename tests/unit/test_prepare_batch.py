"""``Translator.prepare``'s device step: the cuda plugin's fused Triton kernel (positions, slot
mappings and gathered block tables in one launch per KV-cache group, from one staged buffer)
against the core's torch implementation, exact values, under Triton's interpreter on CPU
tensors. Skipped when Triton is not installed; on a GPU machine tests/gpu covers the real kernel.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_interpreted import InterpretedCudaPlatform  # sets TRITON_INTERPRET first

pytest.importorskip("triton", reason="Triton is not installed (ci/bootstrap.sh installs it)")

import random
from typing import Any

import numpy as np

from diffusion_kv.conformance.harness import PagedHarness
from diffusion_kv.core.block_tables import (
    BlockTables,
    DeviceBatch,
    HostBatch,
    TorchBlockTables,
    prepare_batch_torch,
)
from diffusion_kv.core.errors import StaleBatchError
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cuda import backend as cuda_backend
from diffusion_kv.platforms.cuda.block_tables import TritonBlockTables
from diffusion_kv.platforms.interface import ENV_BACKEND

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="GPU present: tests/gpu covers the real kernel"
)

LAYOUTS = {
    "one group": {},
    "kernel blocks": {"kernel_block_sizes": [8]},
    "dcp interleave 4": {"cp_size": 2, "cp_rank": 1, "cp_interleave": 4},
    "dcp 4 ranks": {"cp_size": 4, "cp_rank": 2, "cp_interleave": 1},
    "int32 slots": {"slot_mapping_dtype": torch.int32},
    "two groups": {
        "block_sizes": [16, 32],
        "kernel_block_sizes": [16, 16],
        "max_num_blocks_per_group": [8, 5],
    },
}


def tables(**kw: Any) -> tuple[TritonBlockTables, TorchBlockTables]:
    args: dict[str, Any] = dict(
        block_sizes=[16],
        max_num_reqs=6,
        max_num_batched_tokens=400,
        max_num_blocks_per_group=[8],
        device="cpu",
    )
    args.update(kw)
    return TritonBlockTables(**args), TorchBlockTables(**args)


def install_random(bts: tuple[TorchBlockTables, ...], rng: random.Random) -> None:
    """The same random rows in every BlockTables: some rows empty, some appended to, some
    overwritten with fewer blocks (stale ids stay in the table past the row's count)."""
    ref = bts[0]
    for row in range(ref.max_num_reqs):
        if rng.random() < 0.2:
            continue
        for overwrite in (True, *rng.choice([(), (False,), (True,)])):
            ids = tuple(
                rng.sample(range(1, 200), rng.randint(0, cap // 2)) for cap in ref.max_num_blocks_per_group
            )
            for bt in bts:
                bt.append_block_ids(row, tuple(list(g) for g in ids), overwrite=overwrite)
                bt.apply_staged_writes()


def host_batch(query_lens: list[int], seq_lens: list[int], rows: list[int], starts: list[int]) -> HostBatch:
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    packed = torch.from_numpy(np.array(qsl + seq_lens + rows + starts, dtype=np.int32))
    return HostBatch(packed, len(rows), qsl[-1], max(query_lens))


def random_batch(rng: random.Random, max_reqs: int, max_tokens: int) -> HostBatch:
    """Rows of random length anywhere in their worker row, positions past the installed blocks
    included (their slots are -1); one row may be the padding index -1."""
    n = rng.randint(1, max_reqs)
    rows = rng.sample(range(max_reqs), n)
    if rng.random() < 0.3:
        rows[rng.randrange(n)] = -1
    query_lens = [rng.randint(1, max_tokens // max_reqs) for _ in rows]
    starts = [rng.randint(0, 150) for _ in rows]
    seq_lens = [s + q + rng.randint(0, 8) for s, q in zip(starts, query_lens, strict=True)]
    return host_batch(query_lens, seq_lens, rows, starts)


def tensor_pairs(a: object, b: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One DeviceBatch field of two batches, tensor by tensor (a field is a tensor or a tuple)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return list(zip(a, b, strict=True))
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return [(a, b)]


def assert_same(got: DeviceBatch, want: DeviceBatch) -> None:
    for name, a, b in zip(DeviceBatch._fields, got, want, strict=True):
        for x, y in tensor_pairs(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"


@pytest.mark.parametrize("kw", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_kernel_matches_torch_on_random_layouts(kw: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed)
    tri, ref = tables(**kw)
    install_random((ref, tri), rng)
    for _ in range(4):  # one set of persistent buffers, batches of every size in turn
        host = random_batch(rng, ref.max_num_reqs, ref.max_num_batched_tokens)
        assert_same(tri.prepare_batch(host), ref.prepare_batch(host))


def test_worked_example_and_padding_slots() -> None:
    tri, ref = tables(kernel_block_sizes=[8])
    for bt in (tri, ref):
        bt.append_block_ids(2, ([5, 1, 3],), overwrite=True)
        bt.append_block_ids(0, ([4],), overwrite=True)
        bt.apply_staged_writes()
    # row 2: tokens 8..47 (3 blocks of 16); row 0: tokens 13..18, only 0..15 installed
    host = host_batch([40, 6], [48, 19], [2, 0], [8, 13])
    got = tri.prepare_batch(host)
    assert_same(got, ref.prepare_batch(host))
    assert got.positions.tolist() == [*range(8, 48), *range(13, 19)]
    kernel = [10, 11, 2, 3, 6, 7]  # manager block b is kernel blocks 2b, 2b + 1
    want_row2 = [kernel[(p // 8)] * 8 + p % 8 for p in range(8, 48)]
    want_row0 = [9 * 8 + p % 8 for p in range(13, 16)] + [-1, -1, -1]
    assert got.slot_mappings.tolist() == [want_row2 + want_row0]
    assert got.block_tables[0].tolist()[0][:7] == [10, 11, 2, 3, 6, 7, 0]
    assert got.block_tables[0].tolist()[1][:3] == [8, 9, 0]


def test_batches_are_views_of_persistent_buffers() -> None:
    tri, _ = tables()
    tri.append_block_ids(0, ([3, 4],), overwrite=True)
    tri.append_block_ids(1, ([5],), overwrite=True)
    tri.apply_staged_writes()
    first = tri.prepare_batch(host_batch([4, 2], [20, 6], [0, 1], [16, 4]))
    second = tri.prepare_batch(host_batch([3, 2], [19, 6], [0, 1], [16, 4]))
    for a, b in zip(first, second, strict=True):  # persistent buffers: the same storage
        for x, y in tensor_pairs(a, b):
            assert x.data_ptr() == y.data_ptr()
    assert second.positions.tolist() == [16, 17, 18, 4, 5]
    assert second.slot_mappings.tolist() == [[64, 65, 66, 84, 85]]


def test_buffers_grow_with_the_capacities() -> None:
    tri, ref = tables(max_num_reqs=2, max_num_batched_tokens=8)
    for bt in (tri, ref):
        bt.append_block_ids(0, ([3],), overwrite=True)
        bt.apply_staged_writes()
    assert_same(
        tri.prepare_batch(host_batch([8], [8], [0], [0])), ref.prepare_batch(host_batch([8], [8], [0], [0]))
    )
    for bt in (tri, ref):
        bt.max_num_batched_tokens = 16
    host = host_batch([16], [16], [0], [0])
    assert_same(tri.prepare_batch(host), ref.prepare_batch(host))
    tri.init_block_table_layout_tensors()  # storage moved: the buffers are made again
    assert_same(tri.prepare_batch(host), ref.prepare_batch(host))


# --- through the translator ------------------------------------------------------------------


def harness(platform: Any, **kw: Any) -> PagedHarness:
    h = PagedHarness(platform, block_size=16, num_blocks=64, max_model_len=128, **kw)
    h.install("r", [100, 37, 64], placement="permuted")
    h.prefill("r", [100, 37, 64])
    return h


DENOISE = (
    PagedRow("r", 20, 100, 80, sequence_id=0),
    PagedRow("r", 37, 37, 0, sequence_id=1),
    PagedRow("r", 5, 64, 59, sequence_id=2),
)


def common_values(batch: Any) -> dict[str, Any]:
    c = batch.common
    return {
        "query_start_loc": c.query_start_loc.tolist(),
        "query_start_loc_cpu": c.query_start_loc_cpu.tolist(),
        "seq_lens": c.seq_lens.tolist(),
        "seq_lens_cpu": c.seq_lens_cpu.tolist(),
        "positions": c.positions.tolist(),
        "block_tables": [t.tolist() for t in c.block_tables],
        "slot_mappings": c.slot_mappings.tolist(),
        "row_indices": batch.row_indices.tolist(),
        "sizes": (c.num_reqs, c.num_tokens, c.max_query_len, c.max_seq_len),
        "host_block_ids": c.host_block_ids,
    }


def test_translator_outputs_equal_the_cpu_plugin() -> None:
    cuda, cpu = harness(InterpretedCudaPlatform()), harness(CpuPlatform())
    assert type(cuda.block_tables) is TritonBlockTables and type(cpu.block_tables) is TorchBlockTables
    for rows in (DENOISE, DENOISE[1:], DENOISE):
        assert common_values(cuda.translator.prepare(rows)) == common_values(cpu.translator.prepare(rows))


class HooklessBlockTables:
    """A BlockTables without ``prepare_batch`` (vLLM's and vllm-ascend's adapters)."""

    def __init__(self, inner: BlockTables) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "prepare_batch":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_block_tables_without_the_hook_take_the_torch_default() -> None:
    h = harness(InterpretedCudaPlatform())
    want = common_values(h.translator.prepare(DENOISE))
    h.translator.block_tables = HooklessBlockTables(h.block_tables)
    assert common_values(h.translator.prepare(DENOISE)) == want


def test_a_new_preparation_makes_the_older_batch_stale() -> None:
    h = harness(InterpretedCudaPlatform())
    old = h.translator.prepare(DENOISE)
    new = h.translator.prepare(DENOISE[:1])
    assert old.common.positions.data_ptr() == new.common.positions.data_ptr()  # reused in place
    with pytest.raises(StaleBatchError), h.translator.activate(old):
        pass
    with h.translator.activate(new):
        pass


def test_torch_default_matches_the_method() -> None:
    _, ref = tables()
    ref.append_block_ids(1, ([7, 2],), overwrite=True)
    ref.apply_staged_writes()
    host = host_batch([5, 3], [21, 3], [1, 0], [16, 0])
    assert_same(prepare_batch_torch(ref, host, torch.device("cpu")), ref.prepare_batch(host))


@pytest.mark.parametrize(
    "kw", [v for k, v in LAYOUTS.items() if "dcp" not in k], ids=[k for k in LAYOUTS if "dcp" not in k]
)
@pytest.mark.parametrize("seed", [3, 4])
def test_the_host_path_matches_the_torch_default_on_random_layouts(kw: dict[str, Any], seed: int) -> None:
    """The CPU tables' NumPy path (``_prepare_batch_host``) against the pure-torch default, on
    the same tables: padding rows, kernel blocks, two groups, int32 slots, positions past a
    row's installed blocks, stale ids past a row's count."""
    rng = random.Random(seed)
    _, ref = tables(**kw)
    install_random((ref,), rng)
    for _ in range(6):
        host = random_batch(rng, ref.max_num_reqs, ref.max_num_batched_tokens)
        assert_same(ref.prepare_batch(host), prepare_batch_torch(ref, host, torch.device("cpu")))


# --- the cuda backend's per-shape plans -------------------------------------------------------


def test_tile_schedule_is_made_once_per_batch_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BACKEND, "cuda:triton")
    monkeypatch.setattr(cuda_backend, "PLAN_CACHE_SIZE", 2)
    h = harness(InterpretedCudaPlatform())
    layer = h.layer_names[0]

    def schedule(rows: tuple[PagedRow, ...]) -> torch.Tensor:
        md = h.translator.prepare(rows).attn_metadata[layer]
        assert md.way.value == "triton" and md.tile_row is not None
        tile_row: torch.Tensor = md.tile_row
        return tile_row

    first = schedule(DENOISE)
    assert schedule(DENOISE) is first  # the same device tensor: no new copy
    other = schedule(DENOISE[:2])
    assert other is not first and schedule(DENOISE[:2]) is other
    schedule(DENOISE[1:])  # a third shape drops the oldest plan
    again = schedule(DENOISE)
    assert again is not first and torch.equal(again, first)

"""``Translator.prepare`` on a GPU: the fused Triton kernel's outputs equal the core's torch
implementation, and a single-group prepare launches one kernel and one host-to-device copy.
Skipped without CUDA (see conftest)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from diffusion_kv.bench.host import _kernel_launches, _runner
from diffusion_kv.core.block_tables import DeviceBatch, TorchBlockTables
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.translate import resolve_device
from diffusion_kv.platforms.cuda.block_tables import TritonBlockTables
from diffusion_kv.platforms.interface import ENV_BACKEND
from diffusion_kv.platforms.selection import get_platform
from tests.unit.test_prepare_batch import LAYOUTS, host_batch, install_random, random_batch


def _on_cpu(batch: DeviceBatch) -> list[Any]:
    return [[t.cpu() for t in part] if isinstance(part, tuple) else part.cpu() for part in batch]


@pytest.mark.parametrize("kw", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_fused_kernel_matches_torch_on_random_layouts(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = dict(
        block_sizes=[16], max_num_reqs=6, max_num_batched_tokens=400, max_num_blocks_per_group=[8]
    )
    args.update(kw)
    tri = TritonBlockTables(**args, device="cuda")
    ref = TorchBlockTables(**args, device="cpu")
    rng = random.Random(0)
    install_random((ref, tri), rng)
    for _ in range(8):
        host = random_batch(rng, ref.max_num_reqs, ref.max_num_batched_tokens)
        got, want = _on_cpu(tri.prepare_batch(host)), _on_cpu(ref.prepare_batch(host))
        for name, a, b in zip(DeviceBatch._fields, got, want, strict=True):
            for x, y in zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]:
                assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("backend", ["paged", "triton", "sdpa"])
@pytest.mark.parametrize("rows", [2, 64])
def test_prepare_equals_torch_and_launches_one_kernel(
    rows: int, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_BACKEND, f"cuda:{backend}")
    platform = get_platform("cuda")
    device = resolve_device(platform.device())
    tokens, target = 4096, 1024
    runner = _runner(platform, rows, tokens, target, platform.default_block_size, device, torch.bfloat16)
    translator = runner.translator
    assert translator is not None
    bt = translator.block_tables
    assert isinstance(bt, TritonBlockTables)
    denoise = tuple(PagedRow("host", target, tokens, tokens - target, sequence_id=i) for i in range(rows))
    batch = translator.prepare(denoise)
    common = batch.common
    row_indices = batch.row_indices.tolist()
    host = host_batch([target] * rows, [tokens] * rows, row_indices, [tokens - target] * rows)
    # the torch implementation on the same device tables
    qsl = torch.tensor([target * i for i in range(rows + 1)], dtype=torch.int32, device=device)
    idx = torch.tensor(row_indices, dtype=torch.int32, device=device)
    positions = torch.arange(tokens - target, tokens, device=device).repeat(rows)
    want_tables = TorchBlockTables.gather_block_tables(bt, idx, rows)
    want_slots = TorchBlockTables.compute_slot_mappings(bt, idx, qsl, positions, rows * target)
    assert torch.equal(common.query_start_loc, qsl)
    assert common.seq_lens.tolist() == [tokens] * rows
    assert torch.equal(common.positions, positions)
    assert torch.equal(common.slot_mappings, want_slots)
    assert all(torch.equal(a, b) for a, b in zip(common.block_tables, want_tables, strict=True))
    assert host.num_tokens == common.num_tokens
    for _ in range(3):  # warm: the kernel is compiled and the batch shape's plan is cached
        translator.prepare(denoise)
    launches = _kernel_launches(lambda: translator.prepare(denoise), device)
    assert launches["kernels_total"] == 1 and launches["copies"] == 1, launches
    runner.remove(["host"])


def test_a_repeated_batch_shape_replays_its_captured_prepare_with_new_contents() -> None:
    """The second preparation of a shape captures the copy and launches as a CUDA graph; later
    ones replay it. Every preparation, eager, capturing or replayed, equals the torch
    implementation on its own rows and offsets (the graph's copy reads the host buffer at replay)."""
    args: dict[str, Any] = dict(
        block_sizes=[16], max_num_reqs=6, max_num_batched_tokens=400, max_num_blocks_per_group=[8]
    )
    tri = TritonBlockTables(**args, device="cuda")
    ref = TorchBlockTables(**args, device="cpu")
    rng = random.Random(3)
    install_random((ref, tri), rng)
    lens = [40, 25, 7]
    for i in range(6):
        rows = rng.sample(range(6), 3)
        starts = [rng.randint(0, 60) for _ in lens]
        host = host_batch(lens, [s + n + 3 for s, n in zip(starts, lens, strict=True)], rows, starts)
        got, want = _on_cpu(tri.prepare_batch(host)), _on_cpu(ref.prepare_batch(host))
        for name, a, b in zip(DeviceBatch._fields, got, want, strict=True):
            for x, y in zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]:
                assert x.dtype == y.dtype and torch.equal(x, y), (i, name)
    buffers = tri._buffers
    assert buffers is not None and len(buffers.graphs) == 1  # one shape, captured once

"""Shared inputs, the single-process reference, and the per-rank scenarios of the parallel tests.

Every scenario runs two steps (step 0: prefill of the whole ``[prefix | target]`` row; step 1:
the target only, over the cached prefix) through three paged layers: causal, full, and
piecewise (causal with the target as one bidirectional span). The reference runs the same
steps in one process with no parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from diffusion_kv.core.allocation import ContextAllocation, RequestAllocation, SequenceAllocation
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.parallel import (
    RankGroup,
    SequencePadding,
    UlyssesParallel,
    build_parallel_groups,
    gather_cfg_branches,
    verify_replicated,
)
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, ParallelConfig, RunnerConfig
from diffusion_kv.core.translate import dcp_local_seq_lens
from diffusion_kv.platforms.cpu import CpuPlatform

H, HKV, D = 8, 4, 8
BLOCK = 4
P, T = 15, 7
S = P + T
B = 2
NUM_BLOCKS = 32
LAYERS = {"causal": AttentionMode.CAUSAL, "full": AttentionMode.FULL, "piecewise": AttentionMode.CAUSAL}
SPANS = AttentionMetadata(full_attn_spans=[[(P, S)]] * B)

Attend = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for step, length in ((0, S), (1, T)):
        out[f"q{step}"] = torch.randn(B, length, H, D, generator=g)
        out[f"k{step}"] = torch.randn(B, length, HKV, D, generator=g)
        out[f"v{step}"] = torch.randn(B, length, HKV, D, generator=g)
    return out


def make_runner(**config: Any) -> PagedWorker:
    merger = config.pop("dcp_merger", None)
    base: dict[str, Any] = dict(
        max_model_len=64, max_rows_per_request=3, max_num_seqs=2, max_num_batched_tokens=256
    )
    base.update(config)
    runner = PagedWorker(CpuPlatform(), RunnerConfig(**base), dcp_merger=merger)
    runner.register_kv_cache_layers(
        {name: PagedLayerSpec(H, HKV, D, torch.float32, mode=mode) for name, mode in LAYERS.items()}
    )
    runner.initialize_kv_cache(num_blocks=NUM_BLOCKS, block_size=BLOCK)
    return runner


def snapshot(
    cp_size: int = 1, rid: str = "r", generation: int = 1, num_seqs: int = B, first_block: int = 0
) -> RequestAllocation:
    """``num_seqs`` sequences of ``S`` tokens; block ids handed out in descending order."""
    per_row = cdiv(S, BLOCK * cp_size)
    sequences = []
    for i in range(num_seqs):
        start = first_block + i * per_row
        ids = tuple(range(start + per_row - 1, start - 1, -1))
        sequences.append(SequenceAllocation(i, P, T, S, (ids, ids)))
    return RequestAllocation(rid, generation, tuple(sequences))


def phases(rid: str = "r", num_seqs: int = B) -> PhaseRows:
    return PhaseRows(
        tuple(PagedRow(rid, S, S, 0, sequence_id=i) for i in range(num_seqs)),
        tuple(PagedRow(rid, T, S, P, sequence_id=i) for i in range(num_seqs)),
    )


def run_steps(
    runner: PagedWorker, attend: Attend, rows: slice = slice(None), seed: int = 0
) -> tuple[dict[str, torch.Tensor], list[list[Any]]]:
    """Outputs ``{"layer/step": out}`` and the identities of each step's prepared rows."""
    data = inputs(seed)
    outputs: dict[str, torch.Tensor] = {}
    identities: list[list[Any]] = []
    with torch.no_grad(), runner.activate(phases()) as runtime:
        for step in (0, 1):
            batch = runtime.ensure_active(step)
            identities.append([r.identity for r in batch.rows])
            q, k, v = (data[f"{name}{step}"][rows] for name in "qkv")
            for layer in LAYERS:
                md = SPANS if layer == "piecewise" else None
                if md is not None and q.shape[0] != B:
                    md = AttentionMetadata(full_attn_spans=[[(P, S)]] * q.shape[0])
                outputs[f"{layer}/{step}"] = attend(layer, q, k, v, md)
    return outputs, identities


def reference() -> dict[str, torch.Tensor]:
    """The single-process, single-rank result of every layer and step."""
    runner = make_runner()
    runner.install(snapshot())
    return run_steps(runner, runner.forward)[0]


# --------------------------------------------------------------------------------------------
# per-rank scenarios (run inside the spawned processes)
# --------------------------------------------------------------------------------------------


def ulysses_scenario(rank: int, world: int) -> dict[str, Any]:
    uly = UlyssesParallel(RankGroup.of(None))
    runner = make_runner(parallel=ParallelConfig(ulysses_degree=world))
    runner.install(snapshot())
    pad_regions: list[float] = []

    def attend(layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: Any) -> torch.Tensor:
        length = q.shape[1]
        padding = SequencePadding.rear(length, world)
        per_rank = (length + padding.length) // world

        def shard(x: torch.Tensor) -> torch.Tensor:
            # garbage in the padding: it must never reach the pages or the output
            garbage = torch.full((x.shape[0], padding.length, *x.shape[2:]), 1e3)
            return torch.cat([x, garbage], dim=1)[:, rank * per_rank : (rank + 1) * per_rank]

        out = uly.attention(runner.forward, layer, shard(q), shard(k), shard(v), md, padding=padding)
        full = uly.gather_sequence(out)
        pad_regions.append(float(full[:, length:].abs().max()) if padding.length else 0.0)
        return full[:, :length]

    outputs, _ = run_steps(runner, attend)
    rows = runner.registry.rows if runner.registry is not None else {}
    verify_replicated(rows, RankGroup.of(None), "Ulysses worker rows")
    geom = runner.layers["causal"]
    cache = runner.kv_caches["causal"]
    assert isinstance(cache, torch.Tensor)
    return {
        "outputs": outputs,
        "pad_max": max(pad_regions),
        "local_heads": (geom.num_heads, geom.num_kv_heads),
        "cache_shape": tuple(cache.shape),
        "rows": rows,
    }


def dcp_scenario(rank: int, world: int, interleave: int) -> dict[str, Any]:
    runner = make_runner(cp_size=world, cp_rank=rank, cp_interleave=interleave)
    snap = snapshot(cp_size=world)
    runner.install(snap)
    outputs, _ = run_steps(runner, runner.forward)
    # what this rank wrote at step 0: exactly its interleave slots of every row
    cache = runner.kv_caches["full"]
    assert isinstance(cache, torch.Tensor)
    written = []
    for seq in snap.sequences:
        blocks = torch.tensor(seq.block_ids[0], dtype=torch.long)
        keys = cache[0].index_select(0, blocks).reshape(-1, HKV, D)
        written.append(int((keys.abs().sum(dim=(1, 2)) > 0).sum()))
    expected = dcp_local_seq_lens(torch.tensor([S] * B), world, rank, interleave).tolist()
    rows = runner.registry.rows if runner.registry is not None else {}
    verify_replicated(rows, RankGroup.of(None), "DCP worker rows")
    return {"outputs": outputs, "written": written, "expected_local": expected, "rows": rows}


def cfg_scenario(rank: int, world: int) -> dict[str, Any]:
    group = RankGroup.of(None)
    runner = make_runner(cfg_parallel_size=world, cfg_parallel_rank=rank)
    registry = runner.registry
    assert registry is not None and runner.block_tables is not None
    before = (registry.rows, registry.free_rows, runner.block_tables.num_blocks.cpu.clone())
    error = None
    try:
        runner.install(snapshot(num_seqs=world + 1))
    except ValidationError as exc:
        error = str(exc)
    after = (registry.rows, registry.free_rows, runner.block_tables.num_blocks.cpu.clone())
    unchanged = before[:2] == after[:2] and torch.equal(before[2], after[2])

    # a context used by branch 0 only is installed on rank 0 only
    base = snapshot(num_seqs=world)
    ctx = ContextAllocation("ref", "image", 4, ((NUM_BLOCKS - 1,), (NUM_BLOCKS - 1,)))
    seqs = list(base.sequences)
    seqs[0] = SequenceAllocation(0, P, T, S, seqs[0].block_ids, context_ids=("ref",))
    with_ctx = RequestAllocation("r", 1, tuple(seqs), (ctx,))
    installed = runner.install(with_ctx)
    rows = registry.rows
    outputs, identities = run_steps(runner, runner.forward, rows=slice(rank, rank + 1))
    gathered = {key: gather_cfg_branches(out, group) for key, out in outputs.items()}
    again = runner.install(with_ctx)  # same generation and snapshot: a no-op
    return {
        "error": error,
        "unchanged": unchanged,
        "installed": installed,
        "again": again,
        "rows": rows,
        "identities": identities,
        "outputs": outputs,
        "gathered": gathered,
    }


def cfg_ulysses_scenario(rank: int, world: int) -> dict[str, Any]:
    """World 4 = CFG-parallel 2 x Ulysses 2, groups built by build_parallel_groups."""
    groups = build_parallel_groups(world // 2, 2)
    uly = UlyssesParallel(groups.ulysses)
    runner = make_runner(
        parallel=ParallelConfig(ulysses_degree=groups.ulysses.size),
        cfg_parallel_size=groups.cfg.size,
        cfg_parallel_rank=groups.cfg.rank,
    )
    runner.install(snapshot())
    degree, sp_rank = groups.ulysses.size, groups.ulysses.rank

    def attend(layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: Any) -> torch.Tensor:
        length = q.shape[1]
        padding = SequencePadding.rear(length, degree)
        per_rank = (length + padding.length) // degree

        def shard(x: torch.Tensor) -> torch.Tensor:
            x = torch.cat([x, torch.zeros((x.shape[0], padding.length, *x.shape[2:]))], dim=1)
            return x[:, sp_rank * per_rank : (sp_rank + 1) * per_rank]

        out = uly.attention(runner.forward, layer, shard(q), shard(k), shard(v), md, padding=padding)
        return gather_cfg_branches(uly.gather_sequence(out)[:, :length], groups.cfg)

    branch = slice(groups.cfg.rank, groups.cfg.rank + 1)
    outputs, identities = run_steps(runner, attend, rows=branch)
    return {
        "outputs": outputs,
        "identities": identities,
        "cfg": (groups.cfg.size, groups.cfg.rank),
        "ulysses": (groups.ulysses.size, groups.ulysses.rank),
    }


def row_policy_scenario(rank: int, world: int) -> dict[str, Any]:
    """The same install/remove history lands in the same rows everywhere; a divergence is caught."""
    group = RankGroup.of(None)
    runner = make_runner(max_num_seqs=3)
    history = []
    runner.install(snapshot(rid="a", first_block=0))
    runner.install(snapshot(rid="b", num_seqs=1, first_block=12))
    history.append(runner.registry.rows if runner.registry else {})
    runner.remove(["a"])
    runner.install(snapshot(rid="c", first_block=0))
    runner.install(snapshot(rid="d", num_seqs=1, first_block=18))
    history.append(runner.registry.rows if runner.registry else {})
    verify_replicated(history, group, "worker rows")
    diverged = None
    runner.remove(["c"])
    if rank == world - 1:  # one rank sees an extra request first
        runner.install(snapshot(rid="x", num_seqs=1, first_block=24))
    runner.install(snapshot(rid="e", first_block=0))
    try:
        verify_replicated(runner.registry.rows if runner.registry else {}, group, "worker rows")
    except StateError as exc:
        diverged = str(exc)
    return {"history": history, "diverged": diverged}


def worker(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {
        "ulysses": ulysses_scenario(rank, world),
        "dcp": {i: dcp_scenario(rank, world, i) for i in (1, 2)},
        "rows": row_policy_scenario(rank, world),
    }
    try:
        build_parallel_groups(world * 2, 1)
    except ValidationError as exc:
        results["groups_error"] = str(exc)
    if world == 2:
        results["cfg"] = cfg_scenario(rank, world)
    if world == 4:
        results["cfg_ulysses"] = cfg_ulysses_scenario(rank, world)
    dist.barrier()
    return results

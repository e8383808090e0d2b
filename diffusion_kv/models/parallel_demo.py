"""The demo across ranks: strict Ulysses, CFG-parallel and DCP on torch.distributed.

Launched with ``torchrun`` (one process per device): the world is split into CFG-parallel
groups of 2 (with ``cfg_parallel``) and Ulysses groups of ``ulysses`` ranks
(rank = cfg_rank * ulysses + ulysses_rank); or, with decode context parallelism (``dcp``), the
whole world is one DCP group: every rank runs every token and holds the keys of its interleave
slots, and the partial attentions are merged by log-sum-exp across the group. Every rank

* computes the dense reference on its own (the whole model on one device), then
* runs the paged model on its share: the rows of its CFG branch, a shard of the sequence, and
  ``heads / ulysses`` heads inside each paged attention call (the all-to-all of
  :class:`~diffusion_kv.core.parallel.UlyssesParallel`, with the padding to a multiple of the
  degree stripped before the paged call);
* gathers the sequence and the CFG branches, combines them, and compares with the dense run.

The largest difference over all ranks decides agreement, so every rank reaches the same verdict.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from diffusion_kv.core.allocator import DiffusionKVAllocator, FreeListPool, KVRequest, SequenceRequest
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.parallel import (
    DCPMerger,
    ParallelGroups,
    RankGroup,
    SequencePadding,
    UlyssesParallel,
    gather_cfg_branches,
)
from diffusion_kv.core.rows import PagedRow, PhaseRows
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, ParallelConfig, RunnerConfig
from diffusion_kv.core.translate import dcp_local_seq_lens
from diffusion_kv.models.demo import (
    DemoConfig,
    DemoResult,
    Progress,
    _combine,
    _inputs,
    _sync,
    build_model,
    make_result,
    max_difference,
    run_dense,
)
from diffusion_kv.models.tiny_dit import TinyDiT
from diffusion_kv.platforms.interface import Platform


def check_parallel_config(
    cfg: DemoConfig, ulysses: int, cfg_parallel: bool, dcp: int = 1, dcp_interleave: int = 1, block: int = 0
) -> None:
    """Every reason the demo cannot run this split, before any process group is touched
    (``block``: the KV block size, checked against ``dcp_interleave`` when given)."""
    if type(ulysses) is not int or ulysses <= 0:
        raise ValidationError(f"--ulysses must be a positive integer; got {ulysses!r}")
    for name, value in (("--dcp", dcp), ("--dcp-interleave", dcp_interleave)):
        if type(value) is not int or value <= 0:
            raise ValidationError(f"{name} must be a positive integer; got {value!r}")
    if dcp > 1 and (ulysses > 1 or cfg_parallel):
        raise ValidationError("the demo runs --dcp on its own; drop --ulysses/--cfg-parallel")
    if dcp > 1 and block and block % dcp_interleave:
        raise ValidationError(f"--dcp-interleave {dcp_interleave} must divide the block size {block}")
    if cfg_parallel and cfg.cfg_rows != 2:
        raise ValidationError(f"--cfg-parallel needs 2 CFG rows (one per rank); got --cfg {cfg.cfg_rows}")
    if cfg.heads % ulysses or cfg.kv_heads % ulysses:
        raise ValidationError(
            f"heads={cfg.heads} and kv_heads={cfg.kv_heads} must be divisible by --ulysses {ulysses}"
        )


def _shard(x: torch.Tensor, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s sequence shard of ``x [B, L, ...]`` padded with zeros to a multiple of degree."""
    pad = (-x.shape[1]) % degree
    if pad:
        x = F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad))
    per_rank = x.shape[1] // degree
    return x[:, rank * per_rank : (rank + 1) * per_rank]


def run_paged_parallel(
    model: TinyDiT,
    cfg: DemoConfig,
    platform: Platform,
    groups: ParallelGroups,
    device: torch.device,
    progress: Progress,
    dcp: RankGroup | None = None,
    dcp_interleave: int = 1,
) -> tuple[torch.Tensor, list[float], dict[str, Any]]:
    uly = UlyssesParallel(groups.ulysses)
    cfg_group = groups.cfg
    degree, sp_rank = uly.degree, groups.ulysses.rank
    dcp = dcp or RankGroup.single()
    block = cfg.block_size or platform.default_block_size
    seq_len = cfg.prefix_len + cfg.target_len
    rows = cfg.cfg_rows
    # Under DCP one scheduler block id covers ``block`` tokens on each rank.
    num_blocks = rows * cdiv(seq_len, block * dcp.size) + 1
    runner = PagedWorker(
        platform,
        RunnerConfig(
            max_model_len=cfg.max_model_len,
            max_rows_per_request=rows,
            max_num_seqs=1,
            max_num_batched_tokens=rows * seq_len,
            device=device,
            backend=cfg.backend,
            parallel=ParallelConfig(ulysses_degree=degree),
            cfg_parallel_size=cfg_group.size,
            cfg_parallel_rank=cfg_group.rank,
            cp_size=dcp.size,
            cp_rank=dcp.rank,
            cp_interleave=dcp_interleave,
        ),
        dcp_merger=DCPMerger(dcp) if dcp.size > 1 else None,
    )
    mc = model.cfg
    geometry = runner.register_kv_cache_layers(
        {name: PagedLayerSpec(mc.heads, mc.kv_heads, mc.head_size, mc.dtype) for name in model.layer_names}
    )
    runner.initialize_kv_cache(num_blocks=num_blocks, block_size=block)
    # The scheduler side is replicated: every rank reserves the same blocks for every CFG row.
    allocator = DiffusionKVAllocator(
        block_size=block * dcp.size,
        max_model_len=cfg.max_model_len,
        max_rows_per_request=rows,
        worker_rows=rows,
        pool=FreeListPool(num_blocks),
    )
    snapshot = allocator.reserve(
        KVRequest("demo", tuple(SequenceRequest(i, cfg.prefix_len, cfg.target_len) for i in range(rows)))
    )
    if snapshot is None:  # pragma: no cover - the pool is sized for the request
        raise RuntimeError("the demo's block pool cannot hold the request")
    prefixes, latent = _inputs(cfg, device)
    branch = slice(cfg_group.rank, cfg_group.rank + 1) if cfg_group.size > 1 else slice(0, rows)
    my_prefixes = prefixes[branch]
    my_rows = my_prefixes.shape[0]
    phases = PhaseRows(
        tuple(PagedRow("demo", seq_len, seq_len, 0, sequence_id=i) for i in range(rows)),
        tuple(PagedRow("demo", cfg.target_len, seq_len, cfg.prefix_len, sequence_id=i) for i in range(rows)),
    )
    times: list[float] = []
    dt = 1.0 / cfg.steps
    try:
        runner.install(snapshot)
        with torch.no_grad(), runner.activate(phases) as runtime:
            for step in range(cfg.steps):
                t0 = time.perf_counter()
                runtime.ensure_active(step)
                target = latent.expand(my_rows, -1, -1)
                x, positions, spans = model.paged_inputs(my_prefixes, target, 1.0 - step * dt, step)
                length = x.shape[1]
                padding = SequencePadding.rear(length, degree)
                x_local = _shard(x, degree, sp_rank)
                pos_local = _shard(positions[None, :, None], degree, sp_rank)[0, :, 0]

                def attention(
                    name: str,
                    q: torch.Tensor,
                    k: torch.Tensor,
                    v: torch.Tensor,
                    _spans: Any = spans,
                    _padding: SequencePadding = padding,
                ) -> torch.Tensor:
                    return uly.attention(runner.forward, name, q, k, v, _spans, padding=_padding)

                local = model.run(x_local, pos_local, attention, x_local.shape[1])
                tokens = uly.gather_sequence(local)[:, :length]
                velocity = gather_cfg_branches(tokens[:, -cfg.target_len :], cfg_group)
                latent = latent - dt * _combine(cfg, velocity)
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
                progress("paged", step + 1, cfg.steps)
        rows_here = runner.registry.rows if runner.registry is not None else {}
    finally:
        runner.remove(["demo"])
        allocator.free("demo")
    installed = [s for s in snapshot.sequences if ("demo", s.sequence_id, None) in rows_here]
    # tokens this rank holds per row (its interleave slots under DCP)
    local_len = int(dcp_local_seq_lens(torch.tensor([seq_len]), dcp.size, dcp.rank, dcp_interleave)[0])
    blocks_used = sum(len(s.block_ids[0]) for s in installed)
    any_geom = next(iter(geometry.values()))
    info = {
        "block_size": block,
        "blocks_used": blocks_used,
        "kv_bytes_paged": blocks_used * runner.kv_bytes_per_block(),
        "tokens": len(installed) * local_len,
        "rank_local_heads": any_geom.num_heads,
        "rank_local_kv_heads": any_geom.num_kv_heads,
        "worker_rows": {f"{rid}/{sid}": row for (rid, sid, _), row in rows_here.items()},
        "backends": sorted({b.name for b in runner.backends}),
    }
    return latent, times, info


def run_parallel_demo(
    platform: Platform,
    cfg: DemoConfig,
    groups: ParallelGroups,
    device: torch.device,
    progress: Progress | None = None,
    dcp: RankGroup | None = None,
    dcp_interleave: int = 1,
) -> DemoResult:
    """Dense on every rank, paged across ranks; agreement is decided on the largest difference.

    ``dcp``: the decode-context-parallel group (the world, with single Ulysses and CFG groups)."""
    dcp_size = dcp.size if dcp is not None else 1
    block = cfg.block_size or platform.default_block_size
    check_parallel_config(cfg, groups.ulysses.size, groups.cfg.size > 1, dcp_size, dcp_interleave, block)
    progress = progress or (lambda _mode, _i, _n: None)
    model = build_model(cfg, device)
    dense_out, dense_ms = run_dense(model, cfg, device, progress)
    paged_out, paged_ms, info = run_paged_parallel(
        model, cfg, platform, groups, device, progress, dcp, dcp_interleave
    )
    worst = max_difference(dense_out, paged_out).to(device)
    if groups.world.size > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=groups.world.group)
    return make_result(
        platform,
        cfg,
        device,
        float(worst.item()),
        dense_ms,
        paged_ms,
        info,
        {
            "parallel": {
                "world_size": groups.world.size,
                "rank": groups.world.rank,
                "ulysses_degree": groups.ulysses.size,
                "cfg_parallel_size": groups.cfg.size,
                "dcp_size": dcp_size,
                "dcp_interleave": dcp_interleave,
                "paged_backends": info["backends"],
                "rank_local_heads": info["rank_local_heads"],
                "rank_local_kv_heads": info["rank_local_kv_heads"],
                "worker_rows": info["worker_rows"],
                "backend": dist.get_backend() if dist.is_initialized() else None,
            }
        },
    )

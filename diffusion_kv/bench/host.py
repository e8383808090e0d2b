"""Translation host overhead: prepare time, per-layer context time, launches of gather + slots."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch

from diffusion_kv.bench.timing import synchronize, time_host
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.interface import Platform

LAYER = "bench.host"


def _runner(
    platform: Platform,
    rows: int,
    tokens: int,
    target: int,
    block: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: str | None = None,
) -> PagedWorker:
    """Rows whose prefix is declared a prefix-cache hit (``cached_prefix_len``): the bench times
    translation only, so no K/V is computed, and the denoise rows may read the prefix pages."""
    prefix = tokens - target
    if prefix % block:
        raise ValueError(f"host bench: prefix {prefix} must be a multiple of the block size {block}")
    runner = PagedWorker(
        platform,
        RunnerConfig(
            max_model_len=tokens,
            max_rows_per_request=rows,
            max_num_seqs=1,
            max_num_batched_tokens=rows * tokens,
            device=device,
            backend=backend,
        ),
    )
    runner.register_kv_cache_layers({LAYER: PagedLayerSpec(8, 8, 128, dtype)})
    nblk = cdiv(tokens, block)
    runner.initialize_kv_cache(num_blocks=rows * nblk + 1, block_size=block)
    order = torch.randperm(rows * nblk + 1, generator=torch.Generator().manual_seed(0)).tolist()
    seqs = tuple(
        SequenceAllocation(
            i, prefix, target, tokens, (tuple(order[i * nblk : (i + 1) * nblk]),), cached_prefix_len=prefix
        )
        for i in range(rows)
    )
    runner.install(RequestAllocation("host", 0, seqs))
    return runner


def _kernel_launches(fn: Any, device: torch.device) -> dict[str, Any]:
    """Device kernels launched by ``fn`` (CUDA only), by name, via the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    names: Counter[str] = Counter()
    copies = 0
    for ev in prof.events():
        if str(ev.device_type) != "DeviceType.CUDA":
            continue
        if "memcpy" in ev.name.lower() or "memset" in ev.name.lower():
            copies += 1
        else:
            names[ev.name] += 1
    gather_slots = sum(n for name, n in names.items() if "gather" in name or "slot" in name)
    return {
        "kernels": dict(names),
        "kernels_total": sum(names.values()),
        "copies": copies,
        "gather_slots": gather_slots,
    }


def host_overhead(
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    *,
    rows_list: tuple[int, ...] = (2, 64),
    tokens: int = 4096,
    block: int | None = None,
    iters: int = 200,
    backend: str | None = None,
    count_launches: bool = True,
) -> list[dict[str, Any]]:
    """Per row count: median prepare microseconds, median per-layer context microseconds, and
    (on CUDA, with ``count_launches``) the kernels prepare launches. Rows of ``tokens`` keys
    each; the denoise query is the last quarter of each row.

    Every timing runs before any launch count: counting uses the torch profiler, whose CUPTI
    subscription outlives the profiler on the CUDA builds measured (each later kernel launch of
    the process costs a few microseconds more; the eager end-to-end step measured 8.97 ms after
    it against 3.72 ms without, H100, 2026-12-06). :func:`count_prepare_launches` adds the
    counts afterwards; ``bench`` calls it once every timed section has run."""
    block = block or platform.default_block_size
    entries = [_measure(platform, device, dtype, rows, tokens, block, iters, backend) for rows in rows_list]
    if count_launches:
        count_prepare_launches(platform, device, dtype, entries, backend=backend)
    return entries


def count_prepare_launches(
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    entries: list[dict[str, Any]],
    *,
    backend: str | None = None,
) -> None:
    """Set each :func:`host_overhead` entry's ``launches``: the kernels one prepare of its rows
    launches, by name, through the torch profiler on CUDA; ``None`` elsewhere. Run it after
    every timing of the process (see :func:`host_overhead`)."""
    for entry in entries:
        if device.type != "cuda":
            entry["launches"] = None
            continue
        rows, tokens, block = entry["rows"], entry["tokens_per_row"], entry["block_size"]
        target = tokens // 4
        runner = _runner(platform, rows, tokens, target, block, device, dtype, backend)
        translator = runner.translator
        assert translator is not None
        denoise = _denoise_rows(rows, tokens, target)
        try:
            translator.prepare(denoise)  # warm, as the timed prepares were
            entry["launches"] = _kernel_launches(functools.partial(translator.prepare, denoise), device)
        finally:
            runner.remove(["host"])


def _denoise_rows(rows: int, tokens: int, target: int) -> tuple[PagedRow, ...]:
    return tuple(PagedRow("host", target, tokens, tokens - target, sequence_id=i) for i in range(rows))


def _measure(
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    tokens: int,
    block: int,
    iters: int,
    backend: str | None = None,
) -> dict[str, Any]:
    target = tokens // 4
    runner = _runner(platform, rows, tokens, target, block, device, dtype, backend)
    translator, executor = runner.translator, runner.executor
    assert translator is not None and executor is not None
    denoise = _denoise_rows(rows, tokens, target)
    prepare_us = time_host(lambda: translator.prepare(denoise), iters=iters)
    synchronize(device)
    entry: dict[str, Any] = {
        "rows": rows,
        "tokens_per_row": tokens,
        "query_tokens": rows * target,
        "block_size": block,
        "prepare_us": prepare_us,
    }
    q = torch.zeros(rows * target, 8, 128, dtype=dtype, device=device)
    batch = translator.prepare(denoise)
    with translator.activate(batch):
        entry["layer_context_us"] = time_host(lambda: executor.context(LAYER, q, q, q), iters=iters)
    synchronize(device)
    entry["launches"] = None  # counted by count_prepare_launches, after every timing
    runner.remove(["host"])
    return entry

"""Run a function on N local processes joined by a gloo process group (CPU, localhost).

``run_ranks(fn, world_size, out_dir)`` spawns ``world_size`` processes; each initialises
``torch.distributed`` with the gloo backend on a free localhost port, calls ``fn(rank,
world_size)`` and saves the returned (picklable) value; the results come back in rank order.
A failing rank fails the whole run (``torch.multiprocessing.spawn`` stops the others).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[[int, int], Any], out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world_size)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(fn: Callable[[int, int], Any], world_size: int, out_dir: Path) -> list[Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(world_size, free_port(), fn, str(out_dir)), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]

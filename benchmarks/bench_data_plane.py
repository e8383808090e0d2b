"""Micro-benchmark of the core data plane on the CPU.

Reports install+remove cycles per second through the row registry and slot-mapping (plus
block-table gather) time for 2 and 64 rows at 4k tokens per row.

    python benchmarks/bench_data_plane.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.layout import cdiv, single_group_layout
from diffusion_kv.core.registry import RowRegistry


def _layout(rows: int, tokens: int, block_size: int):  # type: ignore[no-untyped-def]
    return single_group_layout(
        ["l0"],
        num_kv_heads=8,
        head_size=128,
        dtype=torch.float16,
        block_size=block_size,
        num_blocks=rows * cdiv(tokens, block_size) + 1,
        max_model_len=tokens,
        max_rows_per_request=2,
        max_num_seqs=max(1, rows // 2),
        max_num_batched_tokens=rows * tokens,
    )


def _tables(lay) -> TorchBlockTables:  # type: ignore[no-untyped-def]
    return TorchBlockTables(
        block_sizes=lay.block_sizes,
        max_num_reqs=lay.max_num_reqs,
        max_num_batched_tokens=lay.max_num_batched_tokens,
        max_num_blocks_per_group=lay.max_blocks_per_row(),
        device="cpu",
    )


def bench_install_remove(tokens: int = 4096, block_size: int = 16, seconds: float = 1.0) -> dict[str, float]:
    lay = _layout(2, tokens, block_size)
    reg = RowRegistry(lay, _tables(lay))
    nblk = cdiv(tokens, block_size)
    seqs = tuple(
        SequenceAllocation(s, 0, tokens, tokens, (tuple(range(s * nblk, (s + 1) * nblk)),)) for s in range(2)
    )
    snap = RequestAllocation("r", 0, seqs)
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        reg.install(snap)
        reg.remove(["r"])
        n += 1
    elapsed = time.perf_counter() - start
    return {"cycles_per_s": n / elapsed, "us_per_cycle": elapsed / n * 1e6, "rows_per_request": 2}


def bench_slots(rows: int, tokens: int = 4096, block_size: int = 16, repeats: int = 30) -> dict[str, float]:
    lay = _layout(rows, tokens, block_size)
    bt = _tables(lay)
    nblk = cdiv(tokens, block_size)
    perm = torch.randperm(rows * nblk).tolist()  # physically shuffled placement
    for r in range(rows):
        bt.append_block_ids(r, (perm[r * nblk : (r + 1) * nblk],), overwrite=True)
    bt.apply_staged_writes()
    idx = torch.arange(rows, dtype=torch.int32)
    qsl = torch.arange(rows + 1, dtype=torch.int32) * tokens
    positions = torch.arange(tokens).repeat(rows)
    times_slots, times_gather = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bt.compute_slot_mappings(idx, qsl, positions, rows * tokens)
        t1 = time.perf_counter()
        bt.gather_block_tables(idx, rows)
        t2 = time.perf_counter()
        times_slots.append(t1 - t0)
        times_gather.append(t2 - t1)
    return {
        "rows": rows,
        "tokens_per_row": tokens,
        "slot_mapping_median_us": statistics.median(times_slots) * 1e6,
        "gather_median_us": statistics.median(times_gather) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "install_remove": bench_install_remove(),
        "slots": [bench_slots(2), bench_slots(64)],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    ir = result["install_remove"]
    print(f"torch {result['torch']}, {result['threads']} threads, block size 16")
    print(
        f"install+remove (2 rows x 4096 tokens): {ir['cycles_per_s']:.0f} cycles/s ({ir['us_per_cycle']:.1f} us each)"
    )
    for s in result["slots"]:
        print(
            f"slot mapping {s['rows']:>2} rows x {s['tokens_per_row']} tokens: {s['slot_mapping_median_us']:.0f} us "
            f"median; gather {s['gather_median_us']:.0f} us"
        )


if __name__ == "__main__":
    main()

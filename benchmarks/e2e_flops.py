"""The FLOP ceiling of the bench's tiny-DiT end-to-end speedup (dense recompute vs a paged step).

python benchmarks/e2e_flops.py [--sizes full|small] [--json PATH]

The e2e section reports an ideal by token count (a paged step computes the target's tokens of
``prefix + target``). The dense baseline is cheaper than that count says: its prefix queries
attend causally over the prefix alone (one causal SDPA call; kernels skip the masked tiles),
so its attention does about half the prefix's key pairs. This script counts, per step and
layer, the matrix-multiply FLOPs (the layer's linear maps, ``2 * tokens * in * out``) and the
attention FLOPs (``4 * head_size`` per query-key pair and head: ``QK^T`` and ``PV``) of both
steps for the bench's shape, and prints the ratio: the speedup a paged step would reach if
both ran every FLOP at the same rate. The linear-map count is checked against
``torch.utils.flop_counter`` on the model itself (small shape, on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, cast

import torch
from torch.utils.flop_counter import FlopCounterMode

from diffusion_kv.bench.e2e import FULL, SMALL
from diffusion_kv.models.tiny_dit import Block, TinyDiT, TinyDiTConfig


def linear_flops_per_token(cfg: TinyDiTConfig) -> int:
    """``2 * in * out`` summed over a layer's linear maps (qkv, out, the MLP's two)."""
    h, d = cfg.hidden, cfg.head_size
    qkv = h * (cfg.heads + 2 * cfg.kv_heads) * d
    out = h * h
    mlp = 2 * h * cfg.mlp_ratio * h
    return 2 * (qkv + out + mlp)


def step_flops(cfg: TinyDiTConfig, prefix: int, target: int, rows: int) -> dict[str, dict[str, float]]:
    """FLOPs of one layer of the dense and the paged step (``rows`` CFG rows)."""
    per_pair = 4 * cfg.head_size * cfg.heads
    seq = prefix + target
    causal_pairs = prefix * (prefix + 1) // 2  # prefix queries over the prefix, causal
    target_pairs = target * seq  # target queries over every key
    dense = {
        "linear": float(rows * seq * linear_flops_per_token(cfg)),
        "attention": float(rows * (causal_pairs + target_pairs) * per_pair),
    }
    paged = {
        "linear": float(rows * target * linear_flops_per_token(cfg)),
        "attention": float(rows * target_pairs * per_pair),
    }
    return {"dense": dense, "paged": paged}


def check_linear_count(cfg: TinyDiTConfig, tokens: int) -> None:
    """The per-token linear count against torch's FLOP counter on one real layer (CPU)."""
    model = TinyDiT(cfg).eval()
    block = cast(Block, model.blocks[0])
    x = torch.randn(1, tokens, cfg.hidden)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        q, _k, _v = block.pre(x, None)
        block.post(x, q.contiguous())
    counts = counter.get_flop_counts()["Global"]
    counted = sum(int(n) for op, n in counts.items() if "mm" in str(op))
    expected = tokens * linear_flops_per_token(cfg)
    if counted != expected:
        raise SystemExit(f"linear FLOPs: torch counted {counted}, the formula gives {expected}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="full", choices=("full", "small"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shape: dict[str, Any] = dict(FULL if args.sizes == "full" else SMALL)
    cfg = TinyDiTConfig(
        hidden=shape["hidden"], heads=shape["heads"], kv_heads=shape["kv_heads"], layers=shape["layers"]
    )
    check_linear_count(
        TinyDiTConfig(hidden=SMALL["hidden"], heads=SMALL["heads"], kv_heads=SMALL["kv_heads"], layers=1), 16
    )
    rows = 2  # the bench's e2e shape: two CFG rows
    per_layer = step_flops(cfg, shape["prefix_len"], shape["target_len"], rows)
    totals = {k: sum(v.values()) * cfg.layers for k, v in per_layer.items()}
    ratio = totals["dense"] / totals["paged"]
    tokens_ideal = (shape["prefix_len"] + shape["target_len"]) / shape["target_len"]
    print(f"shape {shape}, {rows} CFG rows, mlp_ratio {cfg.mlp_ratio}")
    for name, parts in per_layer.items():
        print(
            f"{name:>5} step, per layer: linear {parts['linear'] / 1e9:.1f} GFLOP, "
            f"attention {parts['attention'] / 1e9:.1f} GFLOP; all layers {totals[name] / 1e9:.1f} GFLOP"
        )
    print(
        f"FLOP ratio dense / paged: {ratio:.2f}x (the token-count ideal the bench prints: {tokens_ideal:.1f}x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "shape": shape,
                    "cfg_rows": rows,
                    "mlp_ratio": cfg.mlp_ratio,
                    "per_layer_flops": per_layer,
                    "step_flops": totals,
                    "flop_ratio": ratio,
                    "token_ratio": tokens_ideal,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

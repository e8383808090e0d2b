"""Sweep the Triton paged-attention kernel's launch parameters on the bench's regime shapes.

Prints, per shape, every configuration's time and the best one next to the best dense SDPA
time measured in the same run; used to set the heuristics in
``diffusion_kv/platforms/cuda/backend.py``. Needs a CUDA device.

    python benchmarks/tune_cuda_paged.py [--regimes A,B] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from typing import Any

import torch

from diffusion_kv.bench.attention import attention_cases, dense_backends, dense_fn
from diffusion_kv.bench.timing import time_device


def _shape(regime: str, kv_grouped: bool, page: int) -> dict[str, int]:
    """The bench's CFG-2 case of ``regime`` (the issue's reference shape) as the sweep's dict."""
    (case,) = attention_cases(
        "full", regimes=(regime,), block_sizes=(page,), cfgs=(2,), gqa=(kv_grouped,), contiguous_regimes=()
    )
    return dict(
        rows=case.rows,
        heads=case.heads,
        kv_heads=case.kv_heads,
        head_size=case.head_size,
        prefix=case.prefix,
        target=case.target,
        page=page,
    )


def sweep(shape: dict[str, int], configs: list[tuple[int, int, int, int, int]]) -> dict[str, Any]:
    from diffusion_kv.platforms.cuda import kernels

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    R, H, Hkv, D = shape["rows"], shape["heads"], shape["kv_heads"], shape["head_size"]
    T, S, page = shape["target"], shape["prefix"] + shape["target"], shape["page"]
    nblk = -(-S // page)
    nb = R * nblk + 1
    k_cache = torch.randn(nb, page, Hkv, D, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(nb)[: R * nblk].view(R, nblk).to(torch.int32).to(dev)
    q = torch.randn(R * T, H, D, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    seq = torch.full((R,), S, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, (R + 1) * T, T, dtype=torch.int32, device=dev)
    group = H // Hkv
    # dense reference inputs (contiguous copies of the same logical K/V)
    k = k_cache[table.long()].reshape(R, nblk * page, Hkv, D)[:, :S].transpose(1, 2)
    v = v_cache[table.long()].reshape(R, nblk * page, Hkv, D)[:, :S].transpose(1, 2)
    dq = q.view(R, T, H, D).transpose(1, 2)
    dense: dict[str, float] = {}
    for name, b in dense_backends(dev):
        for kk, vv, flag, label in (
            (k, v, group > 1, name),
            (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False, name + "+expand"),
        ):
            try:
                fn = dense_fn(b, dq, kk, vv, D**-0.5, flag)
                fn()
                dense[label] = time_device(fn, dev, min_ms=10)
            except RuntimeError:
                pass
            if group == 1:
                break
    best_dense = min(dense.items(), key=lambda kv: kv[1])
    results = []
    for block_m, block_n, warps, stages, splits in configs:
        per_tile = max(block_m // group, 1)
        if block_m < group:
            continue
        rows = [r for r in range(R) for _ in range(0, T, per_tile)]
        q0s = [q0 for _ in range(R) for q0 in range(0, T, per_tile)]
        tr = torch.tensor(rows, dtype=torch.int32, device=dev)
        tq = torch.tensor(q0s, dtype=torch.int32, device=dev)

        run = functools.partial(
            kernels.paged_attention,
            q,
            k_cache,
            v_cache,
            out,
            table,
            seq,
            qsl,
            tr,
            tq,
            scale=D**-0.5,
            causal=False,
            block_m=block_m,
            block_n=block_n,
            num_splits=splits,
            num_warps=warps,
            num_stages=stages,
        )

        try:
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            ms = time_device(run, dev, min_ms=10, reps=3)
        except Exception as exc:  # out of shared memory etc.
            results.append({"cfg": [block_m, block_n, warps, stages, splits], "error": str(exc)[:120]})
            continue
        results.append({"cfg": [block_m, block_n, warps, stages, splits], "ms": ms, "compile_s": compile_s})
    ok = [r for r in results if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    return {"shape": shape, "dense": dense, "best_dense": best_dense, "best": best, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--regimes", default="A,B")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    report = []
    for regime in args.regimes.split(","):
        for grouped in (False, True):
            shape = _shape(regime, grouped, 128)
            group = shape["heads"] // shape["kv_heads"]
            if regime == "A":
                configs = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3), (1,)))
            else:
                bm = 32 * group if 32 * group <= 128 else 128
                configs = list(itertools.product((bm,), (64, 128), (4, 8), (2, 3, 4), (1, 2, 4)))
            res = sweep(shape, configs)
            report.append(res)
            b = res["best"]
            print(
                f"{regime} kv{shape['kv_heads']} page128: dense {res['best_dense'][0]} {res['best_dense'][1]:.3f} ms; "
                f"best triton {b['cfg'] if b else None} {b['ms'] if b else float('nan'):.3f} ms",
                flush=True,
            )
            if b is not None:  # the same winner at page 16
                shape16 = dict(shape, page=16)
                res16 = sweep(shape16, [tuple(b["cfg"])])  # type: ignore[list-item]
                report.append(res16)
                b16 = res16["best"]
                print(f"   page16 with that cfg: {b16['ms'] if b16 else float('nan'):.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

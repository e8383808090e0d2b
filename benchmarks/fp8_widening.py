"""Time the cuda paged-attention kernel over e4m3 pages, widening them to the query dtype
directly or through float16, against the same kernel over bf16 pages (regime B, 8 KV heads).

    python3 benchmarks/fp8_widening.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

from diffusion_kv.bench.timing import time_device
from diffusion_kv.platforms.cuda import kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows, target, keys, heads, kvh, d, page = 16, 32, 8192, 32, 8, 128, 128
    nblk = rows * keys // page
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(rows * target, heads, d, device=dev, dtype=torch.bfloat16, generator=g)
    kc = torch.randn(nblk, page, kvh, d, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    ones = torch.ones(kvh, device=dev)
    bt = torch.randperm(nblk, device=dev, generator=g).to(torch.int32).view(rows, keys // page)
    seq = torch.full((rows,), keys, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, rows * target + 1, target, dtype=torch.int32, device=dev)
    tile_row = torch.arange(rows, dtype=torch.int32, device=dev)
    tile_q0 = torch.zeros(rows, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    report = {}
    for splits in (4, 8):
        common = dict(scale=d**-0.5, causal=False, block_m=128, block_n=64, num_splits=splits, num_warps=8)

        def bf16(common: dict[str, object] = common) -> None:
            kernels.paged_attention(q, kc, vc, out, bt, seq, qsl, tile_row, tile_q0, **common)  # type: ignore[arg-type]

        def fp8(common: dict[str, object] = common) -> None:
            kernels.paged_attention(
                q,
                k8,
                v8,
                out,
                bt,
                seq,
                qsl,
                tile_row,
                tile_q0,
                k_scale=ones,
                v_scale=ones,
                **common,  # type: ignore[arg-type]
            )

        row = {"bf16_ms": time_device(bf16, dev, min_ms=20.0)}
        for via in (False, True):
            kernels.FP8_VIA_F16 = via
            row[f"fp8_{'via_f16' if via else 'direct'}_ms"] = time_device(fp8, dev, min_ms=20.0)
        report[f"splits{splits}"] = row
        print(splits, row, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()

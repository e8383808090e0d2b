"""cuDNN's own paged SDPA over diffusion-kv's page layout, against gather + cuDNN and dense.

Can cuDNN read the pages in place (its SDPA with page tables, cuDNN >= 9.5 through the cuDNN
frontend's Python package, ``import cudnn``) at dense cuDNN's speed? This probe runs the
``cuda:cudnn`` backend's graph (:mod:`diffusion_kv.platforms.cuda.cudnn_paged`: queries packed
with ragged offsets, per-row lengths, page tables) over a ``[blocks, page, kv_heads, head_size]``
key cache and value cache (the cuda plugin's layout, physically shuffled pages), and times it
against, over the same K/V:

* ``dense``: torch's SDPA (its own kernel choice) over contiguous K/V (one call for uniform
  rows, else one a row);
* ``gather + dense``: the pages gathered by block first (what ``cuda:paged`` does in regime A).

Cases: ``A`` (the bench's regime A at CFG 2: 2 rows x 4096 queries over 6144 keys, 24 heads,
24 or 8 KV heads), ``stream`` (the stream bench's 12,800-token mixed step: queries ragged, packed
along one axis). Outputs are checked against ``dense``. The fifteenth session's figures
(``docs/benchmarks.md``) came from this probe's first version (``72c70bf``), which built its own
graph with exact query and key maxima and unpadded queries for uniform rows. Needs a CUDA device
and the cuDNN frontend (``nvidia-cudnn-frontend``)::

    PYTHONPATH=. python3 benchmarks/probe_cudnn_paged.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from diffusion_kv.bench.stream import FULL_MIXED_STEP
from diffusion_kv.bench.timing import time_device
from diffusion_kv.platforms.cuda.cudnn_paged import CudnnGraphs, cudnn_paged_available, make_batch

STREAM_STEP = list(FULL_MIXED_STEP)


def run_case(name: str, rows: list[tuple[int, int]], heads: int, kv_heads: int, args: Any) -> dict[str, Any]:
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    d, page = args.head_size, args.block_size
    scale = d**-0.5
    n = len(rows)
    gen = torch.Generator(device=dev).manual_seed(0)
    max_kv = max(s for _, s in rows)
    max_pages = -(-max_kv // page)
    pages_of = [-(-s // page) for _, s in rows]
    blocks = sum(pages_of) + 1
    k_cache = torch.randn(blocks, page, kv_heads, d, generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn(blocks, page, kv_heads, d, generator=gen, device=dev, dtype=dtype)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    table = torch.zeros(n, max_pages, dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages_of):
        table[i, :p] = torch.tensor(order[at : at + p], dtype=torch.int32)
        at += p
    table_d = table.to(dev)
    qlens = [q for q, _ in rows]
    uniform = len(set(rows)) == 1
    query = torch.randn(sum(qlens), heads, d, generator=gen, device=dev, dtype=dtype)
    qs = list(torch.split(query, qlens))
    group = heads // kv_heads
    flops = sum(4.0 * q * s * heads * d for q, s in rows)
    out: dict[str, Any] = {
        "case": name,
        "rows": rows,
        "heads": heads,
        "kv_heads": kv_heads,
        "gflop": flops / 1e9,
    }

    def dense_kv(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = rows[i][1]
        idx = table[i, : pages_of[i]].long().to(dev)
        k = k_cache.index_select(0, idx).reshape(-1, kv_heads, d)[:s]
        v = v_cache.index_select(0, idx).reshape(-1, kv_heads, d)[:s]
        return k, v

    contiguous = [dense_kv(i) for i in range(n)]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B, L, H, D], k/v [B, S, Hkv, D] -> [B, L, H, D]; torch's own kernel choice
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=group > 1)
        return o.transpose(1, 2)

    if uniform:
        dk = torch.stack([k for k, _ in contiguous])
        dv = torch.stack([v for _, v in contiguous])
        dq = query.view(n, qlens[0], heads, d)

        def dense() -> torch.Tensor:
            return sdpa(dq, dk, dv).reshape(-1, heads, d)

        def gather_dense() -> torch.Tensor:
            s = rows[0][1]
            k = k_cache.index_select(0, table_d.flatten().long()).view(n, -1, kv_heads, d)[:, :s]
            v = v_cache.index_select(0, table_d.flatten().long()).view(n, -1, kv_heads, d)[:, :s]
            return sdpa(dq, k, v).reshape(-1, heads, d)

    else:

        def dense() -> torch.Tensor:
            return torch.cat(
                [sdpa(q[None], k[None], v[None])[0] for q, (k, v) in zip(qs, contiguous, strict=True)]
            )

        def gather_dense() -> torch.Tensor:
            outs = []
            for i, q in enumerate(qs):
                k, v = dense_kv(i)
                outs.append(sdpa(q[None], k[None], v[None])[0])
            return torch.cat(outs)

    ref = dense().float()
    out["dense_ms"] = time_device(dense, dev, min_ms=args.min_ms)
    out["gather_dense_ms"] = time_device(gather_dense, dev, min_ms=args.min_ms)
    out["gather_dense_max_abs_diff"] = float((gather_dense().float() - ref).abs().max())
    # cuDNN paged, through the cudnn backend's own graph cache and batch inputs
    graphs = CudnnGraphs()
    plan = make_batch(tuple(qlens), tuple(s for _, s in rows), table_d, page)
    o_buf = torch.empty_like(query)

    def paged() -> torch.Tensor:
        graphs.attend(plan, query, k_cache, v_cache, o_buf, scale)
        return o_buf

    try:
        began = time.perf_counter()
        got = paged().float()
        torch.cuda.synchronize()
        out["cudnn_paged_build_ms"] = (time.perf_counter() - began) * 1e3  # the first call builds
    except Exception as exc:
        out["cudnn_paged_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        return out
    out["cudnn_paged_max_abs_diff"] = float((got - ref).abs().max())
    out["cudnn_paged_ms"] = time_device(paged, dev, min_ms=args.min_ms)
    for key in ("gather_dense_ms", "cudnn_paged_ms"):
        out[key.replace("_ms", "_vs_dense")] = out[key] / out["dense_ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--min-ms", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    found = cudnn_paged_available()
    if not found:
        print(f"needs cuDNN's paged SDPA: {found.reason}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": found.reason,
        "cases": [],
    }
    cases = [
        ("A cfg2 MHA", [(4096, 6144)] * 2, 24, 24),
        ("A cfg2 GQA", [(4096, 6144)] * 2, 24, 8),
        ("A cfg1 MHA", [(4096, 6144)], 24, 24),
        ("stream step (12 heads)", list(STREAM_STEP), 12, 12),
    ]
    for name, rows, heads, kv_heads in cases:
        try:
            r = run_case(name, rows, heads, kv_heads, args)
        except Exception as exc:
            r = {"case": name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:400]}
        report["cases"].append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

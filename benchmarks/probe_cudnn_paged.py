"""cuDNN's own paged SDPA over diffusion-kv's page layout, against gather + cuDNN and dense.

Can cuDNN read the pages in place (its SDPA with page tables, cuDNN >= 9.5 through the cuDNN
frontend's Python package, ``import cudnn``) at dense cuDNN's speed? This probe builds one cuDNN
graph per case over a ``[blocks, page, kv_heads, head_size]`` key cache and value cache (the
cuda plugin's layout, physically shuffled pages), per-row key lengths and page tables, and times
its execution against, over the same K/V:

* ``dense``: torch's SDPA (its own kernel choice) over contiguous K/V (one call for uniform
  rows, else one a row);
* ``gather + dense``: the pages gathered by block first (what ``cuda:paged`` does in regime A).

Cases: ``A`` (the bench's regime A at CFG 2: 2 rows x 4096 queries over 6144 keys, 24 heads,
24 or 8 KV heads), ``stream`` (the stream bench's 12,800-token mixed step: queries ragged, packed
along one axis). Outputs are checked against ``dense``. Needs a CUDA device and the cuDNN
frontend (``nvidia-cudnn-frontend``)::

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

STREAM_STEP = list(FULL_MIXED_STEP)


def _cudnn_graph(
    cudnn: Any,
    handle: Any,
    *,
    rows: int,
    heads: int,
    kv_heads: int,
    d: int,
    max_q: int,
    max_kv: int,
    blocks: int,
    page: int,
    max_pages: int,
    ragged: bool,
    scale: float,
) -> tuple[Any, dict[str, Any]]:
    bf16, i32 = cudnn.data_type.BFLOAT16, cudnn.data_type.INT32
    g = cudnn.pygraph(
        io_data_type=bf16,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    t: dict[str, Any] = {}
    # queries [rows, H, max_q, D] in token-major memory ([tokens, H, D] packed rows)
    t["q"] = g.tensor(
        name="q", dim=[rows, heads, max_q, d], stride=[max_q * heads * d, d, heads * d, 1], data_type=bf16
    )
    # the caches as [blocks, Hkv, page, D] over [blocks, page, Hkv, D] memory
    kv_stride = [page * kv_heads * d, d, kv_heads * d, 1]
    t["k"] = g.tensor(name="k", dim=[blocks, kv_heads, page, d], stride=kv_stride, data_type=bf16)
    t["v"] = g.tensor(name="v", dim=[blocks, kv_heads, page, d], stride=kv_stride, data_type=bf16)
    one = [1, 1, 1, 1]
    t["seq_q"] = g.tensor(name="seq_q", dim=[rows, 1, 1, 1], stride=one, data_type=i32)
    t["seq_kv"] = g.tensor(name="seq_kv", dim=[rows, 1, 1, 1], stride=one, data_type=i32)
    table_stride = [max_pages, max_pages, 1, 1]
    t["table_k"] = g.tensor(name="table_k", dim=[rows, 1, max_pages, 1], stride=table_stride, data_type=i32)
    t["table_v"] = g.tensor(name="table_v", dim=[rows, 1, max_pages, 1], stride=table_stride, data_type=i32)
    if ragged:
        t["q_off"] = g.tensor(name="q_off", dim=[rows + 1, 1, 1, 1], stride=one, data_type=i32)
        t["q"].set_ragged_offset(t["q_off"])
    kwargs: dict[str, Any] = dict(
        name="sdpa",
        q=t["q"],
        k=t["k"],
        v=t["v"],
        attn_scale=scale,
        use_padding_mask=True,
        seq_len_q=t["seq_q"],
        seq_len_kv=t["seq_kv"],
        paged_attention_k_table=t["table_k"],
        paged_attention_v_table=t["table_v"],
        paged_attention_max_seq_len_kv=max_kv,
    )
    try:
        o, _ = g.sdpa(generate_stats=False, **kwargs)
    except TypeError:  # older frontends name it is_inference
        o, _ = g.sdpa(is_inference=True, **kwargs)
    o.set_output(True).set_dim([rows, heads, max_q, d]).set_stride([max_q * heads * d, d, heads * d, 1])
    if ragged:
        t["o_off"] = g.tensor(name="o_off", dim=[rows + 1, 1, 1, 1], stride=one, data_type=i32)
        o.set_ragged_offset(t["o_off"])
    t["o"] = o
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, t


def run_case(
    cudnn: Any, handle: Any, name: str, rows: list[tuple[int, int]], heads: int, kv_heads: int, args: Any
) -> dict[str, Any]:
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    d, page = args.head_size, args.block_size
    scale = d**-0.5
    n = len(rows)
    gen = torch.Generator(device=dev).manual_seed(0)
    max_q, max_kv = max(q for q, _ in rows), max(s for _, s in rows)
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
    # cuDNN paged
    ragged = not uniform
    try:
        began = time.perf_counter()
        g, t = _cudnn_graph(
            cudnn,
            handle,
            rows=n,
            heads=heads,
            kv_heads=kv_heads,
            d=d,
            max_q=max_q,
            max_kv=max_kv,
            blocks=blocks,
            page=page,
            max_pages=max_pages,
            ragged=ragged,
            scale=scale,
        )
        out["cudnn_paged_build_ms"] = (time.perf_counter() - began) * 1e3
    except Exception as exc:
        out["cudnn_paged_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        return out
    ws = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=dev)
    o_buf = torch.empty(n * max_q if not ragged else sum(qlens), heads, d, device=dev, dtype=dtype)
    cum = [0]
    for q in qlens:
        cum.append(cum[-1] + q * heads * d)
    pack: dict[Any, torch.Tensor] = {
        t["q"]: query if ragged else query.view(n * max_q, heads, d),
        t["k"]: k_cache,
        t["v"]: v_cache,
        t["seq_q"]: torch.tensor(qlens, dtype=torch.int32, device=dev).view(n, 1, 1, 1),
        t["seq_kv"]: torch.tensor([s for _, s in rows], dtype=torch.int32, device=dev).view(n, 1, 1, 1),
        t["table_k"]: table_d.view(n, 1, max_pages, 1),
        t["table_v"]: table_d.view(n, 1, max_pages, 1),
        t["o"]: o_buf,
    }
    if ragged:
        offsets = torch.tensor(cum, dtype=torch.int32, device=dev).view(n + 1, 1, 1, 1)
        pack[t["q_off"]] = offsets
        pack[t["o_off"]] = offsets

    def paged() -> torch.Tensor:
        g.execute(pack, ws, handle=handle)
        return o_buf

    try:
        got = paged().float()
        torch.cuda.synchronize()
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
    try:
        import cudnn  # type: ignore[import-not-found]  # the cuDNN frontend's Python package
    except ImportError as exc:
        print(f"needs the cuDNN frontend (pip install nvidia-cudnn-frontend): {exc}", file=sys.stderr)
        return 2
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn_backend": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call]
        "cudnn_frontend": getattr(cudnn, "__version__", "?"),
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
            r = run_case(cudnn, handle, name, rows, heads, kv_heads, args)
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

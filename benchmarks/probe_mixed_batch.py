"""Attention over one mixed continuous batch: the paged ways against dense ideals, one process.

The stream bench's batched steps mix rows of several (query, key) shapes, which ``cuda:paged``
sends to the in-place Triton kernel (its per-batch rule allows gather + SDPA for at most two row
shapes). This probe takes one such step's rows (default: the bench's ``full`` stream at its
largest mixed step: 11 rows, queries 512-5120 over 512-5120 keys, 12 heads of 128, bf16,
shuffled 128-token pages) and times, over the same K/V:

* every paged backend of the platform through :class:`PagedWorker` (``forward`` from pages);
* ``dense per row``: the best dense SDPA per row over contiguous K/V, summed (one call a row);
* ``ragged cudnn``: packed queries and packed contiguous K/V in one
  ``aten._cudnn_attention_forward`` call with cumulative lengths (where the build accepts it);
* ``ragged flash``: the same through ``aten._flash_attention_forward`` (varlen).

Every output is checked against the per-row dense output. Needs a CUDA device::

    PYTHONPATH=. python3 benchmarks/probe_mixed_batch.py [--rows Q:S,Q:S,...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from diffusion_kv.bench.attention import _native_choice, dense_backends, dense_fn
from diffusion_kv.bench.stream import FULL_MIXED_STEP
from diffusion_kv.bench.timing import time_device
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.selection import get_platform

LAYER = "probe.attn"
# The bench's full stream, its 12,800-token step (queries, keys per row).
STREAM_STEP = list(FULL_MIXED_STEP)


def _flops(rows: list[tuple[int, int]], heads: int, d: int) -> float:
    return sum(4.0 * q * s * heads * d for q, s in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=None, help="Q:S pairs, comma separated (default: a stream step)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--min-ms", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rows = (
        [tuple(int(x) for x in p.split(":")) for p in args.rows.split(",")]
        if args.rows
        else list(STREAM_STEP)
    )
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    H, Hkv, D, page = args.heads, args.kv_heads, args.head_size, args.block_size
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    ks = [torch.randn(s, Hkv, D, generator=gen, device=dev, dtype=dtype) for _, s in rows]
    vs = [torch.randn(s, Hkv, D, generator=gen, device=dev, dtype=dtype) for _, s in rows]
    qs = [torch.randn(q, H, D, generator=gen, device=dev, dtype=dtype) for q, _ in rows]
    query = torch.cat(qs)
    flops = _flops(rows, H, D)  # type: ignore[arg-type]
    report: dict[str, Any] = {
        "rows": rows,
        "heads": H,
        "kv_heads": Hkv,
        "head_size": D,
        "block_size": page,
        "dtype": "bfloat16",
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "gflop": flops / 1e9,
        "ways": {},
    }
    ways = report["ways"]

    def record(name: str, fn: Any, check: torch.Tensor | None) -> None:
        try:
            got = fn()
            torch.cuda.synchronize(dev)
        except Exception as exc:  # a way the build does not serve is a reported reason
            ways[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            return
        ms = time_device(fn, dev, min_ms=args.min_ms)
        entry: dict[str, Any] = {"ms": ms, "tflops": flops / ms / 1e9}
        if check is not None:
            entry["max_abs_diff"] = float((got.float() - check).abs().max())
        ways[name] = entry

    # Dense per row: the best SDPA backend for each row's shape, summed.
    dense_q = [q.transpose(0, 1)[None] for q in qs]
    dense_k = [k.transpose(0, 1)[None] for k in ks]
    dense_v = [v.transpose(0, 1)[None] for v in vs]
    gqa = Hkv != H
    per_backend: dict[str, Any] = {}
    for label, sdp in dense_backends(dev):
        fns = [dense_fn(sdp, q, k, v, scale, gqa) for q, k, v in zip(dense_q, dense_k, dense_v, strict=True)]

        def all_rows(fns: list[Any] = fns) -> torch.Tensor:
            return torch.cat([f()[0].transpose(0, 1) for f in fns])

        record(f"dense per row ({label})", all_rows, None)
        per_backend[label] = all_rows
    good = {n: w for n, w in ways.items() if "ms" in w}
    best_name = min(good, key=lambda n: good[n]["ms"])
    reference = per_backend[best_name.removeprefix("dense per row (").removesuffix(")")]().float()
    report["best_dense"] = {"way": best_name, "ms": good[best_name]["ms"]}

    # Packed contiguous K/V with cumulative lengths: one ragged call.
    cum_q = torch.tensor(
        [0, *torch.tensor([q for q, _ in rows]).cumsum(0).tolist()], dtype=torch.int32, device=dev
    )
    cum_k = torch.tensor(
        [0, *torch.tensor([s for _, s in rows]).cumsum(0).tolist()], dtype=torch.int32, device=dev
    )
    packed_k, packed_v = torch.cat(ks), torch.cat(vs)
    max_q, max_k = max(q for q, _ in rows), max(s for _, s in rows)
    if not gqa:

        def ragged_cudnn() -> torch.Tensor:
            out = torch.ops.aten._cudnn_attention_forward(
                query,
                packed_k,
                packed_v,
                None,
                cum_q,
                cum_k,
                max_q,
                max_k,
                False,
                0.0,
                False,
                False,
                scale=scale,
            )
            got: torch.Tensor = out[0]
            return got

        record("ragged cudnn (contiguous K/V)", ragged_cudnn, reference)

    def ragged_flash() -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(
            query, packed_k, packed_v, cum_q, cum_k, max_q, max_k, 0.0, False, False, scale=scale
        )
        got: torch.Tensor = out[0]
        return got

    record("ragged flash (contiguous K/V)", ragged_flash, reference)

    # Paged: every backend of the platform over the same K/V in shuffled pages.
    platform = get_platform("cuda")
    total_blocks = sum(cdiv(s, page) for _, s in rows)
    order = torch.randperm(total_blocks + 1, generator=torch.Generator().manual_seed(0)).tolist()
    seqs = []
    at = 0
    for i, (q, s) in enumerate(rows):
        n = cdiv(s, page)
        seqs.append(SequenceAllocation(i, s - q, q, s, (tuple(order[at : at + n]),)))
        at += n
    for candidate in platform.candidate_backends():
        if not candidate.is_available():
            continue
        try:
            runner = PagedWorker(
                platform,
                RunnerConfig(
                    max_model_len=max_k,
                    max_rows_per_request=len(rows),
                    max_num_seqs=1,
                    max_num_batched_tokens=sum(s for _, s in rows),
                    device=dev,
                    backend=candidate.name,
                ),
            )
            runner.register_kv_cache_layers(
                {LAYER: PagedLayerSpec(H, Hkv, D, dtype, mode=AttentionMode.FULL)}
            )
            runner.initialize_kv_cache(num_blocks=total_blocks + 1, block_size=page)
            runner.install(RequestAllocation("probe", 0, tuple(seqs)))
            translator = runner.translator
            assert translator is not None
            prefill = translator.prepare(
                tuple(PagedRow("probe", s, s, 0, sequence_id=i) for i, (_, s) in enumerate(rows))
            )
            full_q = torch.zeros(sum(s for _, s in rows), H, D, device=dev, dtype=dtype)
            with translator.activate(prefill):
                runner.forward(LAYER, full_q, packed_k, packed_v)
            batch = translator.prepare(
                tuple(PagedRow("probe", q, s, s - q, sequence_id=i) for i, (q, s) in enumerate(rows))
            )
        except Exception as exc:
            ways[f"paged {candidate.name}"] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            continue
        md = batch.attn_metadata[LAYER]
        backend, layer, cache = runner.backends[0], runner.layers[LAYER], runner.kv_caches[LAYER]
        out = torch.empty_like(query)

        def paged(
            md: Any = md, backend: Any = backend, layer: Any = layer, cache: Any = cache
        ) -> torch.Tensor:
            got: torch.Tensor = backend.forward(layer, query, cache, md, out)  # noqa: B023
            return got

        record(f"paged {candidate.name}", paged, reference)
        ways[f"paged {candidate.name}"].update(_native_choice(md))
        runner.remove(["probe"])
    best_ms = report["best_dense"]["ms"]
    for entry in ways.values():
        if "ms" in entry:
            entry["ratio_vs_best_dense"] = entry["ms"] / best_ms
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

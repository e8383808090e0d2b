"""The continuous-batching stream under ``cuda:paged``'s per-batch way rule, today's and a
candidate, in one process: ``bench --sections stream`` run once under the module's rule
(:data:`~diffusion_kv.platforms.cuda.backend.SDPA_MAX_ROW_SHAPES`: 2, so a batch mixing requests
of several shapes takes the in-place Triton kernel) and once with the cap at ``--cap`` (default 8)
and ``--long-share`` of the queries in rows of >= 512 required, with the stream's figures of
each. Needs a CUDA machine::

    PYTHONPATH=. python benchmarks/stream_way_rule.py --out stream-way-rule.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from diffusion_kv.bench import BenchConfig, run_bench
from diffusion_kv.platforms.cuda import CudaPlatform
from diffusion_kv.platforms.cuda import backend as cuda_backend


def _figures(report: dict[str, Any]) -> dict[str, Any]:
    st = report.get("stream") or {}
    keep = ("speedup", "speedup_eager", "together_ms", "sequential_ms", "agree", "eager", "capture_ms")
    return {"errors": report.get("errors"), **{k: st[k] for k in keep if k in st}, "stream": st}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", type=int, default=8)
    ap.add_argument("--long-share", type=float, default=0.75)
    ap.add_argument("--sizes", choices=("small", "full"), default="full")
    ap.add_argument("--out", default="stream-way-rule.json")
    args = ap.parse_args()
    platform = CudaPlatform()
    out: dict[str, Any] = {}
    cap0, share0 = cuda_backend.SDPA_MAX_ROW_SHAPES, cuda_backend.SDPA_MIN_LONG_SHARE
    for label, cap, share in (("rule", cap0, share0), ("candidate", args.cap, args.long_share)):
        cuda_backend.SDPA_MAX_ROW_SHAPES, cuda_backend.SDPA_MIN_LONG_SHARE = cap, share
        try:
            report = run_bench(platform, BenchConfig(sizes=args.sizes, sections=("stream",)))
        finally:
            cuda_backend.SDPA_MAX_ROW_SHAPES, cuda_backend.SDPA_MIN_LONG_SHARE = cap0, share0
        out[label] = {"max_row_shapes": cap, "min_long_share": share, **_figures(report)}
        st = out[label]["stream"]
        print(
            label, "cap", cap, "speedup", st.get("speedup"), "eager", (st.get("eager") or {}).get("speedup")
        )
        out["environment"] = report.get("environment")
        with open(args.out, "w") as f:  # after each run: a time limit keeps what finished
            json.dump(out, f, indent=2, default=str)


if __name__ == "__main__":
    main()

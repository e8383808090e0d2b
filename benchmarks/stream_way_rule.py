"""The continuous-batching stream under ``cuda:paged``'s per-batch way rule, today's and an older
one, in one process: ``bench --sections stream`` run once with the rule's row-shape cap at
``--old-cap`` (2: mixed batches of more shapes took the in-place Triton kernel) and once at the
module's cap (:data:`~diffusion_kv.platforms.cuda.backend.SDPA_MAX_ROW_SHAPES`), with the stream's
figures of each. Needs a CUDA machine::

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
    ap.add_argument("--old-cap", type=int, default=2)
    ap.add_argument("--sizes", choices=("small", "full"), default="full")
    ap.add_argument("--out", default="stream-way-rule.json")
    args = ap.parse_args()
    platform = CudaPlatform()
    out: dict[str, Any] = {}
    new_cap = cuda_backend.SDPA_MAX_ROW_SHAPES
    for label, cap in (("old_rule", args.old_cap), ("rule", new_cap)):
        cuda_backend.SDPA_MAX_ROW_SHAPES = cap
        try:
            report = run_bench(platform, BenchConfig(sizes=args.sizes, sections=("stream",)))
        finally:
            cuda_backend.SDPA_MAX_ROW_SHAPES = new_cap
        out[label] = {"max_row_shapes": cap, **_figures(report)}
        st = out[label]["stream"]
        print(
            label, "cap", cap, "speedup", st.get("speedup"), "eager", (st.get("eager") or {}).get("speedup")
        )
        out["environment"] = report.get("environment")
        with open(args.out, "w") as f:  # after each run: a time limit keeps what finished
            json.dump(out, f, indent=2, default=str)


if __name__ == "__main__":
    main()

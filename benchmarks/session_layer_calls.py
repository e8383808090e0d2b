"""Per layer call of a session chunk, in place: the wall time of each paged attention call by its
place in the chunk (the first denoise step's calls -- a layer's first call of the chunk's prepared
batch -- then the later steps', which take the bound path), medians over the chunks after the
window filled, beside the torch.cat rolling cache's calls at the same places (taking turns chunk
by chunk, on the same model and inputs).

python benchmarks/session_layer_calls.py [--layers 8] [--chunks 40] [--shape small] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from diffusion_kv.bench.session import SHAPES
from diffusion_kv.models.session import (
    ConcatStream,
    PagedStream,
    SessionConfig,
    build_session_model,
    session_inputs,
)
from diffusion_kv.models.session_dit import AttentionFn, SessionDiT, cross_attention_context
from diffusion_kv.platforms.selection import get_platform


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    params = {k: v for k, v in SHAPES[args.shape].items() if k not in ("modes", "repeats")}
    params.update(chunks=args.chunks, layers=args.layers)
    cfg = SessionConfig(**params, backend="sdpa", modes=("paged",))
    platform = get_platform("cpu")
    device = platform.device()
    model = build_session_model(cfg, device)
    text, noise = session_inputs(cfg, device)
    cross = cross_attention_context(model, text)
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    way = [""]
    place = [0]
    run = SessionDiT.run

    def timed_run(
        self: SessionDiT,
        x: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        ctx: Any,
        out_tokens: int,
    ) -> torch.Tensor:
        def attend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = attention(name, q, k, v)
            if way[0]:
                samples[(way[0], place[0])].append((time.perf_counter() - t0) * 1e6)
            place[0] += 1
            return out

        return run(self, x, positions, attend, ctx, out_tokens)

    SessionDiT.run = timed_run  # type: ignore[method-assign]
    with torch.no_grad():
        paged = PagedStream(model, cfg, cross, device, platform, count_writes=False)
        concat = ConcatStream(model, cfg, cross, device)
        concat.count_copies = False
        for i in range(cfg.chunks):
            for name, stream in (("concat", concat), ("paged", paged)):
                way[0] = name if i >= cfg.window_filled_at + 2 else ""
                place[0] = 0
                stream.run(i, noise[i])
        paged.end()
    SessionDiT.run = run  # type: ignore[method-assign]
    layers = cfg.layers
    report: dict[str, Any] = {
        "shape": args.shape,
        "layers": layers,
        "steps": cfg.steps,
        "chunks_timed": len(samples[("paged", 0)]),
        "torch_threads": torch.get_num_threads(),
        "median_us": {},
    }
    for name in ("paged", "concat"):
        per_place = [statistics.median(samples[(name, p)]) for p in range(layers * cfg.steps)]
        report["median_us"][name] = {
            "first_layer_first_call": round(per_place[0], 1),
            "other_layers_first_call": round(statistics.median(per_place[1:layers]), 1)
            if layers > 1
            else None,
            "later_steps": round(statistics.median(per_place[layers:]), 1),
            "by_place": [round(t, 1) for t in per_place],
        }
        m = report["median_us"][name]
        print(
            f"{name:7s} first layer's first call {m['first_layer_first_call']:7.1f} us, other layers' first "
            f"calls {m['other_layers_first_call']} us, later steps {m['later_steps']:7.1f} us"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

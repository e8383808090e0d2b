"""Where a steady paged session chunk's host time goes, on the CPU.

OMP_NUM_THREADS=1 python benchmarks/profile_session.py [--chunks N] [--shape small] [--backend sdpa]
    [--sort tottime] [--callees REGEX ...]
OMP_NUM_THREADS=1 python benchmarks/profile_session.py --host-only --chunks 600

Default: cProfile of ``PagedStream.run`` (append, the denoise steps, commit) over ``--chunks``
chunks after the window filled; prints the median chunk time of the paged stream alone and the
profile's top entries (and the callees of the functions ``--callees`` names).

``--host-only``: no model. Each chunk is appended, prepared, activated with every paged layer
marked done (its tokens count as written) and committed; prints the median wall time of
``append_chunk``, ``Translator.prepare`` and ``commit`` over the chunks after the window filled
and over the last 16 (a long stream shows what grows with the chunks served).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from diffusion_kv.bench.session import SHAPES
from diffusion_kv.models.session import (
    PagedStream,
    SessionConfig,
    build_session_model,
    session_inputs,
)
from diffusion_kv.models.session_dit import cross_attention_context
from diffusion_kv.platforms.selection import get_platform


def _host_only(stream: PagedStream, chunks: int, first: int) -> None:
    translator = stream.worker.translator
    assert translator is not None
    layers = stream.model.layer_names
    times: dict[str, list[float]] = {"append": [], "prepare": [], "commit": []}

    def timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        times[name].append((time.perf_counter() - t0) * 1e6)
        return out

    for i in range(chunks):
        chunk = timed("append", stream.append)
        batch = timed("prepare", translator.prepare, chunk.rows())
        with translator.activate(batch):
            for name in layers:
                translator.layer_done(name)
        timed("commit", stream.cache.commit, chunk)
        if i + 1 == first + 16 or i + 1 == chunks:
            span = f"chunks {first}-{i}" if i + 1 == first + 16 else f"last 16 of {chunks}"
            print(
                span + ": " + ", ".join(f"{k} {statistics.median(v[-16:]):.0f} us" for k, v in times.items())
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--callees", nargs="*", default=())
    ap.add_argument("--host-only", action="store_true")
    args = ap.parse_args()
    params = {k: v for k, v in SHAPES[args.shape].items() if k not in ("modes", "repeats")}
    params["chunks"] = args.chunks + 8
    cfg = SessionConfig(**params, backend=args.backend, modes=("paged",))
    platform = get_platform("cpu")
    device = platform.device()
    model = build_session_model(cfg, device)
    text, noise = session_inputs(cfg, device)
    cross = cross_attention_context(model, text)
    with torch.no_grad():
        stream = PagedStream(model, cfg, cross, device, platform)
        if args.host_only:
            _host_only(stream, cfg.chunks, cfg.window_filled_at)
            stream.end()
            return 0
        warm = cfg.window_filled_at + 2
        for i in range(warm):
            stream.run(i, noise[i])
        times = []
        prof = cProfile.Profile()
        for i in range(warm, cfg.chunks):
            t0 = time.perf_counter()
            prof.enable()
            stream.run(i, noise[i])
            prof.disable()
            times.append((time.perf_counter() - t0) * 1e3)
        stream.end()
    print(
        f"{platform.name}:{args.backend} {args.shape}: {len(times)} steady paged chunks, "
        f"median {statistics.median(times):.2f} ms"
    )
    stats = pstats.Stats(prof).sort_stats(args.sort)
    stats.print_stats(40)
    for pattern in args.callees:
        stats.print_callees(pattern)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

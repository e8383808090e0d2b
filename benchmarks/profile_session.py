"""Where a steady paged session chunk's host time goes: cProfile of ``PagedStream.run`` (append,
the denoise steps, commit) on the CPU after the window filled.

OMP_NUM_THREADS=1 python benchmarks/profile_session.py [CHUNKS] [SHAPE] [BACKEND] [SORT] [CALLEES...]

``SHAPE`` is a ``bench --session-shape`` name (default ``small``), ``BACKEND`` a cpu backend
(default ``sdpa``); prints the median steady chunk time of the paged stream alone and the
profile's top entries (``SORT``: ``tottime`` or ``cumtime``).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

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


def main() -> int:
    chunks = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    shape = sys.argv[2] if len(sys.argv) > 2 else "small"
    backend = sys.argv[3] if len(sys.argv) > 3 else "sdpa"
    sort = sys.argv[4] if len(sys.argv) > 4 else "tottime"
    params = {k: v for k, v in SHAPES[shape].items() if k not in ("modes", "repeats")}
    params["chunks"] = chunks + 8
    cfg = SessionConfig(**params, backend=backend, modes=("paged",))
    platform = get_platform("cpu")
    device = platform.device()
    model = build_session_model(cfg, device)
    text, noise = session_inputs(cfg, device)
    cross = cross_attention_context(model, text)
    with torch.no_grad():
        stream = PagedStream(model, cfg, cross, device, platform)
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
        f"{platform.name}:{backend} {shape}: {len(times)} steady paged chunks, median {statistics.median(times):.2f} ms"
    )
    stats = pstats.Stats(prof).sort_stats(sort)
    stats.print_stats(40)
    if len(sys.argv) > 5:  # the callees of the named functions (regular expressions)
        for pattern in sys.argv[5:]:
            stats.print_callees(pattern)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where prepare's host time goes: cProfile of ``Translator.prepare`` on the selected platform.

python benchmarks/profile_prepare.py [ROWS] [TOKENS]
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from diffusion_kv.bench.host import _runner
from diffusion_kv.bench.timing import time_host
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.selection import get_platform


def main() -> int:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    platform = get_platform()
    device = platform.device()
    target = tokens // 4
    runner = _runner(platform, rows, tokens, target, platform.default_block_size, device, torch.bfloat16)
    translator = runner.translator
    assert translator is not None
    rows_ = tuple(PagedRow("host", target, tokens, tokens - target, sequence_id=i) for i in range(rows))
    print(
        f"{platform.name}: prepare {rows} rows median {time_host(lambda: translator.prepare(rows_)):.1f} us"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        translator.prepare(rows_)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())

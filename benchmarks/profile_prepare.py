"""Where prepare's host time goes: cProfile of ``Translator.prepare`` on the selected platform.

python benchmarks/profile_prepare.py [ROWS] [TOKENS] [--after-writes]

``--after-writes``: before each prepare, the registry records the writes of the batch before it
(what a finished step does: a denoise loop rewrites the same target span every step), so the
figure includes what those records cost the next prepare.
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
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    after_writes = "--after-writes" in sys.argv[1:]
    rows = int(args[0]) if args else 2
    tokens = int(args[1]) if len(args) > 1 else 4096
    platform = get_platform()
    device = platform.device()
    target = tokens // 4
    runner = _runner(platform, rows, tokens, target, platform.default_block_size, device, torch.bfloat16)
    translator = runner.translator
    assert translator is not None
    rows_ = tuple(PagedRow("host", target, tokens, tokens - target, sequence_id=i) for i in range(rows))
    registry = runner.registry
    assert registry is not None
    spans = translator.prepare(rows_).write_spans

    def prepare() -> object:
        if after_writes:
            registry.record_writes(spans)
        return translator.prepare(rows_)

    what = " after the last batch's writes" if after_writes else ""
    print(f"{platform.name}: prepare {rows} rows{what} median {time_host(prepare):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        prepare()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())

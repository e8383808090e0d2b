"""Host time of vLLM-Omni's paged-KV control path, upstream's module against diffusion-kv's.

Runs in a process with vLLM-Omni 0.30.0 (the vLLM-Omni lane's venv). The same tiny-DiT runner
(tests/vllm_omni/tiny_dit.py) is set up once, paged, and the worker-side calls a diffusion
request makes around its forward are timed on the host, each the median of ``--repeat``:

* ``install``: ``install_diffusion_kv_metadata`` (the scheduler's snapshot -> worker rows);
* ``prepare_prefill``: activating the request's rows and preparing step 0 (prefill rows:
  validation, positions, block-table gather, slot mapping, native metadata);
* ``step_switch``: the first denoise step's activation (denoise rows prepared);
* ``idle_step``: a later denoise step's ``ensure_active`` (the same rows: nothing to prepare);
* ``remove``: ``remove_diffusion_kv_requests`` after the runtime is closed;
* ``slot_mapping`` / ``gather``: the BlockTables' two data-plane calls alone, on the prefill
  rows (the part of prepare the BlockTables own);
* with ``--tight N``, ``install_tight`` / ``remove_tight``: afterwards, N installs and removals
  back to back with nothing between them (the same calls with their data warm in the caches,
  where the loop above runs each between a request's prepares).

Which module runs is whatever this process's vLLM-Omni runner uses: upstream's
(``vllm_omni.diffusion.diffusion_kv``) when the package is unpatched (zero-patch embedding:
upstream's module with diffusion-kv's BlockTables and metadata), diffusion-kv's core when
the module-replacement patch is on ``PYTHONPATH`` (``ci/vllm_omni_lane.sh`` shows how). Run it
both ways on the same machine and compare:

    python benchmarks/omni_host_overhead.py --json upstream.json
    PYTHONPATH=$PATCHED python benchmarks/omni_host_overhead.py --json core.json

Shapes default to a HunyuanImage-style request: a 1024-token prompt prefix, a 64 x 64 latent
(4096 image tokens) target, two CFG rows, block size 128.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--target", type=int, default=4096)
    parser.add_argument("--cfg", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument(
        "--tight",
        type=int,
        default=0,
        metavar="N",
        help="then N installs and removals back to back, nothing between them (install_tight, "
        "remove_tight): the same calls with their data warm in the caches",
    )
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    from tests.vllm_omni import engine, tiny_dit

    shape = tiny_dit.Shape(
        prefix=args.prefix,
        target=args.target,
        cfg=args.cfg,
        layers=2,
        max_model_len=args.prefix + args.target,
        dtype=torch.float32,
    )
    od = engine.od_config(
        dtype=shape.dtype,
        paged=True,
        max_model_len=shape.max_model_len,
        rows_per_request=shape.cfg,
        model_type="tiny_dit",
        # one request-level forward carries every CFG row's tokens
        max_num_batched_tokens=shape.cfg * (shape.prefix + shape.target),
    )
    worker = engine.start_worker(
        od,
        lambda _config: tiny_dit.TinyPipeline(shape).to(shape.dtype).eval(),
        device=torch.device("cpu"),
        kv_cache_bytes=256 << 20,
    )
    runner, manager = worker.runner, worker.manager
    assert manager is not None
    block_size = worker.hooks["block_size"]
    backend = runner.diffusion_kv_backend
    module = type(backend).__module__
    timings: dict[str, list[float]] = {
        k: []
        for k in (
            "install",
            "prepare_prefill",
            "step_switch",
            "idle_step",
            "remove",
            "slot_mapping",
            "gather",
        )
    }

    def timed(key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        timings[key].append(time.perf_counter() - t0)
        return out

    for i in range(args.repeat + 5):
        rid = f"req-{i}"
        kv_requests = tiny_dit.kv_requests(shape, rid)
        metadata = manager.reserve_request(rid, kv_requests)
        assert metadata is not None, "the scheduler could not admit the request"
        timed("install", runner.install_diffusion_kv_metadata, metadata)
        paged = runner._build_paged_attention_metadata([metadata])
        runtime, context = backend.activate_paged_attention_metadata(paged)
        with context:
            adapter = timed("prepare_prefill", runtime.ensure_active, 0)
            translator = getattr(adapter, "translator", None)
            if translator is not None:
                # diffusion-kv's core admits denoise rows only over pages a completed prefill
                # wrote (provenance): record every layer's prefill write without running it
                for name in sorted(translator._layer_names):
                    translator.layer_done(name)
            timed("step_switch", runtime.ensure_active, 1)
            timed("idle_step", runtime.ensure_active, 2)  # same rows: what every later step calls
            tables = backend.block_tables
            rows = torch.tensor(
                [int(backend.get_diffusion_kv_row(rid, c)) for c in range(shape.cfg)], dtype=torch.int32
            )
            total = shape.cfg * (shape.prefix + shape.target)
            qsl = torch.arange(0, total + 1, shape.prefix + shape.target, dtype=torch.int32)
            positions = torch.arange(shape.prefix + shape.target, dtype=torch.int64).repeat(shape.cfg)
            timed("slot_mapping", tables.compute_slot_mappings, rows, qsl, positions, num_tokens_padded=total)
            timed("gather", tables.gather_block_tables, rows, num_reqs_padded=shape.cfg)
            del adapter
        timed("remove", runner.remove_diffusion_kv_requests, [rid])
        manager.free_request(rid)
    tight: dict[str, list[float]] = {"install_tight": [], "remove_tight": []}
    for i in range(args.tight + 5 if args.tight else 0):
        rid = f"tight-{i}"
        metadata = manager.reserve_request(rid, tiny_dit.kv_requests(shape, rid))
        assert metadata is not None, "the scheduler could not admit the request"
        t0 = time.perf_counter()
        runner.install_diffusion_kv_metadata(metadata)
        t1 = time.perf_counter()
        runner.remove_diffusion_kv_requests([rid])
        t2 = time.perf_counter()
        manager.free_request(rid)
        tight["install_tight"].append(t1 - t0)
        tight["remove_tight"].append(t2 - t1)
    if args.tight:
        timings.update(tight)
    result = {
        "module": module,
        "block_tables": type(backend.block_tables).__module__ + "." + type(backend.block_tables).__name__,
        "block_size": block_size,
        "shape": {"prefix": shape.prefix, "target": shape.target, "cfg": shape.cfg},
        "repeat": args.repeat,
        "median_us": {k: _median_us(v[5:]) for k, v in timings.items()},
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Host time of vLLM-Omni's paged-KV control path, upstream's module against diffusion-kv's.

Runs in a process with vLLM-Omni 0.30.0 (the vLLM-Omni lane's venv). The same tiny-DiT runner
(tests/vllm_omni/tiny_dit.py) is set up once, paged, and the worker-side calls a diffusion
request makes around its forward are timed on the host, each the median of ``--repeat``:

* ``install``: ``install_diffusion_kv_metadata`` (the scheduler's snapshot -> worker rows);
* ``prepare_prefill``: activating the request's rows and preparing step 0 (prefill rows:
  validation, positions, block-table gather, slot mapping, native metadata);
* ``step_switch``: the first denoise step's activation (denoise rows prepared);
* ``remove``: ``remove_diffusion_kv_requests`` after the runtime is closed;
* ``slot_mapping`` / ``gather``: the BlockTables' two data-plane calls alone, on the prefill
  rows (the part of prepare the BlockTables own).

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
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.diffusion_kv.initialization import build_native_kv_cache_configs
    from vllm_omni.diffusion.diffusion_kv.manager import DiffusionKVCacheManager
    from vllm_omni.diffusion.diffusion_kv.request import DiffusionKVRequest
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.platforms import current_omni_platform

    from tests.vllm_omni import tiny_dit

    shape = tiny_dit.Shape(
        prefix=args.prefix,
        target=args.target,
        cfg=args.cfg,
        layers=2,
        max_model_len=args.prefix + args.target,
        dtype=torch.float32,
    )
    device = torch.device("cpu")
    od = tiny_dit.od_config(shape, paged=True)
    vllm_config = create_diffusion_vllm_config(device, od)
    # one request-level forward carries every CFG row's tokens
    vllm_config.scheduler_config.max_num_batched_tokens = max(
        vllm_config.scheduler_config.max_num_batched_tokens, shape.cfg * (shape.prefix + shape.target)
    )
    current_omni_platform.init_diffusion_worker_vllm_config(vllm_config)
    with set_current_diffusion_config(od), set_current_vllm_config(vllm_config):
        pipeline = tiny_dit.TinyPipeline(shape).to(shape.dtype).eval()
    current_omni_platform.init_diffusion_model_runner_runtime(
        vllm_config=vllm_config, od_config=od, device=device
    )
    runner = DiffusionModelRunner(vllm_config, od, device)
    runner.pipeline = pipeline
    with set_current_vllm_config(vllm_config):
        specs = runner.get_kv_cache_spec()
    worker_configs, scheduler_config = build_native_kv_cache_configs(vllm_config, [specs], [256 << 20])
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
    runner.set_kv_cache_config(worker_configs[0])
    manager = DiffusionKVCacheManager(
        scheduler_config,
        max_model_len=vllm_config.model_config.max_model_len,
        scheduler_block_size=block_size,
        hash_block_size=hash_block_size,
    )
    backend = runner.diffusion_kv_backend
    module = type(backend).__module__
    timings: dict[str, list[float]] = {
        k: [] for k in ("install", "prepare_prefill", "step_switch", "remove", "slot_mapping", "gather")
    }

    def timed(key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        timings[key].append(time.perf_counter() - t0)
        return out

    for i in range(args.repeat + 5):
        rid = f"req-{i}"
        kv_requests = [
            DiffusionKVRequest(
                f"{rid}-cfg{c}",
                sequence_id=c,
                prefix_len=shape.prefix,
                target_len=shape.target,
                seq_len=shape.prefix + shape.target,
            )
            for c in range(shape.cfg)
        ]
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

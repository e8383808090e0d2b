"""Per-chunk cost of vLLM-Omni's AR-diffusion engine on diffusion-kv sessions vs its own KV path.

LingBot-World's causal transformer (vLLM-Omni 0.30.0, random weights) generates AR blocks (4
probe forwards + 1 committing forward each, as its DMD block runs them) twice in the same process,
one thread, same weights and inputs: once on vLLM-Omni's own ``ARDiffusionKVCache`` (its CPU
attention: ``_reference_paged_attention``), once on diffusion-kv's session state
(``integrations/vllm_omni/ar_sessions``). Reported per AR block, after the window filled (the
steady state): wall time of the block, and the time inside the paged op
(``vllm_omni::ar_diffusion_paged_write_attn``: the KV write, host bookkeeping and attention), from
the torch profiler over the same blocks. Needs the vLLM-Omni lane's venv::

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD python benchmarks/omni_ar_host_cost.py --out docs/results/X.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

OP = "vllm_omni::ar_diffusion_paged_write_attn"


def _run(model: Any, state: Any, inputs: Any, blocks: int, warm: int) -> dict[str, Any]:
    from tests.vllm_omni import ar_models as M

    cross: list[Any] = [None] * inputs.shape.layers
    walls = []
    for index in range(warm):
        M.lingbot_block(model, state, cross, inputs, index)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for index in range(warm, warm + blocks):
            t0 = time.perf_counter()
            M.lingbot_block(model, state, cross, inputs, index)
            walls.append(time.perf_counter() - t0)
    op_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key == OP)
    calls = sum(e.count for e in prof.key_averages() if e.key == OP)
    return {
        "block_wall_ms_median": statistics.median(walls) * 1e3,
        "block_wall_ms": [w * 1e3 for w in walls],
        "op_ms_per_block": op_us / 1e3 / blocks,
        "op_calls_per_block": calls / blocks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--side", type=int, default=16, help="latent height = width (patch 2x2)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from tests.vllm_omni import ar_models as M

    shape = M.LingBotShape(
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        height=args.side,
        width=args.side,
        frames_per_block=3,
        window_frames=18,
        sink_frames=9,
    )
    warm = (shape.window_frames + shape.sink_frames) // shape.frames_per_block
    results: dict[str, Any] = {}
    with M.environment(), torch.no_grad():
        model = M.lingbot(shape, seed=0)
        layout = M.lingbot_layout(shape)
        inputs = M.LingBotInputs(shape, seed=1)
        for name, make in (
            ("vllm_omni", lambda: M.host_state(layout)),
            ("diffusion_kv", lambda: M.dkv_cache(layout).state("s0")),
        ):
            results[name] = _run(model, make(), inputs, args.blocks, warm)
    ratio_wall = (
        results["diffusion_kv"]["block_wall_ms_median"] / results["vllm_omni"]["block_wall_ms_median"]
    )
    ratio_op = results["diffusion_kv"]["op_ms_per_block"] / results["vllm_omni"]["op_ms_per_block"]
    report = {
        "what": "LingBot-World AR block (4 probes + 1 commit forward), steady state after the window filled",
        "shape": {
            **shape.__dict__,
            "tokens_per_frame": shape.tokens_per_frame,
            "chunk_tokens": shape.frames_per_block * shape.tokens_per_frame,
            "max_visible_keys": (shape.window_frames + shape.sink_frames) * shape.tokens_per_frame,
        },
        "threads": 1,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "results": results,
        "ratio_block_wall": ratio_wall,
        "ratio_op_time": ratio_op,
        "target_op_ratio": 0.5,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    for name, r in results.items():
        print(
            f"{name:13s} block {r['block_wall_ms_median']:8.2f} ms  op {r['op_ms_per_block']:8.2f} ms/block"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

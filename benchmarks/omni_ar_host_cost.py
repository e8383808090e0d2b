"""Per-chunk cost of vLLM-Omni's AR-diffusion engine on diffusion-kv sessions vs its own KV path.

LingBot-World's causal transformer (vLLM-Omni 0.30.0, random weights) generates AR blocks (4
probe forwards + 1 committing forward each, as its DMD block runs them) in one process, one
thread, same weights and inputs: on vLLM-Omni's own ``ARDiffusionKVCache`` (its CPU attention:
``_reference_paged_attention``) and on diffusion-kv's session state
(``integrations/vllm_omni/ar_sessions``) once per backend named in ``--backend`` (default
``cpu:reference,cpu:sdpa``: the oracle and the SDPA backend, both serving chunk-causal masks).
After the window filled (the steady state) the paths take turns block by block; reported per AR
block: the median wall time and the median time inside the paged op
(``vllm_omni::ar_diffusion_paged_write_attn``: the KV write, host bookkeeping and attention),
from the torch profiler around each block. Needs the vLLM-Omni lane's venv::

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


def _block(
    model: Any, state: Any, cross: list[Any], inputs: Any, index: int
) -> tuple[float, float, float, int]:
    """One AR block under the profiler: (wall s, thread CPU s, op us, op calls)."""
    from tests.vllm_omni import ar_models as M

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0, c0 = time.perf_counter(), time.thread_time()
        M.lingbot_block(model, state, cross, inputs, index)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    events = [e for e in prof.key_averages() if e.key == OP]
    return wall, cpu, sum(e.cpu_time_total for e in events), sum(e.count for e in events)


def _interleaved(model: Any, states: dict[str, Any], inputs: Any, blocks: int, warm: int) -> dict[str, Any]:
    """Every path warmed up to the steady state, then block after block with the paths taking
    turns (so a noisy neighbour on a shared host slows all of them alike)."""
    from tests.vllm_omni import ar_models as M

    cross = {name: [None] * inputs.shape.layers for name in states}
    for index in range(warm):
        for name, state in states.items():
            M.lingbot_block(model, state, cross[name], inputs, index)
    walls: dict[str, list[float]] = {name: [] for name in states}
    cpus: dict[str, list[float]] = {name: [] for name in states}
    ops: dict[str, list[float]] = {name: [] for name in states}
    calls: dict[str, int] = dict.fromkeys(states, 0)
    for index in range(warm, warm + blocks):
        for name, state in states.items():
            wall, cpu, op_us, n = _block(model, state, cross[name], inputs, index)
            walls[name].append(wall * 1e3)
            cpus[name].append(cpu * 1e3)
            ops[name].append(op_us / 1e3)
            calls[name] += n
    return {
        name: {
            "block_wall_ms_median": statistics.median(walls[name]),
            "block_wall_ms": walls[name],
            "block_thread_cpu_ms_median": statistics.median(cpus[name]),
            "op_ms_per_block": statistics.median(ops[name]),
            "op_ms_min": min(ops[name]),
            "op_ms": ops[name],
            "op_calls_per_block": calls[name] / blocks,
        }
        for name in states
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--side", type=int, default=16, help="latent height = width (patch 2x2)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument(
        "--backend",
        default="cpu:reference,cpu:sdpa",
        help="comma-separated diffusion-kv backends for the session layers (platform:name)",
    )
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
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    for backend in backends:
        if not backend.startswith("cpu:"):
            parser.error(f"--backend {backend!r}: this benchmark runs on the cpu platform (cpu:NAME)")
    with M.environment(), torch.no_grad():
        model = M.lingbot(shape, seed=0)
        layout = M.lingbot_layout(shape)
        inputs = M.LingBotInputs(shape, seed=1)
        states: dict[str, Any] = {"vllm_omni": M.host_state(layout)}
        chosen: dict[str, list[str]] = {}
        for backend in backends:
            cache = M.dkv_cache(layout, backend=backend.split(":", 1)[1])
            chosen[backend] = [b.name for b in cache.worker.backends]
            states[f"diffusion_kv[{backend}]"] = cache.state("s0")
        results = _interleaved(model, states, inputs, args.blocks, warm)
        for backend, names in chosen.items():
            results[f"diffusion_kv[{backend}]"]["backends"] = names
    host = results["vllm_omni"]
    ratios = {
        name: {
            "block_wall": r["block_wall_ms_median"] / host["block_wall_ms_median"],
            "op_time": r["op_ms_per_block"] / host["op_ms_per_block"],
            "op_time_min": r["op_ms_min"] / host["op_ms_min"],
            "block_thread_cpu": r["block_thread_cpu_ms_median"] / host["block_thread_cpu_ms_median"],
        }
        for name, r in results.items()
        if name != "vllm_omni"
    }
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
        "ratios": ratios,
        "target_op_ratio": 0.5,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    for name, r in results.items():
        print(
            f"{name:28s} block {r['block_wall_ms_median']:8.2f} ms (thread CPU {r['block_thread_cpu_ms_median']:8.2f})"
            f"  op {r['op_ms_per_block']:8.2f} ms/block (min {r['op_ms_min']:7.2f})"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

"""Per-chunk time of a session stream on the GPU: every cuda backend against a contiguous window.

    PYTHONPATH=. python benchmarks/profile_session_gpu.py [--layers N] [--chunks N] [--profile]
        [--sync-debug] [--backends paged,sdpa,triton] [--out DIR]

The bench's Wan-1.3B-like session shape (``diffusion_kv.bench.session.WAN13B``: 12 heads x 128,
hidden 1536, 4,680-token chunks, block 128, sink 1 chunk, window 4 chunks, 512 text tokens, 4
denoise steps, bf16), ``--layers`` of its 30 layers, for ``--chunks`` chunks (default 8: the
window fills at chunk 5, so three chunks slide). Each way runs its own stream, one after the
other (one way's cache on the device at a time):

* ``paged:<backend>`` -- ``diffusion_kv.models.session.PagedStream`` on ``cuda:<backend>``;
* ``contiguous`` -- one preallocated buffer per layer, sink + window + chunk, SDPA
  (FlashAttention / cuDNN) over the filled prefix (``ContiguousStream``): the dense baseline.

Printed per chunk: each way's wall time (append, every denoise step, commit; the device
synchronised at the end of the chunk). Written under ``--out`` (default ``session-profile``):
``chunks.json`` (the per-chunk times, medians before and after the window filled, each way's
last-chunk output against the contiguous one's, the cards, torch and Triton versions), and with

* ``--profile``: for one steady chunk (after the timed ones) of each way, a torch.profiler table
  of the top CUDA kernels and of the top CPU ops by self time (``profile-<way>.txt``, and the
  rows in ``profile.json``);
* ``--sync-debug``: one steady chunk of each paged way under
  ``torch.cuda.set_sync_debug_mode("warn")``: every call that synchronised the device with the
  host, counted by its source line (``sync.json``). None is expected inside the per-layer path.

Needs nothing but torch and this package (imported from the working tree with ``PYTHONPATH=.``;
no entry points are read: the platform is built directly). ``--platform cpu`` runs the same on
the CPU (``--shape small`` for a quick smoke; backends ``sdpa,reference``).

On the CPU a token gather of a planned group's visible keys (``SdpaRowGroup.tokens``) was
measured against a view of the whole live blocks with the bool mask (1 thread, float32, one row;
``query_len x live blocks x page, heads x head size``): 64 x 16 x 16, 4 x 64: gather 219 us, view +
mask 255 us; 24 x 5 x 16, 2 x 8: 27 / 31 us; 256 x 40 x 16, 4 x 64: 1.84 / 2.06 ms; 512 x 40 x 64,
8 x 64: 42.8 / 41.2 ms (a loaded machine) -- no slower, so the CPU keeps a view only where it needs
no mask.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from diffusion_kv.bench.session import SMALL, WAN13B
from diffusion_kv.models.session import (
    ContiguousStream,
    PagedStream,
    SessionConfig,
    build_session_model,
    session_inputs,
)
from diffusion_kv.models.session_dit import cross_attention_context
from diffusion_kv.platforms.interface import Platform


def _platform(name: str) -> Platform:
    if name == "cuda":
        from diffusion_kv.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from diffusion_kv.platforms.cpu import CpuPlatform

    return CpuPlatform()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _table(prof: Any, key: str, limit: int) -> tuple[str, list[dict[str, Any]]]:
    events = prof.key_averages()
    text = events.table(sort_by=key, row_limit=limit)
    rows = []
    for e in sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:limit]:
        rows.append(
            {
                "name": e.key,
                "count": e.count,
                "self_cpu_us": e.self_cpu_time_total,
                "self_device_us": getattr(e, "self_device_time_total", 0.0),
            }
        )
    return text, rows


def run_way(
    way: str,
    cfg: SessionConfig,
    platform: Platform,
    device: torch.device,
    args: argparse.Namespace,
    out: Path,
) -> dict[str, Any]:
    """One way's stream: ``chunks`` timed chunks, then the profiled and sync-checked ones."""
    model = build_session_model(cfg, device)
    text, noise = session_inputs(cfg, device)
    cross = cross_attention_context(model, text)
    extra = int(args.profile) + int(args.sync_debug)
    chunks = cfg.chunks
    times: list[float] = []
    result: dict[str, Any] = {"way": way}
    last = None
    with torch.no_grad():
        if way == "contiguous":
            stream: Any = ContiguousStream(model, cfg, cross, device)
        else:
            stream = PagedStream(model, cfg, cross, device, platform)
            result["served_by"] = sorted({f"{platform.name}:{type(b).name}" for b in stream.worker.backends})

        def chunk(i: int) -> torch.Tensor:
            latent: torch.Tensor = stream.run(i, noise[i])[0]
            return latent

        for i in range(chunks - extra):
            t0 = time.perf_counter()
            last = chunk(i)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            print(f"  {way:>14} chunk {i:2d}: {times[-1]:8.1f} ms", flush=True)
        i = chunks - extra
        if args.sync_debug and way != "contiguous" and device.type == "cuda":
            sites: Counter[str] = Counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    chunk(i)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            for w in caught:
                sites[f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}"] += 1
            _sync(device)
            result["sync_sites"] = dict(sites.most_common())
            print(f"  {way:>14} chunk {i:2d}: {sum(sites.values())} synchronising calls", flush=True)
            i += 1
        elif args.sync_debug:  # keep the chunk indices of every way alike
            chunk(i)
            i += 1
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            _sync(device)
            with profile(activities=acts) as prof:
                chunk(i)
                _sync(device)
            dev_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
            dev_text, dev_rows = _table(prof, dev_key, args.top)
            cpu_text, cpu_rows = _table(prof, "self_cpu_time_total", args.top)
            name = way.replace(":", "-")
            (out / f"profile-{name}.txt").write_text(
                f"{way}: chunk {i}, top device kernels by self time\n{dev_text}\n\n"
                f"{way}: chunk {i}, top CPU ops by self time\n{cpu_text}\n"
            )
            result["profile"] = {"chunk": i, "device": dev_rows, "cpu": cpu_rows}
            print(f"  {way:>14} chunk {i:2d}: profiled -> {out / f'profile-{name}.txt'}", flush=True)
        if way != "contiguous":
            result["pool_full_after"] = stream.end()
    filled = cfg.window_filled_at
    result["chunk_ms"] = times
    result["median_filling_ms"] = (
        statistics.median(times[1:filled]) if len(times) > 2 and filled > 1 else None
    )
    result["median_steady_ms"] = statistics.median(times[filled:]) if len(times) > filled else None
    result["last_output"] = last.float().cpu() if last is not None else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=("wan13b", "small"), default="wan13b")
    ap.add_argument("--layers", type=int, default=None, help="layers of the shape to run (default: all)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--backends", default=None, help="comma-separated (default cuda: paged,sdpa,triton)")
    ap.add_argument("--no-contiguous", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sync-debug", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="session-profile")
    args = ap.parse_args()

    platform = _platform(args.platform)
    device = platform.device()
    shape = dict(WAN13B if args.shape == "wan13b" else SMALL)
    shape["chunks"] = args.chunks + int(args.profile) + int(args.sync_debug)  # the untimed ones last
    shape["repeats"] = 1
    shape.pop("modes", None)
    if args.layers is not None:
        shape["layers"] = args.layers
    if args.steps is not None:
        shape["steps"] = args.steps
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = (
        args.backends or ("paged,sdpa,triton" if args.platform == "cuda" else "sdpa,reference")
    ).split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "shape": {k: v for k, v in shape.items()},
        "dtype": str(dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    print(json.dumps(meta), flush=True)
    ways = [f"paged:{b}" for b in backends] + ([] if args.no_contiguous else ["contiguous"])
    results: dict[str, dict[str, Any]] = {}
    t_all = time.perf_counter()
    for way in ways:
        backend = way.split(":", 1)[1] if way.startswith("paged:") else None
        cfg = SessionConfig(**shape, dtype=dtype, backend=backend)
        print(f"{way}:", flush=True)
        try:
            results[way] = run_way(way, cfg, platform, device, args, out)
            gc.collect()  # the way's cache and model go before the next way's are made
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:  # a backend this machine cannot run: recorded, the others go on
            results[way] = {"way": way, "error": f"{type(exc).__name__}: {exc}"}
            print(f"  {way}: {results[way]['error']}", flush=True)
    base = results.get("contiguous", {}).get("last_output")
    for r in results.values():
        o = r.pop("last_output", None)
        if base is not None and o is not None:
            r["last_output_max_abs_diff_vs_contiguous"] = float((o - base).abs().max())
    meta["wall_s"] = time.perf_counter() - t_all
    print("\nway             filling median   steady median   (ms per chunk)")
    for way, r in results.items():
        if "error" in r:
            continue
        f, s = r["median_filling_ms"], r["median_steady_ms"]
        print(f"{way:>14}  {f if f is None else round(f, 1)!s:>15}  {s if s is None else round(s, 1)!s:>14}")
    profiles = {w: r.pop("profile") for w, r in results.items() if "profile" in r}
    syncs = {w: r.pop("sync_sites") for w, r in results.items() if "sync_sites" in r}
    (out / "chunks.json").write_text(json.dumps({"meta": meta, "ways": results}, indent=1))
    if profiles:
        (out / "profile.json").write_text(json.dumps(profiles, indent=1))
    if syncs:
        (out / "sync.json").write_text(json.dumps(syncs, indent=1))
    print(f"written under {out}/ in {meta['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()

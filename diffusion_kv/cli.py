"""The ``diffusion-kv`` command.

Exit codes: 0 success; 1 a selection or run error (message on stderr); 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from diffusion_kv.core.errors import PlatformError
from diffusion_kv.platforms.interface import Platform, Requirements
from diffusion_kv.platforms.selection import (
    ENV_PLATFORM,
    ENV_PLUGINS,
    PlatformStatus,
    available_platforms,
    discover,
    select_platform,
)

if TYPE_CHECKING:
    import torch

    from diffusion_kv.models.demo import DemoConfig

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _caps_line(status: PlatformStatus) -> str:
    caps = status.capabilities
    if caps is None:
        return "(not loaded)"
    heads = caps["head_sizes"] if caps["head_sizes"] == "any" else ",".join(map(str, caps["head_sizes"]))
    flags = [name for name in ("gqa", "ulysses", "dcp", "graph_capture") if caps[name]]
    if caps["host_lengths"]:
        flags.append("host_lengths")
    return (
        f"dtypes={','.join(caps['dtypes'])} head_sizes={heads} blocks={';'.join(caps['kernel_block_sizes'])} "
        f"(default {status.default_block_size}) slots={caps['slot_mapping_dtype']} "
        f"modes={','.join(caps['attention_modes'])} write={status.kv_write_policy} "
        f"flags={','.join(flags) or '-'}"
    )


def _cmd_platforms(args: argparse.Namespace) -> int:
    statuses = available_platforms()
    plugins = discover()
    error: str | None = None
    how = ""
    try:
        selection = select_platform(warn=lambda _m: None)
        selected, how = selection.platform.name, selection.how
    except PlatformError as exc:
        selected, error = None, str(exc)
    statuses = [PlatformStatus(**{**s.as_dict(), "selected": s.name == selected}) for s in statuses]
    if args.json:
        payload = {
            "entry_point_group": plugins.namespace,
            "allowlist": sorted(plugins.allowlist) if plugins.allowlist is not None else None,
            "allowlisted_not_installed": list(plugins.not_installed),
            "selected": selected,
            "selected_how": how,
            "error": error,
            "platforms": [s.as_dict() for s in statuses],
        }
        print(json.dumps(payload, indent=2, sort_keys=True))
    else:
        rows = [["NAME", "SELECTED", "AVAILABLE", "ENTRY POINT", "REASON"]]
        for s in statuses:
            rows.append(
                [
                    s.name + (" (reference)" if s.is_reference else ""),
                    "*" if s.selected else "",
                    "yes" if s.available else "no",
                    s.entry_point,
                    s.reason if s.error is None else "failed to load (see below)",
                ]
            )
        print(f"entry-point group: {plugins.namespace}")
        if plugins.allowlist is not None:
            print(f"{ENV_PLUGINS}: {','.join(sorted(plugins.allowlist))}")
            if plugins.not_installed:
                print(f"  allowlisted but not installed: {', '.join(plugins.not_installed)}")
        print(_table(rows))
        print()
        for s in statuses:
            print(f"{s.name}: {_caps_line(s)}")
        broken = [s for s in statuses if s.error is not None]
        if broken:
            print()
            print("plugins that failed to load:")
            for s in broken:
                print(f"  {s.name}: {s.error}")
        print()
        if selected is not None:
            print(f"selected: {selected} ({how})")
        if args.explain and selected is not None:
            platform = plugins.instance(selected)
            for line in platform.explain(Requirements()):
                print(f"  {line}")
    if error is not None:
        print(f"diffusion-kv: error: {error}", file=sys.stderr)
        print(
            f"  (set {ENV_PLATFORM}=<name> to choose, or {ENV_PLUGINS}=<names> to limit loading)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        import pytest
    except ImportError:
        print(
            "diffusion-kv: the conformance kit needs pytest: pip install 'diffusion-kv[test]'",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        platform = select_platform(args.platform, warn=lambda _m: None).platform
    except PlatformError as exc:
        print(f"diffusion-kv: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"conformance kit on platform {platform.name!r}", flush=True)
    argv = ["--pyargs", "diffusion_kv.conformance", "--dkv-platform", platform.name, "-p", "no:cacheprovider"]
    argv += ["-q"] if not args.verbose else ["-v"]
    return EXIT_OK if int(pytest.main([*argv, *args.pytest_args])) == 0 else EXIT_ERROR


DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def preferred_dtype(platform: Platform) -> torch.dtype:
    """float32 where the platform supports it, else bfloat16, else float16."""
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if dtype in platform.capabilities.dtypes:
            return dtype
    raise ValueError(f"platform {platform.name!r} supports none of float32, bfloat16, float16")


def _device_for_rank(device_type: str) -> torch.device:
    import os

    import torch

    if device_type in ("cuda", "npu"):
        return torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device_type)


def _cmd_demo_parallel(args: argparse.Namespace, platform: Platform, cfg: DemoConfig) -> int:
    """``demo --ulysses N`` / ``--cfg-parallel`` under torchrun: every rank runs, rank 0 reports."""
    import torch.distributed as dist

    from diffusion_kv.core.errors import DiffusionKVError
    from diffusion_kv.core.parallel import build_parallel_groups, init_distributed_from_env
    from diffusion_kv.models.demo import format_result, text_progress
    from diffusion_kv.models.parallel_demo import check_parallel_config, run_parallel_demo

    device_type = platform.capabilities.device_type
    try:
        check_parallel_config(cfg, args.ulysses, args.cfg_parallel)
        device = _device_for_rank(device_type)
        if device.type != "cpu":  # torch.cuda / torch.npu (registered by torch_npu)
            import torch

            accel = getattr(torch, device.type, None)
            if accel is not None and hasattr(accel, "set_device"):
                accel.set_device(device)
        world = init_distributed_from_env(device_type)
    except DiffusionKVError as exc:
        print(f"diffusion-kv: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    rank = world.rank
    try:
        try:
            groups = build_parallel_groups(args.ulysses, 2 if args.cfg_parallel else 1)
        except DiffusionKVError as exc:
            print(f"diffusion-kv: error (rank {rank}): {exc}", file=sys.stderr)
            return EXIT_ERROR
        show = rank == 0 and not args.json and not args.no_progress
        if show:
            print(
                f"diffusion-kv demo on platform {platform.name!r}, {world.size} ranks "
                f"(Ulysses {groups.ulysses.size} x CFG-parallel {groups.cfg.size})",
                file=sys.stderr,
            )
        result = run_parallel_demo(platform, cfg, groups, device, progress=text_progress() if show else None)
        if rank == 0:
            if args.json:
                print(json.dumps(result.as_dict(), indent=2, sort_keys=True))
            else:
                print(format_result(result))
        if not result.agree:
            if rank == 0:
                print(
                    f"diffusion-kv: error: dense and paged outputs disagree on some rank (max abs diff "
                    f"{result.max_abs_diff:.3g} > {result.tolerance:g})",
                    file=sys.stderr,
                )
            return EXIT_ERROR
        return EXIT_OK
    finally:
        dist.destroy_process_group()


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from diffusion_kv.models.demo import DemoConfig, format_result, run_demo, text_progress

    try:
        platform = select_platform(
            args.platform, warn=lambda m: print(f"warning: {m}", file=sys.stderr)
        ).platform
        cfg = DemoConfig(
            prefix_len=args.prefix,
            target_len=args.target,
            steps=args.steps,
            cfg_rows=args.cfg,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads or args.heads,
            layers=args.layers,
            block_size=args.block_size,
            dtype=getattr(torch, DTYPES[args.dtype]) if args.dtype else preferred_dtype(platform),
            max_model_len=args.max_model_len,
            seed=args.seed,
            inject_fault=args.inject_fault,
        )
    except (PlatformError, ValueError) as exc:
        print(f"diffusion-kv: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.ulysses != 1 or args.cfg_parallel:
        return _cmd_demo_parallel(args, platform, cfg)
    show = not args.json and not args.no_progress
    if show:
        print(f"diffusion-kv demo on platform {platform.name!r}", file=sys.stderr)
    result = run_demo(platform, cfg, progress=text_progress() if show else None)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, sort_keys=True))
    else:
        print(format_result(result))
    if not result.agree:
        print(
            f"diffusion-kv: error: dense and paged outputs disagree (max abs diff {result.max_abs_diff:.3g} > "
            f"{result.tolerance:g})",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from diffusion_kv.bench import BenchConfig, format_report, parse_list, run_bench, text_progress

    try:
        platform = select_platform(
            args.platform, warn=lambda m: print(f"warning: {m}", file=sys.stderr)
        ).platform
        config = BenchConfig(
            sizes=args.sizes,
            sections=parse_list(args.sections, str),
            regimes=parse_list(args.regimes, str),
            block_sizes=parse_list(args.block_sizes, int),
            cfgs=parse_list(args.cfg, int),
            gqa={"both": (False, True), "no": (False,), "only": (True,)}[args.gqa],
            dtype=getattr(torch, DTYPES[args.dtype]) if args.dtype else None,
            min_ms=args.min_ms,
        )
    except (PlatformError, ValueError) as exc:
        print(f"diffusion-kv: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    progress = None if args.no_progress else text_progress()
    if progress:
        progress(f"platform {platform.name!r}, sections {','.join(config.sections)}")
    try:
        report = run_bench(platform, config, progress)
    except ValueError as exc:
        print(f"diffusion-kv: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    text = json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    disagreements = [
        f"{r['case']} {variant}"
        for r in report.get("attention", [])
        for variant, p in r.get("paged", {}).items()
        if "agrees" in p and not p["agrees"]
    ]
    if "e2e" in report and not report["e2e"]["agrees"]:
        disagreements.append("tiny-DiT end to end")
    if report["errors"]:
        print(f"diffusion-kv: error: bench parts failed: {', '.join(report['errors'])}", file=sys.stderr)
        return EXIT_ERROR
    if disagreements:
        print(
            f"diffusion-kv: error: paged output disagrees with dense in: {', '.join(disagreements)}",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusion-kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("platforms", help="list installed platform plugins and the one that would be selected")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--explain", action="store_true", help="show how the selected platform picks its backend")
    p.set_defaults(func=_cmd_platforms)
    c = sub.add_parser("conformance", help="run the conformance kit (paged vs dense cases) on a platform")
    c.add_argument("--platform", default=None, help="platform name (default: automatic selection)")
    c.add_argument("-v", "--verbose", action="store_true")
    c.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    c.set_defaults(func=_cmd_conformance)
    d = sub.add_parser("demo", help="the main job: a tiny DiT denoised densely and through paged KV")
    d.add_argument("--platform", default=None, help="platform name (default: automatic selection)")
    d.add_argument("--prefix", type=int, default=1024, help="prefix (condition) tokens")
    d.add_argument("--target", type=int, default=256, help="target (generated) tokens")
    d.add_argument("--steps", type=int, default=8, help="denoise steps")
    d.add_argument("--cfg", type=int, default=2, choices=(1, 2), help="CFG rows (2: cond + uncond)")
    d.add_argument("--hidden", type=int, default=256)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads; fewer gives GQA)")
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--block-size", type=int, default=None, help="KV block size (default: the platform's)")
    d.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default: float32 where supported, else bfloat16/float16",
    )
    d.add_argument(
        "--max-model-len", type=int, default=4096, help="the dense cache's length for the memory comparison"
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument(
        "--inject-fault", action="store_true", help="testing aid: corrupt a cached block (must fail)"
    )
    d.add_argument(
        "--ulysses",
        type=int,
        default=1,
        help="strict Ulysses degree (heads sharded across ranks); launch with torchrun",
    )
    d.add_argument(
        "--cfg-parallel",
        action="store_true",
        help="run the 2 CFG branches on different ranks; launch with torchrun (world size = 2 x --ulysses)",
    )
    d.set_defaults(func=_cmd_demo)
    b = sub.add_parser(
        "bench", help="benchmarks: attention regimes, translation overhead, tiny-DiT end to end"
    )
    b.add_argument("--platform", default=None, help="platform name (default: automatic selection)")
    b.add_argument(
        "--sizes", choices=("auto", "small", "full"), default="auto", help="auto: full on CUDA, else small"
    )
    b.add_argument("--sections", default="attention,host,e2e", help="comma list of attention, host, e2e")
    b.add_argument("--regimes", default="A,B", help="attention regimes (A: compute-bound, B: memory-bound)")
    b.add_argument("--block-sizes", default="128,16")
    b.add_argument("--cfg", default="1,2", help="CFG branch counts")
    b.add_argument("--gqa", choices=("both", "no", "only"), default="both", help="GQA (8 KV heads) variants")
    b.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32"
    )
    b.add_argument("--min-ms", type=float, default=20.0, help="minimum duration of one timed repetition")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.add_argument("--output", default=None, help="also write the report to this file")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The ``diffusion-kv`` command.

Exit codes: 0 success; 1 a run error (platform unavailable or ambiguous, paged output disagreeing
with dense, a failed bench part, an internal error); 2 a usage error (any invalid argument value,
including what the selected platform cannot serve), found before any work starts; 130
interrupted. Every error is one line ``diffusion-kv: error: ...`` on stderr; with ``--json`` the
command also prints one JSON error object on stdout. ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.errors import (
    ConfigurationError,
    DiffusionKVError,
    PlatformError,
    PlatformNotFoundError,
    ValidationError,
)
from diffusion_kv.platforms.interface import AttentionMode, Platform, Requirements
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
EXIT_INTERRUPTED = 130
SECTION_NAMES = ("attention", "host", "e2e", "stream", "prefix-cache", "session")
KV_CACHE_DTYPE_NAMES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8")
"""``--kv-cache-dtype`` choices (``diffusion_kv.core.kv_quant``; ``fp8`` is ``fp8_e4m3``)."""
"""``bench --sections`` choices (``diffusion_kv.bench.SECTIONS``, not imported: it loads torch)."""


class UsageError(Exception):
    """An invalid argument value (exit 2)."""


class RunError(Exception):
    """A failure after the arguments were accepted (exit 1)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument raises :class:`UsageError` (one line, exit 2) instead of
    printing the usage text."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _fail(code: int, message: str, kind: str, as_json: bool) -> int:
    print(f"diffusion-kv: error: {_one_line(message)}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": {"kind": kind, "message": _one_line(message), "exit_code": code}}))
    return code


# --- argument types: every value is checked while parsing ---------------------------------------


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _list_of(
    item: Callable[[str], Any], choices: Sequence[Any] | None = None
) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma list without empty items, got {text!r}")
        values = tuple(item(p) for p in parts)
        if choices is not None:
            bad = [v for v in values if v not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown value(s) {', '.join(map(str, bad))}; choose from {', '.join(map(str, choices))}"
                )
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"lists a value twice: {text!r}")
        return values

    parse.__name__ = "comma list"
    return parse


def _select(name: str | None, warn: Callable[[str], None] | None = None) -> Platform:
    """The platform for a command: an unknown ``--platform`` is a usage error, an unusable one a
    run error."""
    try:
        return select_platform(name, warn=warn).platform
    except PlatformNotFoundError as exc:
        if name is not None:
            raise UsageError(f"argument --platform: {exc}") from exc
        raise RunError(str(exc)) from exc
    except PlatformError as exc:
        raise RunError(str(exc)) from exc


def _stderr_warning(message: str) -> None:
    print(f"warning: {_one_line(message)}", file=sys.stderr)


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
    if isinstance(heads, str) and len(heads) > 40:
        heads = f"{caps['head_sizes'][0]}..{caps['head_sizes'][-1]} ({len(caps['head_sizes'])} sizes)"
    flags = [name for name in ("gqa", "ulysses", "dcp", "graph_capture") if caps[name]]
    backends = ", ".join(
        f"{b['name']}[{b['priority']}]{'' if b['available'] else ' (unavailable)'}" for b in status.backends
    )
    return (
        f"dtypes={','.join(caps['dtypes'])} head_sizes={heads} blocks={';'.join(caps['kernel_block_sizes'])} "
        f"(default {status.default_block_size}) slots={','.join(caps['slot_mapping_dtypes'])} "
        f"kv_cache={','.join(caps.get('kv_cache_dtypes', ['auto']))} "
        f"modes={','.join(caps['attention_modes'])} flags={','.join(flags) or '-'} backends={backends or '-'}"
    )


def _cmd_platforms(args: argparse.Namespace) -> int:
    statuses = available_platforms()
    plugins = discover()
    error: str | None = None
    how = ""
    try:
        selection = select_platform(warn=lambda _m: None)
        selected, how = selection.platform.name, selection.how
    except ConfigurationError:
        raise  # an unusable DIFFUSION_KV_BACKEND: its one line, not the table
    except PlatformError as exc:
        selected, error = None, str(exc)
    statuses = [PlatformStatus(**{**s.as_dict(), "selected": s.name == selected}) for s in statuses]
    if args.json:
        payload = {
            "entry_point_group": plugins.namespace,
            "allowlist": sorted(plugins.allowlist) if plugins.allowlist is not None else None,
            "allowlisted_not_installed": list(plugins.not_installed),
            "backend_allowlist": (
                sorted(plugins.backend_allowlist) if plugins.backend_allowlist is not None else None
            ),
            "blocked_backends": sorted(plugins.blocked_backends),
            "left_out_backends": [{"name": n, "why": why} for n, why in plugins.left_out_backends],
            "selected": selected,
            "selected_how": how,
            "error": error,
            "platforms": [s.as_dict() for s in statuses],
            "skipped_entry_points": [
                *(
                    {
                        "kind": "platform",
                        "name": r.name,
                        "entry_point": r.entry_point,
                        "group": plugins.namespace,
                        "distribution": " | ".join(r.distributions),
                        "error": str(r.error),
                    }
                    for r in plugins.shadowed
                ),
                *(
                    {
                        "kind": "backend",
                        "name": r.name,
                        "platform": r.platform,
                        "entry_point": r.entry_point,
                        "group": plugins.backend_namespace,
                        "distribution": r.distribution,
                        "error": str(r.error),
                    }
                    for r in plugins.broken_backends()
                ),
            ],
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
                hint = " (a backend entry point: see DIFFUSION_KV_BACKEND_PLUGINS)"
                shown = [n + (hint if n in plugins.misplaced else "") for n in plugins.not_installed]
                print(f"  allowlisted but not installed: {', '.join(shown)}")
        if plugins.backend_allowlist is not None:
            print(f"DIFFUSION_KV_BACKEND_PLUGINS: {','.join(sorted(plugins.backend_allowlist))}")
        if plugins.blocked_backends:
            print(f"DIFFUSION_KV_BLOCKED_BACKENDS: {','.join(sorted(plugins.blocked_backends))}")
        for name, why in plugins.left_out_backends:
            print(f"  backend entry point {name!r} left out: {why}")
        print(_table(rows))
        print()
        for s in statuses:
            print(f"{s.name}{f' — {s.description}' if s.description else ''}: {_caps_line(s)}")
        broken = [s for s in statuses if s.error is not None]
        broken_backends = plugins.broken_backends()
        if broken or plugins.shadowed or broken_backends:
            print()
            print("plugins that failed to load:")
            for s in broken:
                print(f"  {s.name}: {s.error}")
            for r in plugins.shadowed:
                print(f"  {r.name} (skipped entry point): {r.error}")
            for b in broken_backends:
                print(f"  {b.name} (backend, skipped): {b.error}")
        noted = [s for s in statuses if s.notes]
        if noted:
            print()
            print("plugin warnings:")
            for s in noted:
                for note in s.notes:
                    print(f"  {s.name}: {note}")
        print()
        if selected is not None:
            print(f"selected: {selected} ({how})")
        if args.explain and selected is not None:
            platform = plugins.instance(selected)
            for line in platform.explain(Requirements()):
                print(f"  {line}")
    if error is not None:
        print(
            f"diffusion-kv: error: {_one_line(error)} (set {ENV_PLATFORM}=<name> to choose, or "
            f"{ENV_PLUGINS}=<names> to limit loading)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


class _Interrupts:
    """A pytest plugin noting Ctrl-C: pytest turns it into its exit code 2, which it also uses
    for collection errors."""

    def __init__(self) -> None:
        self.seen = False

    def pytest_keyboard_interrupt(self) -> None:
        self.seen = True


_REWRITE_WARNING = "Module already imported so cannot be rewritten; diffusion_kv"  # pytest escapes it


def _option_value(argv: Sequence[str], option: str) -> str | None:
    """The value of ``option`` in pytest arguments (``--opt V`` or ``--opt=V``; the last wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(option + "="):
            value = arg[len(option) + 1 :]
    return value


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        import pytest
    except ImportError:
        raise RunError("the conformance kit needs pytest: pip install 'diffusion-kv[test]'") from None
    from diffusion_kv.conformance.plugin import backend_under_test

    platform = _select(args.platform, warn=lambda _m: None)
    option = _option_value(args.pytest_args, "--dkv-backend")
    if args.backend is not None:
        if option is not None and option != args.backend:
            raise UsageError(
                f"--backend {args.backend} and -- --dkv-backend {option} name different backends"
            )
        _backend_choice(platform, args.backend)
        option = args.backend
    try:
        backend, source = backend_under_test(platform, option)
    except DiffusionKVError as exc:
        if option is None:
            raise  # DIFFUSION_KV_BACKEND's: a configuration error (exit 1), not an argument's
        raise UsageError(str(exc)) from exc
    shown = repr(backend.name) if backend is not None else "none usable here"
    print(f"conformance kit on platform {platform.name!r}, backend {shown} ({source})", flush=True)
    argv = ["--pyargs", "diffusion_kv.conformance", "--dkv-platform", platform.name, "-p", "no:cacheprovider"]
    argv += ["-q"] if not args.verbose else ["-v"]
    # This command imported diffusion_kv before pytest could mark it for assertion rewriting (an
    # installed distribution with a pytest11 entry point gets its top-level package marked); the
    # kit's own modules are imported later and rewritten, so the warning says nothing here.
    argv += ["-W", f"ignore:{_REWRITE_WARNING}:pytest.PytestAssertRewriteWarning"]
    if args.backend is not None and _option_value(args.pytest_args, "--dkv-backend") is None:
        argv += ["--dkv-backend", args.backend]

    interrupts = _Interrupts()
    code = int(pytest.main([*argv, *args.pytest_args], plugins=[interrupts]))
    if interrupts.seen:
        raise KeyboardInterrupt
    if code == int(pytest.ExitCode.USAGE_ERROR):
        raise UsageError(f"pytest refused the arguments {args.pytest_args} (its message is above)")
    return EXIT_OK if code == 0 else EXIT_ERROR


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
    raise UsageError(
        f"platform {platform.name!r} supports none of float32, bfloat16, float16; choose --dtype"
    )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1]; got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1]; got {text!r}")
    return value


def _demo_config(args: argparse.Namespace, platform: Platform) -> DemoConfig:
    """The demo's configuration, or a UsageError naming every problem with the arguments."""
    import torch

    from diffusion_kv.models.demo import DemoConfig

    problems: list[str] = []
    kv_heads = args.kv_heads if args.kv_heads is not None else args.heads
    if args.hidden % args.heads:
        problems.append(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    elif (args.hidden // args.heads) % 2:
        problems.append(f"head size --hidden/--heads = {args.hidden // args.heads} must be even (RoPE)")
    if args.heads % kv_heads:
        problems.append(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads}")
    if args.prefix + args.target > args.max_model_len:
        problems.append(
            f"--prefix {args.prefix} + --target {args.target} exceeds --max-model-len {args.max_model_len}"
        )
    if args.ulysses > 1 and (args.heads % args.ulysses or kv_heads % args.ulysses):
        problems.append(
            f"--heads {args.heads} and --kv-heads {kv_heads} must be divisible by --ulysses {args.ulysses}"
        )
    if args.cfg_parallel and args.cfg != 2:
        problems.append(f"--cfg-parallel needs --cfg 2 (one branch per rank); got --cfg {args.cfg}")
    block = args.block_size if args.block_size is not None else platform.default_block_size
    if args.dcp > 1 and (args.ulysses > 1 or args.cfg_parallel):
        problems.append("the demo runs --dcp on its own; drop --ulysses/--cfg-parallel")
    if args.dcp_interleave > 1 and args.dcp == 1:
        problems.append("--dcp-interleave needs --dcp N > 1")
    elif args.dcp > 1 and block % args.dcp_interleave:
        problems.append(f"--dcp-interleave {args.dcp_interleave} must divide the block size {block}")
    if problems:
        raise UsageError("; ".join(problems))
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else preferred_dtype(platform)
    requirements = Requirements(
        dtype=dtype,
        head_size=args.hidden // args.heads,
        num_heads=args.heads // args.ulysses,
        num_kv_heads=kv_heads // args.ulysses,
        block_size=block,
        attention_modes=frozenset({AttentionMode.CAUSAL, AttentionMode.PIECEWISE}),
        ulysses_degree=args.ulysses,
        dcp_size=args.dcp,
        kv_cache_dtype=_kv_cache_dtype(args.kv_cache_dtype, dtype),
    )
    backend = _backend_choice(platform, args.backend)
    if backend is not None:
        reasons = platform.backend_reasons(backend, requirements)
        if reasons:
            raise UsageError(
                f"backend {platform.name}:{backend.name} cannot serve this demo: " + "; ".join(reasons)
            )
    reasons = platform.not_supported_reasons(requirements)
    if reasons:
        raise UsageError(f"platform {platform.name!r} cannot serve this demo: " + "; ".join(reasons))
    return DemoConfig(
        backend=args.backend,
        prefix_len=args.prefix,
        target_len=args.target,
        steps=args.steps,
        cfg_rows=args.cfg,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=kv_heads,
        layers=args.layers,
        block_size=args.block_size,
        dtype=dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        inject_fault=args.inject_fault,
        kv_cache_dtype=requirements.kv_cache_dtype,
    )


def _backend_choice(platform: Platform, name: str | None) -> type[PagedBackend] | None:
    """``--backend NAME``: the platform's backend of that name (None when not given), or a
    UsageError naming the platform's backends."""
    if name is None:
        return None
    backends = platform.candidate_backends()
    for backend in backends:
        if backend.name == name:
            return backend
    names = ", ".join(b.name for b in backends) or "none"
    raise UsageError(
        f"argument --backend: platform {platform.name!r} has no backend {name!r} (backends: {names})"
    )


def _kv_cache_dtype(name: str, dtype: Any) -> Any:
    """``--kv-cache-dtype`` for a model computing in ``dtype`` (None: the model's own), or a
    UsageError."""
    from diffusion_kv.core.errors import ValidationError
    from diffusion_kv.core.kv_quant import parse_kv_cache_dtype, resolve_cache_dtype

    try:
        return resolve_cache_dtype(dtype, parse_kv_cache_dtype(name), "--kv-cache-dtype")
    except ValidationError as exc:
        raise UsageError(str(exc)) from exc


def _cmd_demo_parallel(args: argparse.Namespace, platform: Platform, cfg: DemoConfig) -> int:
    """``demo --ulysses N`` / ``--cfg-parallel`` / ``--dcp N`` under torchrun: every rank runs,
    rank 0 reports."""
    import torch.distributed as dist

    from diffusion_kv.core.parallel import (
        ParallelGroups,
        RankGroup,
        build_parallel_groups,
        init_distributed_from_env,
    )
    from diffusion_kv.models.demo import format_result
    from diffusion_kv.models.parallel_demo import check_parallel_config, run_parallel_demo
    from diffusion_kv.progress import ProgressDisplay, demo_progress

    if "WORLD_SIZE" not in os.environ:
        raise UsageError("--ulysses N, --cfg-parallel and --dcp N run under torchrun (WORLD_SIZE is not set)")
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise UsageError(
            f"--ulysses N, --cfg-parallel and --dcp N run under torchrun ({', '.join(missing)} not set); "
            "launch with torchrun --nproc-per-node N"
        )
    world = args.dcp if args.dcp > 1 else args.ulysses * (2 if args.cfg_parallel else 1)
    if os.environ["WORLD_SIZE"].strip() != str(world):
        split = (
            f"--dcp {args.dcp}"
            if args.dcp > 1
            else f"--ulysses {args.ulysses}" + (" x 2 (--cfg-parallel)" if args.cfg_parallel else "")
        )
        raise UsageError(
            f"{split} needs a world of {world} ranks; torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} "
            f"(use torchrun --nproc-per-node {world})"
        )
    try:
        check_parallel_config(cfg, args.ulysses, args.cfg_parallel, args.dcp, args.dcp_interleave)
        device = platform.device_for_rank(int(os.environ.get("LOCAL_RANK", "0")))
        if device.type != "cpu":  # torch.cuda / torch.npu (registered by torch_npu)
            import torch

            accel = getattr(torch, device.type, None)
            if accel is not None and hasattr(accel, "set_device"):
                accel.set_device(device)
        world = init_distributed_from_env(platform.distributed_backend)
    except DiffusionKVError as exc:
        raise RunError(str(exc)) from exc
    rank = world.rank
    try:
        dcp: RankGroup | None = None
        try:
            if args.dcp > 1:  # the whole world is one DCP group (the core's default group)
                if world.size != args.dcp:
                    raise ValidationError(
                        f"--dcp {args.dcp} needs a world of {args.dcp} ranks; got {world.size}"
                    )
                groups = ParallelGroups(world, RankGroup.single(), RankGroup.single())
                dcp = world
            else:
                groups = build_parallel_groups(args.ulysses, 2 if args.cfg_parallel else 1)
        except DiffusionKVError as exc:
            print(f"diffusion-kv: error (rank {rank}): {exc}", file=sys.stderr)
            return EXIT_ERROR
        display = ProgressDisplay(enabled=rank == 0 and not args.json and not args.no_progress)
        split = (
            f"DCP {args.dcp}, interleave {args.dcp_interleave}"
            if dcp is not None
            else f"Ulysses {groups.ulysses.size} x CFG-parallel {groups.cfg.size}"
        )
        display.say(f"diffusion-kv demo on platform {platform.name!r}, {world.size} ranks ({split})")
        result = run_parallel_demo(
            platform,
            cfg,
            groups,
            device,
            progress=demo_progress(display) if display.enabled else None,
            dcp=dcp,
            dcp_interleave=args.dcp_interleave,
        )
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


def _cmd_demo_stream(args: argparse.Namespace, cfg: DemoConfig, platform: Platform) -> int:
    """``demo --stream N``: N requests of mixed shapes served together (continuous batching)."""
    from diffusion_kv.models.stream import StreamConfig, format_stream, run_stream
    from diffusion_kv.progress import ProgressDisplay, stream_progress

    problems = []
    if args.ulysses != 1 or args.cfg_parallel or args.dcp != 1:
        problems.append("--stream runs on one device; drop --ulysses/--cfg-parallel/--dcp")
    if args.inject_fault:
        problems.append("--inject-fault applies to the single-request demo only")
    if args.target < 2:
        problems.append("--stream needs --target >= 2 (requests use the target or half of it)")
    if args.shared_prefixes is not None and args.shared_prefixes > args.stream:
        problems.append(
            f"--shared-prefixes {args.shared_prefixes} is more than the {args.stream} requests of --stream"
        )
    caching = args.prefix_caching if args.prefix_caching is not None else args.shared_prefixes is not None
    if args.max_cached_blocks is not None and not caching:
        problems.append(
            f"--max-cached-blocks {args.max_cached_blocks} caps the prefix cache, which is off here "
            "(add --prefix-caching or --shared-prefixes K)"
        )
    if problems:
        raise UsageError("; ".join(problems))
    stream_cfg = StreamConfig(
        requests=args.stream,
        prefix_len=cfg.prefix_len,
        target_len=cfg.target_len,
        steps=cfg.steps,
        hidden=cfg.hidden,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        layers=cfg.layers,
        block_size=cfg.block_size,
        dtype=cfg.dtype,
        seed=cfg.seed,
        arrival_gap=args.arrival_gap,
        max_running=args.max_running,
        pool_fraction=args.pool_fraction,
        shared_prefixes=args.shared_prefixes,
        prefix_caching=args.prefix_caching,
        max_cached_blocks=args.max_cached_blocks,
        kv_cache_dtype=cfg.kv_cache_dtype,
        backend=cfg.backend,
    )
    display = ProgressDisplay(enabled=not args.json and not args.no_progress)
    display.say(
        f"diffusion-kv demo --stream {args.stream} on platform {platform.name!r}: the requests one after "
        "another, then served together"
    )
    result = run_stream(platform, stream_cfg, progress=stream_progress(display) if display.enabled else None)
    display.close()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, sort_keys=True))
    else:
        print(format_stream(result))
    if not result.agree:
        print(
            "diffusion-kv: error: a request's paged output disagrees with its dense run "
            + (
                f"(max abs diff {result.max_abs_diff:.3g} > {result.tolerance:g})"
                if result.kv_cache_dtype == "auto"
                else f"(cosine similarity {result.min_cosine_similarity:.6f} below the fp8 bound)"
            ),
            file=sys.stderr,
        )
        return EXIT_ERROR
    if result.prefix_cache is not None and not result.prefix_cache["agrees"]:
        print(
            "diffusion-kv: error: the stream with prefix caching disagrees with the uncached stream (max abs "
            f"diff {result.prefix_cache['max_abs_diff_vs_uncached']:.3g} > {result.tolerance:g})",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


SESSION_ONLY = ("chunks", "chunk_tokens", "window", "sink", "text_tokens")


def _session_config(args: argparse.Namespace, platform: Platform) -> Any:
    """``demo --session``: its configuration, or a UsageError naming every problem."""
    import torch

    from diffusion_kv.core.sessions import SessionPolicy
    from diffusion_kv.models.session import SessionConfig

    problems = []
    if args.stream is not None:
        problems.append("--session and --stream are two modes; give one")
    if args.ulysses != 1 or args.cfg_parallel or args.dcp != 1:
        problems.append("--session runs on one device; drop --ulysses/--cfg-parallel/--dcp")
    if args.inject_fault:
        problems.append("--inject-fault applies to the single-request demo only")
    if args.kv_cache_dtype != "auto":
        problems.append("--session keeps its pages in the model's dtype; drop --kv-cache-dtype")
    kv_heads = args.kv_heads if args.kv_heads is not None else args.heads
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        problems.append(
            f"--hidden {args.hidden} must divide by --heads {args.heads} into an even head size (RoPE)"
        )
    if args.heads % kv_heads:
        problems.append(f"--heads {args.heads} must be a multiple of --kv-heads {kv_heads}")
    if problems:
        raise UsageError("; ".join(problems))
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else preferred_dtype(platform)
    chunk = args.chunk_tokens if args.chunk_tokens is not None else 64
    window = args.window if args.window is not None else 3
    sink = args.sink if args.sink is not None else 1
    mask = SessionPolicy(chunk, window, sink).mask
    block = args.block_size if args.block_size is not None else platform.default_block_size
    requirements = Requirements(
        dtype=dtype,
        head_size=args.hidden // args.heads,
        num_heads=args.heads,
        num_kv_heads=kv_heads,
        block_size=block,
        attention_modes=mask.required_modes,
        window=mask.window,
        sink=mask.sink,
    )
    backend = _backend_choice(platform, args.backend)
    if backend is not None:
        reasons = platform.backend_reasons(backend, requirements)
        if reasons:
            raise UsageError(
                f"backend {platform.name}:{backend.name} cannot serve the session's {mask.describe()} mask: "
                + "; ".join(reasons)
            )
    reasons = platform.not_supported_reasons(requirements)
    if reasons:
        raise UsageError(
            f"platform {platform.name!r} cannot serve the session's {mask.describe()} mask: "
            + "; ".join(reasons)
        )
    try:
        return SessionConfig(
            chunks=args.chunks if args.chunks is not None else 16,
            chunk_tokens=chunk,
            window_chunks=window,
            sink_chunks=sink,
            steps=args.steps if args.steps is not None else 4,
            branches=args.cfg if args.cfg is not None else 1,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=kv_heads,
            layers=args.layers if args.layers is not None else 2,
            text_tokens=args.text_tokens if args.text_tokens is not None else 16,
            block_size=args.block_size,
            dtype=dtype,
            seed=args.seed,
            backend=args.backend,
        )
    except ValidationError as exc:
        raise UsageError(str(exc)) from exc


def _cmd_demo_session(args: argparse.Namespace) -> int:
    """``demo --session``: a stream of chunks through a paged session, against recomputing the
    visible context and a torch.cat rolling cache."""
    from diffusion_kv.models.session import format_session, run_session
    from diffusion_kv.progress import ProgressDisplay, demo_progress

    platform = _select(args.platform, warn=_stderr_warning)
    cfg = _session_config(args, platform)
    display = ProgressDisplay(enabled=not args.json and not args.no_progress)
    display.say(
        f"diffusion-kv demo --session on platform {platform.name!r}: {cfg.chunks} chunks, paged / recompute / "
        "torch.cat interleaved, then the dense oracle"
    )
    result = run_session(platform, cfg, progress=demo_progress(display) if display.enabled else None)
    display.close()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, sort_keys=True))
    else:
        print(format_session(result))
    if not result.agrees and result.agrees_as_dense is not True:
        print(
            f"diffusion-kv: error: the paged session disagrees with the dense oracle over the same mask (max abs "
            f"diff {result.max_abs_diff:.3g} > atol {result.tolerance['atol']:g} + rtol {result.tolerance['rtol']:g})",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if not result.pool_full_after:
        print(
            f"diffusion-kv: error: blocks left held after the sessions: {result.pool_checks}", file=sys.stderr
        )
        return EXIT_ERROR
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from diffusion_kv.models.demo import format_result, run_demo
    from diffusion_kv.progress import ProgressDisplay, demo_progress

    if args.session:
        return _cmd_demo_session(args)
    given = [f"--{n.replace('_', '-')}" for n in SESSION_ONLY if getattr(args, n) is not None]
    if given:
        raise UsageError(f"{', '.join(given)} applies to --session only")
    args.steps = args.steps if args.steps is not None else 8
    args.cfg = args.cfg if args.cfg is not None else 2
    args.layers = args.layers if args.layers is not None else 4
    platform = _select(args.platform, warn=_stderr_warning)
    cfg = _demo_config(args, platform)
    if args.stream is not None:
        return _cmd_demo_stream(args, cfg, platform)
    stream_only = [
        flag
        for flag, value in (
            ("--shared-prefixes", args.shared_prefixes),
            ("--prefix-caching", args.prefix_caching),
            ("--max-cached-blocks", args.max_cached_blocks),
        )
        if value is not None
    ]
    if stream_only:
        raise UsageError(f"{', '.join(stream_only)} applies to --stream only")
    if args.ulysses != 1 or args.cfg_parallel or args.dcp != 1:
        return _cmd_demo_parallel(args, platform, cfg)
    display = ProgressDisplay(enabled=not args.json and not args.no_progress)
    display.say(f"diffusion-kv demo on platform {platform.name!r}")
    result = run_demo(platform, cfg, progress=demo_progress(display) if display.enabled else None)
    display.close()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, sort_keys=True))
    else:
        print(format_result(result))
    if not result.agree:
        why = (
            f"max abs diff {result.max_abs_diff:.3g} > {result.tolerance:g}"
            if result.kv_cache_dtype == "auto"
            else f"final-latent cosine similarity {result.cosine_similarity:.6f} below the {result.kv_cache_dtype} "
            "bound 0.999"
        )
        print(f"diffusion-kv: error: dense and paged outputs disagree ({why})", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _check_writable(path: str) -> None:
    """Refuse an output path that cannot be written, before any work (nothing is left behind)."""
    existed = os.path.exists(path)
    if os.path.isdir(path):
        raise UsageError(f"argument --output: {path!r} is a directory")
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise UsageError(f"argument --output: cannot write {path!r}: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)


def _plot(report: dict[str, Any], path: str) -> None:
    from diffusion_kv.bench.plot import plot_report

    try:
        written = plot_report(report, path)
    except DiffusionKVError as exc:
        raise RunError(str(exc)) from exc
    print(f"[bench] picture written to {written}", file=sys.stderr)


def _plot_saved_report(args: argparse.Namespace) -> int:
    """``bench --from-report FILE --plot OUT``: draw a saved JSON report, run nothing."""
    if not args.plot:
        raise UsageError("--from-report draws a saved report: give --plot FILE.png|FILE.svg too")
    try:
        with open(args.from_report, encoding="utf-8") as fh:
            report = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--from-report {args.from_report!r}: cannot read a JSON report ({exc})") from exc
    if not isinstance(report, dict):
        raise UsageError(f"--from-report {args.from_report!r}: not a bench report (a JSON object)")
    _plot(report, args.plot)
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from diffusion_kv.bench import BenchConfig, format_report, run_bench
    from diffusion_kv.progress import ProgressDisplay, bench_progress

    if args.output:
        _check_writable(args.output)
    if args.plot:
        from diffusion_kv.bench.plot import check_plot_path

        try:
            check_plot_path(args.plot)
        except DiffusionKVError as exc:
            raise UsageError(str(exc)) from exc
    if args.from_report:
        return _plot_saved_report(args)
    platform = _select(args.platform, warn=_stderr_warning)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    problems = []
    if dtype is not None and dtype not in platform.capabilities.dtypes:
        problems.append(
            f"--dtype {args.dtype} (supported: {sorted(str(d).removeprefix('torch.') for d in platform.capabilities.dtypes)})"
        )
    if dtype is None:  # the bench's default, as run_bench picks it: refused here, before any work
        default = torch.bfloat16 if platform.device().type == "cuda" else torch.float32
        if default not in platform.capabilities.dtypes:
            supported = sorted(str(d).removeprefix("torch.") for d in platform.capabilities.dtypes)
            problems.append(
                f"the default dtype {str(default).removeprefix('torch.')} (supported: {supported}; choose --dtype)"
            )
    bad_blocks = [b for b in args.block_sizes if not platform.capabilities.supports_block_size(b)]
    if bad_blocks:
        rules = ", ".join(str(r) for r in platform.capabilities.kernel_block_sizes)
        problems.append(f"--block-sizes {','.join(map(str, bad_blocks))} (supported: {rules})")
    from diffusion_kv.core.kv_quant import QUANTIZED_CACHE_DTYPES, cache_dtype_name, parse_kv_cache_dtype

    cache_dtype = parse_kv_cache_dtype(args.kv_cache_dtype)
    quantized: tuple[Any, ...] = ()
    if cache_dtype is not None and cache_dtype not in QUANTIZED_CACHE_DTYPES:
        problems.append(
            f"--kv-cache-dtype {args.kv_cache_dtype}: the bench measures 16-bit pages in the model's dtype always; "
            "this option adds a quantised cache dtype (fp8_e4m3) beside them"
        )
    elif cache_dtype is not None:
        if cache_dtype not in platform.capabilities.kv_cache_dtypes:
            problems.append(
                f"--kv-cache-dtype {cache_dtype_name(cache_dtype)} (no backend of the platform declares it)"
            )
        quantized = (cache_dtype,)
    if problems:
        raise UsageError(f"platform {platform.name!r} cannot serve " + "; ".join(problems))
    _backend_choice(platform, args.backend)
    try:
        config = BenchConfig(
            sizes=args.sizes,
            sections=args.sections,
            regimes=args.regimes,
            block_sizes=args.block_sizes,
            cfgs=args.cfg,
            gqa={"both": (False, True), "no": (False,), "only": (True,)}[args.gqa],
            dtype=dtype,
            min_ms=args.min_ms,
            kv_cache_dtypes=quantized,
            backend=args.backend,
            session_shape=args.session_shape,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    display = ProgressDisplay(enabled=not args.no_progress)
    progress = bench_progress(display) if display.enabled else None
    isolate = args.isolate == "on" or (
        args.isolate == "auto" and platform.device().type == "cuda" and len(config.sections) > 1
    )
    display.say(
        f"[bench] platform {platform.name!r}, sections {','.join(config.sections)}"
        + (" (one process per section)" if isolate else "")
    )
    if isolate:
        report = _bench_isolated(args, platform.name, config.sections)
    else:
        try:
            report = run_bench(platform, config, progress)
        except ValueError as exc:
            raise RunError(str(exc)) from exc
    text = json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    if args.plot:
        _plot(report, args.plot)
    disagreements = [
        f"{r['case']} {variant}"
        for r in report.get("attention", [])
        for variant, p in r.get("paged", {}).items()
        if "agrees" in p and not p["agrees"]
    ]
    if "e2e" in report and not report["e2e"]["agrees"]:
        disagreements.append("tiny-DiT end to end")
    if "stream" in report and not report["stream"]["agree"]:
        disagreements.append("stream (a request disagrees with its dense run)")
    if "prefix-cache" in report and not report["prefix-cache"]["agrees"]:
        disagreements.append("prefix cache (cached and uncached runs differ)")
    if "session" in report and not report["session"]["agrees_as_dense"]:
        # beyond the kit's tolerance of the oracle and further from it than the dense ways of the
        # same run (a deep 16-bit stack drifts from a float32 oracle whichever way attends)
        disagreements.append("session (a paged chunk differs from the dense oracle over the same mask)")
    if "session" in report and not report["session"]["pool_full_after"]:
        report["errors"]["session"] = (
            f"blocks left held after the sessions: {report['session']['pool_checks']}"
        )
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


def _bench_child_argv(args: argparse.Namespace, platform: str, section: str, output: str) -> list[str]:
    """The ``bench`` command line of one section in its own process: every measurement option
    of ``args``, that section only, JSON to ``output``, no further isolation."""
    argv = [sys.executable, "-m", "diffusion_kv.cli", "bench", "--platform", platform]
    argv += ["--sections", section, "--sizes", args.sizes, "--isolate", "off", "--json", "--output", output]
    argv += ["--regimes", ",".join(args.regimes), "--block-sizes", ",".join(map(str, args.block_sizes))]
    argv += ["--cfg", ",".join(map(str, args.cfg)), "--gqa", args.gqa, "--min-ms", repr(args.min_ms)]
    argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    for flag, value in (
        ("--backend", args.backend),
        ("--dtype", args.dtype),
        ("--session-shape", args.session_shape),
    ):
        if value is not None:
            argv += [flag, value]
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def _bench_isolated(args: argparse.Namespace, platform: str, sections: Sequence[str]) -> dict[str, Any]:
    """Run each bench section in a fresh interpreter and merge the reports: no section measures
    in a process another one changed (on CUDA the profiler's CUPTI subscription, the caching
    allocator's pools, compiled kernels and library state all outlive a section). A child that
    writes no report becomes an error of its section; the others still run."""
    import subprocess
    import tempfile

    merged: dict[str, Any] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dkv-bench-") as tmp:
        for section in sections:
            out = os.path.join(tmp, f"{section}.json")
            # the child's progress and messages go straight to this stderr; its report to ``out``
            proc = subprocess.run(
                _bench_child_argv(args, platform, section, out), stdout=subprocess.DEVNULL, check=False
            )
            if not os.path.exists(out):
                errors[section] = (
                    f"the section's process wrote no report (exit status {proc.returncode}; its messages above)"
                )
                continue
            with open(out, encoding="utf-8") as fh:
                part = json.load(fh)
            errors.update(part.pop("errors", {}) or {})
            for key, value in part.items():
                merged.setdefault(key, value)
    if not merged:
        raise RunError(
            "no bench section produced a report: " + "; ".join(f"{k}: {v}" for k, v in errors.items())
        )
    merged["errors"] = errors
    merged["isolated_sections"] = list(sections)
    return merged


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser = _Parser(prog="diffusion-kv", description=__doc__.splitlines()[0], parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "platforms",
        help="list installed platform plugins and the one that would be selected",
        parents=[common],
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--explain", action="store_true", help="show how the selected platform picks its backend")
    p.set_defaults(func=_cmd_platforms)
    c = sub.add_parser(
        "conformance", help="run the conformance kit (paged vs dense cases) on a platform", parents=[common]
    )
    c.add_argument("--platform", default=None, help="platform name (default: automatic selection)")
    c.add_argument(
        "--backend",
        default=None,
        help="the backend under test (default: DIFFUSION_KV_BACKEND, else the platform's first available)",
    )
    c.add_argument("-v", "--verbose", action="store_true")
    c.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    c.set_defaults(func=_cmd_conformance)
    d = sub.add_parser(
        "demo", help="the main job: a tiny DiT denoised densely and through paged KV", parents=[common]
    )
    d.add_argument("--platform", default=None, help="platform name (default: automatic selection)")
    d.add_argument(
        "--backend", default=None, help="the platform's paged backend to use (default: its priority list)"
    )
    d.add_argument("--prefix", type=positive_int, default=1024, help="prefix (condition) tokens")
    d.add_argument("--target", type=positive_int, default=256, help="target (generated) tokens")
    d.add_argument("--steps", type=positive_int, default=None, help="denoise steps (default 8; --session: 4)")
    d.add_argument(
        "--cfg",
        type=int,
        default=None,
        choices=(1, 2),
        help="CFG rows (2: cond + uncond; default 2, --session: 1)",
    )
    d.add_argument("--hidden", type=positive_int, default=256)
    d.add_argument("--heads", type=positive_int, default=4)
    d.add_argument(
        "--kv-heads", type=positive_int, default=None, help="KV heads (default: --heads; fewer gives GQA)"
    )
    d.add_argument("--layers", type=positive_int, default=None, help="default 4; --session: 2")
    d.add_argument(
        "--block-size", type=positive_int, default=None, help="KV block size (default: the platform's)"
    )
    d.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default: float32 where supported, else bfloat16/float16",
    )
    d.add_argument(
        "--max-model-len",
        type=positive_int,
        default=4096,
        help="the dense cache's length for the memory comparison",
    )
    d.add_argument("--seed", type=non_negative_int, default=0)
    d.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPE_NAMES,
        default="auto",
        help="the pages' dtype: auto (the model's), or fp8_e4m3 (1 byte per element, per-KV-head scales "
        "1.0; agreement then checked by cosine similarity >= 0.999); the selected backend must declare it",
    )
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument(
        "--inject-fault", action="store_true", help="testing aid: corrupt a cached block (must fail)"
    )
    d.add_argument(
        "--ulysses",
        type=positive_int,
        default=1,
        help="strict Ulysses degree (heads sharded across ranks); launch with torchrun",
    )
    d.add_argument(
        "--cfg-parallel",
        action="store_true",
        help="run the 2 CFG branches on different ranks; launch with torchrun (world size = 2 x --ulysses)",
    )
    d.add_argument(
        "--dcp",
        type=positive_int,
        default=1,
        metavar="N",
        help="decode context parallelism: every row's KV interleaved across N ranks, partial attention "
        "merged by log-sum-exp; launch with torchrun (world size = N); not combined with --ulysses or "
        "--cfg-parallel",
    )
    d.add_argument(
        "--dcp-interleave",
        type=positive_int,
        default=1,
        metavar="I",
        help="--dcp: consecutive tokens each rank holds in turn (must divide the block size)",
    )
    d.add_argument(
        "--stream",
        type=positive_int,
        default=None,
        metavar="N",
        help="serve N requests of mixed shapes together (prefix up to --prefix, none included; target "
        "--target or half; --steps +-2; 1 or 2 CFG rows), each checked against its own dense run",
    )
    d.add_argument(
        "--arrival-gap", type=non_negative_int, default=1, help="--stream: scheduler steps between arrivals"
    )
    d.add_argument(
        "--max-running", type=positive_int, default=8, help="--stream: requests stepped together at most"
    )
    d.add_argument(
        "--pool-fraction",
        type=_fraction,
        default=0.6,
        help="--stream: block pool as a fraction of what all requests need at once (below 1: back-pressure)",
    )
    d.add_argument(
        "--shared-prefixes",
        type=positive_int,
        default=None,
        metavar="K",
        help="--stream: every request has the full prefix, drawn from K distinct ones, and two CFG rows; "
        "served with prefix caching and compared with the same stream without it (hits, blocks saved, "
        "evictions, peak blocks held, throughput, agreement)",
    )
    d.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--stream: serve with the prefix cache (default: on with --shared-prefixes, off otherwise)",
    )
    d.add_argument(
        "--max-cached-blocks",
        type=non_negative_int,
        default=None,
        metavar="B",
        help="--stream: cap on the blocks the prefix cache keeps (default: the pool is the only limit)",
    )
    d.add_argument(
        "--session",
        action="store_true",
        help="a stream of chunks through a paged session (chunk-causal, sink + window, cross-attention to a "
        "short text), per chunk against recomputing the visible context and a torch.cat rolling cache, checked "
        "against a dense oracle over the same mask",
    )
    d.add_argument(
        "--chunks", type=positive_int, default=None, metavar="N", help="--session: chunks (default 16)"
    )
    d.add_argument(
        "--chunk-tokens",
        type=positive_int,
        default=None,
        metavar="C",
        help="--session: tokens per chunk (default 64)",
    )
    d.add_argument(
        "--window",
        type=non_negative_int,
        default=None,
        metavar="W",
        help="--session: window chunks (default 3)",
    )
    d.add_argument(
        "--sink", type=non_negative_int, default=None, metavar="S", help="--session: sink chunks (default 1)"
    )
    d.add_argument(
        "--text-tokens", type=positive_int, default=None, help="--session: text context tokens (default 16)"
    )
    d.set_defaults(func=_cmd_demo)
    b = sub.add_parser(
        "bench",
        help="benchmarks: attention regimes, translation overhead, tiny-DiT end to end",
        parents=[common],
    )
    b.add_argument("--platform", default=None, help="platform name (default: automatic selection)")
    b.add_argument("--backend", default=None, help="measure this paged backend only (default: every backend)")
    b.add_argument(
        "--sizes", choices=("auto", "small", "full"), default="auto", help="auto: full on CUDA, else small"
    )
    b.add_argument(
        "--sections",
        type=_list_of(str, SECTION_NAMES),
        default=SECTION_NAMES,
        help="comma list of attention, host, e2e, stream, prefix-cache, session",
    )
    b.add_argument(
        "--session-shape",
        choices=("small", "medium", "wan13b"),
        default=None,
        help="the session section's shape (default: wan13b with full sizes, else small; medium is a second CPU "
        "shape: hidden 512, 128-token chunks, 4 layers; wan13b is a GPU shape: "
        "30 layers, 12 heads x 128, 1560 tokens per frame, 3-frame chunks, sink 1, window 4)",
    )
    b.add_argument(
        "--regimes",
        type=_list_of(str, ("A", "B")),
        default=("A", "B"),
        help="attention regimes (A: compute-bound, B: memory-bound)",
    )
    b.add_argument("--block-sizes", type=_list_of(positive_int), default=(128, 16))
    b.add_argument("--cfg", type=_list_of(int, (1, 2)), default=(1, 2), help="CFG branch counts (1, 2)")
    b.add_argument("--gqa", choices=("both", "no", "only"), default="both", help="GQA (8 KV heads) variants")
    b.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32"
    )
    b.add_argument(
        "--min-ms", type=positive_float, default=20.0, help="minimum duration of one timed repetition"
    )
    b.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPE_NAMES,
        default="auto",
        help="fp8_e4m3: also measure e4m3 pages beside the model dtype's (attention variants with their "
        "error against 16-bit pages, end-to-end latent difference, stream capacity at equal pool memory)",
    )
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.add_argument("--output", default=None, help="also write the report to this file")
    b.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="also draw the report (.png or .svg; needs matplotlib: pip install 'diffusion-kv[plot]')",
    )
    b.add_argument(
        "--from-report",
        default=None,
        metavar="JSON",
        help="with --plot: draw a saved --json report, run nothing",
    )
    b.add_argument(
        "--isolate",
        choices=("auto", "on", "off"),
        default="auto",
        help="run each section in its own process (auto: on a CUDA device with several sections, so no "
        "section measures in a process an earlier one changed)",
    )
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; see the module docstring for exit codes and error output."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except UsageError as exc:
        return _fail(EXIT_USAGE, str(exc), "usage", as_json)
    except KeyboardInterrupt:
        print("diffusion-kv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RunError, DiffusionKVError) as exc:
        if debug:
            raise
        return _fail(EXIT_ERROR, str(exc), "error", as_json)
    except Exception as exc:
        if debug:
            raise
        message = f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
        return _fail(EXIT_ERROR, message, "internal", as_json)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

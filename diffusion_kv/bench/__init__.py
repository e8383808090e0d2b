"""``diffusion-kv bench``: attention regimes, translation host overhead, tiny-DiT end to end,
continuous batching (stream), prefix caching (prefix-cache), autoregressive sessions (session).

Sizes: ``full`` (the issue's regime A/B shapes; meant for a GPU) or ``small`` (the same
structure at sizes a CPU finishes in seconds: CI's smoke run). ``auto`` picks ``full`` on CUDA.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform as _pyplatform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_kv.core.translate import resolve_device
from diffusion_kv.platforms.interface import Platform

SECTIONS = ("attention", "host", "e2e", "stream", "prefix-cache", "session")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    sizes: str = "auto"
    sections: tuple[str, ...] = SECTIONS
    regimes: tuple[str, ...] = ("A", "B")
    block_sizes: tuple[int, ...] = (128, 16)
    cfgs: tuple[int, ...] = (1, 2)
    gqa: tuple[bool, ...] = (False, True)
    dtype: torch.dtype | None = None
    min_ms: float = 20.0
    host_iters: int = 200
    kv_cache_dtypes: tuple[torch.dtype, ...] = ()
    """Quantised cache dtypes measured beside the 16-bit pages (attention variants, end to end,
    stream capacity); empty: none."""
    backend: str | None = None
    """Measure this paged backend only (its name): the attention section's only variant, and the
    backend every other section's worker uses (None: every variant; the priority list picks)."""
    session_shape: str | None = None
    """The session section's shape: ``small`` or ``wan13b`` (None: ``wan13b`` for full sizes,
    else ``small``)."""

    def __post_init__(self) -> None:
        if self.sizes not in ("auto", "small", "full"):
            raise ValueError(f"sizes must be auto, small or full; got {self.sizes!r}")
        unknown = [s for s in self.sections if s not in SECTIONS]
        if unknown or not self.sections:
            raise ValueError(
                f"unknown or empty sections {unknown or list(self.sections)}; expected some of {SECTIONS}"
            )
        if any(b <= 0 for b in self.block_sizes) or any(c not in (1, 2) for c in self.cfgs):
            raise ValueError(
                f"block sizes must be positive and CFG 1 or 2; got {self.block_sizes}, {self.cfgs}"
            )


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": _pyplatform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    try:  # package metadata only: the bench does not import vendor modules
        env["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        env["triton"] = None
    return env


def run_bench(platform: Platform, config: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    from diffusion_kv.bench import attention, e2e, host, prefix, session, stream

    say = progress or (lambda _m: None)
    device = resolve_device(platform.device())
    sizes = config.sizes if config.sizes != "auto" else ("full" if device.type == "cuda" else "small")
    dtype = config.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dtype not in platform.capabilities.dtypes:
        raise ValueError(f"platform {platform.name!r} does not support {dtype}")
    report: dict[str, Any] = {
        "platform": platform.name,
        "sizes": sizes,
        "dtype": str(dtype).removeprefix("torch."),
        "environment": environment(device),
        "backends": [b.name for b in platform.candidate_backends()],
        "backend_choice": config.backend,
    }
    if "attention" in config.sections:
        bw = attention.copy_bandwidth(device)
        report["copy_bandwidth_gbs"] = bw
        cases = attention.attention_cases(
            sizes, regimes=config.regimes, block_sizes=config.block_sizes, cfgs=config.cfgs, gqa=config.gqa
        )
        results = []
        for i, case in enumerate(cases):
            say(f"attention {i + 1}/{len(cases)}: {case.name}")
            try:
                results.append(
                    attention.run_case(
                        platform,
                        case,
                        device,
                        dtype,
                        bw,
                        min_ms=config.min_ms,
                        kv_cache_dtypes=config.kv_cache_dtypes,
                        backend=config.backend,
                    )
                )
            except Exception as exc:  # one failing case is reported; the others still run
                results.append({"case": case.name, "error": f"{type(exc).__name__}: {exc}"})
                say(f"  failed: {type(exc).__name__}: {exc}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["attention"] = results
    errors: dict[str, str] = {}
    if "host" in config.sections:
        say("host overhead: prepare and per-layer context")
        try:
            report["host"] = host.host_overhead(
                platform,
                device,
                dtype,
                tokens=4096,
                iters=config.host_iters,
                backend=config.backend,
                count_launches=False,  # the profiler pass runs last: see host.host_overhead
            )
        except Exception as exc:  # reported, and the command exits 1
            errors["host"] = f"{type(exc).__name__}: {exc}"
    whole_runs = (
        ("e2e", "tiny-DiT end to end", e2e.end_to_end),
        (
            "stream",
            "continuous batching: mixed requests served together vs one after another",
            stream.stream_throughput,
        ),
        (
            "prefix-cache",
            "prefix caching: hit vs miss prefill, a shared-prefix stream and a mix without sharing",
            prefix.prefix_cache_bench,
        ),
        (
            "session",
            "sessions: a stream of chunks, paged against recompute and a torch.cat rolling cache",
            session.session_bench,
        ),
    )
    for section, title, run in whole_runs:
        if section not in config.sections:
            continue
        say(title)
        try:
            extra: dict[str, Any] = {"backend": config.backend}
            if section in ("e2e", "stream"):
                extra["kv_cache_dtypes"] = config.kv_cache_dtypes
            if section == "session":
                extra["shape"] = config.session_shape
            report[section] = run(platform, device, dtype, sizes, **extra)
        except Exception as exc:  # reported, and the command exits 1
            errors[section] = f"{type(exc).__name__}: {exc}"
    if "host" in report:
        say("host overhead: kernels one prepare launches (torch profiler, after every timing)")
        try:
            host.count_prepare_launches(platform, device, dtype, report["host"], backend=config.backend)
        except Exception as exc:  # reported, and the command exits 1
            errors["host"] = f"{type(exc).__name__}: {exc}"
    errors.update({r["case"]: r["error"] for r in report.get("attention", []) if "error" in r})
    report["errors"] = errors
    return report


def _fmt_ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def format_report(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"platform {report['platform']} on {env.get('gpu') or env['device']} ({report['dtype']}, {report['sizes']} sizes, "
        f"torch {env['torch']}, triton {env.get('triton')}, {env['date']})",
    ]
    if "attention" in report:
        lines.append(f"copy bandwidth: {report['copy_bandwidth_gbs']:.0f} GB/s")
        lines.append("")
        lines.append("attention (ms; ratio = paged / best dense SDPA in this run)")
        for r in report["attention"]:
            if "error" in r:
                lines.append(f"  {r['case']}: FAILED: {r['error']}")
                continue
            best = r["best_dense"]
            lines.append(
                f"  {r['case']}: dense {best['backend']} {_fmt_ms(best['ms'])} ms ({best['tflops']:.3g} TFLOP/s)"
                + (
                    f", bandwidth bound {_fmt_ms(r['bandwidth_bound_ms'])} ms"
                    if "bandwidth_bound_ms" in r
                    else ""
                )
            )
            for variant, p in r["paged"].items():
                if "error" in p:
                    lines.append(f"    {variant}: {p['error']}")
                    continue
                via = f" [{p['backend']}]" if "backend" in p else ""
                lines.append(
                    f"    {variant}{via}: {_fmt_ms(p['ms'])} ms ({p['tflops']:.3g} TFLOP/s) "
                    f"ratio {p['ratio_vs_best_dense']:.2f}x"
                    + (
                        f", {p['ratio_vs_bandwidth_bound']:.2f}x bound"
                        if "ratio_vs_bandwidth_bound" in p
                        else ""
                    )
                    + (f", {p['ratio_vs_peer']:.2f}x the peer" if "ratio_vs_peer" in p else "")
                    + (
                        f", {p['ratio_vs_16bit_paged']:.2f}x its 16-bit pages; error vs them max "
                        f"{p['max_abs_err_vs_16bit_paged']:.3g} mean {p['mean_abs_err_vs_16bit_paged']:.3g} "
                        f"(cosine {p['cosine_vs_16bit_paged']:.6f})"
                        if "ratio_vs_16bit_paged" in p
                        else ""
                    )
                    + ("" if p["agrees"] else f"  DISAGREES (max diff {p['max_abs_diff']:.3g})")
                )
            peer = r.get("peer")
            if peer is not None:
                lines.append(
                    f"    peer {peer['name']}: "
                    + (
                        f"{_fmt_ms(peer['ms'])} ms ratio {peer['ratio_vs_best_dense']:.2f}x"
                        + ("" if peer["agrees"] else "  DISAGREES")
                        if "ms" in peer
                        else peer["error"]
                    )
                )
    if "host" in report:
        lines.append("")
        lines.append("translation host overhead (median)")
        for h in report["host"]:
            launches = h["launches"]
            extra = (
                f", {launches['kernels_total']} kernels ({launches['gather_slots']} gather+slots), "
                f"{launches['copies']} copies"
                if launches
                else ""
            )
            lines.append(
                f"  {h['rows']} rows x {h['tokens_per_row']} tokens: prepare {h['prepare_us']:.1f} us, "
                f"per-layer context {h['layer_context_us']:.1f} us{extra}"
            )
    if "e2e" in report:
        e = report["e2e"]
        s = e["shape"]
        lines.append("")
        lines.append(
            f"tiny-DiT end to end (prefix {s['prefix_len']} + target {s['target_len']}, hidden {s['hidden']}, "
            f"{s['layers']} layers, CFG {s['cfg_rows']}): dense step {_fmt_ms(e['dense_step_ms'])} ms, "
            f"paged step {_fmt_ms(e['paged_step_ms'])} ms{' (CUDA graph)' if e['paged_graphs'] else ''} -> "
            f"{e['speedup']:.2f}x; eager paged step {_fmt_ms(e['paged_eager_step_ms'])} ms -> "
            f"{e['speedup_eager']:.2f}x (target >= {e['target_speedup']:.2f}x; ideal {e['ideal_speedup']:.2f}x)"
            + ("" if e["agrees"] else f"  DISAGREES (max diff {e['max_abs_diff']:.3g})")
        )
        for name, qe in e.get("kv_cache_dtypes", {}).items():
            if "error" in qe:
                lines.append(f"  {name} pages: {qe['error']}")
                continue
            lines.append(
                f"  {name} pages: paged step {_fmt_ms(qe['paged_step_ms'])} ms -> {qe['speedup']:.2f}x dense, "
                f"{qe['ratio_vs_16bit_paged']:.2f}x the 16-bit paged step; KV {qe['kv_bytes_paged'] / 2**20:.1f} vs "
                f"{qe['kv_bytes_paged_16bit'] / 2**20:.1f} MiB; final latent cosine to 16-bit paged "
                f"{qe['cosine_vs_16bit_paged']:.6f} (bound >= {qe['cosine_bound']}), max abs diff "
                f"{qe['max_abs_diff_vs_16bit_paged']:.3g}" + ("" if qe["agrees"] else "  DISAGREES")
            )
    if "stream" in report:
        st = report["stream"]
        s, q = st["stream"], st["sequential"]
        lines.append("")
        lines.append(
            f"stream ({len(st['requests'])} mixed requests, up to {st['shape']['prefix_len']} + "
            f"{st['shape']['target_len']} tokens, hidden {st['shape']['hidden']}, {st['shape']['layers']} layers): "
            f"together {s['wall_ms']:.0f} ms ({s['requests_per_s']:.2f} req/s, up to {s['max_running']} at once), "
            f"one after another {q['wall_ms']:.0f} ms ({q['requests_per_s']:.2f} req/s) -> {st['speedup']:.2f}x "
            f"(same graph policy, captures apart: stream {s['capture_ms']:.0f} ms, one after another "
            f"{q['capture_ms']:.0f} ms; target >= {st['target_speedup']:.1f}x); peak blocks "
            f"{s['peak_blocks']}/{st['pool_blocks']}"
            + ("" if st["agree"] else f"  DISAGREES (max diff {st['max_abs_diff']:.3g})")
        )
        for name, cap in st.get("capacity", {}).items():
            a, b = cap["model_dtype"], cap[name]
            lines.append(
                f"  capacity at equal pool memory ({cap['pool_fraction']:.0%} of what the requests need in the model "
                f"dtype): {a['max_running']} requests at once ({a['pool_blocks']} blocks) vs {b['max_running']} with "
                f"{name} pages ({b['pool_blocks']} blocks) -> {cap['concurrency_ratio']:.2f}x"
            )
        if "eager" in st:
            ea = st["eager"]
            lines.append(
                f"  both eager: together {ea['stream']['wall_ms']:.0f} ms, one after another "
                f"{ea['sequential']['wall_ms']:.0f} ms -> {ea['speedup']:.2f}x"
            )
    if "prefix-cache" in report:
        from diffusion_kv.bench.prefix import format_prefix_cache

        lines.append("")
        lines.extend(format_prefix_cache(report["prefix-cache"]))
    if "session" in report:
        from diffusion_kv.bench.session import format_session_section

        lines.extend(format_session_section(report["session"]))
    for where, error in report.get("errors", {}).items():
        lines.append(f"error in {where}: {error}")
    return "\n".join(lines)


def parse_list(text: str, cast: Callable[[str], Any]) -> tuple[Any, ...]:
    return tuple(cast(x) for x in text.split(",") if x)


__all__: Sequence[str] = ("SECTIONS", "BenchConfig", "format_report", "run_bench")

"""Pictures of a bench report: ``diffusion-kv bench --plot FILE`` (PNG or SVG).

One panel per attention regime: per case, our best paged time, the FA3 paged peer's (where the
run had one) and the memory-bandwidth bound, each as a ratio to the best dense kernel of the same
run (1.0 = as fast as dense; lower is faster). A last panel shows the tiny-DiT end-to-end step:
dense recompute, paged eager and paged under CUDA-graph replay, in milliseconds. With a session
section, two more panels: per-chunk latency and KV memory against chunk index for the paged
session, recomputing the visible context and the torch.cat rolling cache (and the contiguous
window, where the run had it).

matplotlib is an optional dependency (``pip install "diffusion-kv[plot]"``); without it the bench
runs and only the picture is refused, with that fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diffusion_kv.core.errors import ValidationError

FORMATS = (".png", ".svg")


def check_plot_path(path: str) -> Path:
    """The picture's path: its suffix names the format and its folder must exist."""
    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise ValidationError(f"--plot {path!r}: the file name must end in .png or .svg")
    if not out.parent.exists():
        raise ValidationError(f"--plot {path!r}: folder {str(out.parent)!r} does not exist")
    return out


def _best_paged(case: Mapping[str, Any]) -> tuple[str, float] | None:
    best: tuple[str, float] | None = None
    for name, entry in case.get("paged", {}).items():
        ratio = entry.get("ratio_vs_best_dense")
        if ratio is not None and (best is None or ratio < best[1]):
            best = (name, float(ratio))
    return best


SESSION_LABELS = {
    "paged": "paged session",
    "recompute": "recompute visible context",
    "concat": "torch.cat rolling cache",
    "contiguous": "contiguous rolling window",
    "chunk_only": "the chunk alone (no context: the floor)",
}


def _plot_session(latency: Any, memory: Any, session: Mapping[str, Any]) -> None:
    """Per-chunk latency and KV memory against chunk index, one line per way."""
    s = session.get("shapes", {})
    for mode, times in session.get("chunk_ms", {}).items():
        latency.plot(range(len(times)), times, marker=".", label=SESSION_LABELS.get(mode, mode))
    for mode, held in session.get("kv_bytes", {}).items():
        memory.plot(
            range(len(held)), [b / 2**20 for b in held], marker=".", label=SESSION_LABELS.get(mode, mode)
        )
    if session.get("kv_bytes_bound"):
        memory.axhline(session["kv_bytes_bound"] / 2**20, color="grey", linestyle="--", label="paged bound")
    shape = (
        f"{s.get('chunks')} chunks of {s.get('chunk_tokens')} tokens, sink {s.get('sink_chunks')} + window "
        f"{s.get('window_chunks')}, {s.get('steps')} steps, {s.get('layers')} layers; {session.get('backend', '')}"
    )
    latency.set_title(f"session: latency per chunk ({shape})")
    latency.set_ylabel("ms per chunk")
    memory.set_title("session: KV memory held while each chunk runs")
    memory.set_ylabel("MiB")
    for ax in (latency, memory):
        ax.set_xlabel("chunk index")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_report(report: Mapping[str, Any], path: str) -> Path:
    """Draw ``report`` (the bench's JSON object) into ``path``; returns the path written."""
    out = check_plot_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValidationError(
            f"--plot needs matplotlib ({exc}); install it with: pip install 'diffusion-kv[plot]'"
        ) from None
    cases = list(report.get("attention", []))
    regimes = sorted({c["shape"]["regime"] for c in cases})
    e2e = report.get("e2e")
    session = report.get("session")
    panels = len(regimes) + (1 if e2e else 0) + (2 if session else 0)
    if panels == 0:
        raise ValidationError("--plot: the report has no attention, e2e or session section to draw")
    fig, axes = plt.subplots(panels, 1, figsize=(13, 3.8 * panels), squeeze=False)
    title = f"diffusion-kv bench on {report.get('platform', '?')}"
    env = report.get("environment", {})
    if env.get("gpu"):
        title += f" ({env['gpu']}, {report.get('dtype', '')}, {env.get('date', '')})"
    fig.suptitle(title)
    for ax, regime in zip([a[0] for a in axes], regimes, strict=False):
        rows = [c for c in cases if c["shape"]["regime"] == regime]
        labels = [c["case"].removeprefix(f"{regime} ") for c in rows]
        ours = [_best_paged(c) for c in rows]
        peer = [c.get("peer", {}).get("ratio_vs_best_dense") for c in rows]
        bound = [
            c["bandwidth_bound_ms"] / c["best_dense"]["ms"] if c.get("bandwidth_bound_ms") else None
            for c in rows
        ]
        x = list(range(len(rows)))
        width = 0.38
        ax.bar(
            [i - width / 2 for i in x],
            [o[1] if o else 0.0 for o in ours],
            width,
            label="diffusion-kv paged (best)",
        )
        if any(p is not None for p in peer):
            ax.bar([i + width / 2 for i in x], [p or 0.0 for p in peer], width, label="vLLM FA3 paged (peer)")
        if any(b is not None for b in bound):
            ax.scatter(
                x,
                [b if b is not None else float("nan") for b in bound],
                marker="_",
                s=300,
                color="black",
                label="bandwidth bound",
                zorder=3,
            )
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("time / best dense")
        ax.set_title(f"regime {regime}: paged attention against the best dense kernel (lower is faster)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if session:
        _plot_session(axes[-2][0], axes[-1][0], session)
    if e2e:
        ax = axes[len(regimes)][0]
        names = ["dense recompute", "paged eager", "paged CUDA graphs"]
        values = [
            e2e.get("dense_step_ms"),
            e2e.get("paged_eager_step_ms"),
            e2e.get("paged_step_ms") if e2e.get("paged_graphs") else None,
        ]
        shown = [(n, v) for n, v in zip(names, values, strict=True) if v is not None]
        bars = ax.bar(
            [n for n, _ in shown],
            [v for _, v in shown],
            color=["#999999", "#4c72b0", "#55a868"][: len(shown)],
        )
        for bar, (_, v) in zip(bars, shown, strict=True):
            ax.annotate(
                f"{v:.2f} ms",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        s = e2e.get("shape", {})
        ax.set_ylabel("ms per denoise step")
        ax.set_title(
            f"tiny DiT end to end (prefix {s.get('prefix_len')} + target {s.get('target_len')}, "
            f"{s.get('layers')} layers, CFG {s.get('cfg_rows')}): steady-state step"
        )
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out

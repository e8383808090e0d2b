"""Turn a ``diffusion-kv bench --json`` report into the Markdown tables of docs/benchmarks.md.

python benchmarks/report_md.py bench.json
"""

from __future__ import annotations

import json
import sys
from typing import Any


def attention_table(report: dict[str, Any]) -> list[str]:
    variants = report["backends"]
    head = "| case | best dense SDPA (ms, TFLOP/s) | " + " | ".join(f"{v} (ms, ratio)" for v in variants)
    head += " | vLLM FA3 peer (ms, ratio) | bandwidth bound (ms) |"
    lines = [head, "|" + " --- |" * (4 + len(variants))]
    for r in report["attention"]:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][:80]} |")
            continue
        best = r["best_dense"]
        cells = [f"{r['case']}", f"{best['backend']} {best['ms']:.3f}, {best['tflops']:.0f}"]
        for v in variants:
            p = r["paged"].get(v, {})
            if "ms" not in p:
                cells.append(p.get("error", "-")[:40])
                continue
            via = f" [{p['backend']}]" if "backend" in p and v == "paged" else ""
            flag = "" if p["agrees"] else " DISAGREES"
            vs_peer = f" ({p['ratio_vs_peer']:.2f}x FA3)" if "ratio_vs_peer" in p else ""
            cells.append(f"{p['ms']:.3f}, **{p['ratio_vs_best_dense']:.2f}x**{via}{vs_peer}{flag}")
        peer = r.get("peer", {})
        cells.append(
            f"{peer['ms']:.3f}, {peer['ratio_vs_best_dense']:.2f}x"
            if "ms" in peer
            else peer.get("error", "-")[:40]
        )
        cells.append(f"{r.get('bandwidth_bound_ms', float('nan')):.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as fh:
        report = json.load(fh)
    env = report["environment"]
    print(
        f"{env.get('gpu') or env['device']}, torch {env['torch']}, triton {env.get('triton')}, "
        f"CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, {report['dtype']}, {env['date']}; "
        f"copy bandwidth {report.get('copy_bandwidth_gbs', 0):.0f} GB/s\n"
    )
    if "attention" in report:
        print("\n".join(attention_table(report)))
    if "host" in report:
        print(
            "\n| rows x tokens | prepare (us) | per-layer context (us) | kernels in prepare (gather+slots) |"
        )
        print("| --- | --- | --- | --- |")
        for h in report["host"]:
            la = h["launches"]
            k = f"{la['kernels_total']} ({la['gather_slots']})" if la else "-"
            print(
                f"| {h['rows']} x {h['tokens_per_row']} | {h['prepare_us']:.1f} | {h['layer_context_us']:.1f} | {k} |"
            )
    if "e2e" in report:
        e = report["e2e"]
        print(
            f"\ntiny-DiT: {e['shape']} dense {e['dense_step_ms']:.2f} ms/step, paged {e['paged_step_ms']:.2f} ms/step, "
            f"speedup {e['speedup']:.2f}x (target {e['target_speedup']:.2f}x, ideal {e['ideal_speedup']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sweep the Triton paged kernel on regime B with 8 KV heads (GQA 4:1, the issue-41 shapes):
launch settings, the next-page prefetch and, over e4m3 pages, the ways of multiplying them
(``kernels.FP8_MODES``: widened, float16 MMAs, fp8 MMAs), each e4m3 way with its cosine
similarity to the same kernel over bf16 pages. Also regime A (4096 queries) over e4m3 pages.

The variants are compiled first in parallel worker processes (Triton's on-disk cache), then timed
one after another in this process. Needs a CUDA device.

    python benchmarks/sweep_gqa_fp8.py [--json OUT] [--workers 12] [--quick] [--mha]

``--mha``: regime B with 32 KV heads instead (MHA: 32-row query tiles, one head each), 16-bit
and e4m3 pages, every e4m3 way, key tile, stage count and split count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import torch

from diffusion_kv.bench.attention import attention_cases, dense_backends, dense_fn
from diffusion_kv.bench.timing import time_device

Config = dict[str, Any]


def shape(regime: str, cfg: int, gqa: bool = True) -> dict[str, int]:
    (case,) = attention_cases(
        "full", regimes=(regime,), block_sizes=(128,), cfgs=(cfg,), gqa=(gqa,), contiguous_regimes=()
    )
    return dict(
        rows=case.rows,
        heads=case.heads,
        kv_heads=case.kv_heads,
        head_size=case.head_size,
        prefix=case.prefix,
        target=case.target,
        page=128,
    )


def configs(quick: bool) -> list[Config]:
    out: list[Config] = []
    # 16-bit pages, regime B
    bn: tuple[int, ...] = (64, 128)
    warps: tuple[int, ...] = (8,)  # 4 warps lost everywhere at 128-row tiles (H200 sweep)
    stages: tuple[int, ...] = (2, 3, 4)
    splits: tuple[int, ...] = (2, 4, 8)
    if quick:
        bn, warps, stages, splits = (64,), (8,), (2, 3), (2, 4)
    for n, w, st, sp, pf in itertools.product(bn, warps, stages, splits, (False, True)):
        out.append(
            dict(regime="B", fp8=False, block_m=128, block_n=n, warps=w, stages=st, splits=sp, prefetch=pf)
        )
    # e4m3 pages, regime B: every way of multiplying them
    modes = [(0, 0), (1, 1), (2, 1), (2, 0)]
    for (qk, pv), n, st, sp in itertools.product(modes, (64, 128), (2, 3), (2, 4)):
        out.append(
            dict(
                regime="B",
                fp8=True,
                qk=qk,
                pv=pv,
                block_m=128,
                block_n=n,
                warps=8,
                stages=st,
                splits=sp,
                prefetch=True,
            )
        )
    # e4m3 pages, regime A (compute-bound: one query tile per 32 tokens x 4 heads, no split)
    for (qk, pv), n, st in itertools.product(modes, (64, 128), (2, 3)):
        out.append(
            dict(
                regime="A",
                fp8=True,
                qk=qk,
                pv=pv,
                block_m=128,
                block_n=n,
                warps=8,
                stages=st,
                splits=1,
                prefetch=True,
            )
        )
    return out


def configs_mha() -> list[Config]:
    """Regime B, MHA: 32-row tiles (the builder's: 4 warps), 16-bit and e4m3 pages."""
    out: list[Config] = []
    for n, st, sp in itertools.product((64, 128), (2, 3, 4), (2, 4, 8)):
        out.append(
            dict(regime="B", fp8=False, block_m=32, block_n=n, warps=4, stages=st, splits=sp, prefetch=True)
        )
    for (qk, pv), n, st, sp in itertools.product(
        [(0, 0), (1, 1), (1, 0), (2, 1)], (64, 128), (2, 3, 4), (2, 4, 8)
    ):
        out.append(
            dict(
                regime="B", fp8=True, qk=qk, pv=pv, block_m=32, block_n=n, warps=4, stages=st, splits=sp,
                prefetch=True,
            )
        )  # fmt: skip
    return out


class Problem:
    """One shape's pages (bf16 and e4m3 with scale 1), queries and tile schedule on the GPU."""

    def __init__(self, shp: dict[str, int], seed: int = 0) -> None:
        torch.manual_seed(seed)
        dev = torch.device("cuda")
        self.shape = shp
        R, H, Hkv, D = shp["rows"], shp["heads"], shp["kv_heads"], shp["head_size"]
        T, S, page = shp["target"], shp["prefix"] + shp["target"], shp["page"]
        nblk = -(-S // page)
        nb = R * nblk + 1
        self.k16 = torch.randn(nb, page, Hkv, D, device=dev, dtype=torch.bfloat16)
        self.v16 = torch.randn_like(self.k16)
        self.k8 = self.k16.to(torch.float8_e4m3fn)
        self.v8 = self.v16.to(torch.float8_e4m3fn)
        self.ones = torch.ones(Hkv, device=dev)
        self.table = torch.randperm(nb)[: R * nblk].view(R, nblk).to(torch.int32).to(dev)
        self.q = torch.randn(R * T, H, D, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.seq = torch.full((R,), S, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(0, (R + 1) * T, T, dtype=torch.int32, device=dev)
        self.group = H // Hkv
        self.R, self.T, self.S, self.nblk = R, T, S, nblk

    def schedule(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_tile = max(block_m // self.group, 1)
        rows = [r for r in range(self.R) for _ in range(0, self.T, per_tile)]
        q0s = [q0 for _ in range(self.R) for q0 in range(0, self.T, per_tile)]
        dev = self.q.device
        return torch.tensor(rows, dtype=torch.int32, device=dev), torch.tensor(
            q0s, dtype=torch.int32, device=dev
        )

    def runner(self, c: Config) -> Any:
        from diffusion_kv.platforms.cuda import kernels

        tr, tq = self.schedule(c["block_m"])
        fp8 = c["fp8"]
        kw: dict[str, Any] = dict(
            scale=self.shape["head_size"] ** -0.5,
            causal=False,
            block_m=c["block_m"],
            block_n=c["block_n"],
            num_splits=c["splits"],
            num_warps=c["warps"],
            num_stages=c["stages"],
            prefetch_pages=c["prefetch"],
        )
        if fp8:
            kw.update(k_scale=self.ones, v_scale=self.ones, qk_mode=c["qk"], pv_mode=c["pv"])
        k, v = (self.k8, self.v8) if fp8 else (self.k16, self.v16)

        def run() -> torch.Tensor:
            return kernels.paged_attention(
                self.q, k, v, self.out, self.table, self.seq, self.qsl, tr, tq, **kw
            )

        return run


def _small(shp: dict[str, int]) -> dict[str, int]:
    return dict(shp, rows=2, prefix=512 - shp["target"] if shp["target"] < 512 else 0)


def _compile_one(args: tuple[dict[str, int], Config]) -> str:
    shp, c = args
    try:
        Problem(_small(shp)).runner(c)()
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # out of shared memory etc.: reported when timed
        return f"{type(exc).__name__}: {str(exc)[:100]}"


def splits_check(min_ms: float) -> int:
    """Regime B GQA at CFG 1 and 2 with the builder's settings for 16-bit (64-key tiles, 4
    stages) and e4m3 pages (128-key tiles, 3 stages, fp8 Q.K^T), at 1 and 2 splits."""
    dev = torch.device("cuda")
    for cfg in (1, 2):
        prob = Problem(shape("B", cfg))
        for fp8 in (False, True):
            for sp in (1, 2):
                c: Config = dict(
                    fp8=fp8, block_m=128, block_n=128 if fp8 else 64, warps=8, stages=3 if fp8 else 4,
                    splits=sp, prefetch=True, qk=2, pv=1,
                )  # fmt: skip
                run = prob.runner(c)
                run()
                print(
                    f"B cfg{cfg} {'e4m3' if fp8 else 'bf16'} splits {sp}: {time_device(run, dev, min_ms=min_ms, reps=5):.4f} ms"
                )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--min-ms", type=float, default=5.0)
    ap.add_argument("--log", default=None, help="one line per timed variant, written as it goes")
    ap.add_argument(
        "--splits-check", action="store_true", help="only: the builder's GQA settings, 1 vs 2 splits"
    )
    ap.add_argument("--mha", action="store_true", help="regime B with 32 KV heads (MHA) instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.splits_check:
        return splits_check(args.min_ms)
    if args.mha:
        shapes = {("B", 1): shape("B", 1, gqa=False), ("B", 2): shape("B", 2, gqa=False)}
        cfgs = configs_mha()
    else:
        shapes = {("B", 1): shape("B", 1), ("B", 2): shape("B", 2), ("A", 1): shape("A", 1)}
        cfgs = configs(args.quick)
    t0 = time.perf_counter()
    jobs = [(shapes[(c["regime"], 1)], c) for c in cfgs]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = pool.map(_compile_one, jobs, chunksize=1)
    print(f"compiled {len(cfgs)} variants in {time.perf_counter() - t0:.0f} s", flush=True)
    dev = torch.device("cuda")
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 (kept open through the sweep)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "results": [], "dense": {}}
    for (regime, cfg), shp in shapes.items():
        prob = Problem(shp)
        key = f"{regime} cfg{cfg}"
        # dense SDPA on the same logical K/V (GQA flag), the bench's baseline
        k = prob.k16[prob.table.long()].reshape(prob.R, prob.nblk * shp["page"], shp["kv_heads"], -1)[
            :, : prob.S
        ]
        v = prob.v16[prob.table.long()].reshape(prob.R, prob.nblk * shp["page"], shp["kv_heads"], -1)[
            :, : prob.S
        ]
        dq = prob.q.view(prob.R, prob.T, shp["heads"], -1).transpose(1, 2)
        dense = {}
        for name, b in dense_backends(dev):
            try:
                fn = dense_fn(b, dq, k.transpose(1, 2), v.transpose(1, 2), shp["head_size"] ** -0.5, True)
                fn()
                dense[name] = time_device(fn, dev, min_ms=args.min_ms, reps=3)
            except RuntimeError:
                pass
        del k, v
        report["dense"][key] = dense
        ref16: torch.Tensor | None = None
        for c, err in zip(cfgs, errors, strict=True):
            if c["regime"] != regime or (
                cfg == 2 and c["fp8"] and c["regime"] == "B" and c["stages"] == 3 and not args.mha
            ):
                continue
            row: Config = dict(c, case=key)
            if err:
                row["error"] = err
                report["results"].append(row)
                continue
            run = prob.runner(c)
            try:
                prob.out.fill_(float("nan"))
                out = run().float().clone()
                row["ms"] = time_device(run, dev, min_ms=args.min_ms, reps=3)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                report["results"].append(row)
                continue
            if ref16 is None:
                from diffusion_kv.platforms.cuda import kernels

                r16 = torch.empty_like(prob.q)
                tr, tq = prob.schedule(128)
                kernels.paged_attention(
                    prob.q, prob.k16, prob.v16, r16, prob.table, prob.seq, prob.qsl, tr, tq,
                    scale=shp["head_size"] ** -0.5, causal=False, block_m=128, block_n=64,
                    num_splits=1, num_warps=8,
                )  # fmt: skip
                ref16 = r16.float()
            row["nan"] = bool(out.isnan().any())
            row["cos_vs_bf16_pages"] = torch.nn.functional.cosine_similarity(
                out.flatten(), ref16.flatten(), 0
            ).item()
            row["max_abs_vs_bf16_pages"] = (out - ref16).abs().max().item()
            report["results"].append(row)
            if log is not None:
                log.write(json.dumps(row) + "\n")
                log.flush()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    # summary: per case and page dtype, the five fastest, then each e4m3 way's best
    for key in report["dense"]:
        dense = report["dense"][key]
        best_dense = min(dense.values()) if dense else float("nan")
        print(f"== {key}: dense { ({k: round(v, 4) for k, v in dense.items()}) }")
        for fp8 in (False, True):
            ok = [r for r in report["results"] if r["case"] == key and r["fp8"] == fp8 and "ms" in r]
            ok.sort(key=lambda r: r["ms"])
            for r in ok[:4]:
                print(
                    f"  {'e4m3' if fp8 else 'bf16'} {r['ms']:.4f} ms ({r['ms'] / best_dense:.3f}x dense) "
                    f"n{r['block_n']} w{r['warps']} st{r['stages']} sp{r['splits']} pf{int(r['prefetch'])}"
                    + (f" qk{r['qk']} pv{r['pv']} cos {r['cos_vs_bf16_pages']:.5f}" if fp8 else "")
                )
            if fp8:
                for qk, pv in sorted({(r["qk"], r["pv"]) for r in ok}):
                    m = [r for r in ok if (r["qk"], r["pv"]) == (qk, pv)]
                    b = m[0]
                    print(
                        f"    mode qk{qk} pv{pv}: best {b['ms']:.4f} ms cos {min(x['cos_vs_bf16_pages'] for x in m):.5f} nan {any(x['nan'] for x in m)}"
                    )
        errs = [r for r in report["results"] if r["case"] == key and "error" in r]
        if errs:
            print(f"  {len(errs)} errors, e.g. {errs[0]['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``demo --session`` and ``bench --sections session`` at tiny sizes on the cpu plugin: the
paged session against the dense oracle, its memory bound, the bytes it copies, the pool after
every session (structure and checkable values, not timings)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffusion_kv.bench import BenchConfig, run_bench
from diffusion_kv.bench.session import session_bench
from diffusion_kv.cli import main
from diffusion_kv.conformance.reference import tolerance
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.models.session import (
    KIT_TOLERANCE,
    PagedStream,
    SessionConfig,
    build_session_model,
    format_session,
    run_session,
    session_inputs,
)
from diffusion_kv.models.session_dit import cross_attention_context
from diffusion_kv.platforms.cpu import CpuPlatform

TINY = dict(chunks=7, chunk_tokens=8, window_chunks=2, sink_chunks=1, steps=2, hidden=32, heads=2, kv_heads=2)
# 8-token chunks in 16-token blocks: a chunk boundary inside a block (the straddled block)


def chunk_kv_bytes(cfg: SessionConfig) -> int:
    return cfg.chunk_tokens * cfg.branches * cfg.layers * 2 * cfg.kv_heads * cfg.head_size * 4  # float32


@pytest.mark.parametrize("branches", [1, 2])
def test_a_session_run_agrees_holds_its_bound_and_copies_only_the_chunk(branches: int) -> None:
    cfg = SessionConfig(
        **TINY,  # type: ignore[arg-type]
        branches=branches,
        abort_chunk=4,
        failing_session=True,
        modes=("paged", "recompute", "concat", "contiguous"),
    )
    r = run_session(CpuPlatform(), cfg)
    assert r.agrees and r.max_abs_diff <= 2e-5
    assert r.backends == ("cpu:sdpa",) and r.block_size == 16  # the priority list's pick for the mask
    # the dense rolling caches compute the same attention as the paged session
    assert set(r.baseline_max_abs_diff) == {"concat", "contiguous"}
    assert all(d <= 2e-5 for d in r.baseline_max_abs_diff.values())
    assert r.chunk_kv_bytes == chunk_kv_bytes(cfg) == branches * 8 * 2 * 2 * 2 * 16 * 4
    assert r.bytes_copied_per_chunk == r.chunk_kv_bytes and r.bytes_written_per_step == r.chunk_kv_bytes
    # torch.cat copies the cache at every step: (sink 1 + window 2) chunks + the chunk, every layer
    assert r.baseline_bytes_copied["concat"]["per_step"] == 4 * r.chunk_kv_bytes
    assert r.baseline_bytes_copied["contiguous"]["per_step"] == r.chunk_kv_bytes
    # bound: sink 8 tokens -> 1 block, window + chunk 24 tokens -> 2 blocks, + 1 straddled; per branch
    per_block = 16 * 2 * 2 * 2 * 16 * 4
    assert r.kv_bytes_bound == branches * 4 * per_block
    assert r.kv_bytes_peak <= r.kv_bytes_bound
    # blocks held while each chunk runs: 8, 16, 24, 32 tokens, then flat once the window slides
    assert [b // (branches * per_block) for b in r.kv_bytes["paged"]] == [1, 1, 2, 2, 3, 3, 3]
    assert r.pool_full_after and all(r.pool_checks.values()) and len(r.pool_checks) == 2
    assert r.abort == {"chunk": 4, "restored": True}
    assert r.failing_session is not None and r.failing_session["restored"]
    assert r.failing_session["error"] == "the model failed in a denoise step"
    d = r.as_dict()
    assert d["ideal_vs_recompute"] == 4.0 and d["speedup_vs_recompute"] > 0
    assert len(d["chunk_ms"]["paged"]) == len(d["kv_bytes"]["recompute"]) == 7
    json.dumps(d)


def test_session_figures_come_from_the_chunks_after_the_window_filled() -> None:
    r = run_session(CpuPlatform(), SessionConfig(**TINY, modes=("paged", "concat")))  # type: ignore[arg-type]
    r.chunk_ms = {"paged": [9.0, 9.0, 9.0, 2.0, 2.0, 3.0, 4.0], "concat": [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0]}
    assert list(r.steady) == [3, 4, 5, 6]
    assert r.time_vs_concat == 2.5 / 4.0
    assert r.flatness == 4.0 / 2.0  # q = 7 // 4 = 1: chunk 6 over chunk 3
    assert r.speedup_vs_recompute is None and r.time_vs_contiguous is None


def test_the_chunk_alone_is_the_floor_and_sets_the_speedup_ceiling() -> None:
    cfg = SessionConfig(**TINY, modes=("paged", "recompute", "chunk_only"))  # type: ignore[arg-type]
    r = run_session(CpuPlatform(), cfg)
    assert set(r.chunk_ms) == {"paged", "recompute", "chunk_only"}
    # another computation (no context): never compared with the oracle or the paged chunks
    assert r.baseline_max_abs_diff == {} and r.dense_max_abs_diff == {} and r.agrees
    # one layer's K/V of the chunk alive at a time, the same for every chunk
    assert r.kv_bytes["chunk_only"] == [8 * 2 * 2 * 16 * 4] * 7
    r.chunk_ms = {
        "paged": [1.0] * 7,
        "recompute": [9.0, 9.0, 9.0, 8.0, 8.0, 6.0, 6.0],
        "chunk_only": [5.0, 5.0, 5.0, 2.0, 3.0, 2.0, 2.0],
    }
    # medians over chunks 3-6: recompute 7.0, chunk alone 2.0
    assert r.speedup_ceiling == 3.5 and r.as_dict()["speedup_ceiling"] == 3.5
    r.chunk_ms.pop("chunk_only")
    assert r.speedup_ceiling is None
    text = format_session(run_session(CpuPlatform(), cfg))
    assert "the chunk alone" in text and "a cache costing nothing would reach" in text
    with pytest.raises(ValidationError, match="come from .*'chunk_only'"):
        SessionConfig(modes=("paged", "chunk_alone"))


def test_the_kit_tolerance_is_the_conformance_kits() -> None:
    for dtype, (atol, rtol) in KIT_TOLERANCE.items():
        assert tolerance(dtype) == {"atol": atol, "rtol": rtol}


def test_bad_session_configs_are_refused() -> None:
    with pytest.raises(ValidationError, match="session chunks must be a positive integer; got 0"):
        SessionConfig(chunks=0)
    with pytest.raises(ValidationError, match="session modes must include paged"):
        SessionConfig(modes=("concat",))
    with pytest.raises(ValidationError, match="abort_chunk 9 is not a chunk index below 7"):
        SessionConfig(**TINY, abort_chunk=9)  # type: ignore[arg-type]


def test_the_graphs_mode_needs_cuda_and_its_figures_are_ratios_of_medians() -> None:
    cfg = SessionConfig(**TINY, modes=("paged", "graphs"))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="graphs mode needs a CUDA device; the run is on cpu"):
        run_session(CpuPlatform(), cfg)
    r = run_session(CpuPlatform(), SessionConfig(**TINY, modes=("paged", "contiguous")))  # type: ignore[arg-type]
    assert r.graphs_vs_paged is None and r.graphs_vs_contiguous is None and "graphs" not in r.extra
    r.chunk_ms = {
        "paged": [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0],
        "contiguous": [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0],
        "graphs": [9.0, 9.0, 9.0, 9.0, 1.0, 1.0, 1.0],  # chunk 3: the filled shape's capture
    }
    r.extra["graphs"] = {"captures": 4, "replays": 24, "max_abs_diff_vs_paged": 0.0}
    r.kv_bytes["graphs"] = r.kv_bytes["paged"]
    assert (r.graphs_vs_paged, r.graphs_vs_contiguous) == (0.25, 0.5)
    d = r.as_dict()
    assert (d["graphs_vs_paged"], d["graphs_vs_contiguous"]) == (0.25, 0.5)
    assert "paged with CUDA graphs 1.0 ms (0.25 of eager paged; 4 captures, 24 replays" in format_session(r)


def test_a_graphed_stream_cannot_count_writes() -> None:
    cfg = SessionConfig(**TINY)  # type: ignore[arg-type]
    device = torch.device("cpu")
    model = build_session_model(cfg, device)
    text, _ = session_inputs(cfg, device)
    with pytest.raises(ValidationError, match="cannot count its writes"):
        PagedStream(model, cfg, cross_attention_context(model, text), device, CpuPlatform(), graphs=True)


def test_session_bench_section_records_refused_backends_and_checks() -> None:
    s = session_bench(
        CpuPlatform(),
        torch.device("cpu"),
        torch.float32,
        "small",
        overrides={**TINY, "repeats": 1, "layers": 1},
    )
    assert s["backend"] == "sdpa" and s["shape_name"] == "small"
    assert s["agrees"] and s["pool_full_after"]
    assert s["kv_bytes_peak"] <= s["kv_bytes_bound"]
    assert s["bytes_copied_per_chunk"] == s["chunk_kv_bytes"] == 8 * 1 * 2 * 2 * 16 * 4
    assert s["abort"] == {"chunk": 4, "restored": True}  # the chunk after the window filled
    assert s["failing_session"]["restored"]
    assert s["meets_targets"]["kv_bytes_peak"] and s["meets_targets"]["bytes_copied_per_chunk"]
    by = s["by_backend"]
    for name in ("sdpa", "reference"):  # both serve the session mask
        assert by[name]["agrees"] and by[name]["pool_full_after"], name
    assert "vllm-cpu-attn" not in by or "refused" in by["vllm-cpu-attn"]
    for key in (
        "speedup_vs_recompute",
        "ideal_vs_recompute",
        "flatness",
        "time_vs_concat",
        "speedup_ceiling",
        "chunk_ms",
        "kv_bytes",
    ):
        assert key in s
    # the CPU shapes time the floor
    assert set(s["chunk_ms"]) == {"paged", "recompute", "concat", "chunk_only"}
    assert s["speedup_ceiling"] > 0
    assert s["dtype"] == "float32" and s["device"] == "cpu" and s["shapes"]["chunk_tokens"] == 8


def test_session_bench_wan_shape_smoke_with_reduced_sizes() -> None:
    """The GPU shape's code path (contiguous and torch.cat baselines, no recompute) at a size a
    CPU runs in a moment."""
    s = session_bench(
        CpuPlatform(),
        torch.device("cpu"),
        torch.float32,
        "small",
        backend="reference",
        shape="wan13b",
        overrides=dict(
            chunks=7, chunk_tokens=12, hidden=32, heads=2, kv_heads=2, layers=1, text_tokens=4, steps=2
        ),
    )
    assert s["shape_name"] == "wan13b" and set(s["chunk_ms"]) == {"paged", "contiguous", "concat"}
    assert s["shapes"]["window_chunks"] == 4 and s["shapes"]["sink_chunks"] == 1
    assert s["speedup_vs_recompute"] is None and s["time_vs_contiguous"] is not None
    assert s["agrees"] and s["pool_full_after"] and list(s["by_backend"]) == ["reference"]


def test_agrees_as_dense_compares_the_paged_drift_with_the_dense_ways(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dense ways' distance from the oracle is recorded; a paged run outside the kit's
    tolerance is an error only when it is also further off than every dense way (a deep 16-bit
    stack drifts from the float32 oracle whichever way attends)."""
    import dataclasses

    from diffusion_kv.models import session

    r = run_session(CpuPlatform(), SessionConfig(**TINY, modes=("paged", "recompute", "concat")))  # type: ignore[arg-type]
    assert set(r.dense_max_abs_diff) == {"concat"}  # recompute recomputes the K/V: not the same computation
    assert all(d <= 2e-5 for d in r.dense_max_abs_diff.values())
    assert r.agrees and r.agrees_as_dense is True and r.as_dict()["agrees_as_dense"] is True
    drift = dataclasses.replace(r, agrees=False, max_abs_diff=0.0625, dense_max_abs_diff={"concat": 0.0625})
    assert drift.agrees_as_dense is True
    worse = dataclasses.replace(drift, max_abs_diff=0.07)
    assert worse.agrees_as_dense is False
    # one rounding step of the dtype at the oracle's largest magnitude: bfloat16 at 6.0 is 2**-7 * 4
    bf16 = dataclasses.replace(drift, dtype="bfloat16", oracle_max_abs=6.0)
    assert bf16.rounding_step == 0.03125 and bf16.as_dict()["rounding_step"] == 0.03125
    assert dataclasses.replace(bf16, max_abs_diff=0.09375).agrees_as_dense is True
    assert dataclasses.replace(bf16, max_abs_diff=0.0938).agrees_as_dense is False
    assert dataclasses.replace(bf16, oracle_max_abs=0.0).rounding_step == 0.0
    assert r.oracle_max_abs > 0 and r.rounding_step == torch.finfo(torch.float32).eps * 2.0 ** math.floor(
        math.log2(r.oracle_max_abs)
    )
    assert dataclasses.replace(r, dense_max_abs_diff={}).agrees_as_dense is None
    argv = ["demo", "--session", "--chunks", "5", "--chunk-tokens", "8", "--window", "2", "--sink", "1"]
    argv += ["--steps", "2", "--hidden", "32", "--heads", "2", "--no-progress"]
    monkeypatch.setattr(session, "run_session", lambda *a, **k: drift)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "the dense ways against the same oracle: torch.cat 0.0625" in captured.out
    assert "paging adds no error of its own" in captured.out and captured.err == ""
    monkeypatch.setattr(session, "run_session", lambda *a, **k: worse)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "the paged way is further off than every dense way" in captured.out
    assert (
        "the paged session disagrees with the dense oracle over the same mask (max abs diff 0.07"
        in captured.err
    )


def test_bench_cli_runs_the_session_section(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusion_kv.bench import session

    monkeypatch.setitem(session.SHAPES, "small", {**session.SMALL, **TINY, "repeats": 1})
    report = run_bench(CpuPlatform(), BenchConfig(sizes="small", sections=("session",)))
    assert report["errors"] == {} and report["session"]["agrees"]
    assert main(["bench", "--sections", "session", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"session", "errors"} and out["session"]["pool_full_after"] is True
    assert main(["bench", "--sections", "session", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "session (small: 7 chunks of 8 tokens, sink 1 + window 2 chunks" in text
    assert "reference: paged" in text


def test_demo_session_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--session", "--chunks", "5", "--chunk-tokens", "8", "--window", "2", "--sink", "1"]
    argv += ["--steps", "2", "--hidden", "32", "--heads", "2", "--no-progress"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["agrees"] and out["pool_full_after"] and set(out["chunk_ms"]) == {"paged", "recompute", "concat"}
    )
    assert out["shapes"]["layers"] == 2 and out["shapes"]["branches"] == 1 and out["shapes"]["steps"] == 2
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "session: 5 chunks of 8 tokens, sink 1 + window 2 chunks, 2 denoise steps per chunk" in text
    assert "-> AGREE" in text and "pool whole after every session: yes" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--chunks", "3"], "--chunks applies to --session only"),
        (["demo", "--session", "--stream", "2"], "--session and --stream are two modes; give one"),
        (
            ["demo", "--session", "--backend", "vllm-cpu-attn"],
            "backend cpu:vllm-cpu-attn cannot serve the session's chunk_causal(",
        ),
        (
            ["demo", "--session", "--hidden", "30", "--heads", "4"],
            "must divide by --heads 4 into an even head size",
        ),
    ],
)
def test_demo_session_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_plot_draws_the_session_panels(tmp_path: object) -> None:
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from diffusion_kv.bench.plot import plot_report

    r = run_session(CpuPlatform(), SessionConfig(**{**TINY, "chunks": 5}))  # type: ignore[arg-type]
    out = plot_report({"platform": "cpu", "session": r.as_dict()}, str(Path(str(tmp_path)) / "s.png"))
    assert out.exists() and out.stat().st_size > 10_000


def test_key_mask_is_the_row_mask_at_the_keys_and_a_far_chunks_plan_reads_sink_and_window() -> None:
    from diffusion_kv.core.attention import BlockKind, build_block_plan

    mask = SessionConfig(**TINY).policy.mask  # type: ignore[arg-type]  # chunk 8, window 24, sink 8
    keys = torch.tensor([0, 3, 7, 8, 30, 31, 40, 44, 47])
    assert torch.equal(mask.key_mask(40, 8, 48, keys), mask.row_mask(40, 8, 48)[:, keys])
    # chunk 1000 of the stream: the plan classifies the sink block and the window's blocks only
    start = 1000 * 8
    plan = build_block_plan(mask, [start], [8], [start + 8], 16)
    kinds = plan.kinds[0]
    assert kinds.numel() == (start + 8 + 15) // 16
    assert plan.live_blocks(0).tolist() == [0, 499, 500]  # sink [0, 8); window [7984, 8008)
    assert (
        kinds[0] == int(BlockKind.PARTIAL) and int((kinds == int(BlockKind.SKIP)).sum()) == kinds.numel() - 3
    )

"""``diffusion-kv bench`` on the cpu plugin: structure, agreement, errors (not timings)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from diffusion_kv.bench import SECTIONS, BenchConfig, run_bench
from diffusion_kv.bench.attention import AttentionCase, attention_cases, run_case
from diffusion_kv.cli import main
from diffusion_kv.platforms.cpu import CpuPlatform


def test_case_grid_and_flop_count() -> None:
    cases = attention_cases("full")
    assert len(cases) == 24  # 16 shuffled + regime A's 8 once more with contiguous pages
    assert sum(c.placement == "contiguous" for c in cases) == 8
    assert {c.regime for c in cases if c.placement == "contiguous"} == {"A"}
    assert "A cfg2 rows2 H24/kv24 bs128 contiguous" in {c.name for c in cases}
    a = next(c for c in cases if c.regime == "A" and c.cfg == 2 and c.kv_heads == 24 and c.block_size == 128)
    assert (a.rows, a.heads, a.head_size, a.prefix, a.target, a.seq_len) == (2, 24, 128, 2048, 4096, 6144)
    assert a.flops() == 4 * 2 * 24 * 4096 * 6144 * 128
    b = next(c for c in cases if c.regime == "B" and c.cfg == 2 and c.kv_heads == 8 and c.block_size == 16)
    assert (b.rows, b.heads, b.prefix, b.target) == (16, 32, 8160, 32)
    # K and V of 16 rows x 8192 tokens x 8 heads x 128, plus Q and O of 16 x 32 x 32 x 128, in bf16
    assert b.min_bytes(2) == (2 * 16 * 8192 * 8 * 128 + 2 * 16 * 32 * 32 * 128) * 2
    with pytest.raises(ValueError, match="unknown regime 'C'"):
        attention_cases("full", regimes=("C",))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_paged_case_agrees_with_dense_on_cpu(kv_heads: int) -> None:
    case = AttentionCase(
        "B", rows=3, heads=4, kv_heads=kv_heads, head_size=64, prefix=100, target=20, block_size=16, cfg=1
    )
    result = run_case(CpuPlatform(), case, torch.device("cpu"), torch.float32, None, min_ms=0.5)
    assert set(result["paged"]) == {b.name for b in CpuPlatform().candidate_backends()}
    paged = result["paged"]["reference"]
    if "vllm-cpu-attn" in result["paged"] and not vllm_installed():
        assert result["paged"]["vllm-cpu-attn"] == {"error": "unavailable: vLLM is not installed"}
    assert paged["agrees"] and paged["max_abs_diff"] < 1e-4
    assert result["best_dense"]["backend"] in result["dense"]
    assert paged["ratio_vs_best_dense"] == pytest.approx(paged["ms"] / result["best_dense"]["ms"])


def vllm_installed() -> bool:
    from diffusion_kv.integrations.vllm.versions import installed_vllm_version

    return installed_vllm_version() is not None


def test_run_bench_small_all_sections() -> None:
    report = run_bench(
        CpuPlatform(),
        BenchConfig(
            sizes="small",
            regimes=("B",),
            block_sizes=(16,),
            cfgs=(1,),
            gqa=(True,),
            min_ms=0.5,
            host_iters=10,
            sections=tuple(s for s in SECTIONS if s != "session"),  # tests/unit/test_session_demo.py
        ),
    )
    assert report["sizes"] == "small" and report["dtype"] == "float32"
    assert [r["case"] for r in report["attention"]] == ["B cfg1 rows4 H4/kv2 bs16"]
    assert [h["rows"] for h in report["host"]] == [2, 64]
    assert all(h["prepare_us"] > 0 and h["launches"] is None for h in report["host"])
    e2e = report["e2e"]
    assert e2e["agrees"] and e2e["ideal_speedup"] == (512 + 128) / 128
    stream = report["stream"]
    assert stream["agree"] and len(stream["requests"]) == 6 and stream["target_speedup"] == 2.0
    assert stream["stream"]["max_running"] > 1 and stream["sequential"]["max_running"] == 1
    # no graphs on the cpu plugin: nothing captured, so both speedups are the plain wall ratio
    assert stream["stream"]["capture_ms"] == stream["sequential"]["capture_ms"] == 0.0
    assert stream["speedup"] == stream["speedup_with_captures"]
    assert stream["speedup"] == stream["sequential"]["wall_ms"] / stream["stream"]["wall_ms"]
    assert "eager" not in stream  # the eager pair is run only where graphs were taken
    pc = report["prefix-cache"]
    assert pc["agrees"] and pc["block_size"] == 16 and pc["prefill"]["graphs"] == "eager"
    # SMALL: prefix 128 + target 32, two CFG rows; a hit computes the 32 target tokens per row
    assert (pc["prefill"]["tokens_miss"], pc["prefill"]["tokens_hit"]) == (320, 64)
    assert pc["shared"]["hit_tokens"] == 5 * 2 * 128 and pc["shared"]["evictions"] == 0
    assert pc["no_sharing"]["hit_tokens"] == 0 and pc["no_sharing"]["blocks_saved"] == 0
    assert set(pc["meets"]) == set(pc["targets"])


def test_bench_cli_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--sizes", "small", "--sections", "attention", "--regimes", "A", "--block-sizes", "16"]
    argv += ["--cfg", "1", "--gqa", "no", "--min-ms", "0.5", "--json", "--no-progress"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["platform"] == "cpu"
    assert [r["case"] for r in report["attention"]] == [
        "A cfg1 rows1 H4/kv4 bs16",
        "A cfg1 rows1 H4/kv4 bs16 contiguous",
    ]
    assert main(["bench", "--sections", "attention,nope", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "diffusion-kv: error: argument --sections: unknown value(s) nope; choose from attention, host, e2e, stream, prefix-cache, session\n"
    )
    assert main(["bench", "--cfg", "3", "--no-progress"]) == 2
    assert "argument --cfg: unknown value(s) 3; choose from 1, 2" in capsys.readouterr().err


def test_a_failing_section_is_reported_and_fails_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from diffusion_kv.bench import host

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("prepare exploded")

    monkeypatch.setattr(host, "host_overhead", broken)
    report = run_bench(CpuPlatform(), BenchConfig(sizes="small", sections=("host",)))
    assert report["errors"] == {"host": "RuntimeError: prepare exploded"} and "host" not in report
    assert main(["bench", "--sections", "host", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "error in host: RuntimeError: prepare exploded" in captured.out
    assert "bench parts failed: host" in captured.err


def test_isolated_sections_run_each_in_its_own_process_and_merge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--isolate on: each section measured by a child ``bench`` of that section alone, the
    reports merged into one with the sections named; the options travel to every child."""
    out = tmp_path / "report.json"
    argv = [
        "bench",
        "--sections",
        "host,e2e",
        "--isolate",
        "on",
        "--json",
        "--output",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["isolated_sections"] == ["host", "e2e"] and report["errors"] == {}
    assert report["platform"] == "cpu" and report["sizes"] == "small"
    assert [h["rows"] for h in report["host"]] == [2, 64] and report["e2e"]["agrees"] is True
    assert "attention" not in report and "stream" not in report
    capsys.readouterr()


def test_an_isolated_section_without_a_report_is_its_error_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from diffusion_kv import cli

    real = cli._bench_child_argv

    def child(args: argparse.Namespace, platform: str, section: str, output: str) -> list[str]:
        if section == "host":  # a child that dies before writing its report
            return [sys.executable, "-c", "import sys; sys.exit(3)"]
        return real(args, platform, section, output)

    monkeypatch.setattr(cli, "_bench_child_argv", child)
    argv = ["bench", "--sections", "host,e2e", "--isolate", "on", "--json", "--no-progress"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["errors"] == {
        "host": "the section's process wrote no report (exit status 3; its messages above)"
    }
    assert "host" not in report and report["e2e"]["agrees"] is True
    assert "bench parts failed: host" in captured.err


def test_child_argv_carries_every_measurement_option() -> None:
    from diffusion_kv import cli

    given = [
        "bench",
        "--sizes",
        "full",
        "--regimes",
        "B",
        "--block-sizes",
        "128",
        "--cfg",
        "2",
        "--gqa",
        "only",
    ]
    given += ["--min-ms", "5", "--kv-cache-dtype", "fp8_e4m3", "--backend", "sdpa", "--dtype", "float16"]
    given += ["--session-shape", "medium", "--no-progress"]
    args = cli.build_parser().parse_args(given)
    argv = cli._bench_child_argv(args, "cpu", "attention", "/tmp/x.json")
    assert argv[:4] == [sys.executable, "-m", "diffusion_kv.cli", "bench"]
    reparsed = cli.build_parser().parse_args(argv[3:])
    for name in ("sizes", "regimes", "block_sizes", "cfg", "gqa", "min_ms", "kv_cache_dtype", "backend"):
        assert getattr(reparsed, name) == getattr(args, name), name
    assert (reparsed.dtype, reparsed.session_shape, reparsed.no_progress) == ("float16", "medium", True)
    assert (reparsed.platform, reparsed.sections, reparsed.isolate, reparsed.output) == (
        "cpu",
        ("attention",),
        "off",
        "/tmp/x.json",
    )
    # every other option of the bench command travels as given: an option added to the parser
    # later and forgotten by the child's command line fails here
    per_child = {"platform", "sections", "isolate", "output", "json", "plot", "from_report", "func"}
    for name in sorted(set(vars(args)) - per_child):
        assert getattr(reparsed, name) == getattr(args, name), name

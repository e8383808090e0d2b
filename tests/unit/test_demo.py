"""The demo: dense and paged modes agree; the CLI fails when they do not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from diffusion_kv.models.demo import DemoConfig, format_result, make_result, run_demo
from diffusion_kv.platforms.cpu import CpuPlatform

SMALL = dict(prefix_len=37, target_len=19, steps=3, hidden=64, heads=4, layers=2, max_model_len=256)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("cfg_rows", [1, 2])
def test_modes_agree(block_size: int, cfg_rows: int) -> None:
    result = run_demo(CpuPlatform(), DemoConfig(block_size=block_size, cfg_rows=cfg_rows, **SMALL))  # type: ignore[arg-type]
    assert result.agree and result.max_abs_diff < 1e-4
    assert result.blocks_used == cfg_rows * -(-56 // block_size)
    assert len(result.dense_step_ms) == len(result.paged_step_ms) == 3
    assert result.block_utilisation == pytest.approx(cfg_rows * 56 / (result.blocks_used * block_size))


def test_gqa_and_half_precision_agree() -> None:
    result = run_demo(CpuPlatform(), DemoConfig(kv_heads=2, dtype=torch.float16, **SMALL))  # type: ignore[arg-type]
    assert result.agree and result.dtype == "float16"


def test_the_report_names_the_backend_that_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFUSION_KV_BACKEND", "cpu:reference")
    result = run_demo(CpuPlatform(), DemoConfig(**SMALL))  # type: ignore[arg-type]
    assert result.backends == ("cpu:reference",)
    assert (
        format_result(result).splitlines()[0]
        == "platform: cpu (device cpu, float32), paged backend cpu:reference"
    )
    monkeypatch.delenv("DIFFUSION_KV_BACKEND")
    assert run_demo(CpuPlatform(), DemoConfig(**SMALL)).backends == ("cpu:sdpa",)  # type: ignore[arg-type]


def test_corrupted_cache_is_detected() -> None:
    result = run_demo(CpuPlatform(), DemoConfig(inject_fault=True, **SMALL))  # type: ignore[arg-type]
    assert not result.agree and result.max_abs_diff > result.tolerance


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    small = ["--prefix", "40", "--target", "16", "--steps", "2", "--hidden", "64", "--layers", "1"]
    return subprocess.run(
        [sys.executable, "-m", "diffusion_kv.cli", "demo", *small, *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_json_and_exit_codes() -> None:
    ok = _cli("--json")
    assert ok.returncode == 0, ok.stderr
    payload = json.loads(ok.stdout)
    assert payload["agree"] is True and payload["platform"] == "cpu" and payload["cfg_rows"] == 2
    assert payload["shapes"]["seq_len"] == 56 and payload["speedup"] > 0
    bad = _cli("--inject-fault", "--no-progress")
    assert bad.returncode == 1
    assert "DISAGREE" in bad.stdout and "outputs disagree" in bad.stderr


def test_cli_rejects_bad_sizes() -> None:
    proc = _cli("--max-model-len", "8")
    assert proc.returncode == 2
    assert proc.stderr == "diffusion-kv: error: --prefix 40 + --target 16 exceeds --max-model-len 8\n"


def test_cpu_output_keeps_its_figures() -> None:
    """No warm-up and no capture on CPU: the whole-run figure is every step of both runs."""
    result = run_demo(CpuPlatform(), DemoConfig(**SMALL))  # type: ignore[arg-type]
    assert result.warmup_ms == {} and result.capture_step is None and result.capture_step_ms == 0.0
    assert result.speedup_without_capture == result.speedup
    text = format_result(result)
    whole = (
        f"whole run {result.paged_total_ms:.0f} ms vs {result.dense_total_ms:.0f} ms "
        f"({result.speedup:.2f}x over 3 steps)"
    )
    assert whole in text and "warm-up" not in text and "left out of both" not in text
    payload = result.as_dict()
    assert payload["speedup_without_capture"] == payload["speedup"] and payload["capture_step"] is None


def test_a_warm_up_is_timed_apart_and_leaves_the_result_alone() -> None:
    cold = run_demo(CpuPlatform(), DemoConfig(**SMALL))  # type: ignore[arg-type]
    warm = run_demo(CpuPlatform(), DemoConfig(warmup=True, **SMALL))  # type: ignore[arg-type]
    assert set(warm.warmup_ms) == {"dense", "paged"} and all(ms > 0 for ms in warm.warmup_ms.values())
    assert len(warm.paged_step_ms) == len(warm.dense_step_ms) == 3  # the timed runs: every step
    assert warm.agree and warm.max_abs_diff == cold.max_abs_diff  # same weights and inputs
    line = format_result(warm).splitlines()[-1]
    assert line == (
        "warm-up before timing (one-off: compilation, library set-up; in no figure above): "
        f"dense {warm.warmup_ms['dense']:.0f} ms, paged {warm.warmup_ms['paged']:.0f} ms"
    )
    assert json.loads(json.dumps(warm.as_dict()))["warmup_ms"] == warm.warmup_ms


def test_the_capture_step_is_left_out_of_both_whole_run_figures() -> None:
    info = {"block_size": 16, "blocks_used": 8, "kv_bytes_paged": 1024, "tokens": 112, "capture_step": 2}
    cfg = DemoConfig(steps=5, **{k: v for k, v in SMALL.items() if k != "steps"})  # type: ignore[arg-type]
    dense = [12.0, 10.0, 10.0, 10.0, 10.0]
    paged = [20.0, 4.0, 900.0, 2.0, 2.0]  # step 2 captured the graph
    r = make_result(
        CpuPlatform(), cfg, torch.device("cpu"), 0.0, dense, paged, info, {"graphs": True, "graph_replays": 2}
    )
    assert r.capture_step == 2 and r.capture_step_ms == 900.0
    assert r.speedup == pytest.approx(52.0 / 928.0)  # the headline a GPU user used to read
    assert r.speedup_without_capture == pytest.approx(42.0 / 28.0)
    assert (
        "whole run 28 ms vs 42 ms (1.50x over 4 steps, step 2 left out of both: it captured the CUDA graph, "
        "a one-off 900 ms for one eager step and the capture; 0.06x with it)"
    ) in format_result(r)
    payload = r.as_dict()
    assert payload["capture_step_ms"] == 900.0 and payload["speedup_without_capture"] == pytest.approx(1.5)


def test_a_run_that_wants_graphs_states_the_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion_kv.core.errors import UnsupportedRequirementsError
    from diffusion_kv.core.runner import PagedLayerSpec, RunnerConfig
    from diffusion_kv.models import demo

    assert demo.wants_graph_capture(None, torch.device("cpu")) is False
    assert demo.wants_graph_capture(None, torch.device("cuda", 0)) is True
    assert demo.wants_graph_capture(False, torch.device("cuda", 0)) is False
    config = RunnerConfig(max_model_len=64, max_rows_per_request=1, max_num_seqs=1, max_num_batched_tokens=64)
    layers = {"l0": PagedLayerSpec(2, 2, 16, torch.float32)}
    # graphs required where no backend can be captured (the cpu platform's): refused at selection
    with pytest.raises(UnsupportedRequirementsError, match="graph capture"):
        demo.paged_runner(CpuPlatform(), config, layers, 4, 16, True)
    # graphs where possible (None) on a device that would capture: the requirement is stated,
    # and where nothing can serve it the run is built without it (eager)
    monkeypatch.setattr(demo, "wants_graph_capture", lambda graphs, device: True)
    runner = demo.paged_runner(CpuPlatform(), config, layers, 4, 16, None)
    assert runner.initialized and runner.config.graph_capture is False
    assert [type(b).name for b in runner.backends] == ["sdpa"]

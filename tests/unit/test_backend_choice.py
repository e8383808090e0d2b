"""The backend choice as a value: ``RunnerConfig.backend`` and ``select_backend(force=...)``;
``DIFFUSION_KV_BACKEND`` is only its default, and the package never writes the environment."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import diffusion_kv
from diffusion_kv.core.capabilities import Requirements, capability_reasons
from diffusion_kv.core.errors import ConfigurationError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend


def runner(backend: object = None, kv_cache_dtype: str = "auto") -> PagedWorker:
    r = PagedWorker(
        CpuPlatform(),
        RunnerConfig(
            max_model_len=64, max_rows_per_request=1, max_num_seqs=1, max_num_batched_tokens=64,
            backend=backend, kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        ),
    )  # fmt: skip
    r.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 16, torch.float32)})
    r.initialize_kv_cache(num_blocks=4, block_size=16)
    return r


def test_the_choice_picks_by_name_or_class_and_wins_over_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert [type(b).name for b in runner().backends] == ["sdpa"]  # the priority list
    assert [type(b).name for b in runner("reference").backends] == ["reference"]
    assert [type(b) for b in runner(CpuReferenceBackend).backends] == [CpuReferenceBackend]
    monkeypatch.setenv("DIFFUSION_KV_BACKEND", "cpu:reference")
    assert [type(b).name for b in runner().backends] == ["reference"]  # the variable: the default
    assert [type(b).name for b in runner("sdpa").backends] == ["sdpa"]  # a value wins


def test_a_bad_or_unknown_choice_is_refused() -> None:
    with pytest.raises(
        ValidationError, match="RunnerConfig.backend must be a backend name, a PagedBackend class"
    ):
        runner(42)
    with pytest.raises(
        ConfigurationError, match=r"the backend choice forces backend 'nope' on platform 'cpu', which has \["
    ):
        runner("nope")
    with pytest.raises(UnsupportedRequirementsError) as err:
        runner("sdpa", kv_cache_dtype="fp8_e4m3")  # the choice cannot serve e4m3 pages: refused, not replaced
    assert "(the backend choice limits the candidates to one)" in str(err.value)
    assert "kv_cache_dtype=fp8_e4m3" in str(err.value)


def test_select_and_explain_take_the_choice() -> None:
    platform = CpuPlatform()
    req = Requirements(dtype=torch.float32, head_size=16)
    assert platform.select_backend(req, force="reference") is CpuReferenceBackend
    lines = platform.explain(req, force="reference")
    assert lines[0] == "cpu: selects backend 'reference' for dtype=float32, head_size=16"
    assert "  the backend choice forces 'reference'" in lines
    with pytest.raises(ValidationError, match="a backend choice is a backend name or a PagedBackend class"):
        platform.select_backend(req, force=3.0)  # type: ignore[arg-type]


def test_the_package_never_writes_the_environment() -> None:
    root = pathlib.Path(diffusion_kv.__file__).parent
    writes = re.compile(
        r"os\.environ\[[^\]]+\]\s*=|os\.environ\.(update|setdefault|pop|clear)\(|os\.putenv|setenv\("
    )
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if writes.search(line)
    ]
    assert offenders == []


# --- graph capture as a selection requirement (RunnerConfig.graph_capture) -------------------------


class CapturingReference(CpuReferenceBackend):
    """The reference backend declaring graph capture (the cpu platform's own declare none)."""

    name = "capturing"
    capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, supports_graph_capture=True)


class GraphCpu(CpuPlatform):
    """sdpa (priority 120, cannot be captured) above a capturing backend (100)."""

    backends = (CpuSdpaBackend, CapturingReference)


def graph_runner(platform: CpuPlatform, graph_capture: object, backend: object = None) -> PagedWorker:
    return PagedWorker(
        platform,
        RunnerConfig(
            max_model_len=64, max_rows_per_request=1, max_num_seqs=1, max_num_batched_tokens=64,
            backend=backend, graph_capture=graph_capture,  # type: ignore[arg-type]
        ),
    )  # fmt: skip


def test_a_runner_that_wants_graphs_gets_a_backend_that_can_be_captured() -> None:
    picked = {}
    for wants in (False, True):
        r = graph_runner(GraphCpu(), wants)
        r.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 16, torch.float32)})
        r.initialize_kv_cache(num_blocks=4, block_size=16)
        picked[wants] = [type(b).name for b in r.backends]
    assert picked == {False: ["sdpa"], True: ["capturing"]}  # the priority list, then the requirement


def test_a_forced_backend_that_cannot_be_captured_is_refused_with_the_reason() -> None:
    r = graph_runner(GraphCpu(), True, backend="sdpa")
    r.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 16, torch.float32)})
    with pytest.raises(UnsupportedRequirementsError) as err:
        r.initialize_kv_cache(num_blocks=4, block_size=16)
    assert "graph_capture=True" in str(err.value) and "      graph capture" in str(err.value)
    assert not r.initialized and r.backends == ()


def test_no_backend_that_can_be_captured_is_refused_at_registration() -> None:
    r = graph_runner(CpuPlatform(), True)  # neither sdpa nor reference declares capture
    with pytest.raises(UnsupportedRequirementsError, match=r"platform 'cpu' cannot serve these layers \(.*"
                       r"graph_capture=True\): .*graph capture"):  # fmt: skip
        r.register_kv_cache_layers({"l0": PagedLayerSpec(2, 2, 16, torch.float32)})
    assert r.layers == {}
    with pytest.raises(ValidationError, match="RunnerConfig.graph_capture must be a bool; got 'yes'"):
        graph_runner(CpuPlatform(), "yes")


def test_vllm_flash_attn_is_ruled_out_by_the_requirement_and_the_cuda_backends_are_not() -> None:
    from diffusion_kv.integrations.vllm.backend import VllmFlashAttnBackend
    from diffusion_kv.platforms.cuda.backend import CudaPagedBackend, SdpaPagedBackend, TritonPagedBackend

    wants = Requirements(dtype=torch.bfloat16, head_size=128, graph_capture=True)
    assert capability_reasons(VllmFlashAttnBackend.capabilities, wants) == ["graph capture"]
    assert capability_reasons(VllmFlashAttnBackend.capabilities, Requirements(graph_capture=False)) == []
    for own in (CudaPagedBackend, TritonPagedBackend, SdpaPagedBackend):
        assert capability_reasons(own.capabilities, wants) == []

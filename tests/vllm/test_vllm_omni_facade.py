"""diffusion-kv's vLLM-Omni integration without vLLM-Omni installed (the main suite).

The module replacement (``integrations.vllm_omni.runner``) replays vLLM-Omni's worker call
sequence on the cpu platform with plain attribute objects as configs and records (vLLM-Omni
reads its own by attribute name too); the platform hooks' decisions, the BlockTables
adaptation and the page views are checked directly. The real thing (vLLM-Omni 0.30.0's runner,
forward context and ``Attention`` layers) runs in ``tests/vllm_omni`` (``ci/vllm_omni_lane.sh``).

Shim: :func:`forward_paged` stands in for vLLM-Omni's ``FlashAttentionImpl.forward_paged`` (the
backend-owned execution boundary Omni's ``Attention`` calls), reduced to the two call orders it
uses: with ``prewrite`` (``do_kv_cache_update`` then ``forward`` without K/V, as on Ascend) and
without (``forward`` with K/V, as on CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.backend import KVPageLayout
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.capabilities import AttentionMode, MultipleOf, Requirements
from diffusion_kv.core.errors import StateError, UnsupportedRequirementsError
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.integrations.vllm.backend import VllmCpuAttnBackend, view_layout
from diffusion_kv.integrations.vllm_omni import (
    DiffusionKVModelRunnerBackend,
    DiffusionKVPlatformHooks,
    DiffusionPagedAttentionMetadata,
    DiffusionPagedAttentionRow,
)
from diffusion_kv.integrations.vllm_omni.hooks import (
    CONFIG_KEY,
    OmniBlockTablesFactory,
    kv_cache_layout_for,
    paged_batch,
    smallest_block_size_served,
)
from diffusion_kv.integrations.vllm_omni.native import page_view
from diffusion_kv.integrations.vllm_omni.plugin import PLATFORM_PATH, omni_platform_plugin
from diffusion_kv.integrations.vllm_omni.runner import DiffusionPagedAttentionContext
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend
from diffusion_kv.platforms.interface import ENV_BACKEND
from diffusion_kv.platforms.selection import ENV_PLATFORM

BLOCK = 16
HEADS, KV_HEADS, HEAD = 4, 2, 32
NAMES = ("blk.0.attn", "blk.1.attn")


@dataclass(frozen=True)
class FullAttentionSpec:  # vLLM's field names
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    non_causal: bool = False


@dataclass
class ModelConfig:
    max_model_len: int = 100
    geometry: list[dict[str, int]] = field(default_factory=list)

    def set_attention_geometry(self, **geometry: int) -> None:  # vLLM-Omni's diffusion model config
        self.geometry.append(geometry)


def vllm_config(max_num_seqs: int = 6, max_model_len: int = 100) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=ModelConfig(max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK, kv_cache_layout=None),
        additional_config={},
    )


def od_config(mode: str = "paged_scheduler", **parallel: Any) -> SimpleNamespace:
    return SimpleNamespace(
        diffusion_kv_mode=SimpleNamespace(value=mode),
        diffusion_kv_max_rows_per_request=3,
        dtype=torch.float32,
        parallel_config=SimpleNamespace(**{"ulysses_degree": 1, **parallel}),
    )


PAGED_BACKEND = SimpleNamespace(supports_paged_kv=True, get_name=lambda: "FLASH_ATTN")


def layers(attn_backend: Any = PAGED_BACKEND) -> dict[str, tuple[Any, FullAttentionSpec]]:
    spec = FullAttentionSpec(BLOCK, KV_HEADS, HEAD, torch.float32)
    layer = SimpleNamespace(num_heads=HEADS, softmax_scale=HEAD**-0.5, attn_backend=attn_backend)
    return {name: (layer, spec) for name in NAMES}


def kv_cache_config(specs: dict[str, Any], num_blocks: int = 32) -> SimpleNamespace:
    spec = next(iter(specs.values()))
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[SimpleNamespace(layer_names=list(specs), kv_cache_spec=spec)],
    )


def metadata(generation: int = 1) -> SimpleNamespace:
    """Two CFG sequences (prefix 20 + target 12), as vLLM-Omni's scheduler hands them over."""
    seq = lambda sid, blocks: SimpleNamespace(  # noqa: E731
        sequence_id=sid, prefix_len=20, target_len=12, seq_len=32, block_ids=(blocks,), cached_prefix_len=0
    )
    return SimpleNamespace(
        request_id="req-1", allocation_generation=generation, sequences=(seq(0, [7, 3]), seq(1, [12, 5]))
    )


def phases() -> DiffusionPagedAttentionMetadata:
    """What vLLM-Omni's runner builds for those sequences (its _build_paged_attention_metadata)."""

    def row(sid: int, start: int, query_len: int) -> DiffusionPagedAttentionRow:
        return DiffusionPagedAttentionRow("req-1", query_len, 32, start, sequence_id=sid)

    return DiffusionPagedAttentionMetadata((row(0, 0, 32), row(1, 0, 32)), (row(0, 20, 12), row(1, 20, 12)))


def backend(mode: str = "paged_scheduler", **parallel: Any) -> DiffusionKVModelRunnerBackend:
    return DiffusionKVModelRunnerBackend(
        vllm_config=vllm_config(), od_config=od_config(mode, **parallel), device="cpu", platform=CpuPlatform()
    )


def initialised() -> DiffusionKVModelRunnerBackend:
    be = backend()
    be.initialize_kv_cache(kv_cache_config(be.register_kv_cache_layers(layers())))
    return be


def forward_paged(context: DiffusionPagedAttentionContext, *, prewrite: bool) -> torch.Tensor:
    """Stand-in for vLLM-Omni's ``FlashAttentionImpl.forward_paged`` (see the module docstring)."""
    layer = context.layer
    if prewrite or not layer.attn_backend.forward_includes_kv_cache_update:
        layer.impl.do_kv_cache_update(
            layer, context.key_write, context.value_write, layer.kv_cache, context.slot_mapping
        )
        out = layer.impl.forward(layer, context.query, None, None, layer.kv_cache, context.native_metadata)
    else:
        out = layer.impl.forward(
            layer,
            context.query,
            context.key_write,
            context.value_write,
            layer.kv_cache,
            context.native_metadata,
        )
    return context.restore_output(out)


# -- the module replacement ------------------------------------------------------------------------


def test_construction_validates_nothing_as_the_runner_builds_it_in_dense_mode() -> None:
    be = DiffusionKVModelRunnerBackend(vllm_config=None, od_config=None, device="cpu")
    assert (be.kv_cache_config, be.kv_caches, be.block_tables, be.paged_attention_adapter) == (
        None,
        [],
        None,
        None,
    )
    assert be.remove_diffusion_kv_requests(["r"]) == 0
    be.refresh_block_table_layout()  # no-op


def test_upstream_call_sequence_on_the_cpu_platform() -> None:
    be = backend()
    specs = be.register_kv_cache_layers(layers())
    assert specs == {n: FullAttentionSpec(BLOCK, KV_HEADS, HEAD, torch.float32) for n in NAMES}
    assert be.vllm_config.model_config.geometry == [{"num_heads": 4, "num_kv_heads": 2, "head_size": 32}]
    config = kv_cache_config(specs)
    be.initialize_kv_cache(config)
    assert be.kv_cache_config is not config and be.kv_cache_config.num_blocks == 32  # a deep copy
    assert be.chosen_backends == (CpuSdpaBackend,)  # float32 without vLLM: the cpu platform's default
    tables = be.block_tables
    assert tables.max_num_reqs == 6  # worker rows = scheduler max_num_seqs (already x rows/request)
    assert [t.width for t in tables.block_tables] == [8]  # cdiv(100, 16) = 7 rounded to 128 tokens
    assert tables.num_blocks.np.shape == (1, 6)
    assert sorted(be.kv_caches_by_layer) == list(NAMES)
    assert be.install_diffusion_kv_metadata(metadata()) is True
    assert be.install_diffusion_kv_metadata(metadata()) is False  # same generation: no-op
    assert tables.num_blocks.np.tolist() == [[2, 2, 0, 0, 0, 0]]  # the NumPy view shares memory
    assert [be.get_diffusion_kv_row("req-1", 0), be.get_diffusion_kv_row("req-1", 1)] == [0, 1]
    binding = be._resolve_paged_attention_row("req-1", 1, None)
    assert (binding.row_index, binding.max_seq_len, binding.block_ids) == (1, 32, ((12, 5),))

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 32, h, HEAD, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    spans = SimpleNamespace(full_attn_spans=[[(20, 32)], [(20, 32)]], attn_mask=None)
    runtime, activation = be.activate_paged_attention_metadata(phases())
    outs: dict[int, list[torch.Tensor]] = {}
    with activation:
        for step in (0, 1, 2):
            assert runtime.ensure_active(step) is runtime.adapter is be.paged_attention_adapter
            part = slice(0, 32) if step == 0 else slice(20, 32)
            outs[step] = []
            for i, name in enumerate(NAMES):
                context = runtime.adapter.prepare_layer_context(
                    name, q[:, part], k[:, part], v[:, part], omni_attn_metadata=spans
                )
                assert context.layer.kv_cache is be.kv_caches_by_layer[name]
                outs[step].append(forward_paged(context, prewrite=i == 0))
    with pytest.raises(RuntimeError, match="Paged attention runtime is already closed"):
        runtime.ensure_active(1)
    for step, start in ((0, 0), (1, 20)):
        for r in range(2):
            mask = row_mask(AttentionMode.PIECEWISE, start, 32 - start, 32, [(20, 32)])
            ref = dense_attention(q[r, start:], k[r], v[r], mask, HEAD**-0.5)
            for out in outs[step]:
                torch.testing.assert_close(out[r].double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs[1][0], outs[2][0], atol=0, rtol=0)  # step 2 reuses step 1's batch

    assert be.remove_diffusion_kv_requests([("req-1", 5)]) == 0  # another generation: kept
    assert be.remove_diffusion_kv_requests(["req-1"]) == 2
    assert be.remove_diffusion_kv_requests(["req-1"]) == 0
    with pytest.raises(KeyError, match=r"no worker row is installed for \('req-1', 0, None\)"):
        be.get_diffusion_kv_row("req-1", 0)
    assert be.install_diffusion_kv_metadata(metadata(generation=2)) is True
    assert be.get_diffusion_kv_row("req-1", 0) == 0  # freed rows are reused lowest first
    be.refresh_block_table_layout()


def test_runtime_metadata_can_be_replaced_between_steps_as_omnis_forward_context_does() -> None:
    be = initialised()
    be.install_diffusion_kv_metadata(metadata())
    runtime, activation = be.activate_paged_attention_metadata(phases())
    prefill = runtime.metadata.prefill_rows[0]
    batch = runtime.adapter.prepare_batch((prefill,))  # what Omni's paged_kv_prefill does
    with runtime.adapter.activate(batch):
        assert runtime.adapter.translator.active_batch is batch
        with pytest.raises(RuntimeError, match="cannot prepare a paged batch while another batch is active"):
            runtime.adapter.prepare_batch((prefill,))
    one_row = DiffusionPagedAttentionMetadata((phases().prefill_rows[1],), (phases().denoise_rows[1],))
    runtime.metadata = one_row  # paged_kv_prefill replaces it between steps
    with activation:
        assert runtime.ensure_active(0) is runtime.adapter
        (row,) = runtime.adapter.translator.active_batch.rows
        assert (row.request_id, row.sequence_id, row.query_len) == ("req-1", 1, 32)
        with pytest.raises(ValueError, match="non-negative denoise step index, got -1"):
            runtime.ensure_active(-1)


def test_upstream_errors_with_upstream_types() -> None:
    be = backend()
    with pytest.raises(RuntimeError, match="^paged_scheduler native BlockTables are not initialized$"):
        be.get_diffusion_kv_row("r", 0)
    with pytest.raises(RuntimeError, match="^paged_scheduler native KV cache is not initialized$"):
        be.install_diffusion_kv_metadata(metadata())
    with pytest.raises(RuntimeError, match="^paged_scheduler native attention adapter is not initialized$"):
        be.activate_paged_attention_metadata(phases())
    with pytest.raises(RuntimeError, match="must be registered before physical initialization"):
        be.initialize_kv_cache(
            kv_cache_config(dict.fromkeys(NAMES, FullAttentionSpec(16, 2, 32, torch.float32)))
        )
    specs = be.register_kv_cache_layers(layers())
    with pytest.raises(ValueError) as info:
        be.initialize_kv_cache(kv_cache_config({"other.0.attn": specs[NAMES[0]]}))
    assert str(info.value) == (
        "Rank-local Diffusion KVCacheConfig layer mismatch: "
        "expected=['blk.0.attn', 'blk.1.attn'], configured=['other.0.attn']"
    )
    odd = DiffusionKVModelRunnerBackend(
        vllm_config=vllm_config(max_num_seqs=4), od_config=od_config(), device="cpu", platform=CpuPlatform()
    )
    odd.register_kv_cache_layers(layers())
    with pytest.raises(
        ValueError,
        match="^scheduler_config.max_num_seqs must be a multiple of diffusion_kv_max_rows_per_request$",
    ):
        odd.initialize_kv_cache(kv_cache_config(specs))
    be.initialize_kv_cache(kv_cache_config(specs))
    with pytest.raises(RuntimeError, match="^Diffusion native KV cache is already initialized$"):
        be.initialize_kv_cache(kv_cache_config(specs))
    with pytest.raises(RuntimeError, match="cannot be changed after physical initialization"):
        be.register_kv_cache_layers(layers())
    be.install_diffusion_kv_metadata(metadata(generation=2))
    with pytest.raises(ValueError, match="stale allocation generation 1 for request 'req-1'"):
        be.install_diffusion_kv_metadata(metadata(generation=1))
    runtime, activation = be.activate_paged_attention_metadata(phases())
    with activation:
        runtime.ensure_active(0)
        x = torch.zeros(2, 32, HEADS, HEAD)
        kv = torch.zeros(2, 32, KV_HEADS, HEAD)
        with pytest.raises(KeyError, match="Unknown diffusion paged attention layer 'nope'"):
            runtime.adapter.prepare_layer_context("nope", x, kv, kv)
        packed = SimpleNamespace(full_attn_spans=None, packed_padding=object())
        with pytest.raises(NotImplementedError, match=r"fields \['packed_padding'\]"):
            runtime.adapter.prepare_layer_context(NAMES[0], x, kv, kv, omni_attn_metadata=packed)
        joint = SimpleNamespace(full_attn_spans=None, joint_attn_mask=torch.ones(1))
        context = runtime.adapter.prepare_layer_context(NAMES[0], x, kv, kv, omni_attn_metadata=joint)
        with pytest.raises(NotImplementedError, match=r"field\(s\) \['joint_attn_mask'\]"):
            forward_paged(context, prewrite=False)
    dense = backend("dense_legacy")
    with pytest.raises(
        ValueError, match="^Dense diffusion execution must not install Diffusion KV metadata$"
    ):
        dense.install_diffusion_kv_metadata(metadata())
    with pytest.raises(RuntimeError, match="^paged_scheduler native BlockTables are not initialized$"):
        dense.get_diffusion_kv_row("req-1", 0)


def test_registration_rejections_follow_upstream() -> None:
    be = backend()
    no_paging = SimpleNamespace(supports_paged_kv=False, get_name=lambda: "TORCH_SDPA")
    with pytest.raises(NotImplementedError) as info:
        be.register_kv_cache_layers(layers(no_paging))
    assert str(info.value) == (
        "Diffusion paged KV layer 'blk.0.attn' requires an Omni backend with paged support; selected TORCH_SDPA"
    )
    with pytest.raises(TypeError, match="^Diffusion KV layer 'x' produced unsupported spec str; only native"):
        be.register_kv_cache_layers({"x": (layers()[NAMES[0]][0], "spec")})
    with pytest.raises(NotImplementedError, match="Ring or hybrid Ulysses\\+Ring"):
        backend(ring_degree=2).register_kv_cache_layers(layers())
    with pytest.raises(NotImplementedError, match="only strict Ulysses; got ulysses_mode='relaxed'"):
        backend(ulysses_degree=2, ulysses_mode="relaxed").register_kv_cache_layers(layers())
    ulysses = backend(ulysses_degree=2).register_kv_cache_layers(layers())
    assert {spec.num_kv_heads for spec in ulysses.values()} == {1}  # rank-local KV heads
    no_geometry = DiffusionKVModelRunnerBackend(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace()), od_config=od_config(), device="cpu"
    )
    with pytest.raises(RuntimeError, match="requires a model config that exposes set_attention_geometry"):
        no_geometry.register_kv_cache_layers(layers())


# -- the platform hooks ----------------------------------------------------------------------------


def with_kernel_blocks(name: str, priority: int, *rules: int | MultipleOf) -> type[CpuReferenceBackend]:
    """The reference backend under another name and priority, its kernel taking ``rules``."""
    caps = CpuReferenceBackend.capabilities
    return type(
        f"Blocks{name.title()}",
        (CpuReferenceBackend,),
        {
            "name": name,
            "platform": "blocks",
            "priority": priority,
            "capabilities": caps.__class__(**{**caps.__dict__, "kernel_block_sizes": rules}),
        },
    )


FIXED64 = with_kernel_blocks("fixed64", 300, 64)  # one kernel block size: larger blocks are split
STRICT32 = with_kernel_blocks("strict32", 200, MultipleOf(32))  # like vLLM's CPU_ATTN


class BlocksPlatform(CpuPlatform):
    """A platform whose backends take different kernel block sizes (no entry-point backends
    join it: nothing is registered under its name)."""

    name = "blocks"
    backends = (FIXED64, STRICT32, CpuReferenceBackend)


def configured(block_size: int) -> tuple[str, int, str]:
    config = vllm_config()
    config.cache_config.block_size = block_size
    decision = DiffusionKVPlatformHooks(BlocksPlatform()).configure(config, od_config())
    assert decision.requirements.block_size == block_size
    return decision.key, config.cache_config.block_size, config.additional_config[CONFIG_KEY]


@pytest.mark.parametrize(
    ("block_size", "forced", "expected"),
    [
        (16, None, "blocks:reference"),  # neither fixed64 nor strict32 serves 16
        (32, None, "blocks:strict32"),  # fixed64 cannot (64 does not divide 32)
        (128, None, "blocks:fixed64"),  # two 64-token kernel blocks per block
        (16, "reference", "blocks:reference"),
        (32, "reference", "blocks:reference"),
        (128, "reference", "blocks:reference"),
        (32, "strict32", "blocks:strict32"),
        (128, "strict32", "blocks:strict32"),
        (128, "fixed64", "blocks:fixed64"),
    ],
)
def test_the_configured_block_size_is_served_never_changed(
    monkeypatch: pytest.MonkeyPatch, block_size: int, forced: str | None, expected: str
) -> None:
    if forced is None:
        monkeypatch.delenv(ENV_BACKEND, raising=False)
    else:
        monkeypatch.setenv(ENV_BACKEND, f"blocks:{forced}")
    assert configured(block_size) == (expected, block_size, expected)


def test_a_forced_backend_that_cannot_serve_the_block_size_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_BACKEND, "blocks:strict32")
    config = vllm_config()
    config.cache_config.block_size = 16
    with pytest.raises(UnsupportedRequirementsError) as refused:
        DiffusionKVPlatformHooks(BlocksPlatform()).configure(config, od_config())
    message = str(refused.value)
    assert "DIFFUSION_KV_BACKEND forces diffusion-kv backend blocks:strict32" in message
    assert "configured block size 16: it takes block sizes multiple of 32" in message
    assert "(e.g. 32)" in message
    assert "here blocks:reference serves block size 16 for dtype=float32, block_size=16" in message
    assert (config.cache_config.block_size, config.additional_config) == (16, {})  # nothing applied

    monkeypatch.setenv(ENV_BACKEND, "blocks:fixed64")
    config.cache_config.block_size = 96  # 64 neither equals nor divides 96
    with pytest.raises(UnsupportedRequirementsError) as refused:
        DiffusionKVPlatformHooks(BlocksPlatform()).configure(config, od_config())
    message = str(refused.value)
    assert "backend blocks:fixed64, whose kernel cannot serve vLLM-Omni's configured block size 96" in message
    assert "it takes block sizes 64 (a block size it takes, or a multiple of a fixed one" in message
    assert "(e.g. 192)" in message
    assert "here blocks:strict32, blocks:reference serve block size 96" in message
    assert (config.cache_config.block_size, config.additional_config) == (96, {})


def test_no_backend_serving_the_block_size_is_the_selection_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_BACKEND, raising=False)

    class Only32(CpuPlatform):
        name = "blocks"
        backends = (STRICT32,)

    config = vllm_config()
    config.cache_config.block_size = 16
    with pytest.raises(UnsupportedRequirementsError) as refused:
        DiffusionKVPlatformHooks(Only32()).configure(config, od_config())
    message = str(refused.value)
    assert "requirements: dtype=float32, block_size=16" in message
    assert "`blocks:strict32` (priority 200) is not supported because:" in message
    assert "block_size=16 (kernel blocks: multiple of 32; none equals or divides it)" in message
    assert config.cache_config.block_size == 16
    config.cache_config.block_size = None
    with pytest.raises(ValueError, match="cache_config.block_size must be a positive integer; got None"):
        DiffusionKVPlatformHooks(Only32()).configure(config, od_config())


def test_block_size_suggestion_and_layout_follow_the_backend() -> None:
    assert smallest_block_size_served(VllmCpuAttnBackend, 16) == 32  # CPU_ATTN: multiples of 32
    assert smallest_block_size_served(VllmCpuAttnBackend, 128) == 128
    assert smallest_block_size_served(CpuReferenceBackend, 16) == 16
    assert smallest_block_size_served(FIXED64, 16) == 64  # a fixed kernel block: a multiple of it
    assert smallest_block_size_served(FIXED64, 256) == 256  # split into four kernel blocks
    assert smallest_block_size_served(with_kernel_blocks("odd", 1, 48, MultipleOf(40)), 30) == 120
    assert (kv_cache_layout_for(VllmCpuAttnBackend), kv_cache_layout_for(CpuReferenceBackend)) == (
        "LBHNC",
        "LBNHC",
    )

    class HeadFirst(CpuReferenceBackend):
        page_layout = KVPageLayout.HEAD_FIRST

    assert kv_cache_layout_for(HeadFirst) == "LBHNC"


def test_configure_records_the_decision_in_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = DiffusionKVPlatformHooks(CpuPlatform())
    monkeypatch.setenv(ENV_BACKEND, "cpu:reference")
    config = vllm_config()
    decision = hooks.configure(config, od_config())
    assert (decision.key, decision.vllm_native) == ("cpu:reference", False)
    assert decision.requirements == Requirements(dtype=torch.float32, block_size=BLOCK)
    assert (config.cache_config.block_size, config.cache_config.kv_cache_layout) == (16, "LBNHC")
    assert config.additional_config == {CONFIG_KEY: "cpu:reference"}
    monkeypatch.delenv(ENV_BACKEND)
    assert DiffusionKVPlatformHooks(CpuPlatform()).decision_for(config).backend is CpuReferenceBackend
    kept = vllm_config()
    kept.cache_config.kv_cache_layout = "LBHNC"  # a layout already on the config is kept
    DiffusionKVPlatformHooks(CpuPlatform()).configure(kept, od_config())
    assert kept.cache_config.kv_cache_layout == "LBHNC"
    with pytest.raises(ValueError, match="recorded in the VllmConfig is not installed"):
        DiffusionKVPlatformHooks(CpuPlatform()).decision_for(
            SimpleNamespace(additional_config={CONFIG_KEY: "cpu:missing"})
        )
    assert hooks.ulysses_reasons(CpuReferenceBackend, 2) == []
    with pytest.raises(ValueError, match="ulysses_degree must be a positive integer; got 0"):
        hooks.ulysses_reasons(CpuReferenceBackend, 0)


def test_omni_block_tables_take_upstream_keywords() -> None:
    hooks = DiffusionKVPlatformHooks(CpuPlatform())
    factory = hooks.block_tables_factory(CpuReferenceBackend)
    assert hooks.block_tables_factory(CpuReferenceBackend) is factory  # one per backend
    assert isinstance(factory, OmniBlockTablesFactory) and factory.base is TorchBlockTables
    with pytest.raises(StateError, match="no TorchBlockTables has been built yet"):
        _ = factory.latest
    tables = factory(
        block_sizes=[16],
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[7],  # rounded to 8 (128 tokens); 8 stays 8
        device="cpu",
        kernel_block_sizes=[16],
        cp_size=1,
        cp_rank=0,
        cp_interleave=1,
    )
    assert type(tables) is TorchBlockTables  # the backend's own class, no subclass made for the host
    assert (tables.block_tables[0].width, tables.slot_mapping_dtype) == (8, torch.int64)
    assert factory.latest is tables
    tables.num_blocks.np[0, 2] = 5  # upstream's rollback writes the NumPy view
    assert int(tables.num_blocks.cpu[0, 2]) == 5


class Int32SlotsBackend(CpuReferenceBackend):
    name = "int32-slots"
    capabilities = dataclasses.replace(
        CpuReferenceBackend.capabilities, slot_mapping_dtypes=frozenset({torch.int32})
    )


def test_each_backend_keeps_its_own_slot_dtype_for_a_shared_block_tables_class() -> None:
    hooks = DiffusionKVPlatformHooks(CpuPlatform())
    a, b = hooks.block_tables_factory(CpuReferenceBackend), hooks.block_tables_factory(Int32SlotsBackend)
    assert a.base is b.base is TorchBlockTables
    assert (a.slot_mapping_dtype, b.slot_mapping_dtype) == (torch.int64, torch.int32)


def test_paged_batch_from_upstream_keywords() -> None:
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    seq = torch.tensor([9], dtype=torch.int32)
    kwargs: dict[str, Any] = dict(
        num_reqs=1,
        num_tokens=5,
        query_start_loc_gpu=qsl,
        query_start_loc_cpu=qsl,
        max_query_len=5,
        seq_lens=seq,
        max_seq_len=9,
        block_tables=[torch.tensor([[4, 0]], dtype=torch.int32)],
        slot_mappings=torch.arange(68, 73)[None],
        positions=torch.arange(4, 9),
        seq_lens_cpu=seq,
    )
    batch = paged_batch(0, AttentionMode.CAUSAL, **kwargs)
    assert (batch.mode, batch.slot_mapping.tolist(), batch.block_table.tolist()) == (
        AttentionMode.CAUSAL,
        [68, 69, 70, 71, 72],
        [[4, 0]],
    )
    assert paged_batch(0, AttentionMode.CAUSAL, causal={0: False}, **kwargs).mode is AttentionMode.FULL
    assert paged_batch(0, AttentionMode.CAUSAL, causal={1: False}, **kwargs).mode is AttentionMode.CAUSAL
    # upstream's flag holds for a full group too (a piecewise segment of HunyuanImage3's image
    # attention, declared non-causal, runs causal); a mapping without the group keeps its mode
    assert paged_batch(0, AttentionMode.FULL, causal=True, **kwargs).mode is AttentionMode.CAUSAL
    assert paged_batch(0, AttentionMode.FULL, causal=False, **kwargs).mode is AttentionMode.FULL
    assert paged_batch(0, AttentionMode.FULL, causal={1: True}, **kwargs).mode is AttentionMode.FULL
    with pytest.raises(ValueError, match="needs positions"):
        paged_batch(0, AttentionMode.CAUSAL, **{**kwargs, "positions": None})


@pytest.mark.parametrize("layout", list(KVPageLayout))
@pytest.mark.parametrize("vllm_layout", ["LBHNC", "LBNHC"])
def test_page_views_are_zero_copy_views_of_vllms_cache(layout: KVPageLayout, vllm_layout: str) -> None:
    blocks, heads, block, d = 3, 2, 4, 8
    physical = torch.arange(blocks * heads * block * 2 * d, dtype=torch.float32)
    if vllm_layout == "LBHNC":
        view = physical.view(blocks, heads, block, 2 * d)
    else:
        view = physical.view(blocks, block, heads, 2 * d).permute(0, 2, 1, 3)
    assert view_layout(view) == vllm_layout
    pages = page_view(view, layout, d)
    key = view[..., :d].permute(0, 2, 1, 3)  # [blocks, block, heads, d]
    value = view[..., d:].permute(0, 2, 1, 3)
    if layout is KVPageLayout.SEPARATE:
        assert isinstance(pages, tuple)
        assert torch.equal(pages[0], key) and torch.equal(pages[1], value)
        ptrs = {t.untyped_storage().data_ptr() for t in pages}
    else:
        assert isinstance(pages, torch.Tensor)
        got_k, got_v = (
            (pages[0], pages[1])
            if layout is KVPageLayout.COMBINED
            else (
                pages[0].transpose(1, 2),
                pages[1].transpose(1, 2),
            )
        )
        assert torch.equal(got_k, key) and torch.equal(got_v, value)
        ptrs = {pages.untyped_storage().data_ptr()}
    assert ptrs == {physical.untyped_storage().data_ptr()}


# -- the entry point -------------------------------------------------------------------------------


def test_plugin_names_the_platform_or_steps_aside(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert (
        omni_platform_plugin()
        == PLATFORM_PATH
        == "diffusion_kv.integrations.vllm_omni.platform.DiffusionKVOmniPlatform"
    )
    monkeypatch.setenv(ENV_PLATFORM, "no-such-platform")
    with caplog.at_level(logging.WARNING, logger="diffusion_kv.integrations.vllm_omni.plugin"):
        assert omni_platform_plugin() is None
    assert caplog.records[0].getMessage().startswith("diffusion-kv does not serve vLLM-Omni here: ")
    assert "no-such-platform" in caplog.records[0].getMessage()


def test_entry_point_and_imports_stay_free_of_vllm() -> None:
    code = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='vllm_omni.platform_plugins') if e.name == 'diffusion_kv']\n"
        "print(ep.value)\n"
        "import diffusion_kv.integrations.vllm_omni as m\n"
        "from diffusion_kv.integrations.vllm_omni import hooks, native, plugin, records, runner\n"
        "print(ep.load()())\n"
        "print(sorted(x for x in sys.modules if x.split('.')[0] in ('vllm', 'vllm_omni')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        "diffusion_kv.integrations.vllm_omni.plugin:omni_platform_plugin",
        PLATFORM_PATH,
        "[]",
    ]


def test_capabilities_of_the_wrapped_kernel_sizes() -> None:
    assert CpuReferenceBackend.capabilities.kernel_block_sizes == (MultipleOf(1),)


def test_vllm_cpu_attn_binds_only_head_major_host_caches() -> None:
    """``VllmPagedBackend.bind_kv_cache`` with its vLLM session stood in for (only the adapter
    it binds the cache to): the host's ``LBHNC`` view is adopted as is, an ``LBNHC`` one (which
    ``CPU_ATTN``'s ``view`` would misread) is refused with the layout to set."""
    from diffusion_kv.core.backend import GroupContext
    from diffusion_kv.core.batch import LayerGeometry
    from diffusion_kv.core.layout import AttentionSpec, KVCacheGroup

    geometry = LayerGeometry("blk.0.attn", 4, 2, 32, 32**-0.5, torch.float16)
    layout = CacheLayout(
        groups=(KVCacheGroup(32, ("blk.0.attn",), AttentionSpec(2, 32, torch.float16)),),
        num_blocks=3,
        max_model_len=64,
        max_rows_per_request=1,
        max_num_seqs=1,
        max_num_batched_tokens=64,
    )
    backend = object.__new__(VllmCpuAttnBackend)
    backend.group = GroupContext(
        0, (geometry,), AttentionMode.CAUSAL, 32, 32, 3, None, layout, torch.device("cpu"), "cpu"
    )  # type: ignore[arg-type]
    adapter = SimpleNamespace(kv_cache=None)
    backend.session = SimpleNamespace(adapters={"blk.0.attn": adapter})  # type: ignore[assignment]
    head_major = torch.zeros(3, 2, 32, 64, dtype=torch.float16)
    assert backend.bind_kv_cache(geometry, head_major) is head_major and adapter.kv_cache is head_major
    token_major = torch.zeros(3, 32, 2, 64, dtype=torch.float16).permute(0, 2, 1, 3)
    with pytest.raises(ValueError) as info:
        backend.bind_kv_cache(geometry, token_major)
    assert str(info.value) == (
        "backend 'vllm-cpu-attn' cannot use the given cache of layer 'blk.0.attn': layout LBNHC (the kernel "
        "reads ['LBHNC']; set the host's KV-cache layout to one of them)"
    )
    with pytest.raises(ValueError, match=r"shape \(3, 2, 16, 64\) \(expected \(3, 2, 32, 64\)\)"):
        backend.bind_kv_cache(geometry, torch.zeros(3, 2, 16, 64, dtype=torch.float16))

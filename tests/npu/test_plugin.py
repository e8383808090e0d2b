"""The npu platform and its ``direct`` backend under the emulator: detection, backend selection,
declared limits (only what the wheels document; float16 and head size 64 named as unverified),
the backend's own checks, metadata, and the call pattern (one K/V write per layer with padding
slots dropped, one FIA call per attention call, int32 slots)."""

from __future__ import annotations

import importlib.metadata
import pathlib
from collections.abc import Callable
from dataclasses import replace
from importlib.metadata import version
from typing import Any

import pytest
import torch

from diffusion_kv.conformance.harness import PagedHarness
from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.batch import LayerGeometry
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.capabilities import BASE_MODES
from diffusion_kv.core.errors import (
    ConfigurationError,
    NativeBackendError,
    PlatformUnavailableError,
    UnsupportedFeatureError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.integrations.vllm_ascend.backend import EMULATED_REASON, NO_HOST_REASON, VllmAscendBackend
from diffusion_kv.platforms.interface import (
    ENV_BACKEND,
    AttentionMode,
    Availability,
    KVPageLayout,
    Requirements,
)
from diffusion_kv.platforms.npu import NpuDirectBackend, NpuPlatform
from diffusion_kv.platforms.npu.constraints import CAPABILITIES, DOCUMENTED_LIMITS, UNVERIFIED_SUMMARY
from diffusion_kv.platforms.npu.direct import NpuAttentionMetadata
from diffusion_kv.platforms.npu.kernels import compressed_causal_mask
from diffusion_kv.platforms.selection import select_platform, validate_backend_class, validate_platform_class
from diffusion_kv.testing import EmulatorProfile, TorchNpuEmulator, emulated_torch_npu

from .helpers import BF16, HEAD, common_batch, group_context, paged_batch, without_torch_npu

F16 = torch.float16
TOL = 1e-2  # bfloat16 (vllm-ascend's precision tests use the same)
SCATTER = "npu_scatter_pa_kv_cache"
FIA = "npu_fused_infer_attention_score"
DIRECT_LINE = f"  [100] direct — {NpuDirectBackend.description}"
VLLM_ASCEND_LINE = (
    f"  [200] vllm-ascend — {VllmAscendBackend.description} [entry point 'vllm-ascend = "
    f"diffusion_kv.integrations.vllm_ascend.backend:VllmAscendBackend', diffusion-kv {version('diffusion-kv')}]"
)
UNVERIFIED_LINE = f"  {UNVERIFIED_SUMMARY}"


def make_harness(platform: NpuPlatform, **kw: Any) -> PagedHarness:
    kw.setdefault("dtype", BF16)
    kw.setdefault("head_size", HEAD)
    kw.setdefault("block_size", 128)
    kw.setdefault("num_blocks", 12)
    return PagedHarness(platform, **kw)


def qkv(h: PagedHarness, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, h.num_heads, h.head_size, generator=g).to(h.dtype)
    k = torch.randn(tokens, h.num_kv_heads, h.head_size, generator=g).to(h.dtype)
    v = torch.randn(tokens, h.num_kv_heads, h.head_size, generator=g).to(h.dtype)
    return q, k, v


def rows(spans: list[tuple[int, int]]) -> tuple[PagedRow, ...]:
    return tuple(PagedRow("r", sl - ks, sl, ks, sequence_id=i) for i, (ks, sl) in enumerate(spans))


def forward_all(
    h: PagedHarness,
    batch_rows: tuple[PagedRow, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    **kw: Any,
) -> list[torch.Tensor]:
    batch = h.translator.prepare(batch_rows)
    with h.translator.activate(batch):
        meta = AttentionMetadata(**kw) if kw else None
        return [h.executor.forward(name, q, k, v, meta) for name in h.layer_names]


def layer(name: str = "blocks.0.attn", **kw: Any) -> LayerGeometry:
    args: dict[str, Any] = dict(num_heads=4, num_kv_heads=4, head_size=HEAD, scale=0.125, dtype=BF16)
    args.update(kw)
    return LayerGeometry(name, **args)


# --- detection and selection -----------------------------------------------------------------------


@without_torch_npu
def test_detection_is_honest_without_torch_npu() -> None:
    assert NpuPlatform.is_available() == Availability(False, "torch_npu is not installed")
    assert NpuDirectBackend.is_available() == Availability(False, "torch_npu is not installed")
    calls: tuple[Callable[[], torch.device], ...] = (
        lambda: NpuPlatform().device(),
        lambda: NpuPlatform().device_for_rank(1),
    )
    for call in calls:
        with pytest.raises(PlatformUnavailableError, match="registered by torch_npu, which is not loaded"):
            call()
    with pytest.raises(
        PlatformUnavailableError, match="npu: cannot initialise a worker here: torch_npu is not installed"
    ):
        NpuPlatform().init_worker()


def test_detection_under_the_emulator(npu_emulator: TorchNpuEmulator) -> None:
    platform = NpuPlatform()
    assert NpuPlatform.is_available() == Availability(True, "torch_npu emulator (CPU)")
    assert NpuDirectBackend.is_available() == Availability(True, "torch_npu emulator (CPU)")
    assert VllmAscendBackend.is_available() == Availability(False, EMULATED_REASON)
    assert platform.device() == torch.device("cpu")
    assert platform.device_for_rank(3) == torch.device("cpu")
    assert platform.select_backend(Requirements()) is NpuDirectBackend
    platform.init_worker()  # resolves the direct backend's operators; nothing is called
    assert npu_emulator.calls == []
    assert platform.explain() == [
        "npu: selects backend 'direct' for (none)",
        f"{VLLM_ASCEND_LINE}: unavailable: {EMULATED_REASON}; {NO_HOST_REASON}",
        f"{DIRECT_LINE}: selected",
        UNVERIFIED_LINE,
    ]
    assert UNVERIFIED_LINE == (
        "  unverified, not declared: dtype float16 and head size 64 (torch_npu's TND documentation of "
        "npu_fused_infer_attention_score lists neither; first checks for a hardware run, docs/ascend.md)"
    )
    selection = select_platform()
    assert selection.platform.name == "npu"
    assert selection.how == "auto: the only available accelerator platform (torch_npu emulator (CPU))"


def test_backends_in_priority_order() -> None:
    assert NpuPlatform.backends == (NpuDirectBackend,)
    candidates = NpuPlatform().candidate_backends()
    assert [(b.name, b.priority, b.platform) for b in candidates] == [
        ("vllm-ascend", 200, "npu"),
        ("direct", 100, "npu"),
    ]
    assert candidates[0] is VllmAscendBackend  # added through the entry-point group
    (ep,) = [
        e for e in importlib.metadata.entry_points(group="diffusion_kv.backends") if e.name == "vllm-ascend"
    ]
    assert ep.value == "diffusion_kv.integrations.vllm_ascend.backend:VllmAscendBackend"
    assert validate_platform_class(NpuPlatform, "npu") == []
    assert validate_backend_class(NpuDirectBackend) == []
    assert validate_backend_class(VllmAscendBackend, "vllm-ascend") == []
    assert (NpuPlatform.device_type, NpuPlatform.distributed_backend, NpuPlatform.default_block_size) == (
        "npu",
        "hccl",
        128,
    )


def test_forcing_vllm_ascend_without_a_runtime_is_an_error(
    npu_emulator: TorchNpuEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    platform = NpuPlatform()
    monkeypatch.setenv(ENV_BACKEND, "npu:vllm-ascend")
    requirements = Requirements(dtype=BF16, head_size=HEAD, num_heads=4, num_kv_heads=4)
    with pytest.raises(UnsupportedRequirementsError) as info:
        platform.select_backend(requirements)
    assert str(info.value).splitlines() == [
        "No paged backend of platform 'npu' supports the requested requirements:",
        "  requirements: dtype=bfloat16, head_size=128, num_heads=4, num_kv_heads=4",
        f"  ({ENV_BACKEND} limits the candidates to one)",
        "  `npu:vllm-ascend` (priority 200) is not supported because:",
        f"      unavailable: {EMULATED_REASON}",
        f"      {NO_HOST_REASON}",
    ]
    assert platform.explain() == [
        "npu: no backend serves for (none)",
        f"  {ENV_BACKEND} forces 'vllm-ascend'",
        f"{VLLM_ASCEND_LINE}: unavailable: {EMULATED_REASON}; {NO_HOST_REASON}",
        UNVERIFIED_LINE,
    ]
    with pytest.raises(
        UnsupportedRequirementsError, match="vllm-ascend: unavailable: the torch_npu emulator"
    ):
        make_harness(platform)  # the worker refuses at layer registration
    with pytest.raises(UnsupportedRequirementsError, match="`npu:vllm-ascend` \\(priority 200\\)"):
        platform.init_worker()
    assert npu_emulator.calls == []


@without_torch_npu
def test_forcing_vllm_ascend_where_it_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BACKEND, "npu:vllm-ascend")
    assert NpuPlatform().backend_reasons(VllmAscendBackend, Requirements()) + NpuPlatform().host_reasons(
        VllmAscendBackend, None
    ) == [
        "unavailable: vllm_ascend is not importable",
        NO_HOST_REASON,
    ]
    with pytest.raises(UnsupportedRequirementsError, match="unavailable: vllm_ascend is not importable"):
        NpuPlatform().select_backend(Requirements())


def test_forcing_a_backend_by_name(npu_emulator: TorchNpuEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    platform = NpuPlatform()
    monkeypatch.setenv(ENV_BACKEND, "npu:direct")
    assert platform.select_backend(Requirements()) is NpuDirectBackend
    assert platform.explain() == [
        "npu: selects backend 'direct' for (none)",
        f"  {ENV_BACKEND} forces 'direct'",
        f"{DIRECT_LINE}: selected",
        UNVERIFIED_LINE,
    ]
    monkeypatch.setenv(ENV_BACKEND, "npu:fastest")
    with pytest.raises(
        ConfigurationError,
        match=r"forces backend 'fastest' on platform 'npu', which has \['vllm-ascend', 'direct'\]",
    ):
        platform.select_backend(Requirements())
    monkeypatch.setenv(ENV_BACKEND, "cuda:triton")  # another platform's choice leaves npu alone
    assert platform.select_backend(Requirements()) is NpuDirectBackend


# --- declared limits ------------------------------------------------------------------------------


def test_direct_serves_chunk_causal_masks_on_page_boundaries_only() -> None:
    chunk_causal = frozenset({AttentionMode.CHUNK_CAUSAL})
    served = Requirements(attention_modes=chunk_causal, chunk=128, window=384, sink=128)
    assert NpuDirectBackend.not_supported_reasons(served) == []
    off = Requirements(attention_modes=chunk_causal, chunk=192, window=384, sink=64)
    assert NpuDirectBackend.not_supported_reasons(off) == [
        "chunk=192, sink=64 tokens off the 128-token page (a chunk runs as one full-attention FIA row "
        "over the whole pages it sees)"
    ]
    causal_window = Requirements(attention_modes=frozenset({AttentionMode.CAUSAL}), window=256)
    assert NpuDirectBackend.not_supported_reasons(causal_window) == [
        "window=256 / sink=0 on a causal or full mask (FIA serves a window and sinks only as whole "
        "pages of a chunk-causal mask)"
    ]
    # vllm-ascend declares no chunk-causal mask
    assert any("chunk_causal" in r for r in VllmAscendBackend.not_supported_reasons(served))


def test_declared_capabilities() -> None:
    caps = VllmAscendBackend.capabilities
    assert caps is CAPABILITIES
    # direct adds chunk-causal masks (any window and sink, on page boundaries), nothing else
    direct = NpuDirectBackend.capabilities
    assert direct == replace(
        CAPABILITIES,
        attention_modes=BASE_MODES | {AttentionMode.CHUNK_CAUSAL},
        max_window=None,
        max_sink=None,
    )
    assert caps.dtypes == frozenset({torch.bfloat16})
    assert caps.head_sizes == frozenset({128, 192})
    assert caps.kernel_block_sizes == (128,)
    assert caps.slot_mapping_dtypes == frozenset({torch.int32})
    assert caps.attention_modes == BASE_MODES
    assert (caps.max_rows_per_call, caps.max_kv_heads_x_head_size, caps.max_gqa_ratio) == (4096, 65535, 64)
    assert not (caps.supports_dcp or caps.supports_ulysses or caps.supports_graph_capture)
    assert caps.problems() == []
    assert NpuDirectBackend.page_layout is KVPageLayout.SEPARATE
    assert VllmAscendBackend.page_layout is KVPageLayout.SEPARATE
    assert NpuPlatform().capabilities == direct  # the union: direct's covers vllm-ascend's
    # scheduler blocks of 256 are served as two kernel blocks of 128; 64 is not served
    assert (
        caps.kernel_block_size_for(128),
        caps.kernel_block_size_for(256),
        caps.kernel_block_size_for(64),
    ) == (
        128,
        128,
        None,
    )


def test_every_unsupported_shape_is_named() -> None:
    reasons = NpuDirectBackend.not_supported_reasons(
        Requirements(
            dtype=torch.float32,
            head_size=96,
            num_heads=512,
            num_kv_heads=4,
            block_size=64,
            num_rows=5000,
        )
    )
    assert reasons == [
        "dtype=float32 (supported: ['bfloat16'])",
        "head_size=96 (supported: [128, 192])",
        "block_size=64 (kernel blocks: 128; none equals or divides it)",
        "GQA ratio 128 exceeds 64",
        "num_rows=5000 exceeds 4096 rows per call",
        "num_heads=512 exceeds 256",
    ]
    assert NpuDirectBackend.not_supported_reasons(
        Requirements(num_heads=512, num_kv_heads=512, head_size=128)
    ) == [
        "num_kv_heads*head_size=65536 exceeds 65535",
        "num_heads=512 exceeds 256",
        "num_kv_heads=512 exceeds 256",
    ]
    assert VllmAscendBackend.not_supported_reasons(Requirements(num_heads=300, num_kv_heads=300)) == [
        "num_heads=300 exceeds 256",
        "num_kv_heads=300 exceeds 256",
    ]
    assert (
        NpuDirectBackend.not_supported_reasons(
            Requirements(dtype=torch.bfloat16, head_size=192, num_heads=64, num_kv_heads=1, block_size=256)
        )
        == []
    )
    assert NpuDirectBackend.not_supported_reasons(Requirements(dcp_size=2, ulysses_degree=2)) == [
        "Ulysses sequence parallelism (degree 2)",
        "decode context parallelism (cp_size 2)",
    ]


def test_unverified_combinations_are_named_as_such() -> None:
    """float16 and head size 64 are outside the wheels' TND documentation: refused, and said to
    be unverified rather than unsupported by the hardware."""
    reasons = NpuDirectBackend.not_supported_reasons(Requirements(dtype=F16, head_size=64))
    assert reasons == [
        "dtype=float16 (supported: ['bfloat16'])",
        "head_size=64 (supported: [128, 192])",
        "dtype=float16 is unverified on Ascend: the TND documentation of npu_fused_infer_attention_score "
        "lists bfloat16 only",
        "head_size=64 is unverified on Ascend: the TND documentation of npu_fused_infer_attention_score "
        "lists [128, 192]",
    ]
    assert VllmAscendBackend.not_supported_reasons(Requirements(dtype=F16)) == reasons[::2]
    assert NpuDirectBackend.not_supported_reasons(Requirements(dtype=BF16, head_size=192)) == []


def test_explain_names_the_unverified_request(npu_emulator: TorchNpuEmulator) -> None:
    lines = NpuPlatform().explain(Requirements(dtype=F16, head_size=HEAD))
    assert lines[0] == "npu: no backend serves for dtype=float16, head_size=128"
    assert lines[2] == (
        f"{DIRECT_LINE}: dtype=float16 (supported: ['bfloat16']); dtype=float16 is unverified on Ascend: "
        "the TND documentation of npu_fused_infer_attention_score lists bfloat16 only"
    )
    assert lines[-1] == UNVERIFIED_LINE


def test_every_declared_limit_cites_a_wheel_file() -> None:
    """docs/ascend.md renders DOCUMENTED_LIMITS; each row names the released file it comes from."""
    names = [limit.name for limit in DOCUMENTED_LIMITS]
    assert names == [
        "dtype",
        "head size",
        "query tokens per call",
        "rows per call",
        "kernel block size",
        "heads",
        "num_kv_heads * head_size",
        "causal / full calls",
        "slot mapping",
    ]
    assert all("torch_npu/_op_plugin_docs.py" in limit.source for limit in DOCUMENTED_LIMITS)
    doc = (pathlib.Path(__file__).parents[2] / "docs" / "ascend.md").read_text()
    for limit in DOCUMENTED_LIMITS:
        row = f"| {limit.name} | {limit.value} | {limit.source} |"
        assert row in doc, f"docs/ascend.md lacks the row {row!r}"


def test_platform_reasons_name_every_backend(npu_emulator: TorchNpuEmulator) -> None:
    platform = NpuPlatform()
    assert platform.not_supported_reasons(Requirements(dtype=torch.float32, head_size=80)) == [
        f"vllm-ascend: unavailable: {EMULATED_REASON}",
        f"vllm-ascend: {NO_HOST_REASON}",
        "direct: dtype=float32 (supported: ['bfloat16'])",
        "direct: head_size=80 (supported: [128, 192])",
    ]
    assert platform.not_supported_reasons(Requirements(dtype=BF16, head_size=128)) == []


def test_unsupported_layer_is_rejected_before_any_call(npu_emulator: TorchNpuEmulator) -> None:
    bad = layer(num_heads=8, num_kv_heads=8, head_size=80, scale=1.0, dtype=torch.float32)
    with pytest.raises(UnsupportedRequirementsError) as info:
        NpuDirectBackend(group_context((bad,)))
    assert str(info.value) == (
        "npu cannot serve layer 'blocks.0.attn' (dtype=float32, num_heads=8, num_kv_heads=8, head_size=80): "
        "dtype=float32 (supported: ['bfloat16']); head_size=80 (supported: [128, 192])"
    )
    with pytest.raises(UnsupportedRequirementsError, match="dtype=float16 is unverified on Ascend"):
        make_harness(NpuPlatform(), dtype=F16)
    with pytest.raises(UnsupportedRequirementsError, match="head_size=80"):
        make_harness(NpuPlatform(), head_size=80)
    assert npu_emulator.calls == []


def test_backend_refuses_what_fia_cannot_take(npu_emulator: TorchNpuEmulator) -> None:
    one = (layer(),)
    with pytest.raises(ValidationError, match=r"group 0: kernel block size 64 \(supported: 128\)"):
        NpuDirectBackend(group_context(one, block_size=64))
    with pytest.raises(ValidationError, match=r"group 0: kernel block size 256 \(supported: 128\)"):
        NpuDirectBackend(group_context(one, block_size=256))
    with pytest.raises(UnsupportedFeatureError, match="does not implement decode context parallelism"):
        NpuDirectBackend(group_context(one, cp_size=2))
    with pytest.raises(
        ValidationError,
        match="the K/V writers take int32 slot mappings; this BlockTables produces torch.int64",
    ):
        NpuDirectBackend(group_context(one, slot_mapping_dtype=torch.int64))
    assert npu_emulator.calls == []


def test_build_refuses_batches_fia_cannot_take(npu_emulator: TorchNpuEmulator) -> None:
    backend = NpuDirectBackend(group_context((layer(),)))
    md = backend.build(common_batch(4096))
    assert isinstance(md, NpuAttentionMetadata) and len(md.actual_seq_lengths) == 4096
    with pytest.raises(
        ValidationError, match="npu: batch rejected before any call: num_rows=4097 exceeds 4096 rows per call"
    ):
        backend.build(common_batch(4097))
    assert len(backend.build(paged_batch([65536], [65536])).actual_seq_lengths) == 1
    with pytest.raises(ValidationError) as info:
        backend.build(paged_batch([65537], [65537]))
    assert str(info.value) == (
        "npu: batch rejected before any call: num_tokens=65537 exceeds 65536 query tokens per call "
        "(the TND limit of npu_fused_infer_attention_score)"
    )
    with pytest.raises(
        ValidationError,
        match=r"kv_len >= query_len for every row; \(row, query_len, kv_len\) = \[\(1, 3, 2\)\]",
    ):
        backend.build(paged_batch([1, 3], [4, 2]))
    full = backend.build(paged_batch([1, 3], [4, 2], mode=AttentionMode.FULL))  # full rows may be longer
    assert (full.actual_seq_lengths, full.actual_seq_lengths_kv, full.attn_mask) == ((1, 4), (4, 2), None)
    with pytest.raises(ValidationError, match="npu: FIA takes an int32 block table; group 0 has torch.int64"):
        backend.build(paged_batch([1], [1], table_dtype=torch.int64))
    assert npu_emulator.calls == []


def test_missing_operators_fail_worker_start_and_backend_construction() -> None:
    with emulated_torch_npu(EmulatorProfile(fused_infer_attention=False)) as emu:
        with pytest.raises(NotImplementedError, match="has no npu_fused_infer_attention_score"):
            NpuPlatform().init_worker()
        with pytest.raises(NativeBackendError, match="failed to build its backend 'direct'") as info:
            make_harness(NpuPlatform())
        assert "has no npu_fused_infer_attention_score" in str(info.value)
        assert emu.calls == []


# --- the runner's parts -----------------------------------------------------------------------------


def test_runner_builds_int32_torch_block_tables_and_separate_caches(npu_emulator: TorchNpuEmulator) -> None:
    assert NpuDirectBackend.block_tables_cls() is TorchBlockTables
    h = make_harness(NpuPlatform())
    assert type(h.backend) is NpuDirectBackend
    assert type(h.block_tables) is TorchBlockTables and h.block_tables.slot_mapping_dtype == torch.int32
    cache = h.kv_caches["layer.0"]
    assert isinstance(cache, tuple) and len(cache) == 2
    assert [tuple(t.shape) for t in cache] == [(12, 128, 4, HEAD)] * 2
    assert all(t.dtype == BF16 and int(torch.count_nonzero(t)) == 0 for t in cache)
    assert cache[0].data_ptr() != cache[1].data_ptr()
    with pytest.raises(
        ValidationError,
        match=r"slot_mapping_dtype=torch.int64 is not declared by the chosen backend\(s\) \['direct'\]",
    ):
        make_harness(NpuPlatform(), slot_mapping_dtype=torch.int64)


def test_scheduler_blocks_of_256_are_split_into_kernel_blocks(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), block_size=256, num_blocks=6, max_model_len=512, layer_names=("layer.0",))
    assert h.kernel_block_size == 128
    assert [tuple(t.shape) for t in h.kv_caches["layer.0"]] == [(12, 128, 4, HEAD)] * 2
    h.install("r", [300], placement="reversed")  # scheduler blocks 5, 4 = kernel blocks 10, 11, 8, 9
    q, k, v = qkv(h, 300, seed=2)
    (out,) = forward_all(h, rows([(0, 300)]), q, k, v)
    attend = npu_emulator.calls[1]
    assert attend.op == FIA and attend.args["block_size"] == 128
    md = h.translator.prepare(rows([(299, 300)])).attn_metadata["layer.0"]
    assert md.block_table[0, :3].tolist() == [10, 11, 8] and md.block_size == 128
    ref = dense_attention(q, k, v, row_mask(AttentionMode.CAUSAL, 0, 300, 300), HEAD**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=TOL)


def test_two_kv_cache_groups_get_one_direct_backend_each(npu_emulator: TorchNpuEmulator) -> None:
    platform = NpuPlatform()
    runner = PagedWorker(
        platform,
        RunnerConfig(max_model_len=256, max_rows_per_request=2, max_num_seqs=2, max_num_batched_tokens=1024),
    )
    runner.register_kv_cache_layers(
        {
            "blocks.0.attn": PagedLayerSpec(4, 4, HEAD, BF16),
            "blocks.1.attn": PagedLayerSpec(4, 4, HEAD, BF16, mode=AttentionMode.FULL),
        }
    )
    layout = runner.initialize_kv_cache(num_blocks=8)
    assert [g.spec.mode for g in layout.groups] == [AttentionMode.CAUSAL, AttentionMode.FULL]
    assert [type(b) for b in runner.backends] == [NpuDirectBackend, NpuDirectBackend]
    assert [b.group.index for b in runner.backends] == [0, 1]
    assert [b.group.layer_names for b in runner.backends] == [("blocks.0.attn",), ("blocks.1.attn",)]
    assert npu_emulator.calls == []


# --- metadata -----------------------------------------------------------------------------------------


def test_metadata_carries_the_fia_arguments(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform())
    h.install("r", [200, 9], placement="reversed")  # row 0: blocks 11, 10; row 1: block 9
    h.prefill("r", [200, 9])
    npu_emulator.calls.clear()
    batch = h.translator.prepare(rows([(190, 200), (0, 9)]))
    md = batch.attn_metadata["layer.0"]
    assert isinstance(md, NpuAttentionMetadata)
    assert md is batch.attn_metadata["layer.1"]  # one build per KV-cache group
    assert md.actual_seq_lengths == (10, 19)  # cumulative query ends
    assert md.actual_seq_lengths_kv == (200, 9)  # per-row KV lengths
    assert md.block_table.dtype == torch.int32 and md.block_table[:, :2].tolist() == [[11, 10], [9, 0]]
    assert md.slot_mapping.dtype == torch.int32
    assert md.slot_mapping.tolist() == [10 * 128 + p for p in range(62, 72)] + [9 * 128 + p for p in range(9)]
    assert md.causal and md.attn_mask is compressed_causal_mask(torch.device("cpu"))
    assert (md.block_size, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (128, 19, 10, 200)
    assert npu_emulator.calls == []  # building metadata calls no operator


def test_full_attention_metadata_has_no_mask(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), mode=AttentionMode.FULL)
    h.install("r", [5])
    h.prefill("r", [5])
    md = h.translator.prepare(rows([(2, 5)])).attn_metadata["layer.0"]
    assert not md.causal and md.attn_mask is None
    assert (md.actual_seq_lengths, md.actual_seq_lengths_kv) == ((3,), (5,))


# --- the call pattern ---------------------------------------------------------------------------------


def test_one_write_per_layer_then_one_attention_call(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform())
    h.install("r", [130, 7])
    q, k, v = qkv(h, 137)
    forward_all(h, rows([(0, 130), (0, 7)]), q, k, v)
    assert npu_emulator.ops() == [SCATTER, FIA, SCATTER, FIA]
    write = npu_emulator.calls[0]
    assert write.args == {"cache_mode": "Norm"}
    assert write.shapes["key"] == (137, 4, HEAD) and write.dtypes["slot_mapping"] == torch.int32
    attend = npu_emulator.calls[1]
    assert attend.args["sparse_mode"] == 3
    assert attend.args["actual_seq_lengths"] == [130, 137]
    assert attend.args["actual_seq_lengths_kv"] == [130, 7]
    assert attend.shapes["query"] == (137, 4, HEAD) and attend.shapes["atten_mask"] == (2048, 2048)


def test_worked_example_one_write_three_segment_calls(npu_emulator: TorchNpuEmulator) -> None:
    """Two rows, seq_len 9, cached prefix 3, span (5, 8): [3,5) causal, [5,8) full, [8,9) causal."""
    h = make_harness(NpuPlatform())
    h.install("r", [9, 9])
    q, k, v = qkv(h, 18, seed=3)
    spans = [[(5, 8)], [(5, 8)]]
    forward_all(h, rows([(0, 9), (0, 9)]), q, k, v, full_attn_spans=spans)  # step 0 writes all 9
    npu_emulator.reset()
    q6 = torch.cat([q[3:9], q[12:18]])
    k6 = torch.cat([k[3:9], k[12:18]])
    v6 = torch.cat([v[3:9], v[12:18]])
    outs = forward_all(h, rows([(3, 9), (3, 9)]), q6, k6, v6, full_attn_spans=spans)
    assert npu_emulator.ops() == [SCATTER, FIA, FIA, FIA] * 2
    for index in range(2):
        write, *segments = npu_emulator.calls[4 * index : 4 * index + 4]
        assert write.shapes["key"] == (12, 4, HEAD)
        assert [s.args["sparse_mode"] for s in segments] == [3, 0, 3]
        assert [s.args["actual_seq_lengths"] for s in segments] == [[2, 4], [3, 6], [1, 2]]
        assert [s.args["actual_seq_lengths_kv"] for s in segments] == [[5, 5], [8, 8], [9, 9]]
        assert ["atten_mask" in s.shapes for s in segments] == [True, False, True]
    for out in outs:  # against dense attention over the same logical rows
        for r in range(2):
            mask = row_mask(AttentionMode.PIECEWISE, 3, 6, 9, spans[r])
            ref = dense_attention(
                q[9 * r + 3 : 9 * r + 9], k[9 * r : 9 * r + 9], v[9 * r : 9 * r + 9], mask, HEAD**-0.5
            )
            torch.testing.assert_close(out[6 * r : 6 * r + 6].double(), ref, atol=TOL, rtol=TOL)


def test_full_attention_layer_uses_sparse_mode_0_without_mask(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), mode=AttentionMode.FULL, layer_names=("layer.0",))
    h.install("r", [10])
    q, k, v = qkv(h, 10)
    forward_all(h, rows([(0, 10)]), q, k, v)
    attend = npu_emulator.calls[1]
    assert attend.args["sparse_mode"] == 0 and "atten_mask" not in attend.shapes


def test_older_torch_npu_writes_through_reshape_and_cache() -> None:
    outputs = {}
    for label, profile in (
        ("scatter", EmulatorProfile()),
        ("atb", EmulatorProfile(scatter_cache_mode=False)),
    ):
        with emulated_torch_npu(profile) as emu:
            h = make_harness(NpuPlatform(), placement_seed=5)
            h.install("r", [140])
            q, k, v = qkv(h, 140, seed=7)
            outputs[label] = forward_all(h, rows([(0, 140)]), q, k, v)[0]
            assert emu.ops()[0] == (SCATTER if label == "scatter" else "_npu_reshape_and_cache")
            assert (
                emu.calls[0].dtypes.get("slot_mapping", emu.calls[0].dtypes.get("slot_indices"))
                == torch.int32
            )
    torch.testing.assert_close(outputs["atb"], outputs["scatter"], atol=0, rtol=0)


def test_backend_refusals_leave_the_cache_unchanged(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), layer_names=("layer.0",))
    h.install("r", [6])
    q, k, v = qkv(h, 6)
    backend, geometry = h.backend, h.geometry["layer.0"]
    cache = h.kv_caches["layer.0"]
    md = h.translator.prepare(rows([(0, 6)])).attn_metadata["layer.0"]
    before = h.cache_snapshot()
    with pytest.raises(ValidationError, match="npu: slot mappings must be int32; got torch.int64"):
        backend.write_kv(geometry, k, v, cache, md.slot_mapping.long())
    with pytest.raises(ValidationError, match="npu: 6 K/V tokens but only 5 slots \\(layer 'layer.0'\\)"):
        backend.write_kv(geometry, k, v, cache, md.slot_mapping[:5])
    with pytest.raises(ValidationError, match="npu: query has 5 tokens; the metadata describes 6"):
        backend.forward(geometry, q[:5], cache, md)
    with pytest.raises(ValidationError, match="a \\(key_cache, value_cache\\) tuple"):
        backend.write_kv(geometry, k, v, torch.stack(list(cache)), md.slot_mapping)
    assert npu_emulator.calls == []
    assert all(torch.equal(a, b) for a, b in zip(before, h.cache_snapshot(), strict=True))


def test_forward_reads_the_pages_only(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), layer_names=("layer.0",))
    h.install("r", [6])
    q, k, v = qkv(h, 6)
    backend, geometry, cache = h.backend, h.geometry["layer.0"], h.kv_caches["layer.0"]
    md = h.translator.prepare(rows([(0, 6)])).attn_metadata["layer.0"]
    backend.write_kv(geometry, k, v, cache, md.slot_mapping)
    out = torch.empty(6, 4, HEAD, dtype=BF16)
    assert backend.forward(geometry, q, cache, md, out) is out
    again = backend.forward(geometry, q, cache, md)  # no K/V argument: the pages are the input
    assert npu_emulator.ops() == [SCATTER, FIA, FIA]
    ref = dense_attention(q, k, v, row_mask(AttentionMode.CAUSAL, 0, 6, 6), HEAD**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


# --- padding slots ------------------------------------------------------------------------------------


def test_padding_slots_are_dropped_before_the_writer(npu_emulator: TorchNpuEmulator) -> None:
    """The scatter writer documents slots >= 0 only: -1 (padding) tokens never reach it."""
    h = make_harness(NpuPlatform(), layer_names=("layer.0",))
    backend, geometry, cache = h.backend, h.geometry["layer.0"], h.kv_caches["layer.0"]
    g = torch.Generator().manual_seed(4)
    key = torch.randn(5, 4, HEAD, generator=g).to(BF16)
    value = torch.randn(5, 4, HEAD, generator=g).to(BF16)
    backend.write_kv(geometry, key, value, cache, torch.tensor([-1, 7, -1, 130, -1], dtype=torch.int32))
    (write,) = npu_emulator.calls
    assert write.shapes["key"] == (2, 4, HEAD) and write.shapes["slot_mapping"] == (2,)
    assert torch.equal(cache[0][0, 7], key[1]) and torch.equal(cache[1][1, 2], value[3])
    assert int(torch.count_nonzero(cache[0].float().abs().sum(dim=(2, 3)))) == 2
    backend.write_kv(geometry, key, value, cache, torch.full((5,), -1, dtype=torch.int32))
    assert len(npu_emulator.calls) == 1  # all padding: no call at all


def test_padding_is_found_once_per_batch_not_per_layer(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform())
    h.install("r", [20])
    q, k, v = qkv(h, 20)
    assert isinstance(h.backend, NpuDirectBackend)
    padding = h.backend.padding
    assert padding.syncs == 0
    forward_all(h, rows([(0, 20)]), q, k, v)  # two layers share the batch's slot tensor
    assert padding.syncs == 1
    forward_all(h, rows([(0, 20)]), q, k, v)  # a new batch: a new slot tensor
    assert padding.syncs == 2
    assert npu_emulator.ops() == [SCATTER, FIA] * 4


def test_a_slot_buffer_rewritten_in_place_for_the_next_batch_is_looked_at_again(
    npu_emulator: TorchNpuEmulator,
) -> None:
    """Hosts (vLLM's BlockTables) reuse one slot buffer; under inference mode torch keeps no
    version counter, so the plan is dropped at every build."""
    h = make_harness(NpuPlatform(), layer_names=("layer.0",))
    backend, geometry, cache = h.backend, h.geometry["layer.0"], h.kv_caches["layer.0"]
    assert isinstance(backend, NpuDirectBackend)
    key = torch.ones(3, 4, HEAD, dtype=BF16)
    with torch.inference_mode():
        slots = torch.tensor([0, 1, 2], dtype=torch.int32)
        backend.write_kv(geometry, key, key, cache, slots)
        slots[1] = -1  # the next batch, written into the same buffer
        backend.build(common_batch(1))
        backend.write_kv(geometry, key * 2, key * 2, cache, slots)
    assert [c.shapes["key"][0] for c in npu_emulator.calls] == [3, 2]
    assert cache[0][0, :3, 0, 0].tolist() == [2.0, 1.0, 2.0]

"""The npu plugin's direct tier under the emulator: detection, declared limits, the four parts,
and the call pattern (one K/V write per layer, one FIA call per segment, int32 slots)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from diffusion_kv.conformance.harness import PagedHarness
from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.batch import LayerGeometry
from diffusion_kv.core.errors import PlatformUnavailableError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.layout import single_group_layout
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.interface import AttentionMode, Availability, Requirements
from diffusion_kv.platforms.npu import ENV_TIER, NpuPlatform
from diffusion_kv.platforms.npu.direct import NpuAttentionMetadata, NpuBlockTables, NpuMetadataBuilder
from diffusion_kv.platforms.npu.kernels import compressed_causal_mask
from diffusion_kv.platforms.selection import select_platform
from diffusion_kv.testing import EmulatorProfile, TorchNpuEmulator, emulated_torch_npu

from .helpers import common_batch, without_torch_npu

F16 = torch.float16
SCATTER = "npu_scatter_pa_kv_cache"
FIA = "npu_fused_infer_attention_score"


def make_harness(platform: NpuPlatform, **kw: Any) -> PagedHarness:
    kw.setdefault("dtype", F16)
    kw.setdefault("head_size", 64)
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


# --- detection and selection -----------------------------------------------------------------------


@without_torch_npu
def test_detection_is_honest_without_torch_npu() -> None:
    assert NpuPlatform.is_available() == Availability(False, "torch_npu is not installed")
    with pytest.raises(PlatformUnavailableError, match="registered by torch_npu, which is not loaded"):
        NpuPlatform().device()
    with pytest.raises(
        PlatformUnavailableError, match="npu: cannot initialise a worker here: torch_npu is not installed"
    ):
        NpuPlatform().init_worker()


def test_detection_under_the_emulator(npu_emulator: TorchNpuEmulator) -> None:
    platform = NpuPlatform()
    assert NpuPlatform.is_available() == Availability(True, "torch_npu emulator (CPU)")
    assert platform.device() == torch.device("cpu")
    assert platform.tier() == "direct"
    platform.init_worker()  # resolves the operators; nothing is called
    assert npu_emulator.calls == []
    assert platform.explain() == [
        "npu: supported",
        "    tier direct (torch_npu scatter-PA write + fused-infer-attention, TND + block table): used",
        "    tier vllm-ascend (vllm-ascend BlockTables, build_attn_metadata, AscendAttentionBackendImpl): "
        "not used: the torch_npu emulator (CPU) is installed; vllm-ascend needs CANN",
        "    mode DIFFUSION_KV_NPU_TIER=auto",
    ]
    selection = select_platform()
    assert selection.platform.name == "npu"
    assert selection.how == "auto: the only available accelerator platform (torch_npu emulator (CPU))"


@without_torch_npu
def test_tier_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    platform = NpuPlatform()
    assert platform.tier() == "direct"  # auto: vllm_ascend is not importable here
    monkeypatch.setenv(ENV_TIER, "vllm-ascend")
    with pytest.raises(
        ValidationError, match="DIFFUSION_KV_NPU_TIER=vllm-ascend, but vllm_ascend is not importable"
    ):
        platform.tier()
    with (
        emulated_torch_npu(),
        pytest.raises(NotImplementedError, match="cannot run under the torch_npu emulator"),
    ):
        platform.tier()
    monkeypatch.setenv(ENV_TIER, "fastest")
    with pytest.raises(
        ValidationError, match="DIFFUSION_KV_NPU_TIER='fastest' is not one of auto, direct, vllm-ascend"
    ):
        platform.tier()


# --- declared limits ------------------------------------------------------------------------------


def test_declared_capabilities() -> None:
    caps = NpuPlatform.capabilities
    assert caps.dtypes == frozenset({torch.float16, torch.bfloat16})
    assert caps.head_sizes == frozenset({64, 128, 192})
    assert caps.kernel_block_sizes == (128,)
    assert caps.slot_mapping_dtype == torch.int32
    assert caps.attention_modes == frozenset(AttentionMode)
    assert (caps.max_rows_per_call, caps.max_kv_heads_x_head_size, caps.max_gqa_ratio) == (4096, 65535, 64)
    assert caps.needs_host_lengths and not caps.supports_dcp and not caps.supports_graph_capture
    assert NpuPlatform.default_block_size == 128
    assert NpuPlatform.kv_write_policy.value == "prewrite"


def test_every_unsupported_shape_is_named() -> None:
    reasons = NpuPlatform().not_supported_reasons(
        Requirements(
            dtype=torch.float32,
            head_size=96,
            num_heads=512,
            num_kv_heads=4,
            block_size=256,
            num_rows=5000,
        )
    )
    assert reasons == [
        "dtype=float32 (supported: ['bfloat16', 'float16'])",
        "head_size=96 (supported: [64, 128, 192])",
        "block_size=256 (supported: 128)",
        "GQA ratio 128 exceeds 64",
        "num_rows=5000 exceeds 4096 rows per call",
        "num_heads=512 exceeds 256",
    ]
    assert NpuPlatform().not_supported_reasons(
        Requirements(num_heads=512, num_kv_heads=512, head_size=128)
    ) == [
        "num_kv_heads*head_size=65536 exceeds 65535",
        "num_heads=512 exceeds 256",
        "num_kv_heads=512 exceeds 256",
    ]
    assert (
        NpuPlatform().not_supported_reasons(
            Requirements(dtype=torch.bfloat16, head_size=192, num_heads=64, num_kv_heads=1)
        )
        == []
    )


def test_unsupported_layer_is_rejected_before_any_call(npu_emulator: TorchNpuEmulator) -> None:
    layer = LayerGeometry(
        "blocks.0.attn", num_heads=8, num_kv_heads=8, head_size=80, scale=1.0, dtype=torch.float32
    )
    platform = NpuPlatform()
    with pytest.raises(UnsupportedRequirementsError) as info:
        platform.paged_backend(layer, torch.device("cpu"))
    assert str(info.value) == (
        "npu cannot serve layer 'blocks.0.attn' (dtype=float32, num_heads=8, num_kv_heads=8, head_size=80): "
        "dtype=float32 (supported: ['bfloat16', 'float16']); head_size=80 (supported: [64, 128, 192])"
    )
    with pytest.raises(UnsupportedRequirementsError, match="head_size=80"):
        make_harness(platform, head_size=80)
    assert npu_emulator.calls == []


def test_kv_cache_is_separate_k_and_v(npu_emulator: TorchNpuEmulator) -> None:
    platform = NpuPlatform()
    assert platform.kv_cache_shape(10, 128, 2, 64) == (10, 128, 2, 64)
    cache = platform.allocate_kv_cache(10, 128, 2, 64, torch.bfloat16, torch.device("cpu"))
    assert isinstance(cache, tuple) and len(cache) == 2
    assert [tuple(t.shape) for t in cache] == [(10, 128, 2, 64)] * 2
    assert all(t.dtype == torch.bfloat16 and int(torch.count_nonzero(t)) == 0 for t in cache)
    assert cache[0].data_ptr() != cache[1].data_ptr()
    with pytest.raises(
        UnsupportedRequirementsError, match=r"dtype=float32 .*; block_size=64 \(supported: 128\)"
    ):
        platform.allocate_kv_cache(10, 64, 2, 64, torch.float32, torch.device("cpu"))


# --- BlockTables and metadata -------------------------------------------------------------------------


def test_block_tables_give_int32_slots_only() -> None:
    cls = NpuPlatform().block_tables_cls()
    assert cls is NpuBlockTables
    assert "slot_mapping_dtype" not in inspect.signature(cls).parameters
    bt = cls(
        block_sizes=[128],
        max_num_reqs=2,
        max_num_batched_tokens=256,
        max_num_blocks_per_group=[2],
        device="cpu",
    )
    bt.append_block_ids(1, ([4, 2],), overwrite=True)
    bt.apply_staged_writes()
    slots = bt.compute_slot_mappings(
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([127, 128, 129]),
        num_tokens_padded=4,
    )
    assert slots.dtype == torch.int32
    assert slots.tolist() == [[4 * 128 + 127, 2 * 128, 2 * 128 + 1, -1]]


def test_metadata_builder_produces_the_fia_arguments(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform())
    h.install("r", [200, 9], placement="reversed")  # row 0: blocks 11, 10; row 1: block 9
    h.prefill("r", [200, 9])
    npu_emulator.calls.clear()
    batch = h.translator.prepare(rows([(190, 200), (0, 9)]))
    md = batch.attn_metadata["layer.0"]
    assert isinstance(md, NpuAttentionMetadata)
    assert md is batch.attn_metadata["layer.1"]
    assert md.actual_seq_lengths == (10, 19)  # cumulative query ends
    assert md.actual_seq_lengths_kv == (200, 9)  # per-row KV lengths
    assert md.block_table.dtype == torch.int32 and md.block_table[:, :2].tolist() == [[11, 10], [9, 0]]
    assert md.slot_mapping.dtype == torch.int32
    assert md.slot_mapping.tolist() == [10 * 128 + p for p in range(62, 72)] + [9 * 128 + p for p in range(9)]
    assert md.causal and md.attn_mask is compressed_causal_mask(torch.device("cpu"))
    assert (md.block_size, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (128, 19, 10, 200)
    assert npu_emulator.calls == []  # building metadata calls no operator


def test_full_attention_metadata_has_no_mask(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), causal=False)
    h.install("r", [5])
    h.prefill("r", [5])
    md = h.translator.prepare(rows([(2, 5)])).attn_metadata["layer.0"]
    assert not md.causal and md.attn_mask is None
    assert (md.actual_seq_lengths, md.actual_seq_lengths_kv) == ((3,), (5,))


def _builder(block_size: int = 128, cp_size: int = 1) -> NpuMetadataBuilder:
    layout = single_group_layout(
        ["layer.0"],
        num_kv_heads=1,
        head_size=64,
        dtype=F16,
        block_size=block_size,
        num_blocks=4,
        max_model_len=512,
        max_rows_per_request=1,
        max_num_seqs=8,
    )
    bt = NpuBlockTables(
        block_sizes=[block_size],
        max_num_reqs=8,
        max_num_batched_tokens=512,
        max_num_blocks_per_group=[4],
        device="cpu",
        cp_size=cp_size,
    )
    return NpuMetadataBuilder(layout, bt, NpuPlatform.capabilities, torch.device("cpu"))


def test_builder_rejects_what_fia_cannot_take() -> None:
    with pytest.raises(ValidationError, match=r"group 0: kernel block size 64 \(supported: 128\)"):
        _builder(block_size=64)
    with pytest.raises(NotImplementedError, match="does not implement decode context parallelism"):
        _builder(cp_size=2)
    builder = _builder()
    assert set(builder.build(common_batch(4096))) == {"layer.0"}
    with pytest.raises(
        ValidationError, match="npu: batch rejected before any call: num_rows=4097 exceeds 4096 rows per call"
    ):
        builder.build(common_batch(4097))


# --- the call pattern ---------------------------------------------------------------------------------


def test_one_write_per_layer_then_one_attention_call(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform())
    h.install("r", [130, 7])
    q, k, v = qkv(h, 137)
    forward_all(h, rows([(0, 130), (0, 7)]), q, k, v)
    assert npu_emulator.ops() == [SCATTER, FIA, SCATTER, FIA]
    write = npu_emulator.calls[0]
    assert write.args == {"cache_mode": "Norm"}
    assert write.shapes["key"] == (137, 4, 64) and write.dtypes["slot_mapping"] == torch.int32
    attend = npu_emulator.calls[1]
    assert attend.args["sparse_mode"] == 3
    assert attend.args["actual_seq_lengths"] == [130, 137]
    assert attend.args["actual_seq_lengths_kv"] == [130, 7]
    assert attend.shapes["query"] == (137, 4, 64) and attend.shapes["atten_mask"] == (2048, 2048)


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
    for layer in range(2):
        write, *segments = npu_emulator.calls[4 * layer : 4 * layer + 4]
        assert write.shapes["key"] == (12, 4, 64)
        assert [s.args["sparse_mode"] for s in segments] == [3, 0, 3]
        assert [s.args["actual_seq_lengths"] for s in segments] == [[2, 4], [3, 6], [1, 2]]
        assert [s.args["actual_seq_lengths_kv"] for s in segments] == [[5, 5], [8, 8], [9, 9]]
        assert ["atten_mask" in s.shapes for s in segments] == [True, False, True]
    for out in outs:  # against dense attention over the same logical rows
        for r in range(2):
            mask = row_mask("piecewise", 3, 6, 9, spans[r])
            ref = dense_attention(
                q[9 * r + 3 : 9 * r + 9], k[9 * r : 9 * r + 9], v[9 * r : 9 * r + 9], mask, 64**-0.5
            )
            torch.testing.assert_close(out[6 * r : 6 * r + 6].double(), ref, atol=3e-3, rtol=3e-3)


def test_full_attention_layer_uses_sparse_mode_0_without_mask(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), causal=False, layer_names=("layer.0",))
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
            assert emu.ops()[0] == (
                "npu_scatter_pa_kv_cache" if label == "scatter" else "_npu_reshape_and_cache"
            )
            assert (
                emu.calls[0].dtypes.get("slot_mapping", emu.calls[0].dtypes.get("slot_indices"))
                == torch.int32
            )
    torch.testing.assert_close(outputs["atb"], outputs["scatter"], atol=0, rtol=0)


def test_backend_refusals_leave_the_cache_unchanged(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), layer_names=("layer.0",))
    h.install("r", [6])
    q, k, v = qkv(h, 6)
    backend = h.backends["layer.0"].inner
    cache = h.kv_caches["layer.0"]
    batch = h.translator.prepare(rows([(0, 6)]))
    md = batch.attn_metadata["layer.0"]
    before = h.cache_snapshot()
    with pytest.raises(ValidationError, match="npu: slot mappings must be int32; got torch.int64"):
        backend.write_kv(k, v, cache, md.slot_mapping.long())
    with pytest.raises(ValidationError, match="npu: 6 K/V tokens but only 5 slots"):
        backend.write_kv(k, v, cache, md.slot_mapping[:5])
    with pytest.raises(ValidationError, match="npu: query has 5 tokens; the metadata describes 6"):
        backend.forward(q[:5], k[:5], v[:5], cache, md)
    with pytest.raises(ValidationError, match="a \\(key_cache, value_cache\\) tuple"):
        backend.write_kv(k, v, torch.stack(cache), md.slot_mapping)
    assert npu_emulator.calls == []
    assert all(torch.equal(a, b) for a, b in zip(before, h.cache_snapshot(), strict=True))


def test_forward_with_key_and_value_writes_then_reads(npu_emulator: TorchNpuEmulator) -> None:
    h = make_harness(NpuPlatform(), layer_names=("layer.0",))
    h.install("r", [6])
    q, k, v = qkv(h, 6)
    backend = h.backends["layer.0"].inner
    md = h.translator.prepare(rows([(0, 6)])).attn_metadata["layer.0"]
    out = torch.empty(6, 4, 64, dtype=F16)
    result = backend.forward(q, k, v, h.kv_caches["layer.0"], md, out)
    assert result is out
    assert npu_emulator.ops() == [SCATTER, FIA]
    ref = dense_attention(q, k, v, row_mask("causal", 0, 6, 6), 64**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=3e-3)

"""Golden tests of the torch_npu emulator: hand-computed vectors and the released ops' contracts.

Attention calls use what the wheels' TND documentation lists (bfloat16, head size 128); values
are chosen so every expected number is exact in bfloat16 (small integers, halves), and the
expected outputs are written out by hand, not computed by another attention implementation.
The contract cases cite what torch_npu/_op_plugin_docs.py (torch-npu 2.10.0.post4 and 2.14.0,
identical text) says the operator refuses; "not emulated" cases are valid inputs the emulator
does not model.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from diffusion_kv.platforms.npu import constraints
from diffusion_kv.testing import EmulatedNpuError, EmulatorProfile, TorchNpuEmulator, emulated_torch_npu
from diffusion_kv.testing import torch_npu_emulator as emulator_module

from .helpers import BF16, HEAD, without_torch_npu

F16 = torch.float16
BS = 128
MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)


def nd_caches(
    num_blocks: int, block_size: int, kv_heads: int, head_size: int = HEAD, dtype: torch.dtype = BF16
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, kv_heads, head_size)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def fia_args(**overrides: object) -> dict[str, object]:
    """Keyword arguments of a TND + PageAttention FIA call (block size 128)."""
    args: dict[str, object] = dict(
        input_layout="TND",
        block_size=BS,
        num_heads=1,
        num_key_value_heads=1,
        scale=1.0,
        sparse_mode=0,
    )
    args.update(overrides)
    return args


def query(tokens: int, heads: int = 1, head_size: int = HEAD, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.zeros(tokens, heads, head_size, dtype=dtype)


# --- installation ------------------------------------------------------------------------------


@without_torch_npu
def test_emulator_is_installed_only_inside_the_block() -> None:
    assert "torch_npu" not in sys.modules
    with emulated_torch_npu() as emu:
        import torch_npu

        assert torch_npu is emu.module
        assert torch_npu.__diffusion_kv_emulator__ is True
        assert torch_npu.__version__ == "2.10.0.post4"
        names = [a.name for a in torch_npu.npu_scatter_pa_kv_cache.default._schema.arguments]
        assert names[-1] == "cache_mode"
        assert str(torch_npu.npu_scatter_pa_kv_cache.default._schema.arguments[-1].default_value) == "PA_NZ"
    assert "torch_npu" not in sys.modules


@without_torch_npu
def test_emulator_restores_a_previous_module() -> None:
    sentinel = object()
    sys.modules["torch_npu"] = sentinel  # type: ignore[assignment]
    try:
        with emulated_torch_npu() as emu:
            assert sys.modules["torch_npu"] is emu.module
        assert sys.modules["torch_npu"] is sentinel
    finally:
        del sys.modules["torch_npu"]


def test_profile_without_cache_mode_changes_the_schema() -> None:
    emu = TorchNpuEmulator(EmulatorProfile(scatter_cache_mode=False))
    names = [a.name for a in emu.module.npu_scatter_pa_kv_cache.default._schema.arguments]
    assert "cache_mode" not in names


def test_atb_operators_always_exist_and_fail_on_first_call_without_nnal() -> None:
    """As in a real torch_npu: the ATB names are lazy wrappers; without NNAL's libatb.so the
    first call raises OSError (torch_npu/op_plugin/atb/_atb_ops.py)."""
    emu = TorchNpuEmulator(EmulatorProfile(nnal_installed=False))
    assert emu.module.__diffusion_kv_atb_loaded__ is False
    kc, vc = nd_caches(1, 4, 1)
    with pytest.raises(OSError, match="_npu_reshape_and_cache: libatb.so: cannot open shared object file"):
        emu.module._npu_reshape_and_cache(query(1), query(1), kc, vc, torch.tensor([0], dtype=torch.int32))
    assert emu.calls == [] and int(torch.count_nonzero(kc)) == 0
    assert TorchNpuEmulator().module.__diffusion_kv_atb_loaded__ is True


def test_emulator_limits_are_the_declared_ones() -> None:
    assert tuple(constraints.DTYPES) == emulator_module.TND_DTYPES
    assert {d for d, _ in emulator_module.TND_HEAD_SIZES} == set(constraints.HEAD_SIZES)
    assert emulator_module.TND_MAX_TOKENS == {
        "v1": constraints.MAX_TOKENS_PER_CALL,
        "v2": constraints.MAX_TOKENS_PER_CALL_V2,
    }
    assert emulator_module.MAX_BATCHES["v2"] == constraints.MAX_ROWS_PER_CALL
    assert emulator_module.MASK_SIZE == constraints.MASK_SIZE
    assert [s.qualified for s in emulator_module.EMULATED_OPS] == [
        "npu::npu_scatter_pa_kv_cache",
        "npu::npu_fused_infer_attention_score",
        "npu::npu_fused_infer_attention_score.out",
        "npu::_npu_fused_infer_attention_score_get_max_workspace",
        "npu::npu_fused_infer_attention_score_v2",
        "atb::_npu_reshape_and_cache",
        "atb::_npu_paged_attention",
        "atb::_npu_paged_attention_get_workspace",
    ]


# --- npu_scatter_pa_kv_cache ---------------------------------------------------------------------


def test_scatter_norm_writes_each_token_at_its_slot() -> None:
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(2, 2, 1, 8, F16)
    key = torch.tensor([[[1.0] * 8], [[2.0] * 8], [[3.0] * 8]], dtype=F16)
    value = -key
    slots = torch.tensor([3, 1, 0], dtype=torch.int32)
    emu.module.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="Norm")
    expected_k = torch.zeros(2, 2, 1, 8, dtype=F16)
    expected_k[1, 1] = 1.0  # slot 3 = block 1, offset 1
    expected_k[0, 1] = 2.0  # slot 1 = block 0, offset 1
    expected_k[0, 0] = 3.0  # slot 0 = block 0, offset 0
    assert torch.equal(kc, expected_k)
    assert torch.equal(vc, -expected_k)
    assert emu.ops() == ["npu_scatter_pa_kv_cache"]
    call = emu.calls[0]
    assert call.args == {"cache_mode": "Norm"}
    assert call.shapes["slot_mapping"] == (3,) and call.dtypes["slot_mapping"] == torch.int32


def test_scatter_pa_nz_layout() -> None:
    emu = TorchNpuEmulator()
    # fp16: 16 lanes; kv_heads*head_size = 2*16 = 32 -> 2 fractal columns
    kc = torch.zeros(2, 2, 4, 16, dtype=F16)
    vc = torch.zeros(2, 2, 4, 16, dtype=F16)
    key = torch.arange(32, dtype=F16).reshape(1, 2, 16)
    value = key + 100
    emu.module.npu_scatter_pa_kv_cache(key, value, kc, vc, torch.tensor([6], dtype=torch.int64))
    # slot 6 = block 1, offset 2; column c holds elements [16c, 16c + 16)
    assert torch.equal(kc[1, 0, 2], torch.arange(16, dtype=F16))
    assert torch.equal(kc[1, 1, 2], torch.arange(16, 32, dtype=F16))
    assert torch.equal(vc[1, 1, 2], torch.arange(116, 132, dtype=F16))
    assert int(torch.count_nonzero(kc)) == 31  # every written element but the zero
    assert emu.calls[0].args == {"cache_mode": "PA_NZ"}


def test_scatter_default_mode_is_pa_nz_and_rejects_nd_caches() -> None:
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(2, 128, 2, 64, F16)
    key = torch.ones(1, 2, 64, dtype=F16)
    with pytest.raises(
        EmulatedNpuError, match=r"cache_mode='PA_NZ' expects key_cache of shape \(2, 8, 2, 16\)"
    ):
        emu.module.npu_scatter_pa_kv_cache(key, key, kc, vc, torch.tensor([0], dtype=torch.int32))
    assert int(torch.count_nonzero(kc)) == 0 and emu.calls == []


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("cache_mode", "cache_mode must be 'Norm' or 'PA_NZ'; got 'ND'"),
        ("non_contiguous", "key is not contiguous"),
        ("slot_dtype", "slot dtype must be one of"),
        ("dtype_mismatch", "must share one dtype"),
        ("slot_range", "slot 4 is outside [0, 3] (the documented range;"),
        ("negative_slot", "slot -1 is outside [0, 3] (the documented range; there is no padding value"),
        ("duplicate", "duplicate slots"),
        ("slot_count", "slots must be 1-D with one entry per token (2)"),
    ],
)
def test_scatter_contract_failures_leave_caches_unchanged(case: str, message: str) -> None:
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(2, 2, 2, 8, F16)
    key = torch.ones(2, 2, 8, dtype=F16)
    value = torch.ones(2, 2, 8, dtype=F16)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    mode = "Norm"
    if case == "cache_mode":
        mode = "ND"
    elif case == "non_contiguous":
        key = torch.ones(2, 8, 2, dtype=F16).transpose(1, 2)
    elif case == "slot_dtype":
        slots = slots.to(torch.int16)
    elif case == "dtype_mismatch":
        value = value.to(torch.bfloat16)
    elif case == "slot_range":
        slots = torch.tensor([0, 4], dtype=torch.int32)
    elif case == "negative_slot":
        slots = torch.tensor([-1, 1], dtype=torch.int32)
    elif case == "duplicate":
        slots = torch.tensor([1, 1], dtype=torch.int32)
    elif case == "slot_count":
        slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(EmulatedNpuError) as info:
        emu.module.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode=mode)
    assert message in str(info.value)
    assert int(torch.count_nonzero(kc)) == 0 and int(torch.count_nonzero(vc)) == 0
    assert emu.calls == []


def test_scatter_kv_compression_scenario_is_not_emulated() -> None:
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(1, 4, 1, 8, F16)
    with pytest.raises(
        NotImplementedError, match="KV-compression scenario .* is \\(valid, but not emulated\\)"
    ):
        emu.module.npu_scatter_pa_kv_cache(
            torch.ones(1, 1, 8, dtype=F16),
            torch.ones(1, 1, 8, dtype=F16),
            kc,
            vc,
            torch.tensor([0], dtype=torch.int32),
            seq_lens=torch.tensor([1], dtype=torch.int32),
            cache_mode="Norm",
        )


def test_reshape_and_cache_needs_int32_slot_indices_and_never_sees_negative_slots() -> None:
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(1, 4, 1, 8, F16)
    key = torch.full((2, 1, 8), 5.0, dtype=F16)
    with pytest.raises(EmulatedNpuError, match="slot dtype must be one of"):
        emu.module._npu_reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(NotImplementedError, match="negative slot_indices .* \\(valid, but not emulated\\)"):
        emu.module._npu_reshape_and_cache(key, key, kc, vc, torch.tensor([2, -1], dtype=torch.int32))
    assert int(torch.count_nonzero(kc)) == 0
    emu.module._npu_reshape_and_cache(
        key=key,
        value=key * 2,
        key_cache=kc,
        value_cache=vc,
        slot_indices=torch.tensor([2, 0], dtype=torch.int32),
    )
    assert kc[0, :, 0, 0].tolist() == [5.0, 0.0, 5.0, 0.0]
    assert vc[0, :, 0, 0].tolist() == [10.0, 0.0, 10.0, 0.0]
    assert emu.ops() == ["_npu_reshape_and_cache"]


# --- fused infer attention: math ----------------------------------------------------------------


def test_fia_softmax_weights_from_hand_computed_scores() -> None:
    """scale = ln 3 and scores {0, 1} give weights {1/4, 3/4}: 0.25 * 4 + 0.75 * 8 = 7."""
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(3, BS, 1)
    kc[2, 1, 0, 0] = 1.0  # position 1 of the row lives in block 2, offset 1
    vc[2, 0, 0, :] = 4.0
    vc[2, 1, 0, :] = 8.0
    q = query(1)
    q[0, 0, 0] = 1.0
    out, lse = emu.module.npu_fused_infer_attention_score(
        q,
        kc.view(3, BS, HEAD),
        vc.view(3, BS, HEAD),
        **fia_args(
            block_table=torch.tensor([[2]], dtype=torch.int32),
            actual_seq_lengths=[1],
            actual_seq_lengths_kv=[2],
            scale=math.log(3.0),
            softmax_lse_flag=True,
        ),
    )
    assert out.dtype == BF16 and out.shape == (1, 1, HEAD)
    assert torch.equal(out, torch.full((1, 1, HEAD), 7.0, dtype=BF16))
    assert lse.shape == (1, 1, 1) and lse.dtype == torch.float32
    assert lse.item() == pytest.approx(math.log(4.0), abs=1e-6)  # log(e^0 + e^ln3)


def test_fia_lse_placeholder_is_empty_as_the_wheels_meta_function_says() -> None:
    """Without softmax_lse_flag the second output is an empty [0] float32 tensor (the meta
    registration; the docstring says a one-element zero tensor: a hardware check)."""
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(1, BS, 1)
    _, lse = emu.module.npu_fused_infer_attention_score(
        query(1),
        kc.view(1, BS, HEAD),
        vc.view(1, BS, HEAD),
        **fia_args(
            block_table=torch.tensor([[0]], dtype=torch.int32),
            actual_seq_lengths=[1],
            actual_seq_lengths_kv=[1],
        ),
    )
    assert lse.shape == (0,) and lse.dtype == torch.float32


def test_fia_worked_three_segment_example() -> None:
    """Two rows, seq_len 9, cached prefix 3, span (5, 8).

    Zero queries give uniform weights over the visible keys, and value[j] = j (row 0) or 10*j
    (row 1), so each output is the mean visible position: causal [3, 5) -> 1.5, 2; full [5, 8)
    over keys [0, 8) -> 3.5; causal [8, 9) -> 4 (row 1: ten times that).
    """
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(4, BS, 1)
    table = torch.tensor([[3], [1]], dtype=torch.int32)  # row 0 in block 3, row 1 in block 1
    for j in range(9):
        vc[3, j] = float(j)
        vc[1, j] = float(10 * j)
    segments = [  # (query tokens per row, cumulative ends, kv lengths, sparse mode, mask)
        (2, [2, 4], [5, 5], 3, MASK),
        (3, [3, 6], [8, 8], 0, None),
        (1, [1, 2], [9, 9], 3, MASK),
    ]
    outs = []
    for per_row, ends, kv, mode, mask in segments:
        out, _ = emu.module.npu_fused_infer_attention_score(
            query(2 * per_row),
            kc.view(4, BS, HEAD),
            vc.view(4, BS, HEAD),
            **fia_args(
                block_table=table,
                actual_seq_lengths=ends,
                actual_seq_lengths_kv=kv,
                sparse_mode=mode,
                atten_mask=mask,
            ),
        )
        outs.append(out[:, 0, 0].tolist())
    assert outs == [
        [1.5, 2.0, 15.0, 20.0],
        [3.5, 3.5, 3.5, 35.0, 35.0, 35.0],
        [4.0, 40.0],
    ]
    assert [c.args["sparse_mode"] for c in emu.calls] == [3, 0, 3]
    assert [c.args["actual_seq_lengths"] for c in emu.calls] == [[2, 4], [3, 6], [1, 2]]
    assert [c.args["actual_seq_lengths_kv"] for c in emu.calls] == [[5, 5], [8, 8], [9, 9]]


def test_fia_gqa_head_grouping_and_4d_cache() -> None:
    """Query heads 0-1 read KV head 0 (values 1), heads 2-3 read KV head 1 (values 2)."""
    emu = TorchNpuEmulator()
    kc = torch.zeros(1, 2, BS, HEAD, dtype=BF16)  # (blocks, kv_heads, block_size, head_size)
    vc = torch.zeros(1, 2, BS, HEAD, dtype=BF16)
    vc[0, 0, :4] = 1.0
    vc[0, 1, :4] = 2.0
    out, _ = emu.module.npu_fused_infer_attention_score(
        query(3, heads=4),
        kc,
        vc,
        **fia_args(
            num_heads=4,
            num_key_value_heads=2,
            block_table=torch.tensor([[0]], dtype=torch.int32),
            actual_seq_lengths=[3],
            actual_seq_lengths_kv=[4],
            sparse_mode=3,
            atten_mask=MASK,
        ),
    )
    assert out[:, :, 0].tolist() == [[1.0, 1.0, 2.0, 2.0]] * 3


def test_fia_rows_without_keys_and_empty_batches() -> None:
    """A kv_len 0 batch (zeros, lse -inf: what hardware does is a first check) and a zero-length
    batch in the cumulative list."""
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(2, BS, 1)
    vc[1, 0] = 6.0
    out, lse = emu.module.npu_fused_infer_attention_score(
        query(5),
        kc.view(2, BS, HEAD),
        vc.view(2, BS, HEAD),
        **fia_args(
            block_table=torch.tensor([[0], [0], [1]], dtype=torch.int32),
            actual_seq_lengths=[2, 2, 5],  # batch 0: 2 rows, batch 1: none, batch 2: 3 rows
            actual_seq_lengths_kv=[0, 4, 1],
            softmax_lse_flag=True,
        ),
    )
    assert out[:, 0, 0].tolist() == [0.0, 0.0, 6.0, 6.0, 6.0]
    assert lse[:, 0, 0].tolist() == [float("-inf"), float("-inf"), 0.0, 0.0, 0.0]


def test_fia_tnd_without_block_table_uses_cumulative_kv_lengths() -> None:
    emu = TorchNpuEmulator()
    key = torch.zeros(5, 1, HEAD, dtype=BF16)
    value = (
        torch.tensor([1.0, 3.0, 10.0, 20.0, 30.0], dtype=BF16)[:, None, None].expand(5, 1, HEAD).contiguous()
    )
    out, _ = emu.module.npu_fused_infer_attention_score(
        query(2),
        key,
        value,
        input_layout="TND",
        num_heads=1,
        actual_seq_lengths=[1, 2],
        actual_seq_lengths_kv=[2, 5],  # batch 0: keys [0, 2); batch 1: keys [2, 5)
        sparse_mode=0,
    )
    assert out[:, 0, 0].tolist() == [2.0, 20.0]


def test_fia_band_mode_is_inclusive() -> None:
    """sparse_mode 4: query r sees keys p - pre <= j <= p + next with p = r + kv_len - q_len."""
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(1, BS, 1)
    for j in range(4):
        vc[0, j] = float(4 * j)
    out, _ = emu.module.npu_fused_infer_attention_score(
        query(1),
        kc.view(1, BS, HEAD),
        vc.view(1, BS, HEAD),
        **fia_args(
            block_table=torch.tensor([[0]], dtype=torch.int32),
            actual_seq_lengths=[1],
            actual_seq_lengths_kv=[4],
            sparse_mode=4,
            atten_mask=MASK,
            pre_tokens=1,
            next_tokens=0,
        ),
    )
    assert out[0, 0, 0].item() == 10.0  # keys 2 and 3 (values 8 and 12)


def test_fia_out_variant_and_workspace() -> None:
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(1, BS, 1)
    vc[0, 0] = 2.0
    attn = torch.full((1, 1, HEAD), -1.0, dtype=BF16)
    lse = torch.zeros(0, dtype=torch.float32)
    kwargs = fia_args(
        block_table=torch.tensor([[0]], dtype=torch.int32), actual_seq_lengths=[1], actual_seq_lengths_kv=[1]
    )
    fia = emu.module.npu_fused_infer_attention_score
    workspace = emu.module._npu_fused_infer_attention_score_get_max_workspace(
        query(1), kc.view(1, BS, HEAD), vc.view(1, BS, HEAD), **kwargs
    )
    assert workspace.dtype == torch.uint8 and workspace.numel() == 0
    fia.out(
        query(1), kc.view(1, BS, HEAD), vc.view(1, BS, HEAD), workspace=workspace, out=[attn, lse], **kwargs
    )
    assert torch.equal(attn, torch.full((1, 1, HEAD), 2.0, dtype=BF16))


def test_fia_v2_learnable_sink_adds_one_logit() -> None:
    """One key with score 0 and a sink logit 0: weight 1/2 on the value 6 -> 3."""
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(1, BS, 1)
    vc[0, 0] = 6.0
    out, _ = emu.module.npu_fused_infer_attention_score_v2(
        query(1),
        kc.view(1, BS, HEAD),
        vc.view(1, BS, HEAD),
        input_layout="TND",
        block_table=torch.tensor([[0]], dtype=torch.int32),
        block_size=BS,
        actual_seq_qlen=[1],
        actual_seq_kvlen=[1],
        num_query_heads=1,
        sparse_mode=0,
        learnable_sink=torch.zeros(1, dtype=torch.bfloat16),
    )
    assert out[0, 0, 0].item() == 3.0
    assert emu.ops() == ["npu_fused_infer_attention_score_v2"]


def test_paged_attention_decode_op() -> None:
    emu = TorchNpuEmulator()
    kc, vc = nd_caches(2, 16, 1, 8, F16)
    vc[1, 0] = 2.0
    vc[1, 1] = 6.0
    out = torch.full((1, 2, 8), -1.0, dtype=F16)
    emu.module._npu_paged_attention(
        torch.zeros(1, 2, 8, dtype=F16),
        kc,
        vc,
        1,
        2,
        1.0,
        torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        out,
    )
    assert torch.equal(out, torch.full((1, 2, 8), 4.0, dtype=F16))


# --- fused infer attention: what the documentation refuses --------------------------------------


def _fia_call(emu: TorchNpuEmulator, **changes: object) -> None:
    kc, vc = nd_caches(2, BS, 1)
    q = changes.pop("query", query(2))
    key = changes.pop("key", kc.view(2, BS, HEAD))
    value = changes.pop("value", vc.view(2, BS, HEAD))
    kwargs = fia_args(
        block_table=torch.tensor([[0]], dtype=torch.int32),
        actual_seq_lengths=[2],
        actual_seq_lengths_kv=[2],
        sparse_mode=3,
        atten_mask=MASK,
    )
    kwargs.update(changes)
    emu.module.npu_fused_infer_attention_score(q, key, value, **kwargs)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"input_layout": "TNDX"}, "input_layout 'TNDX' is not one of"),
        ({"input_layout": "BSND"}, "input_layout BSND needs a 4-D query; got 3-D"),
        ({"query": query(2, dtype=torch.float32)}, "query dtype must be float16, bfloat16 or int8"),
        ({"query": query(2, dtype=F16)}, "query, key and value must share a dtype"),
        ({"query": torch.zeros(1, HEAD, 2, dtype=BF16).permute(2, 0, 1)}, "query is not contiguous"),
        ({"block_table": torch.tensor([[0]])}, "block_table must be a 2-D int32 tensor"),
        ({"actual_seq_lengths": [2, 1], "actual_seq_lengths_kv": [2, 2]}, "must be non-decreasing"),
        ({"actual_seq_lengths": [3]}, "ends at 3 but the query has 2 tokens"),
        ({"actual_seq_lengths_kv": [2, 2]}, "actual_seq_lengths_kv has 2 entries; actual_seq_lengths has 1"),
        ({"atten_mask": torch.ones(9, 9, dtype=torch.int8)}, "needs a 2048x2048 mask; got (9, 9)"),
        ({"atten_mask": MASK.to(torch.float16)}, "atten_mask dtype must be bool, int8 or uint8"),
        ({"atten_mask": MASK.t().contiguous()}, "needs the compressed causal template"),
        ({"atten_mask": None}, "sparse_mode=3 requires the compressed atten_mask"),
        ({"sparse_mode": 0}, "the TND layout takes sparse_mode=0 without a mask only"),
        ({"sparse_mode": 1}, "sparse_mode 1 is not supported with the TND layout (0, 3 or 4)"),
        ({"sparse_mode": 2}, "sparse_mode 2 is not supported with the TND layout (0, 3 or 4)"),
        ({"sparse_mode": 6}, "sparse_mode 6 is documented as not implemented"),
        ({"sparse_mode": 9}, "sparse_mode 9 is not supported with the TND layout (0, 3 or 4)"),
        (
            {
                "block_size": 16,
                "key": torch.zeros(16, 16, HEAD, dtype=BF16),
                "value": torch.zeros(16, 16, HEAD, dtype=BF16),
            },
            "must be a multiple of 128 in [128, 512]",
        ),
        ({"actual_seq_lengths_kv": [300]}, "kv length 300 is outside [0, 128]"),
        ({"block_table": torch.tensor([[5]], dtype=torch.int32)}, "block ids [5] fall outside [0, 2)"),
        ({"num_heads": 2}, "num_heads=2 does not match the query's 1 heads"),
        (
            {"query": query(2, heads=3), "num_heads": 3, "num_key_value_heads": 2},
            "must be a multiple of num_key_value_heads=2",
        ),
        ({"query": query(2, head_size=136)}, "head size 136 must be <= 512 and a multiple of 16"),
        ({"query": query(2, head_size=120)}, "head size 120 must be <= 512 and a multiple of 16"),
        (
            {"actual_seq_lengths_kv": [1]},
            "batch 0: sparse_mode=3 with the TND layout needs the query length below the KV length; "
            "got 2 query and 1 KV tokens",
        ),
        (
            {"sparse_mode": 4, "pre_tokens": -3, "next_tokens": 3},
            "batch 0: sparse_mode=4 needs pre_tokens >= -2 and next_tokens >= -2; got -3, 3",
        ),
        (
            {"sparse_mode": 4, "pre_tokens": 1, "next_tokens": -2},
            "needs pre_tokens + next_tokens >= 0; got 1, -2",
        ),
    ],
)
def test_fia_refuses_what_the_documentation_refuses(changes: dict[str, object], message: str) -> None:
    emu = TorchNpuEmulator()
    with pytest.raises(EmulatedNpuError) as info:
        _fia_call(emu, **changes)
    assert message in str(info.value)
    assert str(info.value).startswith("npu_fused_infer_attention_score: ")
    assert emu.calls == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {
                "query": query(2, dtype=F16),
                "key": torch.zeros(2, BS, HEAD, dtype=F16),
                "value": torch.zeros(2, BS, HEAD, dtype=F16),
            },
            "the TND layout takes bfloat16 only; got torch.float16 (unverified combinations: "
            "EmulatorProfile(unverified_tnd=True))",
        ),
        (
            {
                "query": query(2, head_size=64),
                "key": torch.zeros(2, BS, 64, dtype=BF16),
                "value": torch.zeros(2, BS, 64, dtype=BF16),
            },
            "the TND layout takes (query/key, value) head sizes [(128, 128), (192, 128), (192, 192)]; got (64, 64)",
        ),
    ],
    ids=["float16", "head-size-64"],
)
def test_fia_refuses_tnd_combinations_the_documentation_does_not_list(
    changes: dict[str, object], message: str
) -> None:
    emu = TorchNpuEmulator()
    with pytest.raises(EmulatedNpuError) as info:
        _fia_call(emu, **changes)
    assert message in str(info.value)


def test_unverified_combinations_run_only_when_asked_for() -> None:
    """UNVERIFIED: float16 and head size 64 under TND, exercised on purpose; the emulator's
    answer says nothing about hardware (docs/ascend.md, first checks)."""
    emu = TorchNpuEmulator(EmulatorProfile(unverified_tnd=True))
    kc, vc = nd_caches(1, BS, 2, 64, F16)
    vc[0, :3] = 3.0
    out, _ = emu.module.npu_fused_infer_attention_score(
        query(3, heads=2, head_size=64, dtype=F16),
        kc.view(1, BS, 128),
        vc.view(1, BS, 128),
        **fia_args(
            num_heads=2,
            num_key_value_heads=2,
            block_table=torch.tensor([[0]], dtype=torch.int32),
            actual_seq_lengths=[3],
            actual_seq_lengths_kv=[3],
            sparse_mode=3,
            atten_mask=MASK,
        ),
    )
    assert out.dtype == F16 and out.shape == (3, 2, 64) and bool((out == 3.0).all())


def test_value_head_size_128_with_192_keys_is_documented() -> None:
    emu = TorchNpuEmulator()
    kc = torch.zeros(1, BS, 192, dtype=BF16)
    vc = torch.ones(1, BS, 128, dtype=BF16)
    out, _ = emu.module.npu_fused_infer_attention_score(
        query(2, head_size=192),
        kc,
        vc,
        **fia_args(
            block_table=torch.tensor([[0]], dtype=torch.int32),
            actual_seq_lengths=[2],
            actual_seq_lengths_kv=[2],
        ),
    )
    assert out.shape == (2, 1, 128) and bool((out == 1.0).all())


def test_sparse_mode_3_with_equal_lengths_is_accepted_unless_read_literally() -> None:
    """The TND text asks query length < KV length for sparse_mode=3; vllm-ascend relies on
    equal lengths (prefill). Accepted by default (an open point), refused when read literally."""
    emu = TorchNpuEmulator()
    _fia_call(emu)  # 2 query tokens over 2 keys
    assert emu.ops() == ["npu_fused_infer_attention_score"]
    literal = TorchNpuEmulator(EmulatorProfile(literal_sparse3=True))
    with pytest.raises(
        EmulatedNpuError, match="needs the query length below the KV length; got 2 query and 2 KV"
    ):
        _fia_call(literal)
    _fia_call(literal, actual_seq_lengths_kv=[3])
    assert literal.ops() == ["npu_fused_infer_attention_score"]


def test_token_and_row_limits_per_entry_point() -> None:
    emu = TorchNpuEmulator()
    limit = constraints.MAX_TOKENS_PER_CALL
    with pytest.raises(
        EmulatedNpuError, match=f"the TND layout takes T <= {limit} query tokens; got {limit + 1}"
    ):
        _fia_call(emu, query=query(limit + 1), actual_seq_lengths=[2])
    rows = constraints.MAX_ROWS_PER_CALL + 1
    v1_args = dict(
        query=query(rows),
        block_table=torch.zeros(rows, 1, dtype=torch.int32),
        actual_seq_lengths=list(range(1, rows + 1)),
        actual_seq_lengths_kv=[0] * rows,
        sparse_mode=0,
        atten_mask=None,
    )
    _fia_call(emu, **v1_args)  # v1 documents no TND row limit below its B <= 65536
    assert emu.ops() == ["npu_fused_infer_attention_score"]
    v2_args = {
        "query": v1_args["query"],
        "block_table": v1_args["block_table"],
        "actual_seq_qlen": v1_args["actual_seq_lengths"],
        "actual_seq_kvlen": v1_args["actual_seq_lengths_kv"],
        "input_layout": "TND",
        "block_size": BS,
        "num_query_heads": 1,
    }
    kc, vc = nd_caches(2, BS, 1)
    with pytest.raises(EmulatedNpuError, match=f"actual_seq_lengths must hold 1..4096 entries; got {rows}"):
        emu.module.npu_fused_infer_attention_score_v2(
            v2_args.pop("query"), kc.view(2, BS, HEAD), vc.view(2, BS, HEAD), **v2_args
        )


def test_fia_kv_heads_times_head_size_limit_for_3d_caches() -> None:
    emu = TorchNpuEmulator()
    kv = torch.empty(1, BS, 256 * 256, dtype=BF16)
    with pytest.raises(EmulatedNpuError, match="num_key_value_heads\\*head_size=65536 exceeds 65535"):
        _fia_call(
            emu,
            query=query(2, heads=256, head_size=256),
            key=kv,
            value=kv,
            num_heads=256,
            num_key_value_heads=256,
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"input_layout": "BSH"}, "input_layout='BSH' is (only 'TND' is modelled) (valid, but not emulated)"),
        ({"input_layout": "BSH_BNSD"}, "input_layout='BSH_BNSD' is (only 'TND' is modelled)"),
        ({"input_layout": "NSD"}, "input_layout='NSD' is (only 'TND' is modelled)"),
        (
            {"input_layout": "BSND_BNSD", "query": torch.zeros(1, 2, 1, HEAD, dtype=BF16)},
            "input_layout='BSND_BNSD' is (only 'TND' is modelled)",
        ),
        (
            {"query": torch.zeros(2, 1, HEAD, dtype=torch.int8)},
            "an int8 (quantised) query is (valid, but not emulated)",
        ),
        (
            {
                "key": torch.zeros(2, 1, HEAD // 16, BS, 16, dtype=BF16),
                "value": torch.zeros(2, 1, HEAD // 16, BS, 16, dtype=BF16),
            },
            "5-D (NZ) paged caches are (valid, but not emulated)",
        ),
        ({"pse_shift": torch.zeros(1)}, "['pse_shift'] are (valid, but not emulated)"),
    ],
)
def test_fia_valid_inputs_it_does_not_model_are_not_emulated(
    changes: dict[str, object], message: str
) -> None:
    emu = TorchNpuEmulator()
    with pytest.raises(NotImplementedError) as info:
        _fia_call(emu, **changes)
    assert message in str(info.value)
    assert emu.calls == []

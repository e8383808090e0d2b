"""Ascend hardware lane: the real torch_npu operators against the emulator.

These run only where torch_npu imports and sees an NPU (``pytest tests/npu -m "npu and A2"``
on the self-hosted Ascend runners, see ``ci/workflows/npu.yml``); everywhere else they skip.
The whole conformance kit is run on hardware separately (``diffusion-kv conformance
--platform npu``). Tolerances follow vllm-ascend's precision tests: float16 1e-3, bfloat16 1e-2.

Cases marked ``unverified`` exercise what the wheels' TND documentation does not list
(float16, head size 64) and what it leaves open (docs/ascend.md, "first checks for a hardware
run"); the emulator runs them only with ``EmulatorProfile(unverified_tnd=True)``. A pass there
is the first evidence either way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffusion_kv.platforms.interface import Requirements
from diffusion_kv.platforms.npu import EMULATOR_REASON, NpuDirectBackend, NpuPlatform
from diffusion_kv.platforms.npu.compat import cann_release, installed_stack
from diffusion_kv.platforms.npu.kernels import SCATTER_OP, AscendKernels, compressed_causal_mask
from diffusion_kv.testing import EmulatorProfile, TorchNpuEmulator


def _hardware_reason() -> str | None:
    found = NpuPlatform.is_available()
    if not found or found.reason == EMULATOR_REASON:
        return f"needs an Ascend NPU with torch_npu ({found.reason})"
    return None


_SKIP = _hardware_reason()

pytestmark = [
    pytest.mark.npu,
    pytest.mark.A2,
    pytest.mark.A3,
    pytest.mark.cards_1,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]

TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
UNVERIFIED = EmulatorProfile(unverified_tnd=True)


def test_the_scatter_writer_is_selected() -> None:
    assert AscendKernels.load().writer == SCATTER_OP


def test_standalone_use_selects_the_direct_backend() -> None:
    platform = NpuPlatform()  # no vLLM runtime is bound here: vllm-ascend is never chosen
    assert platform.select_backend(Requirements(dtype=torch.bfloat16, head_size=128)) is NpuDirectBackend
    platform.init_worker()  # resolves the direct backend's operators


def test_the_cann_version_string_has_release_numbers() -> None:
    """First check: the format of torch_npu's CANN version string (the vllm-ascend gate matches
    its release numbers only)."""
    import torch_npu

    cann = installed_stack(torch_npu).cann
    print(f"CANN version string: {cann!r}")
    assert cann_release(cann) is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_scatter_matches_the_emulator(dtype: torch.dtype) -> None:
    device = NpuPlatform().device()
    g = torch.Generator().manual_seed(0)
    key = torch.randn(300, 8, 128, generator=g).to(dtype)
    value = torch.randn(300, 8, 128, generator=g).to(dtype)
    slots = torch.randperm(16 * 128, generator=g)[:300].to(torch.int32)  # documented range only
    shape = (16, 128, 8, 128)
    real = AscendKernels.load()
    kc, vc = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    real.write_kv(key.to(device), value.to(device), kc, vc, slots.to(device))
    emulated = AscendKernels(TorchNpuEmulator().module)
    ekc, evc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    emulated.write_kv(key, value, ekc, evc, slots)
    assert torch.equal(kc.cpu(), ekc) and torch.equal(vc.cpu(), evc)


@pytest.mark.parametrize(
    ("dtype", "head_size", "profile"),
    [
        (torch.bfloat16, 128, None),
        (torch.bfloat16, 192, None),
        pytest.param(torch.float16, 128, UNVERIFIED, id="unverified-fp16-128"),
        pytest.param(torch.bfloat16, 64, UNVERIFIED, id="unverified-bf16-64"),
    ],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fused_infer_attention_matches_the_emulator(
    dtype: torch.dtype, head_size: int, profile: EmulatorProfile | None, causal: bool
) -> None:
    """GQA 32/8, block size 128, permuted blocks, KV lengths not block multiples; row 1 queries
    all its keys (sparse_mode=3 with equal lengths: a first check)."""
    device = NpuPlatform().device()
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, bs, nb = 32, 8, head_size, 128, 24
    q_lens, kv_lens = [1, 37, 300], [200, 37, 900]
    ends = torch.tensor(q_lens).cumsum(0).tolist()
    table = torch.randperm(nb, generator=g)[: 3 * 8].reshape(3, 8).to(torch.int32)
    query = torch.randn(ends[-1], heads, d, generator=g).to(dtype)
    kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    args: dict[str, Any] = dict(
        block_table=table,
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=kv_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        scale=d**-0.5,
        causal=causal,
    )
    real = AscendKernels.load().paged_attention(
        query.to(device),
        kc.to(device),
        vc.to(device),
        causal_mask=compressed_causal_mask(device),
        **{**args, "block_table": table.to(device)},
    )
    emulated = AscendKernels(TorchNpuEmulator(profile).module).paged_attention(
        query,
        kc,
        vc,
        causal_mask=compressed_causal_mask(torch.device("cpu")),
        **args,
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(real.cpu().float(), emulated.float(), atol=tol, rtol=tol)


def test_rows_without_keys_and_the_lse_placeholder() -> None:
    """First checks: a row with KV length 0 (the emulator writes zeros) and the second output
    without softmax_lse_flag (the meta function says an empty [0] tensor, the docstring [1])."""
    import torch_npu

    device = NpuPlatform().device()
    kc = torch.zeros(2, 128, 128, dtype=torch.bfloat16, device=device)
    vc = torch.ones(2, 128, 128, dtype=torch.bfloat16, device=device)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        torch.ones(3, 1, 128, dtype=torch.bfloat16, device=device),
        kc,
        vc,
        block_table=torch.tensor([[0], [1]], dtype=torch.int32, device=device),
        input_layout="TND",
        block_size=128,
        actual_seq_lengths=[1, 3],
        actual_seq_lengths_kv=[0, 2],
        num_heads=1,
        num_key_value_heads=1,
        scale=1.0,
        sparse_mode=0,
    )
    print(f"row without keys: {out[0, 0, :4].tolist()}; lse placeholder shape {tuple(lse.shape)}")
    assert out[1:].float().cpu().eq(1.0).all()
    assert out[0].float().cpu().eq(0.0).all()
    assert tuple(lse.shape) == (0,)

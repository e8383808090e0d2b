"""``sdpa_with_lse`` on CUDA: the FlashAttention fast path (no bias, fp16/bf16) against the
memory-efficient kernel it replaced, and against a float32 reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.platforms import torch_sdpa
from diffusion_kv.platforms.torch_sdpa import sdpa_with_lse


def _efficient(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, False, scale=scale
    )[:2]
    return out, lse[..., : q.shape[2]]


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhmn,bhnd->bhmd", torch.exp(scores - lse[..., None]), v.float()), lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "d"), [(1760, 7920, 128), (33, 880, 128), (100, 33, 64), (7, 5, 128)])
def test_flash_path_matches_efficient_kernel(dtype: torch.dtype, m: int, n: int, d: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m * 31 + n)
    q = torch.randn(1, 12, m, d, device="cuda", dtype=dtype, generator=g)
    # keys and values as the backends pass them: [B, N, H, D] pages transposed (strided views)
    k = torch.randn(1, n, 12, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    v = torch.randn(1, n, 12, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    scale = d**-0.5
    assert torch_sdpa._flash_serves(q, k, v)
    out, lse = sdpa_with_lse(q, k, v, None, scale)
    eff_out, eff_lse = _efficient(q, k, v, scale)
    ref_out, ref_lse = _reference(q, k, v, scale)
    assert out.shape == (1, 12, m, d) and out.dtype == dtype
    assert lse.shape == (1, 12, m) and lse.dtype == torch.float32
    tol = 2e-2 if dtype is torch.bfloat16 else 4e-3
    assert (out.float() - eff_out.float()).abs().max().item() <= tol
    assert (out.float() - ref_out).abs().max().item() <= tol
    assert (lse - eff_lse).abs().max().item() <= 1e-3  # both natural log, float32
    assert (lse - ref_lse).abs().max().item() <= 1e-2


def test_bias_and_fp32_keep_the_efficient_kernel() -> None:
    q = torch.randn(1, 4, 40, 64, device="cuda")
    k = torch.randn(1, 4, 64, 64, device="cuda")
    v = torch.randn(1, 4, 64, 64, device="cuda")
    assert not torch_sdpa._flash_serves(q, k, v)  # fp32
    # the kernel wants the bias's row stride a multiple of 4 elements (64 keys; callers pad theirs)
    bias = torch.zeros(1, 4, 40, 64, device="cuda")
    bias[..., 32:] = float("-inf")
    out, lse = sdpa_with_lse(q, k, v, bias, 0.125)
    ref_out, ref_lse = _reference(q, k[:, :, :32], v[:, :, :32], 0.125)
    assert lse.shape == (1, 4, 40)
    assert (out - ref_out).abs().max().item() <= 1e-4
    assert (lse - ref_lse).abs().max().item() <= 1e-4

"""``PagedBackend.packed_query``: a backend that declares it gets a query packed per token
(a slice of a fused QKV projection) without a copy; one that does not gets it contiguous. The
output is the same either way, equal to dense attention over the same keys."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv import PagedLayerSpec
from diffusion_kv.core.allocation import RequestAllocation, SequenceAllocation
from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.runner import PagedWorker, RunnerConfig
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend

H, D, T, BLOCK = 4, 16, 32, 16
LAYER = "l0"


def _worker(backend: str) -> PagedWorker:
    worker = PagedWorker(
        CpuPlatform(), RunnerConfig(64, 1, 1, 64, device=torch.device("cpu"), backend=backend)
    )
    worker.register_kv_cache_layers({LAYER: PagedLayerSpec(H, H, D, torch.float32)})
    worker.initialize_kv_cache(num_blocks=8, block_size=BLOCK)
    worker.install(RequestAllocation("r", 0, (SequenceAllocation(0, 0, T, T, ((3, 5),)),)))
    return worker


def _fused(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V as slices of one ``[T, 3, H, D]`` projection: packed per token, token stride 3 * H * D."""
    qkv = torch.randn(T, 3, H, D, generator=torch.Generator().manual_seed(seed))
    return qkv[:, 0], qkv[:, 1], qkv[:, 2]


def test_the_flag_defaults_off_and_the_cpu_sdpa_backend_sets_it() -> None:
    assert PagedBackend.packed_query is False and CpuSdpaBackend.packed_query is True


@pytest.mark.parametrize("packed", [True, False])
def test_context_passes_a_packed_query_uncopied_only_when_asked(packed: bool) -> None:
    worker = _worker("sdpa")
    q, k, v = _fused()
    assert not q.is_contiguous() and q.stride() == (3 * H * D, D, 1)
    with worker.stepper() as runtime:
        runtime.ensure_rows((PagedRow("r", T, T, 0, sequence_id=0),))
        executor = worker.executor
        assert executor is not None
        for _ in range(2):  # the batch's first layer decides, the second reuses the decision
            ctx = executor.context(LAYER, q, k, v, packed_query=packed)
            assert (ctx.query.data_ptr() == q.data_ptr()) is packed
            assert ctx.query.is_contiguous() is not packed
            assert torch.equal(ctx.query, q)


def test_a_query_not_packed_per_token_is_still_made_contiguous() -> None:
    worker = _worker("sdpa")
    q = torch.randn(T, D, H).transpose(1, 2)  # head dims not packed (stride(-1) == H)
    _, k, v = _fused()
    with worker.stepper() as runtime:
        runtime.ensure_rows((PagedRow("r", T, T, 0, sequence_id=0),))
        executor = worker.executor
        assert executor is not None
        ctx = executor.context(LAYER, q, k, v, packed_query=True)
        assert ctx.query.is_contiguous() and torch.equal(ctx.query, q)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_forward_with_a_fused_query_equals_dense(backend: str) -> None:
    """``sdpa`` (packed_query) reads the fused query in place, ``reference`` gets a contiguous
    copy; both equal dense attention over the row's keys."""
    worker = _worker(backend)
    q, k, v = _fused(1)
    with worker.stepper() as runtime:
        runtime.ensure_rows((PagedRow("r", T, T, 0, sequence_id=0),))
        out = worker.forward(LAYER, q, k, v)
    dense = torch.nn.functional.scaled_dot_product_attention(  # the layer's default mode: causal
        q.transpose(0, 1).double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(), is_causal=True
    ).transpose(0, 1)
    assert out.shape == (T, H, D)
    torch.testing.assert_close(out.double(), dense, atol=1e-4, rtol=1e-4)


def test_load_time_validation_requires_a_bool() -> None:
    from typing import ClassVar

    from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
    from diffusion_kv.platforms.selection import validate_backend_class

    class Bad(CpuReferenceBackend):
        name: ClassVar[str] = "bad"
        packed_query = 1  # type: ignore[assignment]

    assert "packed_query must be a bool; got 1" in validate_backend_class(Bad)
    assert not [p for p in validate_backend_class(CpuSdpaBackend) if "packed_query" in p]

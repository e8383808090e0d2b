"""(2) Module replacement: vLLM-Omni 0.30.0 patched to run diffusion-kv's worker module.

Runs where ``vllm_omni`` is the patched copy (``ci/vllm_omni_lane.sh`` applies
``diffusion_kv/integrations/vllm_omni/patches/vllm-omni-0.30.0.patch`` to a copy of the installed
package and puts it first on ``PYTHONPATH``). vLLM-Omni's runner, forward context and
``Attention`` layers are upstream's; its ``DiffusionKVModelRunnerBackend`` and paged-attention
records are diffusion-kv's (:mod:`diffusion_kv.integrations.vllm_omni.runner`), on the same
platform plugin. The tiny DiT runs dense and paged; each paged run is compared with the dense run
and with upstream's own module on the same inputs (a subprocess without the patched copy).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch

from tests.vllm_omni import tiny_dit
from tests.vllm_omni.conftest import RUNNER_MODULE, patched

pytestmark = pytest.mark.skipif(not patched(), reason="vLLM-Omni is not patched here: zero-patch run")

SCENARIOS = {
    "fp16:auto": (torch.float16, None, "VllmCpuAttnBackend"),
    "fp16:cpu:reference": (torch.float16, "cpu:reference", "CpuReferenceBackend"),
    "fp32:auto": (torch.float32, None, "CpuSdpaBackend"),
}
TOLERANCE = {torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same scenarios through upstream's own module (the installed, unpatched vLLM-Omni)."""
    out = tmp_path_factory.mktemp("upstream") / "outputs.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DIFFUSION_KV_BACKEND")}
    script = Path(__file__).with_name("scenario.py")
    subprocess.run([sys.executable, str(script), "--out", str(out), *SCENARIOS], env=env, check=True)
    results: dict[str, Any] = torch.load(out)
    return results


@pytest.fixture(scope="module")
def dense() -> dict[torch.dtype, torch.Tensor]:
    outputs = {}
    for dtype in TOLERANCE:
        result = tiny_dit.run(tiny_dit.Shape(dtype=dtype), paged=False)
        assert result.hooks["calls"] == [
            "init_diffusion_worker_vllm_config",
            "init_diffusion_model_runner_runtime",
        ]
        assert result.tokens_per_step == [160, 160, 160]
        outputs[dtype] = result.output
    return outputs


def test_the_patch_swaps_the_module_and_nothing_else() -> None:
    from vllm_omni.diffusion import forward_context
    from vllm_omni.diffusion.diffusion_kv import model_runner_backend
    from vllm_omni.diffusion.worker import diffusion_model_runner as runner_module

    from diffusion_kv.integrations.vllm_omni import runner

    assert runner_module.DiffusionKVModelRunnerBackend is runner.DiffusionKVModelRunnerBackend
    assert runner_module.DiffusionPagedAttentionMetadata is runner.DiffusionPagedAttentionMetadata
    assert runner_module.DiffusionPagedAttentionRow is runner.DiffusionPagedAttentionRow
    assert model_runner_backend.DiffusionKVModelRunnerBackend.__module__ == model_runner_backend.__name__
    assert forward_context.override_paged_kv_adapter.__module__ == forward_context.__name__


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_patched_module_pages_with_diffusion_kvs_core(
    monkeypatch: pytest.MonkeyPatch,
    upstream: dict[str, Any],
    dense: dict[torch.dtype, torch.Tensor],
    scenario: str,
) -> None:
    dtype, forced, chosen = SCENARIOS[scenario]
    if forced is None:
        monkeypatch.delenv("DIFFUSION_KV_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DIFFUSION_KV_BACKEND", forced)
    result = tiny_dit.run(tiny_dit.Shape(dtype=dtype), paged=True, requests=2)
    # the module selects its backends through the diffusion-kv platform itself: of the KV hooks,
    # vLLM-Omni still configures the worker, and Omni's forward_paged asks the prewrite policy
    # once per layer call (2 requests x 3 steps x 2 layers)
    assert result.hooks["calls"] == [
        "configure_diffusion_vllm_config",
        "init_diffusion_worker_vllm_config",
        "init_diffusion_model_runner_runtime",
        *["requires_diffusion_paged_kv_prewrite"] * 12,
    ]
    backend: Any = result.hooks["backend"]
    assert type(backend).__module__ == RUNNER_MODULE
    assert [b.__name__ for b in backend.chosen_backends] == [chosen]
    # the caches are the scheduler's KVCacheConfig tensors (what vLLM's KV connectors register)
    (tensor,) = backend.kv_cache_config.kv_cache_tensors
    caches = backend.kv_caches_by_layer
    assert sorted(caches) == ["transformer.blocks.0.attn", "transformer.blocks.1.attn"]
    assert len({c.untyped_storage().data_ptr() for c in caches.values()}) == 1
    assert {c.untyped_storage().nbytes() for c in caches.values()} == {tensor.size}
    assert backend.block_tables.max_num_reqs == 2  # scheduler max_num_seqs (1 request x 2 CFG rows)
    assert [t.width for t in backend.block_tables.block_tables] == [4]  # 512 tokens / 128, aligned
    assert backend.runner.registry.snapshot_of("req-1") is None  # removed after its forward
    assert result.tokens_per_step == [160, 64, 64]
    runtime = result.hooks["pipeline"].runtime  # the forward context's paged_kv_runtime
    assert (type(runtime).__module__, type(runtime).__name__) == (
        RUNNER_MODULE,
        "DiffusionPagedAttentionRuntime",
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(result.output, dense[dtype], atol=tol, rtol=tol)
    assert upstream[scenario]["runner_module"] == "vllm_omni.diffusion.diffusion_kv.model_runner_backend"
    torch.testing.assert_close(result.output, upstream[scenario]["output"], atol=tol, rtol=tol)


def test_unpageable_attention_metadata_is_refused_through_omnis_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata, PackedPaddingMetadata
    from vllm_omni.diffusion.diffusion_kv.metadata import DiffusionKVMetadata, DiffusionKVSequenceMetadata
    from vllm_omni.diffusion.forward_context import set_forward_context

    from diffusion_kv.integrations.vllm_omni.records import (
        DiffusionPagedAttentionMetadata,
        DiffusionPagedAttentionRow,
    )

    monkeypatch.delenv("DIFFUSION_KV_BACKEND", raising=False)
    shape = tiny_dit.Shape(dtype=torch.float32, steps=1)
    result = tiny_dit.run(shape, paged=True)
    backend: Any = result.hooks["backend"]
    sequence = DiffusionKVSequenceMetadata(0, prefix_len=96, target_len=64, seq_len=160, block_ids=([5, 6],))
    assert backend.install_diffusion_kv_metadata(DiffusionKVMetadata("probe", 1, (sequence,))) is True
    prefill = DiffusionPagedAttentionRow("probe", 160, 160, 0, sequence_id=0)
    denoise = DiffusionPagedAttentionRow("probe", 64, 160, 96, sequence_id=0)
    runtime, activation = backend.activate_paged_attention_metadata(
        DiffusionPagedAttentionMetadata((prefill,), (denoise,))
    )
    attn = result.hooks["pipeline"].transformer.blocks[0].attn
    q = torch.zeros(1, 160, shape.heads, shape.head_size)
    kv = torch.zeros(1, 160, shape.kv_heads, shape.head_size)
    padding = PackedPaddingMetadata(160, 160, torch.tensor([0, 160]), torch.tensor([0, 160]))
    od = tiny_dit.od_config(shape, True)
    with set_forward_context(omni_diffusion_config=od, paged_kv_runtime=runtime), activation:
        runtime.ensure_active(0)
        with pytest.raises(NotImplementedError) as info:
            attn(q, kv, kv, AttentionMetadata(packed_padding=padding))
    assert str(info.value) == (
        "Diffusion paged attention cannot translate Omni attention metadata fields ['packed_padding']"
    )
    assert backend.remove_diffusion_kv_requests(["probe"]) == 1

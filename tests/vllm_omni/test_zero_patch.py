"""(1) Zero-patch embedding: vLLM-Omni 0.30.0's own paged module on diffusion-kv's platform.

Nothing of vLLM-Omni is changed: the entry point ``diffusion_kv`` in
``vllm_omni.platform_plugins`` makes ``current_omni_platform`` diffusion-kv's ``OmniPlatform``
(over ``UnspecifiedOmniPlatform`` on this CPU machine), and vLLM-Omni's runner, forward context,
``DiffusionKVModelRunnerBackend`` / ``DiffusionPagedAttentionAdapter`` and ``Attention`` layers
run a tiny DiT (:mod:`tests.vllm_omni.tiny_dit`), dense and paged, on:

* ``cpu:vllm-cpu-attn`` (float16, chosen by priority): vLLM's own ``CPU_ATTN`` kernel, the one
  upstream's module would page with on CPU; diffusion-kv supplies BlockTables, layout, block
  size and ISA;
* ``cpu:sdpa`` (float32, where CPU_ATTN does not serve) and ``cpu:reference`` (float16 forced): diffusion-kv's
  reference backend behind the vLLM-shaped wrapper, reading the same ``KVCacheConfig`` tensors.

Each paged run is compared with the dense run of the same model, and the reference backend's
output with ``CPU_ATTN``'s on the same inputs.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm_omni")

import torch

from tests.vllm_omni import tiny_dit
from tests.vllm_omni.conftest import patched

pytestmark = pytest.mark.skipif(patched(), reason="vLLM-Omni is patched here: module-replacement run")

SHAPE = tiny_dit.Shape()
TOLERANCE = {torch.float16: 2e-3, torch.float32: 1e-5}


def test_vllm_omni_resolves_diffusion_kvs_platform() -> None:
    from vllm_omni.platforms import current_omni_platform, resolve_current_omni_platform_cls_qualname
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

    platform = type(current_omni_platform)
    assert (platform.__module__, platform.__qualname__) == (
        "diffusion_kv.integrations.vllm_omni.platform",
        "DiffusionKVOmniPlatform",
    )
    assert issubclass(platform, UnspecifiedOmniPlatform)  # the delegate on a CPU machine
    assert platform.diffusion_kv_delegate == "vllm_omni.platforms.interface.UnspecifiedOmniPlatform"
    assert current_omni_platform.device_type == "cpu" and not current_omni_platform.is_cuda()
    assert resolve_current_omni_platform_cls_qualname() == (
        "diffusion_kv.integrations.vllm_omni.platform.DiffusionKVOmniPlatform"
    )
    path = current_omni_platform.get_diffusion_attn_backend_cls(None, 32)
    assert path == "diffusion_kv.integrations.vllm_omni.omni_attention.DiffusionKVTorchAttentionBackend"


def test_opt_out_and_selection_follow_the_conventions(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_omni.platforms import resolve_current_omni_platform_cls_qualname

    unspecified = "vllm_omni.platforms.interface.UnspecifiedOmniPlatform"
    monkeypatch.setenv("VLLM_PLUGINS", "vllm_omni_register_models")  # vLLM-Omni's opt-out
    assert resolve_current_omni_platform_cls_qualname() == unspecified
    monkeypatch.delenv("VLLM_PLUGINS")
    monkeypatch.setenv("DIFFUSION_KV_PLATFORM", "no-such-platform")  # nothing to serve with
    assert resolve_current_omni_platform_cls_qualname() == unspecified
    monkeypatch.setenv("DIFFUSION_KV_PLATFORM", "cpu")
    assert resolve_current_omni_platform_cls_qualname().endswith(".DiffusionKVOmniPlatform")


@pytest.fixture(scope="module")
def dense() -> dict[torch.dtype, tiny_dit.RunResult]:
    return {dtype: tiny_dit.run(tiny_dit.Shape(dtype=dtype), paged=False) for dtype in TOLERANCE}


def run_paged(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, backend: str | None) -> tiny_dit.RunResult:
    if backend is None:
        monkeypatch.delenv("DIFFUSION_KV_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DIFFUSION_KV_BACKEND", backend)
    return tiny_dit.run(tiny_dit.Shape(dtype=dtype), paged=True, requests=2)


CONFIG_HOOKS = [
    "configure_diffusion_vllm_config",
    "init_diffusion_worker_vllm_config",
    "init_diffusion_model_runner_runtime",
]


def test_dense_mode_never_touches_the_kv_hooks(dense: dict[torch.dtype, tiny_dit.RunResult]) -> None:
    for result in dense.values():
        assert result.tokens_per_step == [160, 160, 160]  # every step recomputes prefix + target
        assert result.hooks["kv_cache_layout"] is None  # configure_diffusion_vllm_config is paged-only
        assert result.hooks["calls"] == CONFIG_HOOKS[1:]


@pytest.mark.parametrize(
    ("dtype", "forced", "expected"),
    [
        (torch.float16, None, ("cpu:vllm-cpu-attn", "CPU_ATTN", "LBHNC")),
        (torch.float16, "cpu:reference", ("cpu:reference", "DIFFUSION_KV", "LBNHC")),
        (torch.float32, None, ("cpu:sdpa", "DIFFUSION_KV", "LBNHC")),
    ],
)
def test_upstream_module_pages_through_the_platform(
    monkeypatch: pytest.MonkeyPatch,
    dense: dict[torch.dtype, tiny_dit.RunResult],
    dtype: torch.dtype,
    forced: str | None,
    expected: tuple[str, str, str],
) -> None:
    result = run_paged(monkeypatch, dtype, forced)
    calls = result.hooks["calls"]
    # register: a BlockTables probe, one backend per layer; initialise: the BlockTables; then per
    # request a build per phase and per piecewise segment (step 0: 1 + 2, step 1: 1 + 1) and a
    # prewrite question per layer call (2 layers x 3 steps)
    assert tiny_dit.compress(calls) == [
        *CONFIG_HOOKS,
        "get_diffusion_kv_block_tables_cls",
        "get_diffusion_paged_kv_attn_backend",
        "get_diffusion_kv_block_tables_cls",
        *["build_diffusion_kv_attn_metadata", "requires_diffusion_paged_kv_prewrite"] * 4,
    ]
    assert [calls.count(h) for h in tiny_dit.KV_HOOKS[3:]] == [2, 2, 10, 12]
    backend: Any = result.hooks["backend"]
    assert type(backend).__module__ == "vllm_omni.diffusion.diffusion_kv.model_runner_backend"  # upstream's
    key, attn_backend, layout = expected
    assert backend.vllm_config.additional_config["diffusion_kv_backend"] == key
    assert (result.hooks["block_size"], result.hooks["kv_cache_layout"]) == (128, layout)
    # the backend's own BlockTables class, built by the platform's factory with upstream's keywords
    assert type(backend.block_tables).__qualname__ == "TorchBlockTables"
    assert hasattr(backend.block_tables.num_blocks, "np")  # upstream's rollback view
    adapters = backend._kv_cache_layer_adapters
    assert sorted(adapters) == ["transformer.blocks.0.attn", "transformer.blocks.1.attn"]
    assert {a.attn_backend.get_name() for a in adapters.values()} == {attn_backend}
    # every layer's cache is vLLM's view of the one KVCacheConfig allocation
    (tensor,) = backend.kv_cache_config.kv_cache_tensors
    storages = {a.kv_cache.untyped_storage().data_ptr() for a in adapters.values()}
    assert len(storages) == 1
    assert {a.kv_cache.untyped_storage().nbytes() for a in adapters.values()} == {tensor.size}
    # two requests, both removed after their forward: no installed rows remain
    assert len(result.hooks["block_ids"]) == 2
    assert backend._diffusion_kv_identity_to_row == {}
    assert result.tokens_per_step == [160, 64, 64]  # later steps feed only the target
    runtime = result.hooks["pipeline"].runtime  # the forward context's paged_kv_runtime
    assert (type(runtime).__module__, type(runtime).__name__) == (
        "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter",
        "DiffusionPagedAttentionRuntime",
    )
    reference = dense[dtype].output
    torch.testing.assert_close(result.output, reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_reference_backend_matches_cpu_attn_on_the_same_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    native = run_paged(monkeypatch, torch.float16, None)
    wrapped = run_paged(monkeypatch, torch.float16, "cpu:reference")
    torch.testing.assert_close(wrapped.output, native.output, atol=2e-3, rtol=2e-3)

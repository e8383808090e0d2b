"""The vllm-ascend tier's glue, against stand-in modules.

vllm-ascend cannot be installed without CANN, so these stand-ins reproduce only the documented
vllm-ascend v0.26 / vLLM 0.26 interfaces the tier calls (names, keyword arguments, return
shapes) and record how they are called. They check the tier's own logic: keyword conversion
and filtering, the forced ``ChunkedPrefill`` state, the write-once / K/V-less-forward call
pattern, the strict-Ulysses backend subclass, worker-init order and the version gate. They say
nothing about vllm-ascend's numerics, which only the hardware lane can check.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from typing import Any

import numpy as np
import pytest
import torch

from diffusion_kv.core.batch import LayerGeometry
from diffusion_kv.core.errors import StateError, ValidationError
from diffusion_kv.platforms.npu import ENV_TIER, NpuPlatform, vllm_ascend_tier
from diffusion_kv.platforms.npu.compat import SUPPORTED_VLLM_ASCEND_STACKS, AscendStack, UnsupportedStackError
from diffusion_kv.platforms.npu.vllm_ascend_tier import (
    AscendBlockTablesAdapter,
    VllmAscendMetadataBuilder,
    VllmAscendPagedBackend,
    VllmAscendTier,
    VllmRuntime,
    layer_index_problem,
)

from .helpers import common_batch, without_torch_npu

F16 = torch.float16


@dataclass
class Vendor:
    """What the stand-in modules recorded."""

    log: list[Any] = field(default_factory=list)
    current_config: list[Any] = field(default_factory=list)
    build_kwargs: list[dict[str, Any]] = field(default_factory=list)
    impls: list[Any] = field(default_factory=list)
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    return_metadata: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def vendor(monkeypatch: pytest.MonkeyPatch) -> Vendor:
    rec = Vendor()

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = ModuleSpec(name, loader=None)
        for key, value in attrs.items():
            setattr(m, key, value)
        monkeypatch.setitem(sys.modules, name, m)
        rec.modules[name] = m
        return m

    class Uva:
        def __init__(self, groups: int, rows: int) -> None:
            self.np = np.zeros((groups, rows), dtype=np.int32)

        def copy_to_uva(self) -> None:
            rec.log.append("copy_to_uva")

    class Staged:
        def clear_staged_writes(self) -> None:
            rec.log.append("clear_staged_writes")

    class AscendBlockTables:
        def __init__(self, **kwargs: Any) -> None:
            rec.log.append(("AscendBlockTables", kwargs))
            self.num_blocks = Uva(len(kwargs["block_sizes"]), kwargs["max_num_reqs"])
            self.block_tables = [Staged()]

        def append_block_ids(self, row: int, ids: tuple[list[int], ...], overwrite: bool) -> None:
            rec.log.append(("append_block_ids", row, ids, overwrite))

        def apply_staged_writes(self) -> None:
            rec.log.append("apply_staged_writes")

        def gather_block_tables(self, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
            return (torch.full((n, 2), 7, dtype=torch.int32),)

        def compute_slot_mappings(
            self, idx: torch.Tensor, qsl: torch.Tensor, pos: torch.Tensor, n: int
        ) -> torch.Tensor:
            return torch.arange(n, dtype=torch.int32)[None]

        def init_block_table_layout_tensors(self) -> None:
            rec.log.append("init_block_table_layout_tensors")

    class AscendAttentionState(enum.Enum):
        PrefillNoCache = 0
        ChunkedPrefill = 3

    def build_attn_metadata(
        *,
        attn_groups: Any,
        num_reqs: int,
        num_tokens: int,
        query_start_loc_gpu: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        max_query_len: int,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        block_tables: Any,
        slot_mappings: torch.Tensor,
        kv_cache_config: Any,
        seq_lens_np: Any = None,
        positions: Any = None,
        attn_state: Any = None,
        causal: Any = True,
    ) -> dict[str, Any]:
        kwargs = dict(locals())
        kwargs["current_config"] = rec.current_config[-1] if rec.current_config else None
        rec.build_kwargs.append(kwargs)
        return dict(rec.return_metadata)

    class AscendAttentionBackend:
        @staticmethod
        def get_supported_kernel_block_sizes() -> list[Any]:
            return ["auto", 128]

        @staticmethod
        def get_impl_cls() -> str:
            return "context-parallel dispatch"

    class AscendAttentionBackendImpl:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs
            self.config_at_init = rec.current_config[-1] if rec.current_config else None
            rec.impls.append(self)

        def do_kv_cache_update(
            self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slots: torch.Tensor
        ) -> None:
            rec.log.append(
                ("do_kv_cache_update", layer.layer_name, tuple(key.shape), key.is_contiguous(), slots.dtype)
            )

        def forward(
            self,
            layer: Any,
            query: torch.Tensor,
            key: Any,
            value: Any,
            kv_cache: Any,
            md: Any,
            output: torch.Tensor,
        ) -> torch.Tensor:
            rec.log.append(("forward", tuple(query.shape), key is None, value is None, md))
            output.fill_(1.0)
            return output

    class AscendAttentionMetadataBuilder:
        pass

    @contextlib.contextmanager
    def set_current_vllm_config(config: Any) -> Iterator[None]:
        rec.current_config.append(config)
        try:
            yield
        finally:
            rec.current_config.pop()

    module("vllm_ascend")
    module("vllm_ascend.worker")
    module("vllm_ascend.worker.v2")
    module("vllm_ascend.worker.v2.block_table", AscendBlockTables=AscendBlockTables)
    module("vllm_ascend.worker.v2.attn_utils", build_attn_metadata=build_attn_metadata)
    module("vllm_ascend.attention")
    module(
        "vllm_ascend.attention.attention_v1",
        AscendAttentionBackend=AscendAttentionBackend,
        AscendAttentionBackendImpl=AscendAttentionBackendImpl,
        AscendAttentionMetadataBuilder=AscendAttentionMetadataBuilder,
        AscendAttentionState=AscendAttentionState,
    )
    module("vllm_ascend.utils", adapt_patch=lambda: rec.log.append("adapt_patch"))
    module(
        "vllm_ascend.ascend_config",
        init_ascend_config=lambda cfg: rec.log.append(("init_ascend_config", cfg)),
    )
    module("vllm")
    module("vllm.config", set_current_vllm_config=set_current_vllm_config)
    module("vllm.v1")
    module("vllm.v1.attention")
    module("vllm.v1.attention.backend", AttentionType=types.SimpleNamespace(DECODER="decoder"))
    return rec


RUNTIME = VllmRuntime(vllm_config="VLLM-CONFIG", attn_groups="ATTN-GROUPS", kv_cache_config="KV-CONFIG")
LAYER = LayerGeometry(
    "transformer.blocks.3.attn", num_heads=8, num_kv_heads=2, head_size=128, scale=0.5, dtype=F16
)


def supported_tier(runtime: VllmRuntime | None = RUNTIME) -> VllmAscendTier:
    return VllmAscendTier(runtime, stack=lambda: SUPPORTED_VLLM_ASCEND_STACKS[0])


def test_auto_tier_needs_a_bound_runtime(vendor: Vendor, monkeypatch: pytest.MonkeyPatch) -> None:
    platform = NpuPlatform()
    assert platform.tier() == "direct"
    assert platform.explain()[2] == (
        "    tier vllm-ascend (vllm-ascend BlockTables, build_attn_metadata, AscendAttentionBackendImpl): "
        "not used: vllm_ascend is importable, but no vLLM runtime is bound (embedding hosts only)"
    )
    platform.bind_vllm_runtime("VLLM-CONFIG", "ATTN-GROUPS", "KV-CONFIG")
    assert platform.tier() == "vllm-ascend"
    assert platform.vllm_ascend_tier().runtime == RUNTIME
    assert platform.explain()[1:] == [
        "    tier direct (torch_npu scatter-PA write + fused-infer-attention, TND + block table): "
        "not used: vllm-ascend tier in use",
        "    tier vllm-ascend (vllm-ascend BlockTables, build_attn_metadata, AscendAttentionBackendImpl): used",
        "    mode DIFFUSION_KV_NPU_TIER=auto",
    ]
    monkeypatch.setenv(ENV_TIER, "direct")
    assert platform.tier() == "direct"
    assert platform.explain()[2].endswith("not used: DIFFUSION_KV_NPU_TIER=direct")


@without_torch_npu
def test_platform_parts_refuse_an_unsupported_installed_set(vendor: Vendor) -> None:
    platform = NpuPlatform()
    platform.bind_vllm_runtime("VLLM-CONFIG", "ATTN-GROUPS", "KV-CONFIG")
    with pytest.raises(UnsupportedStackError) as info:
        platform.block_tables_cls()  # this machine: torch 2.13, no CANN, no torch_npu
    assert f"torch {torch.__version__} (expected 2.10.0)" in str(info.value)
    assert "DIFFUSION_KV_NPU_TIER=direct" in str(info.value)
    assert vendor.log == []


def test_platform_dispatches_to_the_tier(vendor: Vendor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_ascend_tier, "installed_stack", lambda: SUPPORTED_VLLM_ASCEND_STACKS[0])
    platform = NpuPlatform()
    platform.bind_vllm_runtime("VLLM-CONFIG", "ATTN-GROUPS", "KV-CONFIG")
    assert platform.block_tables_cls() is AscendBlockTablesAdapter
    builder = platform.metadata_builder(None, None, [LAYER], torch.device("cpu"))  # type: ignore[arg-type]
    assert isinstance(builder, VllmAscendMetadataBuilder) and builder.reorder_batch_threshold == 1
    assert isinstance(platform.paged_backend(LAYER, torch.device("cpu")), VllmAscendPagedBackend)


def test_worker_init_checks_versions_first(vendor: Vendor) -> None:
    bad = VllmAscendTier(RUNTIME, stack=lambda: AscendStack(None, None, None, None, None))
    with pytest.raises(UnsupportedStackError, match="CANN missing \\(expected 9.1.0\\)"):
        bad.init_worker()
    assert vendor.log == []
    supported_tier().init_worker()
    assert vendor.log == ["adapt_patch", ("init_ascend_config", "VLLM-CONFIG")]
    with pytest.raises(StateError, match="NpuPlatform.bind_vllm_runtime"):
        supported_tier(None).init_worker()


def test_configure_block_size_takes_the_first_integer_kernel_size(vendor: Vendor) -> None:
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=16))
    assert supported_tier().configure_block_size(config) == 128
    assert config.cache_config.block_size == 128


def test_block_tables_adapter(vendor: Vendor) -> None:
    bt = AscendBlockTablesAdapter(
        block_sizes=[256],
        max_num_reqs=3,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[4],
        device="cpu",
        kernel_block_sizes=[128],
    )
    assert vendor.log[0] == (
        "AscendBlockTables",
        dict(
            block_sizes=[256],
            max_num_reqs=3,
            max_num_batched_tokens=64,
            max_num_blocks_per_group=[4],
            device=torch.device("cpu"),
            kernel_block_sizes=[128],
            cp_size=1,
            cp_rank=0,
            cp_interleave=1,
        ),
    )
    assert bt.blocks_per_kv_block == [2] and bt.slot_mapping_dtype == torch.int32
    bt.num_blocks.cpu[0, 1] = 6  # the core's rollback writes through .cpu
    assert bt.inner.num_blocks.np[0, 1] == 6
    bt.append_block_ids(1, ([3],), overwrite=True)
    bt.apply_staged_writes()
    bt.num_blocks.copy_to_uva()
    bt.block_tables[0].clear_staged_writes()
    assert vendor.log[1:] == [
        ("append_block_ids", 1, ([3],), True),
        "apply_staged_writes",
        "copy_to_uva",
        "clear_staged_writes",
    ]
    assert bt.gather_block_tables(torch.tensor([1], dtype=torch.int32), 2)[0].tolist() == [[7, 7], [7, 7]]


def test_build_attn_metadata_forces_chunked_prefill_and_filters_keywords(vendor: Vendor) -> None:
    vendor.return_metadata = {
        "layer.0": types.SimpleNamespace(actual_seq_lengths_q=[1], seq_lens_list=[1], block_tables=None)
    }
    builder = supported_tier().metadata_builder()
    batch = common_batch(3)
    out = builder.build(batch)
    assert set(out) == {"layer.0"}
    (kwargs,) = vendor.build_kwargs
    state = vendor.modules["vllm_ascend.attention.attention_v1"].AscendAttentionState
    assert kwargs["attn_state"] is state.ChunkedPrefill
    assert isinstance(kwargs["seq_lens_np"], np.ndarray) and kwargs["seq_lens_np"].tolist() == [1, 1, 1]
    assert (kwargs["attn_groups"], kwargs["kv_cache_config"]) == ("ATTN-GROUPS", "KV-CONFIG")
    assert kwargs["num_reqs"] == 3 and kwargs["causal"] is True
    assert kwargs["query_start_loc_cpu"] is batch.query_start_loc_cpu
    assert kwargs["current_config"] == "VLLM-CONFIG"
    # keywords this (stand-in) version does not take were dropped, not passed
    assert "seq_lens_cpu_upper_bound" not in kwargs and "dcp_local_seq_lens" not in kwargs


def test_build_attn_metadata_checks_what_came_back(vendor: Vendor) -> None:
    vendor.return_metadata = {"layer.0": types.SimpleNamespace(seq_lens_list=[1])}
    with pytest.raises(
        StateError, match=r"layer 'layer.0' without \['actual_seq_lengths_q', 'block_tables'\]"
    ):
        supported_tier().metadata_builder().build(common_batch(1))


def test_strict_ulysses_backend_subclass(vendor: Vendor) -> None:
    attention = vendor.modules["vllm_ascend.attention.attention_v1"]
    tier = supported_tier()
    backend = attention.AscendAttentionBackend
    assert tier.paged_backend_cls(backend, ulysses_degree=1) is backend
    strict = tier.paged_backend_cls(backend, ulysses_degree=4)
    assert issubclass(strict, backend) and strict is not backend
    assert strict.get_impl_cls() is attention.AscendAttentionBackendImpl
    assert strict.get_builder_cls() is attention.AscendAttentionMetadataBuilder
    assert backend.get_impl_cls() == "context-parallel dispatch"  # the original is untouched
    assert tier.paged_backend_cls(backend, ulysses_degree=2) is strict  # cached
    assert tier.paged_backend_cls(int, ulysses_degree=2) is int  # not an Ascend backend


def test_paged_backend_writes_once_then_reads_without_kv(vendor: Vendor) -> None:
    backend = supported_tier().paged_backend(LAYER, torch.device("cpu"))
    (impl,) = vendor.impls
    assert impl.kwargs == dict(
        num_heads=8,
        head_size=128,
        scale=0.5,
        num_kv_heads=2,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
    )
    assert impl.config_at_init == "VLLM-CONFIG"
    adapter = backend.adapter
    assert (adapter.layer_name, adapter._k_scale_float, adapter._v_scale_float) == (
        "transformer.blocks.3.attn",
        1.0,
        1.0,
    )
    packed = torch.zeros(5, 3, 128, dtype=F16)
    cache = (torch.zeros(1), torch.zeros(1))
    backend.write_kv(packed[:, :2], packed[:, :2], cache, torch.arange(6, dtype=torch.int32))
    out = backend.forward(torch.zeros(5, 8, 128, dtype=F16), None, None, cache, "MD")
    assert vendor.log == [
        ("do_kv_cache_update", "transformer.blocks.3.attn", (5, 2, 128), True, torch.int32),
        ("forward", (5, 8, 128), True, True, "MD"),
    ]
    assert out.shape == (5, 8, 128) and bool((out == 1).all())


@pytest.mark.parametrize("name", ["attn", "blocks.1.attn.2"])
def test_layer_names_need_one_integer_component(vendor: Vendor, name: str) -> None:
    layer = LayerGeometry(name, num_heads=8, num_kv_heads=2, head_size=128, scale=0.5, dtype=F16)
    with pytest.raises(ValidationError, match="must contain exactly one integer component"):
        supported_tier().paged_backend(layer, torch.device("cpu"))
    assert vendor.impls == []
    assert layer_index_problem("transformer.blocks.3.attn") is None


def test_parts_without_runtime_explain_the_binding(vendor: Vendor) -> None:
    with pytest.raises(StateError, match="standalone use sets DIFFUSION_KV_NPU_TIER=direct"):
        supported_tier(None).metadata_builder()

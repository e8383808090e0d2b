"""The ``npu:vllm-ascend`` backend's glue, against stand-in modules.

vllm-ascend cannot be installed without CANN, so these stand-ins reproduce only the documented
vllm-ascend v0.26 / vLLM 0.26 interfaces the backend calls (names, keyword arguments, return
shapes) and record how they are called. They check the backend's own logic: selection (a bound
runtime, no emulator), keyword conversion and filtering, the forced ``ChunkedPrefill`` state,
the per-group view of the host's runtime, the write-once / K/V-less-forward call pattern, the
strict-Ulysses backend subclass, worker-init order and the version gate. They say nothing
about vllm-ascend's numerics, which only the hardware lane can check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from importlib.metadata import version
from typing import Any

import numpy as np
import pytest
import torch

from diffusion_kv.core.batch import LayerGeometry
from diffusion_kv.core.errors import (
    StateError,
    UnsupportedFeatureError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.host import HostRuntime
from diffusion_kv.core.runner import PagedLayerSpec, PagedWorker, RunnerConfig
from diffusion_kv.integrations.vllm_ascend import backend as vllm_ascend_backend
from diffusion_kv.integrations.vllm_ascend.backend import (
    BUILD_KEYWORDS,
    EMULATED_REASON,
    LAYER_ATTRIBUTES,
    NO_HOST_REASON,
    POOLING_REASON,
    VENDOR_USES,
    AscendBlockTablesAdapter,
    AscendLayerAdapter,
    VllmAscendBackend,
    layer_index_problem,
)
from diffusion_kv.platforms.interface import ENV_BACKEND, Availability, KVPageLayout, Requirements
from diffusion_kv.platforms.npu import NpuDirectBackend, NpuPlatform
from diffusion_kv.platforms.npu.compat import SUPPORTED_VLLM_ASCEND_STACKS, AscendStack, UnsupportedStackError
from diffusion_kv.platforms.npu.constraints import UNVERIFIED_SUMMARY
from diffusion_kv.testing import TorchNpuEmulator

from .helpers import BF16, common_batch, group_context, without_torch_npu

LAYER_NAME = "transformer.blocks.3.attn"
LAYER = LayerGeometry(LAYER_NAME, num_heads=8, num_kv_heads=2, head_size=128, scale=0.5, dtype=BF16)
KV_CONFIG = types.SimpleNamespace(num_blocks=4, kv_cache_groups=["GROUP-0"])
HOST = HostRuntime(config="VLLM-CONFIG", attn_groups=[["ATTN-GROUP-0"]], kv_cache_config=KV_CONFIG)
DIRECT_LINE = f"  [100] direct — {NpuDirectBackend.description}"
VLLM_ASCEND_LINE = (
    f"  [200] vllm-ascend — {VllmAscendBackend.description} [entry point 'vllm-ascend = "
    f"diffusion_kv.integrations.vllm_ascend.backend:VllmAscendBackend', diffusion-kv {version('diffusion-kv')}]"
)
POOLING_HOST = types.SimpleNamespace(model_config=types.SimpleNamespace(runner_type="pooling"))


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

        @staticmethod
        def get_builder_cls() -> str:
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
            rec.log.append(("forward", layer.layer_name, tuple(query.shape), key is None, value is None, md))
            output.fill_(1.0)
            return output

    class AscendAttentionMetadataBuilder:
        pass

    @dataclass
    class AscendMetadata:
        actual_seq_lengths_q: list[int] = field(default_factory=list)
        seq_lens_list: list[int] = field(default_factory=list)
        block_tables: Any = None
        model_runner_type: str = ""

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
        AscendMetadata=AscendMetadata,
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


@pytest.fixture
def supported_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed version set reads as the supported one."""
    monkeypatch.setattr(vllm_ascend_backend, "installed_stack", lambda *_: SUPPORTED_VLLM_ASCEND_STACKS[0])


def make_backend(
    *layers: LayerGeometry, index: int = 0, host: HostRuntime | None = HOST
) -> VllmAscendBackend:
    return VllmAscendBackend(group_context(layers or (LAYER,), index=index, host=host))


# --- selection --------------------------------------------------------------------------------------


@without_torch_npu
def test_selected_only_with_a_host_runtime(vendor: Vendor, monkeypatch: pytest.MonkeyPatch) -> None:
    platform = NpuPlatform()
    assert VllmAscendBackend.is_available() == Availability(True, "vllm-ascend (version unknown)")
    assert VllmAscendBackend.needs_host and VllmAscendBackend.uses_host_kernels
    assert platform.backend_reasons(VllmAscendBackend, Requirements()) == []
    assert platform.host_reasons(VllmAscendBackend, None) == [NO_HOST_REASON]
    with pytest.raises(UnsupportedRequirementsError) as info:  # direct: no torch_npu on this machine
        platform.select_backend(Requirements())
    assert str(info.value).splitlines()[2:] == [
        "  `npu:vllm-ascend` (priority 200) is not supported because:",
        f"      {NO_HOST_REASON}",
        "  `npu:direct` (priority 100) is not supported because:",
        "      unavailable: torch_npu is not installed",
    ]
    assert platform.backend_reasons(VllmAscendBackend, Requirements()) == []
    assert platform.host_reasons(VllmAscendBackend, HOST) == []
    assert platform.select_backend(Requirements(dtype=BF16, head_size=128), host=HOST) is VllmAscendBackend
    incomplete = HostRuntime(config="VLLM-CONFIG", kv_cache_config=KV_CONFIG, name="vLLM-Omni")
    assert platform.host_reasons(VllmAscendBackend, incomplete) == [
        "the vLLM-Omni runtime lacks attn_groups: vllm-ascend's metadata builder and attention impl need the "
        "host's vllm_config, attn_groups and kv_cache_config"
    ]
    assert platform.explain(host=HOST) == [
        "npu: selects backend 'vllm-ascend' for (none)",
        f"{VLLM_ASCEND_LINE}: selected",
        f"{DIRECT_LINE}: unavailable: torch_npu is not installed",
        f"  {UNVERIFIED_SUMMARY}",
    ]
    # the capability limits still apply to it
    assert platform.backend_reasons(VllmAscendBackend, Requirements(head_size=80, num_heads=300)) == [
        "head_size=80 (supported: [128, 192])",
        "num_heads=300 exceeds 256",
    ]
    monkeypatch.setenv(ENV_BACKEND, "npu:direct")
    with pytest.raises(UnsupportedRequirementsError, match="unavailable: torch_npu is not installed"):
        platform.select_backend(Requirements(), host=HOST)


def test_never_selected_under_the_emulator(vendor: Vendor, npu_emulator: TorchNpuEmulator) -> None:
    platform = NpuPlatform()
    assert VllmAscendBackend.is_available() == Availability(False, EMULATED_REASON)
    assert platform.backend_reasons(VllmAscendBackend, Requirements()) == [f"unavailable: {EMULATED_REASON}"]
    assert platform.select_backend(Requirements(), host=HOST) is NpuDirectBackend
    assert platform.explain(host=HOST)[1] == f"{VLLM_ASCEND_LINE}: unavailable: {EMULATED_REASON}"


@without_torch_npu
def test_a_worker_on_the_vllm_ascend_backend(
    vendor: Vendor, supported_stack: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Selection through the runner: vllm-ascend's BlockTables, one backend for the group, and
    separate K/V pages [kernel_blocks, 128, Hkv, D]."""
    platform = NpuPlatform()
    runner = PagedWorker(
        platform,
        RunnerConfig(
            max_model_len=256,
            max_rows_per_request=2,
            max_num_seqs=2,
            max_num_batched_tokens=1024,
            device=torch.device("cpu"),
        ),
        host=HOST,
    )
    runner.register_kv_cache_layers({LAYER_NAME: PagedLayerSpec(8, 2, 128, BF16, scale=0.5)})
    runner.initialize_kv_cache(num_blocks=6, block_size=256)
    assert type(runner.block_tables) is AscendBlockTablesAdapter
    ((_, kwargs),) = [e for e in vendor.log if e[0] == "AscendBlockTables"]
    assert (kwargs["block_sizes"], kwargs["kernel_block_sizes"]) == ([256], [128])
    (backend,) = runner.backends
    assert type(backend) is VllmAscendBackend and backend.reorder_batch_threshold == 1
    cache = runner.kv_caches[LAYER_NAME]
    assert isinstance(cache, tuple) and [tuple(t.shape) for t in cache] == [(12, 128, 2, 128)] * 2
    (impl,) = vendor.impls
    assert impl.config_at_init == "VLLM-CONFIG"


# --- worker start and the version gate -------------------------------------------------------------


@without_torch_npu
def test_an_unsupported_installed_set_is_refused(vendor: Vendor) -> None:
    with pytest.raises(UnsupportedStackError) as info:  # this machine: no CANN, no torch_npu
        AscendBlockTablesAdapter(
            block_sizes=[128],
            max_num_reqs=1,
            max_num_batched_tokens=8,
            max_num_blocks_per_group=[1],
            device="cpu",
        )
    assert f"torch {torch.__version__} (expected 2.10.0)" in str(info.value)
    assert "DIFFUSION_KV_BACKEND=npu:direct" in str(info.value)
    with pytest.raises(UnsupportedStackError):
        make_backend()
    with pytest.raises(UnsupportedStackError):
        VllmAscendBackend.prepare_worker(HOST)
    assert vendor.log == [] and vendor.impls == []


def test_worker_init_checks_versions_first(vendor: Vendor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        vllm_ascend_backend, "installed_stack", lambda *_: AscendStack(None, None, None, None, None)
    )
    with pytest.raises(UnsupportedStackError, match="CANN missing \\(expected 9.1.0\\)"):
        VllmAscendBackend.prepare_worker(HOST)
    assert vendor.log == []
    monkeypatch.setattr(vllm_ascend_backend, "installed_stack", lambda *_: SUPPORTED_VLLM_ASCEND_STACKS[0])
    VllmAscendBackend.prepare_worker(HOST)
    assert vendor.log == ["adapt_patch", ("init_ascend_config", "VLLM-CONFIG")]


def test_worker_init_without_a_host_explains_what_is_needed(vendor: Vendor, supported_stack: None) -> None:
    with pytest.raises(StateError, match="PagedWorker\\(..., host=HostRuntime\\(...\\)\\)"):
        VllmAscendBackend.prepare_worker(None)
    assert vendor.log == []


@without_torch_npu
def test_platform_worker_init_runs_the_selected_backends_init(
    vendor: Vendor, supported_stack: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stands in for a machine with an NPU: the platform's own detector is not under test here
    monkeypatch.setattr(
        NpuPlatform, "is_available", classmethod(lambda cls: Availability(True, "1 NPU device(s)"))
    )
    platform = NpuPlatform()
    with pytest.raises(UnsupportedRequirementsError, match="needs the embedding vLLM host's runtime"):
        platform.init_worker()  # neither backend can run: nothing is initialised
    assert vendor.log == []
    platform.init_worker(HOST)
    assert vendor.log == ["adapt_patch", ("init_ascend_config", "VLLM-CONFIG")]


# --- BlockTables ------------------------------------------------------------------------------------


def test_block_tables_adapter(vendor: Vendor, supported_stack: None) -> None:
    assert VllmAscendBackend.block_tables_cls() is AscendBlockTablesAdapter
    assert vendor.log == []  # naming the class checks and imports nothing (selection calls it)
    bt = AscendBlockTablesAdapter(
        block_sizes=[256],
        max_num_reqs=3,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[4],
        device="cpu",
        kernel_block_sizes=[128],
        slot_mapping_dtype=torch.int32,
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
    slots = bt.compute_slot_mappings(torch.tensor([0]), torch.tensor([0, 3]), torch.arange(3), 4)
    assert slots.dtype == torch.int32 and slots.tolist() == [[0, 1, 2, 3]]


def test_block_tables_adapter_takes_int32_slots_only(vendor: Vendor, supported_stack: None) -> None:
    with pytest.raises(
        ValidationError,
        match="AscendBlockTables produce int32 slot mappings only; got slot_mapping_dtype=torch.int64",
    ):
        AscendBlockTablesAdapter(
            block_sizes=[128],
            max_num_reqs=1,
            max_num_batched_tokens=8,
            max_num_blocks_per_group=[1],
            device="cpu",
            slot_mapping_dtype=torch.int64,
        )
    assert vendor.log == []


# --- metadata ---------------------------------------------------------------------------------------


def test_build_forces_chunked_prefill_and_filters_keywords(vendor: Vendor, supported_stack: None) -> None:
    vendor.return_metadata = {
        LAYER_NAME: types.SimpleNamespace(actual_seq_lengths_q=[1], seq_lens_list=[1], block_tables=None)
    }
    backend = make_backend()
    batch = common_batch(3)
    out = backend.build(batch)
    assert set(out) == {LAYER_NAME}
    (kwargs,) = vendor.build_kwargs
    state = vendor.modules["vllm_ascend.attention.attention_v1"].AscendAttentionState
    assert kwargs["attn_state"] is state.ChunkedPrefill
    assert isinstance(kwargs["seq_lens_np"], np.ndarray) and kwargs["seq_lens_np"].tolist() == [1, 1, 1]
    assert kwargs["attn_groups"] == [["ATTN-GROUP-0"]]
    assert kwargs["kv_cache_config"] is KV_CONFIG  # one group: the host's own config
    assert kwargs["num_reqs"] == 3 and kwargs["causal"] is True
    assert kwargs["query_start_loc_cpu"] is batch.query_start_loc_cpu
    (table,) = kwargs["block_tables"]
    assert table is batch.block_table
    assert kwargs["slot_mappings"].shape == (1, 3) and kwargs["slot_mappings"].dtype == torch.int32
    assert kwargs["current_config"] == "VLLM-CONFIG"
    # keywords this (stand-in) version does not take were dropped, not passed
    assert "seq_lens_cpu_upper_bound" not in kwargs and "dcp_local_seq_lens" not in kwargs


def test_each_group_builds_with_its_share_of_the_host_runtime(vendor: Vendor, supported_stack: None) -> None:
    two = types.SimpleNamespace(num_blocks=4, kv_cache_groups=["GROUP-0", "GROUP-1"])
    host = HostRuntime("VLLM-CONFIG", [["ATTN-GROUP-0"], ["ATTN-GROUP-1"]], two)
    vendor.return_metadata = {
        LAYER_NAME: types.SimpleNamespace(actual_seq_lengths_q=[1], seq_lens_list=[1], block_tables=None)
    }
    make_backend(index=1, host=host).build(common_batch(1))
    (kwargs,) = vendor.build_kwargs
    assert kwargs["attn_groups"] == [["ATTN-GROUP-1"]]
    assert kwargs["kv_cache_config"].kv_cache_groups == ["GROUP-1"]
    assert kwargs["kv_cache_config"].num_blocks == 4
    assert two.kv_cache_groups == ["GROUP-0", "GROUP-1"]  # the host's config is untouched
    with pytest.raises(StateError, match="attention groups for 2 KV-cache group\\(s\\); .* group 2 has none"):
        make_backend(index=2, host=host)


def test_build_checks_what_came_back(vendor: Vendor, supported_stack: None) -> None:
    backend = make_backend()
    vendor.return_metadata = {LAYER_NAME: types.SimpleNamespace(seq_lens_list=[1])}
    with pytest.raises(
        StateError,
        match=r"layer 'transformer.blocks.3.attn' without \['actual_seq_lengths_q', 'block_tables'\]",
    ):
        backend.build(common_batch(1))
    vendor.return_metadata = {}
    with pytest.raises(
        StateError, match=r"no metadata for layer\(s\) \['transformer.blocks.3.attn'\] of KV-cache group 0"
    ):
        backend.build(common_batch(1))


# --- the impl -------------------------------------------------------------------------------------


def test_backend_writes_once_then_reads_without_kv(vendor: Vendor, supported_stack: None) -> None:
    other = LayerGeometry("transformer.blocks.4.attn", 8, 2, 128, 0.5, BF16)
    backend = make_backend(LAYER, other)
    assert backend.page_layout is KVPageLayout.SEPARATE
    first, second = vendor.impls
    assert first.kwargs == dict(
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
    assert first.config_at_init == second.config_at_init == "VLLM-CONFIG"
    adapter = backend.adapters[LAYER_NAME]
    assert (adapter.layer_name, adapter._k_scale_float, adapter._v_scale_float) == (LAYER_NAME, 1.0, 1.0)
    packed = torch.zeros(5, 3, 128, dtype=BF16)
    cache = (torch.zeros(1), torch.zeros(1))
    backend.write_kv(LAYER, packed[:, :2], packed[:, :2], cache, torch.arange(6, dtype=torch.int32))
    metadata = {LAYER_NAME: "MD-3", "transformer.blocks.4.attn": "MD-4"}
    out = backend.forward(LAYER, torch.zeros(5, 8, 128, dtype=BF16), cache, metadata)
    given = torch.zeros(5, 8, 128, dtype=BF16)
    assert backend.forward(other, torch.zeros(5, 8, 128, dtype=BF16), cache, metadata, given) is given
    assert vendor.log == [
        ("do_kv_cache_update", LAYER_NAME, (5, 2, 128), True, torch.int32),
        ("forward", LAYER_NAME, (5, 8, 128), True, True, "MD-3"),
        ("forward", "transformer.blocks.4.attn", (5, 8, 128), True, True, "MD-4"),
    ]
    assert out.shape == (5, 8, 128) and bool((out == 1).all()) and bool((given == 1).all())
    with pytest.raises(ValidationError, match="npu: slot mappings must be int32; got torch.int64"):
        backend.write_kv(LAYER, packed[:, :2], packed[:, :2], cache, torch.arange(5))
    assert len(vendor.log) == 3


@pytest.mark.parametrize("name", ["attn", "blocks.1.attn.2"])
def test_layer_names_need_one_integer_component(vendor: Vendor, supported_stack: None, name: str) -> None:
    with pytest.raises(ValidationError, match="must contain exactly one integer component"):
        make_backend(LayerGeometry(name, num_heads=8, num_kv_heads=2, head_size=128, scale=0.5, dtype=BF16))
    assert vendor.impls == []
    assert layer_index_problem(LAYER_NAME) is None


def test_unsupported_layers_are_refused_before_any_impl(vendor: Vendor, supported_stack: None) -> None:
    bad = LayerGeometry(LAYER_NAME, num_heads=8, num_kv_heads=2, head_size=80, scale=0.5, dtype=torch.float32)
    with pytest.raises(
        UnsupportedRequirementsError, match="npu cannot serve layer 'transformer.blocks.3.attn'"
    ):
        make_backend(bad)
    assert vendor.impls == []


def test_backend_without_a_host_explains_what_is_needed(vendor: Vendor, supported_stack: None) -> None:
    with pytest.raises(StateError, match="Standalone use sets DIFFUSION_KV_BACKEND=npu:direct"):
        make_backend(host=None)
    assert vendor.impls == []


# --- padding, pooling hosts, and the vendor checklist ------------------------------------------------


def test_padding_slots_never_reach_do_kv_cache_update(vendor: Vendor, supported_stack: None) -> None:
    """vllm-ascend 0.26.0rc1 writes with npu_scatter_pa_kv_cache, documented for slots >= 0 only."""
    backend = make_backend()
    packed = torch.zeros(4, 2, 128, dtype=BF16)
    cache = (torch.zeros(1), torch.zeros(1))
    backend.write_kv(LAYER, packed, packed, cache, torch.tensor([5, -1, 9, -1], dtype=torch.int32))
    backend.write_kv(LAYER, packed, packed, cache, torch.full((4,), -1, dtype=torch.int32))
    assert vendor.log == [("do_kv_cache_update", LAYER_NAME, (2, 2, 128), True, torch.int32)]


def test_a_pooling_host_is_refused(vendor: Vendor, supported_stack: None) -> None:
    """Pooling runners send non-causal attention to _forward_encoder_attention, which needs K/V
    tensors; this backend passes none."""
    platform = NpuPlatform()
    pooling = HostRuntime(POOLING_HOST, [["ATTN-GROUP-0"]], KV_CONFIG)
    assert POOLING_REASON == (
        "the vLLM host runs a pooling model (model_config.runner_type == 'pooling'): vllm-ascend sends "
        "non-causal attention of pooling runners to _forward_encoder_attention, which needs the call's K/V "
        "tensors, and this backend reads K/V from the pages (it passes none)"
    )
    reasons = platform.host_reasons(VllmAscendBackend, pooling)
    assert reasons[-1] == POOLING_REASON
    with pytest.raises(UnsupportedFeatureError, match="runs a pooling model"):
        make_backend(host=pooling)
    with pytest.raises(UnsupportedFeatureError, match="runs a pooling model"):
        VllmAscendBackend.prepare_worker(pooling)
    assert vendor.impls == [] and vendor.log == []
    generate = types.SimpleNamespace(model_config=types.SimpleNamespace(runner_type="generate"))
    assert VllmAscendBackend.host_reasons(HostRuntime(generate, [], KV_CONFIG)) == []


def test_a_missing_do_kv_cache_update_names_the_versions_that_have_it(
    vendor: Vendor, supported_stack: None
) -> None:
    attention = vendor.modules["vllm_ascend.attention.attention_v1"]

    class OldImpl:
        def __init__(self, **kwargs: Any) -> None:
            pass

    setattr(attention, "AscendAttentionBackendImpl", OldImpl)  # noqa: B010 - a module attribute
    with pytest.raises(StateError) as info:
        make_backend()
    assert str(info.value) == (
        "vllm-ascend's AscendAttentionBackendImpl has no do_kv_cache_update; the npu plugin's write-once "
        "contract needs it (vllm-ascend 0.23.0.post1, 0.25.1rc1, 0.26.0rc1 and 0.30.0rc2 all have it; this "
        "backend targets 0.26.0rc1)"
    )


def test_the_vendor_checklist_names_what_the_stand_ins_offer(vendor: Vendor) -> None:
    """VENDOR_USES is what ci/npu_contract_lane.sh checks against the vllm-ascend wheel; the
    stand-ins here must offer the same names (so the glue tests and the wheel check agree)."""
    for use in VENDOR_USES:
        owner_name, _, member = use.name.partition(".")
        owner = getattr(vendor.modules[use.module], owner_name, None)
        if owner is None:
            owner = sys.modules[use.module].__dict__.get(owner_name)
        assert owner is not None, f"{use.module}:{owner_name} is missing from the stand-ins"
        if member and use.kind in ("method", "staticmethod", "enum_member"):
            assert hasattr(owner, member), f"{use.module}:{use.name} is missing from the stand-ins"
        if member and use.kind == "field":
            assert member in {f.name for f in dataclasses.fields(owner)}, (
                f"{use.name} is not a stand-in field"
            )
    assert [u.name for u in VENDOR_USES if u.optional_keywords] == ["build_attn_metadata"]
    adapter = AscendLayerAdapter(LAYER_NAME, torch.device("cpu"))
    assert all(hasattr(adapter, name) for name in LAYER_ATTRIBUTES)


def test_build_passes_exactly_the_checklisted_keywords(vendor: Vendor, supported_stack: None) -> None:
    seen: list[set[str]] = []

    def build_attn_metadata(**kwargs: Any) -> dict[str, Any]:
        seen.append(set(kwargs))
        return {
            LAYER_NAME: types.SimpleNamespace(actual_seq_lengths_q=[1], seq_lens_list=[1], block_tables=None)
        }

    setattr(vendor.modules["vllm_ascend.worker.v2.attn_utils"], "build_attn_metadata", build_attn_metadata)  # noqa: B010
    make_backend().build(common_batch(1))
    assert seen == [set(BUILD_KEYWORDS)]

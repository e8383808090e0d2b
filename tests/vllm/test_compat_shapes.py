"""The version-compat seam, per supported vLLM API shape, against recorded signatures."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diffusion_kv.core.batch import PagedBatch
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.integrations.vllm.compat import VllmCompat, adapt_native_metadata
from diffusion_kv.integrations.vllm.versions import (
    SHAPES,
    SUPPORTED_RANGE,
    InitKVCacheForm,
    UnsupportedVllmVersionError,
    parse_version,
    shape_for_version,
)
from tests.vllm.recorded import EXTRA_BLOCK_TABLE_SIGNATURES, Recorder

VERSIONS = {
    "0.26": "0.26.0",
    "0.27-0.28": "0.28.0",
    "0.29": "0.29.0",
    "0.30-0.31": "0.31.0",
    "0.32-0.33": "0.32.0+cpu",
}
SHAPE_NAMES = [s.name for s in SHAPES]


def compat_for(shape_name: str, **kw: Any) -> tuple[VllmCompat, Recorder]:
    recorder = Recorder(shape_name, **kw)
    return VllmCompat.for_version(VERSIONS[shape_name], recorder), recorder


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
    ],
)
def test_version_to_shape(version: str, shape: str) -> None:
    assert shape_for_version(version).name == shape


@pytest.mark.parametrize("version", ["0.25.1", "0.20.0", "0.34.0", "1.0.0", "not-a-version"])
def test_unsupported_versions_name_the_range(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersionError) as info:
        shape_for_version(version)
    assert SUPPORTED_RANGE in str(info.value)
    assert SUPPORTED_RANGE == ">=0.26,<0.34"


def test_shapes_cover_every_supported_minor_once() -> None:
    covered = [m for s in SHAPES for m in range(s.first_minor, s.last_minor + 1)]
    assert covered == list(range(26, 34))
    assert parse_version("0.32.0+cpu") == (0, 32, 0)


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


@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
def test_block_tables_constructor_per_shape(shape_name: str) -> None:
    compat, recorder = compat_for(shape_name)
    cls = compat.block_tables_cls()
    tables = cls(**PROTOCOL_KWARGS)
    ((name, bound),) = recorder.calls
    assert name == "BlockTables"
    assert bound["block_sizes"] == [32]
    assert bound["max_num_blocks_per_group"] == [8]
    assert bound["device"] == torch.device("cpu")
    assert tables.slot_mapping_dtype == torch.int64
    if shape_name == "0.32-0.33":
        assert "kernel_block_sizes" not in bound
        assert tables.kernel_block_sizes == [32]
        assert tables.blocks_per_kv_block == [1]
    else:
        assert bound["kernel_block_sizes"] == [16]
        assert tables.blocks_per_kv_block == [2]
    assert cls is compat.block_tables_cls()


@pytest.mark.parametrize(("variant", "shape_name"), [("0.30", "0.30-0.31"), ("0.32", "0.32-0.33")])
def test_block_tables_constructor_variants_inside_a_shape(variant: str, shape_name: str) -> None:
    compat, recorder = compat_for(shape_name, block_tables_init=EXTRA_BLOCK_TABLE_SIGNATURES[variant])
    compat.block_tables_cls()(**PROTOCOL_KWARGS)
    assert recorder.calls[0][1]["cp_interleave"] == 1


@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
def test_block_tables_take_the_core_slot_dtype_keyword(shape_name: str) -> None:
    """The runner passes ``slot_mapping_dtype``; vLLM's tables produce int64 slots only, and the
    keyword never reaches vLLM's constructor."""
    compat, recorder = compat_for(shape_name)
    cls = compat.block_tables_cls()
    cls(**PROTOCOL_KWARGS, slot_mapping_dtype=torch.int64)
    assert "slot_mapping_dtype" not in recorder.calls[0][1]
    with pytest.raises(ValueError, match=r"vLLM's BlockTables produces int64 slots; got torch.int32"):
        cls(**PROTOCOL_KWARGS, slot_mapping_dtype=torch.int32)
    assert len(recorder.calls) == 1  # refused before vLLM's constructor ran


def test_kernel_block_sizes_must_divide() -> None:
    compat, _ = compat_for("0.26")
    with pytest.raises(
        ValueError, match=r"kernel_block_sizes \[24\] must give one divisor of each block size \[32\]"
    ):
        compat.block_tables_kwargs(**{**PROTOCOL_KWARGS, "kernel_block_sizes": [24]})
    assert compat.block_tables_kwargs(**{**PROTOCOL_KWARGS, "kernel_block_sizes": None})[
        "kernel_block_sizes"
    ] == [32]


@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
@pytest.mark.parametrize(
    ("blocks", "block_size", "width"), [(100, 16, 104), (3, 128, 3), (5, 32, 8), (1, 256, 1)]
)
def test_block_table_width_per_shape(shape_name: str, blocks: int, block_size: int, width: int) -> None:
    compat, recorder = compat_for(shape_name)
    assert compat.block_table_width(blocks, block_size) == width
    if shape_name == "0.26":
        assert "get_block_table_width" not in recorder.resolved  # absent in 0.26: shimmed
    else:
        assert recorder.calls == [
            ("get_block_table_width", {"max_num_blocks": blocks, "block_size": block_size})
        ]


# -- initialisation --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
def test_init_kv_cache_per_shape(shape_name: str) -> None:
    compat, recorder = compat_for(shape_name)
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
    elif form is InitKVCacheForm.FORWARD_CONTEXT:
        assert bound["block_tables"] == "tables"
        assert "attn_groups" not in bound
    else:
        assert bound["attn_groups"] == ["g0", "g1a", "g1b"]  # flattened
        assert bound["block_tables"] == "tables"


def test_init_kv_cache_reports_unbound_layers() -> None:
    compat, recorder = compat_for("0.32-0.33")
    recorder.make_init_kv_cache = lambda: lambda *a, **k: {}  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"vLLM 0.32.0\+cpu init_kv_cache bound no KV cache to layer 'a'"):
        compat.init_kv_cache(
            forward_context={"a": SimpleNamespace()},
            kv_cache_config=kv_cache_config(["a"]),
            attn_groups=[[]],
            device=torch.device("cpu"),
            kernel_block_sizes=[16],
            vllm_config=None,
        )


@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
def test_init_attn_backend_per_shape(shape_name: str) -> None:
    compat, recorder = compat_for(shape_name)
    groups, kernel = compat.init_attn_backend("kvcfg", "vcfg", torch.device("cpu"))
    assert (groups, kernel) == ([["group"]], [16])
    assert recorder.calls == [
        (
            "init_attn_backend",
            {"kv_cache_config": "kvcfg", "vllm_config": "vcfg", "device": torch.device("cpu")},
        )
    ]
    recorder.make_init_attn_backend = lambda: lambda *a: ([], [16])  # type: ignore[method-assign]
    fresh = VllmCompat.for_version(VERSIONS[shape_name], recorder)
    with pytest.raises(TypeError, match="init_attn_backend returned tuple; expected"):
        fresh.init_attn_backend("kvcfg", "vcfg", torch.device("cpu"))


def batch(mode: AttentionMode = AttentionMode.CAUSAL) -> PagedBatch:
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    seq = torch.tensor([7, 2], dtype=torch.int32)
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
    )


@pytest.mark.parametrize("shape_name", SHAPE_NAMES)
@pytest.mark.parametrize(("mode", "causal"), [(AttentionMode.CAUSAL, True), (AttentionMode.FULL, False)])
def test_build_attn_metadata_per_shape(shape_name: str, mode: AttentionMode, causal: bool) -> None:
    """One KV-cache group's batch becomes vLLM's one-group call: its table in a list, its slots
    as a ``[1, T]`` row, its mode as ``causal``."""
    compat, recorder = compat_for(shape_name)
    b = batch(mode)
    out = compat.build_attn_metadata(
        attn_groups=[["g"]], batch=b, kv_cache_config=kv_cache_config(["x", "y"])
    )
    assert out == {"x": ("md", causal), "y": ("md", causal)}
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
    assert bound["dcp_local_seq_lens"] is None
    assert bound["causal"] is causal


def test_build_attn_metadata_drops_seq_lens_cpu_and_rejects_unknown_keywords() -> None:
    compat, recorder = compat_for("0.26")
    common = dict(
        attn_groups=[],
        num_reqs=1,
        num_tokens=1,
        query_start_loc_gpu=None,
        query_start_loc_cpu=None,
        max_query_len=1,
        seq_lens=None,
        max_seq_len=1,
        block_tables=[],
        slot_mappings=None,
        kv_cache_config=kv_cache_config(["x"]),
    )
    assert compat.call_build_attn_metadata(**common, seq_lens_cpu="host") == {"x": ("md", True)}
    assert "seq_lens_cpu" not in recorder.calls[0][1]
    with pytest.raises(TypeError, match=r"vLLM 0.26.0 build_attn_metadata does not accept \['ubatch_idx'\]"):
        compat.call_build_attn_metadata(**common, ubatch_idx=0)


# -- backend selection and cache tensors -----------------------------------------------------------


@dataclass
class AttentionConfig:
    backend: Any = None
    backend_per_kind: dict[str, Any] = field(default_factory=lambda: {"decoder": "X"})
    use_non_causal: bool = False


def test_get_attn_backend_requests_portable_backend_and_restores_config() -> None:
    seen: dict[str, Any] = {}
    config = SimpleNamespace(
        attention_config=AttentionConfig(), cache_config=SimpleNamespace(cache_dtype="auto")
    )

    class Enum:
        FLASH_ATTN = "FLASH_ATTN-enum"

    def get_attn_backend(
        head_size: int, dtype: torch.dtype, kv_cache_dtype: str, attn_type: Any = None, num_heads: Any = None
    ) -> str:
        a = config.attention_config
        seen.update(
            backend=a.backend,
            per_kind=a.backend_per_kind,
            non_causal=a.use_non_causal,
            entered=list(entered),
            args=(head_size, dtype, kv_cache_dtype, attn_type, num_heads),
        )
        return "Backend"

    entered: list[Any] = []

    class SetConfig:
        def __init__(self, cfg: Any) -> None:
            entered.append(cfg)

        def __enter__(self) -> None: ...

        def __exit__(self, *exc: Any) -> None:
            entered.append("exit")

    table = {
        "AttentionBackendEnum": Enum,
        "get_attn_backend": get_attn_backend,
        "AttentionType": SimpleNamespace(DECODER="decoder"),
        "set_current_vllm_config": SetConfig,
    }
    compat = VllmCompat.for_version("0.26.0", table.__getitem__)
    backend = compat.get_attn_backend(
        vllm_config=config, head_size=64, dtype=torch.float16, num_heads=4, use_non_causal=True
    )
    assert backend == "Backend"
    assert seen["backend"] == "FLASH_ATTN-enum" and seen["per_kind"] == {} and seen["non_causal"] is True
    assert seen["args"] == (64, torch.float16, "auto", "decoder", 4)
    assert seen["entered"] == [config]
    assert config.attention_config == AttentionConfig()  # restored
    assert entered == [config, "exit"]


@pytest.mark.parametrize("shape_name", ["0.26", "0.27-0.28"])
def test_allocate_kv_cache_uses_backend_shape_and_stride_order_up_to_028(shape_name: str) -> None:
    compat, _ = compat_for(shape_name)

    class FA:
        @staticmethod
        def get_kv_cache_shape(
            nb: int, bs: int, h: int, d: int, cache_dtype: str = "auto"
        ) -> tuple[int, ...]:
            return (nb, h, bs, 2 * d)

        @staticmethod
        def get_kv_cache_stride_order() -> tuple[int, ...]:
            return (0, 2, 1, 3)

    cache = compat.allocate_kv_cache(
        FA,
        num_blocks=3,
        block_size=16,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    assert cache.shape == (3, 2, 16, 16)
    assert cache.stride() == (512, 16, 32, 1)  # physical [blocks, block_size, heads, 2*head]


@pytest.mark.parametrize(
    ("layouts", "stride"),
    [(("LBHNC",), (512, 256, 16, 1)), ((), (512, 16, 32, 1)), (("LHBNC", "LBNHC"), (512, 16, 32, 1))],
)
def test_allocate_kv_cache_follows_layout_from_029(layouts: tuple[str, ...], stride: tuple[int, ...]) -> None:
    compat, _ = compat_for("0.32-0.33")

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
    compat, _ = compat_for("0.29")

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


@pytest.mark.parametrize(
    ("form", "expected"),
    [
        ("shared_by", [{"size": 640, "shared_by": ["a"]}, {"size": 640, "shared_by": ["b"]}]),
        ("layers", [{"size": 1280, "layers": ["a", "b"], "layer_stride": 640, "block_stride": 64}]),
    ],
)
def test_kv_cache_tensor_form_is_picked_by_fields(form: str, expected: list[dict[str, Any]]) -> None:
    if form == "shared_by":

        @dataclass
        class KVCacheTensor:
            size: int
            shared_by: list[str]
            offset: int = 0

    else:

        @dataclass
        class KVCacheTensor:  # type: ignore[no-redef]
            size: int
            layers: list[str]
            layer_stride: int
            block_stride: int
            offset: int = 0

    compat = VllmCompat.for_version("0.30.0", {"KVCacheTensor": KVCacheTensor}.__getitem__)
    records = compat.kv_cache_tensors(layer_names=["a", "b"], num_blocks=10, page_bytes=64)
    assert [{k: v for k, v in r.__dict__.items() if k != "offset"} for r in records] == expected


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

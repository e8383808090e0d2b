"""Capability data, requirement reasons, backend selection by priority and plugin validation."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, ClassVar

import pytest
import torch

from diffusion_kv import ConfigurationError, UnsupportedRequirementsError
from diffusion_kv.core.backend import KVPageLayout, allocate_pages
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.interface import (
    ENV_BACKEND,
    AttentionMode,
    Availability,
    Capabilities,
    MultipleOf,
    PagedBackend,
    Platform,
    Requirements,
    capability_reasons,
)
from diffusion_kv.platforms.isolation import BackendCallError
from diffusion_kv.platforms.selection import (
    discover,
    get_platform,
    validate_backend_class,
    validate_platform_class,
)


def _caps(**overrides: object) -> Capabilities:
    base: dict[str, object] = dict(
        dtypes=frozenset({torch.float16}),
        head_sizes=frozenset({64, 128}),
        kernel_block_sizes=(128, MultipleOf(16)),
        slot_mapping_dtypes=frozenset({torch.int32}),
        attention_modes=frozenset({AttentionMode.CAUSAL, AttentionMode.FULL}),
        supports_gqa=True,
        supports_ulysses=False,
        max_rows_per_call=4,
        max_kv_heads_x_head_size=512,
        max_gqa_ratio=4,
    )
    base.update(overrides)
    return Capabilities(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "path",
    [
        "diffusion_kv.platforms.cpu:CpuPlatform",
        "diffusion_kv.platforms.cuda:CudaPlatform",
        "diffusion_kv.platforms.npu:NpuPlatform",
    ],
)
def test_builtin_plugins_validate(path: str) -> None:
    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert validate_platform_class(cls, cls.name) == []


def test_validation_checks_the_entry_point_name() -> None:
    assert validate_platform_class(CpuPlatform, "other") == [
        "class attribute name='cpu' differs from the entry-point name 'other'"
    ]


def test_block_size_rules_and_the_kernel_split() -> None:
    caps = _caps()
    assert caps.kernel_block_size_for(128) == 128 and caps.kernel_block_size_for(32) == 32
    assert caps.kernel_block_size_for(24) is None and caps.kernel_block_size_for(8) is None
    fixed = _caps(kernel_block_sizes=(64, 32))
    assert fixed.kernel_block_size_for(64) == 64
    assert fixed.kernel_block_size_for(128) == 64  # split: two kernel blocks per scheduler block
    assert fixed.kernel_block_size_for(96) == 32
    assert fixed.kernel_block_size_for(48) is None and not fixed.supports_block_size(48)
    assert fixed.kernel_block_size_for(0) is None and fixed.kernel_block_size_for(True) is None


def test_every_reason_is_returned() -> None:
    req = Requirements(
        dtype=torch.bfloat16,
        head_size=96,
        num_heads=32,
        num_kv_heads=4,
        block_size=24,
        attention_modes=frozenset({AttentionMode.PIECEWISE}),
        ulysses_degree=2,
        dcp_size=2,
        num_rows=5,
        graph_capture=True,
    )
    assert capability_reasons(_caps(), req) == [
        "dtype=bfloat16 (supported: ['float16'])",
        "head_size=96 (supported: [64, 128])",
        "block_size=24 (kernel blocks: 128, multiple of 16; none equals or divides it)",
        "attention mode(s) ['piecewise'] (supported: ['causal', 'full'])",
        "GQA ratio 8 exceeds 4",
        "Ulysses sequence parallelism (degree 2)",
        "decode context parallelism (cp_size 2)",
        "num_rows=5 exceeds 4 rows per call",
        "graph capture",
    ]


def test_kv_width_and_gqa_reasons() -> None:
    req = Requirements(head_size=128, num_heads=8, num_kv_heads=8)
    assert capability_reasons(_caps(), req) == ["num_kv_heads*head_size=1024 exceeds 512"]
    assert capability_reasons(_caps(supports_gqa=False), Requirements(num_heads=4, num_kv_heads=2)) == [
        "grouped-query attention (num_heads=4, num_kv_heads=2)"
    ]
    assert capability_reasons(_caps(), Requirements(num_heads=6, num_kv_heads=4)) == [
        "num_heads=6 is not a multiple of num_kv_heads=4"
    ]


def test_supported_requirements_give_no_reason() -> None:
    req = Requirements(dtype=torch.float16, head_size=64, block_size=128, num_heads=8, num_kv_heads=2)
    assert capability_reasons(_caps(), req) == []
    assert Requirements().describe() == "(none)"


def test_malformed_capabilities_are_listed() -> None:
    caps = _caps(
        supports_gqa="yes",
        max_rows_per_call=0,
        attention_modes=frozenset({AttentionMode.PIECEWISE, AttentionMode.CAUSAL}),
        slot_mapping_dtypes=frozenset({torch.float32}),
    )
    assert caps.problems() == [
        "slot_mapping_dtypes must be a non-empty frozenset of torch.int32/torch.int64; got "
        "frozenset({torch.float32})",
        "attention_modes: piecewise runs as causal and full calls; declare both",
        "supports_gqa must be a bool; got 'yes'",
        "max_rows_per_call must be None or a positive int; got 0",
    ]


def test_ulysses_and_dcp_are_off_unless_declared() -> None:
    caps = Capabilities(dtypes=frozenset({torch.float16}), head_sizes=None, kernel_block_sizes=(16,))
    assert not caps.supports_ulysses and not caps.supports_dcp
    assert caps.slot_mapping_dtypes == frozenset({torch.int64})


def test_multiple_of_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="positive integer"):
        MultipleOf(0)


def test_availability_is_truthy_by_flag() -> None:
    assert Availability(True, "ok") and not Availability(False, "no")


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (KVPageLayout.COMBINED, (2, 6, 16, 2, 8)),
        (KVPageLayout.HEAD_FIRST, (2, 6, 2, 16, 8)),
    ],
)
def test_default_page_layouts(layout: KVPageLayout, shape: tuple[int, ...]) -> None:
    cache = allocate_pages(layout, 6, 16, 2, 8, torch.float16, torch.device("cpu"))
    assert isinstance(cache, torch.Tensor) and cache.shape == shape and cache.dtype == torch.float16
    assert int(cache.count_nonzero()) == 0
    k, v = allocate_pages(KVPageLayout.SEPARATE, 6, 16, 2, 8, torch.float32, torch.device("cpu"))
    assert k.shape == v.shape == (6, 16, 2, 8) and k.data_ptr() != v.data_ptr()


# --- selection among a platform's backends ---------------------------------------------------------


def backend(name: str, priority: int, **caps: Any) -> type[PagedBackend]:
    available = caps.pop("available", True)

    class Backend(CpuReferenceBackend):
        capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, **caps)

        @classmethod
        def is_available(cls) -> Availability:
            return Availability(available, "present" if available else "no device")

    Backend.name, Backend.priority = name, priority
    return Backend


class Toy(Platform):
    name: ClassVar[str] = "toy"
    device_type: ClassVar[str] = "cpu"
    default_block_size: ClassVar[int] = 16
    backends = (
        backend("fast", 300, dtypes=frozenset({torch.float16}), head_sizes=frozenset({64})),
        backend("broad", 200, dtypes=frozenset({torch.float16, torch.float32})),
        backend("gone", 400, available=False),
        backend("last", 100),
    )

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, "toy")


def test_the_first_backend_in_priority_order_without_reasons_wins() -> None:
    toy = Toy()
    assert [b.name for b in toy.candidate_backends()] == ["gone", "fast", "broad", "last"]
    assert toy.select_backend(Requirements(dtype=torch.float16, head_size=64)).name == "fast"
    assert toy.select_backend(Requirements(dtype=torch.float16, head_size=128)).name == "broad"
    assert toy.select_backend(Requirements(dtype=torch.float64)).name == "last"
    caps = toy.capabilities  # derived from the backends: they cannot disagree
    assert caps.dtypes == frozenset({torch.float16, torch.float32, torch.float64, torch.bfloat16})
    assert caps.head_sizes is None


def test_no_backend_gives_one_error_with_every_candidate() -> None:
    toy = Toy()
    req = Requirements(dtype=torch.int8, num_heads=4, num_kv_heads=4)
    with pytest.raises(UnsupportedRequirementsError) as info:
        toy.select_backend(req)
    lines = str(info.value).splitlines()
    assert lines[0] == "No paged backend of platform 'toy' supports the requested requirements:"
    assert lines[1] == "  requirements: dtype=int8, num_heads=4, num_kv_heads=4"
    assert lines[2] == "  `toy:gone` (priority 400) is not supported because:"
    assert "      unavailable: no device" in lines
    assert sum(line.strip().startswith("dtype=int8") for line in lines) == 3
    assert toy.not_supported_reasons(req)[0] == "gone: unavailable: no device"
    assert toy.not_supported_reasons(Requirements(dtype=torch.float32)) == []


def test_the_environment_forces_one_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = Toy()
    monkeypatch.setenv(ENV_BACKEND, "toy:last")
    assert toy.select_backend(Requirements(dtype=torch.float16, head_size=64)).name == "last"
    lines = toy.explain()
    assert lines[0].startswith("toy: selects backend 'last'") and lines[1] == f"  {ENV_BACKEND} forces 'last'"
    monkeypatch.setenv(ENV_BACKEND, "toy:fast")
    with pytest.raises(UnsupportedRequirementsError, match="limits the candidates to one"):
        toy.select_backend(Requirements(dtype=torch.float32))  # no silent fallback
    monkeypatch.setenv(ENV_BACKEND, "cuda:triton")  # another installed platform's choice
    assert toy.select_backend(Requirements(dtype=torch.float32)).name == "broad"
    monkeypatch.setenv(ENV_BACKEND, "other:whatever")
    with pytest.raises(
        ConfigurationError,
        match=r"DIFFUSION_KV_BACKEND='other:whatever' names platform 'other', which is not installed in group "
        r"'diffusion_kv.platforms' \(installed: cpu, cuda, npu\)",
    ):
        toy.select_backend(Requirements(dtype=torch.float32))  # never silently ignored
    monkeypatch.setenv(ENV_BACKEND, "toy:nope")
    with pytest.raises(
        ConfigurationError,
        match=r"forces backend 'nope' on platform 'toy', which has \['gone', 'fast', 'broad', 'last'\]",
    ):
        toy.select_backend(Requirements())
    for bad in ("toy", "toy:", ":last"):
        monkeypatch.setenv(ENV_BACKEND, bad)
        with pytest.raises(ConfigurationError, match="expected <platform>:<backend>"):
            toy.select_backend(Requirements())


def test_explain_lists_every_backend_in_priority_order() -> None:
    lines = Toy().explain(Requirements(dtype=torch.float32))
    assert lines[0] == "toy: selects backend 'broad' for dtype=float32"
    assert [line.split("]")[0].strip() for line in lines[1:]] == ["[400", "[300", "[200", "[100"]
    assert lines[1].endswith("unavailable: no device")
    assert "dtype=float32 (supported: ['float16'])" in lines[2]
    assert lines[3].endswith(": selected") and lines[4].endswith(": supported")


def test_groups_must_share_block_tables_and_a_slot_dtype() -> None:
    int32_only = backend("narrow", 500, slot_mapping_dtypes=frozenset({torch.int32}))
    int64_only = backend("wide", 400, slot_mapping_dtypes=frozenset({torch.int64}))

    class OwnTables(TorchBlockTables):
        pass

    own = backend("own", 300)
    own.block_tables_cls = classmethod(lambda cls: OwnTables)  # type: ignore[method-assign,assignment]

    class Mixed(Toy):
        backends = (int32_only, int64_only, own)  # type: ignore[assignment]

    mixed = Mixed()
    assert mixed.select_backend(Requirements()) is int32_only
    assert mixed.select_backend(Requirements(), [int64_only]) is int64_only  # group 0 chose int64 slots
    with pytest.raises(UnsupportedRequirementsError) as info:
        mixed.select_backend(Requirements(), [int32_only, int64_only])
    text = str(info.value)
    assert text.count("no slot-mapping dtype in common with the other KV-cache groups' backends") == 3
    assert "its BlockTables (OwnTables) differs from the one KV-cache group 0's backend 'narrow' uses" in text


def test_backend_validation_names_every_problem() -> None:
    class Bad(CpuReferenceBackend):
        name = "a:b"
        priority = "high"  # type: ignore[assignment]
        capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, supports_dcp=True)
        page_layout = "flat"  # type: ignore[assignment]

        def build(self, batch: Any, extra: Any) -> Any:  # type: ignore[override]
            return None

    problems = validate_backend_class(Bad, "a:b")
    assert "name must be a non-empty string without ':'; got 'a:b'" in problems
    assert "priority must be an int; got 'high'" in problems
    assert "page_layout must be a KVPageLayout; got 'flat'" in problems
    assert any("has extra required parameter 'extra'" in p for p in problems)
    assert validate_backend_class(int) == [
        "<class 'int'> is not a subclass of diffusion_kv.core.backend.PagedBackend"
    ]

    class NoPartial(PagedBackend):
        name = "np"
        capabilities = dataclasses.replace(CpuReferenceBackend.capabilities, supports_dcp=True)

        def build(self, batch: Any) -> Any: ...
        def write_kv(self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None: ...
        def forward(self, layer: Any, query: Any, kv_cache: Any, metadata: Any, out: Any = None) -> Any: ...

    assert validate_backend_class(NoPartial) == [
        "declares supports_dcp but does not implement forward_partial"
    ]


class _HandedPlugins:
    """An InstalledPlugins of our own: two installed platforms, one added backend for ``toy``."""

    namespace = "test.platforms"

    def __init__(self, added: list[type[PagedBackend]]) -> None:
        self.added = added
        self.failures: list[tuple[str, str]] = []
        self.notes: list[str | None] = []

    @property
    def names(self) -> list[str]:
        return ["toy", "other"]

    def backends_for(self, platform: str) -> list[type[PagedBackend]]:
        return list(self.added) if platform == "toy" else []

    def report_failure(self, backend: type[PagedBackend], error: BackendCallError, printed: str) -> None:
        self.failures.append((backend.name, error.what))

    def report_note(self, backend: type[PagedBackend], note: str | None) -> None:
        self.notes.append(note)


def test_a_platform_reads_the_plugins_it_is_handed(monkeypatch: pytest.MonkeyPatch) -> None:
    added = backend("added", 150)
    raising = backend("raising", 250)

    def broken() -> Availability:
        raise RuntimeError("driver gone")

    raising.is_available = staticmethod(broken)  # type: ignore[method-assign]
    handed = _HandedPlugins([added, raising])
    toy = Toy()
    assert [b.name for b in toy.candidate_backends()] == ["gone", "fast", "broad", "last"]  # default set
    toy.use_plugins(handed)
    assert toy.plugins is handed
    assert [b.name for b in toy.candidate_backends()] == ["gone", "fast", "raising", "broad", "added", "last"]
    assert toy.backend_reasons(raising, Requirements()) == [
        "broken: its is_available() raised RuntimeError: driver gone"
    ]
    assert handed.failures == [("raising", "is_available()")]  # recorded where it was handed
    assert Toy().plugins is discover()  # another instance keeps the default set
    monkeypatch.setenv(ENV_BACKEND, "other:x")  # installed in the handed set: another platform's choice
    assert toy.select_backend(Requirements(dtype=torch.float32)).name == "broad"
    monkeypatch.setenv(ENV_BACKEND, "cuda:triton")  # installed for discovery, not in the handed set
    with pytest.raises(
        ConfigurationError,
        match=r"names platform 'cuda', which is not installed in group 'test.platforms' "
        r"\(installed: toy, other\)",
    ):
        toy.select_backend(Requirements(dtype=torch.float32))


def test_discovery_hands_the_platforms_it_constructs_their_plugin_set() -> None:
    plugins = discover()
    platform = plugins.instance("cpu")
    assert platform.plugins is plugins
    assert get_platform("cpu") is platform

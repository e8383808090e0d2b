"""Capability data, requirement reasons and plugin validation."""

from __future__ import annotations

import pytest
import torch

from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cuda import CudaPlatform
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Availability,
    Capabilities,
    MultipleOf,
    Requirements,
    capability_reasons,
)
from diffusion_kv.platforms.npu import NpuPlatform
from diffusion_kv.platforms.selection import validate_platform_class


def _caps(**overrides: object) -> Capabilities:
    base: dict[str, object] = dict(
        device_type="x",
        dtypes=frozenset({torch.float16}),
        head_sizes=frozenset({64, 128}),
        kernel_block_sizes=(128, MultipleOf(16)),
        slot_mapping_dtype=torch.int32,
        attention_modes=frozenset({AttentionMode.CAUSAL, AttentionMode.FULL}),
        supports_gqa=True,
        supports_ulysses=False,
        max_rows_per_call=4,
        max_kv_heads_x_head_size=512,
        max_gqa_ratio=4,
    )
    base.update(overrides)
    return Capabilities(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [CpuPlatform, CudaPlatform, NpuPlatform])
def test_builtin_plugins_validate(cls: type) -> None:
    assert validate_platform_class(cls, cls.name) == []


def test_validation_checks_the_entry_point_name() -> None:
    assert validate_platform_class(CpuPlatform, "other") == [
        "class attribute name='cpu' differs from the entry-point name 'other'"
    ]


def test_block_size_rules() -> None:
    caps = _caps()
    assert caps.supports_block_size(128) and caps.supports_block_size(32)
    assert not caps.supports_block_size(24) and not caps.supports_block_size(8)
    assert NpuPlatform.capabilities.supports_block_size(128)
    assert not NpuPlatform.capabilities.supports_block_size(256)


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
        "block_size=24 (supported: 128, multiple of 16)",
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
    caps = _caps(device_type="", supports_gqa="yes", max_rows_per_call=0, attention_modes=frozenset())
    assert caps.problems() == [
        "device_type must be a non-empty string; got ''",
        "attention_modes must be a non-empty frozenset of AttentionMode",
        "supports_gqa must be a bool; got 'yes'",
        "max_rows_per_call must be None or a positive int; got 0",
    ]


def test_multiple_of_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="positive integer"):
        MultipleOf(0)


def test_availability_is_truthy_by_flag() -> None:
    assert Availability(True, "ok") and not Availability(False, "no")


def test_cpu_allocates_its_declared_shape() -> None:
    cache = CpuPlatform().allocate_kv_cache(3, 16, 2, 8, torch.float16, torch.device("cpu"))
    assert isinstance(cache, torch.Tensor)
    assert cache.shape == (2, 3, 16, 2, 8) and cache.dtype == torch.float16
    assert int(cache.count_nonzero()) == 0

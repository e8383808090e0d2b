"""CPU_ATTN's scheduler-metadata buffer stays the kernel's own after pinning."""

from __future__ import annotations

import pytest
import torch

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

from diffusion_kv.integrations.vllm_omni.cpu_attn_pin import PinnedCPUAttentionMetadata  # noqa: E402
from diffusion_kv.integrations.vllm_omni.platform import pin_scheduler_metadata  # noqa: E402


def test_a_second_assignment_keeps_the_first_buffer() -> None:
    native = object.__new__(cpu_attn.CPUAttentionMetadata)
    first = torch.arange(4)
    object.__setattr__(native, "scheduler_metadata", first)
    pin_scheduler_metadata(native)
    assert type(native) is PinnedCPUAttentionMetadata
    native.scheduler_metadata = first.clone()
    assert native.scheduler_metadata is first
    native.num_actual_tokens = 7  # other fields stay assignable
    assert native.num_actual_tokens == 7
    pin_scheduler_metadata(native)  # idempotent
    assert type(native) is PinnedCPUAttentionMetadata


def test_other_metadata_is_left_alone() -> None:
    class Other:
        scheduler_metadata = torch.zeros(1)

    other = Other()
    pin_scheduler_metadata(other)
    assert type(other) is Other
    empty = object.__new__(cpu_attn.CPUAttentionMetadata)
    object.__setattr__(empty, "scheduler_metadata", None)
    pin_scheduler_metadata(empty)
    assert type(empty) is cpu_attn.CPUAttentionMetadata

"""vLLM CPU_ATTN's metadata with its scheduler-metadata buffer pinned.

Imports vLLM at module import: :func:`~.platform.pin_scheduler_metadata` imports this module
only when it meets CPU_ATTN metadata, so vLLM is already loaded then. The class is defined
once, here, rather than made per call.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

PINNED_FIELDS = frozenset({"scheduler_metadata", "prefix_scheduler_metadata"})
"""The fields whose first buffer stays (the kernel's pointers point into it)."""


class PinnedCPUAttentionMetadata(CPUAttentionMetadata):  # type: ignore[misc]
    """CPU_ATTN metadata whose ``scheduler_metadata`` buffers cannot be replaced once set: a
    second assignment is ignored (see :func:`~.platform.pin_scheduler_metadata`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PINNED_FIELDS and getattr(self, name, None) is not None:
            return  # keep the kernel's own buffer
        object.__setattr__(self, name, value)


__all__ = ["PINNED_FIELDS", "PinnedCPUAttentionMetadata"]

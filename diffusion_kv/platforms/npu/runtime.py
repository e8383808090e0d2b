"""The embedding vLLM host's runtime, as the npu platform's vllm-ascend backend needs it.

vllm-ascend's metadata builder and attention impl need objects only an embedding vLLM host
has: its ``VllmConfig``, its attention groups and its ``KVCacheConfig``. The host hands them
over with :meth:`NpuPlatform.bind_vllm_runtime
<diffusion_kv.platforms.npu.NpuPlatform.bind_vllm_runtime>`; they are kept here, process-wide
(one vLLM host per worker process), because backend selection and the backend classes read
them at class level. The platform only checks *whether* a runtime is bound (a reason the
vllm-ascend backend is not chosen); the backend (``diffusion_kv.integrations.vllm_ascend``)
reads it. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VllmRuntime:
    """What the embedding vLLM host owns and vllm-ascend's parts need."""

    vllm_config: Any
    attn_groups: Any
    """vLLM's attention groups (``init_attn_backend``), one list per KV-cache group."""
    kv_cache_config: Any


_BOUND: list[VllmRuntime] = []


def bind_vllm_runtime(runtime: VllmRuntime) -> None:
    """Make ``runtime`` the process's bound vLLM runtime (replacing any earlier one)."""
    _BOUND[:] = [runtime]


def unbind_vllm_runtime() -> None:
    """Forget the bound runtime (the host shut down; tests)."""
    _BOUND.clear()


def bound_vllm_runtime() -> VllmRuntime | None:
    """The bound runtime, or None when no embedding host has bound one."""
    return _BOUND[0] if _BOUND else None

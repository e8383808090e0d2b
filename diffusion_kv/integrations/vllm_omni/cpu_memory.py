"""The paged KV budget of vLLM-Omni's diffusion worker on a CPU host (no vLLM import).

:class:`~.worker.CpuDiffusionWorker` answers ``determine_available_kv_memory`` with
:func:`cpu_kv_cache_budget`. The rules, in the order they apply, in vLLM's terms:

1. ``VLLM_CPU_KVCACHE_SPACE`` (GiB; vLLM's CPU platform reads it the same way and it wins
   over the configured size), else ``kv_cache_memory_bytes`` (vLLM-Omni's
   ``OmniDiffusionConfig.kv_cache_memory_bytes``, copied onto the cache config): exactly that
   many bytes, refused when more than the host's available memory;
2. else ``gpu_memory_utilization`` set to anything but vLLM-Omni's default (0.9): vLLM's CPU
   rule, that fraction of the host's total memory less what the process already holds (its
   RSS after the profile run);
3. else the default: :data:`DEFAULT_CPU_KV_CACHE_BYTES` (4 GiB), at most
   :data:`DEFAULT_CPU_KV_CACHE_FRACTION` (a quarter) of the host's available memory, never
   vLLM's 0.9 x host memory.

Nothing here imports vLLM or vLLM-Omni (host memory is read with ``psutil``, a vLLM
dependency, on first use).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from diffusion_kv.core.errors import ConfigurationError

logger = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GIB
"""The default CPU KV budget: 4 GiB (``VLLM_CPU_KVCACHE_SPACE=4``)."""
DEFAULT_CPU_KV_CACHE_FRACTION = 0.25
"""The default budget is at most this fraction of the host's available memory."""
OMNI_DEFAULT_UTILIZATION = 0.9
"""``OmniDiffusionConfig.gpu_memory_utilization``'s default: a value that was not set."""
ENV_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """The host's memory, in bytes: total, available (free plus reclaimable), and what this
    process holds (its resident set)."""

    total: int
    available: int
    process: int


def host_memory() -> HostMemory:
    """This host's memory now (``psutil``, which vLLM depends on)."""
    import psutil

    virtual = psutil.virtual_memory()
    return HostMemory(int(virtual.total), int(virtual.available), int(psutil.Process().memory_info().rss))


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """The paged KV budget a CPU worker answers, and the rule that gave it."""

    bytes: int
    source: str
    """``VLLM_CPU_KVCACHE_SPACE``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization`` or
    ``default``."""
    profiles: bool
    """Whether the rule runs the profile requests first (an explicit size skips them, as
    upstream's worker does)."""


def _env_kv_space() -> int | None:
    raw = os.environ.get(ENV_KV_SPACE, "").strip()
    if not raw:
        return None
    try:
        gib = int(raw)
    except ValueError:
        raise ConfigurationError(
            f"{ENV_KV_SPACE}={raw!r} is not a whole number of GiB (vLLM's CPU KV-cache space)"
        ) from None
    if gib <= 0:
        raise ConfigurationError(f"{ENV_KV_SPACE}={gib} GiB: the CPU KV-cache space must be at least 1 GiB")
    return gib * GIB


def budget_rule(cache_config: Any) -> KVBudget:
    """Which rule sizes the budget for ``cache_config`` (vLLM's ``CacheConfig`` as vLLM-Omni
    configured it), with the explicit size where one is given (0 bytes for the measured rules)."""
    env = _env_kv_space()
    if env is not None:
        return KVBudget(env, ENV_KV_SPACE, profiles=False)
    explicit = getattr(cache_config, "kv_cache_memory_bytes", None)
    if explicit:  # upstream's worker treats 0 as unset too
        return KVBudget(int(explicit), "kv_cache_memory_bytes", profiles=False)
    utilization = float(getattr(cache_config, "gpu_memory_utilization", OMNI_DEFAULT_UTILIZATION))
    if not math.isclose(utilization, OMNI_DEFAULT_UTILIZATION):
        return KVBudget(0, "gpu_memory_utilization", profiles=True)
    return KVBudget(0, "default", profiles=True)


def cpu_kv_cache_budget(cache_config: Any, memory: HostMemory) -> KVBudget:
    """The paged KV budget in bytes on a host with ``memory`` (see the module docstring);
    a :class:`ConfigurationError` naming the setting, its value and the limit where it cannot
    be met."""
    rule = budget_rule(cache_config)
    if rule.source in (ENV_KV_SPACE, "kv_cache_memory_bytes"):
        if rule.bytes > memory.available:
            raise ConfigurationError(
                f"{rule.source} asks for {rule.bytes} bytes of CPU KV cache, more than the host's "
                f"{memory.available} available bytes (of {memory.total})"
            )
        return rule
    if rule.source == "gpu_memory_utilization":
        utilization = float(cache_config.gpu_memory_utilization)
        requested = math.ceil(memory.total * utilization)
        kv = requested - memory.process
        if kv <= 0 or kv > memory.available:
            raise ConfigurationError(
                f"gpu_memory_utilization={utilization} reserves {requested} bytes of the host's "
                f"{memory.total}; after this process's {memory.process} bytes that leaves {kv} bytes "
                f"for the KV cache, which must be positive and at most the {memory.available} "
                "available bytes (lower it, or set kv_cache_memory_bytes)"
            )
        return dataclasses.replace(rule, bytes=int(kv))
    default = min(DEFAULT_CPU_KV_CACHE_BYTES, int(memory.available * DEFAULT_CPU_KV_CACHE_FRACTION))
    if default <= 0:
        raise ConfigurationError(
            f"the host has {memory.available} bytes available: no default CPU KV cache fits "
            "(set kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE)"
        )
    return dataclasses.replace(rule, bytes=default)


__all__ = [
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "DEFAULT_CPU_KV_CACHE_FRACTION",
    "ENV_KV_SPACE",
    "HostMemory",
    "KVBudget",
    "budget_rule",
    "cpu_kv_cache_budget",
    "host_memory",
]

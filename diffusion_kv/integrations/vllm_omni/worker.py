"""vLLM-Omni's ``DiffusionWorker`` on a CPU host (:class:`CpuDiffusionWorker`).

vLLM-Omni 0.30.0's worker, in ``paged_scheduler`` mode, measures device memory twice: in
``init_device`` (vLLM's ``MemorySnapshot`` and ``request_memory``, right after the distributed
init) and in ``determine_available_kv_memory`` (vLLM's ``memory_profiling`` around the runner's
``profile_run``). Both read ``torch.accelerator``, which has no CPU device. Where diffusion-kv's
platform answers vLLM-Omni's device questions on the CPU (:class:`~.platform.CpuDeviceMethods`),
its ``get_diffusion_worker_cls()`` names :class:`CpuDiffusionWorker`: upstream's worker with only
these two measurements answered from host memory.

* ``init_device`` is upstream's, run with the two names it looks up for the snapshot
  (``MemorySnapshot`` and ``request_memory`` in ``vllm_omni.diffusion.worker.diffusion_worker``)
  bound to :class:`HostMemorySnapshot` and :func:`host_request_memory` for the duration of the
  call, and restored afterwards (also when it fails). Everything else it does (environment,
  device, vLLM config, platform hooks, distributed init, model-parallel groups) runs unchanged.
* ``determine_available_kv_memory`` runs upstream's ``profile_run`` on the engine's profile
  requests (skipped for an explicit size, as upstream skips it) and answers the budget of
  :func:`~.cpu_memory.cpu_kv_cache_budget` (default 4 GiB, at most a quarter of the host's
  available memory; ``VLLM_CPU_KVCACHE_SPACE``, ``kv_cache_memory_bytes`` and
  ``gpu_memory_utilization`` override it as in vLLM).

This module imports vLLM and vLLM-Omni; the platform names it by path.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.utils.mem_utils import MemorySnapshot
from vllm_omni.diffusion.worker import diffusion_worker as upstream

from diffusion_kv.integrations.vllm_omni.cpu_memory import (
    HostMemory,
    KVBudget,
    budget_rule,
    cpu_kv_cache_budget,
    host_memory,
)

logger = logging.getLogger(__name__)

WORKER_PATH = f"{__name__}.CpuDiffusionWorker"


class HostMemorySnapshot(MemorySnapshot):  # type: ignore[misc]
    """vLLM's ``MemorySnapshot`` of the host: total and free are the host's total and available
    memory, all of the used memory counts as non-torch (the CPU allocator keeps no
    statistics), torch peak and allocation are 0."""

    def measure(self) -> None:
        memory = host_memory()
        self.torch_peak = 0
        self.torch_allocated = 0
        self.free_memory = memory.available
        self.total_memory = memory.total
        self.cuda_memory = memory.total - memory.available
        self.torch_memory = 0
        self.non_torch_memory = self.cuda_memory
        self.timestamp = time.time()


def host_request_memory(init_snapshot: Any, cache_config: Any) -> int:
    """``request_memory`` on a CPU host: the explicit KV size where one is set, else what the
    budget rule answers now (the worker measures again after the profile run); refuses, as
    :func:`~.cpu_memory.cpu_kv_cache_budget` does, a size the host cannot hold."""
    memory = HostMemory(
        int(init_snapshot.total_memory), int(init_snapshot.free_memory), host_memory().process
    )
    return cpu_kv_cache_budget(cache_config, memory).bytes


@contextmanager
def host_memory_measurement() -> Iterator[None]:
    """Inside this block, upstream's worker module measures host memory (see the module
    docstring); its two names are restored on exit."""
    saved = (upstream.MemorySnapshot, upstream.request_memory)
    upstream.MemorySnapshot = HostMemorySnapshot
    upstream.request_memory = host_request_memory
    try:
        yield
    finally:
        upstream.MemorySnapshot, upstream.request_memory = saved


class CpuDiffusionWorker(upstream.DiffusionWorker):  # type: ignore[misc]
    """vLLM-Omni's ``DiffusionWorker`` whose memory measurement reads host memory."""

    kv_budget: KVBudget | None = None
    """The budget the last ``determine_available_kv_memory`` answered."""

    def init_device(self) -> None:
        with host_memory_measurement():
            super().init_device()

    def determine_available_kv_memory(self, profile_requests: list[Any]) -> list[int]:
        def local_budget() -> int:
            assert self.vllm_config is not None and self.model_runner is not None
            cache_config = self.vllm_config.cache_config
            if budget_rule(cache_config).profiles:
                self.model_runner.profile_run(profile_requests)
                gc.collect()
            budget = cpu_kv_cache_budget(cache_config, host_memory())
            self.kv_budget = budget
            logger.info(
                "Worker %d: CPU KV cache budget %d bytes (%s)", self.rank, budget.bytes, budget.source
            )
            return budget.bytes

        return [
            int(value)
            for value in upstream._run_and_gather_rank_values("CPU KV memory discovery", local_budget)
        ]


__all__ = [
    "WORKER_PATH",
    "CpuDiffusionWorker",
    "HostMemorySnapshot",
    "host_memory_measurement",
    "host_request_memory",
]

"""Host-to-device copies that do not block the host.

A copy from pageable host memory makes the host wait for the device: torch synchronises the
stream after a blocking copy, and CUDA may stage a pageable "non-blocking" one synchronously.
Per-batch metadata built on the host (query indices, packing grids, schedules) therefore goes
through pinned memory: the copy is queued on the current stream, the host moves on, and device
work queued after it reads the copied values. Torch's caching host allocator keeps each pinned
buffer until its copy has run, so the host tensor may change or be freed at once.

Build such metadata before a CUDA graph is captured (the core does: in ``prepare`` and a
backend's ``build``, and a captured step runs once before its capture). A copy captured into a
graph would read its pinned snapshot again at every replay, after the allocator may have
handed that memory to someone else, so :func:`to_device` refuses to run while the current CUDA
stream captures (:class:`~diffusion_kv.core.errors.StateError`; a blocking copy would fail
there as well, with CUDA's own error).
"""

from __future__ import annotations

import functools

import torch

from diffusion_kv.core.errors import StateError


@functools.cache
def pinned_memory_available() -> bool:
    """Whether this host runtime can allocate pinned (page-locked) memory."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``. On an accelerator: a pinned snapshot copied without
    blocking the host (a blocking copy where pinned memory is unavailable). On the CPU: ``host``
    itself, as ``Tensor.to`` returns it. Raises :class:`StateError` while the current CUDA stream
    captures a graph (build the metadata before the capture)."""
    target = torch.device(device)
    if target.type == "cpu":
        return host.to(target)
    if target.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise StateError(
            "a host-to-device metadata copy was asked for while a CUDA graph is being captured: the "
            "graph would re-read a transient host buffer at every replay; build per-batch metadata "
            "(prepare, the backend's build, the first layer call) before the capture"
        )
    if pinned_memory_available():
        return host.pin_memory().to(target, non_blocking=True)
    return host.to(target)

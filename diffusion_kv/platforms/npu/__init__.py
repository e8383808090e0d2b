"""The ``npu`` platform plugin (Huawei Ascend through torch_npu / vllm-ascend).

Two tiers share one set of declared capabilities (:mod:`.constraints`):

* **direct** (:mod:`.direct`): the core's torch BlockTables with int32 slots, a metadata builder
  producing fused-infer-attention (FIA) arguments, and a backend that calls torch_npu through
  the kernel seam (:mod:`.kernels`). Works wherever torch_npu imports; the default.
* **vllm-ascend** (:mod:`.vllm_ascend_tier`): vllm-ascend's own BlockTables, metadata builder
  and attention impl. Taken automatically only when ``vllm_ascend`` is importable *and* an
  embedding vLLM host has bound its runtime (:meth:`NpuPlatform.bind_vllm_runtime`).

``DIFFUSION_KV_NPU_TIER=direct|vllm-ascend`` forces a tier (default ``auto``).

Emulation: when :mod:`diffusion_kv.testing` has installed its pure-torch emulator as
``torch_npu`` (the module marks itself with :data:`.kernels.EMULATOR_ATTRIBUTE`), the plugin
reports itself available with the reason ``"torch_npu emulator (CPU)"``, uses device ``cpu``
and always takes the direct tier. ``torch_npu`` and ``vllm_ascend`` are imported only inside
methods: discovery works on any machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from diffusion_kv.core.block_tables import BlockTables
from diffusion_kv.core.errors import PlatformUnavailableError, UnsupportedRequirementsError, ValidationError
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.platforms.interface import (
    Availability,
    Capabilities,
    KVCache,
    KVWritePolicy,
    LayerGeometry,
    MetadataBuilder,
    PagedAttentionBackend,
    Platform,
    Requirements,
)
from diffusion_kv.platforms.npu.constraints import CAPABILITIES, KERNEL_BLOCK_SIZE, head_count_reasons
from diffusion_kv.platforms.npu.direct import NpuBlockTables, NpuMetadataBuilder, NpuPagedBackend
from diffusion_kv.platforms.npu.kernels import AscendKernels, loaded_emulator
from diffusion_kv.platforms.npu.vllm_ascend_tier import VllmAscendTier, VllmRuntime

ENV_TIER = "DIFFUSION_KV_NPU_TIER"
TIER_AUTO = "auto"
TIER_DIRECT = "direct"
TIER_VLLM_ASCEND = "vllm-ascend"
TIERS = (TIER_AUTO, TIER_DIRECT, TIER_VLLM_ASCEND)

EMULATOR_REASON = "torch_npu emulator (CPU)"

__all__ = ["EMULATOR_REASON", "ENV_TIER", "NpuPlatform", "VllmRuntime"]


def _vllm_ascend_importable() -> bool:
    try:
        return importlib.util.find_spec("vllm_ascend") is not None
    except (ImportError, ValueError):
        return False


class NpuPlatform(Platform):
    name: ClassVar[str] = "npu"
    description: ClassVar[str] = "Huawei Ascend NPUs: fused-infer-attention over paged K/V"
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    kv_write_policy: ClassVar[KVWritePolicy] = KVWritePolicy.PREWRITE
    default_block_size: ClassVar[int] = KERNEL_BLOCK_SIZE

    def __init__(self) -> None:
        self._runtime: VllmRuntime | None = None
        self._vllm_ascend: VllmAscendTier | None = None

    # -- detection ------------------------------------------------------------------------------

    @classmethod
    def is_available(cls) -> Availability:
        if loaded_emulator() is not None:
            return Availability(True, EMULATOR_REASON)
        if importlib.util.find_spec("torch_npu") is None:
            return Availability(False, "torch_npu is not installed")
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:  # e.g. CANN toolkit missing: the reason says so
            return Availability(False, f"torch_npu failed to import: {type(exc).__name__}: {exc}")
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return Availability(False, "torch_npu is importable but no NPU device is visible")
        return Availability(True, f"{npu.device_count()} NPU device(s)")

    def device(self) -> torch.device:
        if loaded_emulator() is not None:
            return torch.device("cpu")
        try:
            return torch.device("npu")
        except RuntimeError as exc:  # the "npu" device type exists only once torch_npu is loaded
            raise PlatformUnavailableError(
                f"the npu device type is registered by torch_npu, which is not loaded here ({exc})"
            ) from None

    def not_supported_reasons(self, requirements: Requirements) -> list[str]:
        return super().not_supported_reasons(requirements) + head_count_reasons(requirements)

    # -- tiers ----------------------------------------------------------------------------------

    def bind_vllm_runtime(self, vllm_config: Any, attn_groups: Any, kv_cache_config: Any) -> None:
        """Hand over the embedding vLLM host's objects the vllm-ascend tier needs."""
        self._runtime = VllmRuntime(vllm_config, attn_groups, kv_cache_config)
        self._vllm_ascend = None

    def tier(self) -> str:
        """The tier in use now: ``"direct"`` or ``"vllm-ascend"`` (see the module docstring)."""
        choice = os.environ.get(ENV_TIER, TIER_AUTO).strip() or TIER_AUTO
        if choice not in TIERS:
            raise ValidationError(f"{ENV_TIER}={choice!r} is not one of {', '.join(TIERS)}")
        if loaded_emulator() is not None:
            if choice == TIER_VLLM_ASCEND:
                raise NotImplementedError(
                    f"{ENV_TIER}=vllm-ascend cannot run under the torch_npu emulator: vllm-ascend needs CANN"
                )
            return TIER_DIRECT
        if choice == TIER_DIRECT:
            return TIER_DIRECT
        importable = _vllm_ascend_importable()
        if choice == TIER_VLLM_ASCEND:
            if not importable:
                raise ValidationError(f"{ENV_TIER}=vllm-ascend, but vllm_ascend is not importable")
            return TIER_VLLM_ASCEND
        return TIER_VLLM_ASCEND if importable and self._runtime is not None else TIER_DIRECT

    def vllm_ascend_tier(self) -> VllmAscendTier:
        if self._vllm_ascend is None:
            self._vllm_ascend = VllmAscendTier(self._runtime)
        return self._vllm_ascend

    def explain(self, requirements: Requirements | None = None) -> list[str]:
        """The capability verdict, then each tier with whether it is used and why."""
        lines = super().explain(requirements)
        mode = os.environ.get(ENV_TIER, TIER_AUTO).strip() or TIER_AUTO
        try:
            chosen = self.tier()
        except (ValidationError, NotImplementedError) as exc:
            return [*lines, f"    tier selection failed: {exc}", f"    mode {ENV_TIER}={mode}"]
        if loaded_emulator() is not None:
            vllm_why = "the torch_npu emulator (CPU) is installed; vllm-ascend needs CANN"
        elif not _vllm_ascend_importable():
            vllm_why = "vllm_ascend is not importable"
        elif self._runtime is None:
            vllm_why = "vllm_ascend is importable, but no vLLM runtime is bound (embedding hosts only)"
        else:
            vllm_why = f"{ENV_TIER}=direct"
        direct_why = "vllm-ascend tier in use"
        return [
            *lines,
            "    tier direct (torch_npu scatter-PA write + fused-infer-attention, TND + block table): "
            + ("used" if chosen == TIER_DIRECT else f"not used: {direct_why}"),
            "    tier vllm-ascend (vllm-ascend BlockTables, build_attn_metadata, AscendAttentionBackendImpl): "
            + ("used" if chosen == TIER_VLLM_ASCEND else f"not used: {vllm_why}"),
            f"    mode {ENV_TIER}={mode}",
        ]

    def init_worker(self) -> None:
        found = self.is_available()
        if not found:
            raise PlatformUnavailableError(f"npu: cannot initialise a worker here: {found.reason}")
        if self.tier() == TIER_VLLM_ASCEND:
            self.vllm_ascend_tier().init_worker()
        else:
            AscendKernels.load()  # fails fast, naming the missing operator and the fix

    # -- the four parts -------------------------------------------------------------------------

    def block_tables_cls(self) -> type[BlockTables]:
        if self.tier() == TIER_VLLM_ASCEND:
            return self.vllm_ascend_tier().block_tables_cls()
        return NpuBlockTables

    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> MetadataBuilder:
        for layer in layers:
            self._require_layer(layer)
        if self.tier() == TIER_VLLM_ASCEND:
            return self.vllm_ascend_tier().metadata_builder()
        return NpuMetadataBuilder(layout, block_tables, self.capabilities, device)

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> PagedAttentionBackend:
        self._require_layer(layer)
        if self.tier() == TIER_VLLM_ASCEND:
            return self.vllm_ascend_tier().paged_backend(layer, device)
        return NpuPagedBackend(layer, AscendKernels.load())

    def _require_layer(self, layer: LayerGeometry) -> None:
        """Reject a layer the Ascend operators cannot serve, with every reason, before any call."""
        reasons = self.not_supported_reasons(
            Requirements(
                dtype=layer.dtype,
                head_size=layer.head_size,
                num_heads=layer.num_heads,
                num_kv_heads=layer.num_kv_heads,
            )
        )
        if reasons:
            raise UnsupportedRequirementsError(
                f"npu cannot serve layer {layer.layer_name!r} "
                f"(dtype={str(layer.dtype).removeprefix('torch.')}, num_heads={layer.num_heads}, "
                f"num_kv_heads={layer.num_kv_heads}, head_size={layer.head_size}): " + "; ".join(reasons)
            )

    # -- KV-cache allocation --------------------------------------------------------------------

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of each of the two tensors (K cache and V cache) of a layer."""
        return (num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        reasons = self.not_supported_reasons(
            Requirements(dtype=dtype, head_size=head_size, num_kv_heads=num_kv_heads, block_size=block_size)
        )
        if reasons:
            raise UnsupportedRequirementsError("npu cannot allocate this KV cache: " + "; ".join(reasons))
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        return (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

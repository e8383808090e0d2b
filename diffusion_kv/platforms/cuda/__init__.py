"""The ``cuda`` platform plugin (NVIDIA GPUs): vLLM's FlashAttention tier when vLLM is usable,
else the standalone tier (torch + Triton, no vLLM).

``DIFFUSION_KV_CUDA_TIER=auto|vllm|standalone`` (default ``auto``): ``auto`` takes the vLLM tier
(:mod:`diffusion_kv.integrations.vllm.cuda_tier`) when it reports no reason against it here,
``vllm`` requires it, ``standalone`` never uses it. The choice is made once per instance and
shown by ``explain()``.

Parts: :class:`~diffusion_kv.platforms.cuda.block_tables.TritonBlockTables` (one launch each for
gather and slot mapping), :class:`~diffusion_kv.platforms.cuda.backend.CudaMetadataBuilder`, and
:class:`~diffusion_kv.platforms.cuda.backend.CudaPagedBackend` choosing per batch between the
in-place Triton paged kernel and gather + torch SDPA. Detection uses torch only; Triton is
imported lazily by the parts that need it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.errors import PlatformError
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Availability,
    Capabilities,
    KVCache,
    KVWritePolicy,
    LayerGeometry,
    MetadataBuilder,
    MultipleOf,
    PagedAttentionBackend,
    Platform,
    Requirements,
)

ENV_BACKEND = "DIFFUSION_KV_CUDA_BACKEND"
ENV_TIER = "DIFFUSION_KV_CUDA_TIER"
TIER_MODES = ("auto", "vllm", "standalone")


def tier_mode() -> str:
    mode = os.environ.get(ENV_TIER, "auto").strip().lower() or "auto"
    if mode not in TIER_MODES:
        raise PlatformError(f"{ENV_TIER}={mode!r}; expected one of {TIER_MODES}")
    return mode


def triton_available() -> tuple[bool, str]:
    """Whether the Triton backend can run (Triton importable), with the reason."""
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed"
    try:
        import triton
    except Exception as exc:  # a broken install is a reason, not a crash
        return False, f"Triton failed to import: {type(exc).__name__}: {exc}"
    return True, f"Triton {triton.__version__}"


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    description: ClassVar[str] = (
        "NVIDIA GPUs: vLLM FlashAttention when usable, else Triton paged kernels / gather+SDPA"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        device_type="cuda",
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=frozenset({64, 128}),
        kernel_block_sizes=(MultipleOf(16),),
        slot_mapping_dtype=torch.int64,
        attention_modes=frozenset(AttentionMode),
        supports_gqa=True,
        supports_ulysses=False,
        supports_dcp=False,
        supports_graph_capture=False,
    )
    kv_write_policy: ClassVar[KVWritePolicy] = KVWritePolicy.PREWRITE
    default_block_size: ClassVar[int] = 128

    def __init__(self) -> None:
        self._tier_decided = False
        self._vllm_parts: Any = None
        self._tier_reasons: list[str] = []

    def _vllm(self) -> Any:
        """The vLLM tier's parts, or None for the standalone tier (decided once)."""
        if self._tier_decided:
            return self._vllm_parts
        mode = tier_mode()
        if mode == "standalone":
            self._tier_reasons = [f"{ENV_TIER}=standalone"]
        else:
            from diffusion_kv.integrations.vllm import cuda_tier  # lazy: reads package metadata only

            self._tier_reasons = cuda_tier.vllm_tier_reasons(Requirements())
            if self._tier_reasons and mode == "vllm":
                raise PlatformError(f"{ENV_TIER}=vllm, but: {'; '.join(self._tier_reasons)}")
            if not self._tier_reasons:
                self._vllm_parts = cuda_tier.VllmCudaParts(default_block_size=self.default_block_size)
        self._tier_decided = True
        return self._vllm_parts

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

    def not_supported_reasons(self, requirements: Requirements) -> list[str]:
        reasons = super().not_supported_reasons(requirements)
        if requirements.dcp_size > 1 and "decode context parallelism" not in " ".join(reasons):
            reasons.append("decode context parallelism in the standalone tier")
        return reasons

    def explain(self, requirements: Requirements | None = None) -> list[str]:
        ok, why = triton_available()
        lines = super().explain(requirements)
        try:
            parts = self._vllm()
        except PlatformError as exc:
            return [*lines, f"  tier: error: {exc}"]
        if parts is not None:
            return [*lines, "  tier: vLLM FlashAttention (vLLM's BlockTables, metadata builder and impl)"]
        lines.append(f"  tier: standalone (vLLM tier not used: {'; '.join(self._tier_reasons)})")
        lines.append(
            f"  backend triton (pages read in place, split-KV): {'available' if ok else 'unavailable'} ({why})"
        )
        lines.append("  backend sdpa (gather pages + torch SDPA cuDNN/flash/efficient): available")
        lines.append(
            "  choice per batch: sdpa when max query_len >= 512 with <= 2 row shapes (compute-bound), "
            f"else triton; {ENV_BACKEND}=triton|sdpa forces one"
        )
        return lines

    def backend_variants(self) -> Mapping[str, Mapping[str, str]]:
        if self._vllm() is not None:
            return {"vllm-flash-attn": {}}
        return {
            "auto": {},
            "triton": {ENV_BACKEND: "triton"},
            "sdpa": {ENV_BACKEND: "sdpa"},
        }

    def block_tables_cls(self) -> type[BlockTables]:
        if (parts := self._vllm()) is not None:
            return parts.block_tables_cls()  # type: ignore[no-any-return]
        if triton_available()[0]:
            from diffusion_kv.platforms.cuda.block_tables import TritonBlockTables

            return TritonBlockTables
        return TorchBlockTables

    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> MetadataBuilder:
        if (parts := self._vllm()) is not None:
            return parts.metadata_builder(layout, block_tables, layers, device)  # type: ignore[no-any-return]
        from diffusion_kv.platforms.cuda.backend import CudaMetadataBuilder

        return CudaMetadataBuilder(layout, block_tables, list(layers), triton_available()[0])

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> PagedAttentionBackend:
        if (parts := self._vllm()) is not None:
            return parts.paged_backend(layer, device)  # type: ignore[no-any-return]
        from diffusion_kv.platforms.cuda.backend import CudaPagedBackend

        return CudaPagedBackend(layer, triton_available()[0])

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        if (parts := self._vllm()) is not None:  # vLLM's own cache layout
            return parts.allocate_kv_cache(  # type: ignore[no-any-return]
                num_blocks, block_size, num_kv_heads, head_size, dtype, device
            )
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        return torch.zeros(shape, dtype=dtype, device=device)

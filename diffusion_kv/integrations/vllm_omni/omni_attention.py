"""The vLLM-Omni diffusion attention backend of the diffusion-kv platform where Omni has none.

vLLM-Omni's ``Attention`` layer asks its platform for a diffusion attention backend class
(``get_diffusion_attn_backend_cls``); the platform it falls back to without a device plugin
(``UnspecifiedOmniPlatform``, e.g. on CPU) has none. :class:`DiffusionKVTorchAttentionBackend`
fills that gap, and only that gap (a device platform's own choice always wins):

* dense attention is Omni's own SDPA implementation (``SDPAImpl._forward_impl``: torch's
  ``scaled_dot_product_attention`` with GQA), with ``full_attn_spans`` run through Omni's own
  ``piecewise_attn`` (causal and full segments);
* paged attention (``supports_paged_kv``) is Omni's own execution boundary,
  ``FlashAttentionImpl.forward_paged``, used unchanged: it writes the layer's K/V once with the
  native impl's ``do_kv_cache_update`` and runs the native ``forward`` over the pages, per
  piecewise segment, exactly as on CUDA and Ascend.

This module imports vLLM-Omni; vLLM-Omni imports it through the class path the platform returns.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch

_abstract: Any = importlib.import_module("vllm_omni.diffusion.attention.backends.abstract")
_sdpa: Any = importlib.import_module("vllm_omni.diffusion.attention.backends.sdpa")
_flash: Any = importlib.import_module("vllm_omni.diffusion.attention.backends.flash_attn")
_piecewise: Any = importlib.import_module("vllm_omni.diffusion.attention.backends.utils.piecewise_attn")

BACKEND_NAME = "DIFFUSION_KV_TORCH"


class DiffusionKVTorchAttentionImpl(_sdpa.SDPAImpl):  # type: ignore[misc]
    """Dense: Omni's SDPA (piecewise spans through Omni's ``piecewise_attn``); paged: Omni's
    ``forward_paged``."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        softmax_scale: float,
        causal: bool = False,
        num_kv_heads: int | None = None,
        prefix: str = "",
        backend_kwargs: dict[str, Any] | None = None,
        **extra_impl_args: Any,
    ) -> None:
        super().__init__(
            num_heads=num_heads,
            head_size=head_size,
            softmax_scale=softmax_scale,
            causal=causal,
            num_kv_heads=num_kv_heads,
            prefix=prefix,
            backend_kwargs=backend_kwargs,
        )

    forward_paged = _flash.FlashAttentionImpl.forward_paged

    def _segment(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
    ) -> torch.Tensor:
        if causal and query.shape[1] != key.shape[1]:  # bottom-right aligned causal
            q_len, k_len = query.shape[1], key.shape[1]
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
            q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
            )
            return out.permute(0, 2, 1, 3)
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.permute(0, 2, 1, 3)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any | None = None,
    ) -> torch.Tensor:
        spans = getattr(attn_metadata, "full_attn_spans", None) if attn_metadata is not None else None
        mask = getattr(attn_metadata, "attn_mask", None) if attn_metadata is not None else None
        if spans is not None and not (isinstance(mask, torch.Tensor) and mask.ndim == 4):
            result: torch.Tensor = _piecewise.piecewise_attn(
                query,
                key,
                value,
                spans,
                self.softmax_scale,
                self._segment,
                getattr(attn_metadata, "query_ranges", None),
            )
            return result
        dense: torch.Tensor = self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")
        return dense


class DiffusionKVTorchAttentionBackend(_abstract.AttentionBackend):  # type: ignore[misc]
    """Omni diffusion attention for platforms without a native one (see the module docstring)."""

    accept_output_buffer: bool = True
    supports_piecewise_spans: bool = True
    supports_paged_kv: bool = True
    supported_platforms: ClassVar[tuple[str, ...] | None] = None

    @classmethod
    def supports_attention_mask(cls, attention_spec: object | None = None) -> bool:
        del attention_spec
        return True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[DiffusionKVTorchAttentionImpl]:
        return DiffusionKVTorchAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[Any]:
        return _abstract.AttentionMetadata  # type: ignore[no-any-return]

    @staticmethod
    def get_builder_cls() -> None:
        return None

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return []


BACKEND_PATH = f"{__name__}.{DiffusionKVTorchAttentionBackend.__qualname__}"

__all__ = [
    "BACKEND_NAME",
    "BACKEND_PATH",
    "DiffusionKVTorchAttentionBackend",
    "DiffusionKVTorchAttentionImpl",
]

"""A diffusion-kv paged backend as the vLLM attention backend vLLM-Omni pages with.

vLLM-Omni's own paged module builds one vLLM ``AttentionLayerBase`` adapter per paged layer,
asks ``get_diffusion_paged_kv_attn_backend`` which vLLM attention backend to use, lets vLLM's
``init_attn_backend`` make one metadata builder per group and ``init_kv_cache`` bind each
layer's view of the scheduler's ``KVCacheConfig`` tensors, then calls the impl's
``do_kv_cache_update`` and ``forward`` from Omni's ``forward_paged``. For a diffusion-kv
backend (one that is not vLLM's own kernel), :func:`vllm_attention_backend_for` returns a
vLLM-shaped backend class that routes each of those calls to it:

* the **builder** makes the diffusion-kv backend instance of its KV-cache group on the first
  build (it needs the ``KVCacheConfig`` and the worker's BlockTables, which exist only then) and
  checks the full requirements (head size, heads, block size, modes) against it;
* :func:`build_metadata` (what the platform's ``build_diffusion_kv_attn_metadata`` calls for
  these groups) turns upstream's metadata keywords into one ``PagedBatch`` per group and calls
  the backend's ``build``;
* the **impl**'s ``do_kv_cache_update`` is the backend's ``write_kv`` and its ``forward`` the
  backend's ``forward`` (K/V read from the pages only), on a zero-copy view of vLLM's per-layer
  cache in the backend's page layout (:func:`page_view`).

The per-layer cache is vLLM's logical ``[blocks, kv_heads, block_size, 2 * head_size]`` view
(K in the first ``head_size`` channels of each token, V in the rest), physically ordered by the
configured ``KVCacheLayout``; the platform hooks pick the layout that makes the backend's page
view a plain strided view (:data:`~.hooks.PAGE_LAYOUT_KV_CACHE_LAYOUT`). Decode context
parallelism is refused here (the partial attention would need a merge across ranks that this
path has no group for); the module replacement (:mod:`.runner`) supports it.

fp8 pages: vLLM's ``cache_config.cache_dtype`` ``fp8``/``fp8_e4m3`` (the ``kv_cache_dtype``
vLLM-Omni passes the impl) gives each layer's geometry ``float8_e4m3fn`` pages and the core's
per-KV-head scales, on a backend declaring e4m3 (the requirements refuse one that does not);
:func:`page_view` reads the e4m3 pages out of the model-dtype cache vLLM-Omni allocates.

vLLM is imported when a class is first built, never at module import.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffusion_kv.core.backend import GroupContext, KVPageLayout, PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry
from diffusion_kv.core.capabilities import AttentionMode, MultipleOf, Requirements
from diffusion_kv.core.errors import (
    StateError,
    UnsupportedFeatureError,
    UnsupportedRequirementsError,
    ValidationError,
)
from diffusion_kv.core.kv_quant import FP8_E4M3, KVScales
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.integrations.vllm_omni.hooks import (
    FP8_NAMES,
    cache_dtype_refusal,
    group_cache_dtype,
    paged_batch,
)
from diffusion_kv.platforms.interface import Platform

LAYER_ATTR = "_diffusion_kv_group"
"""Attribute of a vLLM-Omni layer adapter holding its :class:`BoundLayer` once built."""


def page_view(
    kv_cache: KVCache, layout: KVPageLayout, head_size: int, cache_dtype: torch.dtype | None = None
) -> KVCache:
    """vLLM's per-layer ``[blocks, kv_heads, block, 2 * head_size]`` cache as ``layout`` pages.

    Zero-copy: the result is a strided view of the same storage (writes go to vLLM's tensor).
    A cache already in page shape (5-D, or a tuple) is returned as it is. ``cache_dtype``
    ``float8_e4m3fn`` (fp8 pages): the cache's bytes as e4m3, each token's K and V in its first
    ``2 * head_size`` bytes (vLLM-Omni sizes a paged layer's spec in the model dtype, so a
    16-bit cache leaves the rest of each token's slot unused; a 1-byte cache is used whole).
    """
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.ndim != 4:
        return kv_cache
    if cache_dtype == FP8_E4M3 and kv_cache.dtype != FP8_E4M3:
        if kv_cache.shape[-1] != 2 * head_size or kv_cache.stride(-1) != 1:
            raise ValidationError(
                f"KV cache view {tuple(kv_cache.shape)} (strides {kv_cache.stride()}) is not "
                f"[blocks, kv_heads, block_size, 2*{head_size}] with contiguous channels"
            )
        kv_cache = kv_cache.view(torch.uint8)[..., : 2 * head_size].view(FP8_E4M3)
    if kv_cache.shape[-1] != 2 * head_size:
        raise ValidationError(
            f"KV cache view {tuple(kv_cache.shape)} is not [blocks, kv_heads, block_size, 2*{head_size}]"
        )
    split = kv_cache.view(*kv_cache.shape[:-1], 2, head_size)  # [B, H, N, 2, D]
    if layout is KVPageLayout.HEAD_FIRST:
        return split.permute(3, 0, 1, 2, 4)  # [2, B, H, N, D]
    if layout is KVPageLayout.COMBINED:
        return split.permute(3, 0, 2, 1, 4)  # [2, B, N, H, D]
    key = split[..., 0, :].permute(0, 2, 1, 3)  # [B, N, H, D]
    value = split[..., 1, :].permute(0, 2, 1, 3)
    return (key, value)


@dataclass(frozen=True)
class BoundLayer:
    """One paged layer's diffusion-kv backend instance and geometry."""

    backend: PagedBackend
    geometry: LayerGeometry


@dataclass(frozen=True)
class WrappedMetadata:
    """The native metadata of one group for one build, with the backend that made it."""

    backend: PagedBackend
    native: Any


def _bound(layer: Any) -> BoundLayer:
    bound = getattr(layer, LAYER_ATTR, None)
    if not isinstance(bound, BoundLayer):
        raise StateError(
            f"diffusion-kv backend of layer {getattr(layer, 'layer_name', layer)!r} is not built yet: "
            "vLLM-Omni builds it with the first paged attention metadata"
        )
    return bound


def layer_geometry(layer: Any, name: str) -> LayerGeometry:
    """The rank-local geometry of a vLLM-Omni paged layer adapter (read by attribute name)."""
    spec = layer.spec
    scale = getattr(layer, "softmax_scale", None)
    if scale is None:
        scale = layer.impl.scale
    return LayerGeometry(
        layer_name=name,
        num_heads=int(layer.num_heads),
        num_kv_heads=int(layer.num_kv_heads),
        head_size=int(layer.head_size),
        scale=float(scale),
        dtype=spec.dtype,
        mode=AttentionMode.FULL if getattr(spec, "non_causal", False) else AttentionMode.CAUSAL,
    )


class PagedImpl:
    """vLLM's impl contract (``do_kv_cache_update``, ``forward``) over a diffusion-kv backend."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: Any = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        unsupported = [
            name
            for name, value in (
                ("alibi_slopes", alibi_slopes),
                ("sliding_window", sliding_window),
                ("logits_soft_cap", logits_soft_cap),
                ("kv_sharing_target_layer_name", kv_sharing_target_layer_name),
                *((k, v) for k, v in extra.items()),
            )
            if value is not None
        ]
        reason = cache_dtype_refusal(kv_cache_dtype)
        if reason is not None:
            unsupported.append(reason)
        if str(attn_type).lower() not in ("decoder", "attentiontype.decoder"):
            unsupported.append(f"attn_type={attn_type!r}")
        if unsupported:
            raise UnsupportedFeatureError(
                f"diffusion-kv paged backends do not support {unsupported} (the paged diffusion path is "
                "decoder attention, its pages unquantised or fp8_e4m3)"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.kv_cache_dtype = kv_cache_dtype

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        bound = _bound(layer)
        g = bound.geometry
        pages = page_view(kv_cache, bound.backend.page_layout, g.head_size, g.cache_dtype)
        bound.backend.write_kv(g, key, value, pages, slot_mapping.reshape(-1)[: key.shape[0]])

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: Any,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del key, value  # written by do_kv_cache_update (forward_includes_kv_cache_update = False)
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedFeatureError("diffusion-kv paged backends do not quantise their output")
        if attn_metadata is None:  # vLLM's warm-up convention
            return output if output is not None else torch.empty_like(query)
        if not isinstance(attn_metadata, WrappedMetadata):
            raise ValidationError(
                f"diffusion-kv paged layer got {type(attn_metadata).__name__} metadata; expected the metadata "
                "build_diffusion_kv_attn_metadata made for it"
            )
        bound = _bound(layer)
        g = bound.geometry
        pages = page_view(kv_cache, bound.backend.page_layout, g.head_size, g.cache_dtype)
        q = query.reshape(-1, g.num_heads, g.head_size)
        out = output.view(q.shape) if output is not None else None
        result = attn_metadata.backend.forward(g, q.contiguous(), pages, attn_metadata.native, out)
        return result.view(query.shape) if output is None else output


@functools.cache
def vllm_attention_backend_for(backend: type[PagedBackend]) -> type:
    """The vLLM attention backend class serving through ``backend`` (one class per backend)."""
    from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder
    from vllm.v1.attention.backend import MultipleOf as VllmMultipleOf

    caps = backend.capabilities
    kernel_sizes: list[Any] = [
        VllmMultipleOf(rule.base) if isinstance(rule, MultipleOf) else rule
        for rule in caps.kernel_block_sizes
    ]

    class PagedBuilder(AttentionMetadataBuilder):  # type: ignore[misc]
        """Holds the group's diffusion-kv backend instance (made on the first build)."""

        def __init__(
            self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device, **_: Any
        ) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.paged_backend: PagedBackend | None = None

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
            raise UnsupportedFeatureError(
                f"{backend.platform}:{backend.name} metadata is built by the platform's "
                "build_diffusion_kv_attn_metadata, not by vLLM's build_attn_metadata"
            )

        def ensure_backend(
            self,
            *,
            group_index: int,
            kv_cache_config: Any,
            block_tables: Any,
            platform: Platform,
        ) -> PagedBackend:
            if self.paged_backend is not None:
                return self.paged_backend
            self.paged_backend = make_group_backend(
                backend,
                builder=self,
                group_index=group_index,
                kv_cache_config=kv_cache_config,
                block_tables=block_tables,
                platform=platform,
            )
            return self.paged_backend

    class PagedAttentionBackend(AttentionBackend):  # type: ignore[misc]
        forward_includes_kv_cache_update: bool = False
        accept_output_buffer: bool = True
        supported_dtypes: ClassVar[list[torch.dtype]] = sorted(caps.dtypes, key=str)
        supported_kv_cache_dtypes: ClassVar[list[str]] = (
            ["auto", *FP8_NAMES] if FP8_E4M3 in caps.kv_cache_dtypes else ["auto"]
        )
        paged_backend: ClassVar[type[PagedBackend]] = backend

        @staticmethod
        def get_name() -> str:
            return "DIFFUSION_KV"

        @staticmethod
        def get_impl_cls() -> type[PagedImpl]:
            return PagedImpl

        @staticmethod
        def get_builder_cls() -> type[Any]:
            return PagedBuilder

        @staticmethod
        def get_supported_kernel_block_sizes() -> list[Any]:
            return list(kernel_sizes)

        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return sorted(caps.head_sizes) if caps.head_sizes is not None else []

        @classmethod
        def supports_non_causal(cls) -> bool:
            return AttentionMode.FULL in caps.attention_modes

        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
        ) -> tuple[int, ...]:
            return (num_blocks, num_kv_heads, block_size, 2 * head_size)

        @classmethod
        def indexes_kv_by_block_stride(cls) -> bool:
            return False

    name = f"DiffusionKV[{backend.platform}:{backend.name}]"
    PagedAttentionBackend.__name__ = PagedAttentionBackend.__qualname__ = name
    PagedBuilder.__name__ = PagedBuilder.__qualname__ = f"{name}.Builder"
    return PagedAttentionBackend


def make_group_backend(
    backend: type[PagedBackend],
    *,
    builder: Any,
    group_index: int,
    kv_cache_config: Any,
    block_tables: Any,
    platform: Platform,
) -> PagedBackend:
    """The diffusion-kv backend instance serving ``builder``'s layers, bound to each layer."""
    vllm_config = builder.vllm_config
    forward_context = vllm_config.compilation_config.static_forward_context
    group_spec = kv_cache_config.kv_cache_groups[group_index].kv_cache_spec
    layers = {name: forward_context[name] for name in builder.layer_names}
    geometry = tuple(layer_geometry(layer, name) for name, layer in layers.items())
    cache_dtype = group_cache_dtype(vllm_config)
    device = torch.device(builder.device)
    if cache_dtype is not None:
        geometry = tuple(
            dataclasses.replace(
                g,
                cache_dtype=cache_dtype,
                kv_scales=KVScales(g.num_kv_heads, device, layer=g.layer_name),
            )
            for g in geometry
        )
    g0 = geometry[0]
    block_size = int(group_spec.block_size)
    kernel = int(getattr(builder, "kernel_block_size", None) or builder.kv_cache_spec.block_size)
    cp_size = int(block_tables.cp_size)
    if cp_size > 1:
        raise UnsupportedFeatureError(
            f"{backend.platform}:{backend.name} through vLLM-Omni's own module does not support decode context "
            f"parallelism (cp_size={cp_size}); use the module replacement (diffusion_kv.integrations.vllm_omni)"
        )
    modes = (
        {AttentionMode.CAUSAL, AttentionMode.PIECEWISE}
        if g0.mode is AttentionMode.CAUSAL
        else {AttentionMode.FULL}
    )
    requirements = Requirements(
        dtype=g0.dtype,
        head_size=g0.head_size,
        num_heads=g0.num_heads,
        num_kv_heads=g0.num_kv_heads,
        block_size=block_size,
        attention_modes=frozenset(modes),
        kv_cache_dtype=cache_dtype,
    )
    reasons = platform.backend_reasons(backend, requirements)
    if reasons:
        raise UnsupportedRequirementsError(
            f"diffusion-kv backend {backend.platform}:{backend.name} cannot serve KV-cache group {group_index} "
            f"({requirements.describe()}): " + "; ".join(reasons)
        )
    layout = CacheLayout.from_kv_cache_config(
        kv_cache_config,
        max_model_len=int(vllm_config.model_config.max_model_len),
        max_rows_per_request=1,
        max_num_seqs=int(block_tables.max_num_reqs),
        max_num_batched_tokens=int(block_tables.max_num_batched_tokens),
    )
    context = GroupContext(
        index=group_index,
        layers=geometry,
        mode=g0.mode,
        block_size=block_size,
        kernel_block_size=kernel,
        num_blocks=int(kv_cache_config.num_blocks),
        block_tables=block_tables,
        layout=layout,
        device=device,
        platform_name=platform.name,
    )
    instance = backend(context)
    for geom in geometry:
        setattr(layers[geom.layer_name], LAYER_ATTR, BoundLayer(instance, geom))
    return instance


def is_wrapped(attn_backend: Any) -> bool:
    """Whether a vLLM attention backend class is one of :func:`vllm_attention_backend_for`'s."""
    return isinstance(attn_backend, type) and isinstance(getattr(attn_backend, "paged_backend", None), type)


def build_metadata(
    *,
    attn_groups: Sequence[Sequence[Any]],
    kv_cache_config: Any,
    worker_block_tables: Any,
    platform: Platform,
    causal: bool | Mapping[int, bool] = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """Native metadata per layer for one build, for attention groups of wrapped backends
    (``worker_block_tables``: the worker's BlockTables; the other keywords are upstream's)."""
    out: dict[str, Any] = {}
    for g, groups in enumerate(attn_groups):
        for group in groups:
            builder = group.get_metadata_builder(0)
            instance = builder.ensure_backend(
                group_index=g,
                kv_cache_config=kv_cache_config,
                block_tables=worker_block_tables,
                platform=platform,
            )
            batch = paged_batch(g, instance.group.mode, causal=causal, **kwargs)
            wrapped = WrappedMetadata(instance, instance.build(batch))
            out.update(dict.fromkeys(group.layer_names, wrapped))
    return out


__all__ = [
    "LAYER_ATTR",
    "BoundLayer",
    "PagedImpl",
    "WrappedMetadata",
    "build_metadata",
    "is_wrapped",
    "layer_geometry",
    "make_group_backend",
    "page_view",
    "vllm_attention_backend_for",
]

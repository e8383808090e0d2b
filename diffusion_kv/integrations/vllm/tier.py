"""vLLM-native parts shared by the paged backends that run on vLLM's own machinery.

Importing this module checks the installed vLLM first: a release outside
:data:`~diffusion_kv.integrations.vllm.versions.SUPPORTED_RANGE` raises
:class:`~diffusion_kv.integrations.vllm.versions.UnsupportedVllmVersionError` naming the range,
and a missing vLLM raises ``ImportError``. vLLM itself is still imported lazily, through the
seam (:mod:`.compat`), when a part is built.

:class:`VllmSession` is vLLM's view of one KV-cache group: a ``VllmConfig`` (the host's, or
a minimal one synthesised from the layer geometry), one attention-layer adapter per paged layer
registered in ``static_forward_context``, and the attention groups / metadata builders from
``init_attn_backend``. The paged backend over it is :mod:`.backend`.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_kv.core.batch import LayerGeometry, PagedBatch
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.layout import CacheLayout
from diffusion_kv.integrations.vllm.compat import VllmCompat, installed_compat

COMPAT: VllmCompat = installed_compat()  # fails here, with the supported range, when unsupported

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# --------------------------------------------------------------------------------------------
# The attention-layer adapter
# --------------------------------------------------------------------------------------------


def layer_adapter_cls(compat: VllmCompat) -> type[Any]:
    """An ``AttentionLayerBase`` subclass for ``compat``'s vLLM (built once per seam)."""
    if compat.layer_adapter_cls is not None:
        return compat.layer_adapter_cls
    base: type[Any] = compat.symbol("AttentionLayerBase")

    class PagedLayerAdapter(base):  # type: ignore[misc]
        """Registers one diffusion layer with vLLM's cache machinery (not a vLLM ``Attention``).

        Heads are rank-local (global heads divided by the strict-Ulysses degree); quantisation
        scales are identity (the paged diffusion path is unquantised); the native impl is built
        from the selected backend and checked for what the paged path calls.
        """

        def __init__(
            self,
            *,
            layer_name: str,
            num_heads: int,
            num_kv_heads: int,
            head_size: int,
            scale: float,
            dtype: torch.dtype,
            causal: bool,
            block_size: int,
            backend: type[Any],
            vllm_config: Any,
            device: torch.device,
            ulysses_degree: int = 1,
        ) -> None:
            if type(ulysses_degree) is not int or ulysses_degree <= 0:
                raise ValueError(f"ulysses_degree must be a positive integer; got {ulysses_degree!r}")
            if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
                raise ValueError(
                    f"layer {layer_name!r}: paged attention needs positive heads with num_heads divisible by "
                    f"num_kv_heads; got num_heads={num_heads}, num_kv_heads={num_kv_heads}"
                )
            if num_heads % ulysses_degree or num_kv_heads % ulysses_degree:
                raise ValueError(
                    f"layer {layer_name!r}: num_heads={num_heads} and num_kv_heads={num_kv_heads} must be "
                    f"divisible by ulysses_degree={ulysses_degree}"
                )
            self.layer_name = layer_name
            self.num_heads = num_heads // ulysses_degree
            self.num_kv_heads = num_kv_heads // ulysses_degree
            self.head_size = head_size
            self.head_size_v = head_size
            self.softmax_scale = float(scale)
            self.dtype = dtype
            self.attn_backend = backend
            self.spec = compat.symbol("FullAttentionSpec")(
                block_size=block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=head_size,
                dtype=dtype,
                non_causal=not causal,
            )
            self.kv_cache: torch.Tensor | None = None
            ones = torch.ones(1, dtype=torch.float32, device=device)
            self._q_scale, self._k_scale, self._v_scale = ones, ones.clone(), ones.clone()
            self._k_scale_cpu = self._v_scale_cpu = torch.ones(1, dtype=torch.float32)
            self._prob_scale = ones.clone()
            self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
            self.isa: str | None = None
            with compat.current_config(vllm_config):
                self.impl = self._create_impl(vllm_config)

        def _create_impl(self, vllm_config: Any) -> Any:
            backend = self.attn_backend
            impl = backend.get_impl_cls()(
                num_heads=self.num_heads,
                head_size=self.head_size,
                scale=self.softmax_scale,
                num_kv_heads=self.num_kv_heads,
                alibi_slopes=None,
                sliding_window=None,
                kv_cache_dtype=vllm_config.cache_config.cache_dtype,
                logits_soft_cap=None,
                attn_type=compat.symbol("AttentionType").DECODER,
                kv_sharing_target_layer_name=None,
            )
            name = backend.get_name()
            if not callable(getattr(impl, "forward", None)):
                raise RuntimeError(f"native paged-attention backend {name!r} has no forward implementation")
            # the core writes each layer's K/V once (do_kv_cache_update), then attention reads pages
            if not callable(getattr(impl, "do_kv_cache_update", None)):
                raise RuntimeError(f"native paged-attention backend {name!r} cannot update the KV cache")
            if hasattr(impl, "vllm_flash_attn_version") and impl.vllm_flash_attn_version is None:
                raise RuntimeError(
                    f"native paged-attention kernel of {name!r} is unavailable for layer {self.layer_name!r} "
                    "(vllm_flash_attn_version is None: no usable FlashAttention build for this device)"
                )
            return impl

        def get_attn_backend(self) -> type[Any]:
            return self.attn_backend

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            del vllm_config
            return self.spec

    compat.layer_adapter_cls = PagedLayerAdapter
    return PagedLayerAdapter


# --------------------------------------------------------------------------------------------
# A minimal VllmConfig for standalone use
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigKey:
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    max_model_len: int


_MODEL_DIRS: list[str] = []
_MODEL_CONFIGS: dict[ConfigKey, Any] = {}
_LOCK = threading.Lock()


def _remove_model_dirs() -> None:
    for path in _MODEL_DIRS:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_model_dirs)


def _model_config(key: ConfigKey) -> Any:
    """A ``ModelConfig`` for a local, weightless decoder with this attention geometry (cached)."""
    with _LOCK:
        if key in _MODEL_CONFIGS:
            return _MODEL_CONFIGS[key]
        from vllm.config import ModelConfig

        path = tempfile.mkdtemp(prefix="dkv-vllm-geometry-")
        _MODEL_DIRS.append(path)
        hf = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": key.num_heads * key.head_size,
            "num_attention_heads": key.num_heads,
            "num_key_value_heads": key.num_kv_heads,
            "head_dim": key.head_size,
            "num_hidden_layers": 1,
            "intermediate_size": 4 * key.num_heads * key.head_size,
            "vocab_size": 256,
            "max_position_embeddings": key.max_model_len,
            "torch_dtype": _DTYPE_NAMES.get(key.dtype, "float16"),
        }
        with open(f"{path}/config.json", "w") as fh:
            json.dump(hf, fh)
        config = ModelConfig(
            model=path, skip_tokenizer_init=True, dtype=key.dtype, max_model_len=key.max_model_len
        )
        _MODEL_CONFIGS[key] = config
        return config


def synthesize_vllm_config(
    geometry: LayerGeometry, layout: CacheLayout, *, kv_cache_layout: str | None = None
) -> Any:
    """A ``VllmConfig`` carrying only what the attention path reads (no model weights)."""
    from vllm.config import CacheConfig, VllmConfig

    key = ConfigKey(
        geometry.num_heads, geometry.num_kv_heads, geometry.head_size, geometry.dtype, layout.max_model_len
    )
    config = VllmConfig(
        model_config=_model_config(key), cache_config=CacheConfig(block_size=layout.groups[0].block_size)
    )
    config.scheduler_config.max_num_seqs = layout.max_num_reqs
    config.scheduler_config.max_num_batched_tokens = layout.max_num_batched_tokens
    if kv_cache_layout is not None and getattr(config.cache_config, "kv_cache_layout", "absent") is None:
        config.cache_config.kv_cache_layout = kv_cache_layout
    return config


# --------------------------------------------------------------------------------------------
# Session
# --------------------------------------------------------------------------------------------


class VllmSession:
    """vLLM's machinery for one cache layout (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: CacheLayout,
        layers: Sequence[LayerGeometry],
        device: torch.device,
        backend: str | None = "FLASH_ATTN",
        vllm_config: Any | None = None,
        compat: VllmCompat | None = None,
        isa: str | None = None,
    ) -> None:
        self.compat = compat or COMPAT
        self.layout = layout
        self.device = torch.device(device)
        by_name = {g.layer_name: g for g in layers}
        missing = [n for n in layout.layer_names if n not in by_name]
        if missing:
            raise ValueError(f"the cache layout names layers without geometry: {missing}")
        first = by_name[layout.layer_names[0]]
        self.vllm_config = vllm_config if vllm_config is not None else synthesize_vllm_config(first, layout)
        config = self.vllm_config
        non_causal = any(g.spec.mode is AttentionMode.FULL for g in layout.groups)
        backends: dict[tuple[int, int, torch.dtype], type[Any]] = {}
        adapter_cls = layer_adapter_cls(self.compat)
        self.adapters: dict[str, Any] = {}
        for group in layout.groups:
            for name in group.layer_names:
                geom = by_name[name]
                key = (geom.num_heads, geom.head_size, geom.dtype)
                if key not in backends:
                    backends[key] = self.compat.get_attn_backend(
                        vllm_config=config,
                        head_size=geom.head_size,
                        dtype=geom.dtype,
                        num_heads=geom.num_heads,
                        backend=backend,
                        use_non_causal=non_causal,
                    )
                self.adapters[name] = adapter_cls(
                    layer_name=name,
                    num_heads=geom.num_heads,
                    num_kv_heads=geom.num_kv_heads,
                    head_size=geom.head_size,
                    scale=geom.scale,
                    dtype=geom.dtype,
                    causal=geom.mode is AttentionMode.CAUSAL,
                    block_size=group.block_size,
                    backend=backends[key],
                    vllm_config=config,
                    device=self.device,
                )
        if (
            self.compat.shape.resolves_kv_cache_layout
            and getattr(config.cache_config, "kv_cache_layout", "") is None
        ):
            config.cache_config.kv_cache_layout = self.compat.kv_cache_layout(next(iter(backends.values())))
        forward_context = config.compilation_config.static_forward_context
        forward_context.update(self.adapters)
        self.kv_cache_config = self._kv_cache_config()
        previous_non_causal = config.attention_config.use_non_causal
        config.attention_config.use_non_causal = non_causal
        try:
            with self.compat.current_config(config):
                self.attn_groups, self.kernel_block_sizes = self.compat.init_attn_backend(
                    self.kv_cache_config, config, self.device
                )
        except Exception:
            config.attention_config.use_non_causal = previous_non_causal
            for name in self.adapters:
                forward_context.pop(name, None)
            raise
        self.builders = [g.get_metadata_builder(0) for groups in self.attn_groups for g in groups]
        if isa is not None:
            for builder in self.builders:
                if hasattr(builder, "isa"):
                    builder.isa = isa
        for groups in self.attn_groups:
            for g in groups:
                builder_isa = getattr(g.get_metadata_builder(0), "isa", None)
                for name in g.layer_names:
                    if builder_isa is not None:
                        self.adapters[name].isa = builder_isa
        impl = next(iter(self.adapters.values())).impl
        self.flash_attn_version: int | None = getattr(impl, "vllm_flash_attn_version", None)

    def _kv_cache_config(self) -> Any:
        groups = []
        for group in self.layout.groups:
            spec = self.adapters[group.layer_names[0]].spec
            groups.append(self.compat.symbol("KVCacheGroupSpec")(list(group.layer_names), spec))
        return self.compat.symbol("KVCacheConfig")(
            num_blocks=self.layout.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )

    @property
    def backend_name(self) -> str:
        return str(next(iter(self.adapters.values())).attn_backend.get_name())

    def reorder_batch_threshold(self) -> int | None:
        values = [
            getattr(g.get_metadata_builder(0), "reorder_batch_threshold", None)
            for index, groups in enumerate(self.attn_groups)
            if self.layout.groups[index].spec.mode is AttentionMode.CAUSAL
            for g in groups
        ]
        concrete = [v for v in values if v is not None]
        return min(concrete) if concrete else None

    def build(self, batch: PagedBatch) -> dict[str, Any]:
        with self.compat.current_config(self.vllm_config):
            return self.compat.build_attn_metadata(
                attn_groups=self.attn_groups, batch=batch, kv_cache_config=self.kv_cache_config
            )

    def allocate_kv_cache(self, layer_name: str, num_blocks: int) -> torch.Tensor:
        adapter = self.adapters[layer_name]
        # The CUDA backends read the KV-cache layout from the current config (stride order).
        with self.compat.current_config(self.vllm_config):
            return self.compat.allocate_kv_cache(
                adapter.attn_backend,
                num_blocks=num_blocks,
                block_size=adapter.spec.block_size,
                num_kv_heads=adapter.num_kv_heads,
                head_size=adapter.head_size,
                dtype=adapter.dtype,
                device=self.device,
                cache_dtype=self.vllm_config.cache_config.cache_dtype,
            )


__all__ = ["COMPAT", "VllmSession", "layer_adapter_cls", "synthesize_vllm_config"]

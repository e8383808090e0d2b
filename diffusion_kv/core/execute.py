"""The per-layer execution driver: one paged attention forward.

The layer's new K/V is written exactly once (``backend.write_kv``), before and outside the
segment loop; every native call then reads pages only. Under decode context parallelism (a
``merger`` is given) every native call is a partial one (``forward_partial``): it attends over
this rank's keys and the core merges the partials of every DCP rank by log-sum-exp, per call
(so per piecewise segment), before the output is restored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from diffusion_kv.core.backend import PagedBackend
from diffusion_kv.core.batch import KVCache, LayerGeometry, key_value_caches
from diffusion_kv.core.errors import (
    DiffusionKVError,
    NativeBackendError,
    StateError,
    UnknownLayerError,
    ValidationError,
)
from diffusion_kv.core.layer_context import BoundLayer, LayerContext, build_layer_context, tensor_signature
from diffusion_kv.core.parallel import PartialMerger
from diffusion_kv.core.piecewise import run_piecewise_plan
from diffusion_kv.core.translate import Translator


def run_layer(
    ctx: LayerContext, backend: PagedBackend, kv_cache: KVCache, merger: PartialMerger | None = None
) -> torch.Tensor:
    """Write once, run every segment, and restore the caller's layout."""
    layer = ctx.layer
    if ctx.slots_valid:
        backend.write_kv_valid(layer, ctx.key, ctx.value, kv_cache, ctx.slot_mapping)
    else:
        backend.write_kv(layer, ctx.key, ctx.value, kv_cache, ctx.slot_mapping)
    plan = ctx.plan
    if merger is None and (plan is None or plan.single_call):  # one native call over every query
        md = ctx.native_metadata if plan is None else ctx.segment_metadata[0]
        return ctx.restore_output(backend.forward(layer, ctx.query, kv_cache, md, None))

    def runner(q: torch.Tensor, md: Any, out: torch.Tensor | None) -> torch.Tensor:
        if merger is None:
            return backend.forward(layer, q, kv_cache, md, out)
        partial, lse = backend.forward_partial(layer, q, kv_cache, md)
        merged = merger.merge(partial, lse)
        if out is None:
            return merged
        out.copy_(merged)
        return out

    if plan is not None:
        out = run_piecewise_plan(ctx.query, plan, ctx.segment_metadata, runner, out_head_size=layer.head_size)
    else:
        out = runner(ctx.query, ctx.native_metadata, None)
    return ctx.restore_output(out)


class PagedExecutor:
    """Runs paged layers against the translator's active batch.

    Holds, per layer: its geometry, the backend serving its KV-cache group and its KV cache. A
    paged layer called without an active batch is an error (there is no silent dense fallback).
    """

    def __init__(
        self,
        translator: Translator,
        layers: Mapping[str, LayerGeometry],
        backends: Mapping[str, PagedBackend],
        kv_caches: Mapping[str, KVCache],
        merger: PartialMerger | None = None,
        platform_name: str = "?",
    ) -> None:
        missing = sorted(set(layers) - set(backends)) + sorted(set(layers) - set(kv_caches))
        if missing:
            raise StateError(f"paged layers without a backend or KV cache: {missing}")
        if merger is not None:
            lacking = sorted(
                f"{name} ({b.name})" for name, b in backends.items() if not b.capabilities.supports_dcp
            )
            if lacking:
                raise ValidationError(
                    "decode context parallelism needs backends that return partial attention with its "
                    f"log-sum-exp (forward_partial, supports_dcp); these layers' backends do not: {lacking}"
                )
        self.merger = merger
        self.platform_name = platform_name
        self.translator = translator
        self.layers = dict(layers)
        self.backends = dict(backends)
        self.kv_caches = dict(kv_caches)
        self._twin_keys: dict[str, tuple[PagedBackend | None, Any, Any]] = {}
        """Per layer: its backend and cache when its twin key was made, and the key."""

    def context(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any | None = None,
        *,
        packed_query: bool = False,
    ) -> LayerContext:
        """``packed_query``: hand a query packed per token to the backend uncopied (see
        ``PagedBackend.packed_query``; :meth:`forward` sets it from the layer's backend)."""
        try:
            layer = self.layers[layer_name]
        except (KeyError, TypeError):
            raise UnknownLayerError(
                f"unknown paged attention layer {layer_name!r}; registered: {sorted(self.layers)}"
            ) from None
        return build_layer_context(
            self.translator, layer, query, key, value, attn_metadata, packed_query=packed_query
        )

    def forward(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any | None = None,
    ) -> torch.Tensor:
        """One layer's paged attention; ``query``/``key``/``value`` in any accepted layout.

        A layer whose backend bound a fast path in this activation (``PagedBackend.bind_layer``)
        takes it when Q/K/V have the bound call's layout and no attention metadata is passed;
        every other call takes the full path below (validation, layer context, write, forward)."""
        state = self.translator.active_state
        if attn_metadata is None and state is not None and isinstance(layer_name, str):
            bound: BoundLayer | None = state.bound_layers.get(layer_name)
            if bound is not None or state.twins:
                try:
                    sig: tuple[Any, ...] | None = tensor_signature(query, key, value)
                except AttributeError:  # not tensors: the full path names the error
                    sig = None
                if bound is None and sig is not None:
                    bound = self._bind_twin(state, layer_name, sig)
                if bound is not None and sig == bound.signature:
                    try:
                        out = bound(query, key, value)
                    except DiffusionKVError:
                        raise
                    except Exception as exc:
                        raise self._failed(layer_name, exc) from exc
                    state.layers_done.add(layer_name)
                    return out
        # (a name that is no layer's: context() below names the error)
        backend = self.backends.get(layer_name) if isinstance(layer_name, str) else None
        packed = backend is not None and backend.packed_query and self.merger is None
        ctx = self.context(layer_name, query, key, value, attn_metadata, packed_query=packed)
        assert backend is not None  # context() refused a layer without one
        kv_cache = self.kv_caches[layer_name]
        try:
            out = run_layer(ctx, backend, kv_cache, self.merger)
        except DiffusionKVError:
            raise
        except Exception as exc:  # a plugin's kernel or writer failed: name where, keep the cause
            raise self._failed(layer_name, exc) from exc
        self.translator.layer_done(layer_name)
        if (
            attn_metadata is None
            and state is not None
            and self.merger is None
            and ctx.plan is None
            and ctx.scatter_indices is None
            and ctx.slots_valid
            and layer_name not in state.bound_layers
        ):
            run = backend.bind_layer(ctx.layer, kv_cache, ctx.native_metadata, ctx.slot_mapping)
            if run is not None:
                bound = state.bound_layers[layer_name] = BoundLayer.of(ctx, query, key, value, run, packed)
                twin = self._twin_key(layer_name)
                if twin is not None and twin not in state.twins:
                    state.twins[twin] = (layer_name, bound)
        return out

    def _twin_key(self, layer_name: str) -> Any:
        """What a layer must share with another for its backend to bind it from the other's
        binding (``PagedBackend.bind_layer_like``): the backend's class (the batch check in
        :meth:`_bind_twin` -- the same native metadata object -- keeps twins within one KV-cache
        group), the geometry but the name, and the K/V caches' shapes, strides, dtypes and
        devices. None where the backend keeps the default hook or the layer has ``kv_scales``.
        Made once per backend and cache object (a wrapped backend or a rebound cache makes it
        again)."""
        backend, kv_cache = self.backends.get(layer_name), self.kv_caches.get(layer_name)
        known = self._twin_keys.get(layer_name)
        if known is not None and known[0] is backend and known[1] is kv_cache:
            return known[2]
        layer = self.layers[layer_name]
        key: Any = None
        if (
            backend is not None
            and kv_cache is not None
            and type(backend).bind_layer_like is not PagedBackend.bind_layer_like
            and layer.kv_scales is None
        ):
            try:
                caches = key_value_caches(kv_cache)
            except (TypeError, ValueError, IndexError, AttributeError):
                caches = None
            if caches is not None:
                key = (
                    type(backend),
                    layer.num_heads,
                    layer.num_kv_heads,
                    layer.head_size,
                    layer.scale,
                    layer.dtype,
                    layer.cache_dtype,
                    layer.mask,
                    *((c.shape, c.stride(), c.dtype, c.device) for c in caches),
                )
        self._twin_keys[layer_name] = (backend, kv_cache, key)
        return key

    def _bind_twin(self, state: Any, layer_name: str, sig: tuple[Any, ...]) -> BoundLayer | None:
        """A layer's first call in the activation, bound from its twin's binding where the
        backend can (``PagedBackend.bind_layer_like``); None: the full path serves it."""
        if layer_name in state.no_twin or layer_name not in self.layers:
            return None
        twin = self._twin_key(layer_name)
        entry = state.twins.get(twin) if twin is not None else None
        if entry is None:
            return None
        like_name, like = entry
        batch = state.batch
        slots, metadata = batch.slot_mappings_by_layer, batch.attn_metadata
        slot_mapping, native = slots.get(layer_name), metadata.get(layer_name)
        if (
            sig != like.signature
            or slot_mapping is None
            or slot_mapping is not slots.get(like_name)
            or native is None
            or native is not metadata.get(like_name)
        ):
            state.no_twin.add(layer_name)
            return None
        try:
            run = self.backends[layer_name].bind_layer_like(
                self.layers[layer_name],
                self.kv_caches[layer_name],
                native,
                slot_mapping,
                self.layers[like_name],
                self.kv_caches[like_name],
            )
        except DiffusionKVError:
            raise
        except Exception as exc:
            raise self._failed(layer_name, exc) from exc
        if run is None:
            state.no_twin.add(layer_name)
            return None
        bound: BoundLayer = dataclasses.replace(like, run=run)  # the twin's layout and decisions
        state.bound_layers[layer_name] = bound
        return bound

    def _failed(self, layer_name: str, exc: Exception) -> NativeBackendError:
        backend = self.backends[layer_name]
        return NativeBackendError(
            f"platform {self.platform_name!r} backend {backend.name!r} failed in layer {layer_name!r} "
            f"({type(exc).__name__}: {exc}); the layer's write is not counted as done, so its tokens "
            "stay unreadable until rewritten"
        )

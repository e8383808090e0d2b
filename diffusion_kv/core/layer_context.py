"""Per-layer input normalisation: flatten Q/K/V, pack padded layouts, restore the output.

Accepted layouts for each of query, key and value (the same token layout for all three):

* packed ``[T, H, D]`` or ``[T, H*D]`` with ``T`` the batch's token count;
* batched ``[B, L, H, D]`` or ``[B, L, H*D]`` with ``B`` rows, each row's ``query_len <= L``
  (right padding); real tokens are packed for the native call, and the output is restored to
  ``[B, L, ...]`` with zeros in the padding.

All checks run here, before the execution driver writes anything into the cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_kv.core.batch import LayerGeometry
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import UnsupportedFeatureError, ValidationError
from diffusion_kv.core.piecewise import PiecewisePlan
from diffusion_kv.core.translate import Translator

UNSUPPORTED_METADATA_FIELDS = ("joint_attn_mask", "query_ranges", "video_layout")


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-forward attention metadata a model may pass to a paged layer.

    ``full_attn_spans``: per row, half-open ``[a, b)`` spans of bidirectional attention (the
    rest is causal), on causal and full layers alike (vLLM-Omni's HunyuanImage3 passes them to a
    layer declared non-causal). ``attn_mask`` is accepted only together with spans, as a 4-D tensor that
    the spans already describe. Objects with the same attribute names are accepted too.
    """

    full_attn_spans: Sequence[Sequence[tuple[int, int]]] | None = None
    attn_mask: torch.Tensor | None = None


KNOWN_METADATA_FIELDS = ("full_attn_spans", "attn_mask", "extra", *UNSUPPORTED_METADATA_FIELDS)


def spans_from_metadata(metadata: Any | None) -> Sequence[Sequence[Sequence[int]]] | None:
    """The spans to use, or :class:`UnsupportedFeatureError` naming every field that cannot be
    honoured (and for objects that carry none of the known fields, e.g. a plain mapping)."""
    if metadata is None:
        return None
    if isinstance(metadata, Mapping) or not any(hasattr(metadata, f) for f in KNOWN_METADATA_FIELDS):
        raise UnsupportedFeatureError(
            f"paged attention cannot read attention metadata of type {type(metadata).__name__}; pass "
            f"diffusion_kv.AttentionMetadata or an object with attributes {list(KNOWN_METADATA_FIELDS)}"
        )
    spans = getattr(metadata, "full_attn_spans", None)
    mask = getattr(metadata, "attn_mask", None)
    unsupported = [name for name in UNSUPPORTED_METADATA_FIELDS if getattr(metadata, name, None) is not None]
    if mask is not None:
        if spans is None:
            unsupported.append(
                "attn_mask (an arbitrary mask cannot be paged; describe it with full_attn_spans)"
            )
        elif not isinstance(mask, torch.Tensor) or mask.ndim != 4:
            unsupported.append("attn_mask (piecewise paging requires a 4-D tensor)")
    extra = getattr(metadata, "extra", None)
    if extra:
        unsupported.append(f"extra={sorted(extra)}")
    if unsupported:
        raise UnsupportedFeatureError(
            f"paged attention cannot translate attention metadata field(s) {unsupported!r}"
        )
    return spans


@dataclass(frozen=True, slots=True)
class LayerContext:
    """One layer's normalised inputs for the execution driver."""

    layer: LayerGeometry
    query: torch.Tensor
    """``[T, H, D]`` contiguous."""
    key: torch.Tensor
    """``[T, Hkv, D]``; may be a strided view."""
    value: torch.Tensor
    slot_mapping: torch.Tensor
    """``[T]``."""
    native_metadata: Any
    plan: PiecewisePlan | None
    segment_metadata: tuple[Any, ...]
    token_shape: tuple[int, ...]
    has_head_dims: bool
    scatter_indices: torch.Tensor | None
    slots_valid: bool = False
    """Every slot is a real one (the batch's :attr:`PreparedBatch.slots_valid`)."""

    def restore_output(self, output: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` -> the caller's token layout (zeros where the input was padding)."""
        H, D = self.layer.num_heads, self.layer.head_size
        tail = (H, D) if self.has_head_dims else (H * D,)
        if self.scatter_indices is None:
            return output.reshape(*self.token_shape, *tail)
        full = output.new_zeros((int(torch.Size(self.token_shape).numel()), H, D))
        full.index_copy_(0, self.scatter_indices, output.reshape(-1, H, D))
        return full.reshape(*self.token_shape, *tail)


def _flatten(
    tensor: torch.Tensor,
    heads: int,
    head_size: int,
    name: str,
    token_shape: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """``[*tokens, heads, head_size]`` or ``[*tokens, heads * head_size]`` -> ``[T, heads, D]``.

    With ``token_shape`` (the query's), key and value must use the same token dimensions; this
    is what tells ``[B, 1, Hkv*D]`` (batched, one token per row) from ``[T, Hkv, D]`` when
    ``Hkv == 1``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValidationError(f"paged attention {name} must be a tensor; got {type(tensor).__name__}")
    shape = tuple(tensor.shape)
    forms: list[tuple[tuple[int, ...], bool]] = []
    if tensor.ndim >= 3 and shape[-2:] == (heads, head_size):
        forms.append((shape[:-2], True))
    if tensor.ndim >= 2 and shape[-1] == heads * head_size:
        forms.append((shape[:-1], False))
    if token_shape is not None:
        matching = [f for f in forms if f[0] == token_shape]
        if not matching and forms:
            raise ValidationError(
                f"paged attention {name} token layout {forms[0][0]} must match the query's {token_shape}"
            )
        forms = matching
    if not forms:
        raise ValidationError(
            f"paged attention {name} must end in ({heads}, {head_size}) or ({heads * head_size},); "
            f"got shape {shape}"
        )
    tokens, has_heads = forms[0]
    return tensor.reshape(-1, heads, head_size), tokens, has_heads


def _detached(t: Any) -> Any:
    return t.detach() if isinstance(t, torch.Tensor) else t


def _inner_packed(t: torch.Tensor) -> bool:
    """Heads and head dims packed within each token (the writer may keep the token stride)."""
    return t.stride(-1) == 1 and (t.shape[-2] == 1 or t.stride(-2) == t.shape[-1])


@dataclass(slots=True)
class _LayerPlan:
    """What one batch decided for layer inputs of one shape (see :func:`build_layer_context`):
    every paged layer whose Q/K/V have this signature reuses it without re-validating."""

    token_shape: tuple[int, ...]
    has_head_dims: bool
    scatter: torch.Tensor | None
    contiguous_k: bool
    contiguous_v: bool
    metadata: Any
    """The attention-metadata object last validated for this plan (a reference, so the same
    object is recognised by identity)."""
    spans_snapshot: Any
    """A deep copy of the raw ``full_attn_spans`` validated (``None`` without spans)."""
    plan: PiecewisePlan | None
    by_layer: dict[str, tuple[torch.Tensor, Any, tuple[Any, ...]]]
    """Per layer name: its slot mapping, native metadata and per-segment metadata."""


def _signature(
    layer: LayerGeometry, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[Any, ...]:
    return (
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_size,
        layer.dtype,
        layer.mask,
        *tensor_signature(query, key, value),
    )


def tensor_signature(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[Any, ...]:
    """Shapes, strides, dtypes and devices of one call's Q/K/V (a :class:`BoundLayer` serves a
    later call only when they all equal those of the call it was bound on)."""
    return (
        query.shape,
        key.shape,
        value.shape,
        query.stride(),
        key.stride(),
        value.stride(),
        query.dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
    )


@dataclass(frozen=True, slots=True)
class BoundLayer:
    """A layer's fast path in one activation (:meth:`PagedBackend.bind_layer`): the layout of
    the call it was bound on, and what to do with Q/K/V of that layout -- the views
    :func:`build_layer_context` takes (the key and value detached, made contiguous where it
    made them so: the strides are the bound call's, so are its decisions), the backend's
    ``run``, and the output restored to the caller's token layout. Only plain calls are bound
    (no padding scatter, no piecewise plan), so nothing else :func:`build_layer_context`
    decides applies."""

    signature: tuple[Any, ...]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    head_size: int
    copy_query: bool
    copy_key: bool
    copy_value: bool
    out_shape: tuple[int, ...]

    @classmethod
    def of(
        cls,
        ctx: LayerContext,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        packed_query: bool,
    ) -> BoundLayer:
        """The fast path of the plain call ``ctx`` was built for, on these Q/K/V."""
        layer = ctx.layer
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_size
        tail = (H, D) if ctx.has_head_dims else (H * D,)
        return cls(
            tensor_signature(query, key, value),
            run,
            H,
            Hkv,
            D,
            not (packed_query and _inner_packed(query.reshape(-1, H, D))),
            not _inner_packed(key.reshape(-1, Hkv, D)),
            not _inner_packed(value.reshape(-1, Hkv, D)),
            (*ctx.token_shape, *tail),
        )

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        q = query.reshape(-1, self.heads, self.head_size)
        k = (key.detach() if key.requires_grad else key).reshape(-1, self.kv_heads, self.head_size)
        v = (value.detach() if value.requires_grad else value).reshape(-1, self.kv_heads, self.head_size)
        return self.run(
            q.contiguous() if self.copy_query else q,
            k.contiguous() if self.copy_key else k,
            v.contiguous() if self.copy_value else v,
        ).reshape(self.out_shape)


def build_layer_context(
    translator: Translator,
    layer: LayerGeometry,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_metadata: Any | None = None,
    *,
    packed_query: bool = False,
) -> LayerContext:
    """Validate and normalise one layer's inputs against the active batch.

    ``packed_query``: the backend takes a query packed per token (``PagedBackend.packed_query``),
    so one in that layout is passed on as it is; otherwise the query is made contiguous.

    Validation runs once per batch and input signature (shapes, strides, dtypes, devices and
    the layer geometry): later layers with the same signature and the same spans reuse the
    decisions (layout, packing, piecewise plan) and only take views of their own tensors. The
    spans are compared with a copy of the ones validated, so a change between layers is still
    refused."""
    state = translator.require_active()
    if not (
        isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    ):
        return _build_layer_context(
            state, translator, layer, query, key, value, attn_metadata, packed_query=packed_query
        )
    sig = _signature(layer, query, key, value)
    entry: _LayerPlan | None = state.layer_plans.get(sig)
    if entry is not None and attn_metadata is not entry.metadata:
        spans_raw = getattr(attn_metadata, "full_attn_spans", None) if attn_metadata is not None else None
        if spans_raw != entry.spans_snapshot or attn_metadata is None or spans_raw is None:
            entry = None  # the full path decides (and refuses spans that changed)
        else:
            spans_from_metadata(attn_metadata)  # a new metadata object: its fields are checked
            entry.metadata = attn_metadata
    elif (
        entry is not None
        and entry.spans_snapshot is not None
        and getattr(attn_metadata, "full_attn_spans", None) != entry.spans_snapshot
    ):
        entry = None  # the same object, its spans changed in place
    if entry is None:
        return _build_layer_context(
            state, translator, layer, query, key, value, attn_metadata, sig, packed_query=packed_query
        )
    per_layer = entry.by_layer.get(layer.layer_name)
    if per_layer is None:
        per_layer = entry.by_layer[layer.layer_name] = _layer_metadata(state, translator, layer, entry.plan)
    slot_mapping, native, segment_metadata = per_layer
    H, D = layer.num_heads, layer.head_size
    q = query.reshape(-1, H, D)
    k = (key.detach() if key.requires_grad else key).reshape(-1, layer.num_kv_heads, D)
    v = (value.detach() if value.requires_grad else value).reshape(-1, layer.num_kv_heads, D)
    scatter = entry.scatter
    if scatter is not None:
        q, k, v = q.index_select(0, scatter), k.index_select(0, scatter), v.index_select(0, scatter)
    return LayerContext(
        layer=layer,
        query=q if packed_query and _inner_packed(q) else q.contiguous(),
        key=k.contiguous() if entry.contiguous_k else k,
        value=v.contiguous() if entry.contiguous_v else v,
        slot_mapping=slot_mapping,
        native_metadata=native,
        plan=entry.plan,
        segment_metadata=segment_metadata,
        token_shape=entry.token_shape,
        has_head_dims=entry.has_head_dims,
        scatter_indices=scatter,
        slots_valid=state.batch.slots_valid,
    )


def _layer_metadata(
    state: Any, translator: Translator, layer: LayerGeometry, plan: PiecewisePlan | None
) -> tuple[torch.Tensor, Any, tuple[Any, ...]]:
    batch = state.batch
    try:
        slot_mapping = batch.slot_mappings_by_layer[layer.layer_name]
        native = batch.attn_metadata[layer.layer_name]
    except KeyError:
        raise ValidationError(f"no paged metadata was built for layer {layer.layer_name!r}") from None
    segment_metadata: tuple[Any, ...] = ()
    if plan is not None:
        try:
            segment_metadata = tuple(md[layer.layer_name] for md in translator.segment_metadata(plan))
        except KeyError:
            raise ValidationError(f"no piecewise metadata was built for layer {layer.layer_name!r}") from None
    return slot_mapping, native, segment_metadata


def _build_layer_context(
    state: Any,
    translator: Translator,
    layer: LayerGeometry,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_metadata: Any | None = None,
    sig: tuple[Any, ...] | None = None,
    *,
    packed_query: bool = False,
) -> LayerContext:
    """Every check, then the decisions recorded under ``sig`` for the batch's later layers."""
    batch = state.batch
    spans = spans_from_metadata(attn_metadata)
    q, q_shape, has_heads = _flatten(query, layer.num_heads, layer.head_size, "query")
    # The cache never joins autograd: what is written is detached (no grad path, no activations
    # kept alive through the cache); the output's gradient reaches the query only.
    k, _, _ = _flatten(_detached(key), layer.num_kv_heads, layer.head_size, "key", q_shape)
    v, _, _ = _flatten(_detached(value), layer.num_kv_heads, layer.head_size, "value", q_shape)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device != translator.device:
            raise ValidationError(f"paged attention {name} must be on {translator.device}; got {t.device}")
        if t.dtype != layer.dtype:
            raise ValidationError(
                f"paged attention {name} dtype must be {layer.dtype} (layer {layer.layer_name!r}); got {t.dtype}"
            )
    scatter: torch.Tensor | None = None
    if len(q_shape) == 1:
        if q_shape[0] != batch.num_tokens:
            raise ValidationError(
                f"paged attention token count {q_shape[0]} must match the prepared batch's {batch.num_tokens}"
            )
    elif len(q_shape) == 2:
        rows, per_row = q_shape
        lens = batch.query_lens
        if rows != len(lens) or any(n > per_row for n in lens):
            raise ValidationError(
                f"batched layout {q_shape} must be [rows={len(lens)}, L >= every query_len]; query_lens={lens}"
            )
        if any(n != per_row for n in lens):
            scatter = translator.packing_indices(per_row)
            q, k, v = q.index_select(0, scatter), k.index_select(0, scatter), v.index_select(0, scatter)
    else:
        raise ValidationError(
            f"paged attention takes packed [T, ...] or batched [B, L, ...] tokens; got token shape {q_shape}"
        )
    causal = layer.mode.is_causal
    if causal:
        not_suffix = [r.identity for r in batch.rows if not r.is_suffix]
        if not_suffix:
            raise ValidationError(
                f"causal paged attention needs every query span to end at seq_len; invalid rows={not_suffix!r}"
            )
    plan = None
    if spans is not None and not layer.mask.spans:
        raise UnsupportedFeatureError(
            f"full_attn_spans cannot refine layer {layer.layer_name!r} of mask {layer.mask.describe()}; "
            f"spans refine plain {' and '.join(m.name for m in AttentionMode if m.accepts_spans)} layers "
            "that do not declare spans=False"
        )
    # spans describe the row's mask whatever the layer declares (vLLM-Omni's semantics: causal
    # outside the spans, full inside); without spans a full layer sees every key
    if spans is not None:
        plan = translator.piecewise_plan(spans)
    slot_mapping, native, segment_metadata = _layer_metadata(state, translator, layer, plan)
    contiguous_k, contiguous_v = not _inner_packed(k), not _inner_packed(v)
    if contiguous_k:
        k = k.contiguous()
    if contiguous_v:
        v = v.contiguous()
    if sig is not None:
        raw = getattr(attn_metadata, "full_attn_spans", None) if attn_metadata is not None else None
        state.layer_plans[sig] = _LayerPlan(
            token_shape=q_shape,
            has_head_dims=has_heads,
            scatter=scatter,
            contiguous_k=contiguous_k,
            contiguous_v=contiguous_v,
            metadata=attn_metadata,
            spans_snapshot=copy.deepcopy(raw) if raw is not None else None,
            plan=plan,
            by_layer={layer.layer_name: (slot_mapping, native, segment_metadata)},
        )
    return LayerContext(
        layer=layer,
        query=q if packed_query and _inner_packed(q) else q.contiguous(),
        key=k,
        value=v,
        slot_mapping=slot_mapping,
        native_metadata=native,
        plan=plan,
        segment_metadata=segment_metadata,
        token_shape=q_shape,
        has_head_dims=has_heads,
        scatter_indices=scatter,
        slots_valid=batch.slots_valid,
    )

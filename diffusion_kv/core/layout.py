"""Cache layout description: KV-cache groups, their attention spec, and worker capacities.

The layout is what a worker needs to know about its paged KV cache before anything is
allocated. It mirrors vLLM's ``KVCacheConfig`` (``num_blocks`` plus ``kv_cache_groups``, each
with ``layer_names`` and a ``kv_cache_spec``) so vLLM-Omni can hand its own config in:
:meth:`CacheLayout.from_kv_cache_config` reads any object with those attribute names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_kv.core.attention import AttentionMode, MaskSpec
from diffusion_kv.core.errors import UnknownLayerError, ValidationError


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest ``floor * 2**k`` (``k >= 0``) at or above ``n``: a power of two for a
    power-of-two ``floor`` (bucketed sizes: tile rows, graph maxima)."""
    size = floor
    while size < n:
        size *= 2
    return size


def _positive_int(value: object, what: str) -> int:
    if type(value) is not int or value <= 0:
        raise ValidationError(f"{what} must be a positive integer; got {value!r}")
    return value


@dataclass(frozen=True)
class AttentionSpec:
    """The KV-cache spec of one cache group (vLLM's ``AttentionSpec``): the per-layer KV shape
    every layer of the group shares (rank-local heads), and the group's mask -- the unit of
    cache policy: a mask with a window releases what slides out of it (``MaskSpec.retention``)."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    mode: AttentionMode = AttentionMode.CAUSAL
    """The mask's kind, CAUSAL, FULL or CHUNK_CAUSAL (vLLM's ``non_causal`` reads as FULL);
    always ``mask.kind``."""
    cache_dtype: torch.dtype | None = None
    """The pages' dtype when it differs from ``dtype`` (fp8_e4m3); None: ``dtype``."""
    mask: MaskSpec = field(default=None)  # type: ignore[assignment]
    """The group's mask (None at construction: the plain mask of ``mode``)."""

    def __post_init__(self) -> None:
        if self.mask is None:
            if (
                isinstance(self.mode, AttentionMode)
                and self.mode.is_layer_mode
                and self.mode is not AttentionMode.CHUNK_CAUSAL
            ):
                object.__setattr__(self, "mask", MaskSpec.of(self.mode))
        elif not isinstance(self.mask, MaskSpec):
            raise ValidationError(f"AttentionSpec.mask must be a MaskSpec; got {self.mask!r}")
        elif self.mode is not self.mask.kind:
            if self.mode is not AttentionMode.CAUSAL:
                raise ValidationError(
                    f"AttentionSpec.mode {self.mode!r} disagrees with its mask {self.mask.describe()}"
                )
            object.__setattr__(self, "mode", self.mask.kind)
        if self.cache_dtype is not None and not isinstance(self.cache_dtype, torch.dtype):
            raise ValidationError(
                f"AttentionSpec.cache_dtype must be a torch.dtype or None; got {self.cache_dtype!r}"
            )
        _positive_int(self.num_kv_heads, "AttentionSpec.num_kv_heads")
        _positive_int(self.head_size, "AttentionSpec.head_size")
        if not isinstance(self.dtype, torch.dtype):
            raise ValidationError(f"AttentionSpec.dtype must be a torch.dtype; got {self.dtype!r}")
        if not isinstance(self.mode, AttentionMode) or not self.mode.is_layer_mode:
            raise ValidationError(
                f"AttentionSpec.mode must be {AttentionMode.layer_modes_text()}; got {self.mode!r}"
            )
        if self.mask is None:
            raise ValidationError(
                "AttentionSpec of mode CHUNK_CAUSAL needs its mask (a MaskSpec with the chunk size)"
            )

    def bytes_per_token(self) -> int:
        """Bytes one token occupies in the cache (K and V), in the cache dtype."""
        itemsize = torch.empty((), dtype=self.cache_dtype or self.dtype).element_size()
        return 2 * self.num_kv_heads * self.head_size * itemsize


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (one block size, one spec)."""

    block_size: int
    layer_names: tuple[str, ...]
    spec: AttentionSpec

    def __post_init__(self) -> None:
        _positive_int(self.block_size, "KVCacheGroup.block_size")
        if isinstance(self.layer_names, (str, bytes)) or not isinstance(self.layer_names, (tuple, list)):
            raise ValidationError(
                f"KVCacheGroup.layer_names must be a tuple of layer names; got {type(self.layer_names).__name__} "
                f"{self.layer_names!r}"
            )
        if not isinstance(self.spec, AttentionSpec):
            raise ValidationError(
                f"KVCacheGroup.spec must be an AttentionSpec; got {type(self.spec).__name__}"
            )
        names = tuple(self.layer_names)
        if not names:
            raise ValidationError("KVCacheGroup.layer_names must name at least one layer")
        if any(type(n) is not str or not n for n in names):
            raise ValidationError(f"KVCacheGroup.layer_names must be non-empty strings; got {names!r}")
        if len(set(names)) != len(names):
            raise ValidationError(f"KVCacheGroup.layer_names contains duplicates: {names!r}")
        object.__setattr__(self, "layer_names", names)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a row of ``num_tokens`` tokens occupies in this group."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class CacheLayout:
    """Everything a worker needs to size its BlockTables and KV cache.

    ``max_num_reqs`` is the number of worker rows: ``max_num_seqs * max_rows_per_request``
    (a public diffusion request can occupy several sequence and context rows).
    """

    groups: tuple[KVCacheGroup, ...]
    num_blocks: int
    max_model_len: int
    max_rows_per_request: int
    max_num_seqs: int
    max_num_batched_tokens: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.groups, (tuple, list)):
            raise ValidationError(
                f"CacheLayout.groups must be a tuple of KVCacheGroup; got {type(self.groups).__name__}"
            )
        groups = tuple(self.groups)
        if not groups:
            raise ValidationError("CacheLayout requires at least one KV-cache group")
        if any(not isinstance(g, KVCacheGroup) for g in groups):
            raise ValidationError("CacheLayout.groups must hold KVCacheGroup records")
        seen: set[str] = set()
        for g in groups:
            dup = seen.intersection(g.layer_names)
            if dup:
                raise ValidationError(f"layer(s) {sorted(dup)} appear in more than one KV-cache group")
            seen.update(g.layer_names)
        object.__setattr__(self, "groups", groups)
        _positive_int(self.num_blocks, "CacheLayout.num_blocks")
        _positive_int(self.max_model_len, "CacheLayout.max_model_len")
        _positive_int(self.max_rows_per_request, "CacheLayout.max_rows_per_request")
        _positive_int(self.max_num_seqs, "CacheLayout.max_num_seqs")
        _positive_int(self.max_num_batched_tokens, "CacheLayout.max_num_batched_tokens")

    @property
    def max_num_reqs(self) -> int:
        return self.max_num_seqs * self.max_rows_per_request

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in g.layer_names)

    @property
    def block_sizes(self) -> list[int]:
        return [g.block_size for g in self.groups]

    def group_of(self, layer_name: str) -> int:
        for index, g in enumerate(self.groups):
            if layer_name in g.layer_names:
                return index
        raise UnknownLayerError(f"layer {layer_name!r} is not in any KV-cache group")

    def max_blocks_per_row(self) -> list[int]:
        """Blocks a row at ``max_model_len`` occupies, per group."""
        return [g.blocks_for_tokens(self.max_model_len) for g in self.groups]

    @classmethod
    def from_kv_cache_config(
        cls,
        config: Any,
        *,
        max_model_len: int,
        max_rows_per_request: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> CacheLayout:
        """Read a vLLM ``KVCacheConfig``-shaped object (duck typed on attribute names).

        Each ``config.kv_cache_groups[i]`` needs ``layer_names`` and ``kv_cache_spec`` with
        ``block_size``, ``num_kv_heads``, ``head_size``, ``dtype`` and optionally
        ``non_causal``.
        """
        try:
            raw_groups = list(config.kv_cache_groups)
            num_blocks = config.num_blocks
        except AttributeError as exc:
            raise ValidationError(
                f"{type(config).__name__} is not KVCacheConfig-shaped: {exc}; expected attributes "
                "'num_blocks' and 'kv_cache_groups'"
            ) from exc
        groups: list[KVCacheGroup] = []
        for index, raw in enumerate(raw_groups):
            try:
                spec = raw.kv_cache_spec
                attn = AttentionSpec(
                    num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size,
                    dtype=spec.dtype,
                    mode=AttentionMode.FULL if getattr(spec, "non_causal", False) else AttentionMode.CAUSAL,
                )
                groups.append(KVCacheGroup(spec.block_size, tuple(raw.layer_names), attn))
            except AttributeError as exc:
                raise ValidationError(
                    f"KV-cache group {index} is not KVCacheGroupSpec-shaped: {exc}"
                ) from exc
        return cls(
            groups=tuple(groups),
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            max_rows_per_request=max_rows_per_request,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )


def single_group_layout(
    layer_names: Sequence[str],
    *,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    max_rows_per_request: int = 2,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int | None = None,
    mode: AttentionMode = AttentionMode.CAUSAL,
) -> CacheLayout:
    """Convenience constructor for the common one-group case."""
    spec = AttentionSpec(num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, mode=mode)
    return CacheLayout(
        groups=(KVCacheGroup(block_size, tuple(layer_names), spec),),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_rows_per_request=max_rows_per_request,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=(
            max_num_batched_tokens
            if max_num_batched_tokens is not None
            else max_model_len * max_rows_per_request * max_num_seqs
        ),
    )

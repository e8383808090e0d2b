"""What a paged backend can do, declared as data, and what a caller needs from it.

:class:`Capabilities` is a backend's declaration; :class:`Requirements` is what a set of layers
(or a caller) needs; :func:`capability_reasons` lists every reason the first cannot serve the
second. The same data drives backend selection, ``explain()``, the ``diffusion-kv platforms``
table and which conformance cases run, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from diffusion_kv.core.attention.mode import BASE_MODES, AttentionMode
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.kv_quant import is_unquantised

__all__ = [
    "BASE_MODES",
    "AttentionMode",
    "Availability",
    "BlockSizeRule",
    "Capabilities",
    "MultipleOf",
    "Requirements",
    "capability_reasons",
    "dtype_name",
]


@dataclass(frozen=True)
class MultipleOf:
    """A kernel block size rule: any positive multiple of ``base``."""

    base: int

    def __post_init__(self) -> None:
        if type(self.base) is not int or self.base <= 0:
            raise ValueError(f"MultipleOf.base must be a positive integer; got {self.base!r}")

    def __str__(self) -> str:
        return f"multiple of {self.base}"


BlockSizeRule = int | MultipleOf


@dataclass(frozen=True)
class Availability:
    """Whether something can run here, always with a human-readable reason."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Capabilities:
    """What one paged backend supports. ``None`` in a limit means "no limit".

    ``kernel_block_sizes`` are the block sizes the kernel addresses. A scheduler block size the
    kernel does not take directly is still served when one of them divides it: the BlockTables
    then splits every scheduler block into kernel blocks (vLLM's ``kernel_block_sizes``).
    """

    dtypes: frozenset[torch.dtype]
    head_sizes: frozenset[int] | None
    kernel_block_sizes: tuple[BlockSizeRule, ...]
    slot_mapping_dtypes: frozenset[torch.dtype] = frozenset({torch.int64})
    attention_modes: frozenset[AttentionMode] = BASE_MODES
    supports_gqa: bool = True
    supports_ulysses: bool = False
    """Strict Ulysses: the backend has been checked with rank-local heads (the core does the
    all-to-all); off unless declared."""
    supports_dcp: bool = False
    """Decode context parallelism: the backend implements ``forward_partial``."""
    supports_graph_capture: bool = False
    max_rows_per_call: int | None = None
    max_kv_heads_x_head_size: int | None = None
    max_gqa_ratio: int | None = None
    kv_cache_dtypes: frozenset[torch.dtype] = frozenset()
    """Cache dtypes served besides the compute dtype (``torch.float8_e4m3fn``: pages quantised
    with per-KV-head scales, ``diffusion_kv.core.kv_quant``); empty: pages hold the compute dtype
    only, and a layer asking for another cache dtype is refused with that reason."""
    max_window: int | None = 0
    """Largest sliding window (tokens, ``MaskSpec.window``) served; 0: no windowed mask;
    None: any. A backend serving a window reads the batch's block plan (``PagedBatch.block_plan``)
    and never the skipped blocks, whose table entries may be the null entry."""
    max_sink: int | None = 0
    """Largest sink (leading tokens every query sees, ``MaskSpec.sink``) served; 0: none; None: any."""
    supports_live_from: bool = False
    """Rows that skip keys past the sink (``PagedRow.live_from``, a session's re-cache after its
    window slid): the backend masks with ``BlockPlan.row_mask(row, ...)``. Rows declaring one
    are refused on a group whose backend does not."""

    def problems(self) -> list[str]:
        """Every way this declaration is malformed (empty when it is well formed)."""
        out: list[str] = []
        if not isinstance(self.dtypes, frozenset) or not self.dtypes:
            out.append("dtypes must be a non-empty frozenset of torch.dtype")
        elif any(not isinstance(d, torch.dtype) for d in self.dtypes):
            out.append(f"dtypes must hold torch.dtype values; got {sorted(map(str, self.dtypes))}")
        if self.head_sizes is not None and (
            not isinstance(self.head_sizes, frozenset)
            or not self.head_sizes
            or any(type(h) is not int or h <= 0 for h in self.head_sizes)
        ):
            out.append(
                f"head_sizes must be None or a non-empty frozenset of positive ints; got {self.head_sizes!r}"
            )
        if not isinstance(self.kernel_block_sizes, tuple) or not self.kernel_block_sizes:
            out.append("kernel_block_sizes must be a non-empty tuple of ints or MultipleOf")
        else:
            for rule in self.kernel_block_sizes:
                if not (isinstance(rule, MultipleOf) or (type(rule) is int and rule > 0)):
                    out.append(f"kernel_block_sizes entry {rule!r} is neither a positive int nor MultipleOf")
        if (
            not isinstance(self.slot_mapping_dtypes, frozenset)
            or not self.slot_mapping_dtypes
            or not self.slot_mapping_dtypes <= {torch.int32, torch.int64}
        ):
            out.append(
                f"slot_mapping_dtypes must be a non-empty frozenset of torch.int32/torch.int64; "
                f"got {self.slot_mapping_dtypes!r}"
            )
        if not isinstance(self.attention_modes, frozenset) or not self.attention_modes:
            out.append("attention_modes must be a non-empty frozenset of AttentionMode")
        elif any(not isinstance(m, AttentionMode) for m in self.attention_modes):
            out.append(f"attention_modes must hold AttentionMode values; got {self.attention_modes!r}")
        elif (
            AttentionMode.PIECEWISE in self.attention_modes
            and not {
                AttentionMode.CAUSAL,
                AttentionMode.FULL,
            }
            <= self.attention_modes
        ):
            out.append("attention_modes: piecewise runs as causal and full calls; declare both")
        for name in (
            "supports_gqa",
            "supports_ulysses",
            "supports_dcp",
            "supports_graph_capture",
            "supports_live_from",
        ):
            if type(getattr(self, name)) is not bool:
                out.append(f"{name} must be a bool; got {getattr(self, name)!r}")
        if not isinstance(self.kv_cache_dtypes, frozenset) or any(
            not isinstance(d, torch.dtype) for d in self.kv_cache_dtypes
        ):
            out.append(f"kv_cache_dtypes must be a frozenset of torch.dtype; got {self.kv_cache_dtypes!r}")
        for name in ("max_rows_per_call", "max_kv_heads_x_head_size", "max_gqa_ratio"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                out.append(f"{name} must be None or a positive int; got {value!r}")
        for name in ("max_window", "max_sink"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                out.append(f"{name} must be None or an int >= 0; got {value!r}")
        return out

    def kernel_block_size_for(self, block_size: int) -> int | None:
        """The kernel block size serving scheduler blocks of ``block_size`` (itself when the
        kernel takes it, else the largest declared fixed size dividing it), or None."""
        if type(block_size) is not int or block_size <= 0:
            return None
        best: int | None = None
        for rule in self.kernel_block_sizes:
            if isinstance(rule, MultipleOf):
                if block_size % rule.base == 0:
                    return block_size
            elif rule == block_size:
                return block_size
            elif block_size % rule == 0 and (best is None or rule > best):
                best = rule
        return best

    def supports_block_size(self, block_size: int) -> bool:
        return self.kernel_block_size_for(block_size) is not None

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly view (``diffusion-kv platforms --json``)."""
        return {
            "dtypes": sorted(dtype_name(d) for d in self.dtypes),
            "head_sizes": sorted(self.head_sizes) if self.head_sizes is not None else "any",
            "kernel_block_sizes": [str(r) for r in self.kernel_block_sizes],
            "slot_mapping_dtypes": sorted(dtype_name(d) for d in self.slot_mapping_dtypes),
            "attention_modes": sorted(m.value for m in self.attention_modes),
            "gqa": self.supports_gqa,
            "ulysses": self.supports_ulysses,
            "dcp": self.supports_dcp,
            "graph_capture": self.supports_graph_capture,
            "max_rows_per_call": self.max_rows_per_call,
            "max_kv_heads_x_head_size": self.max_kv_heads_x_head_size,
            "max_gqa_ratio": self.max_gqa_ratio,
            "kv_cache_dtypes": ["auto", *sorted(_cache_name(d) for d in self.kv_cache_dtypes)],
            "max_window": self.max_window,
            "max_sink": self.max_sink,
            "live_from": self.supports_live_from,
        }

    @staticmethod
    def union(parts: list[Capabilities]) -> Capabilities:
        """What a set of backends covers together (a platform's view, for display and coarse
        checks; whether one backend serves a combination is always asked of the backends)."""
        if not parts:
            raise ValueError("a union of capabilities needs at least one part")
        heads = (
            None
            if any(p.head_sizes is None for p in parts)
            else frozenset().union(*(p.head_sizes or () for p in parts))
        )
        rules: list[BlockSizeRule] = []
        for p in parts:
            rules.extend(r for r in p.kernel_block_sizes if r not in rules)

        def loosest(name: str) -> int | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else max(values)

        return Capabilities(
            dtypes=frozenset().union(*(p.dtypes for p in parts)),
            head_sizes=heads,
            kernel_block_sizes=tuple(rules),
            slot_mapping_dtypes=frozenset().union(*(p.slot_mapping_dtypes for p in parts)),
            attention_modes=frozenset().union(*(p.attention_modes for p in parts)),
            supports_gqa=any(p.supports_gqa for p in parts),
            supports_ulysses=any(p.supports_ulysses for p in parts),
            supports_dcp=any(p.supports_dcp for p in parts),
            supports_graph_capture=any(p.supports_graph_capture for p in parts),
            max_rows_per_call=loosest("max_rows_per_call"),
            max_kv_heads_x_head_size=loosest("max_kv_heads_x_head_size"),
            max_gqa_ratio=loosest("max_gqa_ratio"),
            kv_cache_dtypes=frozenset().union(*(p.kv_cache_dtypes for p in parts)),
            max_window=loosest("max_window"),
            max_sink=loosest("max_sink"),
            supports_live_from=any(p.supports_live_from for p in parts),
        )


@dataclass(frozen=True)
class Requirements:
    """What a caller needs from a backend. ``None`` fields are not checked."""

    dtype: torch.dtype | None = None
    head_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    block_size: int | None = None
    attention_modes: frozenset[AttentionMode] = field(default_factory=frozenset)
    ulysses_degree: int = 1
    dcp_size: int = 1
    num_rows: int | None = None
    graph_capture: bool = False
    kv_cache_dtype: torch.dtype | None = None
    """The pages' dtype when it differs from ``dtype`` (None: the same)."""
    window: int | None = None
    """A sliding window the mask has (tokens; ``MaskSpec.window``), None: none."""
    sink: int = 0
    """Sink tokens the mask has (``MaskSpec.sink``)."""
    chunk: int | None = None
    """Tokens per chunk of a CHUNK_CAUSAL mask (``MaskSpec.chunk``), None: none. Capabilities
    have no field for it; a backend whose kernel needs chunk boundaries on its pages checks it
    in ``not_supported_reasons``."""

    def __post_init__(self) -> None:
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValidationError(f"Requirements.dtype must be a torch.dtype or None; got {self.dtype!r}")
        if self.kv_cache_dtype is not None and not isinstance(self.kv_cache_dtype, torch.dtype):
            raise ValidationError(
                f"Requirements.kv_cache_dtype must be a torch.dtype or None; got {self.kv_cache_dtype!r}"
            )
        for name in ("head_size", "num_heads", "num_kv_heads", "block_size", "num_rows"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ValidationError(f"Requirements.{name} must be a positive int or None; got {value!r}")
        for name in ("ulysses_degree", "dcp_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValidationError(f"Requirements.{name} must be a positive int; got {value!r}")
        modes = self.attention_modes
        if isinstance(modes, (str, bytes)) or not isinstance(modes, (set, frozenset, tuple, list)):
            raise ValidationError(
                f"Requirements.attention_modes must be a set of AttentionMode; got {type(modes).__name__} {modes!r}"
            )
        if any(not isinstance(m, AttentionMode) for m in modes):
            raise ValidationError(
                f"Requirements.attention_modes must hold AttentionMode values; got {modes!r}"
            )
        object.__setattr__(self, "attention_modes", frozenset(modes))
        if type(self.graph_capture) is not bool:
            raise ValidationError(f"Requirements.graph_capture must be a bool; got {self.graph_capture!r}")
        if self.window is not None and (type(self.window) is not int or self.window <= 0):
            raise ValidationError(f"Requirements.window must be a positive int or None; got {self.window!r}")
        if type(self.sink) is not int or self.sink < 0:
            raise ValidationError(f"Requirements.sink must be an int >= 0; got {self.sink!r}")
        if self.chunk is not None and (type(self.chunk) is not int or self.chunk <= 0):
            raise ValidationError(f"Requirements.chunk must be a positive int or None; got {self.chunk!r}")

    def describe(self) -> str:
        """The non-default fields, e.g. ``dtype=float16, head_size=128``."""
        defaults = Requirements()
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == getattr(defaults, f.name):
                continue
            if f.name == "attention_modes":
                parts.append(f"attention_modes={sorted(m.value for m in value)}")
            elif isinstance(value, torch.dtype):
                parts.append(f"{f.name}={dtype_name(value)}")
            else:
                parts.append(f"{f.name}={value}")
        return ", ".join(parts) if parts else "(none)"


def _cache_name(dtype: torch.dtype) -> str:
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else dtype_name(dtype)


def capability_reasons(caps: Capabilities, req: Requirements) -> list[str]:
    """Every reason ``caps`` cannot serve ``req`` (empty list: supported)."""
    reasons: list[str] = []
    if req.dtype is not None and req.dtype not in caps.dtypes:
        reasons.append(
            f"dtype={dtype_name(req.dtype)} (supported: {sorted(dtype_name(d) for d in caps.dtypes)})"
        )
    if not is_unquantised(req.kv_cache_dtype, req.dtype) and req.kv_cache_dtype not in caps.kv_cache_dtypes:
        served = sorted(_cache_name(d) for d in caps.kv_cache_dtypes)
        assert req.kv_cache_dtype is not None  # unquantised otherwise
        reasons.append(
            f"kv_cache_dtype={_cache_name(req.kv_cache_dtype)} (pages hold the compute dtype"
            + (f" or {', '.join(served)})" if served else " only)")
        )
    if req.head_size is not None and caps.head_sizes is not None and req.head_size not in caps.head_sizes:
        reasons.append(f"head_size={req.head_size} (supported: {sorted(caps.head_sizes)})")
    if req.block_size is not None and not caps.supports_block_size(req.block_size):
        reasons.append(
            f"block_size={req.block_size} (kernel blocks: {', '.join(str(r) for r in caps.kernel_block_sizes)}; "
            "none equals or divides it)"
        )
    missing = sorted(m.value for m in req.attention_modes - caps.attention_modes)
    if missing:
        reasons.append(
            f"attention mode(s) {missing} (supported: {sorted(m.value for m in caps.attention_modes)})"
        )
    if req.num_heads is not None and req.num_kv_heads is not None:
        if req.num_kv_heads <= 0 or req.num_heads % req.num_kv_heads != 0:
            reasons.append(f"num_heads={req.num_heads} is not a multiple of num_kv_heads={req.num_kv_heads}")
        elif req.num_heads != req.num_kv_heads:
            ratio = req.num_heads // req.num_kv_heads
            if not caps.supports_gqa:
                reasons.append(
                    f"grouped-query attention (num_heads={req.num_heads}, num_kv_heads={req.num_kv_heads})"
                )
            elif caps.max_gqa_ratio is not None and ratio > caps.max_gqa_ratio:
                reasons.append(f"GQA ratio {ratio} exceeds {caps.max_gqa_ratio}")
    if (
        req.num_kv_heads is not None
        and req.head_size is not None
        and caps.max_kv_heads_x_head_size is not None
        and req.num_kv_heads * req.head_size > caps.max_kv_heads_x_head_size
    ):
        reasons.append(
            f"num_kv_heads*head_size={req.num_kv_heads * req.head_size} exceeds {caps.max_kv_heads_x_head_size}"
        )
    if req.ulysses_degree > 1 and not caps.supports_ulysses:
        reasons.append(f"Ulysses sequence parallelism (degree {req.ulysses_degree})")
    if req.dcp_size > 1 and not caps.supports_dcp:
        reasons.append(f"decode context parallelism (cp_size {req.dcp_size})")
    if (
        req.num_rows is not None
        and caps.max_rows_per_call is not None
        and req.num_rows > caps.max_rows_per_call
    ):
        reasons.append(f"num_rows={req.num_rows} exceeds {caps.max_rows_per_call} rows per call")
    if req.graph_capture and not caps.supports_graph_capture:
        reasons.append("graph capture")
    for name, needed in (("window", req.window), ("sink", req.sink)):
        limit = getattr(caps, f"max_{name}")
        if needed and limit is not None and needed > limit:
            limit_text = f"up to {limit} tokens" if limit else "none"
            reasons.append(f"{name}={needed} tokens (served: {limit_text})")
    return reasons

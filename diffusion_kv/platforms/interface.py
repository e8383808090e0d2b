"""The plugin contract: one :class:`Platform` class per hardware platform.

A platform plugin is a subclass of :class:`Platform` registered under the entry-point group
``diffusion_kv.platforms``. It declares what it can do as data (:class:`Capabilities`),
answers :meth:`Platform.is_available` with a reason, lists every reason it cannot serve a set
of :class:`Requirements`, and supplies four parts:

1. a BlockTables class (:meth:`Platform.block_tables_cls`, protocol in
   :mod:`diffusion_kv.core.block_tables`);
2. a metadata builder (:meth:`Platform.metadata_builder`, :class:`MetadataBuilder`);
3. a KV-write policy (:attr:`Platform.kv_write_policy`, :class:`KVWritePolicy`);
4. a paged attention backend (:meth:`Platform.paged_backend`, :class:`PagedAttentionBackend`);

plus KV-cache allocation (:meth:`Platform.kv_cache_shape`, :meth:`Platform.allocate_kv_cache`)
and geometry defaults (:attr:`Platform.default_block_size`). Vendor imports belong inside the
methods, never at module import time, so that discovery stays cheap and safe everywhere.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from diffusion_kv.core.batch import (
    CommonBatchMetadata,
    KVCache,
    KVWritePolicy,
    LayerGeometry,
    MetadataBuilder,
    PagedAttentionBackend,
)
from diffusion_kv.core.block_tables import BlockTables
from diffusion_kv.core.layout import CacheLayout

__all__ = [
    "REQUIRED_ATTRIBUTES",
    "REQUIRED_MEMBERS",
    "AttentionMode",
    "Availability",
    "BlockSizeRule",
    "Capabilities",
    "CommonBatchMetadata",
    "KVCache",
    "KVWritePolicy",
    "LayerGeometry",
    "MetadataBuilder",
    "MultipleOf",
    "PagedAttentionBackend",
    "Platform",
    "Requirements",
    "capability_reasons",
]


class AttentionMode(enum.Enum):
    CAUSAL = "causal"
    """Bottom-right aligned causal mask over the row's keys."""
    FULL = "full"
    """Every query token sees every key of the row."""
    PIECEWISE = "piecewise"
    """Causal with bidirectional ``full_attn_spans`` (several native calls per layer)."""


@dataclass(frozen=True)
class MultipleOf:
    """A kernel block size constraint: any positive multiple of ``base``."""

    base: int

    def __post_init__(self) -> None:
        if type(self.base) is not int or self.base <= 0:
            raise ValueError(f"MultipleOf.base must be a positive integer; got {self.base!r}")

    def __str__(self) -> str:
        return f"multiple of {self.base}"


BlockSizeRule = int | MultipleOf


@dataclass(frozen=True)
class Availability:
    """Whether a platform can run here, always with a human-readable reason."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class Capabilities:
    """What a platform (or one backend of it) supports, declared as data.

    ``None`` in a limit means "no limit". The same data drives selection, the
    ``diffusion-kv platforms`` table and which conformance cases run.
    """

    device_type: str
    dtypes: frozenset[torch.dtype]
    head_sizes: frozenset[int] | None
    kernel_block_sizes: tuple[BlockSizeRule, ...]
    slot_mapping_dtype: torch.dtype
    attention_modes: frozenset[AttentionMode]
    supports_gqa: bool = True
    supports_ulysses: bool = True
    supports_dcp: bool = False
    needs_host_lengths: bool = False
    supports_graph_capture: bool = False
    max_rows_per_call: int | None = None
    max_kv_heads_x_head_size: int | None = None
    max_gqa_ratio: int | None = None

    def problems(self) -> list[str]:
        """Every way this declaration is malformed (empty when it is well formed)."""
        out: list[str] = []
        if type(self.device_type) is not str or not self.device_type:
            out.append(f"device_type must be a non-empty string; got {self.device_type!r}")
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
        if self.slot_mapping_dtype not in (torch.int32, torch.int64):
            out.append(
                f"slot_mapping_dtype must be torch.int32 or torch.int64; got {self.slot_mapping_dtype!r}"
            )
        if not isinstance(self.attention_modes, frozenset) or not self.attention_modes:
            out.append("attention_modes must be a non-empty frozenset of AttentionMode")
        elif any(not isinstance(m, AttentionMode) for m in self.attention_modes):
            out.append(f"attention_modes must hold AttentionMode values; got {self.attention_modes!r}")
        for name in (
            "supports_gqa",
            "supports_ulysses",
            "supports_dcp",
            "needs_host_lengths",
            "supports_graph_capture",
        ):
            if type(getattr(self, name)) is not bool:
                out.append(f"{name} must be a bool; got {getattr(self, name)!r}")
        for name in ("max_rows_per_call", "max_kv_heads_x_head_size", "max_gqa_ratio"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                out.append(f"{name} must be None or a positive int; got {value!r}")
        return out

    def supports_block_size(self, block_size: int) -> bool:
        return any(
            (rule.base > 0 and block_size % rule.base == 0)
            if isinstance(rule, MultipleOf)
            else block_size == rule
            for rule in self.kernel_block_sizes
        )

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly view (used by ``diffusion-kv platforms --json``)."""
        return {
            "device_type": self.device_type,
            "dtypes": sorted(str(d).removeprefix("torch.") for d in self.dtypes),
            "head_sizes": sorted(self.head_sizes) if self.head_sizes is not None else "any",
            "kernel_block_sizes": [str(r) for r in self.kernel_block_sizes],
            "slot_mapping_dtype": str(self.slot_mapping_dtype).removeprefix("torch."),
            "attention_modes": sorted(m.value for m in self.attention_modes),
            "gqa": self.supports_gqa,
            "ulysses": self.supports_ulysses,
            "dcp": self.supports_dcp,
            "host_lengths": self.needs_host_lengths,
            "graph_capture": self.supports_graph_capture,
            "max_rows_per_call": self.max_rows_per_call,
            "max_kv_heads_x_head_size": self.max_kv_heads_x_head_size,
            "max_gqa_ratio": self.max_gqa_ratio,
        }


@dataclass(frozen=True)
class Requirements:
    """What a caller needs from a platform. ``None`` fields are not checked."""

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
                parts.append(f"{f.name}={str(value).removeprefix('torch.')}")
            else:
                parts.append(f"{f.name}={value}")
        return ", ".join(parts) if parts else "(none)"


def capability_reasons(caps: Capabilities, req: Requirements) -> list[str]:
    """Every reason ``caps`` cannot serve ``req`` (empty list: supported)."""
    reasons: list[str] = []
    if req.dtype is not None and req.dtype not in caps.dtypes:
        supported = sorted(str(d).removeprefix("torch.") for d in caps.dtypes)
        reasons.append(f"dtype={str(req.dtype).removeprefix('torch.')} (supported: {supported})")
    if req.head_size is not None and caps.head_sizes is not None and req.head_size not in caps.head_sizes:
        reasons.append(f"head_size={req.head_size} (supported: {sorted(caps.head_sizes)})")
    if req.block_size is not None and not caps.supports_block_size(req.block_size):
        reasons.append(
            f"block_size={req.block_size} (supported: {', '.join(str(r) for r in caps.kernel_block_sizes)})"
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
    return reasons


class Platform(abc.ABC):
    """Base class of every platform plugin.

    Subclasses set the class attributes and implement the abstract methods. Instances are
    created with no arguments by the selector; construction must be cheap and must not import
    vendor modules.
    """

    name: ClassVar[str]
    """Platform name; must equal the entry-point name it is registered under."""
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities]
    kv_write_policy: ClassVar[KVWritePolicy]
    default_block_size: ClassVar[int]
    is_reference: ClassVar[bool] = False
    """True for the pure-torch fallback; auto-selection prefers any available non-reference."""

    # --- detection and capability ---------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> Availability:
        """Whether this platform can run on this machine, with the reason either way."""

    def not_supported_reasons(self, requirements: Requirements) -> list[str]:
        """Every reason this platform cannot serve ``requirements``; extend, don't replace."""
        return capability_reasons(self.capabilities, requirements)

    def explain(self, requirements: Requirements | None = None) -> list[str]:
        """Human-readable lines on how this platform would serve ``requirements``.

        Plugins with several internal tiers or backends list each candidate with its reasons.
        """
        reasons = self.not_supported_reasons(requirements or Requirements())
        return [f"{self.name}: " + ("supported" if not reasons else "; ".join(reasons))]

    def device(self) -> torch.device:
        """The default device for this platform's tensors."""
        return torch.device(self.capabilities.device_type)

    def backend_variants(self) -> Mapping[str, Mapping[str, str]]:
        """Named ways to force each internal backend, as environment overrides read at prepare
        time; ``diffusion-kv bench`` times every variant. Default: one variant, no overrides."""
        return {"default": {}}

    def init_worker(self) -> None:  # noqa: B027 - optional hook, intentionally empty
        """Optional worker-initialisation steps (vendor patches, config). Default: nothing."""

    # --- the four supplied parts ----------------------------------------------------------

    @abc.abstractmethod
    def block_tables_cls(self) -> type[BlockTables]:
        """The class implementing :class:`~diffusion_kv.core.block_tables.BlockTables`.

        Constructed with keyword arguments ``block_sizes``, ``max_num_reqs``,
        ``max_num_batched_tokens``, ``max_num_blocks_per_group``, ``device``,
        ``kernel_block_sizes``, ``cp_size``, ``cp_rank``, ``cp_interleave``.
        """

    @abc.abstractmethod
    def metadata_builder(
        self,
        layout: CacheLayout,
        block_tables: BlockTables,
        layers: Sequence[LayerGeometry],
        device: torch.device,
    ) -> MetadataBuilder:
        """A builder producing native metadata for every layer of ``layout``."""

    @abc.abstractmethod
    def paged_backend(self, layer: LayerGeometry, device: torch.device) -> PagedAttentionBackend:
        """The native paged attention for one layer."""

    # --- KV-cache allocation --------------------------------------------------------------

    @abc.abstractmethod
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Logical shape of one layer's cache tensor (or of each tensor of a tuple cache)."""

    @abc.abstractmethod
    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """Allocate one layer's KV cache."""


REQUIRED_MEMBERS: tuple[str, ...] = (
    "is_available",
    "not_supported_reasons",
    "block_tables_cls",
    "metadata_builder",
    "paged_backend",
    "kv_cache_shape",
    "allocate_kv_cache",
)
"""Methods whose signatures load-time validation checks against :class:`Platform`'s."""

REQUIRED_ATTRIBUTES: tuple[str, ...] = ("name", "capabilities", "kv_write_policy", "default_block_size")

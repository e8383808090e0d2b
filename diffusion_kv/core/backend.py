"""The paged backend: the unit of kernels a platform offers, and what the core calls on it.

A :class:`PagedBackend` subclass declares, as class-level data, its ``name``, ``priority``
(higher is tried first), :class:`~diffusion_kv.core.capabilities.Capabilities` and KV page
layout, answers :meth:`~PagedBackend.is_available` with a reason and
:meth:`~PagedBackend.not_supported_reasons` (extend it through ``super()``), and names its
BlockTables class (the core's :class:`~diffusion_kv.core.block_tables.TorchBlockTables` by
default, which splits scheduler blocks into the kernel's blocks).

The core makes one instance per KV-cache group (:class:`GroupContext`) and calls, per batch,
:meth:`~PagedBackend.build` once for the group (native metadata shared by every layer of the
group and every layer call), then per layer and forward :meth:`~PagedBackend.write_kv` exactly
once (``-1`` slots are padding: never written) and :meth:`~PagedBackend.forward` once per
attention call (once, or once per piecewise segment), reading K/V from the pages only. Under
decode context parallelism it calls :meth:`~PagedBackend.forward_partial` instead and merges
the partials across ranks by log-sum-exp. A host adapter may call
:meth:`~PagedBackend.forward_partial_extra` (one row's queries plus queries with no position of
their own that see the same keys; default: :meth:`~PagedBackend.forward_partial` per piece).

Tensor shapes (``T`` query tokens of the call, ``H`` query heads, ``Hkv`` KV heads, ``D`` head
size, all rank-local): ``query`` ``[T, H, D]`` contiguous (or packed per token, for a backend that sets
:attr:`~PagedBackend.packed_query`); ``key``/``value`` ``[T, Hkv, D]``
(heads and head dims packed, the token stride may be larger); ``slot_mapping`` ``[T]``;
``forward`` returns ``[T, H, D]`` (``out`` when given); ``forward_partial`` returns that and
its ``[T, H]`` float32 log-sum-exp (``-inf`` where no local key is visible).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from diffusion_kv.core.attention import MaskSpec
from diffusion_kv.core.batch import KVCache, LayerGeometry, PagedBatch, key_value_caches, write_pages
from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.capabilities import (
    AttentionMode,
    Availability,
    Capabilities,
    Requirements,
    capability_reasons,
)
from diffusion_kv.core.errors import UnsupportedFeatureError, ValidationError
from diffusion_kv.core.host import NO_HOST_REASON, HostRuntime

if TYPE_CHECKING:
    from diffusion_kv.core.layout import CacheLayout

LayerRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``run(query, key, value) -> out``: what :meth:`PagedBackend.bind_layer` may return."""


class KVPageLayout(enum.Enum):
    """How one layer's KV cache is laid out; the default allocation follows it."""

    COMBINED = "combined"
    """One tensor ``[2, kernel_blocks, kernel_block_size, Hkv, D]`` (K at 0, V at 1)."""
    SEPARATE = "separate"
    """A ``(key_cache, value_cache)`` tuple, each ``[kernel_blocks, kernel_block_size, Hkv, D]``."""
    HEAD_FIRST = "head_first"
    """One tensor ``[2, kernel_blocks, Hkv, kernel_block_size, D]``."""


def page_shapes(
    layout: KVPageLayout, kernel_blocks: int, kernel_block_size: int, num_kv_heads: int, head_size: int
) -> tuple[tuple[int, ...], ...]:
    """The shape of each tensor of one layer's cache in ``layout``."""
    if layout is KVPageLayout.SEPARATE:
        shape = (kernel_blocks, kernel_block_size, num_kv_heads, head_size)
        return (shape, shape)
    if layout is KVPageLayout.HEAD_FIRST:
        return ((2, kernel_blocks, num_kv_heads, kernel_block_size, head_size),)
    return ((2, kernel_blocks, kernel_block_size, num_kv_heads, head_size),)


def allocate_pages(
    layout: KVPageLayout,
    kernel_blocks: int,
    kernel_block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """Zeroed pages in ``layout``."""
    shapes = page_shapes(layout, kernel_blocks, kernel_block_size, num_kv_heads, head_size)
    tensors = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)
    return tensors if layout is KVPageLayout.SEPARATE else tensors[0]


def write_layer_pages(
    layout: KVPageLayout,
    layer: LayerGeometry,
    kv_cache: KVCache,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into one layer's pages in ``layout`` at flat
    kernel slots ``slots`` ``[T]`` (int64, every one real); e4m3 pages through
    ``layer.kv_scales``."""
    key_cache, value_cache = key_value_caches(kv_cache)
    if layout is KVPageLayout.HEAD_FIRST:  # [blocks, Hkv, page, D] seen as [blocks, page, Hkv, D]
        key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
    scales = layer.kv_scales
    if scales is None:
        write_pages(key_cache, slots, key)
        write_pages(value_cache, slots, value)
    else:
        write_pages(key_cache, slots, key, scales.k_scale, scales.saturated[0])
        write_pages(value_cache, slots, value, scales.v_scale, scales.saturated[1])


@dataclass(frozen=True)
class GroupContext:
    """One KV-cache group, as the backend instance serving it sees it."""

    index: int
    layers: tuple[LayerGeometry, ...]
    mode: AttentionMode
    """The group's mask's kind (CAUSAL, FULL or CHUNK_CAUSAL)."""
    block_size: int
    """Tokens per scheduler block (what block ids in snapshots address)."""
    kernel_block_size: int
    """Tokens per kernel block (what block tables and slots address); divides ``block_size``."""
    num_blocks: int
    """Scheduler blocks in the pool; the cache holds ``num_kernel_blocks`` kernel blocks."""
    block_tables: BlockTables
    layout: CacheLayout
    device: torch.device
    platform_name: str
    host: HostRuntime | None = None
    """The embedding host's runtime the runner was given (None: standalone)."""

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * (self.block_size // self.kernel_block_size)

    @property
    def mask(self) -> MaskSpec:
        """The group's mask (every layer of a group has the same one)."""
        return self.layers[0].mask

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.layer_name for layer in self.layers)

    @property
    def cp_size(self) -> int:
        return self.block_tables.cp_size


class PagedBackend(abc.ABC):
    """Base class of every paged backend (see the module docstring)."""

    name: ClassVar[str]
    """Unique within its platform; ``DIFFUSION_KV_BACKEND=<platform>:<name>`` forces it."""
    platform: ClassVar[str] = ""
    """The platform this backend serves (required for backends added through entry points)."""
    priority: ClassVar[int] = 0
    """Selection tries higher priorities first."""
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities]
    page_layout: ClassVar[KVPageLayout] = KVPageLayout.COMBINED

    tolerances: ClassVar[Mapping[torch.dtype, tuple[float, float]]] = {}
    """``(atol, rtol)`` per compute dtype the conformance kit compares this backend's output
    with, where its kernels accumulate in lower precision than the kit's defaults assume
    (``diffusion_kv.conformance.reference.tolerance``); a dtype not listed uses the default."""

    reorder_batch_threshold: int | None = None
    """When not None, the kernel wants rows with ``query_len <= threshold`` before longer rows
    in causal groups; the translator enforces that order when a batch is prepared."""

    packed_query: ClassVar[bool] = False
    """The backend's ``forward`` and ``forward_partial`` take a ``query`` whose heads and head
    dims are packed within each token (``stride(-1) == 1``, ``stride(-2) == D``) with a larger
    token stride -- a slice of a host's fused QKV projection, say. The core then hands such a
    query over without copying it (a single call without partial merging; a query in any other
    layout is still made contiguous). Default: the contiguous ``[T, H, D]`` query only."""
    needs_host: ClassVar[bool] = False
    """The backend needs an embedding host's runtime (:class:`~diffusion_kv.core.host.HostRuntime`,
    ``GroupContext.host``); without one, selection rules it out with that reason."""
    uses_host_kernels: ClassVar[bool] = False
    """The backend's kernels are the host's own attention backend (vLLM's, vllm-ascend's): a host
    adapter keeps driving them through the host's own builder rather than wrapping this backend."""
    host_kv_cache_layouts: ClassVar[tuple[str, ...] | None] = None
    """For ``uses_host_kernels`` backends: the host's KV-cache layout names the kernel reads
    (vLLM's ``KVCacheLayout``, e.g. ``("LBHNC",)``); None: any. A host choosing the layout takes
    the first."""
    retains_metadata: ClassVar[bool] = False
    """What :meth:`build` returns stays valid after later builds: no later build (nor anything
    the backend does for a later batch) writes into what an earlier metadata holds or reads.
    Where the BlockTables retain their batches too (``TorchBlockTables.retains_batches``), a
    prepared batch then stays usable after newer preparations -- a host alternating between
    compositions (CFG branches as rows of their own) re-activates each one's batch instead of
    preparing again -- until the block tables change. Default False: a newer preparation makes
    every earlier batch stale. A subclass that overrides :meth:`build` must set it again to keep
    it."""

    # --- selection (class level) ------------------------------------------------------------

    @classmethod
    def is_available(cls) -> Availability:
        """Whether this backend can run here, with the reason; default: pure torch, always."""
        return Availability(True, "pure torch")

    @classmethod
    def not_supported_reasons(cls, requirements: Requirements) -> list[str]:
        """Every reason this backend cannot serve ``requirements``; extend through ``super()``."""
        return capability_reasons(cls.capabilities, requirements)

    @classmethod
    def block_tables_cls(cls) -> type[BlockTables]:
        """The BlockTables class the backend's metadata reads (one per worker)."""
        return TorchBlockTables

    @classmethod
    def host_reasons(cls, host: HostRuntime | None) -> list[str]:
        """Every reason this backend cannot serve with ``host`` (None: no embedding host);
        default: a ``needs_host`` backend needs one. Extend through ``super()`` for what the
        backend needs of the host's objects."""
        return [NO_HOST_REASON] if cls.needs_host and host is None else []

    @classmethod
    def prepare_worker(cls, host: HostRuntime | None) -> None:
        """Once per worker process, before any instance, when this backend is the one the
        platform selects (``Platform.init_worker``): vendor patches, resolving operators so a
        missing one fails fast. Default: nothing."""
        del host

    # --- one instance per KV-cache group --------------------------------------------------------

    def __init__(self, group: GroupContext) -> None:
        self.group = group

    def _bind_dcp(self) -> None:
        """For backends that declare ``supports_dcp``: take the group's decode-context-parallel
        geometry (``cp_size``, ``cp_rank``, ``cp_interleave``) from its BlockTables; the
        interleave must divide the kernel block size (the runner checks this too; a backend
        constructed by hand gets the same error)."""
        bt, kernel = self.group.block_tables, self.group.kernel_block_size
        self.cp_size, self.cp_rank, self.cp_interleave = bt.cp_size, bt.cp_rank, bt.cp_interleave
        if self.cp_size > 1 and kernel % self.cp_interleave:
            raise ValidationError(
                f"cp_interleave={self.cp_interleave} must divide the kernel block size {kernel} "
                f"of the {self.group.platform_name} backend {self.name!r}"
            )

    def allocate_kv_cache(self, layer: LayerGeometry) -> KVCache:
        """One layer's cache; the default allocates zeroed pages in ``page_layout``."""
        g = self.group
        return allocate_pages(
            self.page_layout,
            g.num_kernel_blocks,
            g.kernel_block_size,
            layer.num_kv_heads,
            layer.head_size,
            layer.kv_dtype,
            g.device,
        )

    def bind_kv_cache(self, layer: LayerGeometry, cache: KVCache) -> KVCache:
        """Adopt a cache the host allocated (e.g. vLLM's ``KVCacheConfig`` tensors) instead of
        allocating one; the default checks it has ``page_layout``'s shapes, the layer's dtype
        and the worker's device, and uses it as is (zero-copy)."""
        g = self.group
        expected = page_shapes(
            self.page_layout, g.num_kernel_blocks, g.kernel_block_size, layer.num_kv_heads, layer.head_size
        )
        tensors = cache if isinstance(cache, tuple) else (cache,)
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors]
        problems = []
        if got != [tuple(s) for s in expected] or isinstance(cache, tuple) != (
            self.page_layout is KVPageLayout.SEPARATE
        ):
            problems.append(f"shapes {got} (expected {list(expected)} for {self.page_layout.value} pages)")
        for t in tensors:
            if isinstance(t, torch.Tensor) and (t.dtype != layer.kv_dtype or t.device != g.device):
                problems.append(f"dtype/device {t.dtype}/{t.device} (expected {layer.kv_dtype}/{g.device})")
                break
        if problems:
            raise ValidationError(
                f"backend {self.name!r} cannot use the given cache of layer {layer.layer_name!r}: "
                + "; ".join(problems)
            )
        return cache

    def build(self, batch: PagedBatch) -> Any:
        """Native metadata for one batch (or piecewise segment) of this group; ``forward``
        receives it as ``metadata``. The default is the :class:`PagedBatch` itself (its host
        copies ``query_start_loc_cpu``/``seq_lens_cpu`` read without a sync); override to
        translate it once per batch into what the kernel takes."""
        return batch

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]``; ``-1`` slots are
        padding and must not be written.

        The default serves the three :class:`KVPageLayout` layouts with plain torch indexed
        copies (flat slot ``kernel_block * kernel_block_size + offset``), quantised (e4m3)
        pages through the layer's ``kv_scales``; a backend with its own writer overrides it."""
        slots = slot_mapping.reshape(-1)[: key.shape[0]].to(torch.long)
        keep = slots >= 0
        write_layer_pages(self.page_layout, layer, kv_cache, slots[keep], key[keep], value[keep])

    def write_kv_valid(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """:meth:`write_kv` where the core guarantees every slot is a real one (``>= 0``): a
        prepared batch without decode context parallelism has no padding tokens, and every
        position it writes lies in an installed block. A backend may skip the padding check
        here (one indexed copy instead of a masked write). The default calls :meth:`write_kv`,
        except with the default writer, which then skips its padding mask (a host sync)."""
        if type(self).write_kv is PagedBackend.write_kv:
            slots = slot_mapping.reshape(-1)[: key.shape[0]]
            write_layer_pages(self.page_layout, layer, kv_cache, slots, key, value)
            return
        self.write_kv(layer, key, value, kv_cache, slot_mapping)

    @abc.abstractmethod
    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` ``[T, H, D]`` over the rows' pages; returns ``[T, H, D]``."""

    def forward_partial(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over this DCP rank's keys with its log-sum-exp (backends declaring
        ``supports_dcp`` implement it)."""
        raise UnsupportedFeatureError(
            f"backend {self.name!r} does not implement forward_partial (decode context parallelism)"
        )

    def forward_partial_extra(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        extra_query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_partial` of ``query`` ``[T, H, D]`` -- the queries of ONE prepared row,
        every one of which sees the same keys (a whole chunk under a chunk-causal session mask,
        or a FULL row) -- followed by ``extra_query`` ``[E, H, D]``: queries with no position of
        their own that see exactly those keys too. Returns ``(out [T + E, H, D], lse [T + E, H]
        float32)``, the row's queries first.

        An optional fast path for hosts that attend scratch queries beside a chunk (vLLM-Omni's
        DreamZero action/state tokens): a backend may attend all ``T + E`` queries in one kernel
        call. The default calls :meth:`forward_partial` once for ``query`` and once per piece of
        ``T`` extra queries (the last piece zero-padded), over the same metadata -- correct
        exactly when the caller's promise holds, so every backend that implements
        :meth:`forward_partial` serves it."""
        tokens, extra = query.shape[0], extra_query.shape[0]
        if tokens == 0 and extra:
            raise ValidationError(
                f"backend {self.name!r} forward_partial_extra: {extra} extra queries beside a row of 0 queries"
            )
        out, lse = self.forward_partial(layer, query, kv_cache, metadata)
        if extra == 0:
            return out, lse
        outs, lses = [out], [lse]
        for start in range(0, extra, tokens):
            piece = extra_query[start : start + tokens]
            n = piece.shape[0]
            if n < tokens:
                piece = torch.cat((piece, piece.new_zeros((tokens - n, *piece.shape[1:]))))
            o, lg = self.forward_partial(layer, piece.contiguous(), kv_cache, metadata)
            outs.append(o[:n])
            lses.append(lg[:n])
        return torch.cat(outs), torch.cat(lses)

    def forward_extra_keys(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        extra_query: torch.Tensor,
        extra_key: torch.Tensor,
        extra_value: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`forward_partial_extra`'s queries (``query`` ``[T, H, D]``, the queries of ONE
        prepared row that all see the same keys, then ``extra_query`` ``[E, H, D]``, ``E`` may
        be 0) over the row's keys AND ``extra_key``/``extra_value`` ``[X, Hkv, D]``: keys with no
        place in the pages that every query sees (a host's scratch K/V, e.g. vLLM-Omni's DreamZero
        action/state tokens, or a context's keys read out of its own pages). Returns ``(out
        [T + E, H, D], lse [T + E, H] float32)`` over all of those keys, in one kernel call.

        An optional fast path that may decline: the default returns None, and so does an
        override where it cannot attend in one call; the caller then merges
        :meth:`forward_partial_extra` with its own partial over the extra keys
        (``merge_partial_attention``) -- the same result up to rounding."""
        return None

    def bind_layer(
        self, layer: LayerGeometry, kv_cache: KVCache, metadata: Any, slot_mapping: torch.Tensor
    ) -> LayerRunner | None:
        """An optional fast path for a layer's later calls in one active batch; the default
        returns None (every call goes through :meth:`write_kv_valid` and :meth:`forward`).

        The core asks after a layer's call succeeded in the plain case -- one :meth:`forward`
        over every query, every slot real (:meth:`write_kv_valid`), no decode context
        parallelism, no piecewise spans -- handing the same ``layer``, ``kv_cache``, native
        ``metadata`` and ``slot_mapping`` that call had. A backend may return ``run(query, key,
        value) -> out`` that does exactly what :meth:`write_kv_valid` then :meth:`forward` would
        for those arguments, with whatever it decided on the first call kept (views, masks,
        kernel choice). The core calls it instead of the two, for that layer until the batch is
        deactivated, whenever the caller's Q/K/V have the shapes, strides, dtypes and devices of
        the call that was bound (anything else takes the full path again); ``query`` ``[T, H,
        D]`` as :meth:`forward` takes it, ``key``/``value`` ``[T, Hkv, D]`` views (any token
        stride). A failure inside it is reported like one inside :meth:`forward`."""
        return None

    def bind_layer_like(
        self,
        layer: LayerGeometry,
        kv_cache: KVCache,
        metadata: Any,
        slot_mapping: torch.Tensor,
        like: LayerGeometry,
        like_kv_cache: KVCache,
    ) -> LayerRunner | None:
        """An optional way to bind a layer before its first call in an active batch, from its
        twin the backend already bound there (:meth:`bind_layer`); the default returns None
        (the layer's first call takes the full path, then :meth:`bind_layer`).

        The core asks at the layer's first call of the batch, once ``like`` -- served by a
        backend of this class in the same KV-cache group -- was bound, when the two are twins:
        every field of their
        :class:`LayerGeometry` equal but the name (neither has ``kv_scales``), their caches
        congruent (K and V of the same shapes, strides, dtypes and devices), the same native
        ``metadata`` and ``slot_mapping`` objects, and the caller's Q/K/V with the layout of
        the call ``like`` was bound on. A backend may return a runner doing for ``layer`` and
        ``kv_cache`` exactly what :meth:`write_kv_valid` then :meth:`forward` would (typically
        ``like``'s decisions over ``kv_cache``'s views); the core calls it for this call and the
        layer's later ones, as a :meth:`bind_layer` runner. A failure inside it, or here, is
        reported like one inside :meth:`forward`, and the layer is not counted done."""
        return None

    def graph_key(self, metadata: Any) -> Hashable | None:
        """What a CUDA graph captured over ``metadata`` depends on; None (the default): a graph
        captured over it serves that batch only.

        A backend may return a hashable key with this promise: for two metadata objects of this
        backend with equal keys, every call of the per-layer path (:meth:`write_kv`,
        :meth:`write_kv_valid`, :meth:`forward`, :meth:`forward_partial`, the runners of
        :meth:`bind_layer` and :meth:`bind_layer_like`) on the same layer, cache and inputs
        launches the same kernels with the same host arguments and the same device addresses --
        every device tensor they read is the same memory, holding that batch's values. A graph
        captured over one then computes the other when replayed, so a host replays one graph
        per batch shape across preparations (a session's chunks once its window has filled)
        instead of capturing each batch again (``diffusion_kv.core.graphs``). Typically the
        addresses, shapes and strides of the metadata's tensors (views of persistent buffers
        the BlockTables and the backend reuse for every batch of a shape) and every host value
        the launches take. It is asked right after :meth:`build` and again before replays: a
        key must not depend on anything the first layer call makes. Return None whenever one
        of the batch's launches reads anything the key does not pin (a tensor made per batch,
        a host decision taken from the batch's values)."""
        del metadata
        return None


def tensor_address(t: torch.Tensor) -> tuple[Hashable, ...]:
    """A tensor's memory and view as a :meth:`PagedBackend.graph_key` part: its data pointer,
    shape, strides, dtype and device."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


BackendChoice = str | type[PagedBackend] | None
"""Which backend to use: its name, its class, or None (the platform's priority list, where
``DIFFUSION_KV_BACKEND`` may name one)."""


class BackendProvider(Protocol):
    """What the runner needs of a platform: its name, device and per-group backend choice."""

    @property
    def name(self) -> str: ...

    @property
    def default_block_size(self) -> int: ...

    def device(self) -> torch.device: ...

    def not_supported_reasons(
        self, requirements: Requirements, host: HostRuntime | None = None
    ) -> list[str]: ...

    def select_backend(
        self,
        requirements: Requirements,
        compatible_with: Sequence[type[PagedBackend]] = (),
        force: BackendChoice = None,
        host: HostRuntime | None = None,
    ) -> type[PagedBackend]: ...

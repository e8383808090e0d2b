"""The CUDA plugin's own paged backends (torch + Triton, no vLLM).

Two ways to attend:

* in place — :func:`kernels.paged_attention` reads K/V pages through the block table;
  split-KV over the pages when few query tiles exist (memory-bound shapes, e.g. a few target
  tokens over a long cached prefix);
* gather + SDPA — gathers each row's pages into contiguous K/V, then calls the best torch SDPA
  kernel (cuDNN / FlashAttention / memory-efficient); wins for compute-bound shapes where the
  gather copy is small next to the attention itself.

:class:`CudaPagedBackend` (``paged``) decides per batch, when the batch is built, from the
host-side lengths it already has (no device sync), and records the choice and its reason in
the metadata. :class:`TritonPagedBackend` (``triton``) and :class:`SdpaPagedBackend`
(``sdpa``) always take one way (``DIFFUSION_KV_BACKEND=cuda:triton`` / ``cuda:sdpa``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.errors import UnsupportedFeatureError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.platforms.interface import (
    AttentionMode,
    Availability,
    Capabilities,
    GroupContext,
    KVCache,
    LayerGeometry,
    MultipleOf,
    PagedBackend,
    PagedBatch,
)

SPLIT_CHOICES = (1, 2, 4, 8, 16, 32)
RESIDENT_PROGRAMS = {16: 8, 32: 8, 64: 4, 128: 2}
"""Paged-attention programs one SM runs at once, by query-tile rows (H200, head size 128)."""
DEFAULT_NUM_SMS = 132
PLAN_CACHE_SIZE = 64
"""Batch plans (way, tile schedule or row shapes) a backend keeps, by batch shape (the oldest
is dropped first)."""


@dataclass(frozen=True)
class SdpaRowGroup:
    """Rows sharing one (query_len, seq_len) shape: one gather (or view) + one SDPA call per layer."""

    query_len: int
    seq_len: int
    rows: tuple[int, ...]
    row_index: torch.Tensor | None  # device indices when the rows are not consecutive
    view: tuple[int, int] | None = None
    """``(first kernel block, kernel blocks from one row's start to the next)`` when every row's
    pages form one contiguous run and the runs are evenly spaced: K/V are then read as a strided
    view of the cache, with no gather."""

    @property
    def contiguous(self) -> bool:
        return self.row_index is None


def contiguous_run(ids: tuple[int, ...], ratio: int, count: int) -> int | None:
    """The first kernel block when the first ``count`` kernel blocks of a row (scheduler ids
    ``ids``, ``ratio`` kernel blocks each) are consecutive, else None."""
    needed = -(-count // ratio)
    if len(ids) < needed:
        return None
    first = ids[0]
    if needed <= 1:
        return first * ratio
    if ids[needed - 1] != first + needed - 1:  # rejects most placements at once
        return None
    return first * ratio if tuple(ids[:needed]) == tuple(range(first, first + needed)) else None


RowShapes = tuple[tuple[int, int, tuple[int, ...], "torch.Tensor | None"], ...]
"""``(query_len, seq_len, rows, device row index or None when the rows are consecutive)`` per
row shape of a batch, rows without queries left out."""


def row_shapes(qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device) -> RowShapes:
    """A batch's rows grouped by shape (the part of :func:`sdpa_row_groups` that depends on the
    lengths alone)."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for r in range(len(seq)):
        shapes.setdefault((qsl[r + 1] - qsl[r], seq[r]), []).append(r)
    out = []
    for (ql, sl), rows in shapes.items():
        if ql == 0:  # a row without queries in this (piecewise) segment
            continue
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        index = None if consecutive else torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
        out.append((ql, sl, tuple(rows), index))
    return tuple(out)


def page_view(
    rows: tuple[int, ...], seq_len: int, host_block_ids: tuple[tuple[int, ...], ...], ratio: int, page: int
) -> tuple[int, int] | None:
    """``SdpaRowGroup.view`` for rows of ``seq_len`` keys placed at ``host_block_ids``."""
    if not host_block_ids:
        return None
    nblk = -(-seq_len // page)
    starts: list[int] = []
    for r in rows:  # stop at the first row whose pages are not one run
        start = contiguous_run(host_block_ids[r], ratio, nblk)
        if start is None:
            return None
        starts.append(start)
    first = starts[0]
    step = (starts[1] - first) if len(starts) > 1 else nblk
    evenly = all(st == first + i * step for i, st in enumerate(starts))
    return (first, step) if evenly and step >= nblk else None


def sdpa_row_groups(
    qsl: tuple[int, ...],
    seq: tuple[int, ...],
    device: torch.device,
    host_block_ids: tuple[tuple[int, ...], ...] = (),
    ratio: int = 1,
    page: int = 1,
    shapes: RowShapes | None = None,
) -> tuple[SdpaRowGroup, ...]:
    """Rows grouped by shape, each group read as a strided view of the cache when its pages
    allow it; ``shapes`` is ``row_shapes(qsl, seq, device)`` when the caller has it already."""
    if shapes is None:
        shapes = row_shapes(qsl, seq, device)
    return tuple(
        SdpaRowGroup(ql, sl, rows, index, page_view(rows, sl, host_block_ids, ratio, page))
        for ql, sl, rows, index in shapes
    )


@dataclass(frozen=True)
class CudaPagedMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    page: int
    host_query_start_loc: tuple[int, ...]
    host_seq_lens: tuple[int, ...]
    backend: str
    reason: str
    tile_row: torch.Tensor | None = None
    tile_q0: torch.Tensor | None = None
    block_m: int = 64
    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    sdpa_groups: tuple[SdpaRowGroup, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


class _BatchPlan(NamedTuple):
    """What :meth:`CudaPagedBackend.build` decides from a batch's lengths alone."""

    way: str
    reason: str
    extra: dict[str, Any]
    """The in-place way's tile schedule and launch settings (CudaPagedMetadata fields)."""
    shapes: RowShapes
    """The gather + SDPA way's row shapes."""


def _pow2_at_least(n: int, floor: int = 16) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def triton_available() -> Availability:
    """Whether the Triton kernels can run (Triton importable), with the reason."""
    if importlib.util.find_spec("triton") is None:
        return Availability(False, "Triton is not installed")
    try:
        import triton
    except Exception as exc:  # a broken install is a reason, not a crash
        return Availability(False, f"Triton failed to import: {type(exc).__name__}: {exc}")
    return Availability(True, f"Triton {triton.__version__}")


def cuda_available() -> Availability:
    if not torch.cuda.is_available():
        build = torch.version.cuda
        return Availability(
            False,
            "torch is a CPU-only build" if build is None else f"torch (CUDA {build}) sees no CUDA device",
        )
    return Availability(True, f"CUDA {torch.version.cuda}")


def choose_way(query_lens: tuple[int, ...], seq_lens: tuple[int, ...], *, triton_ok: bool) -> tuple[str, str]:
    """``(way, reason)`` for one batch: ``triton`` (in place) or ``sdpa`` (gather + SDPA)."""
    if not triton_ok:
        return "sdpa", "Triton is not importable"
    max_q = max(query_lens)
    shapes = set(zip(query_lens, seq_lens, strict=True))
    if max_q >= 512 and len(shapes) <= 2:
        return (
            "sdpa",
            f"compute-bound (max query_len {max_q} >= 512, {len(shapes)} row shape(s)): gather + SDPA",
        )
    return (
        "triton",
        f"memory-bound or ragged (max query_len {max_q}, {len(shapes)} row shapes): in-place paged kernel",
    )


CAPABILITIES = Capabilities(
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_sizes=frozenset({64, 128}),
    kernel_block_sizes=(MultipleOf(16),),
    slot_mapping_dtypes=frozenset({torch.int64}),
    attention_modes=frozenset(AttentionMode),
    supports_gqa=True,
    supports_graph_capture=True,
)
"""Per layer the backends only launch work (plans, row groups and device indices are fixed in
``build``): a denoise step can be captured as a CUDA graph and replayed."""


def _row_view(cache: torch.Tensor, view: tuple[int, int], rows: int, tokens: int) -> torch.Tensor:
    """``[rows, tokens, Hkv, D]`` over ``cache`` ``[blocks, page, Hkv, D]``: row ``r`` starts at
    kernel block ``first + r * step``."""
    first, step = view
    page_elems = cache.stride(0)
    return cache.as_strided(
        (rows, tokens, cache.shape[2], cache.shape[3]),
        (step * page_elems, cache.stride(1), cache.stride(2), cache.stride(3)),
        cache.storage_offset() + first * page_elems,
    )


def _caches(kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(kv_cache, torch.Tensor):
        return kv_cache[0], kv_cache[1]
    k, v = kv_cache
    return k, v


class CudaPagedBackend(PagedBackend):
    """Writes with the Triton writer; attends in place or by gather + SDPA, chosen per batch."""

    name: ClassVar[str] = "paged"
    platform: ClassVar[str] = "cuda"
    priority: ClassVar[int] = 200
    description: ClassVar[str] = (
        "per batch: Triton in place (memory-bound, ragged) or gather + SDPA (query_len >= 512, <= 2 row shapes)"
    )
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    way: ClassVar[str | None] = None
    """``triton`` or ``sdpa`` to always take one way; None decides per batch."""

    @classmethod
    def is_available(cls) -> Availability:
        found = cuda_available()
        if not found:
            return found
        triton = triton_available()
        if cls.way == "triton" and not triton:
            return triton
        return Availability(
            True, f"{found.reason}; " + (triton.reason if triton else f"SDPA only ({triton.reason})")
        )

    @classmethod
    def block_tables_cls(cls) -> type[BlockTables]:
        if triton_available():
            from diffusion_kv.platforms.cuda.block_tables import TritonBlockTables

            return TritonBlockTables
        return TorchBlockTables

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        if group.cp_size > 1:
            raise UnsupportedFeatureError(
                "the cuda paged backends do not implement decode context parallelism"
            )
        self.triton_ok = bool(triton_available())
        layer = group.layers[0]
        self.group_ratio = layer.num_heads // layer.num_kv_heads
        self.kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.num_sms = DEFAULT_NUM_SMS
        if group.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(group.device).multi_processor_count
        self._plans: dict[tuple[tuple[int, ...], tuple[int, ...], torch.device], _BatchPlan] = {}

    def _plan(self, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device) -> _BatchPlan:
        """The plan of one batch shape, made once: a batch of a shape seen before reuses it, its
        device tensors (tile schedule, row indices) included. They are never written after
        they are made, so a batch that holds them stays valid; preparing it again costs no
        allocation and no host-to-device copy."""
        key = (qsl, seq, device)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        if self.way is not None:
            way, reason = self.way, f"backend {self.name!r} always takes this way"
        else:
            lens = tuple(qsl[i + 1] - qsl[i] for i in range(len(seq)))
            way, reason = choose_way(lens, seq, triton_ok=self.triton_ok)
        if way == "triton":
            tile_row, tile_q0, block_m, block_n, splits = self._make_schedule(qsl, seq, device)
            extra: dict[str, Any] = dict(
                tile_row=tile_row,
                tile_q0=tile_q0,
                block_m=block_m,
                block_n=block_n,
                num_splits=splits,
                num_warps=8 if block_m >= 128 else 4,
            )
            plan = _BatchPlan(way, reason, extra, ())
        else:
            plan = _BatchPlan(way, reason, {}, row_shapes(qsl, seq, device))
        if len(self._plans) >= PLAN_CACHE_SIZE:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def _make_schedule(
        self, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
        lens = [qsl[i + 1] - qsl[i] for i in range(len(seq))]
        max_q = max(lens)
        block_m = min(
            128 if max_q * self.group_ratio >= 128 else _pow2_at_least(max_q * self.group_ratio), 128
        )
        block_m = max(block_m, _pow2_at_least(self.group_ratio))
        per_tile = max(block_m // self.group_ratio, 1)
        rows: list[int] = []
        q0s: list[int] = []
        for r, n in enumerate(lens):
            for q0 in range(0, n, per_tile):
                rows.append(r)
                q0s.append(q0)
        programs = len(rows) * self.kv_heads
        max_keys = max(seq)
        block_n = 64 if self.head_size > 64 or block_m >= 128 else 128
        # Split the keys until the launch roughly fills every SM with as many programs as fit
        # at once (fewer fit as the query tile grows); tuned on an H200 with
        # benchmarks/tune_cuda_paged.py (docs/benchmarks.md).
        target = int(0.9 * self.num_sms * RESIDENT_PROGRAMS.get(block_m, 2))
        splits = 1
        for s in SPLIT_CHOICES:
            splits = s
            if programs * s >= target or cdiv(max_keys, s) <= 4 * block_n:
                break
        sched = torch.tensor([rows, q0s], dtype=torch.int32)
        if device.type == "cuda":  # pinned: the copy does not block the host
            sched = sched.pin_memory()
        sched = sched.to(device, non_blocking=True)
        return sched[0], sched[1], block_m, block_n, splits

    def build(self, batch: PagedBatch) -> CudaPagedMetadata:
        qsl = tuple(batch.query_start_loc_cpu.tolist())
        seq = tuple(batch.seq_lens_cpu.tolist())
        plan = self._plan(qsl, seq, batch.query_start_loc.device)
        extra = plan.extra
        if plan.way != "triton":  # the page views depend on the placement, not only the shape
            g = self.group
            ratio, page = g.block_size // g.kernel_block_size, g.kernel_block_size
            extra = dict(
                sdpa_groups=tuple(
                    SdpaRowGroup(ql, sl, rows, index, page_view(rows, sl, batch.host_block_ids, ratio, page))
                    for ql, sl, rows, index in plan.shapes
                )
            )
        return CudaPagedMetadata(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=batch.slot_mapping,
            causal=batch.causal,
            page=self.group.kernel_block_size,
            host_query_start_loc=qsl,
            host_seq_lens=seq,
            backend=plan.way,
            reason=plan.reason,
            **extra,
        )

    def write_kv(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        k_cache, v_cache = _caches(kv_cache)
        slots = slot_mapping[: key.shape[0]]
        if self.triton_ok:
            from diffusion_kv.platforms.cuda import kernels

            kernels.write_kv(key, value, k_cache, v_cache, slots)
            return
        # Without Triton: route -1 slots to a scratch row so no host sync is needed.
        nb, page, hkv, d = k_cache.shape
        flat_k = k_cache.view(nb * page, hkv, d)
        flat_v = v_cache.view(nb * page, hkv, d)
        keep = slots >= 0
        idx = torch.where(keep, slots, torch.zeros_like(slots)).long()
        old_k = flat_k.index_select(0, idx)
        old_v = flat_v.index_select(0, idx)
        flat_k.index_copy_(0, idx, torch.where(keep[:, None, None], key.to(k_cache.dtype), old_k))
        flat_v.index_copy_(0, idx, torch.where(keep[:, None, None], value.to(v_cache.dtype), old_v))

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: CudaPagedMetadata = metadata
        k_cache, v_cache = _caches(kv_cache)
        if md.backend != "triton":
            return self._gather_sdpa(layer, query, kv_cache, md, out)
        result = out if out is not None else torch.empty_like(query)
        if md.backend == "triton":
            from diffusion_kv.platforms.cuda import kernels

            assert md.tile_row is not None and md.tile_q0 is not None
            kernels.paged_attention(
                query,
                k_cache,
                v_cache,
                result,
                md.block_table,
                md.seq_lens,
                md.query_start_loc,
                md.tile_row,
                md.tile_q0,
                scale=layer.scale,
                causal=md.causal,
                block_m=md.block_m,
                block_n=md.block_n,
                num_splits=md.num_splits,
                num_warps=md.num_warps,
            )
        return result

    def _gather_sdpa(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: CudaPagedMetadata,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        hkv, hd = layer.num_kv_heads, layer.head_size
        qsl = md.host_query_start_loc
        order = [
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]
        # One group covering every row in order: SDPA's own output (already [tokens, H, D] in
        # memory) is returned as is, without a copy into ``out``.
        single = len(md.sdpa_groups) == 1 and out is None
        result = out
        for grp in md.sdpa_groups:
            ql, sl, rows = grp.query_len, grp.seq_len, grp.rows
            nblk = cdiv(sl, md.page)
            R = len(rows)
            contiguous = grp.row_index is None
            if grp.row_index is None:
                table = md.block_table[rows[0] : rows[0] + R, :nblk]
            else:
                table = md.block_table[grp.row_index, :nblk]
            k_cache, v_cache = _caches(kv_cache)
            if grp.view is not None:  # contiguous pages: a strided view of the cache, no gather
                k, v = (_row_view(c, grp.view, R, nblk * md.page)[:, :sl] for c in (k_cache, v_cache))
            else:
                flat = table.reshape(-1).long()
                k = k_cache.index_select(0, flat).view(R, nblk * md.page, hkv, hd)[:, :sl]
                v = v_cache.index_select(0, flat).view(R, nblk * md.page, hkv, hd)[:, :sl]
            if contiguous:
                q = query[qsl[rows[0]] : qsl[rows[0]] + R * ql].view(R, ql, layer.num_heads, hd)
            else:
                q = torch.stack([query[qsl[r] : qsl[r] + ql] for r in rows])
            mask: Any = None
            is_causal = False
            if md.causal and ql == sl:
                is_causal = True
            elif md.causal:
                mask = causal_lower_right(ql, sl)
            with sdpa_kernel(order, set_priority=True):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    attn_mask=mask,
                    is_causal=is_causal,
                    scale=layer.scale,
                    enable_gqa=layer.num_heads != layer.num_kv_heads,
                )
            o = o.transpose(1, 2)
            if single and contiguous and R * ql == query.shape[0]:
                return o.reshape(R * ql, layer.num_heads, hd)  # a view when SDPA wrote [B, L, H, D]
            if result is None:
                result = torch.empty_like(query)
            if contiguous:
                result[qsl[rows[0]] : qsl[rows[0]] + R * ql].view(R, ql, layer.num_heads, hd).copy_(o)
            else:
                for i, r in enumerate(rows):
                    result[qsl[r] : qsl[r] + ql] = o[i]
        return result if result is not None else torch.zeros_like(query)


class TritonPagedBackend(CudaPagedBackend):
    """Always the in-place Triton kernel."""

    name: ClassVar[str] = "triton"
    priority: ClassVar[int] = 150
    description: ClassVar[str] = "Triton kernel reading pages in place, split-KV"
    way: ClassVar[str | None] = "triton"


class SdpaPagedBackend(CudaPagedBackend):
    """Always gather + torch SDPA (cuDNN / FlashAttention / memory-efficient)."""

    name: ClassVar[str] = "sdpa"
    priority: ClassVar[int] = 100
    description: ClassVar[str] = "gather each row's pages, then the best torch SDPA kernel"
    capabilities: ClassVar[Capabilities] = Capabilities(
        dtypes=CAPABILITIES.dtypes,
        head_sizes=frozenset(range(8, 257, 8)),
        kernel_block_sizes=CAPABILITIES.kernel_block_sizes,
        slot_mapping_dtypes=CAPABILITIES.slot_mapping_dtypes,
        attention_modes=CAPABILITIES.attention_modes,
        supports_gqa=True,
        supports_graph_capture=True,
    )
    way: ClassVar[str | None] = "sdpa"

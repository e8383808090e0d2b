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

Strict Ulysses needs nothing of a backend: it is built with the rank-local head counts.

Decode context parallelism (``cp_size > 1``): a rank's pages hold only the keys of its
interleave slots, local key ``j`` at page index ``j``. :meth:`CudaPagedBackend.forward_partial`
attends over those keys, with the causal mask on their absolute positions, and returns the
output with its natural-log log-sum-exp (``-inf``, output 0, where no local key is visible);
the core merges the partials across the DCP group. Both ways do it: the Triton kernel in its
DCP mode, and gather + torch's memory-efficient SDPA kernel (the one torch kernel that returns
the log-sum-exp under an arbitrary additive mask; the DCP causal mask is a staircase, which no
``is_causal`` flag expresses), with the mask built at ``build``. ``forward`` refuses DCP
metadata.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple

import torch

from diffusion_kv.core.batch import key_value_caches, write_pages
from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.capabilities import BASE_MODES
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.translate import dcp_local_seq_lens
from diffusion_kv.platforms.interface import (
    Availability,
    Capabilities,
    GroupContext,
    KVCache,
    LayerGeometry,
    MultipleOf,
    PagedBackend,
    PagedBatch,
    Requirements,
)

SPLIT_CHOICES = (1, 2, 4, 8, 16, 32)
RESIDENT_PROGRAMS = {16: 8, 32: 8, 64: 4, 128: 2}
"""Paged-attention programs one SM runs at once, by query-tile rows (H200, head size 128)."""
DEFAULT_NUM_SMS = 132
PLAN_CACHE_SIZE = 64
"""Batch plans (way, tile schedule or row shapes) a backend keeps, by batch shape (the oldest
is dropped first)."""
BIAS_ALIGN = 16
"""The memory-efficient SDPA kernel wants the rows of an additive mask 16-element aligned."""


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
    kv_len: int | None = None
    """Keys read from this rank's pages: the local keys under DCP; None means ``seq_len``."""
    bias: torch.Tensor | None = None
    """DCP causal partials: additive mask ``[1, 1, G * query_len, keys]`` (0 or -inf) over the
    query heads of one KV head folded into the query sequence (``G = H // Hkv``); None when
    every query sees every local key."""
    visible: torch.Tensor | None = None
    """DCP causal partials: ``[query_len]`` bool, whether a query sees any local key; None when
    every query does."""

    @property
    def contiguous(self) -> bool:
        return self.row_index is None

    @property
    def keys(self) -> int:
        return self.seq_len if self.kv_len is None else self.kv_len


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
    kv_lens: tuple[int, ...] | None = None,
) -> tuple[SdpaRowGroup, ...]:
    """Rows grouped by shape, each group read as a strided view of the cache when its pages
    allow it; ``shapes`` is ``row_shapes(qsl, seq, device)`` when the caller has it already.
    ``kv_lens`` are the keys each row reads from this rank's pages when they differ from
    ``seq`` (DCP; equal within a group); a group with no local keys is left out."""
    if shapes is None:
        shapes = row_shapes(qsl, seq, device)
    groups = []
    for ql, sl, rows, index in shapes:
        kv_len = None if kv_lens is None else kv_lens[rows[0]]
        keys = sl if kv_len is None else kv_len
        if keys == 0:  # no key of these rows lives on this rank
            continue
        view = page_view(rows, keys, host_block_ids, ratio, page)
        groups.append(SdpaRowGroup(ql, sl, rows, index, view, kv_len))
    return tuple(groups)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, through pinned memory on CUDA (the copy does not block
    the host)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def dcp_causal_mask(
    grp: SdpaRowGroup,
    heads_per_kv: int,
    cp_size: int,
    cp_rank: int,
    interleave: int,
    dtype: torch.dtype,
    device: torch.device,
) -> SdpaRowGroup:
    """``grp`` with the DCP causal ``bias`` and ``visible`` its partial needs (built on the
    device at ``build`` from host lengths; no synchronisation).

    Query ``m`` of the group sits at absolute position ``seq_len - query_len + m`` and sees the
    local keys at absolute positions up to it: a prefix of the local keys (their positions grow
    with their index) of length ``dcp_local_seq_lens(position + 1)``.
    """
    ql, sl, keys = grp.query_len, grp.seq_len, grp.keys
    positions = torch.arange(sl - ql, sl, dtype=torch.int32)
    seen = dcp_local_seq_lens(positions + 1, cp_size, cp_rank, interleave)  # host, [ql]
    least = int(seen.min())
    bias = visible = None
    if least < keys:
        counts = _to_device(seen.repeat(heads_per_kv), device)  # folded row g * ql + m
        padded = cdiv(keys, BIAS_ALIGN) * BIAS_ALIGN
        cols = torch.arange(padded, device=device)
        full = torch.zeros((heads_per_kv * ql, padded), dtype=dtype, device=device)
        full.masked_fill_(cols[None, :] >= counts[:, None], float("-inf"))
        bias = full[:, :keys][None, None]
    if least == 0:
        visible = _to_device(seen > 0, device)
    return replace(grp, bias=bias, visible=visible)


def sdpa_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, M, D]`` over ``[B, H, N, D]`` -> ``(out [B, H, M, D], natural-log lse [B, H, M]
    float32)``, with an optional additive ``bias`` ``[B, H, M, N]`` in the query's dtype.

    On CUDA: torch's memory-efficient kernel (cuDNN and FlashAttention take no such mask).
    Elsewhere (the CPU, under Triton's interpreter in CI): torch's CPU flash kernel. A query
    whose keys are all masked has an undefined result here: the caller masks it out.
    """
    if query.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, False, scale=scale
        )[:2]
        return out, lse[..., : query.shape[2]]  # the kernel pads the LSE rows to a multiple of 32
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse


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
    way: KernelWay
    reason: str
    tile_row: torch.Tensor | None = None
    tile_q0: torch.Tensor | None = None
    block_m: int = 64
    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    sdpa_groups: tuple[SdpaRowGroup, ...] = ()
    local_seq_lens: torch.Tensor | None = None
    """Under DCP, ``[num_reqs]`` keys of each row on this rank (device); None without DCP."""
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per (layer cache address, row group): the K/V strided views of contiguous pages, made by
    the batch's first layer and reused by the others (a layer's cache never moves)."""


class _BatchPlan(NamedTuple):
    """What :meth:`CudaPagedBackend.build` decides from a batch's lengths alone."""

    way: KernelWay
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


class KernelWay(enum.Enum):
    """How a cuda backend attends for one batch."""

    TRITON = "triton"
    """The Triton kernel reading the pages in place."""
    SDPA = "sdpa"
    """Gather each row's pages (or view them when contiguous), then torch SDPA (cuDNN)."""


def choose_way(
    query_lens: tuple[int, ...], seq_lens: tuple[int, ...], *, triton_ok: bool
) -> tuple[KernelWay, str]:
    """``(way, reason)`` for one batch: in place (Triton) or gather + SDPA."""
    if not triton_ok:
        return KernelWay.SDPA, "Triton is not importable"
    max_q = max(query_lens)
    shapes = set(zip(query_lens, seq_lens, strict=True))
    if max_q >= 512 and len(shapes) <= 2:
        return (
            KernelWay.SDPA,
            f"compute-bound (max query_len {max_q} >= 512, {len(shapes)} row shape(s)): gather + SDPA",
        )
    return (
        KernelWay.TRITON,
        f"memory-bound or ragged (max query_len {max_q}, {len(shapes)} row shapes): in-place paged kernel",
    )


CAPABILITIES = Capabilities(
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_sizes=frozenset({64, 128}),
    kernel_block_sizes=(MultipleOf(16),),
    slot_mapping_dtypes=frozenset({torch.int64}),
    attention_modes=BASE_MODES,
    supports_gqa=True,
    supports_ulysses=True,
    supports_dcp=True,
    supports_graph_capture=True,
    kv_cache_dtypes=frozenset({torch.float8_e4m3fn}),
)
"""Per layer the backends only launch work (plans, row groups, DCP masks and device indices are
fixed in ``build``): a denoise step can be captured as a CUDA graph and replayed. Ulysses: the
backends see rank-local heads only. DCP: :meth:`CudaPagedBackend.forward_partial`. e4m3 pages
(``kv_cache_dtypes``): written and read by the Triton kernels only (quantised in the write,
converted in registers in the attention), so ``paged`` takes the Triton way for them and the
``sdpa`` backend, which would need a dequantised copy, does not declare them."""


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


class CudaPagedBackend(PagedBackend):
    """Writes with the Triton writer; attends in place or by gather + SDPA, chosen per batch."""

    name: ClassVar[str] = "paged"
    platform: ClassVar[str] = "cuda"
    priority: ClassVar[int] = 200
    description: ClassVar[str] = (
        "per batch: Triton in place (memory-bound, ragged) or gather + SDPA (query_len >= 512, <= 2 row shapes)"
    )
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    way: ClassVar[KernelWay | None] = None
    """A way to take for every batch; None decides per batch."""

    @classmethod
    def is_available(cls) -> Availability:
        found = cuda_available()
        if not found:
            return found
        triton = triton_available()
        if cls.way is KernelWay.TRITON and not triton:
            return triton
        return Availability(
            True, f"{found.reason}; " + (triton.reason if triton else f"SDPA only ({triton.reason})")
        )

    @classmethod
    def not_supported_reasons(cls, requirements: Requirements) -> list[str]:
        reasons = super().not_supported_reasons(requirements)
        quant = requirements.kv_cache_dtype not in (None, requirements.dtype)
        if quant and cls.way is not KernelWay.SDPA and not triton_available():
            reasons.append(
                f"kv_cache_dtype {requirements.kv_cache_dtype} needs Triton ({triton_available().reason})"
            )
        return reasons

    @classmethod
    def block_tables_cls(cls) -> type[BlockTables]:
        if triton_available():
            from diffusion_kv.platforms.cuda.block_tables import TritonBlockTables

            return TritonBlockTables
        return TorchBlockTables

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        self._bind_dcp()
        self.triton_ok = bool(triton_available())
        layer = group.layers[0]
        self.group_ratio = layer.num_heads // layer.num_kv_heads
        self.kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.num_sms = DEFAULT_NUM_SMS
        if group.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(group.device).multi_processor_count
        self.quantized = layer.cache_dtype is not None
        """e4m3 pages: every batch takes the Triton way (the only one reading them in place)."""
        self._plans: dict[tuple[tuple[int, ...], tuple[int, ...], torch.device], _BatchPlan] = {}
        self._cudnn_answers: dict[tuple[Any, ...], bool] = {}

    def _plan(self, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device) -> _BatchPlan:
        """The plan of one batch shape, made once: a batch of a shape seen before reuses it, its
        device tensors (tile schedule, row indices) included. They are never written after
        they are made, so a batch that holds them stays valid; preparing it again costs no
        allocation and no host-to-device copy."""
        key = (qsl, seq, device)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        if self.quantized:
            way, reason = KernelWay.TRITON, "e4m3 pages are read in place by the Triton kernel only"
        elif self.way is not None:
            way, reason = self.way, f"backend {self.name!r} always takes this way"
        else:
            lens = tuple(qsl[i + 1] - qsl[i] for i in range(len(seq)))
            way, reason = choose_way(lens, seq, triton_ok=self.triton_ok)
        if way is KernelWay.TRITON:
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
        """Query tiles and the split count; ``seq`` are the keys each row reads (this rank's
        under DCP)."""
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
        device = batch.query_start_loc.device
        if self.cp_size > 1:
            return self._build_dcp(batch, qsl, seq, device)
        plan = self._plan(qsl, seq, device)
        extra = plan.extra
        if plan.way is not KernelWay.TRITON:  # the page views depend on the placement, not only the shape
            g = self.group
            ratio, page = g.block_size // g.kernel_block_size, g.kernel_block_size
            extra = dict(
                sdpa_groups=sdpa_row_groups(
                    qsl, seq, device, batch.host_block_ids, ratio, page, shapes=plan.shapes
                )
            )
        return self._metadata(batch, qsl, seq, plan.way, plan.reason, extra)

    def _build_dcp(
        self, batch: PagedBatch, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device
    ) -> CudaPagedMetadata:
        """Under DCP each rank reads its local keys only: the schedule and row groups follow the
        rank-local lengths, and causal partials of the gather + SDPA way carry their mask."""
        host = batch.dcp_local_seq_lens_cpu
        if host is None:
            host = dcp_local_seq_lens(batch.seq_lens_cpu, self.cp_size, self.cp_rank, self.cp_interleave)
        local = tuple(int(x) for x in host.tolist())
        local_dev = batch.dcp_local_seq_lens
        if local_dev is None:
            local_dev = _to_device(host.to(torch.int32), device)
        lens = tuple(qsl[i + 1] - qsl[i] for i in range(len(seq)))
        if self.quantized:
            way, reason = KernelWay.TRITON, "e4m3 pages are read in place by the Triton kernel only"
        elif self.way is not None:
            way, reason = self.way, f"backend {self.name!r} always takes this way"
        else:
            way, reason = choose_way(lens, seq, triton_ok=self.triton_ok)
        extra: dict[str, Any]
        if way is KernelWay.TRITON:
            tile_row, tile_q0, block_m, block_n, splits = self._make_schedule(qsl, local, device)
            extra = dict(
                tile_row=tile_row,
                tile_q0=tile_q0,
                block_m=block_m,
                block_n=block_n,
                num_splits=splits,
                num_warps=8 if block_m >= 128 else 4,
            )
        else:
            g = self.group
            groups = sdpa_row_groups(
                qsl,
                seq,
                device,
                batch.host_block_ids,
                g.block_size // g.kernel_block_size,
                g.kernel_block_size,
                kv_lens=local,
            )
            if batch.causal:
                layer = g.layers[0]
                groups = tuple(
                    dcp_causal_mask(
                        grp,
                        self.group_ratio,
                        self.cp_size,
                        self.cp_rank,
                        self.cp_interleave,
                        layer.dtype,
                        device,
                    )
                    for grp in groups
                )
            extra = dict(sdpa_groups=groups)
        return self._metadata(batch, qsl, seq, way, reason, extra, local_dev)

    def _metadata(
        self,
        batch: PagedBatch,
        qsl: tuple[int, ...],
        seq: tuple[int, ...],
        way: KernelWay,
        reason: str,
        extra: dict[str, Any],
        local_seq_lens: torch.Tensor | None = None,
    ) -> CudaPagedMetadata:
        return CudaPagedMetadata(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=batch.slot_mapping,
            causal=batch.causal,
            page=self.group.kernel_block_size,
            host_query_start_loc=qsl,
            host_seq_lens=seq,
            way=way,
            reason=reason,
            local_seq_lens=local_seq_lens,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            cp_interleave=self.cp_interleave,
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
        k_cache, v_cache = key_value_caches(kv_cache)
        slots = slot_mapping[: key.shape[0]]
        if self.triton_ok:
            from diffusion_kv.platforms.cuda import kernels

            sc = layer.kv_scales
            if sc is not None:  # quantised in the write kernel itself
                kernels.write_kv(key, value, k_cache, v_cache, slots, sc.k_scale, sc.v_scale, sc.saturated)
            else:
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

    def write_kv_valid(
        self,
        layer: LayerGeometry,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Every slot is real: one indexed copy per cache (no launcher, no padding mask); e4m3
        pages take the Triton writer, which quantises in the same pass."""
        if layer.kv_scales is not None:
            self.write_kv(layer, key, value, kv_cache, slot_mapping)
            return
        k_cache, v_cache = key_value_caches(kv_cache)
        slots = slot_mapping[: key.shape[0]]
        write_pages(k_cache, slots, key)
        write_pages(v_cache, slots, value)

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: CudaPagedMetadata = metadata
        if md.cp_size > 1:
            raise ValidationError(
                f"cuda metadata is DCP-sharded (cp_size={md.cp_size}): attention over one rank's keys "
                "is partial; use forward_partial and merge across the DCP group"
            )
        if md.way is not KernelWay.TRITON:
            return self._gather_sdpa(layer, query, kv_cache, md, out)
        result = out if out is not None else torch.empty_like(query)
        self._triton(layer, query, kv_cache, md, result, None)
        return result

    def forward_partial(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over this DCP rank's keys: ``(out [T, H, D], lse [T, H] float32)``, the
        log-sum-exp in natural log, ``-inf`` (and ``out`` 0) where no local key is visible.
        Without DCP the local keys are all keys and ``out`` equals :meth:`forward`'s."""
        md: CudaPagedMetadata = metadata
        if md.way is not KernelWay.TRITON:
            return self._gather_sdpa_partial(layer, query, kv_cache, md)
        result = torch.empty_like(query)
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        self._triton(layer, query, kv_cache, md, result, lse)
        return result, lse

    def _triton(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: CudaPagedMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        from diffusion_kv.platforms.cuda import kernels

        k_cache, v_cache = key_value_caches(kv_cache)
        assert md.tile_row is not None and md.tile_q0 is not None
        kernels.paged_attention(
            query,
            k_cache,
            v_cache,
            out,
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
            lse=lse,
            local_seq_lens=md.local_seq_lens,
            cp_size=md.cp_size,
            cp_rank=md.cp_rank,
            cp_interleave=md.cp_interleave,
            k_scale=layer.kv_scales.k_scale if layer.kv_scales is not None else None,
            v_scale=layer.kv_scales.v_scale if layer.kv_scales is not None else None,
        )

    @staticmethod
    def _group_tensors(
        layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, md: CudaPagedMetadata, grp: SdpaRowGroup
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row group's ``q [R, ql, H, D]`` and ``k``/``v`` ``[R, keys, Hkv, D]`` (a view of the
        cache when its pages are contiguous, else gathered)."""
        hkv, hd = layer.num_kv_heads, layer.head_size
        qsl, rows, ql, keys = md.host_query_start_loc, grp.rows, grp.query_len, grp.keys
        nblk = cdiv(keys, md.page)
        R = len(rows)
        k_cache, v_cache = key_value_caches(kv_cache)
        if grp.view is not None:  # contiguous pages: a strided view of the cache, no gather
            at = (k_cache.data_ptr(), id(grp))
            cached = md.views.get(at)
            if cached is None:
                cached = md.views[at] = (
                    _row_view(k_cache, grp.view, R, nblk * md.page)[:, :keys],
                    _row_view(v_cache, grp.view, R, nblk * md.page)[:, :keys],
                )
            k, v = cached
        else:
            if grp.row_index is None:
                table = md.block_table[rows[0] : rows[0] + R, :nblk]
            else:
                table = md.block_table[grp.row_index, :nblk]
            flat = table.reshape(-1).long()
            k = k_cache.index_select(0, flat).view(R, nblk * md.page, hkv, hd)[:, :keys]
            v = v_cache.index_select(0, flat).view(R, nblk * md.page, hkv, hd)[:, :keys]
        if grp.contiguous:
            q = query[qsl[rows[0]] : qsl[rows[0]] + R * ql].view(R, ql, layer.num_heads, hd)
        else:
            q = torch.stack([query[qsl[r] : qsl[r] + ql] for r in rows])
        return q, k, v

    def _gather_sdpa_partial(
        self, layer: LayerGeometry, query: torch.Tensor, kv_cache: KVCache, md: CudaPagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather + SDPA with the log-sum-exp. The ``G`` query heads of each KV head are folded
        into the query sequence (``[R, Hkv, G * ql, D]``), so GQA needs no copy of K/V.

        Under DCP the causal masks were built at ``build``. Without DCP (a direct call: the core
        calls ``forward_partial`` only under DCP) a causal mask is built here, per call."""
        hkv, heads, hd = layer.num_kv_heads, layer.num_heads, layer.head_size
        per_kv = heads // hkv
        qsl = md.host_query_start_loc
        out = torch.zeros_like(query)  # rows without local keys keep out 0 and lse -inf
        lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=query.device)
        groups = md.sdpa_groups
        if md.cp_size == 1 and md.causal:
            groups = tuple(dcp_causal_mask(g, per_kv, 1, 0, 1, query.dtype, query.device) for g in groups)
        for grp in groups:
            q, k, v = self._group_tensors(layer, query, kv_cache, md, grp)
            R, ql, keys = len(grp.rows), grp.query_len, grp.keys
            qf = q.reshape(R, ql, hkv, per_kv, hd).permute(0, 2, 3, 1, 4).reshape(R, hkv, per_kv * ql, hd)
            bias = None if grp.bias is None else grp.bias.expand(R, hkv, per_kv * ql, keys)
            o, lg = sdpa_with_lse(qf, k.transpose(1, 2), v.transpose(1, 2), bias, layer.scale)
            o = o.reshape(R, hkv, per_kv, ql, hd).permute(0, 3, 1, 2, 4).reshape(R, ql, heads, hd)
            lg = lg.reshape(R, hkv, per_kv, ql).permute(0, 3, 1, 2).reshape(R, ql, heads)
            if grp.visible is not None:  # queries that see no local key: out 0, lse -inf
                o = torch.where(grp.visible[None, :, None, None], o, 0.0)
                lg = torch.where(grp.visible[None, :, None], lg, float("-inf"))
            if grp.contiguous:
                at = slice(qsl[grp.rows[0]], qsl[grp.rows[0]] + R * ql)
                out[at].view(R, ql, heads, hd).copy_(o)
                lse[at].view(R, ql, heads).copy_(lg)
            else:
                for i, r in enumerate(grp.rows):
                    out[qsl[r] : qsl[r] + ql] = o[i]
                    lse[qsl[r] : qsl[r] + ql] = lg[i]
        return out, lse

    def _cudnn_serves(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, gqa: bool
    ) -> bool:
        """Whether SDPA's cuDNN kernel takes these inputs (asked once per input signature)."""
        sig = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, is_causal, gqa)
        known = self._cudnn_answers.get(sig)
        if known is None:
            known = False
            if q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled():  # type: ignore[no-untyped-call]
                try:
                    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, is_causal, gqa)
                    known = bool(torch.backends.cuda.can_use_cudnn_attention(params))
                except (RuntimeError, TypeError):  # an older SDPAParams signature
                    known = False
            if len(self._cudnn_answers) >= 256:
                self._cudnn_answers.clear()
            self._cudnn_answers[sig] = known
        return known

    def _gather_sdpa(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        md: CudaPagedMetadata,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        hd = layer.head_size
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
            R = len(rows)
            contiguous = grp.contiguous
            q, k, v = self._group_tensors(layer, query, kv_cache, md, grp)
            mask: Any = None
            is_causal = False
            if md.causal and ql == sl:
                is_causal = True
            elif md.causal:
                # imported here: torch.nn.attention.bias pulls in torch's compiler stack (a second
                # or more on a first import), and only a causal call with fewer queries than keys
                # needs it
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(ql, sl)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            gqa = layer.num_heads != layer.num_kv_heads
            o: torch.Tensor
            if mask is None and self._cudnn_serves(qt, kt, vt, is_causal, gqa):
                # cuDNN's kernel called directly: the kernel SDPA's priority below would pick,
                # without the dispatcher's per-call backend selection on the host
                o = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qt, kt, vt, None, False, 0.0, is_causal, False, scale=layer.scale
                )[0]
            else:
                with sdpa_kernel(order, set_priority=True):
                    o = torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, attn_mask=mask, is_causal=is_causal, scale=layer.scale, enable_gqa=gqa
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
    way: ClassVar[KernelWay | None] = KernelWay.TRITON


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
        supports_ulysses=True,
        supports_dcp=True,
        supports_graph_capture=True,
    )
    way: ClassVar[KernelWay | None] = KernelWay.SDPA

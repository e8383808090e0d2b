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

import dataclasses
import functools
import importlib.util
from collections.abc import Hashable
from typing import Any, ClassVar, NamedTuple

import torch

from diffusion_kv.core.attention import AttentionMode
from diffusion_kv.core.backend import tensor_address
from diffusion_kv.core.batch import key_value_caches
from diffusion_kv.core.block_tables import BlockTables, TorchBlockTables
from diffusion_kv.core.capabilities import BASE_MODES
from diffusion_kv.core.kv_quant import is_unquantised
from diffusion_kv.core.layout import cdiv, pow2_at_least
from diffusion_kv.core.transfer import to_device
from diffusion_kv.platforms.interface import (
    Availability,
    Capabilities,
    GroupContext,
    KVCache,
    LayerGeometry,
    LayerRunner,
    MultipleOf,
    PagedBatch,
    Requirements,
)
from diffusion_kv.platforms.torch_sdpa import (  # the gather + SDPA way, shared with other plugins
    BIAS_ALIGN,
    CudaPagedMetadata,
    KernelWay,
    RowShapes,
    SdpaRowGroup,
    TorchSdpaBackend,
    contiguous_run,
    dcp_causal_mask,
    page_view,
    row_shapes,
    sdpa_row_groups,
    sdpa_with_lse,
)

__all__ = [
    "BIAS_ALIGN",
    "CAPABILITIES",
    "CudaPagedBackend",
    "CudaPagedMetadata",
    "CudnnPagedBackend",
    "KernelWay",
    "RowShapes",
    "SdpaPagedBackend",
    "SdpaRowGroup",
    "TritonPagedBackend",
    "choose_way",
    "contiguous_run",
    "cuda_available",
    "dcp_causal_mask",
    "page_view",
    "row_shapes",
    "sdpa_row_groups",
    "sdpa_with_lse",
    "triton_available",
]

SPLIT_CHOICES = (1, 2, 4, 8, 16, 32)
RESIDENT_PROGRAMS = {16: 8, 32: 8, 64: 4, 128: 2}
"""Paged-attention programs one SM runs at once, by query-tile rows (H200, head size 128, 2
stages); 128-row tiles at 3-4 stages fit once."""
DEFAULT_NUM_SMS = 132
PLAN_CACHE_SIZE = 64
"""Batch plans (way, tile schedule or row shapes) a backend keeps, by batch shape (the oldest
is dropped first)."""
_GRAPH_PATH = (
    "build",
    "forward",
    "forward_partial",
    "forward_partial_extra",
    "forward_extra_keys",
    "write_kv",
    "write_kv_valid",
    "bind_layer",
    "bind_layer_like",
    "_triton",
    "_schedule",
    "_make_schedule",
)
"""The methods :meth:`CudaPagedBackend.graph_key` vouches for: a subclass overriding one gets None."""


@functools.cache
def _keeps_graph_path(cls: type) -> bool:
    """Whether ``cls`` runs :class:`CudaPagedBackend`'s own :data:`_GRAPH_PATH` (asked once per
    class, not per batch)."""
    return all(getattr(cls, name) is getattr(CudaPagedBackend, name) for name in _GRAPH_PATH)


class _BatchPlan(NamedTuple):
    """What :meth:`CudaPagedBackend.build` decides from a batch's lengths alone."""

    way: KernelWay
    reason: str
    extra: dict[str, Any]
    """The in-place way's tile schedule and launch settings (CudaPagedMetadata fields)."""
    shapes: RowShapes
    """The gather + SDPA way's row shapes."""


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


SDPA_MIN_QUERY = 512
"""Rows with at least this many queries are compute-bound: cuDNN's attention beats the Triton
kernel there (regime A: the Triton kernel runs at about half cuDNN's rate)."""
SDPA_MAX_ROW_SHAPES = 2
"""At most this many distinct (query, key) row shapes take the gather + SDPA way (one cuDNN call
per shape and layer); a batch of more shapes takes the in-place kernel. A continuous batch that
mixes requests (prefill and denoise rows of several prefix and target lengths: up to six shapes
in the stream bench) therefore runs in place, while each
request alone (one or two shapes) takes cuDNN. Measured on an H100 (``docs/cuda.md``): on the
stream's largest mixed step the in-place kernel takes 1.03x dense cuDNN called row by row, and
gather + cuDNN per shape 1.26x (``benchmarks/probe_mixed_batch.py``); a cap of eight shapes made
the stream slower (``benchmarks/stream_way_rule.py``)."""
SDPA_MIN_LONG_SHARE = 0.0
"""The gather + SDPA way only when rows of at least :data:`SDPA_MIN_QUERY` queries hold this
share of the batch's queries (0: any share, the rule as measured; a higher cap on row shapes
would want one, so that a batch of many short rows stays in place)."""


def choose_way(
    query_lens: tuple[int, ...], seq_lens: tuple[int, ...], *, triton_ok: bool
) -> tuple[KernelWay, str]:
    """``(way, reason)`` for one batch: in place (Triton) or gather + SDPA."""
    if not triton_ok:
        return KernelWay.SDPA, "Triton is not importable"
    max_q = max(query_lens)
    shapes = set(zip(query_lens, seq_lens, strict=True))
    long_share = sum(q for q in query_lens if q >= SDPA_MIN_QUERY) / max(1, sum(query_lens))
    if max_q >= SDPA_MIN_QUERY and len(shapes) <= SDPA_MAX_ROW_SHAPES and long_share >= SDPA_MIN_LONG_SHARE:
        return (
            KernelWay.SDPA,
            f"compute-bound (max query_len {max_q} >= {SDPA_MIN_QUERY}, {long_share:.0%} of the queries in such "
            f"rows, {len(shapes)} row shape(s)): gather + SDPA",
        )
    return (
        KernelWay.TRITON,
        f"memory-bound or ragged (max query_len {max_q}, {long_share:.0%} of the queries in rows of >= "
        f"{SDPA_MIN_QUERY}, {len(shapes)} row shapes): in-place paged kernel",
    )


CAPABILITIES = Capabilities(
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_sizes=frozenset({64, 128}),
    kernel_block_sizes=(MultipleOf(16),),
    slot_mapping_dtypes=frozenset({torch.int64}),
    attention_modes=BASE_MODES | {AttentionMode.CHUNK_CAUSAL},
    supports_gqa=True,
    supports_ulysses=True,
    supports_dcp=True,
    supports_graph_capture=True,
    kv_cache_dtypes=frozenset({torch.float8_e4m3fn}),
    max_window=None,
    max_sink=None,
)
"""Per layer the backends only launch work (plans, row groups, DCP masks and device indices are
fixed in ``build``): a denoise step can be captured as a CUDA graph and replayed. Ulysses: the
backends see rank-local heads only. DCP: :meth:`CudaPagedBackend.forward_partial`. e4m3 pages
(``kv_cache_dtypes``): written by the Triton writer (quantised in the write); the Triton kernel
reads them in place (converted in registers or fed to fp8 MMAs), and ``paged``'s gather + SDPA way
(compute-bound batches, as for 16-bit pages) gathers them into a 16-bit copy dequantised in the
same pass (``kernels.gather_dequant``) before cuDNN; the ``sdpa`` backend does not declare them,
and under DCP e4m3 pages always take the Triton way. Chunk-causal,
windowed and sink masks (``attention_modes``, ``max_window``, ``max_sink``): the Triton kernel
computes each query's bounds from its position in-kernel and loads only the key tiles of the
sink and the window; the gather + SDPA way gathers only the block plan's live blocks (both fixed
at ``build``, no host work per layer); not with DCP (refused with that reason)."""


class CudaPagedBackend(TorchSdpaBackend):
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
        quant = not is_unquantised(requirements.kv_cache_dtype, requirements.dtype)
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
        self.triton_ok = bool(triton_available())
        layer = group.layers[0]
        self.num_sms = DEFAULT_NUM_SMS
        if group.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(group.device).multi_processor_count
        self.quantized = layer.cache_dtype is not None
        """e4m3 pages: the Triton kernel reads them in place; the gather + SDPA way (compute-bound
        batches of ``paged``) reads a 16-bit copy dequantised in its gather."""
        self._plans: dict[tuple[tuple[int, ...], tuple[int, ...], torch.device], _BatchPlan] = {}
        self._schedules: dict[tuple[tuple[int, ...], tuple[int, ...], torch.device], dict[str, Any]] = {}

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
            if self.quantized and way is KernelWay.SDPA:
                reason += " (e4m3 pages dequantised into a 16-bit copy in the gather, one pass)"
        if way is KernelWay.TRITON:
            extra: dict[str, Any] = self._schedule(qsl, seq, device)
            plan = _BatchPlan(way, reason, extra, ())
        else:
            plan = _BatchPlan(way, reason, {}, row_shapes(qsl, seq, device))
        if len(self._plans) >= PLAN_CACHE_SIZE:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def _keys_read(self, qsl: tuple[int, ...], seq: tuple[int, ...]) -> tuple[int, ...]:
        """Per row, about the keys the kernel's query tiles read (what split-KV divides):
        under a window mask the sink and the window of the row's last query, widened by the
        queries before it in other chunks (the window ends at the query's chunk, or at the
        query itself), however far the row's absolute length has grown or was compacted to
        (the key tiles between sink and window are never read); else the row's length."""
        mask = self.group.mask
        if mask.window is None:
            return seq
        reach = mask.sink + mask.window - (mask.chunk or 1)
        return tuple(min(s, reach + max(qsl[i + 1] - qsl[i], mask.chunk or 1)) for i, s in enumerate(seq))

    def _schedule(self, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device) -> dict[str, Any]:
        """:meth:`_make_schedule` of the keys the rows read, made once per (query lengths, keys
        read): batches that differ only in how far their windows have slid -- a session's
        chunks once the window has filled -- share one schedule, its device tensors included
        (what lets one CUDA graph serve them all, :meth:`graph_key`)."""
        reads = self._keys_read(qsl, seq)
        key = (qsl, reads, device)
        hit = self._schedules.get(key)
        if hit is None:
            hit = self._make_schedule(qsl, reads, device)
            if len(self._schedules) >= PLAN_CACHE_SIZE:
                del self._schedules[next(iter(self._schedules))]
            self._schedules[key] = hit
        return hit

    def graph_key(self, metadata: Any) -> Hashable | None:
        """The Triton way's launches (write and attention kernels) read the batch's metadata
        tensors only -- views of the Triton BlockTables' persistent buffers and the shared
        schedule -- and take their host values from the schedule: a key of those. The gather +
        SDPA way makes its indices and views per batch, and decode context parallelism its
        local lengths: None. So does a subclass that overrides the per-layer path."""
        md = metadata
        if not isinstance(md, CudaPagedMetadata) or md.way is not KernelWay.TRITON or md.cp_size > 1:
            return None
        if not _keeps_graph_path(type(self)):
            return None
        assert md.tile_row is not None and md.tile_q0 is not None
        return (
            "triton",
            tensor_address(md.query_start_loc),
            tensor_address(md.seq_lens),
            tensor_address(md.block_table),
            tensor_address(md.slot_mapping),
            tensor_address(md.tile_row),
            tensor_address(md.tile_q0),
            md.causal,
            md.page,
            md.block_m,
            md.block_n,
            md.num_splits,
            md.num_warps,
            md.num_stages,
        )

    def _make_schedule(
        self, qsl: tuple[int, ...], seq: tuple[int, ...], device: torch.device
    ) -> dict[str, Any]:
        """Query tiles and launch settings (CudaPagedMetadata fields); ``seq`` are the keys each
        row reads (this rank's under DCP)."""
        lens = [qsl[i + 1] - qsl[i] for i in range(len(seq))]
        max_q = max(lens)
        block_m = min(
            128 if max_q * self.group_ratio >= 128 else pow2_at_least(max_q * self.group_ratio, 16), 128
        )
        block_m = max(block_m, pow2_at_least(self.group_ratio, 16))
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
        stages = 2
        resident = RESIDENT_PROGRAMS.get(block_m, 2)
        if block_m >= 128 and self.quantized:
            # e4m3 pages: a 128-key tile is the bytes of a 64-key 16-bit one; 3 stages, the
            # next page id fetched ahead (H100 sweep, benchmarks/sweep_gqa_fp8.py)
            block_n, stages, resident = 128, 3, 1
        elif self.quantized:
            # e4m3 pages in small query tiles (MHA over a few queries): 128-key tiles at 3
            # stages, and fewer splits the better (H100, sweep_gqa_fp8.py --mha: 2 splits 0.240
            # ms, 4 splits 0.274, 8 splits 0.298 at 256 programs); two such programs fit an SM
            block_n, stages, resident = 128, 3, 2
        elif block_m >= 128 and programs < resident * self.num_sms:
            # few 128-row tiles (GQA heads packed over a few query tokens, regime B): deeper
            # pipelining of the page loads, one program per SM
            stages, resident = 4, 1
        elif block_m >= 128 and self.head_size <= 128:
            # many 128-row tiles (long queries, regime A): a third stage, the next page id
            # fetched ahead (H100 sweep, benchmarks/tune_cuda_paged.py: 1.32-1.38 ms against
            # 1.61-1.74 at two stages, bf16, 24 heads x 4096 queries over 6144 keys)
            stages, resident = 3, 1
        # Split the keys until the launch roughly fills every SM with as many programs as fit
        # at once (fewer fit as the query tile grows or the pipeline deepens); tuned on an H200
        # with benchmarks/tune_cuda_paged.py and on an H100 with benchmarks/sweep_gqa_fp8.py
        # (docs/benchmarks.md).
        target = int(0.9 * self.num_sms * resident)
        splits = 1
        for s in SPLIT_CHOICES:
            splits = s
            if programs * s >= target or cdiv(max_keys, s) <= 4 * block_n:
                break
        sched = to_device(torch.tensor([rows, q0s], dtype=torch.int32), device)
        return dict(
            tile_row=sched[0],
            tile_q0=sched[1],
            block_m=block_m,
            block_n=block_n,
            num_splits=splits,
            num_warps=8 if block_m >= 128 else 4,
            num_stages=stages,
        )

    def build(self, batch: PagedBatch) -> CudaPagedMetadata:
        qsl = tuple(batch.query_start_loc_cpu.tolist())
        seq = tuple(batch.seq_lens_cpu.tolist())
        device = batch.query_start_loc.device
        if self.cp_size > 1:
            return self._build_dcp(batch, qsl, seq, device)
        plan = self._plan(qsl, seq, device)
        extra = plan.extra
        if plan.way is not KernelWay.TRITON and batch.block_plan is not None:  # live blocks only
            extra = dict(
                sdpa_groups=self._placed(batch, self._planned_groups(batch, qsl, seq, device), device)
            )
        elif plan.way is not KernelWay.TRITON:  # the page views depend on the placement, not only the shape
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
        local, local_dev = self._dcp_local(batch, device)
        lens = tuple(qsl[i + 1] - qsl[i] for i in range(len(seq)))
        if self.quantized:
            way, reason = KernelWay.TRITON, "e4m3 pages under DCP: read in place by the Triton kernel"
        elif self.way is not None:
            way, reason = self.way, f"backend {self.name!r} always takes this way"
        else:
            way, reason = choose_way(lens, seq, triton_ok=self.triton_ok)
        extra: dict[str, Any]
        if way is KernelWay.TRITON:
            extra = self._make_schedule(qsl, local, device)
        else:
            groups = self._dcp_sdpa_groups(batch, qsl, seq, local, device)
            extra = dict(sdpa_groups=groups)
        return self._metadata(batch, qsl, seq, way, reason, extra, local_dev)

    @staticmethod
    def _gather_dequantized(
        cache: torch.Tensor,
        index: torch.Tensor,
        rows: int,
        keys: int,
        scale: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """e4m3 pages gathered and dequantised in one Triton pass (page bytes read once, the
        16-bit copy written once). Triton is there: a backend of this class serves e4m3 pages
        only with it (:meth:`not_supported_reasons`)."""
        from diffusion_kv.platforms.cuda import kernels

        return kernels.gather_dequant(cache, index, rows, keys, scale, dtype)

    @staticmethod
    def _dequantized(pages: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """e4m3 pages (a strided view) dequantised into a contiguous copy in one Triton pass."""
        from diffusion_kv.platforms.cuda import kernels

        return kernels.dequant(pages, scale, dtype)

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
        super().write_kv(layer, key, value, kv_cache, slot_mapping)  # without Triton: torch, no host sync

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: CudaPagedMetadata = metadata
        if md.way is not KernelWay.TRITON or md.cp_size > 1:  # the SDPA way, and the DCP refusal
            return super().forward(layer, query, kv_cache, md, out)
        result = out if out is not None else torch.empty_like(query)
        self._triton(layer, query, kv_cache, md, result, None)
        return result

    def bind_layer(
        self, layer: LayerGeometry, kv_cache: KVCache, metadata: Any, slot_mapping: torch.Tensor
    ) -> LayerRunner | None:
        """The SDPA way's recorded call (``TorchSdpaBackend.bind_layer``); the Triton way binds
        nothing (each call launches the kernel over the batch's schedule)."""
        if type(self).forward is not CudaPagedBackend.forward:
            return None
        md = metadata
        if not isinstance(md, CudaPagedMetadata) or md.way is KernelWay.TRITON:
            return None
        return self._bind_sdpa(layer, kv_cache, md, slot_mapping)

    def bind_layer_like(
        self,
        layer: LayerGeometry,
        kv_cache: KVCache,
        metadata: Any,
        slot_mapping: torch.Tensor,
        like: LayerGeometry,
        like_kv_cache: KVCache,
    ) -> LayerRunner | None:
        """The SDPA way's recorded call of the twin layer over this layer's cache
        (``TorchSdpaBackend.bind_layer_like``); the Triton way binds nothing."""
        if type(self).forward is not CudaPagedBackend.forward:
            return None
        md = metadata
        if not isinstance(md, CudaPagedMetadata) or md.way is KernelWay.TRITON:
            return None
        return self._bind_sdpa_like(layer, kv_cache, md, slot_mapping, like_kv_cache)

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
        mask = self.group.mask
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
            num_stages=md.num_stages,
            lse=lse,
            local_seq_lens=md.local_seq_lens,
            cp_size=md.cp_size,
            cp_rank=md.cp_rank,
            cp_interleave=md.cp_interleave,
            k_scale=layer.kv_scales.k_scale if layer.kv_scales is not None else None,
            v_scale=layer.kv_scales.v_scale if layer.kv_scales is not None else None,
            chunk=mask.chunk,
            window=mask.window,
            sink=mask.sink,
        )


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
        max_window=None,
        max_sink=None,
    )
    way: ClassVar[KernelWay | None] = KernelWay.SDPA


class CudnnPagedBackend(CudaPagedBackend):
    """``paged``'s ways, except that compute-bound batches of full attention over 16-bit pages
    take cuDNN's own paged SDPA, reading the pages in place (:mod:`.cudnn_paged`; needs the cuDNN
    frontend's Python package and cuDNN 9.5 or later). Below ``paged`` in priority: chosen by
    name (``DIFFUSION_KV_BACKEND=cuda:cudnn``) until measured end to end."""

    name: ClassVar[str] = "cudnn"
    priority: ClassVar[int] = 90
    description: ClassVar[str] = (
        "cuDNN's paged SDPA in place for compute-bound full attention (cuDNN frontend), else as paged"
    )
    capabilities: ClassVar[Capabilities] = dataclasses.replace(CAPABILITIES, supports_graph_capture=False)
    """``paged``'s, without CUDA-graph capture (a cuDNN graph's execution under capture is not
    yet tested). Batches cuDNN does not take (causal, chunked or windowed masks, e4m3 pages,
    DCP, memory-bound shapes) are served by ``paged``'s ways."""

    @classmethod
    def is_available(cls) -> Availability:
        from diffusion_kv.platforms.cuda.cudnn_paged import cudnn_paged_available

        found = super().is_available()
        if not found:
            return found
        cudnn = cudnn_paged_available()
        if not cudnn:
            return cudnn
        return Availability(True, f"{found.reason}; {cudnn.reason}")

    def __init__(self, group: GroupContext) -> None:
        super().__init__(group)
        from diffusion_kv.platforms.cuda.cudnn_paged import CudnnGraphs

        self.cudnn_graphs = CudnnGraphs()

    def cudnn_serves(self, batch: PagedBatch, query_lens: tuple[int, ...]) -> bool:
        """Whether cuDNN's paged SDPA takes this batch: full attention with no block plan, 16-bit
        pages of the kernel block size (cuDNN's page table indexes the cache's own pages), no
        DCP, every row with queries, and compute-bound (a row of at least
        :data:`SDPA_MIN_QUERY` queries; memory-bound batches keep the split-KV kernel). Decided
        here once per batch: the layers' calls check nothing more."""
        g = self.group
        return (
            batch.mode is AttentionMode.FULL
            and batch.block_plan is None
            and self.cp_size == 1
            and not self.quantized
            and g.block_size == g.kernel_block_size
            and min(query_lens) > 0
            and max(query_lens) >= SDPA_MIN_QUERY
        )

    def build(self, batch: PagedBatch) -> CudaPagedMetadata:
        md = super().build(batch)
        qsl, seq = md.host_query_start_loc, md.host_seq_lens
        lens = tuple(qsl[i + 1] - qsl[i] for i in range(len(seq)))
        if not self.cudnn_serves(batch, lens):
            return md
        from diffusion_kv.platforms.cuda.cudnn_paged import make_batch

        uniform = min(lens) == max(lens)
        exact = uniform and self.cudnn_graphs.admit_exact(len(lens), lens[0])
        plan = make_batch(lens, seq, md.block_table, md.page, exact_uniform=exact)
        return dataclasses.replace(
            md,
            extra={**md.extra, "cudnn": plan},
            reason="full attention, compute-bound: cuDNN's paged SDPA in place",
        )

    def forward(
        self,
        layer: LayerGeometry,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: Any,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md: CudaPagedMetadata = metadata
        plan = md.extra.get("cudnn")
        if plan is None:
            return super().forward(layer, query, kv_cache, md, out)
        k_cache, v_cache = key_value_caches(kv_cache)
        q = query if query.is_contiguous() else query.contiguous()
        result = out if out is not None and out.is_contiguous() else torch.empty_like(q)
        self.cudnn_graphs.attend(plan, q, k_cache, v_cache, result, layer.scale)
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

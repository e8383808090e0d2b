"""cuDNN's own paged SDPA: queries attend over the K/V pages in place, through per-row page tables.

cuDNN 9.5 and later run scaled dot-product attention over a paged K/V cache (its SDPA node with
page tables), reached from Python through the cuDNN frontend's package (``import cudnn``,
``pip install nvidia-cudnn-frontend``; a separate package from the cuDNN library torch ships).
Measured on an H100 (``docs/benchmarks.md``, fifteenth and sixteenth sessions): through the
``cudnn`` backend, 1.01-1.17x dense SDPA in the image regime over shuffled 128-token pages,
where ``paged``'s gather takes 1.09-1.19x in the same runs; the probe's graph took 0.78x
dense-per-row on a continuous batch of mixed rows.

This module builds and caches the cuDNN graphs; :class:`~diffusion_kv.platforms.cuda.backend.CudnnPagedBackend`
decides which batches take them. One graph serves every batch with the same row count,
bucketed query and key maxima and cache geometry: the per-row lengths, the page tables and
the queries' ragged offsets are the graph's inputs, device tensors made once per batch.

* Queries and outputs are ``[tokens, H, D]`` rows packed along the token axis. Where every row
  has the same number of queries (the image regime), the graph is built for exactly that many
  and reads them as a dense ``[rows, H, q, D]`` tensor (for the first :data:`EXACT_SHAPES`
  such shapes a backend meets); otherwise the maximum is bucketed and
  the rows are ragged (row ``i`` starts at element ``cum_q[i] * H * D``), padded query
  positions neither read nor written.
* The caches are ``[blocks, page, Hkv, D]`` (any strides), described to cuDNN as
  ``[blocks, Hkv, page, D]``; the page table is the batch's ``[rows, width]`` block table.
* Full (bidirectional) attention only; GQA by cuDNN's own head grouping.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_kv.core.layout import pow2_at_least
from diffusion_kv.core.transfer import to_device
from diffusion_kv.platforms.interface import Availability

MIN_CUDNN_VERSION = 90500
"""cuDNN's paged SDPA arrived in 9.5.0."""
GRAPHS_CACHED = 32
"""Graphs a backend keeps (the oldest dropped first); a graph build takes 65 ms and up."""
EXACT_SHAPES = 8
"""Uniform ``(rows, queries)`` shapes a backend builds exact graphs for; later ones take the
bucketed, ragged graphs, so a stream of ever-new lengths does not build a graph per length."""
MIN_QUERY_BUCKET = 64


def cudnn_paged_available() -> Availability:
    """Whether cuDNN's paged SDPA can run here (CUDA itself is the caller's check): the cuDNN
    frontend's Python package and torch's cuDNN at least 9.5, with the reason."""
    if importlib.util.find_spec("cudnn") is None:
        return Availability(
            False, "the cuDNN frontend's Python package is not installed (pip install nvidia-cudnn-frontend)"
        )
    try:
        import cudnn  # type: ignore[import-not-found]
    except Exception as exc:  # a broken install is a reason, not a crash
        return Availability(False, f"the cuDNN frontend failed to import: {type(exc).__name__}: {exc}")
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None  # type: ignore[no-untyped-call]
    if version is None or version < MIN_CUDNN_VERSION:
        return Availability(
            False, f"torch's cuDNN is {version}; paged SDPA needs {MIN_CUDNN_VERSION} or later"
        )
    return Availability(True, f"cuDNN {version}, frontend {getattr(cudnn, '__version__', '?')}")


@dataclass
class CudnnBatch:
    """One batch's inputs to the graph (device tensors made once, at ``build``)."""

    rows: int
    max_q: int
    """The query maximum the graph is built for (bucketed, or exact for uniform rows)."""
    max_kv: int
    """The key maximum the graph is built for (bucketed, at most the table's width in keys)."""
    seq_q: torch.Tensor
    """``[rows, 1, 1, 1]`` int32 queries per row."""
    seq_kv: torch.Tensor
    """``[rows, 1, 1, 1]`` int32 keys per row."""
    cum_q: torch.Tensor
    """``[rows + 1]`` int32 cumulative queries."""
    table: torch.Tensor
    """``[rows, 1, width, 1]`` int32 page table (a view of the batch's block table)."""
    ragged: bool = True
    """Whether rows differ in queries (ragged offsets); False: every row has ``max_q``."""
    offsets: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per elements per token (``H * D``), the ragged offsets ``[rows + 1, 1, 1, 1]`` (made by
    the batch's first call with that geometry)."""

    def offsets_for(self, per_token: int) -> torch.Tensor:
        got = self.offsets.get(per_token)
        if got is None:
            got = self.offsets[per_token] = (self.cum_q * per_token).view(self.rows + 1, 1, 1, 1)
        return got


def make_batch(
    query_lens: tuple[int, ...],
    seq_lens: tuple[int, ...],
    block_table: torch.Tensor,
    page: int,
    *,
    exact_uniform: bool = True,
) -> CudnnBatch:
    """The graph inputs of one batch: lengths and offsets in one host-to-device copy (pinned,
    not blocking), the page table as a view. Rows of one query count take a graph for exactly
    that count, without ragged offsets, unless ``exact_uniform`` is False."""
    rows = len(query_lens)
    width = block_table.shape[1]
    cum = [0]
    for q in query_lens:
        cum.append(cum[-1] + q)
    host = torch.tensor([*query_lens, *seq_lens, *cum], dtype=torch.int32)
    device = block_table.device
    lengths = to_device(host, device)
    table = block_table if block_table.is_contiguous() else block_table.contiguous()
    uniform = exact_uniform and min(query_lens) == max(query_lens)
    return CudnnBatch(
        rows=rows,
        max_q=query_lens[0] if uniform else pow2_at_least(max(query_lens), MIN_QUERY_BUCKET),
        max_kv=min(pow2_at_least(max(seq_lens), page), width * page),
        seq_q=lengths[:rows].view(rows, 1, 1, 1),
        seq_kv=lengths[rows : 2 * rows].view(rows, 1, 1, 1),
        cum_q=lengths[2 * rows :],
        table=table.view(rows, 1, width, 1),
        ragged=not uniform,
    )


_HANDLES: dict[int, Any] = {}
_LOCK = threading.Lock()


def _handle(cudnn: Any, device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _HANDLES.get(index)
    if handle is None:  # the lock only for the first call on a device
        with _LOCK:
            handle = _HANDLES.get(index)
            if handle is None:
                with torch.cuda.device(index):
                    handle = _HANDLES[index] = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    return handle


@dataclass
class _Graph:
    graph: Any
    tensors: dict[str, Any]
    workspace: torch.Tensor


class CudnnGraphs:
    """A backend's cuDNN graphs, by everything a graph bakes in (row count, bucketed maxima,
    head geometry, dtype, the caches' shape and strides, the table's width, the scale)."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[Any, ...], _Graph] = {}
        self._exact: set[tuple[int, int]] = set()
        self.builds = 0

    def admit_exact(self, rows: int, queries: int) -> bool:
        """Whether uniform rows of this shape take an exact graph (:data:`EXACT_SHAPES`)."""
        shape = (rows, queries)
        if shape in self._exact:
            return True
        if len(self._exact) >= EXACT_SHAPES:
            return False
        self._exact.add(shape)
        return True

    def attend(
        self,
        batch: CudnnBatch,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """``out [T, H, D]`` = attention of ``query [T, H, D]`` (both contiguous) over the
        pages of ``k_cache``/``v_cache`` ``[blocks, page, Hkv, D]``."""
        import cudnn

        _, heads, d = query.shape
        kv_heads = k_cache.shape[2]
        key = (
            batch.rows,
            batch.max_q,
            batch.ragged,
            batch.max_kv,
            heads,
            kv_heads,
            d,
            query.dtype,
            tuple(k_cache.shape),
            tuple(k_cache.stride()),
            tuple(v_cache.stride()),
            batch.table.shape[2],
            float(scale),
            query.device,
        )
        handle = _handle(cudnn, query.device)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._build(
                cudnn, handle, batch, heads, kv_heads, d, query.dtype, k_cache, v_cache, scale
            )
            if len(self._graphs) >= GRAPHS_CACHED:
                del self._graphs[next(iter(self._graphs))]
            self._graphs[key] = entry
        t = entry.tensors
        pack = {
            t["q"]: query,
            t["k"]: k_cache,
            t["v"]: v_cache,
            t["seq_q"]: batch.seq_q,
            t["seq_kv"]: batch.seq_kv,
            t["table_k"]: batch.table,
            t["table_v"]: batch.table,
            t["o"]: out,
        }
        if batch.ragged:
            pack[t["q_off"]] = pack[t["o_off"]] = batch.offsets_for(heads * d)
        entry.graph.execute(pack, entry.workspace, handle=handle)

    def _build(
        self,
        cudnn: Any,
        handle: Any,
        batch: CudnnBatch,
        heads: int,
        kv_heads: int,
        d: int,
        dtype: torch.dtype,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> _Graph:
        io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        i32 = cudnn.data_type.INT32
        g = cudnn.pygraph(
            io_data_type=io,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        rows, max_q, width = batch.rows, batch.max_q, batch.table.shape[2]
        blocks, page = k_cache.shape[0], k_cache.shape[1]
        token_major = [max_q * heads * d, d, heads * d, 1]
        t: dict[str, Any] = {}
        t["q"] = g.tensor(name="q", dim=[rows, heads, max_q, d], stride=token_major, data_type=io)

        def cache(name: str, c: torch.Tensor) -> Any:
            s = c.stride()  # [blocks, page, Hkv, D] memory as [blocks, Hkv, page, D]
            return g.tensor(
                name=name, dim=[blocks, kv_heads, page, d], stride=[s[0], s[2], s[1], s[3]], data_type=io
            )

        t["k"], t["v"] = cache("k", k_cache), cache("v", v_cache)
        one = [1, 1, 1, 1]
        t["seq_q"] = g.tensor(name="seq_q", dim=[rows, 1, 1, 1], stride=one, data_type=i32)
        t["seq_kv"] = g.tensor(name="seq_kv", dim=[rows, 1, 1, 1], stride=one, data_type=i32)
        table_stride = [width, width, 1, 1]
        t["table_k"] = g.tensor(name="table_k", dim=[rows, 1, width, 1], stride=table_stride, data_type=i32)
        t["table_v"] = g.tensor(name="table_v", dim=[rows, 1, width, 1], stride=table_stride, data_type=i32)
        if batch.ragged:
            t["q_off"] = g.tensor(name="q_off", dim=[rows + 1, 1, 1, 1], stride=one, data_type=i32)
            t["q"].set_ragged_offset(t["q_off"])
        kwargs: dict[str, Any] = dict(
            name="sdpa",
            q=t["q"],
            k=t["k"],
            v=t["v"],
            attn_scale=scale,
            use_padding_mask=True,
            seq_len_q=t["seq_q"],
            seq_len_kv=t["seq_kv"],
            paged_attention_k_table=t["table_k"],
            paged_attention_v_table=t["table_v"],
            paged_attention_max_seq_len_kv=batch.max_kv,
        )
        try:
            o, _ = g.sdpa(generate_stats=False, **kwargs)
        except TypeError:  # frontends before 1.10 name it is_inference
            o, _ = g.sdpa(is_inference=True, **kwargs)
        o.set_output(True).set_dim([rows, heads, max_q, d]).set_stride(token_major).set_data_type(io)
        if batch.ragged:
            t["o_off"] = g.tensor(name="o_off", dim=[rows + 1, 1, 1, 1], stride=one, data_type=i32)
            o.set_ragged_offset(t["o_off"])
        t["o"] = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        workspace = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=k_cache.device)
        self.builds += 1
        return _Graph(g, t, workspace)

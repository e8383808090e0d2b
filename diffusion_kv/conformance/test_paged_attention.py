"""Conformance cases: paged attention through one backend of a platform equals dense attention.

Every case builds a worker through :class:`PagedHarness` with the backend under test forced
(``dkv_backend``), runs paged layers, and compares with :func:`dense_attention` computed here.
What runs is derived from the backend's declared capabilities; cases needing something it does
not declare are skipped with its own reasons, and ``test_declared_capability_matrix`` sweeps
every declared dtype, head size (bounded), slot dtype and GQA ratio (1, 2, the largest declared).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import pytest
import torch

from diffusion_kv.conformance.harness import CapturePartials, PagedHarness
from diffusion_kv.conformance.plugin import MATRIX
from diffusion_kv.conformance.reference import dense_attention, mismatch, row_mask, tolerance
from diffusion_kv.core.allocation import NULL_BLOCK, RequestAllocation, SequenceAllocation
from diffusion_kv.core.allocator import DiffusionKVAllocator, FreeListPool
from diffusion_kv.core.attention import MaskSpec
from diffusion_kv.core.backend import KVPageLayout, PagedBackend
from diffusion_kv.core.batch import KVCache, key_value_caches
from diffusion_kv.core.capabilities import dtype_name
from diffusion_kv.core.errors import (
    DiffusionKVError,
    GenerationError,
    StaleBatchError,
    StateError,
    ValidationError,
)
from diffusion_kv.core.kv_quant import FP8_E4M3, FP8_MAX, fake_quantize, quantize
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.layout import cdiv
from diffusion_kv.core.parallel import merge_partial_attention
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.core.sessions import Chunk, Session, SessionCache, SessionPolicy
from diffusion_kv.platforms.interface import AttentionMode, Platform, Requirements

DTYPE_PREFERENCE = (torch.float32, torch.float16, torch.bfloat16)
Backend = type[PagedBackend]


def pick_dtype(backend: Backend) -> torch.dtype:
    for dtype in DTYPE_PREFERENCE:
        if dtype in backend.capabilities.dtypes:
            return dtype
    pytest.skip(f"{backend.name}: declares none of {[dtype_name(d) for d in DTYPE_PREFERENCE]}")


def pick_head_size(backend: Backend) -> int:
    sizes = backend.capabilities.head_sizes
    return 64 if sizes is None or 64 in sizes else min(sizes)


def pick_block_size(platform: Platform, backend: Backend) -> int:
    """The platform's default block size when the backend serves it, else the backend's own."""
    caps = backend.capabilities
    if caps.supports_block_size(platform.default_block_size):
        return platform.default_block_size
    rule = caps.kernel_block_sizes[0]
    return rule if isinstance(rule, int) else -(-16 // rule.base) * rule.base


def reasons_against(platform: Platform, backend: Backend, **req: object) -> list[str]:
    return platform.backend_reasons(backend, Requirements(**req))  # type: ignore[arg-type]


def require(platform: Platform, backend: Backend, **req: object) -> None:
    reasons = reasons_against(platform, backend, **req)
    if reasons:
        pytest.skip(f"{platform.name}:{backend.name}: unsupported ({'; '.join(reasons)})")


def harness(platform: Platform, backend: Backend, **kw: object) -> PagedHarness:
    kw.setdefault("dtype", pick_dtype(backend))
    kw.setdefault("head_size", pick_head_size(backend))
    block = kw.setdefault("block_size", pick_block_size(platform, backend))
    mask = MaskSpec.of(kw.get("mode", AttentionMode.CAUSAL))  # type: ignore[arg-type]
    require(
        platform,
        backend,
        dtype=kw["dtype"],
        head_size=kw["head_size"],
        num_heads=kw.get("num_heads", 4),
        num_kv_heads=kw.get("num_kv_heads", 4),
        block_size=block,
        attention_modes=mask.required_modes,
        window=mask.window,
        sink=mask.sink,
        chunk=mask.chunk,
    )
    kw.setdefault("backend_choice", backend)
    kw.setdefault("max_model_len", max(256, 4 * int(block)))  # type: ignore[call-overload]
    kw.setdefault("num_blocks", 4 * (int(kw["max_model_len"]) // int(block) + 1))  # type: ignore[call-overload]
    h = PagedHarness(platform, **kw)  # type: ignore[arg-type]
    assert type(h.backend).name == backend.name, f"the worker chose {h.backend.name!r}, not {backend.name!r}"
    return h


@dataclass
class RowData:
    """Q/K/V for every position of one row's logical sequence."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def make_rows(h: PagedHarness, seq_lens: Sequence[int], seed: int = 0) -> list[RowData]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in seq_lens:
        q = torch.randn(n, h.num_heads, h.head_size, generator=g)
        k = torch.randn(n, h.num_kv_heads, h.head_size, generator=g)
        v = torch.randn(n, h.num_kv_heads, h.head_size, generator=g)
        out.append(RowData(*(t.to(h.device, h.dtype) for t in (q, k, v))))
    return out


def rows_for(request_id: str, spans: Sequence[tuple[int, int]]) -> tuple[PagedRow, ...]:
    """``spans[i] = (kv_start, seq_len)``: row ``i`` queries/writes ``[kv_start, seq_len)``."""
    return tuple(PagedRow(request_id, sl - ks, sl, ks, sequence_id=i) for i, (ks, sl) in enumerate(spans))


def packed(data: list[RowData], rows: Sequence[PagedRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = [
        (
            d.q[r.kv_start_pos : r.kv_start_pos + r.query_len],
            d.k[r.kv_start_pos : r.kv_start_pos + r.query_len],
            d.v[r.kv_start_pos : r.kv_start_pos + r.query_len],
        )
        for d, r in zip(data, rows, strict=True)
    ]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def run(
    h: PagedHarness,
    rows: Sequence[PagedRow],
    data: list[RowData],
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    layer: str | None = None,
) -> torch.Tensor:
    q, k, v = packed(data, rows)
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        meta = AttentionMetadata(full_attn_spans=spans) if spans is not None else None
        outs = [h.executor.forward(name, q, k, v, meta) for name in ([layer] if layer else h.layer_names)]
    # every layer ran the same inputs over its own pages: the same output, up to the rounding a
    # CPU BLAS may vary from call to call under load (its threading), within the dtype's
    # tolerance (a layer reading another layer's pages, or stale ones, is far outside it)
    tol = tolerance(outs[0].dtype, type(h.backend))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=tol["atol"], rtol=tol["rtol"])
    return outs[0]


def prefill(h: PagedHarness, request_id: str, data: list[RowData]) -> None:
    """Write every row's whole sequence through every layer (the prefill step), so that later
    rows may read those pages; the call counts start again from zero afterwards."""
    h.prefill(request_id, [len(d.k) for d in data], [(d.k, d.v) for d in data])


@dataclass(frozen=True)
class Expected:
    """Dense attention for a batch, with what locates a mismatch: its rows, mode and spans."""

    out: torch.Tensor
    rows: tuple[PagedRow, ...]
    mode: AttentionMode | MaskSpec
    spans: Sequence[Sequence[tuple[int, int]]] | None = None


def expected(
    h: PagedHarness,
    rows: Sequence[PagedRow],
    data: list[RowData],
    mode: AttentionMode | MaskSpec,
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> Expected:
    outs = []
    for i, (d, r) in enumerate(zip(data, rows, strict=True)):
        mask = row_mask(mode, r.kv_start_pos, r.query_len, r.seq_len, spans[i] if spans else ())
        q = d.q[r.kv_start_pos : r.kv_start_pos + r.query_len]
        outs.append(dense_attention(q, d.k[: r.seq_len], d.v[: r.seq_len], mask, h.head_size**-0.5))
    return Expected(torch.cat(outs), tuple(rows), mode, spans)


def check(h: PagedHarness, out: torch.Tensor, ref: Expected | torch.Tensor) -> None:
    """``out`` equals ``ref`` within the backend's tolerance; a mismatch names the row, the
    key/query position, the head and the mode of the first differing value (``mismatch``)."""
    tol = tolerance(h.dtype, type(h.backend))
    if isinstance(ref, Expected):
        problem = mismatch(out, ref.out, tol["atol"], tol["rtol"], ref.rows, ref.mode, ref.spans)
    else:
        problem = mismatch(out, ref, tol["atol"], tol["rtol"])
    if problem is not None:
        raise AssertionError(f"{h.platform.name}:{h.backend.name}: {problem}")


# --- cases -----------------------------------------------------------------------------------------


def test_prefix_only_causal(dkv_platform: Platform, dkv_backend: Backend) -> None:
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.CAUSAL}))
    h = harness(dkv_platform, dkv_backend)
    n = h.block_size * 2 + 5
    h.install("r", [n])
    data = make_rows(h, [n])
    rows = rows_for("r", [(0, n)])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))


def test_suffix_over_cached_prefix(dkv_platform: Platform, dkv_backend: Backend) -> None:
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.CAUSAL}))
    h = harness(dkv_platform, dkv_backend)
    prefix, target = h.block_size + 3, h.block_size // 2 + 5
    n = prefix + target
    h.install("r", [n, n])
    data = make_rows(h, [n, n], seed=1)
    run(h, rows_for("r", [(0, n), (0, n)]), data)  # step 0 writes everything
    fresh = make_rows(h, [n, n], seed=2)
    for d, f in zip(data, fresh, strict=True):  # the target changes at every denoise step
        d.q[prefix:], d.k[prefix:], d.v[prefix:] = f.q[prefix:], f.k[prefix:], f.v[prefix:]
    rows = rows_for("r", [(prefix, n), (prefix, n)])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))


@pytest.mark.parametrize("placement", ["contiguous", "permuted"])
def test_denoise_steps_over_one_prepared_batch(
    dkv_platform: Platform, dkv_backend: Backend, placement: str
) -> None:
    """Three denoise steps over one prepared batch, the target rewritten at every step and every
    layer called in turn: each step equals dense attention over that step's target K/V and the
    cached prefix. The path a backend gives a layer's later calls in one activation
    (``bind_layer``) and a twin layer's first call (``bind_layer_like``) is what serves most of
    these calls; contiguous blocks let a gather + SDPA backend read its pages as views."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.CAUSAL}))
    h = harness(dkv_platform, dkv_backend)
    prefix, target = h.block_size + 3, h.block_size // 2 + 5
    n = prefix + target
    h.install("r", [n, n], placement=placement)
    data = make_rows(h, [n, n], seed=31)
    run(h, rows_for("r", [(0, n), (0, n)]), data)  # the prefill step writes everything
    rows = rows_for("r", [(prefix, n), (prefix, n)])
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        for step in range(3):
            fresh = make_rows(h, [n, n], seed=32 + step)
            for d, f in zip(data, fresh, strict=True):
                d.q[prefix:], d.k[prefix:], d.v[prefix:] = f.q[prefix:], f.k[prefix:], f.v[prefix:]
            q, k, v = packed(data, rows)
            ref = expected(h, rows, data, AttentionMode.CAUSAL)
            for name in h.layer_names:
                check(h, h.executor.forward(name, q, k, v), ref)


def test_full_attention_over_cache(dkv_platform: Platform, dkv_backend: Backend) -> None:
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.FULL}))
    # a full layer that takes no spans: a full-only backend serves it
    h = harness(dkv_platform, dkv_backend, mode=MaskSpec(AttentionMode.FULL, spans=False))
    n = h.block_size + 7
    h.install("r", [n])
    data = make_rows(h, [n], seed=3)
    check(
        h,
        run(h, rows_for("r", [(0, n)]), data),
        expected(h, rows_for("r", [(0, n)]), data, AttentionMode.FULL),
    )
    rows = rows_for("r", [(n - 4, n)])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.FULL))


def test_piecewise_worked_example(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Two CFG rows, seq_len 9, cached prefix 3, span (5, 8): one write, three native calls."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [9, 9])
    data = make_rows(h, [9, 9], seed=4)
    spans = [[(5, 8)], [(5, 8)]]
    prefill = rows_for("r", [(0, 9), (0, 9)])
    check(h, run(h, prefill, data, spans), expected(h, prefill, data, AttentionMode.PIECEWISE, spans))
    rows = rows_for("r", [(3, 9), (3, 9)])
    writes_before = {n: len(b.writes) for n, b in h.backends.items()}
    forwards_before = {n: len(b.forwards) for n, b in h.backends.items()}
    out = run(h, rows, data, spans)
    check(h, out, expected(h, rows, data, AttentionMode.PIECEWISE, spans))
    for name, backend in h.backends.items():
        assert backend.writes[writes_before[name] :] == [12]  # one write, outside the segment loop
        assert backend.forwards[forwards_before[name] :] == [4, 6, 2]  # one call per segment


def test_piecewise_unequal_offsets(dkv_platform: Platform, dkv_backend: Backend) -> None:
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [40, 30])
    data = make_rows(h, [40, 30], seed=5)
    spans = [[(20, 30)], [(10, 20)]]
    rows = rows_for("r", [(0, 40), (0, 30)])
    check(
        h,
        run(h, rows, data, [[(20, 30)], [(10, 20)]]),
        expected(h, rows, data, AttentionMode.PIECEWISE, spans),
    )
    rows = rows_for("r", [(10, 40), (0, 30)])
    check(h, run(h, rows, data, spans), expected(h, rows, data, AttentionMode.PIECEWISE, spans))


def test_piecewise_span_covering_query_start(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """A query range that starts inside a span still sees the whole span (kv_end = span end)."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend)
    n = 24
    h.install("r", [n])
    data = make_rows(h, [n], seed=6)
    run(h, rows_for("r", [(0, n)]), data, [[(4, 20)]])
    spans = [[(4, 20)]]
    rows = rows_for("r", [(10, n)])
    check(h, run(h, rows, data, spans), expected(h, rows, data, AttentionMode.PIECEWISE, spans))


def test_empty_spans_are_causal(dkv_platform: Platform, dkv_backend: Backend) -> None:
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [19])
    data = make_rows(h, [19], seed=7)
    rows = rows_for("r", [(0, 19)])
    check(h, run(h, rows, data, [[]]), expected(h, rows, data, AttentionMode.CAUSAL))


def test_mixed_phase_batch(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """One batch serves a request at denoise (its target over cached prefix pages), one without
    prefix (its whole sequence is the target) and one at prefill (writes and attends over its
    whole sequence), each row with its own span: one causal call (the prefill row's prefix)
    and one full call serving all three rows, per layer."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend, max_num_seqs=3)
    pa, ta = h.block_size + 5, 9  # "a": prefill now
    pb, tb = 2 * h.block_size + 1, 6  # "b": denoise now
    tc = 13  # "c": no prefix
    h.install("a", [pa + ta])
    h.install("b", [pb + tb])
    h.install("c", [tc])
    a, b, c = (make_rows(h, [n], seed=40 + i)[0] for i, n in enumerate((pa + ta, pb + tb, tc)))
    prefill(h, "b", [b])
    fresh = make_rows(h, [pb + tb], seed=50)[0]  # the target changes at every denoise step
    b.q[pb:], b.k[pb:], b.v[pb:] = fresh.q[pb:], fresh.k[pb:], fresh.v[pb:]
    rows = (  # short queries first (backends that reorder batches require it)
        PagedRow("b", tb, pb + tb, pb, sequence_id=0),
        PagedRow("c", tc, tc, 0, sequence_id=0),
        PagedRow("a", pa + ta, pa + ta, 0, sequence_id=0),
    )
    spans = [[(pb, pb + tb)], [(0, tc)], [(pa, pa + ta)]]
    data = [b, c, a]
    out = run(h, rows, data, spans)
    check(h, out, expected(h, rows, data, AttentionMode.PIECEWISE, spans))
    for backend in h.backends.values():
        assert backend.writes == [tb + tc + pa + ta]
        assert backend.forwards == [tb + tc + ta, pa]  # calls in order of first appearance


def test_mixed_span_structures(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Rows cutting into different segment sequences share calls: per mode, as many calls as
    the row with the most segments of that mode needs."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend)
    lens = [30, 24, 27, 20]
    h.install("r", lens)
    data = make_rows(h, lens, seed=17)
    prefill(h, "r", data)
    spans = [
        [(10, 16), (22, 26)],  # C F C F C
        [],  # C
        [(5, 9)],  # F C (the query starts inside the span)
        [(0, 20)],  # F
    ]
    rows = rows_for("r", [(8, 30), (12, 24), (6, 27), (4, 20)])
    out = run(h, rows, data, spans)
    check(h, out, expected(h, rows, data, AttentionMode.PIECEWISE, spans))
    for backend in h.backends.values():
        # causal: 3 calls (row 0 has three causal pieces), full: 2 (row 0 has two spans). Each
        # row's j-th piece of a mode joins that mode's j-th call: C0 = rows 0, 1, 2 (2 + 12 + 18
        # queries), F0 = rows 0, 2, 3 (6 + 3 + 16), then row 0 alone: C1 (6), F1 (4), C2 (4)
        assert backend.forwards == [32, 25, 6, 4, 4]


def test_gqa(dkv_platform: Platform, dkv_backend: Backend) -> None:
    require(
        dkv_platform,
        dkv_backend,
        num_heads=8,
        num_kv_heads=2,
        attention_modes=frozenset({AttentionMode.CAUSAL}),
    )
    h = harness(dkv_platform, dkv_backend, num_heads=8, num_kv_heads=2)
    h.install("r", [21, 50])
    data = make_rows(h, [21, 50], seed=8)
    rows = rows_for("r", [(0, 21), (0, 50)])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))


def test_rows_of_different_lengths(dkv_platform: Platform, dkv_backend: Backend) -> None:
    h = harness(dkv_platform, dkv_backend)
    lens = [5, h.block_size * 2 + 1, 17]
    h.install("r", lens)
    data = make_rows(h, lens, seed=9)
    rows = rows_for("r", [(0, n) for n in lens])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))
    rows = rows_for("r", [(n - 3, n) for n in lens])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))


@pytest.mark.parametrize("hidden", [False, True], ids=["heads", "flat-hidden"])
def test_padded_batch_layout(dkv_platform: Platform, dkv_backend: Backend, hidden: bool) -> None:
    h = harness(dkv_platform, dkv_backend)
    lens = [7, 12]
    h.install("r", lens)
    data = make_rows(h, lens, seed=10)
    rows = rows_for("r", [(0, n) for n in lens])
    L = max(lens)

    def pad(which: str) -> torch.Tensor:
        parts = []
        for d in data:
            t = getattr(d, which)
            parts.append(torch.cat([t, t.new_zeros(L - t.shape[0], *t.shape[1:])]))
        out = torch.stack(parts)
        return out.reshape(len(lens), L, -1) if hidden else out

    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        out = h.executor.forward(h.layer_names[0], pad("q"), pad("k"), pad("v"))
    assert out.shape == ((2, L, h.num_heads * h.head_size) if hidden else (2, L, h.num_heads, h.head_size))
    out = out.reshape(2, L, h.num_heads, h.head_size)
    assert torch.count_nonzero(out[0, lens[0] :]) == 0
    ref = expected(h, rows, data, AttentionMode.CAUSAL)
    check(h, torch.cat([out[0, : lens[0]], out[1, : lens[1]]]), ref)


def test_uniform_batch_layout(dkv_platform: Platform, dkv_backend: Backend) -> None:
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [11, 11])
    data = make_rows(h, [11, 11], seed=11)
    rows = rows_for("r", [(0, 11), (0, 11)])
    q, k, v = (torch.stack([getattr(d, w) for d in data]) for w in ("q", "k", "v"))
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        out = h.executor.forward(h.layer_names[0], q, k, v)
    check(h, out.reshape(22, h.num_heads, h.head_size), expected(h, rows, data, AttentionMode.CAUSAL))


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_block_sizes(dkv_platform: Platform, dkv_backend: Backend, block_size: int) -> None:
    h = harness(dkv_platform, dkv_backend, block_size=block_size, max_model_len=3 * block_size)
    n = block_size + block_size // 2 + 3
    h.install("r", [n])
    data = make_rows(h, [n], seed=12)
    rows = rows_for("r", [(0, n)])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))


def test_physical_placement_does_not_change_output(dkv_platform: Platform, dkv_backend: Backend) -> None:
    outs = []
    for placement in ("contiguous", "reversed", "permuted"):
        h = harness(dkv_platform, dkv_backend)
        lens = [h.block_size * 3 + 2, h.block_size + 1]
        h.install("r", lens, placement=placement)
        data = make_rows(h, lens, seed=13)
        outs.append(run(h, rows_for("r", [(0, n) for n in lens]), data).cpu())
    tol = tolerance(outs[0].dtype, dkv_backend)  # the same math; a CPU BLAS may round apart
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=tol["atol"], rtol=tol["rtol"])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_slot_mapping_dtypes(dkv_platform: Platform, dkv_backend: Backend, slot_dtype: torch.dtype) -> None:
    declared = dkv_backend.capabilities.slot_mapping_dtypes
    if slot_dtype not in declared:
        pytest.skip(f"{dkv_backend.name}: declares slot dtypes {sorted(dtype_name(d) for d in declared)}")
    h = harness(dkv_platform, dkv_backend, slot_mapping_dtype=slot_dtype)
    n = h.block_size + 9
    h.install("r", [n])
    data = make_rows(h, [n], seed=14)
    rows = rows_for("r", [(0, n)])
    batch = h.translator.prepare(rows)
    assert batch.common.slot_mappings.dtype == slot_dtype
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))


def test_one_kv_write_per_layer(dkv_platform: Platform, dkv_backend: Backend) -> None:
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [20, 20])
    data = make_rows(h, [20, 20], seed=15)
    run(h, rows_for("r", [(0, 20), (0, 20)]), data)
    for backend in h.backends.values():
        assert backend.writes == [40]
        assert backend.forwards == [40]


def test_stale_batch_is_refused(dkv_platform: Platform, dkv_backend: Backend) -> None:
    h = harness(dkv_platform, dkv_backend)
    h.install("a", [10])
    rows = rows_for("a", [(0, 10)])
    first = h.translator.prepare(rows)
    second = h.translator.prepare(rows)
    if h.translator.retains_batches:  # each batch's tensors its own: a newer one leaves it valid
        with h.translator.activate(first):
            pass
    else:
        with pytest.raises(StaleBatchError), h.translator.activate(first):
            pass
    h.install("b", [10])  # a BlockTables mutation
    with pytest.raises(StaleBatchError), h.translator.activate(second):
        pass
    third = h.translator.prepare(rows)
    with h.translator.activate(third):
        with pytest.raises(StateError, match="while a prepared batch is active"):
            h.install("c", [10])
        with pytest.raises(StateError, match="while another batch is active"):
            h.translator.prepare(rows)
    assert h.registry.rows.get(("c", 0, None)) is None


def test_retained_batch_serves_after_newer_preparations(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Where the backend declares ``retains_metadata`` (and its BlockTables ``retains_batches``),
    a batch prepared before two others -- one of them run, writing its rows' pages -- is
    activated again and attends exactly as dense attention says, its own writes included."""
    h = harness(dkv_platform, dkv_backend)
    if not h.translator.retains_batches:
        pytest.skip(f"{dkv_backend.name}: its metadata or BlockTables are not retained across preparations")
    lens_a, lens_b = [h.block_size + 5, 9], [2 * h.block_size + 3]
    h.install("a", lens_a, placement="permuted")
    h.install("b", lens_b, placement="permuted")
    data_a, data_b = make_rows(h, lens_a, seed=21), make_rows(h, lens_b, seed=22)
    rows_a, rows_b = rows_for("a", [(0, n) for n in lens_a]), rows_for("b", [(0, n) for n in lens_b])
    first = h.translator.prepare(rows_a)
    check(h, run(h, rows_b, data_b), expected(h, rows_b, data_b, AttentionMode.CAUSAL))
    q, k, v = packed(data_a, rows_a)
    with h.translator.activate(first):
        outs = [h.executor.forward(name, q, k, v) for name in h.layer_names]
    for out in outs:
        check(h, out, expected(h, rows_a, data_a, AttentionMode.CAUSAL))
    # its writes counted: a row reading them now is served
    later = rows_for("a", [(lens_a[0] - 4, lens_a[0]), (5, 9)])
    check(h, run(h, later, data_a), expected(h, later, data_a, AttentionMode.CAUSAL))


def test_graph_equal_batches_are_served_by_each_others_metadata(
    dkv_platform: Platform, dkv_backend: Backend
) -> None:
    """Where the backend gives a ``graph_key`` and two batches of one shape get equal keys, a
    CUDA graph captured over the first would replay, for the second, the launches the first
    one's metadata made: so the second batch's layers run with the first batch's metadata
    objects must attend exactly as dense attention says for the second batch (its own pages,
    lengths and slots), the first batch's run before it included."""
    h = harness(dkv_platform, dkv_backend)
    lens = [h.block_size + 5, 9]
    h.install("a", lens, placement="permuted")
    h.install("b", lens, placement="permuted")
    data_a, data_b = make_rows(h, lens, seed=31), make_rows(h, lens, seed=32)
    rows_a, rows_b = rows_for("a", [(0, n) for n in lens]), rows_for("b", [(0, n) for n in lens])
    first = h.translator.prepare(rows_a)
    name = h.layer_names[0]
    key = h.backend.graph_key(first.attn_metadata[name])
    if key is None:
        pytest.skip(f"{dkv_backend.name}: graph_key gives no key (a graph serves its own batch only)")
    kept = dict(first.attn_metadata)
    q, k, v = packed(data_a, rows_a)
    with h.translator.activate(first):
        for layer in h.layer_names:
            check(h, h.executor.forward(layer, q, k, v), expected(h, rows_a, data_a, AttentionMode.CAUSAL))
    second = h.translator.prepare(rows_b)
    if h.backend.graph_key(second.attn_metadata[name]) != key:
        pytest.skip(f"{dkv_backend.name}: two batches of one shape got different graph keys")
    cast(dict[str, Any], second.attn_metadata).update(
        kept
    )  # what a replay of the first batch's graph launches
    q, k, v = packed(data_b, rows_b)
    with h.translator.activate(second):
        for layer in h.layer_names:
            check(h, h.executor.forward(layer, q, k, v), expected(h, rows_b, data_b, AttentionMode.CAUSAL))


def test_paged_layer_without_active_batch_is_an_error(dkv_platform: Platform, dkv_backend: Backend) -> None:
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [4])
    data = make_rows(h, [4])
    with pytest.raises(StateError, match="no dense fallback"):
        h.executor.forward(h.layer_names[0], data[0].q, data[0].k, data[0].v)


BadInput = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata | None],
]

BAD_INPUTS: dict[str, BadInput] = {
    "token count": lambda q, k, v: (q[:-1], k[:-1], v[:-1], None),
    "head dims": lambda q, k, v: (q[..., :-1], k, v, None),
    "key layout": lambda q, k, v: (q, k[:-1], v, None),
    "dtype": lambda q, k, v: (q.to(torch.float64 if q.dtype != torch.float64 else torch.float32), k, v, None),
    "span beyond seq_len": lambda q, k, v: (
        q,
        k,
        v,
        AttentionMetadata(full_attn_spans=[[(5, 99)], [(5, 8)]]),
    ),
    "unsorted spans": lambda q, k, v: (
        q,
        k,
        v,
        AttentionMetadata(full_attn_spans=[[(6, 8), (4, 6)], [(5, 8)]]),
    ),
    "span rows": lambda q, k, v: (q, k, v, AttentionMetadata(full_attn_spans=[[(5, 8)]])),
    "mask without spans": lambda q, k, v: (
        q,
        k,
        v,
        AttentionMetadata(attn_mask=torch.ones(1, 1, 6, 9, dtype=torch.bool)),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_rejected_before_any_cache_write(
    dkv_platform: Platform, dkv_backend: Backend, case: str
) -> None:
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [9, 9])
    data = make_rows(h, [9, 9], seed=16)
    prefill(h, "r", data)
    rows = rows_for("r", [(3, 9), (3, 9)])
    q, k, v = packed(data, rows)
    q, k, v, meta = BAD_INPUTS[case](q, k, v)
    before = h.cache_snapshot()
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch), pytest.raises((ValidationError, NotImplementedError)):
        h.executor.forward(h.layer_names[0], q, k, v, meta)
    assert h.writes() == 0
    assert all(b.forwards == [] for b in h.backends.values())
    for a, b in zip(before, h.cache_snapshot(), strict=True):
        assert torch.equal(a, b)


def test_non_suffix_causal_rows_rejected_before_write(dkv_platform: Platform, dkv_backend: Backend) -> None:
    h = harness(dkv_platform, dkv_backend)
    h.install("r", [12])
    data = make_rows(h, [12], seed=17)
    prefill(h, "r", data)
    rows = (PagedRow("r", 4, 12, 2, sequence_id=0),)
    q, k, v = packed(data, rows)
    before = h.cache_snapshot()
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch), pytest.raises(ValidationError, match="end at seq_len"):
        h.executor.forward(h.layer_names[0], q, k, v)
    assert h.writes() == 0
    assert all(torch.equal(a, b) for a, b in zip(before, h.cache_snapshot(), strict=True))


def test_padding_slots_are_never_written(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """``write_kv`` with ``-1`` slots (padding) writes exactly what the real slots alone write
    (a kernel indexing with -1 would hit the cache's last slot)."""
    h = harness(dkv_platform, dkv_backend)
    name = h.layer_names[0]
    backend, cache, layer = h.backends[name], h.kv_caches[name], h.geometry[name]
    tensors = cache if isinstance(cache, tuple) else (cache,)
    slot_dtype = h.block_tables.slot_mapping_dtype
    g = torch.Generator().manual_seed(21)
    key = torch.randn(5, h.num_kv_heads, h.head_size, generator=g).to(h.device, h.dtype)
    value = torch.randn(5, h.num_kv_heads, h.head_size, generator=g).to(h.device, h.dtype)
    last = h.backend.group.num_kernel_blocks * h.kernel_block_size - 1
    real = torch.tensor([0, last - 1], dtype=slot_dtype, device=h.device)
    padded = torch.tensor([-1, 0, -1, last - 1, -1], dtype=slot_dtype, device=h.device)
    for t in tensors:
        t.fill_(7.0)
    backend.write_kv(layer, key[[1, 3]], value[[1, 3]], cache, real)
    expected_cache = h.cache_snapshot()
    for t in tensors:
        t.fill_(7.0)
    backend.write_kv(layer, key, value, cache, padded)
    for a, b in zip(expected_cache, h.cache_snapshot(), strict=True):
        assert torch.equal(a, b), (
            "a -1 slot was written (the cache differs from writing the real slots alone)"
        )


def _matrix_case(platform: Platform, backend: Backend, **kw: object) -> str | None:
    """Prefill + suffix over the cached prefix with ``kw``; a skip reason, or None when it ran."""
    heads, kv_heads = int(kw.get("num_heads", 4)), int(kw.get("num_kv_heads", 4))  # type: ignore[call-overload]
    reasons = reasons_against(
        platform,
        backend,
        dtype=kw["dtype"],
        head_size=kw["head_size"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        block_size=pick_block_size(platform, backend),
        attention_modes=frozenset({AttentionMode.CAUSAL}),
    )
    if reasons:
        return "; ".join(reasons)
    h = harness(platform, backend, layer_names=("layer.0",), **kw)
    lens = [h.block_size + 5, 9]
    h.install("r", lens)
    data = make_rows(h, lens, seed=30)
    check(
        h,
        run(h, rows_for("r", [(0, n) for n in lens]), data),
        expected(h, rows_for("r", [(0, n) for n in lens]), data, AttentionMode.CAUSAL),
    )
    rows = rows_for("r", [(n - 3, n) for n in lens])
    check(h, run(h, rows, data), expected(h, rows, data, AttentionMode.CAUSAL))
    return None


GQA_UNBOUNDED = 16
"""The largest GQA ratio the matrix tries on a backend that declares no ``max_gqa_ratio``."""


def gqa_ratios(backend: Backend) -> list[int]:
    """1 (plain multi-head), 2 (the smallest grouping) and the largest the backend declares
    (``max_gqa_ratio``; :data:`GQA_UNBOUNDED` when it declares no limit); a backend without
    ``supports_gqa`` still lists 2 and the largest, which its own reasons skip."""
    caps = backend.capabilities
    largest = caps.max_gqa_ratio if caps.max_gqa_ratio is not None else GQA_UNBOUNDED
    return sorted({1, 2, max(largest, 1)})


def test_declared_capability_matrix(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Every declared dtype x head size (at most three sizes), each declared slot dtype, and GQA
    ratios 1, 2 and the largest declared (:func:`gqa_ratios`): paged equals dense for each. Every
    cell runs, whatever another cell did; the matrix is printed (the summary's matrix section)
    with each cell passed, failed (with the first line of its failure) or skipped (with the
    backend's reasons), and the case fails naming each failing cell."""
    caps = dkv_backend.capabilities
    sizes = sorted(caps.head_sizes) if caps.head_sizes is not None else [64, 128]
    head_sizes = sorted({sizes[0], sizes[-1], *(s for s in (64, 128) if s in sizes)})[:3]
    cases: list[tuple[str, dict[str, object]]] = []
    base_dtype, base_head = pick_dtype(dkv_backend), pick_head_size(dkv_backend)
    for dtype in sorted(caps.dtypes, key=dtype_name):
        for head in head_sizes:
            cases.append((f"dtype={dtype_name(dtype)} head_size={head}", {"dtype": dtype, "head_size": head}))
    for slot in sorted(caps.slot_mapping_dtypes, key=dtype_name):
        cases.append(
            (
                f"slots={dtype_name(slot)}",
                {"dtype": base_dtype, "head_size": base_head, "slot_mapping_dtype": slot},
            )
        )
    for ratio in gqa_ratios(dkv_backend):
        cases.append(
            (
                f"gqa={ratio}:1",
                {"dtype": base_dtype, "head_size": base_head, "num_heads": 2 * ratio, "num_kv_heads": 2},
            )
        )
    cells: list[tuple[str, str, str]] = []  # (outcome, label, reason)
    for label, kw in cases:
        try:
            reason = _matrix_case(dkv_platform, dkv_backend, **kw)
        except pytest.skip.Exception as exc:
            cells.append(("skipped", label, str(exc.msg)))
            continue
        except (AssertionError, DiffusionKVError, RuntimeError, ValueError, TypeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            cells.append(("failed", label, f"{type(exc).__name__}: {first}"))
            continue
        cells.append(("skipped", label, reason) if reason else ("passed", label, ""))
    counts = {o: sum(1 for c in cells if c[0] == o) for o in ("passed", "failed", "skipped")}
    MATRIX.append(
        f"{dkv_platform.name}:{dkv_backend.name} declared cells (dtype x head size, slot dtypes, GQA): "
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped (the kit's "
        "other cases are counted above)"
    )
    MATRIX.extend(f"  {o:<8} {label}" + (f": {why}" if why else "") for o, label, why in cells)
    failed = [f"{label} ({why})" for o, label, why in cells if o == "failed"]
    assert not failed, f"failing matrix cell(s): {'; '.join(failed)}"
    assert counts["passed"], f"no declared combination could run: {[c[1:] for c in cells]}"


@pytest.mark.parametrize(
    ("cp_size", "interleave", "mode"),
    [(2, 1, AttentionMode.CAUSAL), (4, 2, AttentionMode.CAUSAL), (2, 4, AttentionMode.FULL)],
    ids=["2-1-causal", "4-2-causal", "2-4-full"],
)
def test_dcp_partials_merge_to_full_attention(
    dkv_platform: Platform, dkv_backend: Backend, cp_size: int, interleave: int, mode: AttentionMode
) -> None:
    """Decode context parallelism in one process: each of ``cp_size`` ranks holds its interleave
    slots of keys; their partials merged by log-sum-exp equal dense attention, for the whole
    sequence (where a causal query may see no key of a rank) and for a suffix over cached
    pages."""
    if not dkv_backend.capabilities.supports_dcp:
        pytest.skip(f"{dkv_backend.name}: does not declare supports_dcp")

    lens = [45, 23]
    whole = rows_for("r", [(0, n) for n in lens])
    suffix = rows_for("r", [(n - 5, n) for n in lens])
    data: list[RowData] | None = None
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"whole": [], "suffix": []}
    for rank in range(cp_size):
        capture = CapturePartials(cp_size, rank)
        h = harness(
            dkv_platform,
            dkv_backend,
            cp_size=cp_size,
            cp_rank=rank,
            cp_interleave=interleave,
            dcp_merger=capture,
            mode=mode,
            layer_names=("layer.0",),
        )
        h.install("r", lens)
        data = make_rows(h, lens, seed=31)
        for name, rows in (("whole", whole), ("suffix", suffix)):
            capture.parts.clear()
            run(h, rows, data)
            ((part, lse),) = capture.parts
            assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(part.shape[:2])
            assert not torch.isnan(lse).any() and not torch.isnan(part).any()
            parts[name].append((part, lse))
    assert data is not None
    for name, rows in (("whole", whole), ("suffix", suffix)):
        merged = merge_partial_attention([p for p, _ in parts[name]], [lse for _, lse in parts[name]])
        check(h, merged, expected(h, rows, data, mode))


def test_ulysses_rank_local_heads(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Strict Ulysses hands each rank a contiguous share of the heads; two rank-local workers
    together equal the full layer."""
    if not dkv_backend.capabilities.supports_ulysses:
        pytest.skip(f"{dkv_backend.name}: does not declare supports_ulysses")
    lens = [30, 17]
    full = harness(dkv_platform, dkv_backend, num_heads=8, num_kv_heads=4, layer_names=("layer.0",))
    full.install("r", lens)
    data = make_rows(full, lens, seed=32)
    rows = rows_for("r", [(0, n) for n in lens])
    parts: list[torch.Tensor] = []
    for rank in (0, 1):
        h = harness(dkv_platform, dkv_backend, num_heads=4, num_kv_heads=2, layer_names=("layer.0",))
        h.install("r", lens)
        local = [
            RowData(
                d.q[:, 4 * rank : 4 * rank + 4],
                d.k[:, 2 * rank : 2 * rank + 2],
                d.v[:, 2 * rank : 2 * rank + 2],
            )
            for d in data
        ]
        parts.append(run(h, rows, local))
    check(full, torch.cat(parts, dim=1), expected(full, rows, data, AttentionMode.CAUSAL))


# --- prefix caching: a hit equals the miss ---------------------------------------------------------
#
# A publisher request ("A") writes its whole row, then seals its leading prefix blocks: the same
# snapshot again at a newer generation with a larger cached_prefix_len (the scheduler does this
# once A's prefill step ran). While A is live, a hit request lists those very block ids as its
# own cached prefix; its prefill step writes and queries only the tokens after them and attends
# over the shared pages plus its own. Whatever the backend, a hit row gets what the miss (the
# same row computed whole, in blocks of its own) gets, and what dense attention gets.


@dataclass
class _PrefixRequest:
    """A one-row request of the prefix-caching cases: ``[prefix | target]``, full attention over
    the target and a causal prefix (the scheduler's default spans)."""

    request_id: str
    prefix_len: int
    target_len: int
    data: RowData
    snapshot: RequestAllocation
    hit: int
    """Leading tokens found cached at admission (shared blocks): its prefill step starts there."""

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.target_len

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.snapshot.sequences[0].block_ids[0]

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(self.prefix_len, self.seq_len)]

    def prefill_row(self) -> PagedRow:
        n = self.seq_len
        return PagedRow(self.request_id, n - self.hit, n, self.hit, sequence_id=0)

    def denoise_row(self) -> PagedRow:
        return PagedRow(self.request_id, self.target_len, self.seq_len, self.prefix_len, sequence_id=0)


def _pc_install(
    h: PagedHarness,
    request_id: str,
    prefix_len: int,
    target_len: int,
    data: RowData,
    shared: Sequence[int] = (),
) -> _PrefixRequest:
    """Install a one-row request whose first blocks are ``shared`` (another request's sealed
    blocks, declared as its cached prefix) and the rest its own."""
    n = prefix_len + target_len
    own = h.take_blocks(cdiv(n, h.block_size) - len(shared), "permuted")
    hit = len(shared) * h.block_size
    seq = SequenceAllocation(0, prefix_len, target_len, n, ((*shared, *own),), cached_prefix_len=hit)
    snapshot = RequestAllocation(request_id, 0, (seq,))
    assert h.registry.install(snapshot)
    return _PrefixRequest(request_id, prefix_len, target_len, data, snapshot, hit)


def _pc_clone(data: RowData) -> RowData:
    return RowData(data.q.clone(), data.k.clone(), data.v.clone())


def _pc_new_target(h: PagedHarness, req: _PrefixRequest, seed: int) -> None:
    """The target changes at every denoise step."""
    fresh = make_rows(h, [req.seq_len], seed=seed)[0]
    p, d = req.prefix_len, req.data
    d.q[p:], d.k[p:], d.v[p:] = fresh.q[p:], fresh.k[p:], fresh.v[p:]


def _pc_step(h: PagedHarness, steps: Sequence[tuple[_PrefixRequest, PagedRow]]) -> dict[str, torch.Tensor]:
    """Run one batch of ``(request, row)`` (short queries first) through every layer, check it
    against dense attention; each request's output."""
    steps = sorted(steps, key=lambda s: s[1].query_len)
    rows = [row for _, row in steps]
    data = [req.data for req, _ in steps]
    spans = [req.spans for req, _ in steps]
    out = run(h, rows, data, spans)
    check(h, out, expected(h, rows, data, AttentionMode.PIECEWISE, spans))
    parts = torch.split(out, [row.query_len for row in rows])
    return {req.request_id: part for (req, _), part in zip(steps, parts, strict=True)}


def _pc_publisher(
    h: PagedHarness, prefix_blocks: int, tail: int, target_len: int, seed: int
) -> _PrefixRequest:
    """Request "A": ``prefix_blocks`` blocks plus ``tail`` tokens of prefix, prefilled whole, then
    its prefix blocks sealed (installed again at a newer generation, cached_prefix_len over them)."""
    p = prefix_blocks * h.block_size + tail
    a = _pc_install(h, "A", p, target_len, make_rows(h, [p + target_len], seed=seed)[0])
    _pc_step(h, [(a, a.prefill_row())])
    seq = replace(a.snapshot.sequences[0], cached_prefix_len=prefix_blocks * h.block_size)
    sealed = RequestAllocation("A", a.snapshot.allocation_generation + 1, (seq,))
    assert not h.registry.install(sealed)  # a seal keeps A's rows
    a.snapshot = sealed
    identity = ("A", 0, None)
    for block in a.block_ids[:prefix_blocks]:
        assert h.registry.holders_of(0, block) == {identity: False}  # sealed: nobody writes it
    h.reset_counts()
    return a


def _pc_hit(
    h: PagedHarness,
    request_id: str,
    publisher: _PrefixRequest,
    hit_blocks: int,
    prefix_len: int,
    target_len: int,
    seed: int,
) -> _PrefixRequest:
    """A request whose first ``hit_blocks`` blocks of content equal the publisher's (the same
    K/V there) and are the publisher's sealed blocks; everything after is its own."""
    data = make_rows(h, [prefix_len + target_len], seed=seed)[0]
    hit = hit_blocks * h.block_size
    src = publisher.data
    data.q[:hit], data.k[:hit], data.v[:hit] = src.q[:hit], src.k[:hit], src.v[:hit]
    return _pc_install(h, request_id, prefix_len, target_len, data, shared=publisher.block_ids[:hit_blocks])


def _pc_hit_and_miss(h: PagedHarness) -> tuple[_PrefixRequest, _PrefixRequest, _PrefixRequest]:
    """Publisher "A" (2 sealed prefix blocks), hit "B" on them (its prefix runs on past them,
    its target differs), and "C": B's row again, uncached (the miss)."""
    a = _pc_publisher(h, prefix_blocks=2, tail=5, target_len=9, seed=60)
    b = _pc_hit(h, "B", a, 2, prefix_len=2 * h.block_size + 7, target_len=6, seed=61)
    c = _pc_install(h, "C", b.prefix_len, b.target_len, _pc_clone(b.data))
    return a, b, c


def _pc_same(h: PagedHarness, hit: torch.Tensor, miss: torch.Tensor) -> None:
    """The hit's outputs equal the miss's for the same query positions (the kit's tolerance)."""
    check(h, hit, miss.detach().to("cpu", torch.float64))


def test_prefix_cache_hit_equals_miss(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """A hit row's prefill (only its uncached tokens, over the publisher's sealed blocks while
    the publisher is live) equals the miss computing the whole row, and dense attention."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend, max_num_seqs=3)
    a, b, c = _pc_hit_and_miss(h)
    assert b.block_ids[:2] == a.block_ids[:2] and b.hit == 2 * h.block_size
    hit = _pc_step(h, [(b, b.prefill_row())])["B"]
    for backend in h.backends.values():  # only the uncached tokens are computed and written
        assert backend.writes == [b.seq_len - b.hit]
        assert sum(backend.forwards) == b.seq_len - b.hit
    miss = _pc_step(h, [(c, c.prefill_row())])["C"]
    _pc_same(h, hit, miss[b.hit :])


def test_prefix_cache_denoise_over_shared_prefix(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """After the hit's prefill, the publisher and the hit run a denoise step in one batch (their
    targets over prefixes that share blocks), with the miss: dense, and the hit equals the miss."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend, max_num_seqs=3)
    a, b, c = _pc_hit_and_miss(h)
    _pc_step(h, [(b, b.prefill_row()), (c, c.prefill_row())])  # the hit and the miss in one batch
    _pc_new_target(h, a, seed=62)
    _pc_new_target(h, b, seed=63)
    p = c.prefix_len
    c.data.q[p:], c.data.k[p:], c.data.v[p:] = b.data.q[p:], b.data.k[p:], b.data.v[p:]
    outs = _pc_step(h, [(x, x.denoise_row()) for x in (a, b, c)])
    _pc_same(h, outs["B"], outs["C"])


def test_prefix_cache_write_inside_sealed_prefix_refused(
    dkv_platform: Platform, dkv_backend: Backend
) -> None:
    """A row writing inside a sealed prefix (the hit starting before its cached prefix ends, the
    publisher writing its sealed blocks again), a new row writing a sealed block, and taking a
    seal back are refused before any cache byte or registry state changes; the rows still run."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend, max_num_seqs=4)
    a, b, _ = _pc_hit_and_miss(h)
    _pc_step(h, [(b, b.prefill_row())])
    h.reset_counts()
    bs, sealed = h.block_size, b.hit
    na, nb = a.seq_len, b.seq_len
    refused = {
        "hit row from token 0": (PagedRow("B", nb, nb, 0, sequence_id=0),),
        "hit row from its last cached token": (
            PagedRow("B", nb - sealed + 1, nb, sealed - 1, sequence_id=0),
        ),
        "publisher prefill again": (PagedRow("A", na, na, 0, sequence_id=0),),
        "publisher from its last sealed block": (
            PagedRow("A", na - sealed + bs, na, sealed - bs, sequence_id=0),
        ),
        "with a legal row": (b.denoise_row(), PagedRow("A", na - 1, na, 1, sequence_id=0)),
    }
    identities = [(r, 0, None) for r in "ABC"]
    written = [h.registry.written_spans(i) for i in identities]
    before = h.cache_snapshot()
    for label, rows in refused.items():
        try:
            h.translator.prepare(rows)
        except ValidationError as exc:
            assert "read-only cached prefix" in str(exc), f"{label}: {exc}"
        else:
            pytest.fail(f"{label}: a batch writing inside a sealed prefix was prepared")
    writer = SequenceAllocation(0, 0, bs, bs, ((a.block_ids[0],),))  # writes a sealed block
    with pytest.raises(ValidationError, match="a written block belongs to one live row"):
        h.registry.install(RequestAllocation("W", 0, (writer,)))
    unsealed = replace(a.snapshot.sequences[0], cached_prefix_len=0)
    with pytest.raises(GenerationError, match="conflicting allocation snapshot"):
        h.registry.install(RequestAllocation("A", a.snapshot.allocation_generation + 1, (unsealed,)))
    assert h.registry.snapshot_of("A") == a.snapshot and h.registry.snapshot_of("W") is None
    assert [h.registry.written_spans(i) for i in identities] == written
    assert h.writes() == 0 and all(not x.forwards for x in h.backends.values())
    for x, y in zip(before, h.cache_snapshot(), strict=True):
        assert torch.equal(x, y)
    _pc_new_target(h, a, seed=64)
    _pc_new_target(h, b, seed=65)
    _pc_step(h, [(a, a.denoise_row()), (b, b.denoise_row())])


def test_prefix_cache_mixed_hit_lengths(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Hits of one, two and three blocks on one publisher (the last with its whole prefix
    cached, so it queries only its target), a miss twin of the two-block hit, and the
    publisher's own denoise step, in one batch: dense, and the hit equals its miss twin."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    h = harness(dkv_platform, dkv_backend, max_num_seqs=5)
    bs = h.block_size
    a = _pc_publisher(h, prefix_blocks=3, tail=5, target_len=9, seed=70)
    b1 = _pc_hit(h, "B1", a, 1, prefix_len=bs + 11, target_len=7, seed=71)
    b2 = _pc_hit(h, "B2", a, 2, prefix_len=2 * bs + 3, target_len=12, seed=72)
    b3 = _pc_hit(h, "B3", a, 3, prefix_len=3 * bs, target_len=10, seed=73)
    m = _pc_install(h, "M", b2.prefix_len, b2.target_len, _pc_clone(b2.data))
    assert {b1.hit, b2.hit, b3.hit, m.hit} == {bs, 2 * bs, 3 * bs, 0}
    assert h.registry.holders_of(0, a.block_ids[0]) == {(r, 0, None): False for r in ("A", "B1", "B2", "B3")}
    _pc_new_target(h, a, seed=74)
    steps = [(x, x.prefill_row()) for x in (b1, b2, b3, m)] + [(a, a.denoise_row())]
    outs = _pc_step(h, steps)
    for backend in h.backends.values():
        assert backend.writes == [sum(row.query_len for _, row in steps)]
    _pc_same(h, outs["B2"], outs["M"][b2.hit :])


# --- quantised KV cache (fp8_e4m3) -------------------------------------------------------------


def _tensors(cache: KVCache) -> tuple[torch.Tensor, ...]:
    return cache if isinstance(cache, tuple) else (cache,)


def _fp8_harness(platform: Platform, backend: Backend, **kw: object) -> PagedHarness:
    if FP8_E4M3 not in backend.capabilities.kv_cache_dtypes:
        pytest.skip(f"{platform.name}:{backend.name}: declares no fp8_e4m3 KV cache")
    dtype = kw.setdefault("dtype", pick_dtype(backend))
    require(platform, backend, dtype=dtype, kv_cache_dtype=FP8_E4M3)
    return harness(platform, backend, kv_cache_dtype=FP8_E4M3, **kw)


def _stored(h: PagedHarness, data: list[RowData]) -> list[RowData]:
    """``data`` with K/V as the pages hold them (quantised with the layer's scales, read back)."""
    sc = h.geometry[h.layer_names[0]].kv_scales
    assert sc is not None
    ks, vs = sc.k_scale.to(h.device), sc.v_scale.to(h.device)
    return [RowData(d.q, fake_quantize(d.k, ks), fake_quantize(d.v, vs)) for d in data]


@pytest.mark.parametrize("scales", ["unit", "per-head"])
def test_fp8_kv_cache_equals_dense_over_the_stored_values(
    dkv_platform: Platform, dkv_backend: Backend, scales: str
) -> None:
    """e4m3 pages: a prefill and a denoise step with spans over the cached prefix equal dense
    attention over the K/V the pages hold (quantised, read back) within the compute dtype's
    tolerance; the pages hold exactly ``round_e4m3(x / scale)``; nothing saturates."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.PIECEWISE}))
    kw: dict[str, object] = {"num_heads": 4, "num_kv_heads": 2}
    if scales == "per-head":
        kw.update(k_scale=[7.0 / FP8_MAX, 8.0 / FP8_MAX], v_scale=[7.5 / FP8_MAX, 0.25])
    h = _fp8_harness(dkv_platform, dkv_backend, **kw)
    assert all(c.dtype == FP8_E4M3 for cache in h.kv_caches.values() for c in _tensors(cache))
    bs = h.block_size
    prefix, target = 2 * bs + 3, bs // 2 + 5
    n = prefix + target
    snap = h.install("r", [n, n])
    data = make_rows(h, [n, n], seed=81)
    run(h, rows_for("r", [(0, n), (0, n)]), data)
    stored = _stored(h, data)
    check(
        h,
        run(h, rows_for("r", [(0, n), (0, n)]), data),
        expected(h, rows_for("r", [(0, n)] * 2), stored, AttentionMode.CAUSAL),
    )
    k_cache, _ = key_value_caches(h.kv_caches[h.layer_names[0]])
    if h.backend.page_layout is KVPageLayout.HEAD_FIRST:  # [blocks, Hkv, page, D]: see it token-major
        k_cache = k_cache.transpose(1, 2)
    sc = h.geometry[h.layer_names[0]].kv_scales
    assert sc is not None
    page = h.kernel_block_size
    ids = snap.sequences[0].block_ids[0]
    for pos in (0, bs + 1, n - 1):  # exactly what the writer promises, byte for byte
        blk, off = divmod(pos, page)
        kernel_block = ids[blk * page // h.block_size] * (h.block_size // page) + blk % (h.block_size // page)
        got = k_cache[kernel_block, off].view(torch.uint8).cpu()
        want = quantize(data[0].k[pos : pos + 1], sc.k_scale.to(h.device))[0].view(torch.uint8).cpu()
        assert torch.equal(got, want), f"token {pos}: pages hold {got[:, :8]}, expected {want[:, :8]}"
    fresh = make_rows(h, [n, n], seed=82)
    for d, f in zip(data, fresh, strict=True):
        d.q[prefix:], d.k[prefix:], d.v[prefix:] = f.q[prefix:], f.k[prefix:], f.v[prefix:]
    rows = rows_for("r", [(prefix, n), (prefix, n)])
    spans = [[(prefix, n)], [(prefix, n)]]
    out = run(h, rows, data, spans)
    check(h, out, expected(h, rows, _stored(h, data), AttentionMode.PIECEWISE, spans))
    assert sc.saturations() == (0, 0)


def test_fp8_kv_cache_saturates_and_counts(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """A key beyond ``448 * k_scale`` is stored as +-448 (never inf or nan) and counted, per
    layer."""
    require(dkv_platform, dkv_backend, attention_modes=frozenset({AttentionMode.CAUSAL}))
    h = _fp8_harness(dkv_platform, dkv_backend, k_scale=0.01, v_scale=1.0)
    n = h.block_size + 3
    h.install("r", [n])
    data = make_rows(h, [n], seed=83)
    data[0].k[2, 0, :3] = torch.tensor([10.0, -10.0, 4.16], dtype=h.dtype)  # 1000, -1000, ~416 scaled
    out = run(h, rows_for("r", [(0, n)]), data)
    assert torch.isfinite(out.float()).all()
    sc = h.geometry[h.layer_names[0]].kv_scales
    assert sc is not None
    scaled = data[0].k.float() / 0.01
    for name in h.layer_names:
        counted = h.geometry[name].kv_scales
        assert counted is not None and counted.saturations() == (int((scaled.abs() > FP8_MAX).sum()), 0)
    stored = _stored(h, data)
    clamped = (torch.tensor([FP8_MAX, -FP8_MAX, 416.0]) * torch.tensor(0.01)).to(h.dtype)
    assert torch.equal(stored[0].k[2, 0, :3].cpu(), clamped)
    check(h, out, expected(h, rows_for("r", [(0, n)]), stored, AttentionMode.CAUSAL))


def test_undeclared_kv_cache_dtype_is_refused(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """A backend that does not declare fp8_e4m3 pages is refused with that reason, never served
    in its compute dtype instead."""
    if FP8_E4M3 in dkv_backend.capabilities.kv_cache_dtypes:
        pytest.skip(f"{dkv_backend.name} declares fp8_e4m3")
    dtype = pick_dtype(dkv_backend)
    reasons = reasons_against(dkv_platform, dkv_backend, dtype=dtype, kv_cache_dtype=FP8_E4M3)
    assert any("kv_cache_dtype=fp8_e4m3" in r for r in reasons), reasons
    with pytest.raises(DiffusionKVError):
        PagedHarness(
            dkv_platform, dtype=dtype, head_size=pick_head_size(dkv_backend), kv_cache_dtype=FP8_E4M3,
            block_size=pick_block_size(dkv_platform, dkv_backend), backend_choice=dkv_backend,
        )  # fmt: skip


# --- masks with a chunk, a window and sinks (autoregressive diffusion) ---------------------------


def test_chunk_causal_window_sink_stream(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """A stream of chunks over one row: chunk-causal attention over a sink chunk and a window of
    two chunks (the chunk's own included), the row extended by a chunk at a time, blocks that
    slid out of the window released (``NULL_BLOCK`` in the snapshot). Every chunk equals dense
    attention over the whole history under the same mask; a row that would read a released key
    is refused before any cache write."""
    bs = pick_block_size(dkv_platform, dkv_backend)
    spec = MaskSpec(AttentionMode.CHUNK_CAUSAL, chunk=bs, window=2 * bs, sink=bs)
    require(
        dkv_platform,
        dkv_backend,
        attention_modes=spec.required_modes,
        window=spec.window,
        sink=spec.sink,
        chunk=spec.chunk,
    )
    chunks = 5
    h = harness(
        dkv_platform,
        dkv_backend,
        mode=spec,
        block_size=bs,
        layer_names=("layer.0",),
        max_model_len=max(256, chunks * bs),
    )
    data = make_rows(h, [chunks * bs], seed=11)[0]
    blocks: list[int] = []
    generation = 0
    for c in range(chunks):
        start, end = c * bs, (c + 1) * bs
        blocks.extend(h.take_blocks(1, "permuted"))
        seq = SequenceAllocation(0, 0, end, end, (tuple(blocks),))
        h.registry.install(RequestAllocation("s", generation, (seq,)))
        generation += 1
        rows = (PagedRow("s", bs, end, start, sequence_id=0),)
        out = run(h, rows, [data])
        check(h, out, expected(h, rows, [data], spec))
        keep = spec.retention(end)
        for b in keep.releasable_blocks(h.block_size):
            blocks[b] = NULL_BLOCK
        if NULL_BLOCK in blocks:
            seq = SequenceAllocation(0, 0, end, end, (tuple(blocks),))
            h.registry.install(RequestAllocation("s", generation, (seq,)))
            generation += 1
    assert blocks[1 : chunks - 1] == [NULL_BLOCK] * (chunks - 2)
    before = h.cache_snapshot()
    with pytest.raises(StateError, match="would read tokens"):
        h.translator.prepare((PagedRow("s", bs, (chunks - 1) * bs, (chunks - 2) * bs, sequence_id=0),))
    assert all(torch.equal(a, b) for a, b in zip(before, h.cache_snapshot(), strict=True))


# --- sessions: chunks over a sliding window and sinks, committed or aborted ---------------------


class KitSessions:
    """Sessions (``SessionCache``) on a worker built for the backend under test, and the host's
    dense bookkeeping: every committed K/V per session, branch and layer, on the absolute
    timeline, so each denoise step is checked against dense attention over the whole history
    under the same mask. Blocks back in the pool are filled with NaN after every commit and
    abort, and block 0 -- the null entry the tables hold in a released place -- is kept out of
    the pool and NaN-filled too: a backend that reads a released key, or the null entry in its
    place, fails."""

    def __init__(
        self,
        platform: Platform,
        backend: Backend,
        policy: SessionPolicy,
        chunks: int,
        max_len: int | None = None,
    ) -> None:
        bs = pick_block_size(platform, backend)
        mask = policy.mask
        if max_len is None:  # the rows could hold every chunk (compaction keeps them far shorter)
            max_len = max(256, 4 * bs, cdiv(chunks * policy.chunk_tokens, bs) * bs)
        self.h = harness(  # small shapes: the kit also runs under Triton's interpreter
            platform,
            backend,
            mode=mask,
            block_size=bs,
            num_heads=2,
            num_kv_heads=2,
            layer_names=("layer.0",),
            max_model_len=max_len,
        )
        h = self.h
        self.pool = FreeListPool(h.num_blocks)
        null = self.pool.allocate(1)  # block 0, which the tables read for a released place: NaN
        assert null == [0], null
        allocator = DiffusionKVAllocator(
            block_size=h.block_size,
            max_model_len=h.max_model_len,
            max_rows_per_request=h.max_rows_per_request,
            worker_rows=h.max_rows_per_request * h.max_num_seqs,
            pool=self.pool,
        )
        self.cache = SessionCache(h.runner, allocator, policy)
        self.mask = mask
        self.gen = torch.Generator().manual_seed(policy.chunk_tokens)
        self.keys: dict[tuple[str, int], torch.Tensor] = {}
        self.values: dict[tuple[str, int], torch.Tensor] = {}
        self.poison()

    def begin(self, session_id: str, branches: int = 1) -> Session:
        h = self.h
        for b in range(branches):
            empty = torch.zeros(0, h.num_kv_heads, h.head_size, dtype=h.dtype, device=h.device)
            self.keys[session_id, b], self.values[session_id, b] = empty, empty
        return self.cache.begin_session(session_id, branches)

    def step(self, chunks: Sequence[Chunk]) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
        """One denoise step over ``chunks`` in one batch: fresh Q/K/V, the output checked against
        dense attention over each branch's committed K/V plus this write; returns the write."""
        h = self.h
        rows = tuple(r for c in chunks for r in c.rows())
        total = sum(r.query_len for r in rows)

        def rand(heads: int) -> torch.Tensor:
            t = torch.randn(total, heads, h.head_size, generator=self.gen)
            return t.to(device=h.device, dtype=h.dtype)

        q, k, v = rand(h.num_heads), rand(h.num_kv_heads), rand(h.num_kv_heads)
        with h.runner.stepper() as runtime:
            runtime.ensure_rows(rows)
            out = h.runner.forward(h.layer_names[0], q, k, v)
        written: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        refs = []
        at = 0
        for c in chunks:
            for row in c.rows():
                part = slice(at, at + row.query_len)
                at += row.query_len
                key = (c.session_id, int(row.sequence_id or 0))
                written[key] = (k[part], v[part])
                keys = torch.cat([self.keys[key], k[part]])
                values = torch.cat([self.values[key], v[part]])
                mask = self.mask.row_mask(c.start, c.tokens, c.end)
                refs.append(dense_attention(q[part], keys, values, mask, h.head_size**-0.5))
        check(h, out, Expected(torch.cat(refs), rows, self.mask))
        return written

    def commit(
        self, chunks: Sequence[Chunk], written: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Commit ``chunks``; the bookkeeping keeps ``written`` (the last step's K/V)."""
        for c in chunks:
            self.cache.commit(c)
        for key, (k, v) in written.items():
            self.keys[key] = torch.cat([self.keys[key], k])
            self.values[key] = torch.cat([self.values[key], v])
        self.poison()

    def chunk(self, session: Session) -> Chunk:
        c = self.cache.append_chunk(session)
        assert c is not None, f"the kit's pool is short for session {session.session_id!r}"
        return c

    def run(self, sessions: Sequence[Session], steps: int = 1) -> list[Chunk]:
        """One chunk of every session, in one batch per denoise step, then committed."""
        chunks = [self.chunk(s) for s in sessions]
        written: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for _ in range(steps):
            written = self.step(chunks)
        self.commit(chunks, written)
        return chunks

    def held_blocks(self) -> set[int]:
        held: set[int] = set()
        registry = self.h.registry
        for sid in self.cache.sessions:
            snapshot = registry.snapshot_of(sid)
            if snapshot is not None:
                for seq in snapshot.sequences:
                    held.update(b for b in seq.block_ids[0] if b != NULL_BLOCK)
        return held

    def poison(self) -> None:
        """NaN into every block no session holds (block 0, the null entry, included)."""
        h = self.h
        ratio = h.block_size // h.kernel_block_size
        held = self.held_blocks()
        free = [b * ratio + i for b in range(h.num_blocks) if b not in held for i in range(ratio)]
        if not free:
            return
        index = torch.tensor(free, dtype=torch.long, device=h.device)
        for cache in h.kv_caches.values():
            for t in key_value_caches(cache):
                t.index_fill_(0, index, float("nan"))

    def released(self, session: Session) -> list[int]:
        """Places of the session's first branch, on the timeline, whose blocks were released:
        ``NULL_BLOCK`` in its row, or cut out of the row by compaction (``row_offset`` tokens from
        ``cache.compact_from``)."""
        snapshot = self.h.registry.snapshot_of(session.session_id)
        assert snapshot is not None
        bs, cut = self.h.block_size, self.cache.compact_from // self.h.block_size
        moved = session.row_offset // bs
        nulls = [
            i if i < cut else i + moved
            for i, b in enumerate(snapshot.sequences[0].block_ids[0])
            if b == NULL_BLOCK
        ]
        return sorted([*range(cut, cut + moved), *nulls])


SESSION_LAYOUTS = {
    # name: (chunk in blocks, window chunks (the chunk's own excluded), sink chunks)
    "window-one-chunk-per-block": (1.0, 1, 0),
    "sink-chunk-boundary-inside-a-block": (1.5, 2, 1),
    "sink-two-chunks-per-block": (0.5, 1, 1),
    "no-window": (1.0, None, 0),
}
BOUNDARY = "sink-chunk-boundary-inside-a-block"
ALIGNED = (1.0, 1, 1)
"""The layout the session cases fall back to where chunk boundaries inside a page are refused
(a backend serving chunks as whole pages): a chunk per block, a window of one chunk, a sink."""


def session_policy(
    platform: Platform, backend: Backend, layout: str | tuple[float, int | None, int]
) -> SessionPolicy:
    blocks, window, sink = SESSION_LAYOUTS[layout] if isinstance(layout, str) else layout
    chunk = max(1, int(pick_block_size(platform, backend) * blocks))
    return SessionPolicy(chunk_tokens=chunk, window_chunks=window, sink_chunks=sink)


def served_session_policy(platform: Platform, backend: Backend) -> SessionPolicy:
    """Chunk boundaries inside blocks (:data:`BOUNDARY`) where the backend serves them, else
    :data:`ALIGNED` (skipped with the backend's reasons when it serves neither)."""
    for layout in (BOUNDARY, ALIGNED):
        policy = session_policy(platform, backend, layout)
        mask = policy.mask
        if not reasons_against(
            platform,
            backend,
            attention_modes=mask.required_modes,
            window=mask.window,
            sink=mask.sink,
            chunk=mask.chunk,
        ):
            return policy
    return policy  # refused: the harness skips with the reasons


@pytest.mark.parametrize("layout", sorted(SESSION_LAYOUTS))
def test_session_chunks_over_window_and_sink(
    dkv_platform: Platform, dkv_backend: Backend, layout: str
) -> None:
    """A session of five chunks, a denoise step each: every step equals dense attention over
    the whole history under the session's chunk-causal mask; what slid out of the window is
    released (its blocks NaN-filled in the pool) and never read; ending the session returns
    every block."""
    policy = session_policy(dkv_platform, dkv_backend, layout)
    kit = KitSessions(dkv_platform, dkv_backend, policy, chunks=5)
    session = kit.begin("s")
    for _ in range(5):
        kit.run([session])
    released = kit.released(session)
    if policy.window_chunks is None:
        assert released == []
    else:
        keep = policy.mask.retention(5 * policy.chunk_tokens)
        assert released == [b for b in keep.releasable_blocks(kit.h.block_size)], released
        assert released, f"{layout}: nothing slid out of the window in five chunks"
    kit.cache.end_session(session)
    assert kit.pool.num_free == kit.pool.num_total - 1  # block 0 held out (NaN)


def test_session_runs_past_the_rows_max_model_len(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """A stream twice as long as a row may be (``max_model_len`` just over what the rows hold
    live: sink, window, chunk, and the released run compaction waits for): every step equals
    dense attention over the whole history on the timeline, the rows stay short (the released
    places between the sink and the window are cut out, later positions moved down by whole
    chunks), and ending the session returns every block."""
    policy = served_session_policy(dkv_platform, dkv_backend)
    bs = pick_block_size(dkv_platform, dkv_backend)
    mask = policy.mask
    assert mask.window is not None
    unit = math.lcm(policy.chunk_tokens, bs)
    every = cdiv(mask.sink + mask.window, unit) * unit  # SessionCache.compact_tokens
    row_max = cdiv(mask.sink, bs) * bs + every + mask.window + 2 * bs
    max_len = cdiv(row_max, bs) * bs
    chunks = cdiv(2 * max_len, policy.chunk_tokens) + 1
    kit = KitSessions(dkv_platform, dkv_backend, policy, chunks=chunks, max_len=max_len)
    assert kit.cache.compact_tokens == every
    session = kit.begin("s")
    for _ in range(chunks):
        kit.run([session])
    assert session.committed_tokens == chunks * policy.chunk_tokens > 2 * max_len
    assert session.row_offset > 0 and session.committed_tokens - session.row_offset <= max_len
    kit.cache.end_session(session)
    assert kit.pool.num_free == kit.pool.num_total - 1  # block 0 held out (NaN)


def test_session_commit_keeps_the_last_denoise_step(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Three denoise steps write different K/V at the chunk's positions; the committed chunk is
    the last step's: the next chunk equals dense attention over those, not over the first
    step's (which would give another output)."""
    policy = served_session_policy(dkv_platform, dkv_backend)
    kit = KitSessions(dkv_platform, dkv_backend, policy, chunks=4)
    session = kit.begin("s")
    kit.run([session])
    chunk = kit.chunk(session)
    first = kit.step([chunk])
    kit.step([chunk])
    last = kit.step([chunk])
    assert not torch.equal(first["s", 0][0], last["s", 0][0])
    kit.commit([chunk], last)
    kit.run([session])  # checked against dense over the last step's K/V
    kit.cache.end_session(session)
    assert kit.pool.num_free == kit.pool.num_total - 1  # block 0 held out (NaN)


def test_session_abort_leaves_the_session_as_before(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """A chunk written by a denoise step, then aborted: the session's snapshot and the pool are
    exactly as before it, and the chunks after it equal dense attention over the committed
    history only (the aborted K/V never read; freed blocks NaN-filled)."""
    policy = served_session_policy(dkv_platform, dkv_backend)
    kit = KitSessions(dkv_platform, dkv_backend, policy, chunks=5)
    session = kit.begin("s", branches=2)
    for _ in range(3):
        kit.run([session])
    registry = kit.h.registry
    before = (registry.snapshot_of("s"), kit.pool.num_free)
    chunk = kit.chunk(session)
    kit.step([chunk])
    kit.cache.abort(chunk)
    after = registry.snapshot_of("s")
    assert before[0] is not None and after is not None
    assert (after.sequences, kit.pool.num_free) == (before[0].sequences, before[1])
    kit.poison()
    kit.run([session])
    kit.cache.end_session(session)
    assert kit.pool.num_free == kit.pool.num_total - 1  # block 0 held out (NaN)


def test_session_evicted_keys_are_never_read(dkv_platform: Platform, dkv_backend: Backend) -> None:
    """Once the window slid, the released blocks are back in the pool filled with NaN, and
    another session takes them; the first session's later chunks still equal dense attention
    (a backend reading a released place, or its null entry, returns NaN)."""
    policy = served_session_policy(dkv_platform, dkv_backend)
    kit = KitSessions(dkv_platform, dkv_backend, policy, chunks=6)
    first = kit.begin("a")
    for _ in range(4):
        kit.run([first])
    assert kit.released(first), "nothing slid out of the window"
    second = kit.begin("b")
    kit.run([first, second])
    kit.cache.end_session(first)
    kit.cache.end_session(second)
    assert kit.pool.num_free == kit.pool.num_total - 1  # block 0 held out (NaN)


def test_session_many_sessions_and_branches_in_one_batch(
    dkv_platform: Platform, dkv_backend: Backend
) -> None:
    """Sessions at different window fills (two CFG branches with blocks released, one at its
    second chunk, one just begun) in one batch per denoise step: each row equals dense attention
    over its own history."""
    policy = served_session_policy(dkv_platform, dkv_backend)
    kit = KitSessions(dkv_platform, dkv_backend, policy, chunks=5)
    old = kit.begin("old", branches=2)
    for _ in range(3):
        kit.run([old])
    mid = kit.begin("mid")
    kit.run([old, mid])
    new = kit.begin("new")
    kit.run([old, mid, new])
    for s in (old, mid, new):
        kit.cache.end_session(s)
    assert kit.pool.num_free == kit.pool.num_total - 1  # block 0 held out (NaN)

"""Decode context parallelism (DCP) in the cuda plugin, under Triton's interpreter on CPU.

* the Triton kernel's DCP mode (``kernels.paged_attention`` with ``cp_size > 1``) against the cpu
  reference's ``forward_partial`` on random page placements: interleave sizes 1 to the page
  size, ``cp_size`` 2 and 4, causal and full, GQA, with and without split-KV, rows whose local
  keys are all masked for some queries and rows with no local key at all;
* every cuda backend's ``forward_partial`` (``triton``, ``sdpa``, and ``paged`` on both of its
  ways) through a real worker against the cpu platform's, per rank, and the merged partials
  against dense attention, piecewise spans included;
* ``forward`` refuses DCP metadata; without DCP, ``forward_partial`` is ``forward`` plus its
  log-sum-exp.

Marked ``slow`` (``pytest -m slow``); skipped without Triton, and on a GPU machine (tests/gpu
runs the real kernels there).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

pytest.importorskip("triton", reason="Triton is not installed (ci/bootstrap.sh installs it)")

from collections.abc import Sequence

from diffusion_kv.conformance.harness import CapturePartials, PagedHarness
from diffusion_kv.conformance.reference import dense_attention, row_mask
from diffusion_kv.core.capabilities import AttentionMode
from diffusion_kv.core.errors import ValidationError
from diffusion_kv.core.layer_context import AttentionMetadata
from diffusion_kv.core.parallel import merge_partial_attention
from diffusion_kv.core.rows import PagedRow
from diffusion_kv.platforms.cpu import CpuPlatform
from diffusion_kv.platforms.cpu.backend import CpuPagedMetadata, CpuReferenceBackend
from diffusion_kv.platforms.interface import ENV_BACKEND, LayerGeometry
from tests.unit.test_cuda_interpreter import InterpretedCudaPlatform

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="GPU present: tests/gpu covers the real kernels"),
]

HKV, GROUP, D = 2, 3, 32
H = HKV * GROUP
SCALE = D**-0.5
WORKER_D = 64
"""Head size of the worker-level cases (one the cuda backends declare)."""


def owner(position: int, cp_size: int, interleave: int) -> int:
    return (position // interleave) % cp_size


def cpu_partial(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: CpuPagedMetadata, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cpu reference backend's ``forward_partial`` (it reads only its arguments)."""
    layer = LayerGeometry(
        "layer.0", H, HKV, D, SCALE, query.dtype, AttentionMode.CAUSAL if causal else AttentionMode.FULL
    )
    reference = CpuReferenceBackend.__new__(CpuReferenceBackend)
    return reference.forward_partial(layer, query, (k_cache, v_cache), md)


def rank_pages(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    cp_size: int,
    rank: int,
    interleave: int,
    page: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """One rank's pages: local key ``j`` of a row (its ``j``-th position owned by ``rank``) at
    page index ``j``, blocks placed at random. Returns K/V caches, block table, local lengths."""
    local = [[p for p in range(len(k)) if owner(p, cp_size, interleave) == rank] for k in keys]
    nblk = [-(-len(pos) // page) for pos in local]
    num_blocks = sum(nblk) + 3
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, page, HKV, D, generator=g)  # garbage where nothing is written
    v_cache = torch.randn(num_blocks, page, HKV, D, generator=g)
    table = torch.zeros(len(keys), max(max(nblk), 1), dtype=torch.int32)
    at = 0
    for r, positions in enumerate(local):
        table[r, : nblk[r]] = torch.tensor(order[at : at + nblk[r]], dtype=torch.int32)
        at += nblk[r]
        for j, p in enumerate(positions):
            blk = int(table[r, j // page])
            k_cache[blk, j % page] = keys[r][p]
            v_cache[blk, j % page] = values[r][p]
    return k_cache, v_cache, table, [len(pos) for pos in local]


def tiles(q_lens: Sequence[int], per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [r for r, n in enumerate(q_lens) for _ in range(0, n, per_tile)]
    starts = [q0 for n in q_lens for q0 in range(0, n, per_tile)]
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)


@pytest.mark.parametrize(
    ("cp_size", "interleave", "page", "block_n"),
    [(2, 1, 16, 32), (2, 4, 32, 16), (4, 2, 16, 16), (4, 8, 32, 32), (4, 16, 16, 16)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_dcp_mode_matches_cpu_reference(
    cp_size: int, interleave: int, page: int, block_n: int, causal: bool
) -> None:
    from diffusion_kv.platforms.cuda import kernels

    # a whole row (early queries see no key of later ranks), a row of 6 keys (no local key at
    # all on some ranks when the interleave is large), a suffix over cached keys
    seq_lens, q_lens = [53, 6, 40], [53, 6, 4]
    g = torch.Generator().manual_seed(cp_size * 100 + interleave * 10 + page + int(causal))
    keys = [torch.randn(n, HKV, D, generator=g) for n in seq_lens]
    values = [torch.randn(n, HKV, D, generator=g) for n in seq_lens]
    full_q = [torch.randn(n, H, D, generator=g) for n in seq_lens]
    query = torch.cat([q[n - ql :] for q, n, ql in zip(full_q, seq_lens, q_lens, strict=True)])
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    block_m = 32
    tile_row, tile_q0 = tiles(q_lens, block_m // GROUP)
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    masked_queries = 0
    for rank in range(cp_size):
        k_cache, v_cache, table, local = rank_pages(keys, values, cp_size, rank, interleave, page, seed=rank)
        md = CpuPagedMetadata(
            tuple(qsl),
            tuple(seq_lens),
            table,
            AttentionMode.CAUSAL if causal else AttentionMode.FULL,
            page,
            tuple(local),
            cp_size,
            rank,
            interleave,
        )
        ref_out, ref_lse = cpu_partial(query, k_cache, v_cache, md, causal)
        for splits in (1, 4):
            out = torch.full_like(query, float("nan"))
            lse = torch.full(query.shape[:2], float("nan"))
            kernels.paged_attention(
                query, k_cache, v_cache, out, table,
                torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                tile_row, tile_q0,
                scale=SCALE, causal=causal, block_m=block_m, block_n=block_n, num_splits=splits,
                lse=lse, local_seq_lens=torch.tensor(local, dtype=torch.int32),
                cp_size=cp_size, cp_rank=rank, cp_interleave=interleave,
            )  # fmt: skip
            assert not out.isnan().any() and not lse.isnan().any()
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
            hidden = torch.isneginf(lse)
            assert torch.equal(out[hidden], torch.zeros_like(out[hidden]))  # nothing visible: exactly 0
        masked_queries += int(torch.isneginf(ref_lse).any(dim=1).sum())
        outs.append(out)
        lses.append(lse)
    if causal:
        assert masked_queries > 0  # the layout has queries that see no local key on some rank
    merged = merge_partial_attention(outs, lses)
    expected = []
    for r, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        mask = row_mask(AttentionMode.CAUSAL if causal else AttentionMode.FULL, n - ql, ql, n)
        expected.append(dense_attention(full_q[r][n - ql :], keys[r], values[r], mask, SCALE))
    torch.testing.assert_close(merged.double(), torch.cat(expected), atol=1e-4, rtol=1e-4)


# --- through a worker: every backend against the cpu platform --------------------------------------


def rank_partials(
    platform: object,
    cp_size: int,
    rank: int,
    interleave: int,
    mode: AttentionMode,
    seq_lens: Sequence[int],
    data: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    rows: Sequence[PagedRow],
    spans: Sequence[Sequence[tuple[int, int]]] | None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """This rank's partials of every native call (one per piecewise segment) for ``rows``, after a
    prefill wrote every row; and the way each call's metadata took."""
    capture = CapturePartials(cp_size, rank)
    h = PagedHarness(
        platform,  # type: ignore[arg-type]
        num_heads=H,
        num_kv_heads=HKV,
        head_size=WORKER_D,
        block_size=16,
        num_blocks=96,
        max_model_len=768,
        max_rows_per_request=2,
        max_num_seqs=1,
        mode=mode,
        layer_names=("layer.0",),
        cp_size=cp_size,
        cp_rank=rank,
        cp_interleave=interleave,
        dcp_merger=capture,
        placement_seed=rank,
    )
    h.install("r", seq_lens)
    h.prefill("r", seq_lens, [(k, v) for _, k, v in data])
    capture.parts.clear()  # the prefill's own partials
    q = torch.cat([d[0][r.kv_start_pos : r.seq_len] for d, r in zip(data, rows, strict=True)])
    k = torch.cat([d[1][r.kv_start_pos : r.seq_len] for d, r in zip(data, rows, strict=True)])
    v = torch.cat([d[2][r.kv_start_pos : r.seq_len] for d, r in zip(data, rows, strict=True)])
    batch = h.translator.prepare(rows)
    with h.translator.activate(batch):
        meta = AttentionMetadata(full_attn_spans=spans) if spans is not None else None
        h.executor.forward("layer.0", q, k, v, meta)
        active = h.translator.require_active()  # holds the segments' metadata when spans cut rows
        native = (
            [m["layer.0"] for m in active.segment_metadata]
            if active.segment_metadata
            else [batch.attn_metadata["layer.0"]]
        )
        ways = [m.way.value if hasattr(m, "way") else "reference" for m in native]
    if mode is AttentionMode.CAUSAL and spans is None:
        md = batch.attn_metadata["layer.0"]
        with pytest.raises(ValidationError, match="DCP-sharded"):
            h.backend.forward(h.geometry["layer.0"], q, h.kv_caches["layer.0"], md)
    return capture.parts, ways


CASES = [
    # backend, cp_size, interleave, mode, seq_lens, (kv_start per row), spans
    ("triton", 2, 1, "causal", (45, 23), (0, 18), None),
    ("triton", 4, 2, "full", (45, 23), (40, 0), None),
    ("triton", 2, 4, "causal", (60,), (0,), ((20, 36),)),
    ("sdpa", 2, 1, "causal", (45, 23), (0, 18), None),
    ("sdpa", 4, 4, "causal", (45, 23), (0, 20), None),
    ("sdpa", 4, 2, "full", (45, 23), (40, 0), None),
    ("sdpa", 2, 4, "causal", (60,), (0,), ((20, 36),)),
    ("paged", 4, 8, "causal", (45, 23), (0, 18), None),  # Triton way (short queries)
    ("paged", 2, 16, "causal", (600,), (0,), None),  # gather + SDPA way (>= 512 queries)
]


@pytest.mark.parametrize(("backend", "cp_size", "interleave", "mode", "seq_lens", "starts", "spans"), CASES)
def test_backend_partials_match_cpu_reference_and_merge_to_dense(
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    cp_size: int,
    interleave: int,
    mode: str,
    seq_lens: tuple[int, ...],
    starts: tuple[int, ...],
    spans: tuple[tuple[int, int], ...] | None,
) -> None:
    monkeypatch.setenv(ENV_BACKEND, f"cuda:{backend}")
    attention = AttentionMode.CAUSAL if mode == "causal" else AttentionMode.FULL
    g = torch.Generator().manual_seed(7)
    data = [
        (
            torch.randn(n, H, WORKER_D, generator=g),
            torch.randn(n, HKV, WORKER_D, generator=g),
            torch.randn(n, HKV, WORKER_D, generator=g),
        )
        for n in seq_lens
    ]
    rows = tuple(
        PagedRow("r", n - s, n, s, sequence_id=i)
        for i, (n, s) in enumerate(zip(seq_lens, starts, strict=True))
    )
    row_spans = [list(spans)] * len(rows) if spans is not None else None
    cuda, cpu = InterpretedCudaPlatform(), CpuPlatform()
    per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for rank in range(cp_size):
        parts, ways = rank_partials(
            cuda, cp_size, rank, interleave, attention, seq_lens, data, rows, row_spans
        )
        ref_parts, _ = rank_partials(
            cpu, cp_size, rank, interleave, attention, seq_lens, data, rows, row_spans
        )
        if backend == "paged":
            assert set(ways) == {
                "sdpa" if max(n - s for n, s in zip(seq_lens, starts, strict=True)) >= 512 else "triton"
            }
        else:
            assert set(ways) == {backend}
        assert len(parts) == len(ref_parts) == len(ways)
        for (out, lse), (ref_out, ref_lse) in zip(parts, ref_parts, strict=True):
            assert lse.dtype == torch.float32 and not lse.isnan().any() and not out.isnan().any()
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        per_rank.append(parts)
    if spans is not None:
        return  # per-segment partials: the merged layer output is checked by the kit on the cpu
    finals = [parts[0] for parts in per_rank]
    merged = merge_partial_attention([o for o, _ in finals], [lse for _, lse in finals])
    expected = []
    for (q, k, v), r in zip(data, rows, strict=True):
        mask = row_mask(AttentionMode(mode), r.kv_start_pos, r.query_len, r.seq_len)
        expected.append(dense_attention(q[r.kv_start_pos : r.seq_len], k, v, mask, WORKER_D**-0.5))
    torch.testing.assert_close(merged.double(), torch.cat(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("mode", [AttentionMode.CAUSAL, AttentionMode.FULL])
def test_forward_partial_without_dcp_is_forward_with_its_lse(
    monkeypatch: pytest.MonkeyPatch, backend: str, mode: AttentionMode
) -> None:
    """Called directly without DCP, ``forward_partial`` attends over every key: ``forward``'s
    output, and the cpu reference's log-sum-exp."""
    monkeypatch.setenv(ENV_BACKEND, f"cuda:{backend}")
    seq_lens, starts = (40, 23), (0, 17)
    g = torch.Generator().manual_seed(11)
    kv = [
        (torch.randn(n, HKV, WORKER_D, generator=g), torch.randn(n, HKV, WORKER_D, generator=g))
        for n in seq_lens
    ]
    rows = tuple(
        PagedRow("r", n - s, n, s, sequence_id=i)
        for i, (n, s) in enumerate(zip(seq_lens, starts, strict=True))
    )
    query = torch.randn(sum(r.query_len for r in rows), H, WORKER_D, generator=g)
    results = []
    for platform in (InterpretedCudaPlatform(), CpuPlatform()):
        h = PagedHarness(
            platform,  # type: ignore[arg-type]
            num_heads=H,
            num_kv_heads=HKV,
            head_size=WORKER_D,
            block_size=16,
            mode=mode,
            layer_names=("layer.0",),
        )
        h.install("r", seq_lens)
        h.prefill("r", seq_lens, kv)
        batch = h.translator.prepare(rows)
        md = batch.attn_metadata["layer.0"]
        layer, cache = h.geometry["layer.0"], h.kv_caches["layer.0"]
        results.append(
            (h.backend.forward(layer, query, cache, md), *h.backend.forward_partial(layer, query, cache, md))
        )
    (full, out, lse), (_, ref_out, ref_lse) = results
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)

"""The cuda plugin's Triton kernels under Triton's interpreter on CPU (small shapes).

The whole conformance kit runs against the cuda plugin's own backends (``paged``, ``triton`` and
``sdpa``, with TritonBlockTables) on the CPU, once each, so kernel-logic regressions are caught
without a GPU; that includes the strict-Ulysses and DCP cases, which they declare. Skipped when
Triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_interpreted import InterpretedCudaPlatform  # sets TRITON_INTERPRET first

pytest.importorskip("triton", reason="Triton is not installed (ci/bootstrap.sh installs it)")

from collections.abc import Iterator

from diffusion_kv.conformance.test_paged_attention import *  # noqa: F403
from diffusion_kv.core.block_tables import TorchBlockTables
from diffusion_kv.platforms.cuda import CudaPlatform
from diffusion_kv.platforms.cuda.block_tables import TritonBlockTables
from diffusion_kv.platforms.interface import ENV_BACKEND, PagedBackend

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="GPU present: tests/gpu covers the real kernels"),
]


@pytest.fixture(scope="module")
def dkv_platform() -> CudaPlatform:
    return InterpretedCudaPlatform()


@pytest.fixture(params=["paged", "triton", "sdpa"])
def dkv_backend(
    request: pytest.FixtureRequest, dkv_platform: CudaPlatform, monkeypatch: pytest.MonkeyPatch
) -> Iterator[type[PagedBackend]]:
    monkeypatch.setenv(ENV_BACKEND, f"cuda:{request.param}")
    yield next(b for b in dkv_platform.backends if b.name == request.param)


def _tables(**kw: object) -> tuple[TritonBlockTables, TorchBlockTables]:
    args: dict = dict(
        block_sizes=[16],
        max_num_reqs=4,
        max_num_batched_tokens=256,
        max_num_blocks_per_group=[6],
        device="cpu",
    )
    args.update(kw)
    return TritonBlockTables(**args), TorchBlockTables(**args)


@pytest.mark.parametrize(
    "kw", [{}, {"kernel_block_sizes": [8]}, {"cp_size": 2, "cp_rank": 1, "cp_interleave": 4}]
)
def test_triton_gather_and_slots_match_torch(kw: dict) -> None:
    tri, ref = _tables(**kw)
    for bt in (tri, ref):
        bt.append_block_ids(2, ([5, 1, 3],), overwrite=True)
        bt.append_block_ids(0, ([4],), overwrite=True)
        bt.apply_staged_writes()
    idx = torch.tensor([2, 0, -1], dtype=torch.int32)
    for a, b in zip(tri.gather_block_tables(idx, 4), ref.gather_block_tables(idx, 4), strict=True):
        assert torch.equal(a, b)
    qsl = torch.tensor([0, 40, 43, 45], dtype=torch.int32)
    pos = torch.cat([torch.arange(0, 40), torch.arange(13, 16), torch.arange(0, 2)])
    assert torch.equal(
        tri.compute_slot_mappings(idx, qsl, pos, 48), ref.compute_slot_mappings(idx, qsl, pos, 48)
    )


def test_triton_write_skips_padding_slots() -> None:
    from diffusion_kv.platforms.cuda import kernels

    cache = torch.zeros(2, 3, 4, 2, 8)
    key = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8) + 1
    kernels.write_kv(key, -key, cache[0], cache[1], torch.tensor([5, -1, 0]))
    flat_k = cache[0].view(12, 2, 8)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[0], key[2])
    assert int(torch.count_nonzero(flat_k)) == 2 * 2 * 8
    assert torch.equal(cache[1].view(12, 2, 8)[5], -key[0])


def test_split_kv_matches_single_pass() -> None:
    from diffusion_kv.platforms.cuda import kernels

    g = torch.Generator().manual_seed(0)
    nb, page, hkv, d, h = 12, 16, 2, 64, 4
    kc, vc = torch.randn(nb, page, hkv, d, generator=g), torch.randn(nb, page, hkv, d, generator=g)
    q = torch.randn(6, h, d, generator=g)
    bt = torch.randperm(nb, generator=g)[:10].view(2, 5).to(torch.int32)
    seq = torch.tensor([70, 33], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 6], dtype=torch.int32)
    rows, q0 = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    outs = []
    for splits in (1, 4):
        out = torch.empty_like(q)
        kernels.paged_attention(
            q,
            kc,
            vc,
            out,
            bt,
            seq,
            qsl,
            rows,
            q0,
            scale=0.125,
            causal=True,
            block_m=16,
            block_n=16,
            num_splits=splits,
        )
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page,block_n", [(32, 16), (32, 32), (16, 32)])  # aligned, aligned, per-key
@pytest.mark.parametrize("causal", [False, True])
def test_paged_kernel_matches_dense_for_both_page_paths(page: int, block_n: int, causal: bool) -> None:
    """A key tile inside one page (scalar page lookup) and tiles spanning pages give the dense
    answer, with GQA packing (4 query heads per KV head) and split KV."""
    from diffusion_kv.platforms.cuda import kernels

    g = torch.Generator().manual_seed(page * 7 + block_n + int(causal))
    hkv, group, d = 2, 4, 32
    h = hkv * group
    seqs, qlens = [75, 40], [5, 3]
    nblk = [-(-s // page) for s in seqs]
    nb = sum(nblk) + 3
    kc, vc = torch.randn(nb, page, hkv, d, generator=g), torch.randn(nb, page, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(2, max(nblk), dtype=torch.int32)
    bt[0, : nblk[0]] = perm[: nblk[0]].to(torch.int32)
    bt[1, : nblk[1]] = perm[nblk[0] : nblk[0] + nblk[1]].to(torch.int32)
    q = torch.randn(sum(qlens), h, d, generator=g)
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    seq = torch.tensor(seqs, dtype=torch.int32)
    rows, q0 = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    expected = torch.empty_like(q)
    for r in range(2):
        k = kc[bt[r, : nblk[r]].long()].reshape(-1, hkv, d)[: seqs[r]].repeat_interleave(group, 1)
        v = vc[bt[r, : nblk[r]].long()].reshape(-1, hkv, d)[: seqs[r]].repeat_interleave(group, 1)
        qr = q[int(qsl[r]) : int(qsl[r + 1])]
        s = torch.einsum("thd,khd->htk", qr, k) * 0.2
        if causal:  # bottom-right aligned: query t sees keys <= seq - qlen + t
            allowed = torch.arange(seqs[r])[None, :] <= (seqs[r] - qlens[r] + torch.arange(qlens[r]))[:, None]
            s = s.masked_fill(~allowed[None], float("-inf"))
        expected[int(qsl[r]) : int(qsl[r + 1])] = torch.einsum("htk,khd->thd", s.softmax(-1), v)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        kernels.paged_attention(
            q, kc, vc, out, bt, seq, qsl, rows, q0,
            scale=0.2, causal=causal, block_m=32, block_n=block_n, num_splits=splits,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


PLANNED_MASKS = {
    "chunk-window-sink": dict(kind="CHUNK_CAUSAL", chunk=32, window=96, sink=32),
    "chunk-window-sink-unaligned": dict(kind="CHUNK_CAUSAL", chunk=24, window=72, sink=20),
    "chunk-no-window": dict(kind="CHUNK_CAUSAL", chunk=40),
    "causal-window-sink": dict(kind="CAUSAL", window=50, sink=16),
    "full-window": dict(kind="FULL", window=64),
}


@pytest.mark.parametrize("mask", sorted(PLANNED_MASKS))
@pytest.mark.parametrize("splits", [1, 4])
def test_planned_masks_over_long_histories_match_dense(mask: str, splits: int) -> None:
    """Chunk-causal, windowed and sink masks over long histories, sinks and windows of several
    key tiles, aligned to the tiles and not: the kernel reads each program's sink run and window
    run only. Released pages hold NaN in the cache and the null entry 0 in the table, so a tile
    reaching one would poison the output. Equal to dense attention under the mask."""
    from diffusion_kv.conformance.reference import dense_attention
    from diffusion_kv.core.attention import AttentionMode, MaskSpec
    from diffusion_kv.platforms.cuda import kernels

    kw = dict(PLANNED_MASKS[mask])
    spec = MaskSpec(AttentionMode[str(kw.pop("kind"))], **kw)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(len(mask) + splits)
    hkv, group, d, page, block_n, block_m = 2, 2, 16, 16, 16, 32
    h = hkv * group
    seqs, qlens = [300, 160, 64], [64, 40, 64]
    nblk = [-(-s // page) for s in seqs]
    nb = sum(nblk) + 1
    kc = torch.full((nb, page, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    order = (torch.randperm(nb - 1, generator=g) + 1).tolist()  # block 0: the null entry
    bt = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
    q = torch.randn(sum(qlens), h, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    expected, at = [], 0
    for r, (sl, ql) in enumerate(zip(seqs, qlens, strict=True)):
        k, v = torch.randn(sl, hkv, d, generator=g), torch.randn(sl, hkv, d, generator=g)
        visible = spec.row_mask(sl - ql, ql, sl)
        seen = visible.any(dim=0)
        for i in range(nblk[r]):
            keys = slice(i * page, min((i + 1) * page, sl))
            if bool(seen[keys].any()):  # else released: NaN stays, the table holds 0
                bt[r, i] = order[at + i]
                kc[order[at + i], : keys.stop - keys.start] = k[keys]
                vc[order[at + i], : keys.stop - keys.start] = v[keys]
        at += nblk[r]
        expected.append(dense_attention(q[int(qsl[r]) : int(qsl[r + 1])], k, v, visible, 0.25))
    per_tile = block_m // group
    tiles = [(r, t) for r, n in enumerate(qlens) for t in range(0, n, per_tile)]
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(
        q, kc, vc, out, bt, torch.tensor(seqs, dtype=torch.int32), qsl,
        torch.tensor([r for r, _ in tiles], dtype=torch.int32), torch.tensor([t for _, t in tiles], dtype=torch.int32),
        scale=0.25, causal=spec.kind is AttentionMode.CAUSAL, block_m=block_m, block_n=block_n,
        num_splits=splits, chunk=spec.chunk, window=spec.window, sink=spec.sink,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page,block_n", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
def test_query_tiles_past_the_first_split_their_keys_into_unmasked_and_masked_tiles(
    page: int, block_n: int, causal: bool, splits: int
) -> None:
    """Several query tiles per row: under a causal mask each tile's main loop ends at the
    diagonal of its own first query (a different key tile for each), the rest checked key by
    key; rows with a prefix, without one, and shorter than a key tile; every key split. Equal to
    dense attention."""
    from diffusion_kv.platforms.cuda import kernels

    g = torch.Generator().manual_seed(page + 3 * block_n + 5 * splits + int(causal))
    hkv, group, d, block_m = 2, 2, 32, 16
    h = hkv * group
    seqs, qlens = [100, 37, 90, 9], [40, 37, 5, 9]
    nblk = [-(-s // page) for s in seqs]
    nb = sum(nblk) + 2
    kc, vc = torch.randn(nb, page, hkv, d, generator=g), torch.randn(nb, page, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
    at = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = perm[at : at + n].to(torch.int32)
        at += n
    q = torch.randn(sum(qlens), h, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    per_tile = block_m // group
    tiles = [(r, t) for r, n in enumerate(qlens) for t in range(0, n, per_tile)]
    rows = torch.tensor([r for r, _ in tiles], dtype=torch.int32)
    q0 = torch.tensor([t for _, t in tiles], dtype=torch.int32)
    expected = torch.empty_like(q)
    for r, (sl, ql) in enumerate(zip(seqs, qlens, strict=True)):
        k = kc[bt[r, : nblk[r]].long()].reshape(-1, hkv, d)[:sl].repeat_interleave(group, 1)
        v = vc[bt[r, : nblk[r]].long()].reshape(-1, hkv, d)[:sl].repeat_interleave(group, 1)
        qr = q[int(qsl[r]) : int(qsl[r + 1])]
        sc = torch.einsum("thd,khd->htk", qr, k) * 0.25
        if causal:  # bottom-right aligned
            allowed = torch.arange(sl)[None, :] <= (sl - ql + torch.arange(ql))[:, None]
            sc = sc.masked_fill(~allowed[None], float("-inf"))
        expected[int(qsl[r]) : int(qsl[r + 1])] = torch.einsum("htk,khd->thd", sc.softmax(-1), v)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(
        q, kc, vc, out, bt, torch.tensor(seqs, dtype=torch.int32), qsl, rows, q0,
        scale=0.25, causal=causal, block_m=block_m, block_n=block_n, num_splits=splits,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "group,page,block_n,prefetch",
    [(1, 16, 16, True), (2, 32, 16, True), (4, 32, 16, False), (4, 16, 32, True), (4, 128, 64, True)],
)
def test_fp8_pages_every_mode_matches_dequantised_attention(
    group: int, page: int, block_n: int, prefetch: bool
) -> None:
    """e4m3 pages (quantised by torch: the interpreter's own float8 casts do not round to
    nearest) through every way the kernel multiplies them, GQA ratios 1/2/4 packed into the
    tile's rows, odd query lengths, split KV, tiles inside one page (with and without the next
    page prefetched) and spanning pages: the answer over the dequantised pages, to float32
    rounding for the widened and float16 ways and 1e-3 for the two-term fp8 queries."""
    from diffusion_kv.platforms.cuda import kernels

    g = torch.Generator().manual_seed(group * 100 + page + block_n)
    hkv, d = 2, 32
    h = hkv * group
    seqs, qlens = [150, 41], [5, 3]
    nblk = [-(-s // page) for s in seqs]
    nb = sum(nblk) + 2
    k_scale, v_scale = torch.tensor([0.5, 0.25]), torch.tensor([0.125, 2.0])
    kc = (torch.randn(nb, page, hkv, d, generator=g) / 2).to(torch.float8_e4m3fn)
    vc = (torch.randn(nb, page, hkv, d, generator=g) / 2).to(torch.float8_e4m3fn)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(2, max(nblk), dtype=torch.int32)
    bt[0, : nblk[0]] = perm[: nblk[0]].to(torch.int32)
    bt[1, : nblk[1]] = perm[nblk[0] : nblk[0] + nblk[1]].to(torch.int32)
    q = torch.randn(sum(qlens), h, d, generator=g)
    q[0, 0] = 0.0  # a query row of zeros keeps a finite descale
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    seq = torch.tensor(seqs, dtype=torch.int32)
    block_m = 16 * group
    per_tile = block_m // group
    rows = [r for r, n in enumerate(qlens) for _ in range(0, n, per_tile)]
    q0s = [q0 for n in qlens for q0 in range(0, n, per_tile)]
    expected = torch.empty_like(q)
    for r in range(2):
        blocks = bt[r, : nblk[r]].long()
        k = (kc[blocks].float() * k_scale[:, None]).reshape(-1, hkv, d)[: seqs[r]].repeat_interleave(group, 1)
        v = (vc[blocks].float() * v_scale[:, None]).reshape(-1, hkv, d)[: seqs[r]].repeat_interleave(group, 1)
        qr = q[int(qsl[r]) : int(qsl[r + 1])]
        s = torch.einsum("thd,khd->htk", qr, k) * 0.2
        allowed = torch.arange(seqs[r])[None, :] <= (seqs[r] - qlens[r] + torch.arange(qlens[r]))[:, None]
        s = s.masked_fill(~allowed[None], float("-inf"))
        expected[int(qsl[r]) : int(qsl[r + 1])] = torch.einsum("htk,khd->thd", s.softmax(-1), v)
    for qk, pv in [(0, 0), (1, 1), (2, 1), (2, 0)]:
        out = torch.full_like(q, float("nan"))
        kernels.paged_attention(
            q, kc, vc, out, bt, seq, qsl,
            torch.tensor(rows, dtype=torch.int32), torch.tensor(q0s, dtype=torch.int32),
            scale=0.2, causal=True, block_m=block_m, block_n=block_n, num_splits=2,
            k_scale=k_scale, v_scale=v_scale, qk_mode=qk, pv_mode=pv, prefetch_pages=prefetch,
        )  # fmt: skip
        tol = 1e-3 if qk == kernels.FP8_MMA else 2e-5 if qk == pv == kernels.FP8_WIDEN else 1e-3
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_fp8_mode_defaults_and_refusals() -> None:
    """Off SM90 (here: the interpreter on CPU) e4m3 pages are widened; unknown ways are refused
    before anything is launched, with the output untouched."""
    from diffusion_kv.platforms.cuda import kernels

    assert kernels.fp8_modes(torch.device("cpu"), 128) == (kernels.FP8_WIDEN, kernels.FP8_WIDEN)
    kc = torch.zeros(2, 16, 1, 32).to(torch.float8_e4m3fn)
    q = torch.randn(1, 1, 32)
    out = torch.full_like(q, 7.0)
    one = torch.ones(1)
    i0, i1 = torch.zeros(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    for qk, pv in [(3, 0), (0, kernels.FP8_MMA)]:
        with pytest.raises(ValueError, match="qk_mode"):
            kernels.paged_attention(
                q, kc, kc, out, i0.view(1, 1), torch.tensor([16], dtype=torch.int32), i1, i0, i0,
                scale=1.0, causal=False, block_m=16, block_n=16, num_splits=1,
                k_scale=one, v_scale=one, qk_mode=qk, pv_mode=pv,
            )  # fmt: skip
        assert torch.equal(out, torch.full_like(q, 7.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,d", [(3, 32), (2, 64)])
def test_gather_dequant_equals_torch_dequantise_of_the_gathered_pages(
    dtype: torch.dtype, hkv: int, d: int
) -> None:
    """The gather + SDPA way's e4m3 read: ``gather_dequant`` (pages named by block, rows cut to
    ``keys``) and ``dequant`` (a strided view) equal ``kv_quant.dequantize`` of the same bytes --
    float32 times the head's scale, rounded once -- over pages that are one half of a combined
    K/V cache (strided, not contiguous). float16 exactly; bfloat16 within one bfloat16 step,
    because Triton's interpreter truncates float32 to bfloat16 where the GPU rounds to nearest."""
    from diffusion_kv.core.kv_quant import dequantize
    from diffusion_kv.platforms.cuda import kernels

    g = torch.Generator().manual_seed(hkv * d)
    nb, page = 9, 16
    both = (torch.randn(nb, 2, page, hkv, d, generator=g) * 40).to(torch.float8_e4m3fn)
    cache = both[:, 0]  # [nb, page, hkv, d], page stride 2 * page * hkv * d
    scale = torch.rand(hkv, generator=g) + 0.25
    index = torch.tensor([4, 0, 7, 2, 8, 1])
    rows, keys = 2, 3 * page - 5
    want = dequantize(cache.index_select(0, index).view(rows, 3 * page, hkv, d)[:, :keys], scale, dtype)
    got = kernels.gather_dequant(cache, index, rows, keys, scale, dtype)
    view = cache[2:5, 3:13]  # [3 rows, 10 keys, hkv, d]: rows a page apart, K and V interleaved
    assert not view.is_contiguous()
    want_view = dequantize(view, scale, dtype)
    got_view = kernels.dequant(view, scale, dtype)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert got_view.shape == want_view.shape and got_view.is_contiguous()
    for a, b in ((got, want), (got_view, want_view)):
        if dtype == torch.float16:
            assert torch.equal(a, b)
        else:
            step = b.float().abs() * 2.0**-7
            assert bool(((a.float() - b.float()).abs() <= step).all())


def test_gather_dequant_refuses_what_it_cannot_read() -> None:
    """16-bit pages, a scale of the wrong shape or dtype, more keys than the rows' pages hold, and
    block ids that do not split into the rows are refused with the reason."""
    from diffusion_kv.platforms.cuda import kernels

    cache = torch.zeros(4, 16, 2, 32).to(torch.float8_e4m3fn)
    one = torch.ones(2)
    idx = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="got torch.bfloat16 pages"):
        kernels.gather_dequant(cache.to(torch.bfloat16), idx, 2, 32, one, torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale must be float32 \[2\]"):
        kernels.gather_dequant(cache, idx, 2, 32, torch.ones(3), torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale must be float32 \[2\]"):
        kernels.dequant(cache[None, 0], one.half(), torch.bfloat16)
    with pytest.raises(ValueError, match="33 keys exceed 2 pages of 16"):
        kernels.gather_dequant(cache, idx, 2, 33, one, torch.bfloat16)
    with pytest.raises(ValueError, match="4 block ids do not split into 3 rows"):
        kernels.gather_dequant(cache, idx, 3, 16, one, torch.bfloat16)


def test_paged_takes_gather_sdpa_for_compute_bound_e4m3_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda:paged`` over e4m3 pages chooses its way as for 16-bit pages: with the compute-bound
    threshold lowered to this test's row length, the batch takes gather + SDPA (its reason says
    the pages are dequantised in the gather), reads the pages through ``gather_dequant`` or
    ``dequant`` and never through the Triton attention kernel, and equals dense attention over
    the values the pages hold, prefill and a denoise step over the cached prefix alike.

    The interpreter's float8 casts do not round to nearest (``tests/cuda_interpreted.py``), so
    the pages are written by torch's quantiser here (``write_pages``: what the Triton writer
    computes on a GPU, where ``tests/gpu`` checks it); reading e4m3 is exact in the interpreter."""
    import dataclasses

    from diffusion_kv.conformance.test_paged_attention import (
        _stored,
        check,
        expected,
        harness,
        make_rows,
        rows_for,
        run,
    )
    from diffusion_kv.core.attention import AttentionMode
    from diffusion_kv.core.batch import write_pages
    from diffusion_kv.core.kv_quant import FP8_E4M3, FP8_MAX
    from diffusion_kv.platforms.cuda import backend as cuda_backend
    from diffusion_kv.platforms.cuda import kernels
    from diffusion_kv.platforms.cuda.backend import CudaPagedBackend
    from tests.cuda_interpreted import interpreted

    class E4m3Paged(interpreted(CudaPagedBackend)):  # type: ignore[misc]
        capabilities = dataclasses.replace(CudaPagedBackend.capabilities, dtypes=frozenset({torch.float16}))

    class E4m3Platform(InterpretedCudaPlatform):
        backends = (E4m3Paged,)

    def torch_writer(
        key: torch.Tensor, value: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor,
        k_scale: torch.Tensor, v_scale: torch.Tensor, saturated: torch.Tensor,
    ) -> None:  # fmt: skip
        keep = slots >= 0
        write_pages(kc, slots[keep], key[keep], k_scale, saturated[0])
        write_pages(vc, slots[keep], value[keep], v_scale, saturated[1])

    monkeypatch.setattr(kernels, "write_kv", torch_writer)
    monkeypatch.setattr(cuda_backend, "SDPA_MIN_QUERY", 16)
    calls: dict[str, int] = {"gather_dequant": 0, "dequant": 0, "paged_attention": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*a: object, _real: object = real, _name: str = name, **kw: object) -> object:
            calls[_name] += 1
            return _real(*a, **kw)  # type: ignore[operator]

        monkeypatch.setattr(kernels, name, counted)
    monkeypatch.setenv(ENV_BACKEND, "cuda:paged")
    h = harness(
        E4m3Platform(), E4m3Paged, kv_cache_dtype=FP8_E4M3, num_heads=4, num_kv_heads=2, dtype=torch.float16,
        k_scale=[7.0 / FP8_MAX, 8.0 / FP8_MAX], v_scale=[7.5 / FP8_MAX, 0.25],
    )  # fmt: skip
    bs = h.block_size
    prefix, target = 2 * bs + 3, bs + 5
    n = prefix + target
    h.install("r", [n, n])
    data = make_rows(h, [n, n], seed=91)
    rows = rows_for("r", [(0, n), (0, n)])
    run(h, rows, data)  # writes every token
    check(h, run(h, rows, data), expected(h, rows, _stored(h, data), AttentionMode.CAUSAL))
    denoise = rows_for("r", [(prefix, n), (prefix, n)])
    md = h.translator.prepare(denoise).attn_metadata[h.layer_names[0]]
    assert md.way is cuda_backend.KernelWay.SDPA and "dequantised" in md.reason, (md.way, md.reason)
    out = run(h, denoise, data)
    check(h, out, expected(h, denoise, _stored(h, data), AttentionMode.CAUSAL))
    assert calls["paged_attention"] == 0, calls
    assert calls["gather_dequant"] + calls["dequant"] >= 2, calls

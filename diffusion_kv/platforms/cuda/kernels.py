"""Triton kernels of the CUDA plugin's standalone tier.

* ``write_kv``: scatter a layer's new K/V into the pages by slot mapping (``-1`` skipped);
  into e4m3 pages it divides by the per-KV-head scales, clamps to +-448 (counting what it
  clamps) and rounds in the same pass.
* ``paged_attention``: attention that reads K/V in place through the block table (no gather
  copy): packed varlen queries, per-row KV lengths, bottom-right causal or full masks, GQA by
  packing the query heads of one KV head into the tile's rows, fp32 accumulation, and split-KV
  over the pages combined by log-sum-exp when there are too few query tiles to fill the GPU.
  e4m3 pages are read in place: on SM90 and later the key tiles go straight into fp8 MMAs
  (the queries quantised per row, as two e4m3 terms, with a descale) and the value tiles are
  widened to float16; elsewhere both are widened in registers (``FP8_MODES``). The key scale
  folds into the softmax scale and the value scale into the output (one scale per KV head,
  which is what a program serves), so no dequantised copy of the cache is made.
  Optionally it also writes each query's natural-log log-sum-exp, and in its decode context
  parallelism (DCP) mode it attends over one rank's interleaved keys only (see
  :func:`paged_attention`).
* ``gather_dequant`` / ``dequant``: e4m3 pages times their per-KV-head scales into a contiguous
  16-bit copy, gathered by block or from a view, in one pass (what the gather + SDPA way reads
  e4m3 pages through).
* ``gather_block_tables`` / ``compute_slot_mappings``: one launch each per KV-cache group.
* ``prepare_batch``: what ``Translator.prepare`` needs on the device, in one launch per
  KV-cache group, from the batch's per-row integers: positions, slot mappings and the
  gathered block-table rows.

Importing this module imports Triton; the plugin imports it lazily. Every kernel also runs under
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how CI exercises them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------
# KV write
# --------------------------------------------------------------------------------------------


FP8_VIA_F16 = True
"""How the attention kernel widens e4m3 pages: through float16 (the default: 10% faster on the
H200, ``benchmarks/fp8_widening.py``) or directly to the query dtype; exact either way."""


@triton.jit
def _round_e4m3(x):
    """``x`` (float32, within +-448) rounded to the nearest e4m3 value, ties to even, still in
    float32: the cast to float8 that follows is then exact. (Triton converts float32 to e4m3
    through float16, and rounding twice differs from rounding once in rare cases; torch's
    ``.to(torch.float8_e4m3fn)`` rounds once.) Normal range: keep 3 of the 23 mantissa bits;
    below 2**-6 the e4m3 step is 2**-9: add and subtract 1.5 * 2**14 (a zero keeps its sign)."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    small = (x + 24576.0) - 24576.0
    small = tl.where(small == 0.0, x * 0.0, small)  # keep the sign of a zero, as torch does
    return tl.where(tl.abs(x) < 0.015625, small, normal)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    saturated_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HEAD_D)
        hm = h < NUM_KV_HEADS
        src_k = key_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
        src_v = value_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
        dst = blk * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(src_k, mask=hm[:, None])
        v = tl.load(src_v, mask=hm[:, None])
        if QUANT:  # e4m3 pages: x / scale, clamped to +-448 (counted), rounded on the store
            ks = tl.load(k_scale_ptr + h, mask=hm, other=1.0)
            vs = tl.load(v_scale_ptr + h, mask=hm, other=1.0)
            # correctly rounded division (Triton's "/" is approximate): the same x / scale as torch
            kf = tl.div_rn(k.to(tl.float32), ks[:, None])
            vf = tl.div_rn(v.to(tl.float32), vs[:, None])
            k_over = tl.sum(tl.sum(((tl.abs(kf) > 448.0) & hm[:, None]).to(tl.int32), 1), 0)
            v_over = tl.sum(tl.sum(((tl.abs(vf) > 448.0) & hm[:, None]).to(tl.int32), 1), 0)
            if k_over > 0:
                tl.atomic_add(saturated_ptr, k_over.to(tl.int64))
            if v_over > 0:
                tl.atomic_add(saturated_ptr + 1, v_over.to(tl.int64))
            k = _round_e4m3(tl.minimum(tl.maximum(kf, -448.0), 448.0))
            v = _round_e4m3(tl.minimum(tl.maximum(vf, -448.0), 448.0))
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=hm[:, None])
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=hm[:, None])


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    saturated: torch.Tensor | None = None,
) -> None:
    """``key/value [T, Hkv, D]`` (token stride free, inner dims packed) -> caches ``[NB, PAGE, Hkv, D]``;
    e4m3 caches take ``k_scale``/``v_scale`` ``[Hkv]`` (float32) and count clamped values into
    ``saturated`` ``[2]`` (int64)."""
    T = key.shape[0]
    if T == 0:
        return
    _, page, hkv, d = key_cache.shape
    quant = key_cache.dtype == torch.float8_e4m3fn
    if quant and (k_scale is None or v_scale is None or saturated is None):
        raise ValueError("write_kv into float8_e4m3fn pages needs k_scale, v_scale and saturated")
    _write_kv_kernel[(T,)](
        key,
        value,
        key_cache,
        value_cache,
        slots,
        k_scale if quant else slots,
        v_scale if quant else slots,
        saturated if quant else slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=hkv,
        HEAD_D=d,
        PAGE=page,
        BLOCK_H=triton.next_power_of_2(hkv),
        QUANT=quant,
    )


# --------------------------------------------------------------------------------------------
# Paged attention (split-KV, pages read in place)
# --------------------------------------------------------------------------------------------

# How the attention kernel multiplies e4m3 pages (``qk_mode`` for Q.K^T, ``pv_mode`` for P.V):
FP8_WIDEN = 0
"""Widen each e4m3 tile to the query dtype in registers, a 16-bit MMA (any GPU, the interpreter)."""
FP8_F16 = 1
"""Widen to float16 (one native conversion on SM89+) and multiply in float16; the queries are
scaled per row into [-1, 1] (Q.K^T), the weights are already in [0, 1] (P.V)."""
FP8_MMA = 2
"""fp8 tensor cores (Q.K^T only): e4m3 key tiles straight into the MMAs, the queries quantised per
row with a descale, as two e4m3 terms (``q ~ hi + lo / 16``, two MMAs): one term alone costs
3-4e-4 of cosine similarity on random data, which the 0.999 bound for e4m3 pages cannot spare;
two give the widened path's accuracy. (P.V in fp8, the weights as two e4m3 terms, measured
slower than float16 on an H100 with Triton 3.6 and gave NaNs there: left out.)"""
FP8_MODES = (FP8_WIDEN, FP8_F16, FP8_MMA)
PV_MODES = (FP8_WIDEN, FP8_F16)
_FP8_F16: tl.constexpr = tl.constexpr(FP8_F16)
_FP8_MMA: tl.constexpr = tl.constexpr(FP8_MMA)
_FP8_WIDEN: tl.constexpr = tl.constexpr(FP8_WIDEN)
_FP8_LO: tl.constexpr = tl.constexpr(16.0)


@triton.jit
def _attend_key_tile(
    acc,
    m_i,
    l_i,
    next_page,
    v0,
    end,
    q,
    q_mma,
    q_lo8,
    row_scale,
    qpos,
    q_lo_pos,
    q_hi_pos,
    key_cache_ptr,
    value_cache_ptr,
    bt_row,
    kvh,
    stride_cb,
    stride_cs,
    stride_ch,
    sink_span,
    gap,
    tile_lo,
    tile_hi,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CP: tl.constexpr,
    CP_RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    KV_SCALED: tl.constexpr,
    FP8_VIA_F16: tl.constexpr,
    QK_MODE: tl.constexpr,
    PV_MODE: tl.constexpr,
    PREFETCH_PAGE: tl.constexpr,
    PLANNED: tl.constexpr,
    WINDOW: tl.constexpr,
    SINK: tl.constexpr,
):
    """One key tile (virtual keys ``[v0, v0 + BLOCK_N)``) into the online softmax. ``MASKED``
    False is the main loop's tile: every key of it exists and every query of the program sees
    it, so nothing is masked and no row can be all ``-inf``; True checks each key (the tail
    tile, the causal diagonal, a planned mask, DCP)."""
    n_offs = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_D)
    n0 = v0
    kmask = v0 + n_offs < end
    if PLANNED:
        n0 = v0 + tl.where(v0 >= sink_span, gap, 0)
    kidx = n0 + n_offs
    if PLANNED:  # keys no query of the tile sees are never loaded
        kmask = kmask & (kidx < tile_hi) & ((kidx >= tile_lo) | (kidx < SINK))
    if PAGE % BLOCK_N == 0:
        # n0 is a multiple of BLOCK_N (so is every split's start): the key tile lies in one
        # page, found with one scalar load, and its rows are evenly strided. PREFETCH_PAGE
        # loads the next tile's page id one iteration ahead, so the K/V loads do not wait
        # for the block table.
        if PREFETCH_PAGE:
            page_s = next_page
            nxt = n0 + BLOCK_N
            next_page = tl.load(bt_row + nxt // PAGE, mask=nxt < end, other=0).to(tl.int64)
        else:
            page_s = tl.load(bt_row + n0 // PAGE).to(tl.int64)
        kv_off = page_s * stride_cb + (n0 % PAGE + n_offs) * stride_cs + kvh * stride_ch
    elif MASKED:
        page = tl.load(bt_row + kidx // PAGE, mask=kmask, other=0).to(tl.int64)
        kv_off = page * stride_cb + (kidx % PAGE) * stride_cs + kvh * stride_ch
    else:
        page = tl.load(bt_row + kidx // PAGE).to(tl.int64)
        kv_off = page * stride_cb + (kidx % PAGE) * stride_cs + kvh * stride_ch
    if MASKED:
        k = tl.load(key_cache_ptr + kv_off[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(key_cache_ptr + kv_off[:, None] + d[None, :])
    # Scores before the softmax scale (which is positive): the row maximum is taken unscaled
    # and scaled once per row, and the scale then joins the subtraction of the maximum in one
    # multiply-add per score.
    if KV_SCALED and QK_MODE == _FP8_MMA:  # e4m3 keys straight into the MMAs
        kt = tl.trans(k)
        s = tl.dot(q_mma, kt) + tl.dot(q_lo8, kt) * (1.0 / _FP8_LO)
    elif KV_SCALED and QK_MODE == _FP8_F16:  # one native widening, a float16 MMA
        s = tl.dot(q_mma, tl.trans(k.to(tl.float16)))
    else:
        if KV_SCALED:
            k = k.to(tl.float16).to(q.dtype) if FP8_VIA_F16 else k.to(q.dtype)
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        allowed = kmask[None, :]
        if CAUSAL:
            kpos = (
                kidx
                if CP == 1
                else (kidx // INTERLEAVE) * (INTERLEAVE * CP) + CP_RANK * INTERLEAVE + kidx % INTERLEAVE
            )
            allowed = allowed & (kpos[None, :] <= qpos[:, None])
        if PLANNED:
            allowed = allowed & (kidx[None, :] < q_hi_pos[:, None])
            if WINDOW > 0:
                allowed = allowed & ((kidx[None, :] >= q_lo_pos[:, None]) | (kidx[None, :] < SINK))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:  # every score finite: so is the new maximum
        m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
        m_safe = m_new
    p = tl.exp2(s * row_scale[:, None] - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(value_cache_ptr + kv_off[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    else:
        v = tl.load(value_cache_ptr + kv_off[:, None] + d[None, :])
    acc = acc * alpha[:, None]
    if KV_SCALED and PV_MODE == _FP8_F16:
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
    else:
        if KV_SCALED:
            v = v.to(tl.float16).to(q.dtype) if FP8_VIA_F16 else v.to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i, next_page


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_table_ptr,
    seq_lens_ptr,
    kv_lens_ptr,
    qsl_ptr,
    tile_row_ptr,
    tile_q0_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_et,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    CAUSAL: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    CP: tl.constexpr,
    CP_RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    KV_SCALED: tl.constexpr,
    FP8_VIA_F16: tl.constexpr,
    QK_MODE: tl.constexpr,
    PV_MODE: tl.constexpr,
    PREFETCH_PAGE: tl.constexpr,
    PLANNED: tl.constexpr = False,
    PLAN_CHUNK: tl.constexpr = 0,
    PLAN_CAUSAL: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
    SINK: tl.constexpr = 0,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(tile_row_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    qs = tl.load(qsl_ptr + row)
    ql = tl.load(qsl_ptr + row + 1) - qs
    sl = tl.load(seq_lens_ptr + row)
    # Keys are addressed by their index in this rank's pages. Without DCP that is the absolute
    # position; under DCP local key j is absolute position
    # (j // INTERLEAVE) * INTERLEAVE * CP + CP_RANK * INTERLEAVE + j % INTERLEAVE.
    n_keys = sl if CP == 1 else tl.load(kv_lens_ptr + row)  # CP is constexpr: a static choice

    Q_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    ROUND: tl.constexpr = INTERLEAVE * CP  # positions per interleave round of the DCP group
    m = tl.arange(0, BLOCK_M)
    tok = q0 + m // GROUP
    head = kvh * GROUP + m % GROUP
    m_valid = (m < Q_PER_TILE * GROUP) & (tok < ql)
    d = tl.arange(0, HEAD_D)
    q_off = (qs + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=m_valid[:, None], other=0.0)
    qpos = sl - ql + tok  # bottom-right alignment: the last query sees every key
    s_scale = scale_log2
    if KV_SCALED:  # e4m3 pages: this program's KV head's key scale joins the softmax scale
        s_scale = scale_log2 * tl.load(k_scale_ptr + kvh)
    q_mma = q
    q_lo8 = q  # the second e4m3 term of the queries (fp8 MMAs only)
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * s_scale
    if KV_SCALED and QK_MODE != _FP8_WIDEN:
        # Each query row (one token of one head) is scaled by its own largest magnitude, once
        # per program: into e4m3 (+-448) for fp8 MMAs, into [-1, 1] for float16 ones. Its
        # descale joins the row's softmax scale.
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), 1)
        amax = tl.where(amax == 0.0, 1.0, amax)
        if QK_MODE == _FP8_MMA:  # two e4m3 terms: q ~ hi + lo / 16 (one alone costs accuracy)
            q448 = qf * (448.0 / amax)[:, None]
            q_top = _round_e4m3(q448)
            q_mma = q_top.to(tl.float8e4nv)
            q_lo8 = _round_e4m3((q448 - q_top) * _FP8_LO).to(tl.float8e4nv)
            row_scale = (amax * (1.0 / 448.0)) * s_scale
        else:
            q_mma = (qf * (1.0 / amax)[:, None]).to(tl.float16)
            row_scale = amax * s_scale

    if CAUSAL:
        last_tok = tl.minimum(q0 + Q_PER_TILE, ql) - 1
        seen = tl.minimum(sl, sl - ql + last_tok + 1)  # absolute keys the tile's last query sees
        if CP == 1:
            kv_end = seen
        else:  # of those, the ones on this rank (dcp_local_seq_lens of ``seen``)
            rest = seen % ROUND - CP_RANK * INTERLEAVE
            kv_end = (seen // ROUND) * INTERLEAVE + tl.minimum(tl.maximum(rest, 0), INTERLEAVE)
            kv_end = tl.minimum(kv_end, n_keys)
    else:
        kv_end = n_keys
    # A planned mask (chunk, window, sink; mask.py): query q sees key k < hi(q) with k >= lo(q)
    # or k < SINK. The tile reads two runs of key tiles, the sink's [0, sink_span) and the
    # window's [win_start, tile_hi), as one virtual range [0, kv_end): virtual key v is key v
    # below sink_span, else v + gap. Key tiles between the runs (released ones) are never loaded.
    sink_span = 0
    gap = 0
    tile_lo = 0
    tile_hi = kv_end
    q_lo_pos = qpos * 0  # per query, the planned mask's window: keys [q_lo_pos, q_hi_pos)
    q_hi_pos = qpos * 0 + sl
    if PLANNED:
        t_first = sl - ql + q0
        t_last = sl - ql + tl.minimum(q0 + Q_PER_TILE, ql) - 1
        if PLAN_CHUNK > 0:
            raw_first = (t_first // PLAN_CHUNK + 1) * PLAN_CHUNK
            raw_last = (t_last // PLAN_CHUNK + 1) * PLAN_CHUNK
        elif PLAN_CAUSAL:
            raw_first = t_first + 1
            raw_last = t_last + 1
        else:
            raw_first = sl
            raw_last = sl
        tile_hi = tl.minimum(raw_last, sl)
        if WINDOW > 0:
            tile_lo = tl.maximum(raw_first - WINDOW, 0)
        sink_span = tl.cdiv(tl.minimum(SINK, tile_hi), BLOCK_N) * BLOCK_N
        win_start = tl.maximum((tile_lo // BLOCK_N) * BLOCK_N, sink_span)
        gap = win_start - sink_span
        kv_end = sink_span + tl.maximum(tile_hi - win_start, 0)
        if PLAN_CHUNK > 0:
            q_raw = (qpos // PLAN_CHUNK + 1) * PLAN_CHUNK
        elif PLAN_CAUSAL:
            q_raw = qpos + 1
        else:
            q_raw = qpos * 0 + sl
        q_hi_pos = tl.minimum(q_raw, sl)
        if WINDOW > 0:
            q_lo_pos = tl.maximum(q_raw - WINDOW, 0)
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    bt_row = block_table_ptr + row.to(tl.int64) * stride_bt
    next_page = (start * 0).to(tl.int64)
    if PREFETCH_PAGE and PAGE % BLOCK_N == 0:
        next_page = tl.load(bt_row + start // PAGE, mask=start < end, other=0).to(tl.int64)
    # The main loop takes the key tiles that need no mask: whole tiles every query of the
    # program sees (all of them under a full mask; below the diagonal of the tile's first query
    # under a causal one). The rest -- the tail, the causal diagonal, and every tile of a
    # planned mask or of DCP -- checks each key.
    full_end = start
    if CP == 1 and not PLANNED:
        full_end = (end // BLOCK_N) * BLOCK_N
        if CAUSAL:  # the keys the tile's first query sees
            full_end = tl.minimum(full_end, ((sl - ql + q0 + 1) // BLOCK_N) * BLOCK_N)
        full_end = tl.maximum(full_end, start)
    for masked in tl.static_range(2):
        for v0 in range(full_end if masked else start, end if masked else full_end, BLOCK_N):
            acc, m_i, l_i, next_page = _attend_key_tile(
                acc,
                m_i,
                l_i,
                next_page,
                v0,
                end,
                q,
                q_mma,
                q_lo8,
                row_scale,
                qpos,
                q_lo_pos,
                q_hi_pos,
                key_cache_ptr,
                value_cache_ptr,
                bt_row,
                kvh,
                stride_cb,
                stride_cs,
                stride_ch,
                sink_span,
                gap,
                tile_lo,
                tile_hi,
                masked == 1,
                CAUSAL,
                HEAD_D,
                PAGE,
                BLOCK_N,
                CP,
                CP_RANK,
                INTERLEAVE,
                KV_SCALED,
                FP8_VIA_F16,
                QK_MODE,
                PV_MODE,
                PREFETCH_PAGE,
                PLANNED,
                WINDOW,
                SINK,
            )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if KV_SCALED:  # the value scale, once per output
        out = out * tl.load(v_scale_ptr + kvh)
    t_glob = (qs + tok).to(tl.int64)
    if NUM_SPLITS == 1:
        o_off = t_glob * stride_ot + head * stride_oh
        tl.store(
            out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None]
        )
        if WRITE_LSE:  # natural log; -inf (and out 0) where no key is visible
            lse_e = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
            tl.store(lse_ptr + t_glob * stride_et + head, lse_e, mask=m_valid)
    else:
        p_off = split * stride_ps + t_glob * stride_pt + head * stride_ph
        tl.store(part_out_ptr + p_off[:, None] + d[None, :], out, mask=m_valid[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # base-2 log-sum-exp
        tl.store(part_lse_ptr + split * stride_ls + t_glob * stride_lt + head, lse, mask=m_valid)


@triton.jit
def _combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    stride_et,
    NUM_SPLITS: tl.constexpr,
    HEAD_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_D)
    lse = tl.load(part_lse_ptr + s * stride_ls + t * stride_lt + h)
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    total = tl.sum(w, 0)
    total_safe = tl.where(total == 0.0, 1.0, total)  # no visible key in any split: out 0, not NaN
    parts = tl.load(part_out_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :])
    out = tl.sum(parts * w[:, None], 0) / total_safe
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        lse_e = tl.where(total == 0.0, float("-inf"), (mx + tl.log2(total_safe)) * 0.6931471805599453)
        tl.store(lse_ptr + t * stride_et + h, lse_e)


LOG2E = 1.4426950408889634

SM90_FP8_MODES = (FP8_MMA, FP8_F16)
"""``(qk_mode, pv_mode)`` for e4m3 pages on SM90 and later, query tiles of 128 rows: fp8 tensor
cores for Q.K^T, float16 for P.V (the fastest pair of the H100 sweep, ``benchmarks/sweep_gqa_fp8.py``)."""
SM90_FP8_MODES_SMALL_TILES = (FP8_F16, FP8_F16)
"""The same for smaller query tiles (MHA over a few queries: 32-row tiles): one native widening
to float16 and float16 MMAs for both products (H100, regime B MHA, ``sweep_gqa_fp8.py --mha``:
0.240 / 0.473 ms against 0.255 / 0.499 widened to bfloat16 and 0.284 / 0.551 with the two fp8
MMAs, at the best key tile, stage and split count of each; cfg 1 / 2)."""


def fp8_modes(device: torch.device, block_m: int = 128) -> tuple[int, int]:
    """How :func:`paged_attention` multiplies e4m3 pages on ``device`` by default. From SM90 on:
    fp8 tensor cores for Q.K^T (:data:`SM90_FP8_MODES`) in query tiles of at least 128 rows (GQA
    heads packed, or long queries), float16 MMAs in smaller ones
    (:data:`SM90_FP8_MODES_SMALL_TILES`: the two fp8 MMAs measured 12% slower than widening
    there on an H100). Elsewhere (older GPUs, the interpreter on CPU) widened tiles and 16-bit
    MMAs."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return SM90_FP8_MODES if block_m >= 128 else SM90_FP8_MODES_SMALL_TILES
    return FP8_WIDEN, FP8_WIDEN


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tile_row: torch.Tensor,
    tile_q0: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    block_m: int,
    block_n: int,
    num_splits: int,
    num_warps: int = 4,
    num_stages: int = 2,
    lse: torch.Tensor | None = None,
    local_seq_lens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    qk_mode: int | None = None,
    pv_mode: int | None = None,
    prefetch_pages: bool | None = None,
    chunk: int | None = None,
    window: int | None = None,
    sink: int = 0,
) -> torch.Tensor:
    """``query [T, H, D]`` over pages ``[NB, PAGE, Hkv, D]`` into ``out [T, H, D]``; e4m3 pages
    take ``k_scale``/``v_scale`` ``[Hkv]`` float32 (a page holds ``x / scale``), and
    ``qk_mode`` (one of :data:`FP8_MODES`) / ``pv_mode`` (one of :data:`PV_MODES`) say how their
    tiles are multiplied (None: :func:`fp8_modes` of the device and ``block_m``).
    ``prefetch_pages`` loads each key tile's page id one iteration ahead (None: with
    ``num_stages >= 3``, where it pays; at 2 stages it measured slower; always off under a
    planned mask, whose key tiles jump the gap between sink and window).

    ``tile_row``/``tile_q0`` list the query tiles (row, first query token within the row); each
    tile covers ``block_m // (H // Hkv)`` tokens of one row for all heads of one KV head.

    ``lse`` (``[T, H]`` float32, optional) receives each query's natural-log log-sum-exp over
    the keys it attended (``-inf``, with ``out`` 0, where it saw none).

    Decode context parallelism (``cp_size > 1``): the pages hold only rank ``cp_rank``'s keys
    (``cp_interleave`` consecutive positions per rank in turn), ``local_seq_lens [rows]`` counts
    them per row, and local key ``j`` sits at page index ``j``. ``seq_lens`` stays the rows' full
    lengths: the causal mask compares each local key's absolute position with the query's
    bottom-right aligned one. The result is this rank's partial attention.

    A planned mask (``MaskSpec``'s ``chunk``, ``window``, ``sink``; ``causal`` then says whether
    a non-chunk mask is causal or full): query ``q`` (bottom-right aligned) sees key ``k`` when
    ``k < min(raw(q), seq_len)`` and (no window, or ``k >= raw(q) - window``, or ``k < sink``),
    ``raw(q)`` the end of ``q``'s chunk, ``q + 1`` or ``seq_len``. Each query tile reads only the
    key tiles of the sink and of its window (the block plan's SKIP blocks, released ones
    included, are never loaded). Not with DCP.
    """
    T, H, D = query.shape
    _, page, hkv, _ = key_cache.shape
    group = H // hkv
    n_tiles = tile_row.shape[0]
    if n_tiles == 0 or T == 0:
        return out
    if cp_size > 1 and local_seq_lens is None:
        raise ValueError("paged_attention: cp_size > 1 needs local_seq_lens")
    planned = chunk is not None or window is not None or sink > 0
    if planned and cp_size > 1:
        raise ValueError("paged_attention: a chunk, window or sink mask is not served with cp_size > 1")
    if num_splits > 1:
        part_out = torch.empty((num_splits, T, H, D), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_splits, T, H), dtype=torch.float32, device=query.device)
    else:
        part_out = out
        part_lse = out
    lse_arg = lse if lse is not None else out  # an unused pointer when no LSE is written
    kv_lens = local_seq_lens if local_seq_lens is not None else seq_lens
    scaled = key_cache.dtype == torch.float8_e4m3fn
    if scaled and (k_scale is None or v_scale is None):
        raise ValueError("paged_attention over float8_e4m3fn pages needs k_scale and v_scale")
    default_qk, default_pv = fp8_modes(query.device, block_m) if scaled else (FP8_WIDEN, FP8_WIDEN)
    qk = default_qk if qk_mode is None else qk_mode
    pv = default_pv if pv_mode is None else pv_mode
    if qk not in FP8_MODES or pv not in PV_MODES:
        raise ValueError(
            f"paged_attention: qk_mode {qk} (one of {FP8_MODES}) / pv_mode {pv} (one of {PV_MODES})"
        )
    _paged_attention_kernel[(n_tiles, hkv, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        lse_arg,
        part_out,
        part_lse,
        block_table,
        seq_lens,
        kv_lens,
        query_start_loc,
        tile_row,
        tile_q0,
        k_scale if scaled else seq_lens,
        v_scale if scaled else seq_lens,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        part_out.stride(0) if num_splits > 1 else 0,
        part_out.stride(1) if num_splits > 1 else 0,
        part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0) if num_splits > 1 else 0,
        part_lse.stride(1) if num_splits > 1 else 0,
        CAUSAL=causal and not planned,
        GROUP=group,
        HEAD_D=D,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        WRITE_LSE=lse is not None,
        CP=cp_size,
        CP_RANK=cp_rank if cp_size > 1 else 0,
        INTERLEAVE=cp_interleave if cp_size > 1 else 1,
        KV_SCALED=scaled,
        FP8_VIA_F16=FP8_VIA_F16,
        QK_MODE=qk if scaled else FP8_WIDEN,
        PV_MODE=pv if scaled else FP8_WIDEN,
        PREFETCH_PAGE=(num_stages >= 3 if prefetch_pages is None else prefetch_pages) and not planned,
        PLANNED=planned,
        PLAN_CHUNK=chunk or 0,
        PLAN_CAUSAL=causal,
        WINDOW=window or 0,
        SINK=sink,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_kernel[(T, H)](
            part_out,
            part_lse,
            out,
            lse_arg,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0) if lse is not None else 0,
            NUM_SPLITS=num_splits,
            HEAD_D=D,
            WRITE_LSE=lse is not None,
        )
    return out


# --------------------------------------------------------------------------------------------
# e4m3 pages dequantised into a contiguous copy (the gather + SDPA way)
# --------------------------------------------------------------------------------------------


@triton.jit
def _dequant_kv_kernel(
    src_ptr,
    index_ptr,
    scale_ptr,
    out_ptr,
    keys,
    blocks_per_row,
    s_outer,
    s_tok,
    s_head,
    s_dim,
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GATHER: tl.constexpr,
):
    """``out[r, t, h, d] = float32(src) * scale[h]`` rounded once to ``out``'s dtype, for
    ``BLOCK_T`` keys of row ``r``. ``GATHER``: key ``t`` of row ``r`` lives in page
    ``index[r * blocks_per_row + t // PAGE]`` at offset ``t % PAGE`` (``s_outer`` is the
    pages' stride); else ``src`` is a ``[R, keys, Hkv, D]`` view (``s_outer``: its row stride)."""
    r = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)  # head and dimension, flattened
    h = e // HEAD_D
    d = e % HEAD_D
    tm = t < keys
    em = e < NUM_KV_HEADS * HEAD_D
    if GATHER:
        page = tl.load(index_ptr + r * blocks_per_row + t // PAGE, mask=tm, other=0).to(tl.int64)
        at = page * s_outer + (t % PAGE).to(tl.int64) * s_tok
    else:
        at = r.to(tl.int64) * s_outer + t.to(tl.int64) * s_tok
    m = tm[:, None] & em[None, :]
    x = tl.load(src_ptr + at[:, None] + (h * s_head + d * s_dim)[None, :], mask=m, other=0.0)
    scale = tl.load(scale_ptr + h, mask=em, other=0.0)
    y = x.to(tl.float32) * scale[None, :]
    dst = (r.to(tl.int64) * keys + t.to(tl.int64))[:, None] * (NUM_KV_HEADS * HEAD_D) + e[None, :]
    tl.store(out_ptr + dst, y.to(out_ptr.dtype.element_ty), mask=m)


def _dequant_launch(
    src: torch.Tensor,
    index: torch.Tensor | None,
    scale: torch.Tensor,
    rows: int,
    keys: int,
    blocks_per_row: int,
    s_outer: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    hkv, d = src.shape[-2], src.shape[-1]
    if src.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantising e4m3 pages: got {src.dtype} pages")
    if scale.shape != (hkv,) or scale.dtype != torch.float32:
        raise ValueError(
            f"dequantising e4m3 pages: scale must be float32 [{hkv}]; got {scale.dtype} {tuple(scale.shape)}"
        )
    out = torch.empty((rows, keys, hkv, d), dtype=dtype, device=src.device)
    if rows == 0 or keys == 0:
        return out
    block_e = triton.next_power_of_2(hkv * d)
    block_t = max(1, min(64, 8192 // block_e))
    _dequant_kv_kernel[(rows, triton.cdiv(keys, block_t))](
        src,
        index if index is not None else scale,
        scale,
        out,
        keys,
        blocks_per_row,
        s_outer,
        src.stride(-3),
        src.stride(-2),
        src.stride(-1),
        PAGE=src.shape[1] if index is not None else 1,
        NUM_KV_HEADS=hkv,
        HEAD_D=d,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        GATHER=index is not None,
    )
    return out


def gather_dequant(
    cache: torch.Tensor,
    block_index: torch.Tensor,
    rows: int,
    keys: int,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[rows, keys, Hkv, D]`` in ``dtype``: the first ``keys`` keys of each row's pages,
    ``block_index`` ``[rows * blocks]`` naming each row's pages in order, from e4m3 ``cache``
    ``[NB, PAGE, Hkv, D]`` (any strides) times the per-KV-head ``scale`` -- one pass reading the
    page bytes once, what ``dequantize(cache[block_index])`` computes exactly."""
    if block_index.numel() % max(rows, 1):
        raise ValueError(f"gather_dequant: {block_index.numel()} block ids do not split into {rows} rows")
    blocks = block_index.numel() // max(rows, 1)
    if keys > blocks * cache.shape[1]:
        raise ValueError(f"gather_dequant: {keys} keys exceed {blocks} pages of {cache.shape[1]} per row")
    return _dequant_launch(cache, block_index, scale, rows, keys, blocks, cache.stride(0), dtype)


def dequant(pages: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[R, keys, Hkv, D]`` in ``dtype`` (contiguous): e4m3 ``pages`` ``[R, keys, Hkv, D]`` (any
    strides: a view of the cache) times the per-KV-head ``scale``."""
    rows, keys = pages.shape[0], pages.shape[1]
    return _dequant_launch(pages, None, scale, rows, keys, 0, pages.stride(0), dtype)


# --------------------------------------------------------------------------------------------
# Block-table gather and slot mapping (one launch each per group)
# --------------------------------------------------------------------------------------------


@triton.jit
def _gather_kernel(
    table_ptr,
    counts_ptr,
    idx_ptr,
    out_ptr,
    num_reqs,
    width,
    stride_t,
    stride_o,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid_row = i < num_reqs
    req = tl.load(idx_ptr + i, mask=valid_row, other=-1)
    n = tl.load(counts_ptr + tl.maximum(req, 0), mask=req >= 0, other=0)
    for c0 in range(0, width, BLOCK):
        c = c0 + cols
        inb = c < width
        keep = inb & (c < n) & (req >= 0)
        vals = tl.load(table_ptr + tl.maximum(req, 0).to(tl.int64) * stride_t + c, mask=keep, other=0)
        tl.store(out_ptr + i.to(tl.int64) * stride_o + c, vals, mask=inb)


def gather_block_table(
    table: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor, num_reqs_padded: int
) -> torch.Tensor:
    width = table.shape[1]
    out = torch.empty((num_reqs_padded, width), dtype=table.dtype, device=table.device)
    if num_reqs_padded:
        _gather_kernel[(num_reqs_padded,)](
            table, counts, idx, out, idx.shape[0], width, table.stride(0), out.stride(0), BLOCK=128
        )
    return out


@triton.jit
def _slots_of(
    p,
    tm,
    n,
    req,
    row_table,
    width,
    BS: tl.constexpr,
    KBS: tl.constexpr,
    CP: tl.constexpr,
    CP_RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    """Slots of absolute positions ``p`` (int64; ``tm`` marks real tokens) of a row whose table
    starts at ``row_table`` and holds ``n`` kernel blocks: ``-1`` for another DCP rank's tokens,
    past the row's blocks, or for a row index ``req < 0``."""
    if CP == 1:
        lp = p
        local = tm
    else:
        vbs = BS * CP
        o = p % vbs
        local = tm & ((o // INTERLEAVE) % CP == CP_RANK)
        lp = (p // vbs) * BS + (o // (INTERLEAVE * CP)) * INTERLEAVE + o % INTERLEAVE
    kb = lp // KBS
    local = local & (kb < n) & (req >= 0)
    blk = tl.load(row_table + tl.minimum(kb, width - 1), mask=local, other=0)
    return tl.where(local, blk.to(tl.int64) * KBS + lp % KBS, -1)


@triton.jit
def _slot_kernel(
    table_ptr,
    counts_ptr,
    idx_ptr,
    qsl_ptr,
    pos_ptr,
    out_ptr,
    num_reqs,
    num_tokens_padded,
    stride_t,
    width,
    BS: tl.constexpr,
    KBS: tl.constexpr,
    CP: tl.constexpr,
    CP_RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if i == num_reqs:  # the extra program pads the tail
        start = tl.load(qsl_ptr + num_reqs)
        for t0 in range(start, num_tokens_padded, BLOCK):
            t = t0 + offs
            tl.store(
                out_ptr + t,
                tl.full([BLOCK], -1, tl.int64).to(out_ptr.dtype.element_ty),
                mask=t < num_tokens_padded,
            )
    else:
        req = tl.load(idx_ptr + i)
        start = tl.load(qsl_ptr + i)
        stop = tl.load(qsl_ptr + i + 1)
        n = tl.load(counts_ptr + tl.maximum(req, 0))
        for t0 in range(start, stop, BLOCK):
            t = t0 + offs
            tm = t < stop
            p = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.int64)
            row_table = table_ptr + tl.maximum(req, 0).to(tl.int64) * stride_t
            slot = _slots_of(p, tm, n, req, row_table, width, BS, KBS, CP, CP_RANK, INTERLEAVE)
            tl.store(out_ptr + t, slot.to(out_ptr.dtype.element_ty), mask=tm)


def compute_slots(
    table: torch.Tensor,
    counts: torch.Tensor,
    idx: torch.Tensor,
    qsl: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    *,
    block_size: int,
    kernel_block_size: int,
    cp_size: int,
    cp_rank: int,
    cp_interleave: int,
) -> None:
    num_reqs = idx.shape[0]
    _slot_kernel[(num_reqs + 1,)](
        table,
        counts,
        idx,
        qsl,
        positions,
        out,
        num_reqs,
        out.shape[0],
        table.stride(0),
        table.shape[1],
        BS=block_size,
        KBS=kernel_block_size,
        CP=cp_size,
        CP_RANK=cp_rank,
        INTERLEAVE=cp_interleave,
        BLOCK=128,
    )


# --------------------------------------------------------------------------------------------
# Fused per-batch metadata: positions + slot mapping + block-table gather (one launch per group)
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_reqs"])
def _prepare_batch_kernel(
    meta_ptr,
    table_ptr,
    counts_ptr,
    tables_out_ptr,
    pos_ptr,
    slots_ptr,
    num_reqs,
    width,
    stride_t,
    stride_o,
    BS: tl.constexpr,
    KBS: tl.constexpr,
    CP: tl.constexpr,
    CP_RANK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    WRITE_POSITIONS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # meta = [query_start_loc (n+1) | seq_lens (n) | row_indices (n) | kv_start_pos (n)], int32
    i = tl.program_id(0)
    j = tl.program_id(1)
    chunks = tl.num_programs(1)
    req = tl.load(meta_ptr + 2 * num_reqs + 1 + i)
    qs = tl.load(meta_ptr + i)
    qe = tl.load(meta_ptr + i + 1)
    first = tl.load(meta_ptr + 3 * num_reqs + 1 + i).to(tl.int64)
    safe_req = tl.maximum(req, 0).to(tl.int64)
    n = tl.load(counts_ptr + safe_req, mask=req >= 0, other=0)
    row_table = table_ptr + safe_req * stride_t

    # the row's query tokens [qs + j * BLOCK, ...): positions and slots
    offs = tl.arange(0, BLOCK)
    t = qs + j * BLOCK + offs
    tm = t < qe
    p = first + (t - qs).to(tl.int64)
    if WRITE_POSITIONS:
        tl.store(pos_ptr + t, p, mask=tm)
    slot = _slots_of(p, tm, n, req, row_table, width, BS, KBS, CP, CP_RANK, INTERLEAVE)
    tl.store(slots_ptr + t, slot.to(slots_ptr.dtype.element_ty), mask=tm)

    # the row's table entries (zeros past its installed blocks), split across the chunks
    cols = tl.arange(0, BLOCK_W)
    out_row = tables_out_ptr + i.to(tl.int64) * stride_o
    for c0 in range(j * BLOCK_W, width, chunks * BLOCK_W):
        c = c0 + cols
        inb = c < width
        keep = inb & (c < n) & (req >= 0)
        tl.store(out_row + c, tl.load(row_table + c, mask=keep, other=0), mask=inb)


PREPARE_BLOCK = 1024
"""Query tokens per program of the fused prepare kernel."""
PREPARE_BLOCK_W = 128
"""Block-table columns per program and step of the fused prepare kernel."""


def prepare_chunks(max_query_len: int) -> int:
    """Query chunks (the launch grid's second axis) :func:`prepare_batch` uses."""
    return max(1, -(-max_query_len // PREPARE_BLOCK))


def prepare_batch(
    meta: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    tables_out: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    *,
    num_reqs: int,
    max_query_len: int,
    block_size: int,
    kernel_block_size: int,
    cp_size: int,
    cp_rank: int,
    cp_interleave: int,
    write_positions: bool,
) -> None:
    """One group's slots ``slots[t]`` and table rows ``tables_out[:num_reqs]`` (and, with
    ``write_positions``, ``positions[t]``) for the batch in ``meta`` (device int32
    ``[query_start_loc | seq_lens | row_indices | kv_start_pos]``, ``num_reqs`` rows).

    Token ``t`` of row ``i`` sits at ``kv_start_pos[i] + t - query_start_loc[i]``; its slot
    follows :class:`~diffusion_kv.core.block_tables.TorchBlockTables` (``-1`` for tokens of
    another DCP rank, past the row's blocks, or of a row index ``< 0``). ``tables_out`` and
    ``table`` are row-major with unit column stride."""
    chunks = prepare_chunks(max_query_len)
    _prepare_batch_kernel[(num_reqs, chunks)](
        meta,
        table,
        counts,
        tables_out,
        positions,
        slots,
        num_reqs,
        table.shape[1],
        table.stride(0),
        tables_out.stride(0),
        BS=block_size,
        KBS=kernel_block_size,
        CP=cp_size,
        CP_RANK=cp_rank,
        INTERLEAVE=cp_interleave,
        WRITE_POSITIONS=write_positions,
        BLOCK=PREPARE_BLOCK,
        BLOCK_W=PREPARE_BLOCK_W,
    )

"""Triton kernels for tile + bar ("block + bar") sparse attention, forward and backward.

A query block attends a list of whole ``BLOCK x BLOCK`` KV tiles and a list of
single key columns (bars) gathered ``BLOCK`` at a time. One online softmax spans
both; causal masking is applied inside. This serves the vertical-slash index
(tiles from slash diagonals, bars from vertical columns) and dense attention
(all tiles up to the diagonal, no bars).

Backward without atomics, so it is deterministic:
* ``_dq_kernel``: row-major like the forward, one program per (query block, head).
* ``_bar_dkdv_kernel``: one program per (head, chunk of its vertical columns)
  walks the query blocks after the chunk and writes fp32 ``[B, Hq, V, D]``
  partial dK/dV for those columns.
* ``_tile_dkdv_kernel``: KV-major, one program per (KV block, KV head), walking
  the query blocks that read the block for each query head of the GQA group,
  then folding in that group's bar partials for columns of the block with a
  one-hot matmul. Each dK/dV row has exactly one writer.
All statistics are fp32; exponentials are base 2 with the scale folded in.

Loads use local row and column indices; causality compares global positions,
which are the indices themselves on one device and are read from ``QPOS`` /
``KPOS`` (``HAS_POS``) when the rows are a context-parallel rank's tokens and the
keys another rank's chunk (or gathered columns, ``SK`` of them).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _positions(POS, idx, ok, HAS_POS: tl.constexpr):
    """Global positions of local indices ``idx`` (the indices themselves without ``POS``)."""
    pos = idx
    if HAS_POS:
        pos = tl.load(POS + idx, mask=ok, other=0)
    return pos


@triton.jit
def _scores(q, k, col_pos, col_ok, row_pos, qk_scale, PRECISION: tl.constexpr):
    """Scaled log2-domain logits [BLOCK, N] with invisible keys at -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    visible = col_ok[None, :] & (col_pos[None, :] <= row_pos[:, None])
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _load_rows(base, idx, ok, row_stride, d, d_ok):
    return tl.load(base + idx[:, None] * row_stride + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _online_step(
    acc, m_i, l_i, q, K_base, V_base, cols, col_pos, col_ok, row_pos, kv_stride, d, d_ok, qk_scale,
    PRECISION: tl.constexpr,
):  # fmt: skip
    k = _load_rows(K_base, cols, col_ok, kv_stride, d, d_ok)
    s = _scores(q, k, col_pos, col_ok, row_pos, qk_scale, PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = _load_rows(V_base, cols, col_ok, kv_stride, d, d_ok)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _in_tile(ACTIVE, bh, N_ACTIVE, q_block, col_pos, col_ok, BLOCK: tl.constexpr):
    """Columns inside an attended tile of global query block ``q_block``, which the tiles
    already cover and the bars must skip."""
    diag = q_block - col_pos // BLOCK
    return tl.load(ACTIVE + bh * N_ACTIVE + diag, mask=col_ok & (diag >= 0), other=0) != 0


@triton.jit
def _bar_chunk(VERT, ACTIVE, KPOS, bh, c0, n_bars, V_MAX, N_ACTIVE, q_block, BLOCK: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_POS: tl.constexpr):  # fmt: skip
    """``BLOCK_N`` bar columns from entry ``c0`` of the block's visible prefix of the
    head's vertical list: (columns, their positions, attended mask)."""
    offs = c0 + tl.arange(0, BLOCK_N)
    cols = tl.load(VERT + bh * V_MAX + offs, mask=offs < n_bars, other=-1)
    ok = cols >= 0
    pos = _positions(KPOS, cols, ok, HAS_POS)
    return cols, pos, ok & ~_in_tile(ACTIVE, bh, N_ACTIVE, q_block, pos, ok, BLOCK)


@triton.jit
def _program_rows(BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S, H, HKV):
    """Indices shared by the row-major kernels: (b, h, kv head, rows, row mask, d, d mask)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = qb * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D_PAD)
    return qb, b, h, h // (H // HKV), rows, rows < S, d, d < HEAD_DIM


@triton.jit
def _row_selection(ROWSEL, b, lh, LH, S, rows, row_ok, K_SEL, K_PAD: tl.constexpr):
    """Each row's selected index blocks ``[BLOCK, K_PAD]`` (-1 padded) for top-k layouts."""
    kk = tl.arange(0, K_PAD)
    ptrs = ROWSEL + ((b * LH + lh) * S + rows[:, None]) * K_SEL + kk[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & (kk < K_SEL)[None, :], other=-1)


@triton.jit
def _tile_rows(row_pos, sel, KPOS, kb, BLOCK: tl.constexpr, RATIO, HAS_ROWSEL: tl.constexpr, HAS_POS: tl.constexpr):
    """Row positions for tile ``kb``; -1 (sees nothing) on rows that did not select its
    index block (top-k layouts). Selections hold global block ids."""
    out = row_pos
    if HAS_ROWSEL:
        global_tile = _positions(KPOS, kb * BLOCK, True, HAS_POS) // BLOCK
        out = tl.where(tl.max((sel == global_tile // RATIO).to(tl.int32), 1) > 0, row_pos, -1)
    return out


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, TILES, TILE_CNT, VERT, BAR_CNT, ACTIVE, ROWSEL, QPOS, KPOS,
    S, SK, H, HKV, LB, LH, NQB, T_MAX, V_MAX, N_ACTIVE, K_SEL, RATIO, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BARS: tl.constexpr, HAS_ROWSEL: tl.constexpr, K_PAD: tl.constexpr, HAS_POS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    qb, b, h, kvh, rows, row_ok, d, d_ok = _program_rows(BLOCK, HEAD_DIM, D_PAD, S, H, HKV)
    row_pos = _positions(QPOS, rows, row_ok, HAS_POS)
    q_stride = H * HEAD_DIM
    kv_stride = HKV * HEAD_DIM
    q = _load_rows(Q + b * S * q_stride + h * HEAD_DIM, rows, row_ok, q_stride, d, d_ok)
    K_base = K + b * SK * kv_stride + kvh * HEAD_DIM
    V_base = V + b * SK * kv_stride + kvh * HEAD_DIM

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D_PAD], tl.float32)
    lh = h // (H // LH)
    lay = ((b % LB) * LH + lh) * NQB + qb
    sel = rows
    if HAS_ROWSEL:
        sel = _row_selection(ROWSEL, b, lh, LH, S, rows, row_ok, K_SEL, K_PAD)
    for t in range(tl.load(TILE_CNT + lay)):
        kb = tl.load(TILES + lay * T_MAX + t)
        tile_rows = _tile_rows(row_pos, sel, KPOS, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_POS)
        for j in tl.static_range(BLOCK // BLOCK_N):
            cols = kb * BLOCK + j * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < SK
            acc, m_i, l_i = _online_step(
                acc, m_i, l_i, q, K_base, V_base, cols, _positions(KPOS, cols, col_ok, HAS_POS), col_ok, tile_rows,
                kv_stride, d, d_ok, qk_scale, PRECISION,
            )  # fmt: skip
    if HAS_BARS:
        bh = b * H + h
        n_bars = tl.load(BAR_CNT + bh * NQB + qb)
        q_block = tl.max(row_pos, 0) // BLOCK  # the rows are one global block
        for c0 in range(0, n_bars, BLOCK_N):
            cols, col_pos, col_ok = _bar_chunk(
                VERT, ACTIVE, KPOS, bh, c0, n_bars, V_MAX, N_ACTIVE, q_block, BLOCK, BLOCK_N, HAS_POS
            )
            acc, m_i, l_i = _online_step(
                acc, m_i, l_i, q, K_base, V_base, cols, col_pos, col_ok, row_pos, kv_stride, d, d_ok, qk_scale,
                PRECISION,
            )  # fmt: skip

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    out_ptrs = O + b * S * q_stride + h * HEAD_DIM + rows[:, None] * q_stride + d[None, :]
    tl.store(out_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    tl.store(LSE + (b * H + h) * S + rows, lse, mask=row_ok)


@triton.jit
def _load_row_stats(LSE, DELTA, b, h, H, S, rows, row_ok):
    """log2-domain LSE (0 on empty rows, whose logits are all -inf) and delta."""
    lse = tl.load(LSE + (b * H + h) * S + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + (b * H + h) * S + rows, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _dq_step(
    dq, q, do, lse, delta, K_base, V_base, cols, col_pos, col_ok, row_pos, kv_stride, d, d_ok, qk_scale,
    PRECISION: tl.constexpr,
):  # fmt: skip
    k = _load_rows(K_base, cols, col_ok, kv_stride, d, d_ok)
    v = _load_rows(V_base, cols, col_ok, kv_stride, d, d_ok)
    p = tl.exp2(_scores(q, k, col_pos, col_ok, row_pos, qk_scale, PRECISION) - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@triton.jit
def _dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, DELTA, DQ, TILES, TILE_CNT, VERT, BAR_CNT, ACTIVE, ROWSEL, QPOS, KPOS,
    S, SK, H, HKV, LB, LH, NQB, T_MAX, V_MAX, N_ACTIVE, K_SEL, RATIO, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BARS: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_ROWSEL: tl.constexpr, K_PAD: tl.constexpr,
    HAS_POS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ, and ``delta = rowsum(dO * O) - dLSE`` stored for the dK/dV kernels (computed
    here, where dO is loaded anyway, instead of in fp32 copies of dO and O)."""
    qb, b, h, kvh, rows, row_ok, d, d_ok = _program_rows(BLOCK, HEAD_DIM, D_PAD, S, H, HKV)
    row_pos = _positions(QPOS, rows, row_ok, HAS_POS)
    q_stride = H * HEAD_DIM
    kv_stride = HKV * HEAD_DIM
    q_off = b * S * q_stride + h * HEAD_DIM
    q = _load_rows(Q + q_off, rows, row_ok, q_stride, d, d_ok)
    do = _load_rows(DO + q_off, rows, row_ok, q_stride, d, d_ok)
    o = _load_rows(O + q_off, rows, row_ok, q_stride, d, d_ok)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + (b * H + h) * S + rows, mask=row_ok, other=0.0)
    tl.store(DELTA + (b * H + h) * S + rows, delta, mask=row_ok)
    lse = tl.load(LSE + (b * H + h) * S + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    K_base = K + b * SK * kv_stride + kvh * HEAD_DIM
    V_base = V + b * SK * kv_stride + kvh * HEAD_DIM

    dq = tl.zeros([BLOCK, D_PAD], tl.float32)
    lh = h // (H // LH)
    lay = ((b % LB) * LH + lh) * NQB + qb
    sel = rows
    if HAS_ROWSEL:
        sel = _row_selection(ROWSEL, b, lh, LH, S, rows, row_ok, K_SEL, K_PAD)
    for t in range(tl.load(TILE_CNT + lay)):
        kb = tl.load(TILES + lay * T_MAX + t)
        tile_rows = _tile_rows(row_pos, sel, KPOS, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_POS)
        for j in tl.static_range(BLOCK // BLOCK_N):
            cols = kb * BLOCK + j * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < SK
            dq = _dq_step(
                dq, q, do, lse, delta, K_base, V_base, cols, _positions(KPOS, cols, col_ok, HAS_POS), col_ok,
                tile_rows, kv_stride, d, d_ok, qk_scale, PRECISION,
            )  # fmt: skip
    if HAS_BARS:
        bh = b * H + h
        n_bars = tl.load(BAR_CNT + bh * NQB + qb)
        q_block = tl.max(row_pos, 0) // BLOCK  # the rows are one global block
        for c0 in range(0, n_bars, BLOCK_N):
            cols, col_pos, col_ok = _bar_chunk(
                VERT, ACTIVE, KPOS, bh, c0, n_bars, V_MAX, N_ACTIVE, q_block, BLOCK, BLOCK_N, HAS_POS
            )
            dq = _dq_step(
                dq, q, do, lse, delta, K_base, V_base, cols, col_pos, col_ok, row_pos, kv_stride, d, d_ok, qk_scale,
                PRECISION,
            )  # fmt: skip
    dq_ptrs = DQ + q_off + rows[:, None] * q_stride + d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _kv_grads(
    dk, dv, k, v, col_pos, col_ok, Q_base, DO_base, LSE, DELTA, b, h, H, S, rows, row_pos, q_stride, d, d_ok,
    qk_scale, extra_mask, PRECISION: tl.constexpr,
):  # fmt: skip
    """Adds one query block's contribution to the dK/dV of a set of key rows."""
    row_ok = rows < S
    q = _load_rows(Q_base, rows, row_ok, q_stride, d, d_ok)
    do = _load_rows(DO_base, rows, row_ok, q_stride, d, d_ok)
    lse, delta = _load_row_stats(LSE, DELTA, b, h, H, S, rows, row_ok)
    s = _scores(q, k, col_pos, col_ok, row_pos, qk_scale, PRECISION)
    p = tl.exp2(tl.where(extra_mask & row_ok[:, None], s, float("-inf")) - lse[:, None])
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bar_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, VERT, ACTIVE, BAR_DK, BAR_DV, QPOS, KPOS,
    S, SK, H, HKV, NQB, N_ACTIVE, V_MAX, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_POS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // (H // HKV)
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.load(VERT + bh * V_MAX + offs, mask=offs < V_MAX, other=-1)
    col_ok = cols >= 0
    if tl.sum(col_ok.to(tl.int32), 0) > 0:
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_stride = H * HEAD_DIM
        kv_stride = HKV * HEAD_DIM
        k = _load_rows(K + b * SK * kv_stride + kvh * HEAD_DIM, cols, col_ok, kv_stride, d, d_ok)
        v = _load_rows(V + b * SK * kv_stride + kvh * HEAD_DIM, cols, col_ok, kv_stride, d, d_ok)
        col_pos = _positions(KPOS, cols, col_ok, HAS_POS)
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        q_off = b * S * q_stride + h * HEAD_DIM
        first = 0  # query blocks before the chunk's first column see none of it (single device)
        if not HAS_POS:
            first = tl.min(tl.where(col_ok, col_pos // BLOCK, NQB), 0)
        for qb in range(first, NQB):
            rows = qb * BLOCK + tl.arange(0, BLOCK)
            row_pos = _positions(QPOS, rows, rows < S, HAS_POS)
            in_tile = _in_tile(ACTIVE, bh, N_ACTIVE, tl.max(row_pos, 0) // BLOCK, col_pos, col_ok, BLOCK)
            dk, dv = _kv_grads(
                dk, dv, k, v, col_pos, col_ok, Q + q_off, DO + q_off, LSE, DELTA, b, h, H, S, rows, row_pos, q_stride,
                d, d_ok, qk_scale, (~in_tile)[None, :], PRECISION,
            )  # fmt: skip
        out = (bh * V_MAX + offs)[:, None] * D_PAD + d[None, :]
        ok = (offs < V_MAX)[:, None] & d_ok[None, :]
        tl.store(BAR_DK + out, dk * sm_scale, mask=ok)
        tl.store(BAR_DV + out, dv, mask=ok)


@triton.jit
def _fold_bars(
    dk, dv, BAR_DK, BAR_DV, VERT, VPTR, bh, kb, first, NKB, V_MAX, d,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """Adds the bar partials of the vertical columns in key rows ``first .. first + BLOCK_N``
    (inside KV block ``kb``), ``FOLD`` columns per one-hot matmul."""
    start = tl.load(VPTR + bh * (NKB + 1) + kb)
    stop = tl.load(VPTR + bh * (NKB + 1) + kb + 1)
    n = tl.arange(0, BLOCK_N)
    for c0 in range(start, stop, FOLD):
        offs = c0 + tl.arange(0, FOLD)
        ok = offs < stop
        pos = tl.load(VERT + bh * V_MAX + offs, mask=ok, other=-1) - first
        onehot = ((n[:, None] == pos[None, :]) & ok[None, :]).to(tl.float32)
        rows = (bh * V_MAX + offs)[:, None] * D_PAD + d[None, :]
        dk += tl.dot(onehot, tl.load(BAR_DK + rows, mask=ok[:, None], other=0.0), input_precision="ieee")
        dv += tl.dot(onehot, tl.load(BAR_DV + rows, mask=ok[:, None], other=0.0), input_precision="ieee")
    return dk, dv


@triton.jit
def _tile_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, TILES_T, TILE_T_CNT, BAR_DK, BAR_DV, VERT, VPTR, ROWSEL, QPOS, KPOS,
    S, SK, H, HKV, LB, LH, NKB, T_MAX, V_MAX, K_SEL, RATIO, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BARS: tl.constexpr, HAS_ROWSEL: tl.constexpr, K_PAD: tl.constexpr, HAS_POS: tl.constexpr,
    PRECISION: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    sub = tl.program_id(0)  # BLOCK_N key rows of KV block kb
    kb = sub // (BLOCK // BLOCK_N)
    first = sub * BLOCK_N
    bkv = tl.program_id(1)
    b = bkv // HKV
    kvh = bkv % HKV
    group = H // HKV
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < SK
    col_pos = _positions(KPOS, cols, col_ok, HAS_POS)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_stride = H * HEAD_DIM
    kv_stride = HKV * HEAD_DIM
    kv_off = b * SK * kv_stride + kvh * HEAD_DIM
    k = _load_rows(K + kv_off, cols, col_ok, kv_stride, d, d_ok)
    v = _load_rows(V + kv_off, cols, col_ok, kv_stride, d, d_ok)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    bar_dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    bar_dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for g in range(group):
        h = kvh * group + g
        q_off = b * S * q_stride + h * HEAD_DIM
        lh = h // (H // LH)
        lay = ((b % LB) * LH + lh) * NKB + kb
        for t in range(tl.load(TILE_T_CNT + lay)):
            rows = tl.load(TILES_T + lay * T_MAX + t) * BLOCK + tl.arange(0, BLOCK)
            row_pos = _positions(QPOS, rows, rows < S, HAS_POS)
            sel = rows
            if HAS_ROWSEL:
                sel = _row_selection(ROWSEL, b, lh, LH, S, rows, rows < S, K_SEL, K_PAD)
            dk, dv = _kv_grads(
                dk, dv, k, v, col_pos, col_ok, Q + q_off, DO + q_off, LSE, DELTA, b, h, H, S, rows,
                _tile_rows(row_pos, sel, KPOS, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_POS), q_stride, d, d_ok, qk_scale,
                col_ok[None, :], PRECISION,
            )  # fmt: skip
        if HAS_BARS:
            bar_dk, bar_dv = _fold_bars(
                bar_dk, bar_dv, BAR_DK, BAR_DV, VERT, VPTR, b * H + h, kb, first, NKB, V_MAX, d, BLOCK_N, D_PAD, FOLD
            )
    ok = col_ok[:, None] & d_ok[None, :]
    out = kv_off + cols[:, None] * kv_stride + d[None, :]
    tl.store(DK + out, (dk * sm_scale + bar_dk).to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + out, (dv + bar_dv).to(DV.dtype.element_ty), mask=ok)

"""Triton kernels of MSA's sparse KL loss over union-of-tiles tables (``block_bar``'s).

Per query row ``i`` and GQA group ``r``, over the tokens the row selected (its tiles'
keys, filtered by its own selection ``rowsel`` and causality):

* teacher ``p[i, t] = mean_h exp(scale * q_h . k_t - LSE_main[i, h])`` over the ``G`` query
  heads of the group, with the main pass's own LSE (the main branch attends exactly these
  tokens, or every visible token in warmup);
* student ``s[i, t] = exp(z[i, t] - LSE_idx[i, r])``, ``z = q_idx . k_idx / sqrt(d_idx)``.

Three kernels:

* ``_index_lse_kernel``: ``LSE_idx`` by an online logsumexp over the row's tiles, one
  program per (``BLOCK_M`` rows of a query block, batch x group).
* ``_dq_kl_kernel``: row-major as the LSE kernel, ``BLOCK_M`` rows of one group a program,
  ``BLOCK_N`` keys a step; recomputes ``p`` (a head loop, see below) and ``s``, accumulates
  ``dq_idx = sum_t (s - p) k_idx`` and each row's KL term ``sum_t p (log p - log s)``.
* ``_dk_kl_kernel``: KV-major over ``tiles_t``, one program per (``BLOCK_N`` keys of a KV
  block, batch); the shared index key head gets the sum over the groups, which the
  program loops over (each dK row has one writer); per group it walks the query blocks
  reading the block, ``BLOCK_M`` rows a step (64 by default, so the dK product
  ``(s - p)^T [BLOCK_N, BLOCK_M] @ q_idx [BLOCK_M, d_idx]`` has K = 64).

The backward runs in one pass or two (``dispatch.kl_backward_passes``). Each recomputes the
teacher, ``G`` main products per (row, key), which bound it. Two passes, ``_dq_kl_kernel``
then ``_dk_kl_kernel``, write each output element once, with no atomics: bitwise
reproducible, for torch's deterministic mode. One pass, ``_dk_kl_kernel`` with
``FUSE_DQ``, computes the teacher once: besides dK in registers each step adds its rows'
share of ``dq_idx`` (``(s - p) @ k_idx`` of the program's keys, one more product on
operands the step holds) and of their KL terms into zeroed fp32 buffers with atomic adds,
whose order, so the last bits, varies from run to run.

Teacher: a head loop. Per key step (dQ) or row step (dK), for each of the group's ``G``
heads (``tl.static_range``, ``G`` a constexpr), the product ``q_h @ k^T`` of the program's
rows (``[BLOCK_M, D] @ [D, BLOCK_N]``; transposed, keys the A operand, in dK) and
``p += exp2(scale * S_h - lse_h)`` in the product's own register layout; the visibility
mask and the mean's ``1 / G`` are applied once to the sum. The head reduction so costs
adds in registers, no layout conversion, and every product, the index ones included, has
``BLOCK_M`` rows (the packed layout before this, 16 rows x 8 heads in one ``[128, D]``
operand, reshaped each step's ``[128, N]`` product to ``[16, 8, N]`` through shared memory
to sum the heads, and left the index products and dK's steps 16 rows). The ``G``
heads' queries of a dQ program are loop-invariant: held in registers or re-read from L1
(``loss.DEFAULT_CONFIGS`` sizes ``BLOCK_M`` for that); the dK kernel streams each step's
rows' queries anyway. A reduction by a product with a constant 0/1 matrix (packed rows,
``P^T`` the A operand) was the alternative: it keeps a packed ``[BLOCK_M * G, D]``
operand, so the same register budget, plus a product and a 16-bit rounding of ``p`` before
the mean.

The upstream gradient is read from memory (``GRAD``) and applied in fp32 after the
products, with the mean's ``1 / rows``, so the host never reads it and 16-bit ``ds``
operands keep their range. Products accumulate in fp32; statistics are fp32, base 2.

Context parallelism: every kernel takes a ring step's tables (``query_blocks`` /
``key_blocks``: global block ids of the rank's rows and the chunk's keys; selections hold
global block ids) through ``block_bar``'s position helpers. A CP version runs the LSE
kernel per step and merges the per-step LSEs per row (``logaddexp``; a row with nothing
visible in a step has -inf), then the backward per step, in one pass or two, with the
merged LSEs: the steps' dq_idx and KL rows are added up, the chunk's dk_idx returned to
its owner and added; each step divides by the whole sequence's rows.

Packed documents (``HAS_DOCS``, tables built with documents): a row sees no key before its
document's start, ``DOC_START[row position]`` (``block_bar``'s ``_row_starts``, global
positions under context parallelism), so the teacher and the student are both restricted to
the row's document; the main pass's LSE already is. The tables list no tile wholly before
the document start of a query block's first row; inside the listed ones the start is one
more compare in the visibility mask (``_visible``), which every step applies anyway.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..block_bar.kernels import (
    _block_step,
    _positions,
    _program_rows,
    _row_selection,
    _row_starts,
    _table_row,
    _tile_rows,
)
from ..shared.kernels import LOG2E, _load_rows, _scores, _store_rows

# Globals a jitted function reads must be constexpr (the interpreter does not check it).
LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _row_stats(LSE, off, ok):
    """log2-domain LSE at ``LSE + off``; +inf where masked or -inf (a row with no visible
    key), so its probabilities are exactly 0."""
    lse = tl.load(LSE + off, mask=ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E_C


@triton.jit
def _lse_step(m_i, l_i, z):
    """One step of an online log2-domain logsumexp over the rows of ``z`` (-inf: masked):
    the running maximum and the sum of ``exp2(z - max)``."""
    m_new = tl.maximum(m_i, tl.max(z, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(z - m_safe[:, None]), 1)


@triton.jit
def _lse_final(m_i, l_i):
    """The natural-log LSE of :func:`_lse_step`'s state; -inf for a row that saw nothing."""
    empty = l_i == 0.0
    return tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)


@triton.jit
def _teacher(q_base, q_rows, lse_base, lse_rows, row_ok, d, d_ok, k, qk_scale, S, q_stride, HEAD_DIM: tl.constexpr,
             G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
             KEYS_FIRST: tl.constexpr = False, STAGES: tl.constexpr = 0):  # fmt: skip
    """``[BLOCK_M, BLOCK_N]`` (``[BLOCK_N, BLOCK_M]`` with ``KEYS_FIRST``, keys the A operand)
    sum over the group's ``G`` heads of ``exp2(scale * q_h . k - lse_h)`` for the rows against
    keys ``k`` (not masked: the caller selects the visible pairs once). Head ``h`` of the group
    is ``q_base + h * HEAD_DIM`` at rows ``q_rows`` (``q_stride`` apart) and its LSEs
    ``lse_base + h * S`` at ``lse_rows``. The sum is in registers, in the product's own
    layout. ``STAGES``: 0 unrolls the head loop; more pipelines it over that many stages
    (each head's query rows are a gather, whose latency an unrolled loop short of registers
    leaves exposed)."""
    p = tl.zeros([BLOCK_N, BLOCK_M], tl.float32) if KEYS_FIRST else tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if STAGES == 0:
        for h in tl.static_range(G):
            p += _head_probs(q_base, q_rows, lse_base, lse_rows, row_ok, d, d_ok, k, qk_scale, S, q_stride, h,
                             HEAD_DIM, PRECISION, KEYS_FIRST)  # fmt: skip
    else:
        for h in tl.range(0, G, num_stages=STAGES):
            p += _head_probs(q_base, q_rows, lse_base, lse_rows, row_ok, d, d_ok, k, qk_scale, S, q_stride, h,
                             HEAD_DIM, PRECISION, KEYS_FIRST)  # fmt: skip
    return p


@triton.jit
def _head_probs(q_base, q_rows, lse_base, lse_rows, row_ok, d, d_ok, k, qk_scale, S, q_stride, h,
                HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, KEYS_FIRST: tl.constexpr):  # fmt: skip
    """Head ``h``'s term of :func:`_teacher`."""
    q = _load_rows(q_base + h * HEAD_DIM, q_rows, row_ok, q_stride, d, d_ok)
    lse = _row_stats(lse_base + h * S, lse_rows, row_ok)
    if KEYS_FIRST:
        z = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :]
    else:
        z = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None]
    return tl.exp2(z)


@triton.jit
def _kl_terms(p, log_s, visible, AXIS: tl.constexpr):
    """Per row, ``sum_t p (log p - log s)`` in log2 units over ``AXIS`` (0 where p is: p > 0
    only on visible keys, where log s is finite)."""
    return tl.sum(p * (tl.log2(tl.where(p > 0.0, p, 1.0)) - tl.where(visible, log_s, 0.0)), AXIS)


@triton.jit
def _visible(in_range, col_pos, seen, row_first, HAS_DOCS: tl.constexpr):
    """Where a row sees a key, on operands broadcast to the scores' shape (rows x keys, or
    keys x rows): the pairs ``in_range`` whose key lies at or before ``seen``
    (``_tile_rows``: the row's position, -1 where it did not select the tile) and, with
    ``HAS_DOCS``, at or after ``row_first``, the start of the row's document."""
    visible = in_range & (col_pos <= seen)
    if HAS_DOCS:
        visible = visible & (col_pos >= row_first)
    return visible


@triton.jit
def _index_lse_kernel(
    QI, KI, LSE_IDX, TILES, TILE_CNT, ROWSEL, QBLK, KBLK, DOC_START,
    S, SK, HKV, TB, TH, NQB, T_MAX, K_SEL, RATIO, idx_scale,
    DI: tl.constexpr, DI_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_ROWSEL: tl.constexpr, K_PAD: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
    HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``LSE_idx [B, Hkv, S]`` (natural log, -inf for a row with no visible selected key)."""
    qb, b, r, _, rows, row_ok, di, di_ok = _program_rows(BLOCK, BLOCK_M, DI, DI_PAD, S, HKV, HKV)
    row_pos = _positions(QBLK, qb, rows, HAS_QPOS, BLOCK)
    row_first = _row_starts(DOC_START, row_pos, row_ok, HAS_DOCS)
    qi = _load_rows(QI + b * S * HKV * DI + r * DI, rows, row_ok, HKV * DI, di, di_ok)
    ki_base = KI + b * SK * DI
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    trow, th = _table_row(b, r, HKV, TB, TH, NQB, qb)
    sel = _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD, HAS_ROWSEL)
    for j in range(tl.load(TILE_CNT + trow) * (BLOCK // BLOCK_N)):
        kb, cols, col_ok, col_pos = _block_step(TILES, trow, T_MAX, j, KBLK, SK, BLOCK, BLOCK_N, HAS_KPOS)
        ki = _load_rows(ki_base, cols, col_ok, DI, di, di_ok)
        seen = _tile_rows(row_pos, sel, KBLK, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_KPOS)
        z = _scores(qi, ki, col_pos, col_ok, seen, row_first, idx_scale, True, HAS_DOCS, PRECISION)
        m_i, l_i = _lse_step(m_i, l_i, z)
    tl.store(LSE_IDX + (b * HKV + r) * S + rows, _lse_final(m_i, l_i), mask=row_ok)


@triton.jit
def _dq_kl_kernel(
    Q, K, LSE, QI, KI, LSE_IDX, GRAD, DQI, KL, TILES, TILE_CNT, ROWSEL, QBLK, KBLK, DOC_START,
    S, SK, HQ, HKV, TB, TH, NQB, T_MAX, K_SEL, RATIO, qk_scale, idx_scale, inv_g, grad_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr, G: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_ROWSEL: tl.constexpr,
    K_PAD: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr, TEACHER_STAGES: tl.constexpr = 0,
):  # fmt: skip
    """``dq_idx`` (times ``GRAD * grad_scale``) and each row's KL term ``KL [B, Hkv, S]``;
    ``TEACHER_STAGES`` is ``_teacher``'s ``STAGES``."""
    qb, b, r, _, rows, row_ok, di, di_ok = _program_rows(BLOCK, BLOCK_M, DI, DI_PAD, S, HKV, HKV)
    row_pos = _positions(QBLK, qb, rows, HAS_QPOS, BLOCK)
    row_first = _row_starts(DOC_START, row_pos, row_ok, HAS_DOCS)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_base = Q + (b * S * HQ + r * G) * HEAD_DIM
    lse_base = LSE + (b * HQ + r * G) * S
    qi_off = b * S * HKV * DI + r * DI
    qi = _load_rows(QI + qi_off, rows, row_ok, HKV * DI, di, di_ok)
    lse_i = _row_stats(LSE_IDX, (b * HKV + r) * S + rows, row_ok)
    k_base = K + b * SK * HKV * HEAD_DIM + r * HEAD_DIM
    ki_base = KI + b * SK * DI
    dq = tl.zeros([BLOCK_M, DI_PAD], tl.float32)
    kl = tl.zeros([BLOCK_M], tl.float32)
    trow, th = _table_row(b, r, HKV, TB, TH, NQB, qb)
    sel = _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD, HAS_ROWSEL)
    for j in range(tl.load(TILE_CNT + trow) * (BLOCK // BLOCK_N)):
        kb, cols, col_ok, col_pos = _block_step(TILES, trow, T_MAX, j, KBLK, SK, BLOCK, BLOCK_N, HAS_KPOS)
        k = _load_rows(k_base, cols, col_ok, HKV * HEAD_DIM, d, d_ok)
        ki = _load_rows(ki_base, cols, col_ok, DI, di, di_ok)
        seen = _tile_rows(row_pos, sel, KBLK, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_KPOS)
        in_range = row_ok[:, None] & col_ok[None, :]
        visible = _visible(in_range, col_pos[None, :], seen[:, None], row_first[:, None], HAS_DOCS)
        p = _teacher(q_base, rows, lse_base, rows, row_ok, d, d_ok, k, qk_scale, S, HQ * HEAD_DIM, HEAD_DIM, G,
                     BLOCK_M, BLOCK_N, PRECISION, STAGES=TEACHER_STAGES)  # fmt: skip
        p = tl.where(visible, p, 0.0) * inv_g
        z = tl.dot(qi, tl.trans(ki), input_precision=PRECISION) * idx_scale
        log_s = tl.where(visible, z - lse_i[:, None], float("-inf"))
        dq += tl.dot((tl.exp2(log_s) - p).to(ki.dtype), ki, input_precision=PRECISION)
        kl += _kl_terms(p, log_s, visible, 1)
    _store_rows(DQI + qi_off, rows, row_ok, HKV * DI, di, di_ok, dq * (tl.load(GRAD) * grad_scale))
    tl.store(KL + (b * HKV + r) * S + rows, kl * LN2, mask=row_ok)


@triton.jit
def _dk_kl_kernel(
    Q, K, LSE, QI, KI, LSE_IDX, GRAD, DKI, DQI, KL, TILES_T, TILE_T_CNT, ROWSEL, QBLK, KBLK, DOC_START,
    S, SK, HQ, HKV, TB, TH, NKB, T_MAX, K_SEL, RATIO, qk_scale, idx_scale, inv_g, grad_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr, G: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_ROWSEL: tl.constexpr,
    K_PAD: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr, FUSE_DQ: tl.constexpr, TEACHER_STAGES: tl.constexpr = 0,
):  # fmt: skip
    """``dk_idx`` of ``BLOCK_N`` keys of KV block ``kb``, summed over the groups (times
    ``GRAD * grad_scale``). With ``FUSE_DQ`` (the one pass) also each step's rows' share of
    ``dq_idx`` (times the same) and of their KL terms, added into the zeroed fp32 ``DQI``
    and ``KL [B, Hkv, S]``: every program whose keys a row sees adds to it.
    ``TEACHER_STAGES`` is ``_teacher``'s ``STAGES``."""
    sub = tl.program_id(0)
    kb = sub // (BLOCK // BLOCK_N)
    b = tl.program_id(1)
    cols = sub * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < SK
    col_pos = _positions(KBLK, kb, cols, HAS_KPOS, BLOCK)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    di = tl.arange(0, DI_PAD)
    di_ok = di < DI
    ki_base = KI + b * SK * DI
    ki = _load_rows(ki_base, cols, col_ok, DI, di, di_ok)
    g_scale = tl.load(GRAD) * grad_scale
    dk = tl.zeros([BLOCK_N, DI_PAD], tl.float32)
    for r in range(HKV):
        k = _load_rows(K + b * SK * HKV * HEAD_DIM + r * HEAD_DIM, cols, col_ok, HKV * HEAD_DIM, d, d_ok)
        q_base = Q + (b * S * HQ + r * G) * HEAD_DIM
        lse_base = LSE + (b * HQ + r * G) * S
        qi_off = b * S * HKV * DI + r * DI
        trow, th = _table_row(b, r, HKV, TB, TH, NKB, kb)
        for j in range(tl.load(TILE_T_CNT + trow) * (BLOCK // BLOCK_M)):
            _, rows, row_ok, row_pos = _block_step(TILES_T, trow, T_MAX, j, QBLK, S, BLOCK, BLOCK_M, HAS_QPOS)
            sel = _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD, HAS_ROWSEL)
            seen = _tile_rows(row_pos, sel, KBLK, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_KPOS)
            row_first = _row_starts(DOC_START, row_pos, row_ok, HAS_DOCS)
            in_range = col_ok[:, None] & row_ok[None, :]
            visible = _visible(in_range, col_pos[:, None], seen[None, :], row_first[None, :], HAS_DOCS)
            p = _teacher(q_base, rows, lse_base, rows, row_ok, d, d_ok, k, qk_scale, S, HQ * HEAD_DIM, HEAD_DIM, G,
                         BLOCK_M, BLOCK_N, PRECISION, KEYS_FIRST=True, STAGES=TEACHER_STAGES)  # fmt: skip
            p = tl.where(visible, p, 0.0) * inv_g
            qi = _load_rows(QI + qi_off, rows, row_ok, HKV * DI, di, di_ok)
            lse_i = _row_stats(LSE_IDX, (b * HKV + r) * S + rows, row_ok)
            z = tl.dot(ki, tl.trans(qi), input_precision=PRECISION) * idx_scale
            log_s = tl.where(visible, z - lse_i[None, :], float("-inf"))
            ds = (tl.exp2(log_s) - p).to(qi.dtype)
            if FUSE_DQ:
                # Before the dK product: with these after it, ptxas (Triton 3.7's, sm80) capped the
                # kernel's registers and spilled several times more a thread than here, where it
                # spills about what the dK kernel alone does. Relaxed atomics: nothing reads the
                # sums before the end.
                kl_rows = _kl_terms(p, log_s, visible, 0) * LN2
                tl.atomic_add(KL + (b * HKV + r) * S + rows, kl_rows, mask=row_ok, sem="relaxed")
                dq = tl.dot(tl.trans(ds), ki, input_precision=PRECISION) * g_scale
                dq_ptrs = DQI + qi_off + rows[:, None] * (HKV * DI) + di[None, :]
                tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None] & di_ok[None, :], sem="relaxed")
            dk += tl.dot(ds, qi, input_precision=PRECISION)
    _store_rows(DKI + b * SK * DI, cols, col_ok, DI, di, di_ok, dk * g_scale)

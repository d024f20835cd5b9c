"""Triton kernels of MSA's sparse KL loss over union-of-tiles tables (``block_bar``'s).

Per query row ``i`` and GQA group ``r``, over the tokens the row selected (its tiles'
keys, filtered by its own selection ``rowsel`` and causality):

* teacher ``p[i, t] = mean_h exp(scale * q_h . k_t - LSE_main[i, h])`` over the ``G`` query
  heads of the group, with the main pass's own LSE (the main branch attends exactly these
  tokens, or every visible token in warmup);
* student ``s[i, t] = exp(z[i, t] - LSE_idx[i, r])``, ``z = q_idx . k_idx / sqrt(d_idx)``.

Three kernels, none with atomics:

* ``_index_lse_kernel``: ``LSE_idx`` by an online logsumexp over the row's tiles, one
  program per (``BLOCK_M`` rows of a query block, batch x group).
* ``_dq_kl_kernel``: row-major as the LSE kernel, ``BLOCK_N`` keys a step; recomputes
  ``p`` (all ``G`` heads in one product, see below) and ``s``, accumulates
  ``dq_idx = sum_t (s - p) k_idx`` and each row's KL term ``sum_t p (log p - log s)``.
* ``_dk_kl_kernel``: KV-major over ``tiles_t``, one program per (``BLOCK_N`` keys of a KV
  block, batch); the shared index key head gets the sum over the groups, which the
  program loops over (each dK row has one writer); per group it walks the query blocks
  reading the block, ``BLOCK_M`` rows a step.

Teacher: the main queries of the group's ``G`` heads (contiguous in ``[B, S, Hq, D]``) for
``BLOCK_M`` rows load as one ``[BLOCK_M * G_PAD, D]`` operand (row ``i * G_PAD + g``), so
a step's K tile is loaded once and multiplied once for all heads (the MSA paper's query
concatenation), and the head mean is a sum over a reshaped axis. Heads past ``G`` (``G``
not a power of two) load zeros with an LSE of +inf: they add nothing.

The upstream gradient is read from memory (``GRAD``) and applied in fp32 after the
products, with the mean's ``1 / rows``, so the host never reads it and 16-bit ``ds``
operands keep their range. Products accumulate in fp32; statistics are fp32, base 2.

Context parallelism: every kernel takes a ring step's tables (``query_blocks`` /
``key_blocks``: global block ids of the rank's rows and the chunk's keys; selections hold
global block ids) through ``block_bar``'s position helpers. A CP version runs the LSE
kernel per step and merges the per-step LSEs per row (``logaddexp``; a row with nothing
visible in a step has -inf), then runs the dQ kernel per step with the merged LSEs
(adding the steps' dq_idx and KL rows) and the dK kernel per step for the chunk's keys
(returned to their owner and added), each step dividing by the whole sequence's rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..block_bar.kernels import _block_step, _positions, _program_rows, _row_selection, _table_row, _tile_rows
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
def _group_queries(Q, LSE, b, r, rows, row_ok, S, HQ, G, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, G_PAD: tl.constexpr):  # fmt: skip
    """The main queries of group ``r``'s heads at ``rows``, packed ``[BLOCK_M * G_PAD, D_PAD]``
    (row ``i * G_PAD + g``), and their log2-domain LSEs ``[BLOCK_M, G_PAD]``."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    head = r * G + g
    ok = row_ok[:, None] & (g < G)[None, :]
    ptrs = Q + ((b * S + rows[:, None, None]) * HQ + head[None, :, None]) * HEAD_DIM + d[None, None, :]
    q = tl.load(ptrs, mask=ok[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)
    lse = _row_stats(LSE, (b * HQ + head[None, :]) * S + rows[:, None], ok)
    return tl.reshape(q, (BLOCK_M * G_PAD, D_PAD)), lse


@triton.jit
def _teacher(qg, lse, k, visible, qk_scale, inv_g, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr,
             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """``[BLOCK_M, BLOCK_N]`` head-mean main probabilities of the rows against keys ``k``
    (0 where not ``visible``)."""
    s = tl.reshape(tl.dot(qg, tl.trans(k), input_precision=PRECISION), (BLOCK_M, G_PAD, BLOCK_N))
    x = tl.where(visible[:, None, :], s * qk_scale - lse[:, :, None], float("-inf"))
    return tl.sum(tl.exp2(x), 1) * inv_g


@triton.jit
def _teacher_t(qg, lse, k, visible_t, qk_scale, inv_g, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """``_teacher`` transposed: ``[BLOCK_N, BLOCK_M]`` (keys x rows)."""
    s = tl.reshape(tl.dot(k, tl.trans(qg), input_precision=PRECISION), (BLOCK_N, BLOCK_M, G_PAD))
    x = tl.where(visible_t[:, :, None], s * qk_scale - lse[None, :, :], float("-inf"))
    return tl.sum(tl.exp2(x), 2) * inv_g


@triton.jit
def _index_lse_kernel(
    QI, KI, LSE_IDX, TILES, TILE_CNT, ROWSEL, QBLK, KBLK,
    S, SK, HKV, TB, TH, NQB, T_MAX, K_SEL, RATIO, idx_scale,
    DI: tl.constexpr, DI_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_ROWSEL: tl.constexpr, K_PAD: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """``LSE_idx [B, Hkv, S]`` (natural log, -inf for a row with no visible selected key)."""
    qb, b, r, _, rows, row_ok, di, di_ok = _program_rows(BLOCK, BLOCK_M, DI, DI_PAD, S, HKV, HKV)
    row_pos = _positions(QBLK, qb, rows, HAS_QPOS, BLOCK)
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
        z = _scores(qi, ki, col_pos, col_ok, seen, idx_scale, True, PRECISION)
        m_new = tl.maximum(m_i, tl.max(z, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(z - m_safe[:, None]), 1)
        m_i = m_new
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(LSE_IDX + (b * HKV + r) * S + rows, lse, mask=row_ok)


@triton.jit
def _dq_kl_kernel(
    Q, K, LSE, QI, KI, LSE_IDX, GRAD, DQI, KL, TILES, TILE_CNT, ROWSEL, QBLK, KBLK,
    S, SK, HQ, HKV, G, TB, TH, NQB, T_MAX, K_SEL, RATIO, qk_scale, idx_scale, inv_g, grad_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_ROWSEL: tl.constexpr,
    K_PAD: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``dq_idx`` (times ``GRAD * grad_scale``) and each row's KL term ``KL [B, Hkv, S]``."""
    qb, b, r, _, rows, row_ok, di, di_ok = _program_rows(BLOCK, BLOCK_M, DI, DI_PAD, S, HKV, HKV)
    row_pos = _positions(QBLK, qb, rows, HAS_QPOS, BLOCK)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    qg, lse = _group_queries(Q, LSE, b, r, rows, row_ok, S, HQ, G, HEAD_DIM, D_PAD, BLOCK_M, G_PAD)
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
        visible = row_ok[:, None] & col_ok[None, :] & (col_pos[None, :] <= seen[:, None])
        p = _teacher(qg, lse, k, visible, qk_scale, inv_g, BLOCK_M, G_PAD, BLOCK_N, PRECISION)
        z = tl.dot(qi, tl.trans(ki), input_precision=PRECISION) * idx_scale
        log_s = tl.where(visible, z - lse_i[:, None], float("-inf"))
        dq += tl.dot((tl.exp2(log_s) - p).to(ki.dtype), ki, input_precision=PRECISION)
        # p log(p / s), 0 where p is (p > 0 only on visible keys, where log s is finite).
        kl += tl.sum(p * (tl.log2(tl.where(p > 0.0, p, 1.0)) - tl.where(visible, log_s, 0.0)), 1)
    _store_rows(DQI + qi_off, rows, row_ok, HKV * DI, di, di_ok, dq * (tl.load(GRAD) * grad_scale))
    tl.store(KL + (b * HKV + r) * S + rows, kl * LN2, mask=row_ok)


@triton.jit
def _dk_kl_kernel(
    Q, K, LSE, QI, KI, LSE_IDX, GRAD, DKI, TILES_T, TILE_T_CNT, ROWSEL, QBLK, KBLK,
    S, SK, HQ, HKV, G, TB, TH, NKB, T_MAX, K_SEL, RATIO, qk_scale, idx_scale, inv_g, grad_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_ROWSEL: tl.constexpr,
    K_PAD: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``dk_idx`` of ``BLOCK_N`` keys of KV block ``kb``, summed over the groups (times
    ``GRAD * grad_scale``)."""
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
    dk = tl.zeros([BLOCK_N, DI_PAD], tl.float32)
    for r in range(HKV):
        k = _load_rows(K + b * SK * HKV * HEAD_DIM + r * HEAD_DIM, cols, col_ok, HKV * HEAD_DIM, d, d_ok)
        trow, th = _table_row(b, r, HKV, TB, TH, NKB, kb)
        for j in range(tl.load(TILE_T_CNT + trow) * (BLOCK // BLOCK_M)):
            _, rows, row_ok, row_pos = _block_step(TILES_T, trow, T_MAX, j, QBLK, S, BLOCK, BLOCK_M, HAS_QPOS)
            sel = _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD, HAS_ROWSEL)
            seen = _tile_rows(row_pos, sel, KBLK, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_KPOS)
            visible = col_ok[:, None] & row_ok[None, :] & (col_pos[:, None] <= seen[None, :])
            qg, lse = _group_queries(Q, LSE, b, r, rows, row_ok, S, HQ, G, HEAD_DIM, D_PAD, BLOCK_M, G_PAD)
            qi = _load_rows(QI + b * S * HKV * DI + r * DI, rows, row_ok, HKV * DI, di, di_ok)
            lse_i = _row_stats(LSE_IDX, (b * HKV + r) * S + rows, row_ok)
            p = _teacher_t(qg, lse, k, visible, qk_scale, inv_g, BLOCK_M, G_PAD, BLOCK_N, PRECISION)
            z = tl.dot(ki, tl.trans(qi), input_precision=PRECISION) * idx_scale
            s = tl.exp2(tl.where(visible, z - lse_i[None, :], float("-inf")))
            dk += tl.dot((s - p).to(qi.dtype), qi, input_precision=PRECISION)
    _store_rows(DKI + b * SK * DI, cols, col_ok, DI, di, di_ok, dk * (tl.load(GRAD) * grad_scale))

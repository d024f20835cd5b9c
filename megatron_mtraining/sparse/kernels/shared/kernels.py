"""Triton device functions that both attention families' kernels are built of (the
query-major tile + bar kernels of ``block_bar`` and the KV-outer kernels of ``kv_outer``):
row loads and stores, an online-softmax step, a dQ step and a transposed dK/dV step.

All statistics are fp32; exponentials are base 2 with the scale folded in (``LOG2E``).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k, col_pos, col_ok, row_pos, row_first, qk_scale, masked, HAS_DOCS: tl.constexpr,
            PRECISION: tl.constexpr):  # fmt: skip
    """Scaled log2-domain logits [BLOCK, N]; if ``masked``, invisible keys at -inf: after
    the row, or (``HAS_DOCS``) before ``row_first``, the start of the row's document."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if masked:
        visible = col_ok[None, :] & (col_pos[None, :] <= row_pos[:, None])
        if HAS_DOCS:
            visible = visible & (col_pos[None, :] >= row_first[:, None])
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _load_rows(base, idx, ok, row_stride, d, d_ok):
    return tl.load(base + idx[:, None] * row_stride + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _store_rows(base, idx, ok, row_stride, d, d_ok, x):
    """``x`` stored in the buffer's dtype at the rows ``_load_rows`` reads."""
    ptrs = base + idx[:, None] * row_stride + d[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _online_step(acc, m_i, l_i, q, k, v, col_pos, col_ok, row_pos, row_first, qk_scale, masked,
                 HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    s = _scores(q, k, col_pos, col_ok, row_pos, row_first, qk_scale, masked, HAS_DOCS, PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _dq_step(dq, q, do, lse, delta, k, v, col_pos, col_ok, row_pos, row_first, qk_scale, masked,
             HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    p = tl.exp2(
        _scores(q, k, col_pos, col_ok, row_pos, row_first, qk_scale, masked, HAS_DOCS, PRECISION) - lse[:, None]
    )
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@triton.jit
def _transposed_grads(dk, dv, s, q, v, do, lse, delta, qk_scale, PRECISION: tl.constexpr):
    """dK/dV sums with one step of rows added, from that step's unscaled transposed logits
    ``s`` (keys x rows, invisible at -inf), the step's dS^T in q's dtype (for a dQ) and its
    probabilities P^T (fp32; MSA's KL takes them as its teacher, ``kv_outer._bwd_kernel``). The
    scale is folded into the exponent's argument, one fused multiply-add an element, which
    made both dK/dV kernels faster; in the forward and dQ kernels the same fold measured no
    gain (docs/benchmarks.md, "Forward mask variants, the scale fold and a launch sweep")."""
    p = tl.exp2(s * qk_scale - lse[None, :])
    dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
    dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds = (p * (dp - delta[None, :])).to(q.dtype)
    dk += tl.dot(ds, q, input_precision=PRECISION)
    return dk, dv, ds, p

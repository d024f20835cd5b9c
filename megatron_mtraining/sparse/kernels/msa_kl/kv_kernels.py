"""Triton kernels of MSA's sparse KL loss in the KV-outer order, for a ``BlockTopKIndex``.

The union-of-tiles kernels (``kernels``) compute every row of a query block against the
union of its rows' blocks: under MSA's per-row top-k the rows of a query block choose
different blocks, so at 128K the union covers most of the causal triangle while the
selection is a few percent of it. Here, as in ``kv_outer``'s attention, a program takes one
key block of one GQA group and a work item's tiles of the index rows that chose it,
gathered through ``kv_outer.reverse_index``: a row is one (token, group), ``BLOCK_M`` rows a
tile (``kv_outer.kernels._tile`` with one head a row), so every row of every product wants
the block. Each row's results for the block go to the slot of the block in the row's
selection (``[.., k]`` slot buffers of the query chunk, one writer each, no atomics), and
``kv_outer``'s per-row kernels combine them afterwards.

* ``_kl_lse_kernel``: each (row, slot)'s logsumexp of ``z = q_idx . k_idx / sqrt(d_idx)``
  over the block's visible keys (natural log, -inf where none is visible);
  ``kv_outer.kernels._merge_kernel`` without outputs merges a row's slots into
  ``LSE_idx [B, Hkv, S]``.
* ``_kl_bwd_kernel``: ``BLOCK_N`` keys of an item's block (step ``program_id(1)``) against
  its tiles, transposed (keys x rows) as ``kernels._dk_kl_kernel``: the teacher
  ``p = mean_h exp2(scale q_h . k - lse_h)`` by ``kernels._teacher``'s head loop (the
  group's ``G`` query heads of each gathered row, the main pass's LSEs), the student
  ``s = exp2(z - LSE_idx)``, ``ds = s - p``; ``dk_idx += ds^T q_idx`` over the tiles, and
  where the step is the whole block (``HAS_DQ``) each row's ``dq_idx`` partial ``ds k_idx``
  and KL term ``sum_t p (log p - log s)`` into its slot. The item's dK goes to the running
  fp32 sums ``[B, S, Hkv, d_idx]`` (one writer per (group, key block) where the group is
  one item) or a partial summed by ``kv_outer.kernels._reduce_kernel`` (dK alone); the
  groups' sums are added at the end (index keys are shared by the groups).
* ``_kl_dq_kernel``: for blocks wider than the dK step, each tile's ``dq_idx`` and KL
  partials over the whole block, ``BLOCK_N`` keys a step (``kernels._teacher``).

``kv_outer.kernels._sum_slots_kernel`` then adds each row's dq_idx and KL slots in slot
order. The upstream gradient is read from ``GRAD`` and applied with ``grad_scale`` (the
mean's ``1 / rows`` and the index scale) after the products. Statistics and products are
fp32, exponentials base 2; only plain loads and ``tl.dot`` (sm80, sm90, the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..kv_outer.kernels import _add_block_grad, _key_rows, _tile, _work_item
from ..shared.kernels import _load_rows, _scores, _store_rows
from .kernels import LN2, _kl_terms, _lse_final, _lse_step, _row_stats, _teacher


@triton.jit
def _index_rows(TILES, ENTRIES, tile, live, b, chunk, CHUNK, S, HKV, KSEL, BLOCK_M: tl.constexpr):
    """A tile's index rows, one per (token, group): (row of ``q_idx``'s ``[B * S * Hkv, d_idx]``
    view, row mask, token position (-1 on masked rows), offset in ``[B, Hkv, S]``, row of the
    chunk's slot buffers)."""
    return _tile(TILES, ENTRIES, tile, live, b, chunk, CHUNK, S, HKV, HKV, KSEL, 1, BLOCK_M)


@triton.jit
def _main_rows(q_row, stat, row_pos, G: tl.constexpr):
    """Of index rows (``_index_rows``), the main pass's: (row of head 0 of the group in q's
    ``[B * S * Hq, D]`` view, offset of its LSE in ``[B, Hq, S]``); head ``h`` is ``h`` rows
    and ``h * S`` on."""
    return q_row * G, (stat - row_pos) * G + row_pos


@triton.jit
def _stored_teacher(TEACHER, slot_row, ok, j, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """The teacher's unnormalised sums that the main attention's backward stored for step
    ``j`` of the block (``kv_outer.kernels._store_group_sums``): rows x keys, or keys x rows
    with ``KEYS_FIRST``."""
    keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
    # One return: Triton types every return of a function alike, constexpr branches included.
    if KEYS_FIRST:
        ptrs, mask = TEACHER + slot_row[None, :] * BLOCK + keys[:, None], ok[None, :]
    else:
        ptrs, mask = TEACHER + slot_row[:, None] * BLOCK + keys[None, :], ok[:, None]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["chunk"])
def _kl_lse_kernel(
    QI, KI, ENTRIES, TILES, ITEMS, CHUNK_ITEMS, LSE_BUF, chunk, CHUNK, S, HKV, KSEL, N_KB, idx_scale,
    DI: tl.constexpr, DI_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Each (row, slot)'s index logsumexp over the item's block (natural log; -inf where the
    row sees none of its keys) into ``LSE_BUF``."""
    _item, n_tiles, b, _r, kb, first = _work_item(ITEMS, CHUNK_ITEMS, chunk, HKV, N_KB)
    if n_tiles > 0:
        di = tl.arange(0, DI_PAD)
        di_ok = di < DI
        if BLOCK == BLOCK_N:
            ki, cols, col_ok = _key_rows(KI, b, 0, kb, 0, S, 1, di, di_ok, DI, BLOCK, BLOCK_N)
        q_row, ok, row_pos, _stat, slot_row = _index_rows(TILES, ENTRIES, first, True, b, chunk, CHUNK, S, HKV, KSEL,
                                                          BLOCK_M)  # fmt: skip
        for i in range(n_tiles):
            qi = _load_rows(QI, q_row, ok, DI, di, di_ok)
            n_row, n_ok, n_pos, _stat, n_slot = _index_rows(TILES, ENTRIES, first + i + 1, i + 1 < n_tiles, b, chunk,
                                                            CHUNK, S, HKV, KSEL, BLOCK_M)  # fmt: skip
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            for j in range(BLOCK // BLOCK_N):
                if BLOCK != BLOCK_N:
                    ki, cols, col_ok = _key_rows(KI, b, 0, kb, j, S, 1, di, di_ok, DI, BLOCK, BLOCK_N)
                z = _scores(qi, ki, cols, col_ok, row_pos, row_pos, idx_scale, True, False, PRECISION)
                m_i, l_i = _lse_step(m_i, l_i, z)
            tl.store(LSE_BUF + slot_row, _lse_final(m_i, l_i), mask=ok)
            q_row, ok, row_pos, slot_row = n_row, n_ok, n_pos, n_slot


@triton.jit(do_not_specialize=["chunk"])
def _kl_bwd_kernel(
    Q, K, LSE, QI, KI, LSE_IDX, GRAD, ENTRIES, TILES, ITEMS, CHUNK_ITEMS, PARTIAL, DK_SUM, DK_PART, DQ_BUF, KL_BUF,
    chunk, CHUNK, S, HQ, HKV, KSEL, N_KB, qk_scale, idx_scale, inv_g, grad_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr, G: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, HAS_DQ: tl.constexpr,
    TEACHER=None, HAS_TEACHER: tl.constexpr = False, TEACHER_STAGES: tl.constexpr = 0,
):  # fmt: skip
    """dk_idx of step ``program_id(1)`` of an item's block over its tiles and, with ``HAS_DQ``
    (the step is the whole block), the rows' dq_idx and KL slot partials. Keys x rows. With
    ``HAS_TEACHER`` the teacher is read from ``TEACHER`` (``_stored_teacher``), and ``Q``,
    ``K`` and ``LSE`` are not read; else ``TEACHER_STAGES`` is ``kernels._teacher``'s
    ``STAGES``."""
    item, n_tiles, b, r, kb, first = _work_item(ITEMS, CHUNK_ITEMS, chunk, HKV, N_KB)
    if n_tiles > 0:
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        di = tl.arange(0, DI_PAD)
        di_ok = di < DI
        j = tl.program_id(1)
        ki, cols, col_ok = _key_rows(KI, b, 0, kb, j, S, 1, di, di_ok, DI, BLOCK, BLOCK_N)
        if not HAS_TEACHER:
            k, _, _ = _key_rows(K, b, r, kb, j, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
        g_scale = tl.load(GRAD) * grad_scale
        dk = tl.zeros([BLOCK_N, DI_PAD], tl.float32)
        q_row, ok, row_pos, stat, slot_row = _index_rows(TILES, ENTRIES, first, True, b, chunk, CHUNK, S, HKV, KSEL,
                                                         BLOCK_M)  # fmt: skip
        for i in range(n_tiles):
            qi = _load_rows(QI, q_row, ok, DI, di, di_ok)
            lse_i = _row_stats(LSE_IDX, stat, ok)
            # As in kv_outer: the next tile's rows now, its data when its turn comes.
            n_row, n_ok, n_pos, n_stat, n_slot = _index_rows(TILES, ENTRIES, first + i + 1, i + 1 < n_tiles, b, chunk,
                                                             CHUNK, S, HKV, KSEL, BLOCK_M)  # fmt: skip
            visible = col_ok[:, None] & (cols[:, None] <= row_pos[None, :])
            if HAS_TEACHER:
                p = _stored_teacher(TEACHER, slot_row, ok, j, BLOCK, BLOCK_N, True)
            else:
                main_row, main_stat = _main_rows(q_row, stat, row_pos, G)
                p = _teacher(Q, main_row, LSE, main_stat, ok, d, d_ok, k, qk_scale, S, HEAD_DIM, HEAD_DIM, G,
                             BLOCK_M, BLOCK_N, PRECISION, KEYS_FIRST=True, STAGES=TEACHER_STAGES)  # fmt: skip
            p = tl.where(visible, p, 0.0) * inv_g
            z = tl.dot(ki, tl.trans(qi), input_precision=PRECISION) * idx_scale
            log_s = tl.where(visible, z - lse_i[None, :], float("-inf"))
            ds = tl.exp2(log_s) - p
            dk += tl.dot(ds.to(qi.dtype), qi, input_precision=PRECISION)
            if HAS_DQ:
                dq = tl.dot(tl.trans(ds.to(ki.dtype)), ki, input_precision=PRECISION)
                _store_rows(DQ_BUF, slot_row, ok, DI, di, di_ok, dq * g_scale)
                tl.store(KL_BUF + slot_row, _kl_terms(p, log_s, visible, 0) * LN2, mask=ok)
            q_row, ok, row_pos, stat, slot_row = n_row, n_ok, n_pos, n_stat, n_slot
        partial = tl.load(PARTIAL + item)
        _add_block_grad(dk * g_scale, DK_SUM, DK_PART, partial, b, r, j, cols, col_ok, S, HKV, di, di_ok, DI, BLOCK,
                        BLOCK_N)  # fmt: skip


@triton.jit(do_not_specialize=["chunk"])
def _kl_dq_kernel(
    Q, K, LSE, QI, KI, LSE_IDX, GRAD, ENTRIES, TILES, ITEMS, CHUNK_ITEMS, DQ_BUF, KL_BUF,
    chunk, CHUNK, S, HQ, HKV, KSEL, N_KB, qk_scale, idx_scale, inv_g, grad_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr, G: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TEACHER=None, HAS_TEACHER: tl.constexpr = False, TEACHER_STAGES: tl.constexpr = 0,
):  # fmt: skip
    """The rows' dq_idx and KL slot partials over a block wider than the dK kernel's step,
    ``BLOCK_N`` keys a step. Rows x keys. ``HAS_TEACHER`` and ``TEACHER_STAGES`` as
    ``_kl_bwd_kernel``'s."""
    _item, n_tiles, b, r, kb, first = _work_item(ITEMS, CHUNK_ITEMS, chunk, HKV, N_KB)
    if n_tiles > 0:
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        di = tl.arange(0, DI_PAD)
        di_ok = di < DI
        g_scale = tl.load(GRAD) * grad_scale
        q_row, ok, row_pos, stat, slot_row = _index_rows(TILES, ENTRIES, first, True, b, chunk, CHUNK, S, HKV, KSEL,
                                                         BLOCK_M)  # fmt: skip
        for i in range(n_tiles):
            qi = _load_rows(QI, q_row, ok, DI, di, di_ok)
            lse_i = _row_stats(LSE_IDX, stat, ok)
            n_row, n_ok, n_pos, n_stat, n_slot = _index_rows(TILES, ENTRIES, first + i + 1, i + 1 < n_tiles, b, chunk,
                                                             CHUNK, S, HKV, KSEL, BLOCK_M)  # fmt: skip
            main_row, main_stat = _main_rows(q_row, stat, row_pos, G)
            dq = tl.zeros([BLOCK_M, DI_PAD], tl.float32)
            kl = tl.zeros([BLOCK_M], tl.float32)
            for j in range(BLOCK // BLOCK_N):
                ki, cols, col_ok = _key_rows(KI, b, 0, kb, j, S, 1, di, di_ok, DI, BLOCK, BLOCK_N)
                visible = col_ok[None, :] & (cols[None, :] <= row_pos[:, None])
                if HAS_TEACHER:
                    p = _stored_teacher(TEACHER, slot_row, ok, j, BLOCK, BLOCK_N, False)
                else:
                    k, _, _ = _key_rows(K, b, r, kb, j, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
                    p = _teacher(Q, main_row, LSE, main_stat, ok, d, d_ok, k, qk_scale, S, HEAD_DIM, HEAD_DIM, G,
                                 BLOCK_M, BLOCK_N, PRECISION, STAGES=TEACHER_STAGES)  # fmt: skip
                p = tl.where(visible, p, 0.0) * inv_g
                z = tl.dot(qi, tl.trans(ki), input_precision=PRECISION) * idx_scale
                log_s = tl.where(visible, z - lse_i[:, None], float("-inf"))
                dq += tl.dot((tl.exp2(log_s) - p).to(ki.dtype), ki, input_precision=PRECISION)
                kl += _kl_terms(p, log_s, visible, 1)
            _store_rows(DQ_BUF, slot_row, ok, DI, di, di_ok, dq * g_scale)
            tl.store(KL_BUF + slot_row, kl * LN2, mask=ok)
            q_row, ok, row_pos, stat, slot_row = n_row, n_ok, n_pos, n_stat, n_slot

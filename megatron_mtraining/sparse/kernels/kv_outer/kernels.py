"""Triton kernels of KV-outer attention over a per-query top-k block selection (MSA, MoBA).

Iterating queries on the outer loop (``block_bar`` on a ``block_topk_tables``) walks the
union of the blocks that a query block's rows chose and masks each row to its own, so at
long lengths most of the computed area is thrown away. Here a program takes one key block
and a work item's tiles (``reverse_index``) of the queries that chose it: ``BLOCK_M``
rows of ``BLOCK_M // G`` tokens x the ``G`` query heads of their selection head, gathered
(the heads of a token are adjacent in q), so every row of every product wants the block.

Forward: each row's softmax over its block alone, written locally normalised with its
LSE into slot ``slot`` of its (token, head) in ``O_BUF`` / ``LSE_BUF``, the position of the
block in the token's selection: each slot has one writer, so no atomics. ``_merge_kernel``
then merges each row's slots as split-K partials. A block wider than ``BLOCK_N`` keys is
walked ``BLOCK_N`` keys a step with an online softmax; a block of one step keeps its K/V
for all the item's tiles. ``_fwd_merging_kernel`` (``attention.FWD_MERGE_CHUNK``) runs the
same tiles with the items taken in order by tickets and merges each token itself, in the
program that writes its last slot (``_merge_finished``: atomic counts, never atomic sums).

Backward, deterministic without atomics: ``_bwd_kernel`` takes ``BLOCK_N`` keys of an item's
block and its tiles, accumulates their dK/dV and, when that is the whole block, writes
each row's dQ partial ``dS K`` to its slot of ``DQ_BUF`` (else ``_dq_kernel`` does, walking
the block per tile). An item that is its group's only one in the chunk adds its dK/dV to
the running fp32 sums; items of a split group write partials that ``_reduce_kernel`` adds
in item order, its programs striding over the chunk's split groups. ``_sum_slots_kernel``
adds each row's dQ slots in slot order, in fp32 whatever the slots' dtype (bf16 for bf16
inputs, see ``attention``).

The kernels of one query chunk index their slot buffers by the row's offset in the chunk,
``chunk * CHUNK`` tokens in. All statistics are fp32; exponentials are base 2 with the scale
folded in. Everything is plain loads and ``tl.dot``, which compile for sm80 and sm90.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..shared.combine import _rows, merge_weights
from ..shared.kernels import LOG2E, _dq_step, _load_rows, _online_step, _store_rows, _transposed_grads

_LOG2E = tl.constexpr(LOG2E)  # kernels read only constexpr globals


@triton.jit
def _work_item(ITEMS, CHUNK_ITEMS, chunk, HKV, N_KB):
    """This program's item of the chunk: (item, tiles (0 past the chunk's items), batch,
    KV head, key block, first tile)."""
    item = tl.load(CHUNK_ITEMS + chunk) + tl.program_id(0)
    n_tiles, b, kvh, kb, first = _item_fields(ITEMS, item, item < tl.load(CHUNK_ITEMS + chunk + 1), HKV, N_KB)
    return item, n_tiles, b, kvh, kb, first


@triton.jit
def _item_fields(ITEMS, item, live, HKV, N_KB):
    """Work item ``item``: (tiles (0 unless ``live``), batch, KV head, key block, first tile)."""
    group = tl.load(ITEMS + 3 * item, mask=live, other=0)
    first = tl.load(ITEMS + 3 * item + 1, mask=live, other=0)
    n_tiles = tl.load(ITEMS + 3 * item + 2, mask=live, other=0)
    return n_tiles, group // (HKV * N_KB), group // N_KB % HKV, group % N_KB, first


@triton.jit
def _key_rows(K, b, kvh, kb, j, S, HKV, d, d_ok, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """Step ``j`` of key block ``kb`` of KV head ``kvh`` of ``K [B, S, HKV, HEAD_DIM]``: (its
    rows, key positions, in-sequence mask)."""
    cols = kb * BLOCK + j * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < S
    return _load_rows(K + b * S * HKV * HEAD_DIM + kvh * HEAD_DIM, cols, ok, HKV * HEAD_DIM, d, d_ok), cols, ok


@triton.jit
def _key_step(K, V, b, kvh, kb, j, S, HKV, d, d_ok, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """Step ``j`` of key block ``kb``: (k, v, key positions, in-sequence mask)."""
    k, cols, ok = _key_rows(K, b, kvh, kb, j, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
    v, _, _ = _key_rows(V, b, kvh, kb, j, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
    return k, v, cols, ok


@triton.jit
def _tile(TILES, ENTRIES, tile, live, b, chunk, CHUNK, S, HQ, HS, KSEL, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """A tile's rows, token-major over the ``G`` heads of its selection head (none unless
    ``live``): (row of q's ``[B * S * Hq, D]`` view, row mask, token position (-1 on masked
    rows, which so see no key), statistics offset in ``[B, Hq, S]``, row of the chunk's slot
    buffers)."""
    first = tl.load(TILES + 2 * tile, mask=live, other=0)
    r = tl.arange(0, BLOCK_M)
    token = r // G
    ok = token < tl.load(TILES + 2 * tile + 1, mask=live, other=0)
    entry = tl.load(ENTRIES + first + token, mask=ok, other=0)
    t = entry // (HS * KSEL) % S
    h = entry // KSEL % HS * G + r % G
    slot_row = ((b * CHUNK + t - chunk * CHUNK) * HQ + h) * KSEL + entry % KSEL
    return (b * S + t) * HQ + h, ok, tl.where(ok, t, -1), (b * HQ + h) * S + t, slot_row


@triton.jit
def _grad_rows(Q, DO, LSE, DELTA, q_row, stat, ok, d, d_ok, HEAD_DIM: tl.constexpr):
    """A tile's q, dO, log2-domain LSE (0 on rows that see nothing, whose logits are all
    -inf) and delta."""
    q = _load_rows(Q, q_row, ok, HEAD_DIM, d, d_ok)
    do = _load_rows(DO, q_row, ok, HEAD_DIM, d, d_ok)
    lse = tl.load(LSE + stat, mask=ok, other=0.0) * _LOG2E
    return q, do, tl.where(lse == float("-inf"), 0.0, lse), tl.load(DELTA + stat, mask=ok, other=0.0)


@triton.jit(do_not_specialize=["chunk"])
def _fwd_kernel(
    Q, K, V, ENTRIES, TILES, ITEMS, CHUNK_ITEMS, O_BUF, LSE_BUF, chunk, CHUNK, S, HQ, HKV, HS, KSEL, N_KB, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Each of the program's item's tiles into its slots (``_merge_kernel`` merges them)."""
    _item, n_tiles, b, kvh, kb, first = _work_item(ITEMS, CHUNK_ITEMS, chunk, HKV, N_KB)
    if n_tiles > 0:
        _fwd_item(Q, K, V, ENTRIES, TILES, O_BUF, LSE_BUF, n_tiles, b, kvh, kb, first, chunk, CHUNK, S, HQ, HKV, HS,
                  KSEL, qk_scale, HEAD_DIM, D_PAD, BLOCK, BLOCK_M, BLOCK_N, G, PRECISION)  # fmt: skip


@triton.jit(do_not_specialize=["window"])
def _fwd_merging_kernel(
    Q, K, V, ENTRIES, TILES, ITEMS, CHUNK_ITEMS, O_BUF, LSE_BUF, BLOCKS, COUNT, TICKETS, OUT, LSE, window,
    WINDOW_CHUNKS, N_CHUNKS, WINDOW, S, HQ, HKV, HS, KSEL, N_KB, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, PRECISION: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """The items of the ``WINDOW_CHUNKS`` query chunks of window ``window`` (``WINDOW``
    tokens, whose slot rows ``O_BUF`` / ``LSE_BUF`` hold; ``N_CHUNKS`` in all), taken in order by tickets
    (``TICKETS [window]``, zero before the launch) by a grid of any size: the items are
    chunk-major, so a token's slots are written close together in time, and the tile that
    writes a token's last slot merges them (``_merge_finished``) while the cache may still
    hold them."""
    first_item = tl.load(CHUNK_ITEMS + window * WINDOW_CHUNKS)
    n_items = tl.load(CHUNK_ITEMS + tl.minimum((window + 1) * WINDOW_CHUNKS, N_CHUNKS)) - first_item
    ticket = tl.atomic_add(TICKETS + window, 1)
    while ticket < n_items:
        # A window's first ``n_items`` items are its real ones, each of one tile or more.
        n_tiles, b, kvh, kb, first = _item_fields(ITEMS, first_item + ticket, True, HKV, N_KB)
        _fwd_item(Q, K, V, ENTRIES, TILES, O_BUF, LSE_BUF, n_tiles, b, kvh, kb, first, window, WINDOW, S, HQ, HKV, HS,
                  KSEL, qk_scale, HEAD_DIM, D_PAD, BLOCK, BLOCK_M, BLOCK_N, G, PRECISION, BLOCKS, COUNT, OUT, LSE, True,
                  TOKENS)  # fmt: skip
        ticket = tl.atomic_add(TICKETS + window, 1)


@triton.jit
def _fwd_item(Q, K, V, ENTRIES, TILES, O_BUF, LSE_BUF, n_tiles, b, kvh, kb, first, chunk, CHUNK, S, HQ, HKV, HS, KSEL,
              qk_scale, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, G: tl.constexpr, PRECISION: tl.constexpr, BLOCKS=None, COUNT=None, OUT=None,
              LSE=None, MERGE: tl.constexpr = False, TOKENS: tl.constexpr = 16):  # fmt: skip
    """An item's tiles (``n_tiles`` from ``first``) against its key block: each row's softmax
    over the block alone, written locally normalised with its LSE into slot ``slot`` of its
    (token, head) rows of ``O_BUF`` / ``LSE_BUF`` (rows counted from query ``chunk`` of
    ``CHUNK`` tokens). With ``MERGE``, after each tile, ``_merge_finished``."""
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    if BLOCK == BLOCK_N:
        k, v, cols, col_ok = _key_step(K, V, b, kvh, kb, 0, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
    q_row, ok, row_pos, stat, slot_row = _tile(TILES, ENTRIES, first, True, b, chunk, CHUNK, S, HQ, HS, KSEL, G,
                                               BLOCK_M)  # fmt: skip
    for i in range(n_tiles):
        q = _load_rows(Q, q_row, ok, HEAD_DIM, d, d_ok)
        # The next tile's rows now, so that its loads wait on no index lookup. Its queries
        # too were no faster here, and slowed the backward: their registers spill.
        n_row, n_ok, n_pos, n_stat, n_slot = _tile(TILES, ENTRIES, first + i + 1, i + 1 < n_tiles, b, chunk, CHUNK, S,
                                                   HQ, HS, KSEL, G, BLOCK_M)  # fmt: skip
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for j in range(BLOCK // BLOCK_N):
            if BLOCK != BLOCK_N:
                k, v, cols, col_ok = _key_step(K, V, b, kvh, kb, j, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
            # Masked everywhere: a compare and select per score, against a branch per tile.
            acc, m_i, l_i = _online_step(
                acc, m_i, l_i, q, k, v, cols, col_ok, row_pos, row_pos, qk_scale, True, False, PRECISION
            )
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        _store_rows(O_BUF, slot_row, ok, HEAD_DIM, d, d_ok, acc / l_safe[:, None])
        tl.store(LSE_BUF + slot_row, tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / _LOG2E), mask=ok)
        if MERGE:
            _merge_finished(TILES, ENTRIES, first + i, O_BUF, LSE_BUF, BLOCKS, COUNT, OUT, LSE, q_row, ok, stat,
                            slot_row, b, chunk, CHUNK, S, HQ, HS, KSEL, d, d_ok, HEAD_DIM, D_PAD, BLOCK_M, G,
                            TOKENS)  # fmt: skip
        q_row, ok, row_pos, stat, slot_row = n_row, n_ok, n_pos, n_stat, n_slot


@triton.jit
def _merge_finished(TILES, ENTRIES, tile, O_BUF, LSE_BUF, BLOCKS, COUNT, OUT, LSE, q_row, ok, stat, slot_row, b, chunk,
                    CHUNK, S, HQ, HS, KSEL, d, d_ok, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr):  # fmt: skip
    """Once a tile's partials are stored: counts the slot it wrote for each of its tokens in
    ``COUNT`` (one int32 per (token, selection head) of the window's slot rows) and, for the
    tokens whose every selected slot is now written, merges their rows' slots in slot order
    (``_merged_slots``, as ``_merge_kernel``), into ``OUT`` / ``LSE``, and zeroes their counts for the next
    window. The stores are ordered before the count by a barrier and the count's release;
    the merge's loads after it by its acquire and a barrier, and they bypass L1 (``.cg``),
    which may hold a line of the buffer from an earlier window."""
    sel_row, tok_ok, _pos, _stat, tok_slot = _tile(TILES, ENTRIES, tile, True, b, chunk, CHUNK, S, HS, HS, KSEL, 1,
                                                   TOKENS)  # fmt: skip
    n_valid = tl.zeros([TOKENS], tl.int32)
    for s in range(KSEL):
        n_valid += (tl.load(BLOCKS + sel_row * KSEL + s, mask=tok_ok, other=-1) >= 0).to(tl.int32)
    tl.debug_barrier()
    written = tl.atomic_add(COUNT + tok_slot // KSEL, 1, mask=tok_ok, sem="acq_rel", scope="gpu") + 1
    done = tok_ok & (written == n_valid)
    tl.debug_barrier()
    member = (tl.arange(0, BLOCK_M) // G)[:, None] == tl.arange(0, TOKENS)[None, :]
    rows = ok & (tl.max(tl.where(member & done[None, :], 1, 0), 1) > 0)
    if tl.max(rows.to(tl.int32), 0) > 0:
        out, lse = _merged_slots(O_BUF, LSE_BUF, BLOCKS, slot_row - slot_row % KSEL, q_row // G * KSEL, rows, KSEL,
                                 d, d_ok, HEAD_DIM, BLOCK_M, D_PAD, True, ".cg")  # fmt: skip
        _store_rows(OUT, q_row, rows, HEAD_DIM, d, d_ok, out)
        tl.store(LSE + stat, lse, mask=rows)
        tl.store(COUNT + tok_slot // KSEL, tl.zeros([TOKENS], tl.int32), mask=done)


@triton.jit
def _chunk_rows(chunk, CHUNK, N, S, HQ, HS, KSEL, HEAD_DIM, ROWS: tl.constexpr, D_PAD: tl.constexpr):
    """``ROWS`` of the chunk's ``N`` (token, head) rows, ``[B, CHUNK, Hq]`` row-major: (row of
    the slot buffers' ``[.., k]`` view, row mask, row of ``[B * S * Hq, D]``, statistics offset,
    offset of the row's selection in ``[B, S, Hs, k]``, d, d mask)."""
    r, ok, b, t, h, _, _ = _rows(tl.program_id(0), N, HQ, CHUNK, ROWS, D_PAD, HEAD_DIM)
    t += chunk * CHUNK
    ok &= t < S
    d = tl.arange(0, D_PAD)
    selection = ((b * S + t) * HS + h // (HQ // HS)) * KSEL
    return r, ok, (b * S + t) * HQ + h, (b * HQ + h) * S + t, selection, d, d < HEAD_DIM


@triton.jit(do_not_specialize=["chunk"])
def _merge_kernel(O_BUF, LSE_BUF, BLOCKS, OUT, LSE, chunk, CHUNK, N, S, HQ, HS, KSEL,
                  HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
                  HAS_OUT: tl.constexpr = True):  # fmt: skip
    """Each row's output and LSE from its selected slots, merged in slot order; a row with no
    visible key gets zeros and -inf. Without ``HAS_OUT``, the LSE alone (``O_BUF`` and
    ``OUT`` are not read: MSA's index LSE, ``msa_kl.kv_kernels``)."""
    r, ok, out_row, stat, selection, d, d_ok = _chunk_rows(chunk, CHUNK, N, S, HQ, HS, KSEL, HEAD_DIM, ROWS, D_PAD)
    out, lse = _merged_slots(O_BUF, LSE_BUF, BLOCKS, r * KSEL, selection, ok, KSEL, d, d_ok, HEAD_DIM, ROWS, D_PAD,
                             HAS_OUT)  # fmt: skip
    if HAS_OUT:
        _store_rows(OUT, out_row, ok, HEAD_DIM, d, d_ok, out)
    tl.store(LSE + stat, lse, mask=ok)


@triton.jit
def _merged_slots(O_BUF, LSE_BUF, BLOCKS, slot_base, selection, ok, KSEL, d, d_ok, HEAD_DIM: tl.constexpr,
                  ROWS: tl.constexpr, D_PAD: tl.constexpr, HAS_OUT: tl.constexpr, CACHE: tl.constexpr = ""):  # fmt: skip
    """The ``ROWS`` rows' (output fp32, LSE) merged over their selected slots in slot order:
    row ``i``'s slots are rows ``slot_base[i] ..`` of ``O_BUF`` / ``LSE_BUF``, its selection at
    ``BLOCKS + selection[i]``; rows not ``ok`` or with no slot chosen get zeros and -inf.
    Without ``HAS_OUT`` the outputs are not read (zeros). ``CACHE``: the loads' cache
    modifier."""
    out = tl.zeros([ROWS, D_PAD], tl.float32)
    lse = tl.full([ROWS], float("-inf"), tl.float32)
    for slot in range(KSEL):
        chosen = tl.load(BLOCKS + selection + slot, mask=ok, other=-1) >= 0
        part_lse = tl.load(LSE_BUF + slot_base + slot, mask=chosen, other=float("-inf"), cache_modifier=CACHE)
        w_out, w_part, lse = merge_weights(lse, part_lse)
        if HAS_OUT:
            ptrs = O_BUF + (slot_base + slot)[:, None] * HEAD_DIM + d[None, :]
            part = tl.load(ptrs, mask=chosen[:, None] & d_ok[None, :], other=0.0, cache_modifier=CACHE)
            out = out * w_out[:, None] + part.to(tl.float32) * w_part[:, None]
    return out, lse


@triton.jit
def _delta_kernel(OUT, DOUT, DLSE, DELTA, N, H, S, D, ROWS: tl.constexpr, D_PAD: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``delta = rowsum(dO * O) - dLSE`` per row, fp32 ``[B, H, S]``: with it the softmax
    gradient of a row's scores is ``P * (dP - delta)``, its LSE gradient included."""
    r, ok, b, s, h, ptr, ok2 = _rows(tl.program_id(0), N, H, S, ROWS, D_PAD, D)
    o = tl.load(OUT + ptr, mask=ok2, other=0.0).to(tl.float32)
    delta = tl.sum(o * tl.load(DOUT + ptr, mask=ok2, other=0.0).to(tl.float32), 1)
    stat = (b * H + h) * S + s
    if HAS_DLSE:
        delta -= tl.load(DLSE + stat, mask=ok, other=0.0)
    tl.store(DELTA + stat, delta, mask=ok)


@triton.jit(do_not_specialize=["chunk"])
def _bwd_kernel(
    Q, K, V, DO, LSE, DELTA, ENTRIES, TILES, ITEMS, CHUNK_ITEMS, PARTIAL, DK_SUM, DV_SUM, DK_PART, DV_PART, DQ_BUF,
    chunk, CHUNK, S, HQ, HKV, HS, KSEL, N_KB, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, PRECISION: tl.constexpr, HAS_DQ: tl.constexpr,
    TEACHER=None, HAS_TEACHER: tl.constexpr = False, TOKENS: tl.constexpr = 16,
):  # fmt: skip
    """dK/dV of step ``program_id(1)`` of an item's block over its tiles, and with ``HAS_DQ``
    (the step is the whole block) the rows' dQ partials. Scores are transposed (keys x rows)
    as in ``block_bar.kernels._kv_grads``: P^T and dS^T then feed the dV and dK products as they are.
    With ``HAS_TEACHER``, also MSA's KL teacher for the step's keys (``_store_group_sums``)."""
    item, n_tiles, b, kvh, kb, first = _work_item(ITEMS, CHUNK_ITEMS, chunk, HKV, N_KB)
    if n_tiles > 0:
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        j = tl.program_id(1)
        k, v, cols, col_ok = _key_step(K, V, b, kvh, kb, j, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        q_row, ok, row_pos, stat, slot_row = _tile(TILES, ENTRIES, first, True, b, chunk, CHUNK, S, HQ, HS, KSEL, G,
                                                   BLOCK_M)  # fmt: skip
        for i in range(n_tiles):
            q, do, lse, delta = _grad_rows(Q, DO, LSE, DELTA, q_row, stat, ok, d, d_ok, HEAD_DIM)
            # As in the forward: the next tile's rows now, its data when its turn comes.
            n_row, n_ok, n_pos, n_stat, n_slot = _tile(TILES, ENTRIES, first + i + 1, i + 1 < n_tiles, b, chunk, CHUNK, S,
                                                       HQ, HS, KSEL, G, BLOCK_M)  # fmt: skip
            s = tl.dot(k, tl.trans(q), input_precision=PRECISION)
            s = tl.where(col_ok[:, None] & (cols[:, None] <= row_pos[None, :]), s, float("-inf"))
            dk, dv, ds, p = _transposed_grads(dk, dv, s, q, v, do, lse, delta, qk_scale, PRECISION)
            if HAS_TEACHER:
                _store_group_sums(TEACHER, p.to(q.dtype), TILES, ENTRIES, first + i, b, chunk, CHUNK, S, HS, KSEL, j,
                                  BLOCK, BLOCK_M, BLOCK_N, G, TOKENS, PRECISION)  # fmt: skip
            if HAS_DQ:
                dq = tl.dot(tl.trans(ds), k, input_precision=PRECISION) * sm_scale
                _store_rows(DQ_BUF, slot_row, ok, HEAD_DIM, d, d_ok, dq)
            q_row, ok, row_pos, stat, slot_row = n_row, n_ok, n_pos, n_stat, n_slot
        partial = tl.load(PARTIAL + item)
        _add_block_grad(dk * sm_scale, DK_SUM, DK_PART, partial, b, kvh, j, cols, col_ok, S, HKV, d, d_ok, HEAD_DIM,
                        BLOCK, BLOCK_N)  # fmt: skip
        _add_block_grad(
            dv, DV_SUM, DV_PART, partial, b, kvh, j, cols, col_ok, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N
        )


@triton.jit
def _store_group_sums(TEACHER, p, TILES, ENTRIES, tile, b, chunk, CHUNK, S, HS, KSEL, j, BLOCK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr,
                      PRECISION: tl.constexpr):  # fmt: skip
    """MSA's KL teacher, unnormalised: of a tile's probabilities ``p`` (keys x rows, the ``G``
    heads of each token adjacent, in q's dtype), each token's sum over its heads, stored fp32
    at keys ``j * BLOCK_N ..`` of its (token, selection head, slot) row of ``TEACHER
    [slot rows, BLOCK]`` (the slot rows of ``_tile`` with one head a row, as the KL kernels
    address them: ``msa_kl.kv_kernels``). The sum is a product with the 0/1 matrix of
    (row, token) membership, ``TOKENS`` columns (a power of two >= 16 and the tile's tokens),
    which takes any ``G``; P in q's dtype is what the dV product reads too."""
    _row, tok_ok, _pos, _stat, slot = _tile(TILES, ENTRIES, tile, True, b, chunk, CHUNK, S, HS, HS, KSEL, 1, TOKENS)
    member = tl.arange(0, BLOCK_M)[:, None] // G == tl.arange(0, TOKENS)[None, :]
    sums = tl.dot(p, member.to(p.dtype), input_precision=PRECISION)
    keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(TEACHER + slot[None, :] * BLOCK + keys[:, None], sums, mask=tok_ok[None, :])


@triton.jit
def _add_block_grad(x, X_SUM, X_PART, partial, b, kvh, j, cols, col_ok, S, HKV, d, d_ok, HEAD_DIM: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """A work item's gradient ``x`` of step ``j`` of its key block (KV head ``kvh``): added to
    the running fp32 sums ``X_SUM [B, S, HKV, HEAD_DIM]`` where the item is its group's only
    one in the chunk (``partial`` < 0: no other program adds to these rows), else stored in
    its partial buffer ``partial`` of ``X_PART`` for ``_reduce_kernel``."""
    if partial < 0:
        off = b * S * HKV * HEAD_DIM + kvh * HEAD_DIM
        x += _load_rows(X_SUM + off, cols, col_ok, HKV * HEAD_DIM, d, d_ok)
        _store_rows(X_SUM + off, cols, col_ok, HKV * HEAD_DIM, d, d_ok, x)
    else:
        keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_rows(X_PART + partial * BLOCK * HEAD_DIM, keys, col_ok, HEAD_DIM, d, d_ok, x)


@triton.jit(do_not_specialize=["chunk"])
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, ENTRIES, TILES, ITEMS, CHUNK_ITEMS, DQ_BUF, chunk, CHUNK, S, HQ, HKV, HS, KSEL, N_KB,
    qk_scale, sm_scale, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, G: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The rows' dQ partials over a block wider than the dK/dV kernel's step, ``BLOCK_N``
    keys a step."""
    _item, n_tiles, b, kvh, kb, first = _work_item(ITEMS, CHUNK_ITEMS, chunk, HKV, N_KB)
    if n_tiles > 0:
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_row, ok, row_pos, stat, slot_row = _tile(TILES, ENTRIES, first, True, b, chunk, CHUNK, S, HQ, HS, KSEL, G,
                                                   BLOCK_M)  # fmt: skip
        for i in range(n_tiles):
            q, do, lse, delta = _grad_rows(Q, DO, LSE, DELTA, q_row, stat, ok, d, d_ok, HEAD_DIM)
            # As in the forward: the next tile's rows now, its data when its turn comes.
            n_row, n_ok, n_pos, n_stat, n_slot = _tile(TILES, ENTRIES, first + i + 1, i + 1 < n_tiles, b, chunk, CHUNK, S,
                                                       HQ, HS, KSEL, G, BLOCK_M)  # fmt: skip
            dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            for j in range(BLOCK // BLOCK_N):
                k, v, cols, col_ok = _key_step(K, V, b, kvh, kb, j, S, HKV, d, d_ok, HEAD_DIM, BLOCK, BLOCK_N)
                dq = _dq_step(
                    dq, q, do, lse, delta, k, v, cols, col_ok, row_pos, row_pos, qk_scale, True, False, PRECISION
                )
            _store_rows(DQ_BUF, slot_row, ok, HEAD_DIM, d, d_ok, dq * sm_scale)
            q_row, ok, row_pos, stat, slot_row = n_row, n_ok, n_pos, n_stat, n_slot


@triton.jit(do_not_specialize=["chunk"])
def _reduce_kernel(SPLITS, CHUNK_SPLITS, DK_PART, DV_PART, DK_SUM, DV_SUM, chunk, S, HKV, N_KB,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                   HAS_DV: tl.constexpr = True):  # fmt: skip
    """Adds each of the chunk's split groups' dK/dV partials, in item order, to the running
    sums. A unit of work is ``ROWS`` keys of a group's block; the programs take the chunk's
    units with a stride of the grid, which is sized to the GPU rather than to the bound on a
    chunk's splits, whose surplus programs would mostly exit at once. One program adds each
    unit, so the sums do not depend on the grid. Without ``HAS_DV``, dK alone (``DV_PART``
    and ``DV_SUM`` are not read: MSA's KL, ``msa_kl.kv_kernels``)."""
    first_split = tl.load(CHUNK_SPLITS + chunk)
    units = (tl.load(CHUNK_SPLITS + chunk + 1) - first_split) * (BLOCK // ROWS)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    for unit in range(tl.program_id(0), units, tl.num_programs(0)):
        split = first_split + unit // (BLOCK // ROWS)
        group = tl.load(SPLITS + 3 * split)
        first = tl.load(SPLITS + 3 * split + 1)
        b = group // (HKV * N_KB)
        kvh = group // N_KB % HKV
        keys = unit % (BLOCK // ROWS) * ROWS + tl.arange(0, ROWS)
        cols = group % N_KB * BLOCK + keys
        ok = cols < S
        off = b * S * HKV * HEAD_DIM + kvh * HEAD_DIM
        dk = _load_rows(DK_SUM + off, cols, ok, HKV * HEAD_DIM, d, d_ok)
        if HAS_DV:
            dv = _load_rows(DV_SUM + off, cols, ok, HKV * HEAD_DIM, d, d_ok)
        for p in range(first, first + tl.load(SPLITS + 3 * split + 2)):
            dk += _load_rows(DK_PART + p * BLOCK * HEAD_DIM, keys, ok, HEAD_DIM, d, d_ok)
            if HAS_DV:
                dv += _load_rows(DV_PART + p * BLOCK * HEAD_DIM, keys, ok, HEAD_DIM, d, d_ok)
        _store_rows(DK_SUM + off, cols, ok, HKV * HEAD_DIM, d, d_ok, dk)
        if HAS_DV:
            _store_rows(DV_SUM + off, cols, ok, HKV * HEAD_DIM, d, d_ok, dv)


@triton.jit(do_not_specialize=["chunk"])
def _sum_slots_kernel(DQ_BUF, BLOCKS, DQ, chunk, CHUNK, N, S, HQ, HS, KSEL,
                      HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
                      STAT_BUF=None, STAT=None, HAS_STAT: tl.constexpr = False):  # fmt: skip
    """Each row's dQ: its selected slots' partials added in fp32 in slot order. With
    ``HAS_STAT``, likewise a per-slot scalar ``STAT_BUF`` (fp32, one per slot row) into
    ``STAT [B, HQ, S]`` (MSA's KL terms, ``msa_kl.kv_kernels``)."""
    r, ok, out_row, stat, selection, d, d_ok = _chunk_rows(chunk, CHUNK, N, S, HQ, HS, KSEL, HEAD_DIM, ROWS, D_PAD)
    dq = tl.zeros([ROWS, D_PAD], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for slot in range(KSEL):
        chosen = tl.load(BLOCKS + selection + slot, mask=ok, other=-1) >= 0
        dq += _load_rows(DQ_BUF, r * KSEL + slot, chosen, HEAD_DIM, d, d_ok).to(tl.float32)
        if HAS_STAT:
            total += tl.load(STAT_BUF + r * KSEL + slot, mask=chosen, other=0.0)
    _store_rows(DQ, out_row, ok, HEAD_DIM, d, d_ok, dq)
    if HAS_STAT:
        tl.store(STAT + stat, total, mask=ok)

"""Triton kernels for tile + bar ("block + bar") sparse attention, forward and backward.

A query block attends a list of whole ``BLOCK x BLOCK`` KV tiles and a list of
single key columns (bars), ``BLOCK_N`` keys per step. One online softmax spans
both; causal masking is applied inside. The bars' K/V rows come from per-head
contiguous copies (``KBAR`` / ``VBAR``, gathered once per call by the launcher), so
every K/V load in a loop has an address that follows from the loop counter and
the tile list, which Triton software-pipelines. This serves the vertical-slash index
(tiles from slash diagonals, bars from vertical columns) and dense attention
(all tiles up to the diagonal, no bars). The forward and ``_dq_kernel`` programs take
``BLOCK_M`` rows of a query block (``BLOCK_M`` divides ``BLOCK``).

Partial results over several key sets (context-parallel ring steps, the local column
pass) add up inside the kernels, with no pass of their own over the outputs: with
``ACCUMULATE`` the forward's epilogue merges its result with a running fp32 (out,
lse) of its rows and stores the merged one, and ``_dq_kernel`` adds its dQ to a running
fp32 sum. Each row has one writer, so this needs no atomics. Where the stores overwrite
the running buffers they read (``IN_PLACE``), a program whose query block has no tile and
no bar in the call touches none of its rows: at many ranks most of a ring step's query
blocks attend nothing of the chunk, and reading and writing their fp32 running rows was
most of the step's time.

Backward without atomics, so it is deterministic:
* ``_dq_kernel``: row-major like the forward.
* ``_bar_dkdv_kernel``: one program per (head, chunk of its vertical columns)
  walks the query rows after the chunk, ``BLOCK_M`` a step, and writes fp32
  ``[B, Hq, V, D]`` partial dK/dV for those columns.
* ``_tile_dkdv_kernel``: KV-major, one program per (``BLOCK_N`` keys of a KV block,
  KV head), which first gathers the GQA group's bar partials for its keys, then walks
  the query blocks that read the block, ``BLOCK_M`` rows a step, for each query head of
  the group. Each dK/dV row has exactly one writer.
That is 7 matmuls per attended (row, key) pair, the dQ kernel recomputing QK^T and dP.
A fused backward adding dQ with atomics from the dK/dV kernels (5 matmuls) ran slower:
the atomic adds cost more than the matmuls they save (docs/benchmarks.md, "Backward: the
atomic-dQ variant measured and dropped").
All statistics are fp32; exponentials are base 2 with the scale folded in.

Loads use local row and column indices; causality compares global positions,
which are the indices themselves on one device. When the rows are a
context-parallel rank's tokens (``HAS_QPOS``) or the keys another rank's chunk
(``HAS_KPOS``), they are whole global blocks: ``QBLK`` / ``KBLK`` hold the global block
id of each local block (ascending for the rows), so a step's positions cost one scalar
load. Keys that are the whole sequence (all-gathered K/V) are their own positions, and
key positions cost: given anyway, the forward ran slower (``scripts/bench_ring_pieces.py``;
docs/benchmarks.md, "Context parallelism over all-gathered K/V"). Not the load waiting on the tile
entry's: a table of the entries' global ids, read beside them, measured the same.
Gathered vertical columns carry their positions in ``BAR_POS``.

Packed documents (``HAS_DOCS``): a row sees no key before its document's start,
``DOC_START[row position]`` (one load per row, a compare per score). The tables list no
tile wholly before the document start of a query block's first row, so only the tiles
that cross a row's start pay the compare where the kernels skip masking: the dQ kernel
masks a step whose first key precedes its rows' latest start (the last row's: starts
ascend), the tile dK/dV kernel a step whose last row lies past its first key's document
end (``DOC_END``). Bars start at ``BAR_START``
(the block's columns before that start), look up the diagonals of the block's first
row's document (``ACT_OFF``), and a column chunk's dK/dV computes only the row steps that
some column's document reaches (``DOC_END``), each finding the next.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..shared.combine import merge_weights
from ..shared.kernels import _dq_step, _load_rows, _online_step, _store_rows, _transposed_grads


@triton.jit
def _global_block(BLK, blk, HAS_POS: tl.constexpr):
    """Global block id of local block ``blk``: itself on one device, else ``BLK[blk]``."""
    g = blk
    if HAS_POS:
        g = tl.load(BLK + blk)
    return g


@triton.jit
def _positions(BLK, blk, idx, HAS_POS: tl.constexpr, BLOCK: tl.constexpr):
    """Global positions of local indices ``idx``, all in local block ``blk``: the indices
    themselves on one device, else offsets in the block's global block."""
    pos = idx
    if HAS_POS:
        pos = _global_block(BLK, blk, HAS_POS) * BLOCK + (idx - blk * BLOCK)
    return pos


@triton.jit
def _first_reader(QBLK, n_qb, col_pos, BLOCK: tl.constexpr):
    """The first of ``n_qb`` ascending global blocks ``QBLK`` holding a row at or after
    position ``col_pos`` (``n_qb`` if none), by binary search: the rows before it see
    none of a column there."""
    lo = tl.zeros([], tl.int32)
    hi = lo + n_qb
    target = col_pos // BLOCK
    while lo < hi:
        mid = (lo + hi) // 2
        before = tl.load(QBLK + mid) < target
        lo = tl.where(before, mid + 1, lo)
        hi = tl.where(before, hi, mid)
    return lo


@triton.jit
def _diagonal_tiles(ENTRY, n_tiles, BLK, own, HAS_POS: tl.constexpr, HAS_ROWSEL: tl.constexpr):
    """How many of a block's ``n_tiles`` listed tiles need the causal mask: the one whose
    other block is the block's own (global id ``own``), where ``ENTRY`` points at the list
    entry that can be it (the last key block of a query block's ascending list, the first
    query block of a key block's); every other listed tile lies wholly before the
    diagonal (lists are causal), so its rows see all its keys. A ragged last block (one
    device, a length not a multiple of the block) is read only as a diagonal tile. Top-k
    tables filter every tile by row, so all of theirs are masked."""
    n = n_tiles
    if not HAS_ROWSEL:
        listed = n_tiles > 0
        entry = tl.load(ENTRY, mask=listed, other=0)
        n = (listed & (_global_block(BLK, entry, HAS_POS) == own)).to(tl.int32)
    return n


@triton.jit
def _in_tile(ACTIVE, bh, N_ACTIVE, act_off, q_block, col_pos, col_ok, BLOCK: tl.constexpr):
    """Columns inside an attended tile of global query block ``q_block``, which the tiles
    already cover and the bars must skip (``act_off``: where the diagonals of the block's
    document start in a head's row of ``ACTIVE``; 0 without documents)."""
    diag = q_block - col_pos // BLOCK
    return tl.load(ACTIVE + bh * N_ACTIVE + act_off + diag, mask=col_ok & (diag >= 0), other=0) != 0


@triton.jit
def _block_step(BLOCKS, trow, T_MAX, j, POS, N, BLOCK: tl.constexpr, STEP: tl.constexpr, HAS_POS: tl.constexpr):
    """Step ``j`` through list ``trow`` of ``BLOCKS``, ``STEP`` indices a step (``BLOCK // STEP``
    steps a block): (the block, the step's indices, their in-range mask, their positions).
    Steps of part of a block keep each software-pipeline stage small, so more stages fit
    in shared memory."""
    blk = tl.load(BLOCKS + trow * T_MAX + j // (BLOCK // STEP))
    idx = blk * BLOCK + (j % (BLOCK // STEP)) * STEP + tl.arange(0, STEP)
    return blk, idx, idx < N, _positions(POS, blk, idx, HAS_POS, BLOCK)


@triton.jit
def _step_start(POS, blk, j, BLOCK: tl.constexpr, STEP: tl.constexpr, HAS_POS: tl.constexpr):
    """The first position of step ``j`` of block ``blk`` (``_block_step``'s indices), a scalar:
    the least of the step's ascending positions, without a reduction over them."""
    return _positions(POS, blk, blk * BLOCK + (j % (BLOCK // STEP)) * STEP, HAS_POS, BLOCK)


@triton.jit
def _tile_keys(TILES, trow, T_MAX, j, KBLK, SK, K_base, V_base, kv_stride, d, d_ok,
               BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_POS: tl.constexpr):  # fmt: skip
    """Step ``j`` of the row-major kernels' tile loop: (KV block, k, v, key positions, key
    mask) for ``BLOCK_N`` keys of the ``j // (BLOCK // BLOCK_N)``-th listed tile."""
    kb, cols, col_ok, col_pos = _block_step(TILES, trow, T_MAX, j, KBLK, SK, BLOCK, BLOCK_N, HAS_POS)
    k = _load_rows(K_base, cols, col_ok, kv_stride, d, d_ok)
    v = _load_rows(V_base, cols, col_ok, kv_stride, d, d_ok)
    return kb, k, v, col_pos, col_ok


@triton.jit
def _bar_keys(KBAR, VBAR, BAR_POS, ACTIVE, bh, c0, n_bars, V_MAX, N_ACTIVE, q_block, act_off, first_start, d, d_ok,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    """Entries ``c0 .. c0 + BLOCK_N`` of the first ``n_bars`` of head ``bh``'s gathered
    vertical columns: (k, v, positions, attended mask). The K/V loads are masked by the
    count alone, so they need not wait for the position and tile lookups. With documents
    the tile lookup reads only columns from ``first_start`` on (the document start of the
    block's first row: no row sees an earlier one), which the diagonals at ``act_off``
    cover."""
    offs = c0 + tl.arange(0, BLOCK_N)
    ok = offs < n_bars
    entries = bh * V_MAX + offs
    k = _load_rows(KBAR, entries, ok, HEAD_DIM, d, d_ok)
    v = _load_rows(VBAR, entries, ok, HEAD_DIM, d, d_ok)
    pos = tl.load(BAR_POS + entries, mask=ok, other=0)
    look = ok
    if HAS_DOCS:
        look = ok & (pos >= first_start)
    return k, v, pos, ok & ~_in_tile(ACTIVE, bh, N_ACTIVE, act_off, q_block, pos, look, BLOCK)


@triton.jit
def _row_starts(DOC_START, row_pos, row_ok, HAS_DOCS: tl.constexpr):
    """The document start of each row (``HAS_DOCS``; the rows' positions otherwise, unused)."""
    first = row_pos
    if HAS_DOCS:
        first = tl.load(DOC_START + row_pos, mask=row_ok, other=0)
    return first


@triton.jit
def _start_at(DOC_START, QBLK, qb, row, HAS_QPOS: tl.constexpr, BLOCK: tl.constexpr):
    """The document start of local row ``row`` of block ``qb``, a scalar load. Starts ascend
    with the position, so a program's first row has its rows' earliest start and its last
    row their latest: no reduction over the rows (whose shared-memory barriers sat between
    the starts' gather and the first q / dO loads on sm90)."""
    return tl.load(DOC_START + _positions(QBLK, qb, row, HAS_QPOS, BLOCK))


@triton.jit
def _bar_range(BAR_START, BAR_CNT, ACT_OFF, QBLK, DOC_START, bh, NQB, qb, first_row, HAS_QPOS: tl.constexpr,
               HAS_BARS: tl.constexpr, HAS_DOCS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """(first bar entry, bar count, offset of the block's diagonals in ``ACTIVE``, the
    document start of the program's first local row ``first_row``) of query block ``qb``
    (zeros without bars): scalars, read before the tile loop so that nothing waits on
    them after it."""
    n_bars = tl.zeros([], tl.int32)
    c_start = n_bars
    act_off = n_bars
    first_start = n_bars
    if HAS_BARS:
        n_bars = tl.load(BAR_CNT + bh * NQB + qb)
        if HAS_DOCS:
            c_start = tl.load(BAR_START + bh * NQB + qb)
            act_off = tl.load(ACT_OFF + qb)
            first_start = _start_at(DOC_START, QBLK, qb, first_row, HAS_QPOS, BLOCK)
    return c_start, n_bars, act_off, first_start


@triton.jit
def _program_rows(BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S, H, HKV):
    """Indices shared by the row-major kernels, whose programs take ``BLOCK_M`` rows of
    query block ``qb`` (``BLOCK_M`` divides ``BLOCK``): (qb, b, h, kv head, rows, row
    mask, d, d mask)."""
    sub = _program_sub(BLOCK_M)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = sub * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    return sub // (BLOCK // BLOCK_M), b, h, h // (H // HKV), rows, rows < S, d, d < HEAD_DIM


@triton.jit
def _program_sub(BLOCK_M: tl.constexpr):
    """Which ``BLOCK_M`` rows a row-major program takes."""
    # Later query blocks read more bars: launching them first shortens the tail.
    return tl.num_programs(0) - 1 - tl.program_id(0)


@triton.jit
def _program_row_span(BLOCK_M: tl.constexpr, S):
    """(first, last) local row of a row-major program (``_program_rows``), scalars."""
    first = _program_sub(BLOCK_M) * BLOCK_M
    return first, tl.minimum(first + BLOCK_M, S) - 1


@triton.jit
def _table_row(b, h, H, TB, TH, N_BLOCKS, block):
    """(row of the tile tables for this batch, head and block; the head's head in the tables)."""
    th = h // (H // TH)
    return ((b % TB) * TH + th) * N_BLOCKS + block, th


@triton.jit
def _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD: tl.constexpr, HAS_ROWSEL: tl.constexpr):
    """Each row's selected index blocks ``[BLOCK, K_PAD]`` (-1 padded) for top-k tables;
    the rows themselves otherwise (``_tile_rows`` ignores them)."""
    sel = rows
    if HAS_ROWSEL:
        kk = tl.arange(0, K_PAD)
        ptrs = ROWSEL + ((b * TH + th) * S + rows[:, None]) * K_SEL + kk[None, :]
        sel = tl.load(ptrs, mask=row_ok[:, None] & (kk < K_SEL)[None, :], other=-1)
    return sel


@triton.jit
def _tile_rows(row_pos, sel, KBLK, kb, BLOCK: tl.constexpr, RATIO, HAS_ROWSEL: tl.constexpr, HAS_POS: tl.constexpr):
    """Row positions for tile ``kb``; -1 (sees nothing) on rows that did not select its
    index block (top-k tables). Selections hold global block ids."""
    out = row_pos
    if HAS_ROWSEL:
        global_tile = _global_block(KBLK, kb, HAS_POS)
        out = tl.where(tl.max((sel == global_tile // RATIO).to(tl.int32), 1) > 0, row_pos, -1)
    return out


@triton.jit
def _tile_split(TILES, TILE_CNT, trow, T_MAX, KBLK, own, BLOCK: tl.constexpr, STEP: tl.constexpr,
                HAS_POS: tl.constexpr, HAS_ROWSEL: tl.constexpr):  # fmt: skip
    """(the first step of a query block's masked tile, its tile steps), ``STEP`` keys a
    step: the diagonal tile is last in its ascending list. Steps before the first masked
    one skip the mask by a branch inside the one tile loop: a loop of their own would
    drain the software pipeline's prefetched loads before the masked tile (two loops ran
    4-7% slower on an H100)."""
    n_tiles = tl.load(TILE_CNT + trow)
    n_masked = _diagonal_tiles(TILES + trow * T_MAX + n_tiles - 1, n_tiles, KBLK, own, HAS_POS, HAS_ROWSEL)
    return (n_tiles - n_masked) * (BLOCK // STEP), n_tiles * (BLOCK // STEP)


@triton.jit
def _rows_with_work(row_ok, TILE_CNT, trow, c_start, n_bars, HAS_BARS: tl.constexpr, IN_PLACE: tl.constexpr):
    """The rows a program reads and stores: all of ``row_ok``, or ``IN_PLACE`` none where
    its query block has no tile and no bar (its running rows already hold the result)."""
    if IN_PLACE:
        busy = tl.load(TILE_CNT + trow) > 0
        if HAS_BARS:
            busy = busy | (n_bars > c_start)
        return row_ok & busy
    return row_ok


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["T_MAX", "V_MAX", "N_ACTIVE"])
def _fwd_kernel(
    Q, K, V, O, LSE, O_RUN, LSE_RUN, TILES, TILE_CNT, KBAR, VBAR, BAR_POS, BAR_CNT, BAR_START, ACTIVE, ACT_OFF,
    ROWSEL, QBLK, KBLK, DOC_START,
    S, SK, H, HKV, TB, TH, NQB, T_MAX, V_MAX, N_ACTIVE, K_SEL, RATIO, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_BARS: tl.constexpr, HAS_ROWSEL: tl.constexpr, K_PAD: tl.constexpr,
    HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr, IN_PLACE: tl.constexpr,
):  # fmt: skip
    """Output and LSE of the rows over their listed keys; with ``ACCUMULATE``, over those
    keys and the keys of the running fp32 result ``O_RUN`` / ``LSE_RUN`` of the same rows
    (``O`` / ``LSE`` may be those very buffers, ``IN_PLACE``: each row is read and written
    by its own program only)."""
    qb, b, h, kvh, rows, row_ok, d, d_ok = _program_rows(BLOCK, BLOCK_M, HEAD_DIM, D_PAD, S, H, HKV)
    row_pos = _positions(QBLK, qb, rows, HAS_QPOS, BLOCK)
    row_first = _row_starts(DOC_START, row_pos, row_ok, HAS_DOCS)
    q_stride = H * HEAD_DIM
    kv_stride = HKV * HEAD_DIM
    q_off = b * S * q_stride + h * HEAD_DIM
    K_base = K + b * SK * kv_stride + kvh * HEAD_DIM
    V_base = V + b * SK * kv_stride + kvh * HEAD_DIM
    stat_off = (b * H + h) * S + rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bh = b * H + h
    first_row, _ = _program_row_span(BLOCK_M, S)
    own = _global_block(QBLK, qb, HAS_QPOS)
    c_start, n_bars, act_off, first_start = _bar_range(
        BAR_START, BAR_CNT, ACT_OFF, QBLK, DOC_START, bh, NQB, qb, first_row, HAS_QPOS, HAS_BARS, HAS_DOCS, BLOCK
    )
    trow, th = _table_row(b, h, H, TB, TH, NQB, qb)
    io_ok = _rows_with_work(row_ok, TILE_CNT, trow, c_start, n_bars, HAS_BARS, IN_PLACE)
    q = _load_rows(Q + q_off, rows, io_ok, q_stride, d, d_ok)
    sel = _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD, HAS_ROWSEL)
    # Every tile masked: a branch skipping the mask off the diagonal makes ptxas serialise
    # the forward's matrix products on sm90 (the accumulator of QK^T is then defined by
    # the branch), and a loop of its own for the diagonal tile ran 4% slower on an H100.
    for j in range(tl.load(TILE_CNT + trow) * (BLOCK // BLOCK_N)):
        kb, k, v, col_pos, col_ok = _tile_keys(
            TILES, trow, T_MAX, j, KBLK, SK, K_base, V_base, kv_stride, d, d_ok, BLOCK, BLOCK_N, HAS_KPOS
        )
        acc, m_i, l_i = _online_step(
            acc, m_i, l_i, q, k, v, col_pos, col_ok, _tile_rows(row_pos, sel, KBLK, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_KPOS),
            row_first, qk_scale, True, HAS_DOCS, PRECISION,
        )  # fmt: skip
    if HAS_BARS:
        for c0 in range(c_start, n_bars, BLOCK_N):
            k, v, col_pos, col_ok = _bar_keys(
                KBAR, VBAR, BAR_POS, ACTIVE, bh, c0, n_bars, V_MAX, N_ACTIVE, own, act_off, first_start, d, d_ok,
                HEAD_DIM, BLOCK, BLOCK_N, HAS_DOCS,
            )  # fmt: skip
            acc, m_i, l_i = _online_step(
                acc, m_i, l_i, q, k, v, col_pos, col_ok, row_pos, row_first, qk_scale, True, HAS_DOCS, PRECISION
            )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    if ACCUMULATE:  # merged after the loop, so the loop compiles as for a fresh result
        run_lse = tl.load(LSE_RUN + stat_off, mask=io_ok, other=float("-inf"))
        w_new, w_run, lse = merge_weights(lse, run_lse)
        run_out = _load_rows(O_RUN + q_off, rows, io_ok, q_stride, d, d_ok)
        out = out * w_new[:, None] + run_out * w_run[:, None]
    _store_rows(O + q_off, rows, io_ok, q_stride, d, d_ok, out)
    tl.store(LSE + stat_off, lse, mask=io_ok)


@triton.jit
def _load_row_stats(LSE, DELTA, b, h, H, S, rows, row_ok):
    """log2-domain LSE (0 on empty rows, whose logits are all -inf) and delta."""
    lse = tl.load(LSE + (b * H + h) * S + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + (b * H + h) * S + rows, mask=row_ok, other=0.0)
    return lse, delta


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["T_MAX", "V_MAX", "N_ACTIVE"])
def _dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, DELTA, DQ, DQ_RUN, TILES, TILE_CNT, KBAR, VBAR, BAR_POS, BAR_CNT, BAR_START, ACTIVE,
    ACT_OFF, ROWSEL, QBLK, KBLK, DOC_START, S, SK, H, HKV, TB, TH, NQB, T_MAX, V_MAX, N_ACTIVE, K_SEL, RATIO,
    qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_BARS: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_ROWSEL: tl.constexpr,
    K_PAD: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, IN_PLACE: tl.constexpr,
):  # fmt: skip
    """dQ (with ``ACCUMULATE``, added to the fp32 running sum ``DQ_RUN``, which ``DQ`` may
    be, ``IN_PLACE``), and ``delta = rowsum(dO * O) - dLSE`` stored for the dK/dV kernels
    (computed here, where dO is loaded anyway, instead of in fp32 copies of dO and O; for
    every row, whether its block has work or not)."""
    qb, b, h, kvh, rows, row_ok, d, d_ok = _program_rows(BLOCK, BLOCK_M, HEAD_DIM, D_PAD, S, H, HKV)
    row_pos = _positions(QBLK, qb, rows, HAS_QPOS, BLOCK)
    row_first = _row_starts(DOC_START, row_pos, row_ok, HAS_DOCS)
    q_stride = H * HEAD_DIM
    kv_stride = HKV * HEAD_DIM
    q_off = b * S * q_stride + h * HEAD_DIM
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

    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bh = b * H + h
    first_row, last_row = _program_row_span(BLOCK_M, S)
    own = _global_block(QBLK, qb, HAS_QPOS)
    c_start, n_bars, act_off, first_start = _bar_range(
        BAR_START, BAR_CNT, ACT_OFF, QBLK, DOC_START, bh, NQB, qb, first_row, HAS_QPOS, HAS_BARS, HAS_DOCS, BLOCK
    )
    last_start = 0
    if HAS_DOCS:
        last_start = _start_at(DOC_START, QBLK, qb, last_row, HAS_QPOS, BLOCK)  # the rows' latest
    trow, th = _table_row(b, h, H, TB, TH, NQB, qb)
    io_ok = _rows_with_work(row_ok, TILE_CNT, trow, c_start, n_bars, HAS_BARS, IN_PLACE)
    q = _load_rows(Q + q_off, rows, io_ok, q_stride, d, d_ok)
    sel = _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD, HAS_ROWSEL)
    split, n_steps = _tile_split(TILES, TILE_CNT, trow, T_MAX, KBLK, own, BLOCK, BLOCK_N, HAS_KPOS, HAS_ROWSEL)
    for j in range(n_steps):
        kb, k, v, col_pos, col_ok = _tile_keys(
            TILES, trow, T_MAX, j, KBLK, SK, K_base, V_base, kv_stride, d, d_ok, BLOCK, BLOCK_N, HAS_KPOS
        )
        masked = j >= split
        if HAS_DOCS:  # a step whose first key precedes a row's document start
            masked = masked | (_step_start(KBLK, kb, j, BLOCK, BLOCK_N, HAS_KPOS) < last_start)
        dq = _dq_step(
            dq, q, do, lse, delta, k, v, col_pos, col_ok,
            _tile_rows(row_pos, sel, KBLK, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_KPOS), row_first, qk_scale, masked,
            HAS_DOCS, PRECISION,
        )  # fmt: skip
    if HAS_BARS:
        for c0 in range(c_start, n_bars, BLOCK_N):
            k, v, col_pos, col_ok = _bar_keys(
                KBAR, VBAR, BAR_POS, ACTIVE, bh, c0, n_bars, V_MAX, N_ACTIVE, own, act_off, first_start, d, d_ok,
                HEAD_DIM, BLOCK, BLOCK_N, HAS_DOCS,
            )  # fmt: skip
            dq = _dq_step(
                dq, q, do, lse, delta, k, v, col_pos, col_ok, row_pos, row_first, qk_scale, True, HAS_DOCS, PRECISION
            )
    dq *= sm_scale
    if ACCUMULATE:  # read after the loop, so the running sum takes no registers during it
        dq += _load_rows(DQ_RUN + q_off, rows, io_ok, q_stride, d, d_ok)
    _store_rows(DQ + q_off, rows, io_ok, q_stride, d, d_ok, dq)


@triton.jit
def _kv_grads(
    dk, dv, k, v, col_pos, col_ok, Q_base, DO_base, LSE, DELTA, b, h, H, S, rows, row_pos, q_stride, d, d_ok,
    qk_scale, extra_mask, masked, PRECISION: tl.constexpr,
):  # fmt: skip
    """Adds a step of query rows' contribution to the dK/dV of a set of key rows. It works
    on transposed scores (keys x rows): P^T and dS^T then leave the matrix unit in the
    register arrangement that the dV and dK products take, with no round trip through
    shared memory.
    Unmasked steps need no row mask either: a row past ``S`` loads zero q, dO and
    statistics, so it adds exact zeros."""
    row_ok = rows < S
    q = _load_rows(Q_base, rows, row_ok, q_stride, d, d_ok)
    do = _load_rows(DO_base, rows, row_ok, q_stride, d, d_ok)
    lse, delta = _load_row_stats(LSE, DELTA, b, h, H, S, rows, row_ok)
    s = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    if masked:
        visible = extra_mask & col_ok[:, None] & row_ok[None, :] & (col_pos[:, None] <= row_pos[None, :])
        s = tl.where(visible, s, float("-inf"))
    dk, dv, _, _ = _transposed_grads(dk, dv, s, q, v, do, lse, delta, qk_scale, PRECISION)
    return dk, dv


@triton.jit
def _step_position(QBLK, NQB, r0, HAS_QPOS: tl.constexpr, BLOCK: tl.constexpr):
    """Global position of local row ``r0`` (a step's first row; ``BLOCK_M`` divides
    ``BLOCK``, so a step's rows are contiguous there too); past every position when ``r0``
    is past the ``NQB`` local blocks."""
    if HAS_QPOS:
        blk = r0 // BLOCK
        inside = blk < NQB
        g = tl.load(QBLK + blk, mask=inside, other=0)
        return tl.where(inside, g * BLOCK + r0 % BLOCK, 2147483647)
    return r0


@triton.jit
def _local_step(QBLK, NQB, pos, HAS_QPOS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """The first local ``BLOCK_M``-row step holding global position ``pos`` or a later one
    (the local rows ascend in position): on one device the step of ``pos`` itself; on a
    context-parallel rank, in the first of its blocks at or after ``pos``'s block."""
    if HAS_QPOS:
        blk = _first_reader(QBLK, NQB, pos, BLOCK)
        g = tl.load(QBLK + blk, mask=blk < NQB, other=-1)
        return blk * BLOCK + tl.where(g == pos // BLOCK, pos % BLOCK // BLOCK_M * BLOCK_M, 0)
    return pos // BLOCK_M * BLOCK_M


@triton.jit
def _next_seen_position(col_pos, col_end, after):
    """The first global position at or after ``after`` that some column sees, a column
    ``c`` seeing the rows from its position to its document's end ``col_end`` (exclusive;
    0 for no column); past every end when none does."""
    return tl.min(tl.where(col_end > after, tl.maximum(col_pos, after), 2147483647), 0)


@triton.jit
def _bar_step_rows(col_pos, col_ok, ACTIVE, ACT_OFF, QBLK, DOC_START, N_ACTIVE, bh, r0,
                   BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    """(rows, their positions, which columns lie in an attended tile of their query block)
    of ``_bar_dkdv_kernel``'s step of rows ``r0 .. r0 + BLOCK_M`` (local, one query block)."""
    rows = r0 + tl.arange(0, BLOCK_M)
    row_pos = _positions(QBLK, r0 // BLOCK, rows, HAS_QPOS, BLOCK)
    act_off = r0 * 0
    look = col_ok
    if HAS_DOCS:  # the diagonals of the document of the block's first row (see _bar_keys)
        act_off = tl.load(ACT_OFF + r0 // BLOCK)
        block_start = _global_block(QBLK, r0 // BLOCK, HAS_QPOS) * BLOCK
        look = col_ok & (col_pos >= tl.load(DOC_START + block_start))
    in_tile = _in_tile(ACTIVE, bh, N_ACTIVE, act_off, tl.max(row_pos, 0) // BLOCK, col_pos, look, BLOCK)
    return rows, row_pos, in_tile


@triton.jit
def _bar_step(
    dk, dv, k, v, col_pos, col_ok, Q, DO, LSE, DELTA, DOC_START, b, h, H, S, rows, row_pos, in_tile, q_off, q_stride,
    d, d_ok, qk_scale, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``_bar_dkdv_kernel``'s products for a step's ``rows`` (``_bar_step_rows``)."""
    seen = (~in_tile)[:, None]
    if HAS_DOCS:
        row_first = tl.load(DOC_START + row_pos, mask=rows < S, other=0)
        seen = seen & (col_pos[:, None] >= row_first[None, :])
    return _kv_grads(
        dk, dv, k, v, col_pos, col_ok, Q + q_off, DO + q_off, LSE, DELTA, b, h, H, S, rows, row_pos, q_stride, d,
        d_ok, qk_scale, seen, True, PRECISION,
    )  # fmt: skip


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["V_MAX", "N_ACTIVE"])
def _bar_dkdv_kernel(
    Q, DO, LSE, DELTA, KBAR, VBAR, BAR_POS, ACTIVE, ACT_OFF, BAR_DK, BAR_DV, QBLK, DOC_START, DOC_END,
    S, H, NQB, N_ACTIVE, V_MAX, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``BLOCK_N`` of a head's vertical columns against ``BLOCK_M`` query rows a step
    (``BLOCK_M`` divides ``BLOCK``, so a step's rows lie in one query block). The partials
    are left unscaled, as the tile kernel's sums are until it folds them in."""
    bh = tl.program_id(0)
    # The grid's second axis: every head's earliest columns, which the most rows see, start first.
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = bh // H
    h = bh % H
    entries = bh * V_MAX + offs
    col_pos = tl.load(BAR_POS + entries, mask=offs < V_MAX, other=-1)
    col_ok = col_pos >= 0
    if tl.max(col_pos, 0) >= 0:
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_stride = H * HEAD_DIM
        k = _load_rows(KBAR, entries, col_ok, HEAD_DIM, d, d_ok)
        v = _load_rows(VBAR, entries, col_ok, HEAD_DIM, d, d_ok)
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        q_off = b * S * q_stride + h * HEAD_DIM
        # Rows before the chunk's first column see none of it: start at the first that can.
        first_col = tl.min(tl.where(col_ok, col_pos, 2147483647), 0)
        first = first_col // BLOCK_M * BLOCK_M
        if HAS_QPOS:
            first = _first_reader(QBLK, NQB, first_col, BLOCK) * BLOCK
        stop = S
        col_end = col_pos
        walk: tl.constexpr = HAS_DOCS
        if walk:  # rows after the document of the chunk's last column see none of it
            stop = tl.load(DOC_END + tl.max(col_pos, 0))
            if HAS_QPOS:  # the rank's rows up to the step holding that document's last row
                stop = tl.minimum(_local_step(QBLK, NQB, stop - 1, HAS_QPOS, BLOCK, BLOCK_M) + BLOCK_M, S)
            col_end = tl.load(DOC_END + col_pos, mask=col_ok, other=0)
        seen_step = first
        for r0 in range(first, stop, BLOCK_M):
            live = True
            if walk:
                # A chunk of the ascending list can hold several documents' columns, and a row
                # sees a column only inside the column's document: each computed step finds
                # the next that some column's document reaches, and the steps before it cost
                # a compare (a reduction each cost more than the chunk's products). One flat
                # loop: a walk per document, a loop of data-dependent bounds inside this one,
                # gave wrong dK on CUDA while Triton's interpreter agreed with fp64; a while
                # loop jumping between computed steps made ptxas cap sm80 at 128 registers
                # and spill 1.5 KB.
                live = r0 == seen_step
            if live:
                rows, row_pos, in_tile = _bar_step_rows(
                    col_pos, col_ok, ACTIVE, ACT_OFF, QBLK, DOC_START, N_ACTIVE, bh, r0, BLOCK, BLOCK_M, HAS_QPOS,
                    HAS_DOCS,
                )  # fmt: skip
                if walk:
                    # Short documents with flat statistics keep most columns and diagonals:
                    # most steps then see their columns only inside attended tiles, which
                    # give those pairs already; such a step adds nothing and is skipped.
                    g0 = _step_position(QBLK, NQB, r0, HAS_QPOS, BLOCK)
                    reached = (col_pos < g0 + BLOCK_M) & (col_end > g0)
                    live = tl.max((reached & ~in_tile).to(tl.int32), 0) > 0
                if live:
                    dk, dv = _bar_step(
                        dk, dv, k, v, col_pos, col_ok, Q, DO, LSE, DELTA, DOC_START, b, h, H, S, rows, row_pos,
                        in_tile, q_off, q_stride, d, d_ok, qk_scale, HAS_DOCS, PRECISION,
                    )  # fmt: skip
                if walk:
                    after = _step_position(QBLK, NQB, r0 + BLOCK_M, HAS_QPOS, BLOCK)
                    seen = _next_seen_position(col_pos, col_end, after)
                    seen_step = _local_step(QBLK, NQB, seen, HAS_QPOS, BLOCK, BLOCK_M)
        out = entries[:, None] * D_PAD + d[None, :]
        ok = (offs < V_MAX)[:, None] & d_ok[None, :]
        tl.store(BAR_DK + out, dk, mask=ok)
        tl.store(BAR_DV + out, dv, mask=ok)


@triton.jit
def _fold_bars(
    dk, dv, BAR_DK, BAR_DV, VERT, VPTR, bh, kb, cols, NKB, V_MAX, d, D_PAD: tl.constexpr, FOLD: tl.constexpr
):
    """Adds head ``bh``'s bar partials of the vertical columns among key rows ``cols``
    (inside KV block ``kb``), ``FOLD`` listed columns at a time: each key row gathers its
    column's partial, if it is one, with a masked load, an exact fp32 sum. The tile kernel
    does this before its products: on sm90, instructions that write the accumulators
    between the asynchronous matrix products (as a one-hot matmul folding the partials
    in after them did) make ptxas serialise every product of the kernel."""
    start = tl.load(VPTR + bh * (NKB + 1) + kb)
    stop = tl.load(VPTR + bh * (NKB + 1) + kb + 1)
    for c0 in range(start, stop, FOLD):
        offs = c0 + tl.arange(0, FOLD)
        pos = tl.load(VERT + bh * V_MAX + offs, mask=offs < stop, other=-1)
        entry = tl.max(tl.where(cols[:, None] == pos[None, :], offs[None, :], -1), 1)
        rows = (bh * V_MAX + entry)[:, None] * D_PAD + d[None, :]
        dk += tl.load(BAR_DK + rows, mask=(entry >= 0)[:, None], other=0.0)
        dv += tl.load(BAR_DV + rows, mask=(entry >= 0)[:, None], other=0.0)
    return dk, dv


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["T_MAX", "V_MAX"])
def _tile_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, TILES_T, TILE_T_CNT, BAR_DK, BAR_DV, VERT, VPTR, ROWSEL, QBLK, KBLK, DOC_START,
    DOC_END, S, SK, H, HKV, TB, TH, NKB, T_MAX, V_MAX, K_SEL, RATIO, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_BARS: tl.constexpr, HAS_ROWSEL: tl.constexpr, K_PAD: tl.constexpr,
    HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
    FOLD: tl.constexpr,
):  # fmt: skip
    """``BLOCK_N`` key rows of KV block ``kb`` against ``BLOCK_M`` rows of a reading query
    block a step."""
    sub = tl.program_id(0)
    kb = sub // (BLOCK // BLOCK_N)
    first = sub * BLOCK_N
    bkv = tl.program_id(1)
    b = bkv // HKV
    kvh = bkv % HKV
    group = H // HKV
    cols = first + tl.arange(0, BLOCK_N)
    col_ok = cols < SK
    col_pos = _positions(KBLK, kb, cols, HAS_KPOS, BLOCK)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_stride = H * HEAD_DIM
    kv_stride = HKV * HEAD_DIM
    kv_off = b * SK * kv_stride + kvh * HEAD_DIM
    k = _load_rows(K + kv_off, cols, col_ok, kv_stride, d, d_ok)
    v = _load_rows(V + kv_off, cols, col_ok, kv_stride, d, d_ok)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    if HAS_BARS:
        for g in range(group):
            bh = b * H + kvh * group + g
            dk, dv = _fold_bars(dk, dv, BAR_DK, BAR_DV, VERT, VPTR, bh, kb, cols, NKB, V_MAX, d, D_PAD, FOLD)
    own = _global_block(KBLK, kb, HAS_KPOS)
    if HAS_DOCS:
        # Rows from the end of the first key's document on start after that key.
        first_key_end = tl.load(DOC_END + _step_start(KBLK, kb, sub, BLOCK, BLOCK_N, HAS_KPOS))
    for g in range(group):
        h = kvh * group + g
        q_off = b * S * q_stride + h * HEAD_DIM
        trow, th = _table_row(b, h, H, TB, TH, NKB, kb)
        n_tiles = tl.load(TILE_T_CNT + trow)
        # The reading query blocks ascend: the diagonal one, if listed, is first.
        n_masked = _diagonal_tiles(TILES_T + trow * T_MAX, n_tiles, QBLK, own, HAS_QPOS, HAS_ROWSEL) * (
            BLOCK // BLOCK_M
        )
        for j in range(n_tiles * (BLOCK // BLOCK_M)):
            qb, rows, row_ok, row_pos = _block_step(TILES_T, trow, T_MAX, j, QBLK, S, BLOCK, BLOCK_M, HAS_QPOS)
            sel = _row_selection(ROWSEL, b, th, TH, S, rows, row_ok, K_SEL, K_PAD, HAS_ROWSEL)
            seen = col_ok[:, None]
            masked = j < n_masked
            if HAS_DOCS:
                # Masked where a row's document starts after the first key, which the step's
                # last row (documents ascend) decides by a compare with that key's document
                # end: no load a step. The rows' starts are read only for the steps it masks
                # (elsewhere every row's start is at or before every key: 0 stands in).
                last = tl.minimum(_step_start(QBLK, qb, j, BLOCK, BLOCK_M, False) + BLOCK_M, S) - 1
                crosses = _positions(QBLK, qb, last, HAS_QPOS, BLOCK) >= first_key_end
                masked = masked | crosses
                row_first = tl.zeros([BLOCK_M], tl.int32)
                if crosses:
                    row_first = tl.load(DOC_START + row_pos, mask=row_ok, other=0)
                seen = seen & (col_pos[:, None] >= row_first[None, :])
            dk, dv = _kv_grads(
                dk, dv, k, v, col_pos, col_ok, Q + q_off, DO + q_off, LSE, DELTA, b, h, H, S, rows,
                _tile_rows(row_pos, sel, KBLK, kb, BLOCK, RATIO, HAS_ROWSEL, HAS_KPOS), q_stride, d, d_ok, qk_scale,
                seen, masked, PRECISION,
            )  # fmt: skip
    _store_rows(DK + kv_off, cols, col_ok, kv_stride, d, d_ok, dk * sm_scale)
    _store_rows(DV + kv_off, cols, col_ok, kv_stride, d, d_ok, dv)

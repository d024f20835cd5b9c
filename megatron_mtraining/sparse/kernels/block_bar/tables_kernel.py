"""A vertical-slash index's tile tables in one Triton launch (CUDA inputs), on one
device or for a context-parallel piece.

``tables.vertical_slash_tables`` on the torch path (one device) and ``StepTables`` (a ring step) compose
``slash_tiles``, ``vertical_counts`` and ``active_diagonals``: about 55 small torch
operations, each a kernel launch and microseconds of host time (docs/benchmarks.md,
"Context-parallel layouts in one launch"),
each a node of the index build's CUDA graph, and on a context-parallel rank host time
spent before its first attention kernel. This kernel writes the same tables, equal entry
for entry (the tests compare them), one program per (group of block ids, batch x head).
Query block ``g`` and key block ``h`` are global ids (a rank's rows and a step's chunk
map local blocks to them, ``BlockMap``; on one device local is global):

* tiles of query block ``g``: the held key blocks ``g - d`` for the listed diagonals
  ``d <= g``, ascending (``d`` descending); tiles of key block ``h``: the held query
  blocks ``h + d < n``, ascending. Each entry's slot is its rank among the block's
  entries, so the slash list need not be sorted; slots past the count hold -1;
* with whole-sequence keys, the bars: ``bar_count``, vertical columns at or before
  query block ``g``'s last row; ``vertical_ptr[h]``, columns before key block ``h``
  (``h <= n``); by bisection of the ascending vertical list, as ``vertical_counts``
  (``torch.searchsorted``) does; ``active[d]``, whether diagonal ``d`` is listed;
* with the gathered vertical columns as keys (a ring rank's column piece): no tiles, the
  bars as above over blocks of those columns, and each vertical entry's index among them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...index import VerticalSlashIndex
from .block_map import BlockMap


@triton.jit
def _counts_below(VERT, row, n_vert, bound_a, bound_b, STEPS: tl.constexpr):
    """Entries of the row's ascending vertical list (-1 padding read as +inf) below each
    of two bounds: ``torch.searchsorted`` by bisection, both searches in one loop."""
    lo_a = tl.zeros_like(bound_a)
    hi_a = lo_a + n_vert
    lo_b = tl.zeros_like(bound_b)
    hi_b = lo_b + n_vert
    for _ in tl.static_range(STEPS):
        open_a = lo_a < hi_a
        open_b = lo_b < hi_b
        mid_a = (lo_a + hi_a) // 2
        mid_b = (lo_b + hi_b) // 2
        v_a = tl.load(VERT + row * n_vert + mid_a, mask=open_a, other=-1)
        v_b = tl.load(VERT + row * n_vert + mid_b, mask=open_b, other=-1)
        below_a = (v_a >= 0) & (v_a < bound_a)
        below_b = (v_b >= 0) & (v_b < bound_b)
        lo_a = tl.where(open_a & below_a, mid_a + 1, lo_a)
        hi_a = tl.where(open_a & ~below_a, mid_a, hi_a)
        lo_b = tl.where(open_b & below_b, mid_b + 1, lo_b)
        hi_b = tl.where(open_b & ~below_b, mid_b, hi_b)
    return lo_a, lo_b


@triton.jit
def _local(LOC, glob, ok, HAS_MAP: tl.constexpr):
    """Local block index of global block ids ``glob`` where ``ok`` (-1 where the block is
    not held, or not ``ok``): the map ``LOC``'s entry, or the id itself (whole sequence)."""
    if HAS_MAP:
        return tl.load(LOC + glob, mask=ok, other=-1)
    return tl.where(ok, glob, -1)


@triton.jit
def _diagonals(SLASH, row, n_slash, j0, g, h, n_blocks, QLOC, KLOC, SDC: tl.constexpr,
               HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr):  # fmt: skip
    """Entries ``j0 .. j0 + SDC`` of the row's slash list: (their indices, diagonals,
    listed, ``[G, SDC]`` the local key block that global query block ``g`` reads on each
    diagonal (``g - d``) or -1, and the local query block that reads global key block
    ``h`` (``h + d``) or -1)."""
    j = j0 + tl.arange(0, SDC)
    d = tl.load(SLASH + row * n_slash + j, mask=j < n_slash, other=-1)
    listed = d >= 0
    key = g[:, None] - d[None, :]
    reader = h[:, None] + d[None, :]
    into = _local(KLOC, key, listed[None, :] & (key >= 0) & (key < n_blocks), HAS_KPOS)
    out_of = _local(QLOC, reader, listed[None, :] & (reader < n_blocks), HAS_QPOS)
    return j, d, listed, into, out_of


@triton.jit
def _global(BLK, r, ok, HAS_POS: tl.constexpr):
    """Global block ids of local blocks ``r``: the table's entries, or ``r`` (whole sequence)."""
    if HAS_POS:
        return tl.load(BLK + r, mask=ok, other=0)
    return r


@triton.jit
def _tables_kernel(
    SLASH, VERT, QBLK, QLOC, KBLK, KLOC, COLS, TILES, COUNT, TILES_T, COUNT_T, BAR_COUNT, VERT_PTR, ACTIVE,
    VERT_LOCAL, n_slash, n_vert, n_blocks, n_q, n_k, n_cols, seq_len, width, width_t,
    BLOCK: tl.constexpr, G: tl.constexpr, SDC: tl.constexpr, WP: tl.constexpr, WP_T: tl.constexpr,
    STEPS: tl.constexpr, STEPS_C: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
    HAS_BARS: tl.constexpr, COLUMN_KEYS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)  # batch x head
    r = tl.program_id(0) * G + tl.arange(0, G)  # local query block, local key block, diagonal
    q_ok = r < n_q
    k_ok = r < n_k
    g = _global(QBLK, r, q_ok, HAS_QPOS)
    h = _global(KBLK, r, k_ok, HAS_KPOS)
    base = (row * n_q + r)[:, None] * width
    base_t = (row * n_k + r)[:, None] * width_t
    count = tl.zeros([G], tl.int32)
    count_t = tl.zeros([G], tl.int32)
    active = tl.zeros([G], tl.int32)
    # The slash list in chunks of SDC entries, so that the pairwise tables below stay
    # SDC x SDC whatever the list's length (a 256 x 256 table does not fit in registers).
    for b0 in range(0, n_slash, SDC):
        jb, db, listed_b, tile_b, tile_t_b = _diagonals(
            SLASH, row, n_slash, b0, g, h, n_blocks, QLOC, KLOC, SDC, HAS_QPOS, HAS_KPOS
        )
        if not COLUMN_KEYS:  # the gathered columns' keys have no tiles
            into_b = tile_b >= 0
            out_of_b = tile_t_b >= 0
            # Slots: an entry's rank among its block's entries, by d descending for the tiles
            # (key blocks ascending: local order is global order) and ascending for their
            # transpose, ties in list order. As matrix products of 0/1 values (exact in the
            # fp32 sums): slot[r, j] = sum over j' of in_r(j') * before(j', j).
            slot = tl.zeros([G, SDC], tl.float32)
            slot_t = tl.zeros([G, SDC], tl.float32)
            for a0 in range(0, n_slash, SDC):
                ja, da, listed_a, tile_a, tile_t_a = _diagonals(
                    SLASH, row, n_slash, a0, g, h, n_blocks, QLOC, KLOC, SDC, HAS_QPOS, HAS_KPOS
                )
                tie = (da[:, None] == db[None, :]) & (ja[:, None] < jb[None, :])
                before = (listed_a[:, None] & ((da[:, None] > db[None, :]) | tie)).to(tl.float16)
                before_t = (listed_a[:, None] & ((da[:, None] < db[None, :]) | tie)).to(tl.float16)
                slot = tl.dot((tile_a >= 0).to(tl.float16), before, slot)
                slot_t = tl.dot((tile_t_a >= 0).to(tl.float16), before_t, slot_t)
            slot = slot.to(tl.int32)
            slot_t = slot_t.to(tl.int32)
            # A slot past the width only with repeated diagonals: dropped, as compact trims.
            tl.store(TILES + base + slot, tile_b, mask=into_b & q_ok[:, None] & (slot < width))
            tl.store(TILES_T + base_t + slot_t, tile_t_b, mask=out_of_b & k_ok[:, None] & (slot_t < width_t))
            count += tl.sum(into_b.to(tl.int32), 1)
            count_t += tl.sum(out_of_b.to(tl.int32), 1)
        if HAS_BARS:
            active = tl.maximum(active, tl.max(((db[None, :] == r[:, None]) & listed_b[None, :]).to(tl.int32), 1))
    s = tl.arange(0, WP)[None, :]
    tl.store(TILES + base + s, -1, mask=q_ok[:, None] & (s < width) & (s >= count[:, None]))
    s_t = tl.arange(0, WP_T)[None, :]
    tl.store(TILES_T + base_t + s_t, -1, mask=k_ok[:, None] & (s_t < width_t) & (s_t >= count_t[:, None]))
    tl.store(COUNT + row * n_q + r, count, mask=q_ok)
    tl.store(COUNT_T + row * n_k + r, count_t, mask=k_ok)
    if HAS_BARS:
        tl.store(ACTIVE + row * n_blocks + r, active.to(tl.int8), mask=r < n_blocks)
        # The keys' block r starts at position r * BLOCK (whole sequence), or at gathered
        # column r * BLOCK (past the last column: every column lies before it).
        if COLUMN_KEYS:
            first = tl.load(COLS + r * BLOCK, mask=r * BLOCK < n_cols, other=-1)
            key_start = tl.where(first >= 0, first, seq_len)
        else:
            key_start = r * BLOCK
        # Bars up to the query block's last row (a column <= last row: below last row + 1);
        # columns before the keys' block r.
        n_bars, before_block = _counts_below(VERT, row, n_vert, tl.minimum((g + 1) * BLOCK, seq_len), key_start, STEPS)
        tl.store(BAR_COUNT + row * n_q + r, n_bars, mask=q_ok)
        tl.store(VERT_PTR + row * (n_k + 1) + r, before_block, mask=r <= n_k)
        if COLUMN_KEYS:  # entry r of the vertical list: its index among the gathered columns
            listed = r < n_vert
            column = tl.load(VERT + row * n_vert + r, mask=listed, other=-1)
            at, _ = _counts_below(COLS, 0, n_cols, column, column, STEPS_C)
            tl.store(VERT_LOCAL + row * n_vert + r, tl.where(column >= 0, at, -1), mask=listed)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def launch_vertical_slash_tables(
    index: VerticalSlashIndex,
    query_blocks: BlockMap | None = None,
    key_blocks: BlockMap | None = None,
    bars: bool = True,
    columns: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The tables of ``tables.vertical_slash_tables(index, query_blocks, key_blocks, bars,
    columns)`` (``TileTables``'s fields by name, but ``block``, ``bar_positions`` and the
    block ids): the tiles, and with ``bars`` (whole-sequence keys only) ``bar_count``,
    ``vertical_ptr`` and ``active``. With ``columns`` (the gathered vertical columns'
    positions as keys) no tiles, and ``vertical``: the columns' indices among them."""
    b, h, n_slash = index.slash.shape
    n, dev, n_vert = index.num_blocks, index.device, index.vertical.shape[-1]
    n_q = n if query_blocks is None else len(query_blocks.ids)
    n_k = n if key_blocks is None else len(key_blocks.ids)
    n_cols = 0 if columns is None else len(columns)
    # A block meets each diagonal once: the bounds slash_tiles uses.
    width, width_t = min(n_slash, n_k), min(n_slash, n_q)
    if columns is not None:
        n_k, width, width_t = -(-n_cols // index.block_size), 1, 1

    def table(*shape, dtype=torch.int32):
        return torch.empty(b, h, *shape, dtype=dtype, device=dev)

    out = {"tiles": table(n_q, width), "tile_count": table(n_q), "tiles_t": table(n_k, width_t),
           "tile_t_count": table(n_k)}  # fmt: skip
    if bars:
        out |= {"bar_count": table(n_q), "vertical_ptr": table(n_k + 1), "active": table(n, dtype=torch.int8)}
    if columns is not None:
        out["vertical"] = table(n_vert)
    placeholder = out["tile_count"]  # never read where a flag is off
    qblk, qloc = (placeholder, placeholder) if query_blocks is None else (query_blocks.ids, query_blocks.local)
    kblk, kloc = (placeholder, placeholder) if key_blocks is None else (key_blocks.ids, key_blocks.local)
    # Block ids per program and diagonals per chunk: the slot products hold G x SDC and
    # SDC x SDC tables, which fit in registers at these sizes (sm90).
    g, sdc = 32, min(_pow2(n_slash), 64)
    rows = max(n_q, n_k + 1 if bars else n_k, n if bars else 0, n_vert if columns is not None else 0)
    _tables_kernel[(triton.cdiv(rows, g), b * h)](
        index.slash.contiguous(), index.vertical.contiguous(), qblk, qloc, kblk, kloc,
        placeholder if columns is None else columns.contiguous(), out["tiles"], out["tile_count"], out["tiles_t"],
        out["tile_t_count"], out.get("bar_count", placeholder), out.get("vertical_ptr", placeholder),
        out.get("active", placeholder), out.get("vertical", placeholder),
        n_slash, n_vert, n, n_q, n_k, n_cols, index.seq_len, width, width_t,
        BLOCK=index.block_size, G=g, SDC=sdc, WP=_pow2(width), WP_T=_pow2(width_t),
        STEPS=n_vert.bit_length(), STEPS_C=n_cols.bit_length(), HAS_QPOS=query_blocks is not None,
        HAS_KPOS=key_blocks is not None, HAS_BARS=bars, COLUMN_KEYS=columns is not None,
    )  # fmt: skip
    return out

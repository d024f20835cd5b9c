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
def _counts_below(VERT, row, n_vert, bound_a, bound_b, steps):
    """Entries of the row's ascending vertical list (-1 padding read as +inf) below each
    of two bounds: ``torch.searchsorted`` by bisection, both searches in one loop."""
    lo_a = tl.zeros_like(bound_a)
    hi_a = lo_a + n_vert
    lo_b = tl.zeros_like(bound_b)
    hi_b = lo_b + n_vert
    for _ in range(steps):
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
def _document_list(SLASH, row, n_slash, n_docs, doc, ok, j0, SDC: tl.constexpr):
    """Entries ``j0 .. j0 + SDC`` of document ``doc``'s diagonal list (one per lane of
    ``doc``, ``[G, SDC]``), -1 past the list or where not ``ok``."""
    j = j0 + tl.arange(0, SDC)
    at = (row * n_docs + doc)[:, None].to(tl.int64) * n_slash + j[None, :]
    return tl.load(SLASH + at, mask=ok[:, None] & (j < n_slash)[None, :], other=-1)


@triton.jit
def _document_tiles(
    SLASH, row, n_slash, n_docs, n_blocks, g, h, q_ok, k_ok, doc_q, start_q, DOC_IDS, CU, QLOC, KLOC, TILES,
    TILES_T, base, base_t, width, width_t, seq_len, BLOCK: tl.constexpr, G: tl.constexpr, SDC: tl.constexpr,
    HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
):  # fmt: skip
    """The tiles with packed documents (``tables._document_tiles``, entry for entry), for
    query blocks ``g`` and key blocks ``h`` (global ids). Each document's list is ascending
    (``VerticalSlashIndex``), so a kept entry's slot is a running count: query block ``g``
    lists the key blocks ``g - d`` for its document's ``d > 0`` from its start's key block
    on (larger ``d`` first: key blocks ascending), then ``g`` itself; key block ``h`` is read
    by ``h`` itself, then by ``h + d`` for the ``d > 0`` of the document of its last row whose
    first rows are still in that document. Returns (count, count_t)."""
    first_block = start_q // BLOCK
    last_row = tl.minimum((h + 1) * BLOCK, seq_len) - 1
    doc_k = tl.load(DOC_IDS + last_row, mask=k_ok, other=0)
    end_k = tl.load(CU + doc_k + 1, mask=k_ok, other=0)
    # Tiles: count the kept entries, then place each at (kept entries after it).
    n_into = tl.zeros([G], tl.int32)
    for j0 in range(0, n_slash, SDC):
        d = _document_list(SLASH, row, n_slash, n_docs, doc_q, q_ok, j0, SDC)
        key = g[:, None] - d
        into = _local(KLOC, key, (d > 0) & (key >= first_block[:, None]), HAS_KPOS)
        n_into += tl.sum((into >= 0).to(tl.int32), 1)
    seen = tl.zeros([G], tl.int32)
    seen_t = tl.zeros([G], tl.int32)
    own_t = _local(QLOC, h, k_ok, HAS_QPOS)  # query block h reads key block h (diagonal 0)
    seen_t += (own_t >= 0).to(tl.int32)
    tl.store(TILES_T + base_t, own_t, mask=(own_t >= 0) & (width_t > 0))
    for j0 in range(0, n_slash, SDC):
        d = _document_list(SLASH, row, n_slash, n_docs, doc_q, q_ok, j0, SDC)
        key = g[:, None] - d
        into = _local(KLOC, key, (d > 0) & (key >= first_block[:, None]), HAS_KPOS)
        listed = (into >= 0).to(tl.int32)
        slot = n_into[:, None] - seen[:, None] - tl.cumsum(listed, 1)
        tl.store(TILES + base[:, None] + slot, into, mask=(listed > 0) & q_ok[:, None] & (slot < width))
        seen += tl.sum(listed, 1)
        d_t = _document_list(SLASH, row, n_slash, n_docs, doc_k, k_ok, j0, SDC)
        reader = h[:, None] + d_t
        ok_t = (d_t > 0) & (reader < n_blocks) & (reader * BLOCK < end_k[:, None])
        out_of = _local(QLOC, reader, ok_t, HAS_QPOS)
        listed_t = (out_of >= 0).to(tl.int32)
        slot_t = seen_t[:, None] + tl.cumsum(listed_t, 1) - listed_t
        tl.store(TILES_T + base_t[:, None] + slot_t, out_of, mask=(listed_t > 0) & k_ok[:, None] & (slot_t < width_t))
        seen_t += tl.sum(listed_t, 1)
    own = _local(KLOC, g, q_ok, HAS_KPOS)  # the block's own tile, the last (largest) key block
    tl.store(TILES + base + n_into, own, mask=(own >= 0) & (n_into < width))
    return n_into + (own >= 0).to(tl.int32), seen_t


@triton.jit
def _document_active(SLASH, row, n_slash, n_docs, e, CU, steps_d, BLOCK: tl.constexpr, SDC: tl.constexpr):
    """Entries ``e`` of the packed diagonal table (``VerticalSlashIndex.document_active``):
    document ``m``'s diagonal ``d < span`` at ``cu[m] // BLOCK + m + d``. The document of
    an entry by bisection (that offset increases with ``m``), then ``d`` looked up in its list
    (diagonal 0 always)."""
    lo = tl.zeros_like(e)
    hi = lo + n_docs
    for _ in range(steps_d):  # the first document whose offset lies past e
        open_ = lo < hi
        mid = (lo + hi) // 2
        off = tl.load(CU + mid, mask=open_, other=0) // BLOCK + mid
        past = off > e
        lo = tl.where(open_ & ~past, mid + 1, lo)
        hi = tl.where(open_ & past, mid, hi)
    doc = tl.maximum(lo - 1, 0)
    start = tl.load(CU + doc)
    d = e - (start // BLOCK + doc)
    span = (tl.load(CU + doc + 1) - 1) // BLOCK - start // BLOCK + 1
    ok = (d >= 0) & (d < span)
    hit = ok & (d == 0)
    for j0 in range(0, n_slash, SDC):
        listed = _document_list(SLASH, row, n_slash, n_docs, doc, ok, j0, SDC)
        hit |= tl.max((listed == d[:, None]).to(tl.int32), 1) > 0
    return (hit & ok).to(tl.int32)


# Sizes that follow a step's data (list widths, document counts, search steps) are left
# unspecialized here and in every kernel a packed-documents step runs: Triton compiles a
# kernel again, seconds each, for every new mix of their classes (1, a multiple of 16, other),
# and each packing brings new values.
@triton.jit(
    do_not_specialize=["n_slash", "n_vert", "n_cols", "width", "width_t", "n_docs", "n_active", "steps", "steps_c",
                       "steps_d"]
)  # fmt: skip
def _tables_kernel(
    SLASH, VERT, QBLK, QLOC, KBLK, KLOC, COLS, TILES, COUNT, TILES_T, COUNT_T, BAR_COUNT, VERT_PTR, ACTIVE,
    VERT_LOCAL, DOC_IDS, CU, ACT_OFF, BAR_START, n_slash, n_vert, n_blocks, n_q, n_k, n_cols, seq_len, width,
    width_t, n_docs, n_active, steps, steps_c, steps_d,
    BLOCK: tl.constexpr, G: tl.constexpr, SDC: tl.constexpr, WP: tl.constexpr, WP_T: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    HAS_KPOS: tl.constexpr, HAS_BARS: tl.constexpr, COLUMN_KEYS: tl.constexpr, HAS_DOCS: tl.constexpr,
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
    if HAS_DOCS:
        # The document of query block g's first row (whose diagonals and start its tiles
        # follow), and the document of key block h's last row (the one document whose
        # diagonals reach past h, see tables._document_tiles).
        doc_q = tl.load(DOC_IDS + g * BLOCK, mask=q_ok, other=0)
        start_q = tl.load(CU + doc_q, mask=q_ok, other=0)
        if not COLUMN_KEYS:
            count, count_t = _document_tiles(
                SLASH, row, n_slash, n_docs, n_blocks, g, h, q_ok, k_ok, doc_q, start_q, DOC_IDS, CU, QLOC, KLOC,
                TILES, TILES_T, (row * n_q + r) * width, (row * n_k + r) * width_t, width, width_t, seq_len, BLOCK, G, SDC, HAS_QPOS, HAS_KPOS,
            )  # fmt: skip
        if HAS_BARS:
            active = _document_active(SLASH, row, n_slash, n_docs, r, CU, steps_d, BLOCK, SDC)
            tl.store(ACTIVE + row * n_active + r, active.to(tl.int8), mask=r < n_active)
            # Where the packed table holds this block's document's diagonals, once for all heads.
            tl.store(ACT_OFF + r, start_q // BLOCK + doc_q, mask=q_ok & (row == 0))
            # The vertical entries before the document start of the block's first row.
            n_before, _ = _counts_below(VERT, row, n_vert, start_q, start_q, steps)
            tl.store(BAR_START + row * n_q + r, n_before, mask=q_ok)
    # The slash list in chunks of SDC entries, so that the pairwise tables below stay
    # SDC x SDC whatever the list's length (a 256 x 256 table does not fit in registers).
    if not HAS_DOCS:  # one diagonal list per head
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
    if HAS_BARS and not HAS_DOCS:
        tl.store(ACTIVE + row * n_blocks + r, active.to(tl.int8), mask=r < n_blocks)
    if HAS_BARS:
        # The keys' block r starts at position r * BLOCK (whole sequence), or at gathered
        # column r * BLOCK (past the last column: every column lies before it).
        if COLUMN_KEYS:
            first = tl.load(COLS + r * BLOCK, mask=r * BLOCK < n_cols, other=-1)
            key_start = tl.where(first >= 0, first, seq_len)
        else:
            key_start = r * BLOCK
        # Bars up to the query block's last row (a column <= last row: below last row + 1);
        # columns before the keys' block r.
        n_bars, before_block = _counts_below(VERT, row, n_vert, tl.minimum((g + 1) * BLOCK, seq_len), key_start, steps)
        tl.store(BAR_COUNT + row * n_q + r, n_bars, mask=q_ok)
        tl.store(VERT_PTR + row * (n_k + 1) + r, before_block, mask=r <= n_k)
        if COLUMN_KEYS:  # entry r of the vertical list: its index among the gathered columns
            listed = r < n_vert
            column = tl.load(VERT + row * n_vert + r, mask=listed, other=-1)
            at, _ = _counts_below(COLS, 0, n_cols, column, column, steps_c)
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
    b, h = index.slash.shape[:2]
    n_slash = index.slash.shape[-1]
    docs = index.documents
    n_docs = 0 if docs is None else docs.count
    n, dev, n_vert = index.num_blocks, index.device, index.vertical.shape[-1]
    n_q = n if query_blocks is None else len(query_blocks.ids)
    n_k = n if key_blocks is None else len(key_blocks.ids)
    n_cols = 0 if columns is None else len(columns)
    # A block meets each diagonal once: the bounds slash_tiles uses (with documents, the
    # block's own tile beside its document's diagonals, as tables._document_tiles).
    listed = n_slash if docs is None else n_slash + 1
    width, width_t = min(listed, n_k), min(listed, n_q)
    if columns is not None:
        n_k, width, width_t = -(-n_cols // index.block_size), 1, 1
    n_active = n if docs is None else n + n_docs

    def table(*shape, dtype=torch.int32):
        return torch.empty(b, h, *shape, dtype=dtype, device=dev)

    out = {"tiles": table(n_q, width), "tile_count": table(n_q), "tiles_t": table(n_k, width_t),
           "tile_t_count": table(n_k)}  # fmt: skip
    if bars:
        out |= {"bar_count": table(n_q), "vertical_ptr": table(n_k + 1), "active": table(n_active, dtype=torch.int8)}
        if docs is not None:
            out |= {"bar_start": table(n_q), "active_offset": torch.empty(n_q, dtype=torch.int32, device=dev)}
    if columns is not None:
        out["vertical"] = table(n_vert)
    placeholder = out["tile_count"]  # never read where a flag is off
    qblk, qloc = (placeholder, placeholder) if query_blocks is None else (query_blocks.ids, query_blocks.local)
    kblk, kloc = (placeholder, placeholder) if key_blocks is None else (key_blocks.ids, key_blocks.local)
    doc_ids, cu = (placeholder, placeholder) if docs is None else (docs.ids, docs.cu_seqlens)
    # Block ids per program and diagonals per chunk: the slot products hold G x SDC and
    # SDC x SDC tables, which fit in registers at these sizes (sm90).
    g, sdc = 32, min(_pow2(n_slash), 64)
    rows = max(n_q, n_k + 1 if bars else n_k, n_active if bars else 0, n_vert if columns is not None else 0)
    _tables_kernel[(triton.cdiv(rows, g), b * h)](
        index.slash.contiguous(), index.vertical.contiguous(), qblk, qloc, kblk, kloc,
        placeholder if columns is None else columns.contiguous(), out["tiles"], out["tile_count"], out["tiles_t"],
        out["tile_t_count"], out.get("bar_count", placeholder), out.get("vertical_ptr", placeholder),
        out.get("active", placeholder), out.get("vertical", placeholder), doc_ids, cu,
        out.get("active_offset", placeholder), out.get("bar_start", placeholder),
        n_slash, n_vert, n, n_q, n_k, n_cols, index.seq_len, width, width_t, n_docs, n_active,
        n_vert.bit_length(), n_cols.bit_length(), n_docs.bit_length(),
        BLOCK=index.block_size, G=g, SDC=sdc, WP=_pow2(width), WP_T=_pow2(width_t),
        HAS_QPOS=query_blocks is not None, HAS_KPOS=key_blocks is not None, HAS_BARS=bars,
        COLUMN_KEYS=columns is not None, HAS_DOCS=docs is not None,
    )  # fmt: skip
    return out

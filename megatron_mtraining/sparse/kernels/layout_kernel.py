"""A vertical-slash index's single-device kernel layout in one Triton launch (CUDA inputs).

``layout.vertical_slash_layout`` composes ``slash_tiles``, ``vertical_counts`` and
``active_diagonals``: about 55 small torch operations, each a kernel launch and ~5-10 us of
host time (0.8 ms at 128K on an H200), and each a node of the index build's CUDA graph.
This kernel writes the same tables, equal entry for entry (the tests compare them), one
program per (group of block ids, batch x head):

* tiles of query block ``g``: key blocks ``g - d`` for the listed diagonals ``d <= g``,
  ascending (``d`` descending); tiles of KV block ``g``: query blocks ``g + d < n``,
  ascending. Each entry's slot is its rank among the block's entries, so the slash list
  need not be sorted; slots past the count hold -1;
* ``bar_count[g]``: vertical columns at or before query block ``g``'s last row;
  ``vertical_ptr[g]``: columns before KV block ``g`` (``g <= n``); by bisection of the
  ascending vertical list, as ``vertical_counts`` (``torch.searchsorted``) does;
* ``active[g]``: whether diagonal ``g`` is listed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..index import VerticalSlashIndex


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
def _diagonals(SLASH, row, n_slash, j0, g, n_blocks, SDC: tl.constexpr):
    """Entries ``j0 .. j0 + SDC`` of the row's slash list: (their indices, diagonals,
    listed, ``[G, SDC]`` query block g reads key block g - d, key block g is read by g + d)."""
    j = j0 + tl.arange(0, SDC)
    d = tl.load(SLASH + row * n_slash + j, mask=j < n_slash, other=-1)
    listed = d >= 0
    into = listed[None, :] & (d[None, :] <= g[:, None])
    out_of = listed[None, :] & (d[None, :] + g[:, None] < n_blocks)
    return j, d, listed, into, out_of


@triton.jit
def _layout_kernel(
    SLASH, VERT, TILES, COUNT, TILES_T, COUNT_T, BAR_COUNT, VERT_PTR, ACTIVE,
    n_slash, n_vert, n_blocks, seq_len, width,
    BLOCK: tl.constexpr, G: tl.constexpr, SDC: tl.constexpr, WP: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)  # batch x head
    g = tl.program_id(0) * G + tl.arange(0, G)
    in_range = g < n_blocks
    base = (row * n_blocks + g)[:, None] * width
    count = tl.zeros([G], tl.int32)
    count_t = tl.zeros([G], tl.int32)
    active = tl.zeros([G], tl.int32)
    # The slash list in chunks of SDC entries, so that the pairwise tables below stay
    # SDC x SDC whatever the list's length (a 256 x 256 table does not fit in registers).
    for b0 in range(0, n_slash, SDC):
        jb, db, listed_b, into_b, out_of_b = _diagonals(SLASH, row, n_slash, b0, g, n_blocks, SDC)
        # Slots: an entry's rank among its block's entries, by d descending for the tiles
        # (key blocks ascending) and ascending for their transpose, ties in list order. As
        # matrix products of 0/1 values (exact in the fp32 sums):
        # slot[g, j] = sum over j' of in_g(j') * before(j', j).
        slot = tl.zeros([G, SDC], tl.float32)
        slot_t = tl.zeros([G, SDC], tl.float32)
        for a0 in range(0, n_slash, SDC):
            ja, da, listed_a, into_a, out_of_a = _diagonals(SLASH, row, n_slash, a0, g, n_blocks, SDC)
            tie = (da[:, None] == db[None, :]) & (ja[:, None] < jb[None, :])
            before = (listed_a[:, None] & ((da[:, None] > db[None, :]) | tie)).to(tl.float16)
            before_t = (listed_a[:, None] & ((da[:, None] < db[None, :]) | tie)).to(tl.float16)
            slot = tl.dot(into_a.to(tl.float16), before, slot)
            slot_t = tl.dot(out_of_a.to(tl.float16), before_t, slot_t)
        slot = slot.to(tl.int32)
        slot_t = slot_t.to(tl.int32)
        # A slot past the width only with repeated diagonals: dropped, as compact trims.
        tl.store(TILES + base + slot, g[:, None] - db[None, :], mask=into_b & in_range[:, None] & (slot < width))
        tl.store(
            TILES_T + base + slot_t, g[:, None] + db[None, :], mask=out_of_b & in_range[:, None] & (slot_t < width)
        )
        count += tl.sum(into_b.to(tl.int32), 1)
        count_t += tl.sum(out_of_b.to(tl.int32), 1)
        active = tl.maximum(active, tl.max(((db[None, :] == g[:, None]) & listed_b[None, :]).to(tl.int32), 1))
    s = tl.arange(0, WP)[None, :]
    pad_ok = in_range[:, None] & (s < width)
    tl.store(TILES + base + s, -1, mask=pad_ok & (s >= count[:, None]))
    tl.store(TILES_T + base + s, -1, mask=pad_ok & (s >= count_t[:, None]))
    tl.store(COUNT + row * n_blocks + g, count, mask=in_range)
    tl.store(COUNT_T + row * n_blocks + g, count_t, mask=in_range)
    tl.store(ACTIVE + row * n_blocks + g, active.to(tl.int8), mask=in_range)
    # Bars up to the block's last row (a column <= last row: below last row + 1); columns
    # before KV block g.
    bars, before_block = _counts_below(VERT, row, n_vert, tl.minimum((g + 1) * BLOCK, seq_len), g * BLOCK, STEPS)
    tl.store(BAR_COUNT + row * n_blocks + g, bars, mask=in_range)
    tl.store(VERT_PTR + row * (n_blocks + 1) + g, before_block, mask=g <= n_blocks)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def vertical_slash_tables(index: VerticalSlashIndex) -> dict[str, torch.Tensor]:
    """The fields of ``layout.vertical_slash_layout(index)`` other than ``block`` and
    ``vertical``, by name."""
    b, h, n_slash = index.slash.shape
    n, dev = index.num_blocks, index.device
    width = min(n_slash, n)  # a block meets each diagonal once: the bound slash_tiles uses

    def table(*shape, dtype=torch.int32):
        return torch.empty(b, h, *shape, dtype=dtype, device=dev)

    out = {
        "tiles": table(n, width),
        "tile_count": table(n),
        "tiles_t": table(n, width),
        "tile_t_count": table(n),
        "bar_count": table(n),
        "vertical_ptr": table(n + 1),
        "active": table(n, dtype=torch.int8),
    }
    # Block ids per program and diagonals per chunk: the slot products hold G x SDC and
    # SDC x SDC tables, which fit in registers at these sizes (sm90).
    g, sdc = 32, min(_pow2(n_slash), 64)
    _layout_kernel[(triton.cdiv(n + 1, g), b * h)](
        index.slash.contiguous(), index.vertical.contiguous(), out["tiles"], out["tile_count"], out["tiles_t"],
        out["tile_t_count"], out["bar_count"], out["vertical_ptr"], out["active"],
        n_slash, index.vertical.shape[-1], n, index.seq_len, width,
        BLOCK=index.block_size, G=g, SDC=sdc, WP=_pow2(width), STEPS=index.vertical.shape[-1].bit_length(),
    )  # fmt: skip
    return out

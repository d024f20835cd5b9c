"""Tile tables: the tile + bar kernels' inputs derived from an index: tile lists per
query block, their transpose per KV block, and the vertical-column ("bar") tables.

Everything here is a few vectorised torch ops on index-sized tensors, done once
per attention call and shared by the forward and backward kernels. Table widths
given by the caller (``widths``), or fixed by shapes (``slash_tiles``, and a
membership table's block counts by default), keep the construction from reading
the device, which would stall the training step once per call; trimming a table to
its longest row (``compact`` without a width) would read it.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from ...index import BlockTopKIndex, DenseIndex, SparseIndex, VerticalSlashIndex, compact
from ...validation import fail
from .. import triton_available
from .block_map import BlockMap


@dataclass
class TileTables:
    """Tiles are ``block x block``; the tables have batch and head dims of 1 (shared)
    or the full size, which the kernels index modulo."""

    block: int
    tiles: torch.Tensor  # [TB, TH, n_qblocks, max_tiles] int32 KV blocks, ascending
    tile_count: torch.Tensor  # [TB, TH, n_qblocks] int32
    tiles_t: torch.Tensor  # [TB, TH, n_kvblocks, max] int32 query blocks reading each KV block
    tile_t_count: torch.Tensor  # [TB, TH, n_kvblocks] int32
    # Bars: query block i reads the first bar_count[..., i] entries of its head's vertical
    # list (those at or before its last row), skipping columns inside its own attended
    # tiles in the kernel; a prefix count keeps the tables O(n_qblocks) per head.
    vertical: torch.Tensor | None = None  # [B, Hq, V] int32 key indices, ascending by position, -1 padded
    bar_count: torch.Tensor | None = None  # [B, Hq, n_qblocks] int32
    vertical_ptr: torch.Tensor | None = None  # [B, Hq, n_kvblocks + 1] int32: vertical entries per KV block
    active: torch.Tensor | None = None  # [B, Hq, n_blocks] int8: attended block diagonals
    # Top-k tables: the tiles of a query block are the union of its rows' choices, and
    # each row keeps only tiles of the index blocks it selected.
    rowsel: torch.Tensor | None = None  # [B, TH, S, k] int32 selected index blocks per row
    rowsel_ratio: int = 1  # index block size / tile size
    # Context-parallel steps: the global block ids (int32, ascending for queries) of the
    # local query blocks and of the chunk's key blocks, whose rows and keys are whole
    # global blocks; causality compares the positions they give. None on one device
    # (positions = indices). Gathered vertical columns are no blocks: bars-only tables
    # have no key blocks and give their columns' positions in ``bar_positions``.
    query_blocks: torch.Tensor | None = None
    key_blocks: torch.Tensor | None = None
    bar_positions: torch.Tensor | None = None  # [B, Hq, V] int32, as ``vertical`` (None: ``vertical``)
    # Packed documents (the index's ``documents``): the start of each row's document, [S]
    # int32 by global position, which the kernels compare with the key positions (one load
    # per row), and the ends, which bound the rows a vertical column's dK/dV walks.
    # Tiles wholly before the document start of a query block's first row are not listed.
    doc_start: torch.Tensor | None = None
    doc_end: torch.Tensor | None = None
    # With documents and bars: per (head, query block) the vertical entries before the
    # document start of the block's first row, which no row of the block sees (its bars
    # start after them), [B, Hq, n_qblocks] int32; per query block, where that document's
    # diagonals start in ``active`` (then ``[B, Hq, n_blocks + n_documents]``, see
    # ``VerticalSlashIndex.document_active``), [n_qblocks] int32.
    bar_start: torch.Tensor | None = None
    active_offset: torch.Tensor | None = None

    def __post_init__(self):
        # The kernels index every table with flat row-major offsets.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.contiguous())

    @property
    def has_bars(self) -> bool:
        return self.vertical is not None and self.vertical.shape[-1] > 0


def transpose_tiles(
    tiles: torch.Tensor, count: torch.Tensor, n_kv_blocks: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block KV-block lists -> per KV block query-block lists (ascending),
    ``width`` wide (see ``compact``)."""
    tb, th, nq, listed = tiles.shape
    valid = torch.arange(listed, device=tiles.device) < count.unsqueeze(-1)
    # A dense [.., n_kv, n_q] membership table keeps this simple; it is n_blocks^2 bits per head.
    member = torch.zeros(tb, th, n_kv_blocks + 1, nq, dtype=torch.bool, device=tiles.device)
    kv = torch.where(valid, tiles.long(), n_kv_blocks)
    member.scatter_(2, kv.transpose(2, 3), valid.transpose(2, 3))
    member = member[:, :, :n_kv_blocks]
    q_idx = torch.arange(nq, device=tiles.device, dtype=torch.int32).expand_as(member)
    return compact(q_idx, member, width)


def transpose_sorted(
    tiles: torch.Tensor, count: torch.Tensor, n_kv_blocks: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``transpose_tiles`` by sorting the listed (KV block, query block) pairs rather than
    through a ``[n_kv, n_q]`` membership table: memory and work follow the listed tiles,
    not the square of the block count (a vertical-slash index's lists are short), and no
    read of the device (``width`` bounds the query blocks reading one KV block)."""
    tb, th, nq, listed = tiles.shape
    dev = tiles.device
    valid = torch.arange(listed, device=dev) < count.unsqueeze(-1)
    rows = torch.arange(nq, device=dev).view(1, 1, -1, 1)
    pairs = torch.where(valid, tiles.long() * nq + rows, n_kv_blocks * nq).flatten(2).sort(-1).values
    kv, q = pairs // nq, pairs % nq  # padding sorts last, as KV block n_kv_blocks
    per_kv = torch.zeros(tb, th, n_kv_blocks + 1, dtype=torch.int64, device=dev)
    per_kv.scatter_add_(-1, kv, torch.ones_like(kv))
    first = per_kv.cumsum(-1) - per_kv  # where each KV block's run starts among the sorted pairs
    slot = torch.arange(pairs.shape[-1], device=dev) - first.gather(-1, kv)
    keep = (kv < n_kv_blocks) & (slot < width)
    out = torch.full((tb, th, n_kv_blocks * width + 1), -1, dtype=torch.int32, device=dev)
    out.scatter_(-1, torch.where(keep, kv * width + slot, n_kv_blocks * width), q.int())
    return out[..., :-1].view(tb, th, n_kv_blocks, width), per_kv[..., :-1].to(torch.int32)


def dense_tables(index: DenseIndex, block: int) -> TileTables:
    kb = torch.arange(-(-index.seq_len // block), device=index.device)
    member = kb.view(1, -1) <= kb.view(-1, 1)
    if index.documents is not None:  # block-diagonal: from the key block of each block's first document start
        member &= kb.view(1, -1) >= (index.documents.block_firsts(block) // block).view(-1, 1)
    return tables_from_membership(member.view(1, 1, len(kb), len(kb)), block, **_document_fields(index))


def _document_fields(index: SparseIndex) -> dict:
    """The tables' document vectors of ``index`` (none without documents)."""
    docs = index.documents
    return {} if docs is None else {"doc_start": docs.starts, "doc_end": docs.ends()}


def slash_tiles(slash: torch.Tensor, q_blocks: torch.Tensor, k_blocks: torch.Tensor, n_blocks: int):
    """Tiles of the attended block diagonals ``slash [B, Hq, max]`` (-1 padded) between
    query blocks and key blocks with global ids ``q_blocks`` / ``k_blocks`` (a whole
    sequence, or a context-parallel rank's rows and a ring step's chunk): query block
    ``g`` reads key block ``g - d``, and key block ``g`` is read by query block ``g + d``,
    where present. Returns (tiles, count, tiles_t, count_t) in local block indices,
    ascending. Lookups cost ``n_q x n_diagonals`` per head, not ``n_q x n_k``."""
    # A block meets each diagonal at most once, so a list holds at most min(diagonals,
    # blocks on the other side) entries: the widths follow from shapes, not from the data.
    diagonals = slash.unsqueeze(2).long()

    def lists(blocks: torch.Tensor, sign: int, targets: torch.Tensor):
        local_of = torch.full((n_blocks + 1,), -1, dtype=torch.int32, device=slash.device)
        local_of[targets.long()] = torch.arange(len(targets), dtype=torch.int32, device=slash.device)
        wanted = blocks.long().view(1, 1, -1, 1) + sign * diagonals
        ok = (diagonals >= 0) & (wanted >= 0) & (wanted < n_blocks)
        local = local_of[torch.where(ok, wanted, n_blocks)]
        return compact(local, local >= 0, min(slash.shape[-1], len(targets)))

    return (*lists(q_blocks, -1, k_blocks), *lists(k_blocks, 1, q_blocks))


def vertical_counts(vertical_positions: torch.Tensor, bounds: torch.Tensor, right: bool = False) -> torch.Tensor:
    """``[B, Hq, len(bounds)]`` int32: entries of each head's ascending, -1 padded vertical
    list below (``right``: at or below) each bound."""
    sortable = torch.where(vertical_positions >= 0, vertical_positions, torch.iinfo(torch.int32).max)
    wanted = bounds.to(sortable.dtype).expand(*sortable.shape[:2], -1).contiguous()
    return torch.searchsorted(sortable.contiguous(), wanted, right=right).to(torch.int32)


def vertical_slash_tables(
    index: VerticalSlashIndex,
    queries: BlockMap | None = None,
    keys: BlockMap | None = None,
    bars: bool = True,
    columns: torch.Tensor | None = None,
) -> TileTables:
    """The tile tables of a vertical-slash index between the query blocks and the key blocks
    held (``BlockMap``s: a context-parallel rank's rows, a ring step's chunk), each the
    whole sequence's where None; with ``bars``, which needs whole-sequence keys, the
    vertical columns' tables too. With ``columns`` (int32 positions, ascending, -1 padded
    at the end, holding every vertical column: a rank's gathered column keys) the keys are
    those columns: bars only, no tiles. In one Triton launch for CUDA indices
    (``tables_kernel``, packed documents too), else composed from the torch helpers below:
    the CPU path and the reference the kernel's tests compare with."""
    if keys is not None and bars:
        fail("bars", True, "False where the keys are a chunk (bars need whole-sequence keys)")
    if columns is not None and (keys is not None or not bars):
        fail("columns", "given", "None unless keys=None and bars=True (the columns are the keys)")
    ids = {"query_blocks": None if queries is None else queries.ids, "key_blocks": None if keys is None else keys.ids}
    vertical = {"vertical": index.vertical} if bars else {}
    if columns is not None:  # the bars' keys are the columns: positions beside their indices
        vertical = {"bar_positions": index.vertical}
    docs = index.documents
    if index.device.type == "cuda" and triton_available():
        from .tables_kernel import launch_vertical_slash_tables  # imports Triton

        written = launch_vertical_slash_tables(index, queries, keys, bars, columns)
        return TileTables(index.block_size, **vertical, **written, **ids, **_document_fields(index))
    n, bs = index.num_blocks, index.block_size
    blocks = torch.arange(n + 1, device=index.device, dtype=torch.int32)
    gq, gk = (blocks[:-1] if side is None else side.ids for side in (queries, keys))
    if docs is not None:
        ids.update(_document_fields(index))
    if columns is None:
        tiles = slash_tiles(index.slash, gq, gk, n) if docs is None else _document_tiles(index, gq, keys)
        if not bars:
            return TileTables(bs, *tiles, **ids)
        key_vertical, key_starts = index.vertical, blocks * bs
    else:
        n_column_blocks = -(-len(columns) // bs)
        tiles = _no_tiles(index, len(gq), n_column_blocks)
        # Each column's index among the gathered ones (all of them are there).
        sortable = torch.where(columns >= 0, columns, torch.iinfo(torch.int32).max)
        found = torch.searchsorted(sortable, index.vertical.contiguous())
        key_vertical = torch.where(index.vertical >= 0, found, -1).int()
        key_starts = torch.arange(n_column_blocks + 1, device=index.device, dtype=torch.int32) * bs
        vertical["vertical"] = key_vertical
    last_rows = torch.clamp((gq + 1) * bs, max=index.seq_len) - 1
    if docs is None:
        diagonals = {"active": index.active_diagonals().to(torch.int8)}
    else:  # per document: the packed table, where each query block's document starts in it, its bars' start
        active, offsets = index.document_active()
        first_rows = gq.long() * bs
        diagonals = {
            "active": active.to(torch.int8),
            "active_offset": offsets[docs.ids[first_rows].long()].to(torch.int32),
            "bar_start": vertical_counts(index.vertical, docs.starts[first_rows]),
        }
    return TileTables(
        bs,
        *tiles,
        **vertical,
        bar_count=vertical_counts(index.vertical, last_rows, right=True),
        vertical_ptr=vertical_counts(key_vertical, key_starts),
        **diagonals,
        **ids,
    )


def _document_tiles(index: VerticalSlashIndex, gq: torch.Tensor, keys: BlockMap | None) -> tuple[torch.Tensor, ...]:
    """The tiles of a vertical-slash index with documents between the query blocks with
    global ids ``gq`` and the key blocks ``keys`` holds (the whole sequence's where None), in
    local indices, ascending: query block ``g`` reads the key blocks ``g - d`` of the
    diagonals ``d >= 1`` of the document holding its first row, from that document's first
    key block on, and ``g`` itself (diagonal 0, every document). Widths follow from shapes:
    the diagonals plus the block itself per query block; a key block is read by itself and
    through the diagonals of the one document that runs past it (``VerticalSlashIndex``),
    so by as many query blocks at most. Torch operations on any device."""
    bs, docs = index.block_size, index.documents
    diags = index.block_diagonals(gq)
    g = gq.long().view(1, 1, -1, 1)
    kb = torch.cat([g - diags, g.expand(*diags.shape[:3], 1)], -1)
    first_block = (docs.starts[gq.long() * bs].long() // bs).view(1, 1, -1, 1)
    keep = torch.cat([(diags > 0) & (kb[..., :-1] >= first_block), torch.ones_like(kb[..., -1:], dtype=torch.bool)], -1)
    n_k = index.num_blocks if keys is None else len(keys.ids)
    if keys is not None:  # global -> this chunk's blocks, -1 where another chunk holds them
        kb = keys.local[torch.where(keep, kb, 0)].long()
        keep &= kb >= 0
    width = min(diags.shape[-1] + 1, n_k)
    tiles, count = compact(kb.int(), keep, width)
    return tiles, count, *transpose_sorted(tiles, count, n_k, min(diags.shape[-1] + 1, len(gq)))


def _no_tiles(index: VerticalSlashIndex, n_q: int, n_k: int) -> tuple[torch.Tensor, ...]:
    """Empty tile tables (one -1 slot, count 0) of ``n_q`` query and ``n_k`` key blocks."""
    b, h, dev = index.batch_size, index.num_heads, index.device
    return (
        torch.full((b, h, n_q, 1), -1, dtype=torch.int32, device=dev),
        torch.zeros(b, h, n_q, dtype=torch.int32, device=dev),
        torch.full((b, h, n_k, 1), -1, dtype=torch.int32, device=dev),
        torch.zeros(b, h, n_k, dtype=torch.int32, device=dev),
    )


def selection_union(rowsel: torch.Tensor, block: int, n_index_blocks: int) -> torch.Tensor:
    """``[B, Hs, ceil(L / block), n_index_blocks]`` bool: the index blocks any row of each
    ``block`` rows selected (``rowsel [B, Hs, L, k]``, -1 padded)."""
    b, hs, rows, k = rowsel.shape
    n_q = -(-rows // block)
    per_block = torch.nn.functional.pad(rowsel, (0, 0, 0, n_q * block - rows), value=-1).view(b, hs, n_q, block * k)
    chosen = torch.zeros(b, hs, n_q, n_index_blocks + 1, dtype=torch.bool, device=rowsel.device)
    chosen.scatter_(-1, torch.where(per_block >= 0, per_block.long(), n_index_blocks), True)
    return chosen[..., :n_index_blocks]


def tables_from_membership(
    member: torch.Tensor, block: int, widths: tuple[int, int] | None = None, **fields
) -> TileTables:
    """Tile tables from ``member [TB, TH, n_q, n_k]`` (query block i reads KV block j);
    ``widths``: bounds on the tiles per query block and per KV block (see ``compact``),
    by default the block counts ``(n_k, n_q)``. The kernels walk each list to its count,
    so the padding costs memory only: a dense table is full anyway, and a top-k union's
    longest list (MoBA's, whose rows choose different chunks) is near it."""
    kb = torch.arange(member.shape[-1], device=member.device, dtype=torch.int32)
    width, width_t = widths if widths is not None else (member.shape[-1], member.shape[-2])
    tiles, count = compact(kb.expand_as(member), member, width)
    return TileTables(block, tiles, count, *transpose_tiles(tiles, count, member.shape[-1], width_t), **fields)


def block_topk_tables(index: BlockTopKIndex, max_tile: int = 128) -> TileTables:
    tile = min(index.block_size, max_tile)
    ratio = index.block_size // tile
    n_tiles = -(-index.seq_len // tile)
    rowsel = index.blocks.permute(0, 2, 1, 3).contiguous()  # [B, Hs, S, k]
    chosen = selection_union(rowsel, tile, -(-index.seq_len // index.block_size))
    member = chosen.repeat_interleave(ratio, dim=-1)[..., :n_tiles]
    kb = torch.arange(n_tiles, device=index.device)
    member &= kb.view(1, -1) <= kb.view(-1, 1)  # a selected block may reach past the query block
    if index.documents is not None:  # no tile wholly before the document start of a block's first row
        member &= kb.view(1, -1) >= (index.documents.block_firsts(tile) // tile).view(-1, 1)
    return tables_from_membership(member, tile, rowsel=rowsel, rowsel_ratio=ratio, **_document_fields(index))


# The index types that have tile tables, so the block-bar kernels serve them (the dispatch
# reads this: what the kernels serve is decided here, where the tables are built).
SERVED_INDEXES = (VerticalSlashIndex, DenseIndex, BlockTopKIndex)


def tile_tables(index: SparseIndex, dense_block: int = 128) -> TileTables | None:
    """The tile tables of ``index`` (those kept for it, ``keep_tables``, if any), or None when
    the kernels do not serve its type."""
    kept = kept_tables(index)
    if kept is not None:
        return kept
    if isinstance(index, VerticalSlashIndex):
        return vertical_slash_tables(index)
    if isinstance(index, DenseIndex):
        return dense_tables(index, dense_block)
    if isinstance(index, BlockTopKIndex):
        return block_topk_tables(index)
    return None


# Tile tables made together with their index, by the index object's identity: the
# single-device vertical-slash build writes them in the same CUDA graph as the index, and
# building them again for the forward would repeat that work. Kept here rather than on the
# index, they leave the index plain data that knows nothing of the kernels, and every
# caller that hands the index object on to ``sparse_attention`` (the single-device
# ``mtraining`` attention, the ring at CP size 1 and the recall metric, all through
# ``build_local_index``) reuses them with no argument added to its signature. An entry
# lasts as long as its index: a weak reference's callback drops it. A moved or copied
# index (``to``, ``dataclasses.replace``) is another object and builds its own.
# Keyed by ``id`` since the index dataclasses compare by value and so do not hash.
_KEPT: dict[int, tuple[weakref.ref, TileTables]] = {}


def keep_tables(index: SparseIndex, tables: TileTables) -> None:
    """Makes ``tile_tables(index)`` return ``tables`` for as long as ``index`` lives."""
    key = id(index)

    def forget(ref: weakref.ref) -> None:
        if _KEPT.get(key, (None,))[0] is ref:
            del _KEPT[key]

    _KEPT[key] = (weakref.ref(index, forget), tables)


def kept_tables(index: SparseIndex) -> TileTables | None:
    """The tile tables kept for ``index`` (``keep_tables``), or None."""
    ref, tables = _KEPT.get(id(index), (None, None))
    return tables if ref is not None and ref() is index else None

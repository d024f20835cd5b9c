"""Tile tables of ring steps: a ``StepIndex`` in the kernels' tile + bar form.

Local query block ``i`` and chunk key block ``j`` are global blocks ``gq[i]`` and
``gk[j]`` when the layout's stripes (or zigzag chunks) are whole blocks, which
``StepTables`` checks; tiles are then decided per global block pair and
causality inside a tile is left to the kernels, which compare global positions.
The local vertical-column pass gets the bars of each local query block over the
gathered columns.

Building a step's tables reads nothing from the device, so the host can build step
``s + 1``'s while step ``s``'s kernel runs: block alignment and global block ids are
facts of the positions, computed once per layout, rank and device
(``TokenPositions``), and table widths follow from shapes, except a top-k index's,
read once per layer call (``StepTables``).
"""

from __future__ import annotations

import functools

import torch

from ..sparse.index import BlockTopKIndex, DenseIndex, SparseIndex, VerticalSlashIndex, VerticalSlashPart
from ..sparse.kernels.block_bar.block_map import BlockMap
from ..sparse.kernels.block_bar.tables import (
    TileTables,
    selection_union,
    tables_from_membership,
    vertical_slash_tables,
)
from .layout import TokenPositions

# A dense index's tile sizes, the widest the tokens' runs allow first.
DENSE_BLOCKS = (128, 64, 32, 16)
# A top-k index's tile is its block, capped here: a wider block is read as several tiles.
TOPK_TILE_CAP = 128


def kernel_tiles(kind: type, block: int | None) -> tuple[int, ...]:
    """The tile sizes the kernels take an index of type ``kind`` with blocks of ``block``
    tokens in, the widest first (none: no kernel form). A rank's tokens must come in whole,
    aligned runs of one of them for a ring step to have tile tables."""
    if issubclass(kind, VerticalSlashIndex | VerticalSlashPart):
        return (block,)  # diagonals are counted in blocks: the tile is the block
    if issubclass(kind, BlockTopKIndex):
        return (min(block, TOPK_TILE_CAP),)
    if issubclass(kind, DenseIndex):
        return DENSE_BLOCKS
    return ()


def _global_blocks(positions: TokenPositions, block: int) -> torch.Tensor | None:
    """Global block ids (int32, on the device) of the runs of ``block`` positions, or None
    unless the positions are such runs, each starting at a multiple of ``block``, in
    ascending order. Every context-parallel layout's are. The kernels then derive a
    position from its block's id with one scalar load per block, and the bar dK/dV
    kernel finds the first rows that can see a column by binary search."""

    def make(p: TokenPositions) -> torch.Tensor | None:
        if len(p.host) % block:
            return None
        runs = p.host.view(-1, block)
        aligned = (runs[:, 0] % block == 0).all() and (runs == runs[:, :1] + torch.arange(block)).all()
        ascending = (runs[1:, 0] > runs[:-1, 0]).all()
        return (p.values[::block] // block).int() if aligned and ascending else None

    return positions.derived(("global blocks", block), make)


def _block_map(positions: TokenPositions, block: int, n_blocks: int) -> BlockMap | None:
    """The positions' ``BlockMap`` (global ids of their blocks and its inverse), once; None
    where ``_global_blocks`` is."""

    def make(p: TokenPositions) -> BlockMap | None:
        ids = _global_blocks(p, block)
        return None if ids is None else BlockMap.of(ids, n_blocks)

    return positions.derived(("block map", block, n_blocks), make)


def _whole_sequence(positions: TokenPositions) -> bool:
    """Whether the positions are 0, 1, 2, ... (all-gathered K/V), from the host copy, once."""
    return positions.derived("whole sequence", lambda p: bool(torch.equal(p.host, torch.arange(len(p.host)))))


def _tiles_per_index_block(positions: TokenPositions, block: int, ratio: int) -> int:
    """The most ``block``-token blocks of ``positions`` inside one index block of ``ratio``
    of them."""
    return positions.derived(
        ("tiles per index block", block, ratio),
        lambda p: int(torch.bincount(p.host[::block] // (block * ratio)).max()),
    )


class StepTables:
    """The tile tables of one rank's steps under one index (one layer call), for the
    rank's rows at ``queries``. What depends on those rows alone (a top-k index's
    selections and its table widths) is built once and shared by the steps."""

    def __init__(self, work: SparseIndex, queries: TokenPositions):
        self.work, self.queries = work, queries

    def whole_blocks(self) -> bool:
        """Whether the rows are whole, ascending blocks of the tables' block (a vertical-slash
        part's index block; a top-k index's, capped at 128; for a dense index one of the sizes
        :meth:`of` tries), which the bars-only tables need, and so do the tiles-only tables of
        every ring step: each rank's positions run in the same stripes (or zigzag chunks), so
        a chunk's keys are whole blocks where the rows are. Reads nothing from the device and
        builds nothing."""
        return any(_global_blocks(self.queries, b) is not None for b in self._tiles)

    @property
    def _tiles(self) -> tuple[int, ...]:
        work = self.work
        block = work.index.block_size if isinstance(work, VerticalSlashPart) else getattr(work, "block_size", None)
        return kernel_tiles(type(work), block)

    def of(self, keys: TokenPositions) -> TileTables | None:
        """The tile tables of the step over the chunk at ``keys``, or None when the kernels
        cannot serve it (the tokens are not whole blocks, or the index type has no kernel
        form)."""
        work, queries = self.work, self.queries
        if isinstance(work, VerticalSlashPart) and work.part == "bars":
            return self._bars(keys)
        if isinstance(work, VerticalSlashIndex | VerticalSlashPart):
            return self._vertical_slash(keys)
        if not isinstance(work, BlockTopKIndex | DenseIndex):
            return None
        aligned = ((b, _global_blocks(queries, b), _global_blocks(keys, b)) for b in self._tiles)
        block, gq, gk = next(((b, q, k) for b, q, k in aligned if q is not None and k is not None), (None,) * 3)
        if block is None:
            return None
        # Keys that are the whole sequence are their own positions: the kernels then skip the
        # key-position arithmetic, which cost the forward 6-11% (``block_bar``'s ``HAS_KPOS``).
        fields = {"query_blocks": gq, "key_blocks": None if _whole_sequence(keys) else gk}
        causal = gq.view(-1, 1) >= gk.view(1, -1)
        docs = work.documents
        if docs is not None:
            # Packed documents: no tile wholly before the document start of its query block's
            # first row; the kernels compare each row's start with the keys' global positions.
            causal &= gk.view(1, -1) >= (docs.starts[gq.long() * block].long() // block).view(-1, 1)
            fields.update(doc_start=docs.starts, doc_end=docs.ends())
        if isinstance(work, DenseIndex):
            # One table for every head, and the latest query block reads about every key
            # block: full widths are what trimming would give.
            return tables_from_membership(causal.view(1, 1, *causal.shape), block, (len(gk), len(gq)), **fields)
        rowsel, chosen, most_chosen, most_readers = self._selections
        ratio = work.block_size // block
        member = chosen[..., gk // ratio] & causal
        # A query block's tiles lie in the index blocks it chose; a tile's readers chose its block.
        widths = (min(len(gk), most_chosen * _tiles_per_index_block(keys, block, ratio)), min(len(gq), most_readers))
        return tables_from_membership(member, block, widths, rowsel=rowsel, rowsel_ratio=ratio, **fields)

    def _vertical_slash(self, keys: TokenPositions) -> TileTables | None:
        """A vertical-slash step's tables (one launch on CUDA, ``tables_kernel``): the tiles
        of the ring's part between the rows and the chunk, or the whole index (tiles and
        bars) over whole-sequence keys (the all-gather's one piece)."""
        work = self.work
        index = work if isinstance(work, VerticalSlashIndex) else work.index
        block, n = index.block_size, index.num_blocks
        rows, chunk = _block_map(self.queries, block, n), _block_map(keys, block, n)
        whole = _whole_sequence(keys)
        bars = isinstance(work, VerticalSlashIndex)
        if rows is None or chunk is None or (bars and not whole):
            return None
        return vertical_slash_tables(index, rows, None if whole else chunk, bars)

    @functools.cached_property
    def _selections(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """A top-k index over this rank's rows: (the rows' selections ``[B, Hs, Lq, k]`` in
        global block ids, the index blocks each query block chose, the most index blocks one
        query block chose, the most query blocks that chose one index block).

        The two maxima are the layer call's one read from the device: they bound every
        step's table widths, and the tables are kept for the backward, so padding them to
        the block counts would hold tens of times the data a top-k selection has."""
        work = self.work
        rowsel = work.blocks[:, self.queries.values].permute(0, 2, 1, 3).contiguous()
        chosen = selection_union(rowsel, min(work.block_size, TOPK_TILE_CAP), -(-work.seq_len // work.block_size))
        most_chosen, most_readers = torch.stack([chosen.sum(-1).amax(), chosen.sum(-2).amax()]).tolist()
        return rowsel, chosen, most_chosen, most_readers

    def _bars(self, keys: TokenPositions) -> TileTables | None:
        """No tiles; each local query block reads a prefix of its head's vertical columns,
        as indices into the gathered keys at ``keys`` (see ``TileTables.bar_count``),
        which hold every column in position order. None unless the rows are whole blocks."""
        index = self.work.index
        rows = _block_map(self.queries, index.block_size, index.num_blocks)
        return None if rows is None else vertical_slash_tables(index, rows, columns=keys.int32)

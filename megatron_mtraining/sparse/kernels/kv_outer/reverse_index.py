"""Reverse index of a per-query top-k block selection, and the KV-outer kernels' work lists.

A ``BlockTopKIndex`` lists, per query token and selection head, the key blocks it attends.
KV-outer attention needs the transpose: per key block, the queries that chose it. Here the
queries are taken in chunks of ``chunk`` tokens (the kernels stream over them so their slot
buffers stay small), and each chunk's selections are grouped into *segments* of one
(batch, KV head, key block, selection head of that KV head), tokens ascending. The segments
of one (batch, KV head, key block), the block's *group*, are adjacent: their programs share
the key block's K/V.

A work list cuts each segment into *tiles* of ``tile_tokens`` tokens (with the G heads of a
selection head, one tile is the rows of one matrix product), and each group's tiles into
*items* of at most ``tiles_per_item`` tiles, one program each: a block that every query
chose (a "sink") spreads over many programs instead of one that runs orders of magnitude
longer than the rest.

Everything is torch on the index's device with sizes from shapes only: the tables have
upper-bound lengths, entries past the real counts are marked empty (no tokens, no tiles),
and nothing is read back on the host, so building them neither waits for the device nor
stops a CUDA graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReverseIndex:
    """The selections of ``blocks [B, S, Hs, k]`` (Hs a multiple of the KV head count,
    ``-1`` padded) grouped by (query chunk, segment). An *entry* is a flat position in
    ``blocks``: ``((b * S + token) * Hs + selection head) * k + slot``, so one int32 names
    the token, its selection head and the slot its partial results go to."""

    entries: torch.Tensor  # [B * S * Hs * k] int32, by (chunk, segment), tokens ascending; unselected last
    starts: torch.Tensor  # [n_chunks * n_segments + 1] int64: where each (chunk, segment) starts in entries
    shape: tuple[int, int, int, int]  # (B, S, Hs, k) of the selections
    kv_heads: int
    n_blocks: int  # key blocks
    chunk: int  # query tokens per chunk

    @property
    def n_chunks(self) -> int:
        return -(-self.shape[1] // self.chunk)

    @property
    def heads_per_kv(self) -> int:
        """Selection heads per KV head: the segments of one group."""
        return self.shape[2] // self.kv_heads

    @property
    def n_groups(self) -> int:
        """(batch, KV head, key block) groups of one chunk."""
        return self.shape[0] * self.kv_heads * self.n_blocks

    def chunk_entries(self) -> int:
        """Selections one chunk can hold."""
        b, _, hs, k = self.shape
        return b * self.chunk * hs * k


def reverse_index(blocks: torch.Tensor, kv_heads: int, n_blocks: int, chunk: int) -> ReverseIndex:
    """The reverse index of ``blocks [B, S, Hs, k]`` over ``n_blocks`` key blocks and
    ``kv_heads`` KV heads (selection head ``s`` reads KV head ``s // (Hs / kv_heads)``), in
    query chunks of ``chunk`` tokens: one sort of the entries by (chunk, segment). The sort
    is stable and the entries are numbered token-major, so a segment's tokens ascend."""
    b, s, hs, k = blocks.shape
    per_kv = hs // kv_heads
    n_keys = -(-s // chunk) * b * hs * n_blocks  # (chunk, segment) pairs
    dtype = torch.int32 if n_keys < 2**31 else torch.int64
    dev = blocks.device
    batch = torch.arange(b, device=dev, dtype=dtype).view(-1, 1, 1, 1)
    chunk_of = (torch.arange(s, device=dev, dtype=dtype) // chunk).view(1, -1, 1, 1)
    head = torch.arange(hs, device=dev, dtype=dtype).view(1, 1, -1, 1)
    segment = ((batch * kv_heads + head // per_kv) * n_blocks + blocks.to(dtype)) * per_kv + head % per_kv
    key = torch.where(blocks >= 0, chunk_of * (b * hs * n_blocks) + segment, n_keys).flatten()
    ordered, entries = key.sort(stable=True)
    starts = torch.searchsorted(ordered, torch.arange(n_keys + 1, device=dev, dtype=dtype))
    return ReverseIndex(entries.to(torch.int32), starts, (b, s, hs, k), kv_heads, n_blocks, chunk)


@dataclass
class WorkList:
    """Programs of one KV-outer pass, for every query chunk at once; the launch for chunk
    ``c`` runs items ``chunk_items[c] .. chunk_items[c + 1]`` (its grid is the bound
    ``items_per_chunk``; surplus programs exit at once). A chunk's items are longest first:
    the last programs to start are short ones, which shortens the launch's tail.

    With a partial pool, the dK/dV bookkeeping of the backward: a group whose tiles make
    several items has each item write its dK/dV to a partial buffer of its own (numbered
    from 0 in each chunk, so the buffers are reused), which ``splits`` then sums in item
    order; a group of one item adds its dK/dV to the running sums itself."""

    tiles: torch.Tensor  # [n, 2] int32: first entry in ReverseIndex.entries, tokens (0: empty)
    items: torch.Tensor  # [n, 3] int32: group ((b * Hkv + kv head) * n_blocks + key block), first tile, tiles
    chunk_items: torch.Tensor  # [n_chunks + 1] int32
    items_per_chunk: int
    partial: torch.Tensor | None = None  # [n] int32: each item's partial buffer, -1 for a group's only item
    splits: torch.Tensor | None = None  # [n, 3] int32: group, first partial, partials
    chunk_splits: torch.Tensor | None = None  # [n_chunks + 1] int32
    splits_per_chunk: int = 0


def _spread(counts: torch.Tensor, places: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``places`` consecutive places dealt out in order, ``counts[i]`` to owner ``i``: each
    place's owner and its rank among the owner's places. Places past the total go to the
    last owner with ranks at or past its count, which the callers read as empty."""
    ends = counts.cumsum(0)
    place = torch.arange(places, device=counts.device)
    owner = torch.searchsorted(ends, place, right=True).clamp(max=len(counts) - 1)
    return owner, place - (ends - counts)[owner]


def _ceil_div(a: torch.Tensor, b) -> torch.Tensor:
    return (a + b - 1) // b


def _item_caps(group_tiles: torch.Tensor, cap: int, most: int, pool: int | None) -> torch.Tensor:
    """Tiles per item for each chunk of ``group_tiles [n_chunks, n_groups]``: ``cap``, or
    without a partial ``pool`` large enough for the items of that cap's split groups, the
    least doubling of it whose split items fit (the last, ``most`` or more, splits nothing).
    A bound that holds for any selection would reserve a partial for nearly every item; a
    fixed pool, with longer items where a chunk's splits outgrow it, keeps memory fixed."""
    n_chunks = group_tiles.shape[0]
    if pool is None:
        return torch.full((n_chunks,), cap, device=group_tiles.device)
    caps = cap * 2 ** torch.arange(max(1, (most - 1) // cap).bit_length() + 1, device=group_tiles.device)
    items = _ceil_div(group_tiles.unsqueeze(-1), caps)
    fits = torch.where(items > 1, items, 0).sum(1) <= pool
    return caps[fits.int().argmax(1)]  # the first that fits


def work_list(rev: ReverseIndex, tile_tokens: int, tiles_per_item: int, partial_pool: int | None = None) -> WorkList:
    """Tiles of ``tile_tokens`` tokens and items of at most ``tiles_per_item`` tiles over
    ``rev`` (more where the split groups' dK/dV partials would not fit ``partial_pool``
    buffers a chunk); with a pool, the dK/dV bookkeeping of the backward (see ``WorkList``)."""
    per_kv, n_groups, n_chunks = rev.heads_per_kv, rev.n_groups, rev.n_chunks
    n_segments = n_groups * per_kv
    # A chunk's tiles: at most one partly filled tile per non-empty segment beyond the full ones.
    tiles_bound = rev.chunk_entries() // tile_tokens + min(n_segments, rev.chunk_entries())
    # Likewise items per group.
    items_bound = tiles_bound // tiles_per_item + min(n_groups, tiles_bound)

    count = rev.starts[1:] - rev.starts[:-1]  # per (chunk, segment)
    seg_tiles = _ceil_div(count, tile_tokens)
    owner, rank = _spread(seg_tiles, n_chunks * tiles_bound)
    first_entry = rev.starts[owner] + rank * tile_tokens
    tiles = torch.stack((first_entry, (count[owner] - rank * tile_tokens).clamp(0, tile_tokens)), 1)

    group_tiles = seg_tiles.view(-1, per_kv).sum(1)  # per (chunk, group)
    group_first = (seg_tiles.cumsum(0) - seg_tiles).view(-1, per_kv)[:, 0]
    most = per_kv * -(-rev.chunk // tile_tokens)  # tiles of a group every token of a chunk chose
    caps = _item_caps(group_tiles.view(n_chunks, n_groups), tiles_per_item, most, partial_pool)
    cap = caps.repeat_interleave(n_groups)  # per (chunk, group)
    group_items = _ceil_div(group_tiles, cap)
    owner, rank = _spread(group_items, n_chunks * items_bound)
    n_tiles = (group_tiles[owner] - rank * cap[owner]).clamp(min=0).minimum(cap[owner])
    items = torch.stack((owner % n_groups, group_first[owner] + rank * cap[owner], n_tiles), 1)
    # Longest first within each chunk; places past the total have no tiles, so stay last.
    order = (owner // n_groups * (tiles_bound + 1) + tiles_bound - n_tiles).sort(stable=True).indices
    work = WorkList(tiles.int(), items[order].int(), _chunk_bounds(group_items, n_chunks), items_bound)
    if partial_pool is not None:
        split = group_items > 1
        split_items = (group_items * split).view(n_chunks, n_groups)
        first_partial = (split_items.cumsum(1) - split_items).flatten()
        work.partial = torch.where(split[owner], first_partial[owner] + rank, -1)[order].int()
        work.splits_per_chunk = max(1, partial_pool // 2)
        owner, _ = _spread(split.long(), n_chunks * work.splits_per_chunk)
        work.splits = torch.stack((owner % n_groups, first_partial[owner], group_items[owner]), 1).int()
        work.chunk_splits = _chunk_bounds(split.long(), n_chunks)
    return work


def _chunk_bounds(per_group: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """``[n_chunks + 1]`` int32 offsets of each chunk's share of a per-(chunk, group) count."""
    ends = per_group.view(n_chunks, -1).sum(1).cumsum(0)
    return torch.cat((ends.new_zeros(1), ends)).int()

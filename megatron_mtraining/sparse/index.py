"""Sparse attention index types.

An index says which (query, key) pairs a head attends; causality (key <= query) is
always applied on top. Every type is a plain dataclass of tensors with two views:

* ``to_dense_mask(seq_len)``: the boolean ``[B, Hq, S, S]`` mask, written straight
  from the index's own fields. It exists for tests and debugging only.
* ``key_lists(q_start, q_end)``: for one chunk of query rows, the key positions a
  kernel visits, ``[B, Hs, R, nk]`` (``-1`` padded; ``R`` is 1 when all rows of the
  chunk share the list, else ``q_end - q_start``). ``Hs`` is the number of
  *selection heads*: 1 (shared by all heads), or a multiple of the KV head count
  that divides the query head count; selection head ``s`` serves query heads
  ``[s * Hq/Hs, (s+1) * Hq/Hs)``.

The two views are derived independently on purpose: the attention tests compare
the kernels, which read ``key_lists``, with dense attention under
``to_dense_mask``, so a conversion bug cannot hide behind a shared helper.
``attended_area`` is a third derivation, closed forms over per-block counts (the
metrics and the ring's accounting call it every step); its tests check it against both.

Packed documents (``documents``, see ``documents.py``): a row sees no key before the start
of its document. ``key_lists`` may still name such keys (a list shared by a query block's
rows); ``visible``, ``to_dense_mask`` and the area accounting apply the bound.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from .documents import Documents, check_documents
from .host_tables import to_device
from .validation import check_int, check_tensor, fail

INT32_MAX = torch.iinfo(torch.int32).max
# Entries of a top-k index's selections that attended_area gathers per operation.
_AREA_ENTRIES = 1 << 22


class SparseIndex:
    """Behaviour common to every index dataclass."""

    # Attends every causal (query, key) pair: its attended fraction and recall are 1 by
    # definition, so the metrics need not count them.
    complete: ClassVar[bool] = False
    batch_size: int
    num_heads: int
    seq_len: int
    # Global token positions of the query rows and key columns, when they are not
    # simply 0..S-1 (a context-parallel rank's tokens); causality compares these.
    query_positions: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    # Packed documents (``documents.py``): row ``i`` sees no key before
    # ``documents.starts[i]``; None: one document.
    documents: Documents | None = None

    def to(self, device) -> SparseIndex:
        def move(v):
            if isinstance(v, (torch.Tensor, Documents)):
                return v.to(device)
            return torch.device(device) if isinstance(v, torch.device) else v

        return type(self)(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})

    @property
    def selection_heads(self) -> int:
        raise NotImplementedError

    @property
    def query_chunk(self) -> int:
        """Query rows per ``key_lists`` call; chunks must start at multiples of it."""
        raise NotImplementedError

    def key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        raise NotImplementedError

    def bounded_key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        """``key_lists`` padded (-1) to a width that follows from the index's shapes, where
        ``key_lists`` trims its lists to the longest one by reading their lengths on the host,
        which waits for the device: for callers on the training step's path (the recall
        metric), to which the padding costs little. The same as ``key_lists`` for the types
        whose lists read nothing."""
        return self.key_lists(q_start, q_end)

    def chunk_key_lists(self, starts: list[int]) -> torch.Tensor:
        """``[B, Hs, len(starts), width]``: the ``bounded_key_lists`` of the chunks starting at
        ``starts`` (multiples of ``query_chunk``), -1 padded to the widest, for the types that
        list one set of keys for all the rows of a chunk."""
        lists = [self.bounded_key_lists(q0, min(q0 + self.query_chunk, self.seq_len)) for q0 in starts]
        if any(keys.shape[2] != 1 for keys in lists):
            fail(f"{type(self).__name__}.chunk_key_lists", "a list per row", "one key list per chunk")
        width = max(keys.shape[-1] for keys in lists)
        return torch.cat([torch.nn.functional.pad(keys, (0, width - keys.shape[-1]), value=-1) for keys in lists], 2)

    def query_ranges(self, num_rows: int) -> list[tuple[int, int]]:
        """The row chunks ``key_lists`` is called with."""
        return [(q0, min(q0 + self.query_chunk, num_rows)) for q0 in range(0, num_rows, self.query_chunk)]

    def visible(self, keys: torch.Tensor, q_start: int, q_end: int) -> torch.Tensor:
        """Which entries of ``key_lists(q_start, q_end)`` a row sees: listed, causal and in
        the row's document (by global position). Broadcasts to ``[B, Hs, q_end - q_start, nk]``."""
        rows = torch.arange(q_start, q_end, device=keys.device)
        if self.query_positions is not None:
            rows = self.query_positions[q_start:q_end]
        key_pos = keys if self.key_positions is None else self.key_positions[keys.clamp(min=0)]
        seen = (keys >= 0) & (key_pos <= rows.view(1, 1, -1, 1))
        if self.documents is not None:
            seen &= key_pos >= self.documents.starts[rows.long()].view(1, 1, -1, 1)
        return seen

    def to_dense_mask(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError

    def check_compatible(
        self, batch_size: int, num_heads: int, seq_len: int, num_kv_heads: int, device: torch.device | None = None
    ) -> None:
        """Raises ValueError unless this index was built for these shapes (and device)."""
        name = type(self).__name__
        if device is not None and not _same_device(self.device, device):
            fail(
                f"index.device ({name})", str(self.device), f"the device of q ({device}); move it with index.to(device)"
            )
        if self.seq_len != seq_len:
            fail(f"index.seq_len ({name})", self.seq_len, f"the sequence length of q ({seq_len})")
        if self.batch_size != batch_size:
            fail(f"index.batch_size ({name})", self.batch_size, f"the batch size of q ({batch_size})")
        if self.num_heads != num_heads:
            fail(f"index.num_heads ({name})", self.num_heads, f"the query head count of q ({num_heads})")
        hs = self.selection_heads
        if hs != 1 and (hs % num_kv_heads or num_heads % hs):
            fail(
                f"index selection heads ({name})",
                hs,
                f"1, or a multiple of the KV head count {num_kv_heads} that divides {num_heads}",
            )

    def attended_area(self) -> torch.Tensor:
        """Attended (query, key) pairs per (batch, query head), ``[B, Hq]`` int64, as the
        kernels read the key lists (causality included)."""
        return self.area_between(None, None)

    def area_between(self, query_positions: torch.Tensor | None, key_positions: torch.Tensor | None) -> torch.Tensor:
        """``attended_area`` restricted to the query rows at global positions
        ``query_positions`` and the keys at ``key_positions`` (a context-parallel rank's
        rows and one chunk's keys; ``None``: all of them; ``-1`` pads keys), ``[B, Hq]``
        int64. Closed forms over per-block counts: a few tensor operations whatever the
        length (a top-k index's per chunk of ~4M selected blocks), nothing read on the host."""
        rows = _PositionSet(query_positions, self.seq_len, self.device)
        keys = _PositionSet(key_positions, self.seq_len, self.device)
        area = self._area(rows, keys).expand(self.batch_size, -1)
        return area.repeat_interleave(self.num_heads // self.selection_heads, dim=1)

    def _area(self, rows: _PositionSet, keys: _PositionSet) -> torch.Tensor:
        """``area_between`` per selection head, ``[B or 1, Hs]`` int64."""
        raise NotImplementedError

    def block_areas(self, block: int) -> torch.Tensor:
        """``[n, n]`` attended pairs between query block i and key block j (``block``
        tokens), summed over batch and heads, from the key lists the kernels read."""
        n = -(-self.seq_len // block)
        area = torch.zeros(n * n, dtype=torch.float64, device=self.device)
        for q0, q1 in self.query_ranges(self.seq_len):
            keys = self.key_lists(q0, q1)
            visible = self.visible(keys, q0, q1)
            keys = keys.expand_as(visible)  # a list shared by a chunk's rows counts for each row
            rows = torch.arange(q0, q1, device=keys.device).view(1, 1, -1, 1).expand_as(keys)
            pair = ((rows // block) * n + keys.clamp(min=0) // block)[visible]
            # Each entry stands for the query heads of its selection head (and for every
            # batch element when the list is shared across the batch).
            weight = self.num_heads // self.selection_heads * self.batch_size // keys.shape[0]
            area.index_add_(0, pair, torch.full(pair.shape, float(weight), dtype=torch.float64, device=area.device))
        return area.view(n, n)

    def causal_area(self) -> int:
        """(query, key) pairs that dense causal attention attends per head: the causal
        triangle, or with documents each document's."""
        lengths = [self.seq_len] if self.documents is None else self.documents.lengths()
        return sum(n * (n + 1) // 2 for n in lengths)

    def density(self) -> float:
        """Attended fraction of the causal triangle (each document's, with documents),
        averaged over batch and heads."""
        return float(self.attended_area().double().mean() / self.causal_area())

    @property
    def device(self) -> torch.device:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _causal(seq_len: int, device, documents: Documents | None = None) -> torch.Tensor:
    """``[S, S]``: key at or before the row (and, with ``documents``, in its document)."""
    i = torch.arange(seq_len, device=device)
    causal = i.view(-1, 1) >= i.view(1, -1)
    return causal if documents is None else causal & documents.mask().to(device)


def _blocks_to_tokens(blocks: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """Expands block ids ``[..., n]`` (-1 = none) to token positions ``[..., n * block_size]``."""
    tokens = blocks.long().unsqueeze(-1) * block_size + torch.arange(block_size, device=blocks.device)
    tokens = torch.where((blocks.unsqueeze(-1) >= 0) & (tokens < seq_len), tokens, -1)
    return tokens.flatten(-2)


def select_topk_blocks(block_scores: torch.Tensor, own_block: torch.Tensor, topk: int) -> torch.Tensor:
    """Per query row: its own block plus the ``topk - 1`` best-scoring visible others, ties to
    the lower block id: the top by (score descending, block id ascending), exactly, as the MSA
    selection kernel (``kernels/index_build/msa_index.py``) takes them.

    ``block_scores [..., nq, n_blocks]`` holds -inf for blocks the row cannot see (a NaN is
    never taken); ``own_block [nq]``. Returns int32 ``[..., nq, topk]``, ascending, ``-1`` padded
    (all visible blocks when fewer than ``topk`` are). Ranks raw scores: no softmax is needed to
    choose. Selections run on the scores' dtype and on int32 keys.
    """
    n = block_scores.shape[-1]
    k = min(topk, n)
    own = own_block.view(-1, 1).expand(block_scores.shape[:-1] + (1,)).long()
    inf = float("inf")
    scores = block_scores.nan_to_num(-inf, inf, -inf).scatter_(-1, own, inf)
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    # torch.topk leaves the order of equal scores open; the k smallest of these keys are the
    # blocks above the k-th score, then its equals by id.
    ids = torch.arange(n, dtype=torch.int32, device=scores.device)
    key = torch.where(scores > kth, ids, ids + n)
    key = torch.where((scores >= kth) & (scores > -inf), key, INT32_MAX)
    # The own block's key is the smallest (``% n`` maps it back): kept even where ``k`` other
    # blocks score +inf too, as its own +inf would tie with them by id.
    key.scatter_(-1, own, (own - n).to(torch.int32))
    first = key.topk(k, dim=-1, largest=False, sorted=False).values
    # Width k, a bound from the shapes: the longest row would be read on the host.
    chosen = sort_kept(torch.where(first < INT32_MAX, first % n, INT32_MAX), k)
    pad = topk - k
    return torch.nn.functional.pad(chosen, (0, pad), value=-1) if pad else chosen


def compact(values: torch.Tensor, keep: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves the kept entries of ``values`` (ascending where ``values`` is) to the front
    of the last dimension, pads with -1, and trims to ``width`` entries: a bound on the
    kept entries per row, at most ``values.shape[-1]``; by default the longest row, which
    reads the counts on the host (a device synchronisation).
    Returns ``(compacted int32, count int32)``."""
    count = keep.sum(-1)
    if width is None:
        width = int(count.max()) if count.numel() else 0
    return sort_kept(torch.where(keep, values, INT32_MAX), width), count.to(torch.int32)


def sort_kept(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` in ascending order along the last dimension, trimmed to ``width`` entries,
    with the dropped ones (``INT32_MAX``, sorted last) as -1 padding; int32."""
    ordered = values.sort(dim=-1).values[..., :width]
    return torch.where(ordered == INT32_MAX, -1, ordered).to(torch.int32)


def single_device(t: torch.Tensor) -> torch.Tensor:
    """The all-reduce hook of the index builders and the recall on one device: nothing to
    combine (context parallelism passes collectives over its group instead)."""
    return t


def position_lookup(positions: torch.Tensor, seq_len: int, missing: int = -1) -> torch.Tensor:
    """Table ``[seq_len + 1]`` int64: the index in ``positions`` of each global position,
    ``missing`` where it is not there. ``positions`` may hold -1 padding, and looking up
    -1 as ``seq_len`` (the spare last slot) gives ``missing``."""
    table = torch.full((seq_len + 1,), missing, dtype=torch.int64, device=positions.device)
    table[torch.where(positions >= 0, positions, seq_len)] = torch.arange(len(positions), device=positions.device)
    table[seq_len:].fill_(missing)  # a Python scalar stored by index is a synchronising copy
    return table


class _PositionSet:
    """Global positions in ``[0, seq_len)`` (``None``: all of them), counted by range."""

    def __init__(self, positions: torch.Tensor | None, seq_len: int, device):
        self.seq_len = seq_len
        if positions is None:
            self.values = torch.arange(seq_len, device=device)
            self.sorted = None
        else:
            # Padding sorts to seq_len, which no counted range reaches.
            self.values = positions.long()
            self.sorted = torch.where(self.values >= 0, self.values, seq_len).sort().values

    def before(self, p: torch.Tensor) -> torch.Tensor:
        """How many members lie below each position of ``p`` (int64, ``p``'s shape)."""
        p = p.long().clamp(0, self.seq_len)
        return p if self.sorted is None else torch.searchsorted(self.sorted, p)

    def between(self, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """How many members lie in each ``[start, end)``."""
        return self.before(end) - self.before(start)

    def per_block(self, block: int) -> torch.Tensor:
        """Members in each ``block``-token block, ``[n_blocks]`` int64."""
        bounds = self.before(torch.arange(-(-self.seq_len // block) + 1, device=self.values.device) * block)
        return bounds[1:] - bounds[:-1]


def _document_segments(docs: Documents, block: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, document) of each of the ``n_blocks + n_documents`` slots of
    ``Documents.segment_offsets``' numbering, int64; a slot no position reaches (a document
    ending on a block edge leaves one) gets a valid pair."""
    slot = torch.arange(n_blocks + docs.count, device=docs.device)
    doc = torch.searchsorted(docs.segment_offsets(block), slot, right=True) - 1
    return (slot - doc).clamp(max=n_blocks - 1), doc


def _correlate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c[..., d] = sum_j a[..., j] * b[..., j - d]`` for ``d`` in ``[0, n)`` (``b`` zero
    outside ``[0, n)``), for counts (non-negative integers), int64.

    By FFT: O(n log n) where the direct sum is O(n^2) (n is 8K blocks at 512K tokens).
    Here ``a`` holds rows and ``b`` keys (at most ``block``) or flags per block, so the
    float64 rounding error, about 2^-53 * log2(n) * |a| * |b| <= 2^-53 * log2(n) *
    seq_len * block, stays far below 0.5 and rounding gives the exact count."""
    n = a.shape[-1]
    fa, fb = (torch.fft.rfft(x.double(), 2 * n) for x in (a, b))
    return torch.fft.irfft(fa * fb.conj(), 2 * n)[..., :n].round().long()


@dataclass
class DenseIndex(SparseIndex):
    """Full causal attention, expressed as an index so one code path serves all."""

    complete: ClassVar[bool] = True
    batch_size: int
    num_heads: int
    seq_len: int
    device: torch.device = torch.device("cpu")
    # With documents: block-diagonal causal attention, each document its own causal triangle.
    documents: Documents | None = None

    def __post_init__(self):
        check_documents("DenseIndex.documents", self.documents, self.seq_len)

    @property
    def selection_heads(self) -> int:
        return 1

    @property
    def query_chunk(self) -> int:
        return 64

    def key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        # With documents, from the document start of the chunk's first row (on the host).
        first = 0 if self.documents is None else _document_start(self.documents, q_start)
        keys = torch.arange(first, q_end, device=self.device)
        return keys.view(1, 1, 1, -1).expand(self.batch_size, 1, 1, -1)

    def _area(self, rows: _PositionSet, keys: _PositionSet) -> torch.Tensor:
        q = rows.values
        if self.documents is None:
            return keys.before(q + 1).sum().view(1, 1)
        return keys.between(self.documents.starts[q].long(), q + 1).sum().view(1, 1)

    def block_areas(self, block: int) -> torch.Tensor:
        # Closed form per row: the keys of block j in [row's document start, row]; the
        # generic count enumerates every pair (S^2).
        n, seq = -(-self.seq_len // block), self.seq_len
        first = torch.arange(n, device=self.device) * block
        last = torch.clamp(first + block, max=seq) - 1
        if self.documents is None:
            # Whole blocks below the diagonal, a triangle on it: O(n^2), not O(S n).
            size = (last - first + 1).double()
            area = torch.tril(size.view(-1, 1) * size.view(1, -1), -1)
            area.diagonal().copy_(size * (size + 1) / 2)
            return area * (self.batch_size * self.num_heads)
        area = torch.zeros(n, n, dtype=torch.float64, device=self.device)
        for r0 in range(0, seq, 8192):
            rows = torch.arange(r0, min(r0 + 8192, seq), device=self.device)
            lo = torch.zeros_like(rows) if self.documents is None else self.documents.starts[rows].long()
            count = (torch.minimum(rows.view(-1, 1), last) - torch.maximum(lo.view(-1, 1), first) + 1).clamp(min=0)
            area.index_add_(0, rows // block, count.double())
        return area * (self.batch_size * self.num_heads)

    def to_dense_mask(self, seq_len: int) -> torch.Tensor:
        _check_mask_len(self, seq_len)
        causal = _causal(seq_len, self.device, self.documents)
        return causal.expand(self.batch_size, self.num_heads, seq_len, seq_len).clone()


def _document_start(documents: Documents, position: int) -> int:
    """The start of the document holding ``position``, from the host copy of the bounds."""
    return documents.bounds[bisect.bisect_right(documents.bounds, position) - 1]


@dataclass
class BlockColumns:
    """Kernel form of a vertical-slash index for a range of query blocks: per query
    block, the active KV blocks (whole tiles, ascending) and the extra single key
    columns ("bars", ascending) that no active tile covers. ``-1`` pads."""

    block_idx: torch.Tensor  # [B, Hq, n_qblocks, max_blocks] int32
    block_count: torch.Tensor  # [B, Hq, n_qblocks] int32
    column_idx: torch.Tensor  # [B, Hq, n_qblocks, max_columns] int32
    column_count: torch.Tensor  # [B, Hq, n_qblocks] int32


@dataclass
class VerticalSlashIndex(SparseIndex):
    """MTraining's vertical-slash index, per (batch, query head).

    ``slash`` holds *block-diagonal* offsets ``d``: tile (query block qb, key block kb)
    is attended when ``qb - kb == d``. ``vertical`` holds key token positions attended
    by every (causally later) query. Both ascending, ``-1`` padded.

    With ``documents`` each document has its own diagonals, ``slash [B, Hq, n_documents,
    max_slash]``: a row attends the tiles of its document's diagonals (on the sequence's
    block grid) and always block diagonal 0 (its document's keys of its own block up to
    itself). ``vertical`` lists every document's columns (global positions, ascending),
    which only rows of the same document see (the document bound). A document that
    starts inside a query block sees only that block's tile there (every earlier key
    lies before its start), so a query block's tiles are those of the document holding
    its first row, and its rows share one key list.
    """

    vertical: torch.Tensor  # [B, Hq, max_vertical] int32
    slash: torch.Tensor  # [B, Hq, max_slash] int32; with documents [B, Hq, n_documents, max_slash]
    seq_len: int
    block_size: int
    documents: Documents | None = None

    def __post_init__(self):
        check_documents("VerticalSlashIndex.documents", self.documents, self.seq_len)
        if self.documents is None and self.slash.dim() != 3:
            fail("VerticalSlashIndex.slash.shape", tuple(self.slash.shape), "[B, Hq, max_slash] (no documents)")
        if self.documents is not None and (self.slash.dim() != 4 or self.slash.shape[2] != self.documents.count):
            fail(
                "VerticalSlashIndex.slash.shape",
                tuple(self.slash.shape),
                f"[B, Hq, n_documents = {self.documents.count}, max_slash]: one diagonal list per document",
            )

    @property
    def batch_size(self) -> int:
        return self.vertical.shape[0]

    @property
    def num_heads(self) -> int:
        return self.vertical.shape[1]

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def selection_heads(self) -> int:
        return self.num_heads

    @property
    def query_chunk(self) -> int:
        return self.block_size

    def within(self, documents: Documents) -> VerticalSlashIndex:
        """The same lists under ``documents``' mask: every document keeps this index's
        diagonals and sees only its own columns. The like-for-like comparison of a packed
        sample's attention with and without its documents."""
        if self.documents is not None:
            fail("VerticalSlashIndex.documents", f"{self.documents.count} documents", "None (within() adds them)")
        slash = self.slash.unsqueeze(2).expand(-1, -1, documents.count, -1).contiguous()
        return dataclasses.replace(self, slash=slash, documents=documents)

    def active_diagonals(self) -> torch.Tensor:
        """``[B, Hq, n_blocks]`` bool: which block diagonals are attended (with documents,
        ``[B, Hq, n_documents, n_blocks]``, diagonal 0 always)."""
        active = torch.zeros(*self.slash.shape[:-1], self.num_blocks + 1, dtype=torch.bool, device=self.device)
        active.scatter_(-1, torch.where(self.slash >= 0, self.slash.long(), self.num_blocks), True)
        if self.documents is not None:
            active[..., 0].fill_(True)
        return active[..., :-1]

    def document_active(self) -> tuple[torch.Tensor, torch.Tensor]:
        """With documents, every document's attended diagonals in one flat table:
        (``[B, Hq, n_blocks + n_documents]`` bool, where document ``m``'s diagonal ``d`` is
        entry ``offsets[m] + d``; ``offsets [n_documents]`` int64). A document touching
        ``span`` blocks has diagonals ``0 .. span - 1`` only (none of its rows is further
        from one of its keys). Its offset is ``cu[m] // block + m``, which leaves it
        ``cu[m + 1] // block - cu[m] // block + 1 >= span`` entries (one spare where it ends
        on a block edge): a kernel finds it from the boundaries alone, with no prefix sum
        (``tables_kernel``). The table is O(blocks + documents) per head, where
        ``[n_documents, n_blocks]`` would be their product."""
        docs = self.documents
        width = self.num_blocks + docs.count
        spans = docs.spans(self.block_size)
        offsets = docs.segment_offsets(self.block_size)
        d = self.slash.long()
        ok = (d >= 0) & (d < spans.view(-1, 1))
        flat = torch.zeros(*self.slash.shape[:2], width + 1, dtype=torch.bool, device=self.device)
        flat.scatter_(-1, torch.where(ok, offsets.view(-1, 1) + d, width).flatten(2), True)
        flat.index_fill_(-1, offsets, True)  # diagonal 0 of every document
        return flat[..., :width], offsets

    def _document_in_tile(self, q_block: torch.Tensor, key_block: torch.Tensor) -> torch.Tensor:
        """With documents: whether key block ``key_block`` is an attended tile of query block
        ``q_block`` (broadcast together) for the rows of the document holding the query
        block's first row (whose keys it must hold to be seen)."""
        docs = self.documents
        flat, offsets = self.document_active()
        first_doc = docs.ids[q_block.long() * self.block_size].long()
        diag = q_block - key_block
        ok = (diag >= 0) & (diag < docs.spans(self.block_size)[first_doc])
        at = torch.where(ok, offsets[first_doc] + diag, 0)
        at = at.expand(*flat.shape[:2], *at.shape[2:])
        return ok & flat.gather(-1, at.flatten(2)).view(at.shape)

    def block_diagonals(self, qb: torch.Tensor) -> torch.Tensor:
        """``[B, Hq, len(qb), max_slash]`` int64: the diagonals of query blocks ``qb``: the
        index's, or with documents those of the document holding each block's first row."""
        if self.documents is None:
            return self.slash.long().unsqueeze(2).expand(-1, -1, len(qb), -1)
        first_doc = self.documents.ids[qb.long() * self.block_size].long()
        return self.slash.long().index_select(2, first_doc)

    def block_columns(
        self,
        qblock_start: int = 0,
        qblock_end: int | None = None,
        qblocks: torch.Tensor | None = None,
        bounded: bool = False,
    ) -> BlockColumns:
        """The kernel form of query blocks ``qblock_start .. qblock_end`` (or of the query
        blocks listed in ``qblocks``, e.g. a context-parallel rank's). Lists are trimmed to
        the longest, which reads their lengths on the host; with ``bounded``, padded to what
        a block can list at most: every diagonal (and with documents its own tile) and
        every column of its head."""
        qblock_end = self.num_blocks if qblock_end is None else qblock_end
        bs, dev = self.block_size, self.device
        if qblocks is None:
            qb = torch.arange(qblock_start, qblock_end, device=dev, dtype=torch.int32)
        else:
            qb = qblocks.to(device=dev, dtype=torch.int32)
        if self.documents is not None:
            return self._document_block_columns(qb.long(), bounded)
        # Tiles: key block qb - d for each attended diagonal d <= qb.
        kb = qb.view(1, 1, -1, 1) - self.slash.unsqueeze(2)
        block_idx, block_count = compact(
            kb, (self.slash.unsqueeze(2) >= 0) & (kb >= 0), self.slash.shape[-1] if bounded else None
        )
        # Bars: vertical columns visible to some row of the block and outside its tiles.
        diag = qb.view(1, 1, -1, 1) - (self.vertical // bs).unsqueeze(2)
        active = self.active_diagonals()
        in_tile = (diag >= 0) & active.gather(-1, diag.clamp(0, self.num_blocks - 1).long().flatten(2)).view(diag.shape)
        last_row = torch.clamp((qb + 1) * bs, max=self.seq_len) - 1
        visible = (self.vertical.unsqueeze(2) >= 0) & (self.vertical.unsqueeze(2) <= last_row.view(1, 1, -1, 1))
        column_idx, column_count = compact(
            self.vertical.unsqueeze(2).expand_as(diag), visible & ~in_tile, self.vertical.shape[-1] if bounded else None
        )
        return BlockColumns(block_idx, block_count, column_idx, column_count)

    def _document_block_columns(self, qb: torch.Tensor, bounded: bool) -> BlockColumns:
        """``block_columns`` with documents: the tiles of the diagonals of the document holding
        each block's first row, from its start's key block on, and the block's own tile;
        the bars, its columns from that start on that are in no such tile."""
        bs = self.block_size
        firsts = self.documents.starts[qb * bs].long().view(1, 1, -1, 1)
        diags = self.block_diagonals(qb)
        qbv = qb.view(1, 1, -1, 1)
        kb = qbv - diags
        own = qbv.expand(*diags.shape[:3], 1)
        keep = torch.cat([(diags > 0) & (kb >= firsts // bs), torch.ones_like(own, dtype=torch.bool)], -1)
        block_idx, block_count = compact(torch.cat([kb, own], -1).int(), keep, keep.shape[-1] if bounded else None)
        v = self.vertical.long().unsqueeze(2)
        last_row = torch.clamp((qb + 1) * bs, max=self.seq_len).view(1, 1, -1, 1) - 1
        visible = (v >= firsts) & (v <= last_row)  # a column before the start: no row of the block sees it
        in_tile = self._document_in_tile(qbv, v.clamp(min=0) // bs)
        column_idx, column_count = compact(
            v.expand_as(in_tile).int(), visible & ~in_tile, self.vertical.shape[-1] if bounded else None
        )
        return BlockColumns(block_idx, block_count, column_idx, column_count)

    def key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        return torch.cat(self.tile_and_bar_keys(q_start), dim=-1)

    def bounded_key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        return torch.cat(self.tile_and_bar_keys(q_start, bounded=True), dim=-1)

    def chunk_key_lists(self, starts: list[int]) -> torch.Tensor:
        # Every chunk's query block in one ``block_columns`` call: its launches once, not per chunk.
        qb = to_device(torch.tensor(starts, dtype=torch.int32) // self.block_size, self.device)
        columns = self.block_columns(qblocks=qb, bounded=True)
        tiles = _blocks_to_tokens(columns.block_idx, self.block_size, self.seq_len)
        return torch.cat([tiles, columns.column_idx.long()], dim=-1)

    def tile_and_bar_keys(self, q_start: int, bounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Key positions of the query block at ``q_start``: (its tiles' tokens, its bars);
        ``bounded`` as for ``block_columns``."""
        qb = q_start // self.block_size
        columns = self.block_columns(qb, qb + 1, bounded=bounded)
        return _blocks_to_tokens(columns.block_idx, self.block_size, self.seq_len), columns.column_idx.long()

    def _area(self, rows: _PositionSet, keys: _PositionSet) -> torch.Tensor:
        return self._part_area(rows, keys, "tiles") + self._part_area(rows, keys, "bars")

    def _part_area(self, rows: _PositionSet, keys: _PositionSet, part: str) -> torch.Tensor:
        """``_area`` of the tiles or of the bars alone, ``[B, Hq]``."""
        if self.documents is not None:
            return self._document_part_area(rows, keys, part)
        bs = self.block_size
        active = self.active_diagonals()
        row_blocks = rows.per_block(bs)
        if part == "tiles":
            # Diagonal d >= 1 pairs every row of block qb with every key of block qb - d;
            # on diagonal 0 a row sees its block's keys up to itself.
            q = rows.values
            pairs = _correlate(row_blocks, keys.per_block(bs))
            pairs[0] = keys.between(q // bs * bs, q + 1).sum()
            return (active * pairs).sum(-1)
        v = self.vertical.long()
        vb = v.clamp(min=0) // bs
        present = (v >= 0) & (keys.between(v, v + 1) > 0)
        # A column is a bar for the rows of its own block at or after it unless diagonal 0
        # is a tile, and for every row of a later block vb + d whose diagonal d is not one.
        own = rows.between(v, (vb + 1) * bs) * ~active[..., :1]
        not_tile = ~active
        not_tile[..., 0].fill_(False)
        later = _correlate(row_blocks, not_tile).gather(-1, vb)
        return ((own + later) * present).sum(-1)

    def _document_part_area(self, rows: _PositionSet, keys: _PositionSet, part: str) -> torch.Tensor:
        """``_part_area`` with documents: per query block (tiles) or per column (bars) and
        listed diagonal, O((blocks + columns) x diagonals) per head."""
        bs, docs = self.block_size, self.documents
        cu = docs.cu_seqlens.long()
        if part == "tiles":
            # Diagonal 0, every row: its document's keys of its own block up to itself.
            q = rows.values
            own = keys.between(torch.maximum(q // bs * bs, docs.starts[q].long()), q + 1).sum()
            # Diagonals d >= 1 serve the rows of block qb in the document holding its first
            # row (those of a document starting inside the block see nothing before it).
            qb = torch.arange(self.num_blocks, device=self.device)
            first_doc = docs.ids[qb * bs].long()
            block_rows = rows.between(qb * bs, torch.minimum((qb + 1) * bs, cu[first_doc + 1])).clamp(min=0)
            diags = self.block_diagonals(qb)
            kb = qb.view(1, 1, -1, 1) - diags
            pairs = keys.between(torch.maximum(kb * bs, cu[first_doc].view(1, 1, -1, 1)), (kb + 1) * bs).clamp(min=0)
            return ((pairs * ((diags > 0) & (kb >= 0))).sum(-1) * block_rows).sum(-1) + own
        # A column is a bar for the rows of its document after its own block, except those of
        # the blocks vb + d on its document's diagonals d >= 1 (diagonal 0 is always a tile).
        v = self.vertical.long()
        vc = v.clamp(min=0)
        vb = vc // bs
        doc = docs.ids[vc].long()
        present = (v >= 0) & (keys.between(vc, vc + 1) > 0)
        after = (rows.between((vb + 1) * bs, cu[doc + 1]).clamp(min=0) * present).sum(-1)
        # The tiled rows depend on a column's block and document alone, so they are counted
        # per (block, document) segment, weighted by the columns there: the vertical list is
        # padded to every sparse document's cap, far wider than the segments.
        seg_block, seg_doc = _document_segments(docs, bs, self.num_blocks)
        weight = torch.zeros(*v.shape[:2], len(seg_doc), dtype=torch.int64, device=v.device)
        weight.scatter_add_(-1, vb + doc, present.long())
        d = self.slash.long().index_select(2, seg_doc)
        lo = (seg_block.view(-1, 1) + d) * bs
        tiled = rows.between(lo, torch.minimum(lo + bs, cu[seg_doc + 1].view(-1, 1))).clamp(min=0) * (d > 0)
        return after - (tiled.sum(-1) * weight).sum(-1)

    def to_dense_mask(self, seq_len: int) -> torch.Tensor:
        _check_mask_len(self, seq_len)
        pos = torch.arange(seq_len, device=self.device)
        diag = (pos.view(-1, 1) // self.block_size) - (pos.view(1, -1) // self.block_size)
        if self.documents is None:
            on_slash = self.active_diagonals()[..., diag.clamp(min=0)] & (diag >= 0)
        else:  # each row with its own document's diagonals
            docs = self.documents
            flat, offsets = self.document_active()
            row_doc = docs.ids.long().view(-1, 1)
            ok = (diag >= 0) & (diag < docs.spans(self.block_size)[row_doc])
            on_slash = flat[..., torch.where(ok, offsets[row_doc] + diag, 0)] & ok
        on_vertical = torch.zeros(self.batch_size, self.num_heads, seq_len + 1, dtype=torch.bool, device=self.device)
        on_vertical.scatter_(-1, torch.where(self.vertical >= 0, self.vertical.long(), seq_len), True)
        return _causal(seq_len, self.device, self.documents) & (on_slash | on_vertical[..., None, :seq_len])


@dataclass
class VerticalSlashPart(SparseIndex):
    """Only the tiles (``part="tiles"``) or only the bars (``"bars"``) of a vertical-slash
    index: context parallelism runs the tiles on the ring and the bars locally."""

    index: VerticalSlashIndex
    part: str

    def __post_init__(self):
        if self.part not in ("tiles", "bars"):
            fail("VerticalSlashPart.part", self.part, "'tiles' or 'bars'")

    batch_size = property(lambda self: self.index.batch_size)
    num_heads = property(lambda self: self.index.num_heads)
    seq_len = property(lambda self: self.index.seq_len)
    selection_heads = property(lambda self: self.index.selection_heads)
    query_chunk = property(lambda self: self.index.query_chunk)
    device = property(lambda self: self.index.device)
    documents = property(lambda self: self.index.documents)

    def key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        tiles, bars = self.index.tile_and_bar_keys(q_start)
        return tiles if self.part == "tiles" else bars

    def _area(self, rows: _PositionSet, keys: _PositionSet) -> torch.Tensor:
        return self.index._part_area(rows, keys, self.part)

    def block_areas(self, block: int) -> torch.Tensor:
        if block != self.index.block_size or (self.part != "tiles" and self.documents is not None):
            return super().block_areas(block)
        n, bs, s = self.index.num_blocks, block, self.seq_len
        qb = torch.arange(n, device=self.device).view(-1, 1)
        kb = torch.arange(n, device=self.device).view(1, -1)
        if self.documents is not None:
            # An attended tile's rows see their document's keys in it: the pairs that
            # block-diagonal causal attention has there (none where no row's document reaches).
            hits = self.index._document_in_tile(qb.view(1, 1, n, 1), kb.view(1, 1, 1, n)).double().sum((0, 1))
            return hits * DenseIndex(1, 1, s, device=self.device, documents=self.documents).block_areas(block)
        diag = qb - kb
        rows = torch.clamp(s - qb * bs, max=bs).double()
        active = self.index.active_diagonals()
        if self.part == "bars":
            return self._bar_block_areas(active, diag, rows)
        # Tiles are whole blocks: area = active diagonal x the tile's pairs (causal on the diagonal).
        hits = (active[..., diag.clamp(min=0)] & (diag >= 0)).double().sum((0, 1))
        cols = torch.clamp(s - kb * bs, max=bs).double()
        pairs = torch.where(diag == 0, rows * (rows + 1) / 2, rows * cols)
        return hits * pairs

    def _bar_block_areas(self, active: torch.Tensor, diag: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The bars per block pair, as ``_part_area`` counts them: a column of key block kb is a
        bar for every row of a later block kb + d whose diagonal d is no tile, and for the rows
        of its own block at or after it where diagonal 0 is none. O(heads n^2), not O(pairs)."""
        bs, s, n = self.index.block_size, self.seq_len, self.index.num_blocks
        v = self.index.vertical.long()
        present = (v >= 0).double()
        vb = v.clamp(min=0) // bs
        columns = torch.zeros(*v.shape[:-1], n, dtype=torch.float64, device=v.device).scatter_add_(-1, vb, present)
        after = (torch.clamp((vb + 1) * bs, max=s) - v).double() * present
        own = torch.zeros_like(columns).scatter_add_(-1, vb, after) * ~active[..., :1]
        later = diag >= 1
        area = torch.zeros(n, n, dtype=torch.float64, device=v.device)
        for count, not_tile in zip(columns.flatten(0, -2), (~active).flatten(0, -2), strict=True):
            area += torch.where(later, not_tile[diag.clamp(min=0)] * count.view(1, -1), 0.0)
        area *= rows
        area.diagonal().add_(own.sum(tuple(range(own.dim() - 1))))
        return area


@dataclass
class BlockTopKIndex(SparseIndex):
    """Per-query top-k key blocks (MSA, MoBA).

    ``blocks[b, i, s]`` lists the key blocks (ascending, ``-1`` padded) that query ``i``
    attends under selection head ``s``; selection head ``s`` is shared by query
    heads ``[s * Hq/Hs, (s+1) * Hq/Hs)`` (MSA: one per GQA group; MoBA: one per
    query head).
    """

    blocks: torch.Tensor  # [B, S, Hs, k] int32
    block_size: int
    num_heads: int
    # With documents, a row sees only its document's keys of the blocks it chose (the
    # builders choose no block wholly before the row's document).
    documents: Documents | None = None

    def __post_init__(self):
        check_tensor("BlockTopKIndex.blocks", self.blocks, ndim=4, float_dtype=False)
        check_documents("BlockTopKIndex.documents", self.documents, self.seq_len)
        if self.blocks.dtype not in (torch.int32, torch.int64):
            fail("BlockTopKIndex.blocks.dtype", self.blocks.dtype, "torch.int32 or torch.int64 key block ids")
        check_int("BlockTopKIndex.block_size", self.block_size, minimum=1)
        # The ids are read only in host memory: on a GPU the read would wait for the device, and
        # the builders make an index per layer, with ids in range by construction. An index
        # assembled by hand on the host is checked here, before ``.to(device)``.
        if self.blocks.device.type != "cpu":
            return
        n_blocks = -(-self.seq_len // self.block_size)
        outside = ((self.blocks < -1) | (self.blocks >= n_blocks)).nonzero()
        if len(outside):
            at = tuple(outside[0].tolist())
            fail(
                f"BlockTopKIndex.blocks[{', '.join(map(str, at))}]",
                int(self.blocks[at]),
                f"a key block id in [0, {n_blocks}) (sequence length {self.seq_len}, block size "
                f"{self.block_size}), or -1 for no block",
            )

    @property
    def batch_size(self) -> int:
        return self.blocks.shape[0]

    @property
    def seq_len(self) -> int:
        return self.blocks.shape[1]

    @property
    def selection_heads(self) -> int:
        return self.blocks.shape[2]

    @property
    def query_chunk(self) -> int:
        # Bounds the gathered keys per call to ~8K per (batch, selection head) row set.
        return max(1, 8192 // (self.blocks.shape[3] * self.block_size))

    def key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        chosen = self.blocks[:, q_start:q_end].permute(0, 2, 1, 3)
        return _blocks_to_tokens(chosen, self.block_size, self.seq_len)

    def _area(self, rows: _PositionSet, keys: _PositionSet) -> torch.Tensor:
        bs = self.block_size
        q = rows.values
        per_block = keys.per_block(bs)
        # A chosen block before the row's own one counts all its keys; its own, those up to it.
        own = keys.between(q // bs * bs, q + 1)
        b, _, hs, k = self.blocks.shape
        area = torch.zeros(b, hs, dtype=torch.int64, device=self.device)
        # Rows in chunks bound the temporaries (a [B, rows, Hs, k] gather each) to ~32 MiB.
        chunk = max(1, _AREA_ENTRIES // (b * hs * k))
        starts = None if self.documents is None else self.documents.starts
        if starts is not None:  # the keys of the row's own block from its document's start
            own = keys.between(torch.maximum(q // bs * bs, starts[q].long()), q + 1)
        for r0 in range(0, len(q), chunk):
            rq = q[r0 : r0 + chunk]
            chosen = self.blocks.index_select(1, rq).long()
            own_block = (rq // bs).view(1, -1, 1, 1)
            before = (chosen >= 0) & (chosen < own_block)
            if starts is None:
                earlier = per_block[chosen.clamp(min=0)] * before
            else:  # an earlier block's keys from the row's document start on
                c = chosen.clamp(min=0)
                first = starts[rq].long().view(1, -1, 1, 1)
                earlier = keys.between(torch.maximum(c * bs, first), (c + 1) * bs).clamp(min=0) * before
            area += (earlier + own[r0 : r0 + chunk].view(1, -1, 1, 1) * (chosen == own_block)).sum((1, 3))
        return area

    def to_dense_mask(self, seq_len: int) -> torch.Tensor:
        _check_mask_len(self, seq_len)
        n_blocks = -(-seq_len // self.block_size)
        chosen = torch.zeros(*self.blocks.shape[:3], n_blocks + 1, dtype=torch.bool, device=self.device)
        chosen.scatter_(-1, torch.where(self.blocks >= 0, self.blocks.long(), n_blocks), True)
        key_block = torch.arange(seq_len, device=self.device) // self.block_size
        per_selection = chosen[..., key_block].permute(0, 2, 1, 3)  # [B, Hs, S, S]
        per_head = per_selection.repeat_interleave(self.num_heads // self.selection_heads, dim=1)
        return per_head & _causal(seq_len, self.device, self.documents)


def _check_mask_len(index: SparseIndex, seq_len: int) -> None:
    if seq_len != index.seq_len:
        fail("seq_len", seq_len, f"the length the index was built for ({index.seq_len})")

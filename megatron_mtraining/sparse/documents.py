"""Packed documents: several documents in one sample, separated so that attention never
crosses a boundary.

The boundaries come in flash-attn's varlen convention, ``cu_seqlens``: int32 global
positions ``[0, end_0, end_1, ..., S]``, strictly increasing (no empty document). No
``S x S`` mask is ever formed: the document mask is a per-row lower bound on the visible
keys, the start of the row's document (``Documents.starts``, ``[S]`` int32), and with
causality key ``j`` is visible to row ``i`` iff ``starts[i] <= j <= i``. The bound compares
global positions, so a context-parallel rank's rows and a ring step's keys (which carry
global positions) can use the same vector.

An index carries its ``Documents`` (``SparseIndex.documents``; None: one document, as
before), and every consumer (the reference path through ``visible``, ``to_dense_mask``,
the attended-area accounting, the kernels' tile tables) applies it. The boundaries are
the same for every sample of the batch; flash-attn's convention packs into batch 1.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .validation import fail

ACCEPTED = "int32 document boundaries [0, ..., S], strictly increasing (flash-attn's varlen cu_seqlens, batch 1 packed)"


@dataclass(eq=False)
class Documents:
    """The documents of a packed sequence of ``seq_len`` tokens (build with
    :func:`packed_documents`, which validates the boundaries)."""

    cu_seqlens: torch.Tensor  # [n + 1] int32: document d holds positions [cu[d], cu[d + 1])
    starts: torch.Tensor  # [S] int32: the start of each position's document
    ids: torch.Tensor  # [S] int32: the document of each position
    bounds: tuple[int, ...] = field(repr=False)  # cu_seqlens on the host, read once

    @property
    def seq_len(self) -> int:
        return self.bounds[-1]

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    @property
    def device(self) -> torch.device:
        return self.starts.device

    def to(self, device) -> Documents:
        return Documents(self.cu_seqlens.to(device), self.starts.to(device), self.ids.to(device), self.bounds)

    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True)]

    def ends(self) -> torch.Tensor:
        """``[S]`` int32: the end (exclusive) of each position's document (made once: the
        tile tables of every attention call over these documents carry it)."""
        return self._made(("ends",), lambda: self.cu_seqlens[self.ids.long() + 1])

    def block_firsts(self, block: int) -> torch.Tensor:
        """``[ceil(S / block)]`` int64: the document start of each ``block``-row block's first
        row, a bound on every row of the block (starts never decrease), so key blocks
        before ``first // block`` hold no key any row of the block sees."""
        return self.starts[::block].long()

    def _made(self, key: tuple, make):
        """``make()``, made once per ``key``: every layer of a micro-batch holds these
        documents, and the index's consumers ask for the same tables many times a layer."""
        kept = self.__dict__.setdefault("_tables", {})
        if key not in kept:
            kept[key] = make()
        return kept[key]

    def spans(self, block: int) -> torch.Tensor:
        """``[n]`` int64: how many ``block``-token blocks each document touches."""
        cu = self.cu_seqlens.long()
        return self._made(("spans", block), lambda: (cu[1:] - 1) // block - cu[:-1] // block + 1)

    def segment_offsets(self, block: int) -> torch.Tensor:
        """``[n]`` int64: the first (block, document) segment of each document, ``cu[m] // block
        + m``: position ``p`` lies in segment ``p // block + ids[p]``, so document ``m``'s
        blocks are segments ``offsets[m]`` on (one slot left unused after a document that
        ends on a block edge)."""
        return self._made(
            ("segment_offsets", block),
            lambda: self.cu_seqlens[:-1].long() // block + torch.arange(self.count, device=self.device),
        )

    def mask(self) -> torch.Tensor:
        """``[S, S]`` bool, ``starts[i] <= j`` (no causality): for tests and debugging only."""
        keys = torch.arange(self.seq_len, device=self.device)
        return keys.view(1, -1) >= self.starts.view(-1, 1)


# The last few boundary tensors' host bounds and Documents, by tensor identity: every layer of
# a micro-batch receives the same ``cu_seqlens`` (Megatron's one PackedSeqParams), so the host
# reads it once.
_RECENT: OrderedDict[tuple, tuple[weakref.ref, object]] = OrderedDict()
RECENT_SIZE = 8


def _remembered(tensor: torch.Tensor, key: tuple, make):
    """``make()``, or what it gave for this tensor, unmodified, and ``key``."""
    full = (id(tensor), tensor._version, *key)
    kept = _RECENT.get(full)
    if kept is not None and kept[0]() is tensor:
        _RECENT.move_to_end(full)
        return kept[1]
    value = make()
    # A freed tensor's entry may hold this key (ids are reused): pop it, so the new entry goes
    # to the end rather than keep the old one's place first in line for eviction.
    _RECENT.pop(full, None)
    _RECENT[full] = (weakref.ref(tensor), value)
    while len(_RECENT) > RECENT_SIZE:
        _RECENT.popitem(last=False)
    return value


def document_bounds(cu_seqlens, seq_len: int) -> tuple[int, ...] | None:
    """``cu_seqlens`` on the host, validated, as a tuple (None: None, one document); a
    ``Documents`` gives its own. Raises ``ValueError`` naming the entry, the value and what is
    accepted unless ``cu_seqlens`` is a 1-d int32 (or int64) tensor that starts at 0, strictly
    increases and ends at ``seq_len``. Reads the boundaries on the host once per tensor (one
    small copy from a GPU) and builds nothing on the device."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Documents):
        if cu_seqlens.seq_len != seq_len:
            fail("cu_seqlens", list(cu_seqlens.bounds), f"documents of the sequence length {seq_len}")
        return cu_seqlens.bounds
    if not isinstance(cu_seqlens, torch.Tensor):
        fail("cu_seqlens", type(cu_seqlens).__name__, f"a torch.Tensor of {ACCEPTED}")
    return _remembered(cu_seqlens, ("bounds", seq_len), lambda: _read_bounds(cu_seqlens, seq_len))


def _read_bounds(cu_seqlens: torch.Tensor, seq_len: int) -> tuple[int, ...]:
    if cu_seqlens.dim() != 1:
        fail("cu_seqlens.shape", tuple(cu_seqlens.shape), f"a 1-d tensor [n_documents + 1] of {ACCEPTED}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        fail("cu_seqlens.dtype", cu_seqlens.dtype, f"torch.int32 (or torch.int64): {ACCEPTED}")
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2:
        fail("cu_seqlens", bounds, f"at least two entries, [0, {seq_len}] for one document: {ACCEPTED}")
    if bounds[0] != 0:
        fail("cu_seqlens[0]", bounds[0], "0: the first document starts the sequence")
    for i in range(1, len(bounds)):
        if bounds[i] <= bounds[i - 1]:
            fail(
                f"cu_seqlens[{i}]",
                bounds[i],
                f"a value above cu_seqlens[{i - 1}] = {bounds[i - 1]}: boundaries strictly increase (no empty document)",
            )
    if bounds[-1] != seq_len:
        fail(
            f"cu_seqlens[{len(bounds) - 1}]",
            bounds[-1],
            f"the sequence length {seq_len}: the last document ends the sequence (batch 1 packed)",
        )
    return tuple(int(b) for b in bounds)


def packed_documents(cu_seqlens, seq_len: int, device=None) -> Documents | None:
    """The ``Documents`` of ``cu_seqlens`` over ``seq_len`` tokens (None: None, one document),
    on ``device`` (``cu_seqlens``'s by default), validated by :func:`document_bounds`; a later
    call with the same tensor, unmodified, returns the same ``Documents``."""
    if isinstance(cu_seqlens, Documents):
        document_bounds(cu_seqlens, seq_len)
        return cu_seqlens if device is None else cu_seqlens.to(device)
    bounds = document_bounds(cu_seqlens, seq_len)
    if bounds is None:
        return None
    device = cu_seqlens.device if device is None else torch.device(device)
    return _remembered(cu_seqlens, ("documents", seq_len, device), lambda: _documents(cu_seqlens, bounds, device))


def _documents(cu_seqlens: torch.Tensor, bounds: tuple[int, ...], device: torch.device) -> Documents:
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    positions = torch.arange(bounds[-1], device=device, dtype=torch.int32)
    ids = torch.searchsorted(cu[1:-1].contiguous(), positions, right=True).to(torch.int32)
    return Documents(cu, cu[ids.long()], ids, bounds)


def check_documents(name: str, documents: Documents | None, seq_len: int) -> None:
    """An index's ``documents`` field: None, or ``Documents`` of ``seq_len`` tokens."""
    if documents is None:
        return
    if not isinstance(documents, Documents):
        fail(name, type(documents).__name__, "None or Documents (sparse.documents.packed_documents(cu_seqlens, S))")
    if documents.seq_len != seq_len:
        fail(name, f"documents of {documents.seq_len} tokens", f"documents of the index's {seq_len} tokens")

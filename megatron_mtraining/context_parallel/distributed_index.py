"""Where a ring's index comes from, and the collectives that build one over a group.

The ring takes either a ``SparseIndex`` built for the whole sequence or an
:class:`IndexSource`: an object that builds the index itself, on one device or from the
tokens spread over a context-parallel group. The attention patterns
(``megatron_mtraining.patterns``, a layer above) are the index sources; this layer only
states the contract, so it never needs to know which patterns exist.

No rank gathers the sequence and nothing goes through rank 0 in a distributed build:
every rank computes partial statistics over the keys it holds and small collectives
(below) combine them, so every rank derives the index the single-device builder would
build on the whole sequence.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..sparse.documents import packed_documents
from ..sparse.index import SparseIndex
from ..sparse.validation import fail
from .layout import ContextParallelLayout


@runtime_checkable
class IndexSource(Protocol):
    """Builds a pattern's index (``megatron_mtraining.patterns.base.Pattern`` implements it);
    ``cu_seqlens``: packed documents (``sparse.documents``), None for one document."""

    def local_index(
        self, q: torch.Tensor, k: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None
    ) -> SparseIndex: ...

    def distributed_index(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        layout: ContextParallelLayout,
        group,
        scale: float,
        cu_seqlens: torch.Tensor | None = None,
    ) -> SparseIndex: ...


def build_index(
    pattern: SparseIndex | IndexSource,
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    layout: ContextParallelLayout | None = None,
    group=None,
    cu_seqlens: torch.Tensor | None = None,
) -> SparseIndex:
    """``pattern`` itself if it is an index, else its index: of the whole sequence on this
    device (``layout`` None), or of this rank's queries over ``layout``'s group.
    ``cu_seqlens``: the packed documents of the whole sequence (flash-attn's varlen
    boundaries by global position, ``sparse.documents.packed_documents``; the same on every
    rank); an index passed as ``pattern`` must carry the same documents."""
    if isinstance(pattern, SparseIndex):
        if cu_seqlens is not None:
            _check_index_documents(pattern, cu_seqlens)
        return pattern
    if not isinstance(pattern, IndexSource):
        fail(
            "pattern",
            type(pattern).__name__,
            "a pattern (megatron_mtraining.patterns.get(name)(settings)) or a SparseIndex built for the whole sequence",
        )
    # Passed only when given, so that an index source predating documents still serves.
    documents = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    if layout is None:
        return pattern.local_index(q, k, scale, **documents)
    return pattern.distributed_index(q, k, layout, group, scale, **documents)


def _check_index_documents(index: SparseIndex, cu_seqlens) -> None:
    """A prebuilt index given with ``cu_seqlens`` must carry those documents (its lists were
    chosen for them; attaching other boundaries would not make them per-document)."""
    docs = index.documents
    given = packed_documents(cu_seqlens, index.seq_len).bounds if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    bounds = list(given)
    if docs is None or list(docs.bounds) != bounds:
        fail(
            "cu_seqlens",
            bounds,
            f"the documents the index was built with ({None if docs is None else list(docs.bounds)}): "
            "build the index with cu_seqlens (the pattern's local_index, or the index's documents field)",
        )


def rank_positions(layout: ContextParallelLayout, group, device) -> torch.Tensor:
    """Global positions of this rank's tokens (cached by the layout: no copy per call)."""
    return layout.token_positions(dist.get_rank(group), device).values


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n, ...]`` zeros with row ``rows[i]`` of it set to ``x[:, i]``; rows of -1 are
    dropped. They land in a spare last row rather than being selected out, which would read
    their count from the device. Each kept row needs one writer."""
    out = x.new_zeros(x.shape[0], n + 1, *x.shape[2:])
    out[:, torch.where(rows >= 0, rows, n)] = x
    return out[:, :n]


def gather_window(x: torch.Tensor, positions: torch.Tensor, first: int, seq: int, group) -> torch.Tensor:
    """Rows ``[first, seq)`` of the whole sequence of ``x`` ``[B, L, ...]`` (this rank's
    tokens at global ``positions``) on every rank, detached (``seq``: the end of the rows,
    the sequence's or a packed document's)."""
    return gather_rows(x, positions, torch.arange(first, seq, device=positions.device), group)


def gather_rows(x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, group) -> torch.Tensor:
    """The rows at the ascending global positions ``rows`` (on ``x``'s device) of the whole
    sequence of ``x`` ``[B, L, ...]`` (this rank's tokens at global ``positions``) on every
    rank, detached, ``[B, len(rows), ...]``. Each row has one holder and zeros elsewhere, so
    the sum is exact; nothing is read on the host."""
    slot = torch.searchsorted(rows, positions.to(rows.dtype)).clamp(max=len(rows) - 1)
    held = rows[slot] == positions
    gathered = scatter_rows(
        x.detach(), torch.where(held, slot, -1), len(rows)
    ).contiguous()  # collectives take whole buffers
    dist.all_reduce(gathered, group=group)
    return gathered


def all_reduce_fn(op, group):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=op, group=group)
        return t

    return reduce

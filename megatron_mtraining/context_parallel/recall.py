"""Index recall under context parallelism: ``attention_recall`` (and ``heldout_recall``,
MSA's ``msa_recall``) of the whole sequence, computed from the ranks' shards.

The window (the last ``num_rows`` queries), or the sampled rows of the held-out recall,
reaches every rank by one sum of a small buffer, each rank scores it against the keys it
holds, and the softmax statistics and the attended mass are reduced: no rank gathers the
keys. A top-k index built under CP holds only its rank's rows (``distributed_index``), so
the scored rows' selections come from their holders the same way. MSA's block and score recall reduce the window's per-block
sums of dense attention (SUM) and, in warmup, the index's block maxima (MAX).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..sparse.index import BlockTopKIndex, DenseIndex, SparseIndex
from ..sparse.metrics import (
    RowUnion,
    check_recall_rows,
    check_rows,
    document_starts,
    index_window_selection,
    msa_recall_from_parts,
    msa_window_selection,
    recall_from_parts,
)
from ..sparse.msa import MSAConfig
from ..sparse.validation import check_index_qk, check_qk, check_softmax_scale, fail
from .distributed_index import all_reduce_fn, gather_rows, gather_window
from .layout import ContextParallelLayout


@torch.no_grad()
def distributed_attention_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    layout: ContextParallelLayout,
    group=None,
    num_rows: int = 64,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """``attention_recall`` of the whole sequence from this rank's q/k shards (the same
    ``[B, Hq]`` on every rank). ``index``: the global index ``ring_attention`` runs (for
    top-k indices built under CP, each rank's own rows suffice)."""
    check_qk(q, k)
    check_recall_rows(num_rows, layout.seq_len)
    return _recall_of_rows(q, k, index, layout, group, None, num_rows, softmax_scale).mean(-1)


@torch.no_grad()
def distributed_heldout_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    layout: ContextParallelLayout,
    rows: torch.Tensor,
    group=None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """``heldout_recall`` of the queries at positions ``rows`` (ascending int64 on the host,
    the same on every rank: ``heldout_rows``) from this rank's q/k shards, as
    :func:`distributed_attention_recall` scores the window."""
    check_qk(q, k)
    check_rows(rows, layout.seq_len)
    return _recall_of_rows(q, k, index, layout, group, rows, len(rows), softmax_scale).mean(-1)


@torch.no_grad()
def distributed_window_and_heldout_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    layout: ContextParallelLayout,
    num_rows: int,
    rows: torch.Tensor,
    group=None,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``window_and_heldout_recall`` from this rank's q/k shards: the two recalls of
    :func:`distributed_attention_recall` and :func:`distributed_heldout_recall` from one
    gather of the union of their rows and one pass (and one set of reductions) over it."""
    check_qk(q, k)
    check_recall_rows(num_rows, layout.seq_len)
    union = RowUnion.of(layout.seq_len, num_rows, tuple(check_rows(rows, layout.seq_len)))
    return union.split(_recall_of_rows(q, k, index, layout, group, union.rows, len(union.rows), softmax_scale))


def _recall_of_rows(q, k, index, layout, group, rows, num_rows, softmax_scale) -> torch.Tensor:
    """The recall of each of ``rows`` (None: the last ``num_rows``), ``[B, Hq, rows]``: the
    rows' queries gathered from their holders, the softmax statistics and kept mass reduced
    over the ranks' keys."""
    seq = layout.seq_len
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    if index.complete:  # the same answer on every rank, with no collective
        return torch.ones(q.shape[0], q.shape[2], num_rows, dtype=torch.float32, device=q.device)
    tokens = layout.token_positions(dist.get_rank(group), q.device)  # cached: no copy per call
    positions = tokens.values
    if rows is None:
        row_pos = torch.arange(seq - num_rows, seq, device=q.device)
        q_rows = gather_window(q, positions, seq - num_rows, seq, group)
    else:
        row_pos = rows.to(q.device, non_blocking=True)
        q_rows = gather_rows(q, positions, row_pos, group)
    if isinstance(index, BlockTopKIndex):
        # Rows other ranks hold are -1 here (or equal, for an index every rank has): the
        # maximum takes each row from a holder.
        held = index.blocks[:, row_pos].contiguous()
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=group)
        index = dataclasses.replace(index, blocks=index.blocks.index_copy(1, row_pos, held))
    return recall_from_parts(
        q_rows,
        k,
        positions,
        index,
        scale,
        rows,
        all_reduce_max=all_reduce_fn(dist.ReduceOp.MAX, group),
        all_reduce_sum=all_reduce_fn(dist.ReduceOp.SUM, group),
        host_positions=tokens.host,
    )


@torch.no_grad()
def distributed_msa_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    config: MSAConfig,
    index: SparseIndex | None,
    layout: ContextParallelLayout,
    group=None,
    num_rows: int = 64,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``msa_recall`` of the whole sequence from this rank's q/k/q_idx/k_idx shards: the
    same ``(block, score)``, each ``[B, Hq]``, on every rank.

    The window queries reach every rank (``gather_window``); each rank scores them against
    its keys, and the rows' logit maxima (MAX) and the block sums ``[B, Hq, R, n_blocks]``
    (SUM) are reduced, so every rank ranks the same block masses. The index's selection of
    the window comes from the rows' holders (``index``, a ``BlockTopKIndex`` built under CP,
    holds -1 in the rows of other ranks: MAX), or, in warmup (``None`` / ``DenseIndex``),
    from the window's index queries scored against each rank's index keys, the block maxima
    reduced with MAX before the top-k. No rank gathers keys."""
    check_qk(q, k)
    check_index_qk(q_idx, k_idx, config.index_head_dim)
    seq = layout.seq_len
    check_recall_rows(num_rows, seq)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    first = seq - num_rows
    tokens = layout.token_positions(dist.get_rank(group), q.device)  # cached: no copy per call
    positions = tokens.values
    reduce_max = all_reduce_fn(dist.ReduceOp.MAX, group)
    starts = document_starts(index)  # global positions: the same on every rank
    if isinstance(index, BlockTopKIndex):
        selected = index_window_selection(index, num_rows, all_reduce_max=reduce_max)
    elif index is None or isinstance(index, DenseIndex):
        q_idx_window = gather_window(q_idx, positions, first, seq, group)
        selected = msa_window_selection(
            q_idx_window, k_idx, positions, seq, config, all_reduce_max=reduce_max, doc_starts=starts
        )
    else:
        fail("index", type(index).__name__, "the BlockTopKIndex the layer ran, or None / a DenseIndex (warmup)")
    return msa_recall_from_parts(
        gather_window(q, positions, first, seq, group),
        k,
        positions,
        selected,
        seq,
        config,
        scale,
        all_reduce_max=reduce_max,
        all_reduce_sum=all_reduce_fn(dist.ReduceOp.SUM, group),
        documents=None if index is None else index.documents,
        host_positions=tokens.host,
    )

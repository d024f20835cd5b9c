"""Building a pattern's index from q/k spread over a context-parallel group.

No rank gathers the sequence and nothing goes through rank 0: every rank computes
partial statistics over the keys it holds and small collectives combine them, so
every rank derives the index the single-device builder would build on the whole
sequence (the builders share their arithmetic, see ``window_statistics_from_parts``).

* ``"dense"``: nothing to build.
* ``VerticalSlashConfig``: the observation window (last ``last_q`` queries of the
  sequence) is assembled on every rank by one sum of a ``[B, last_q, Hq, D]``
  buffer; row maxima, normalisers and the column / diagonal mass are reduced.
* ``MoBAConfig``: chunk key sums are reduced (``[B, chunks, Hkv, D]``); each rank
  gates its own queries.
* ``MSAPattern``: the index keys circulate the ring and each rank keeps its queries'
  running block maxima (``block_max_scores``), then picks their top-k.
Top-k indices hold rows for this rank's queries only, the only rows the ring reads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..sparse.index import BlockTopKIndex, DenseIndex, SparseIndex, VerticalSlashIndex, select_topk_blocks
from ..sparse.moba import MoBAConfig, build_moba_index, moba_select_from_parts
from ..sparse.msa import MSAPattern, block_max_scores, msa_select_blocks
from ..sparse.validation import fail
from ..sparse.vertical_slash import (
    VerticalSlashConfig,
    build_vertical_slash_index,
    select_vertical_slash,
    window_statistics_from_parts,
)
from .comm import RingExchange
from .layout import ContextParallelLayout


def build_local_index(pattern, q: torch.Tensor, k: torch.Tensor, scale: float) -> SparseIndex:
    """The single-device index of a pattern config (context-parallel size 1)."""
    if isinstance(pattern, str) and pattern == "dense":
        return DenseIndex(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    if isinstance(pattern, VerticalSlashConfig):
        return build_vertical_slash_index(q, k, pattern, softmax_scale=scale)
    if isinstance(pattern, MoBAConfig):
        return build_moba_index(q, k, pattern)
    if isinstance(pattern, MSAPattern):
        return msa_select_blocks(pattern.q_idx, pattern.k_idx, pattern.config, q.shape[2])
    return _unknown(pattern)


def _unknown(pattern):
    return fail(
        "pattern",
        type(pattern).__name__,
        "'dense', a VerticalSlashConfig, a MoBAConfig, an MSAPattern, or a global SparseIndex built for the whole "
        "sequence",
    )


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n, ...]`` zeros with row ``rows[i]`` of it set to ``x[:, i]``; rows of -1 are
    dropped. They land in a spare last row rather than being selected out, which would read
    their count from the device. Each kept row needs one writer."""
    out = x.new_zeros(x.shape[0], n + 1, *x.shape[2:])
    out[:, torch.where(rows >= 0, rows, n)] = x
    return out[:, :n]


def gather_window(x: torch.Tensor, positions: torch.Tensor, first: int, seq: int, group) -> torch.Tensor:
    """Rows ``[first, seq)`` of the whole sequence of ``x`` ``[B, L, ...]`` (this rank's
    tokens at global ``positions``) on every rank, detached. Each row has one holder and
    zeros elsewhere, so the sum is exact."""
    rows = torch.where(positions >= first, positions - first, -1)
    window = scatter_rows(x.detach(), rows, seq - first).contiguous()  # collectives take whole buffers
    dist.all_reduce(window, group=group)
    return window


def all_reduce_fn(op, group):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=op, group=group)
        return t

    return reduce


def build_distributed_index(
    pattern, q: torch.Tensor, k: torch.Tensor, layout: ContextParallelLayout, group, scale: float
) -> SparseIndex:
    bsz, _, hq, d = q.shape
    seq = layout.seq_len
    positions = layout.token_positions(dist.get_rank(group), q.device).values  # cached: no copy per call
    if isinstance(pattern, str) and pattern == "dense":
        return DenseIndex(bsz, hq, seq, device=q.device)
    if isinstance(pattern, VerticalSlashConfig):
        return _vertical_slash(pattern, q, k, positions, seq, group, scale)
    if isinstance(pattern, MoBAConfig):
        blocks = torch.full((bsz, seq, hq, pattern.topk), -1, dtype=torch.int32, device=q.device)
        blocks[:, positions] = moba_select_from_parts(
            q, positions, k, positions, seq, pattern, all_reduce_fn(dist.ReduceOp.SUM, group)
        )
        return BlockTopKIndex(blocks=blocks, block_size=pattern.chunk_size, num_heads=hq)
    if isinstance(pattern, MSAPattern):
        return _msa(pattern, hq, positions, seq, group)
    return _unknown(pattern)


def _msa(pattern: MSAPattern, num_heads: int, positions, seq, group) -> BlockTopKIndex:
    """Index keys (one head of d_idx per token) circulate the ring; each rank keeps the
    running block maxima of its own queries, then picks their top-k. No rank holds
    the whole sequence's keys."""
    cfg = pattern.config
    q_idx, k_idx = pattern.q_idx.detach(), pattern.k_idx.detach()
    bsz, _, groups, _ = q_idx.shape
    n_blocks = -(-seq // cfg.block_size)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    exchange = RingExchange(members)
    block_max = None
    keys, key_pos = k_idx, positions
    for step in range(len(members)):
        if step + 1 < len(members):
            exchange.start([keys, key_pos])
        part = block_max_scores(q_idx, positions, keys, key_pos, n_blocks, cfg.block_size)
        block_max = part if block_max is None else torch.maximum(block_max, part)
        if step + 1 < len(members):
            keys, key_pos = exchange.wait()
    blocks = torch.full((bsz, seq, groups, cfg.topk), -1, dtype=torch.int32, device=q_idx.device)
    blocks[:, positions] = select_topk_blocks(block_max, positions // cfg.block_size, cfg.topk).permute(0, 2, 1, 3)
    return BlockTopKIndex(blocks=blocks, block_size=cfg.block_size, num_heads=num_heads)


def _vertical_slash(config: VerticalSlashConfig, q, k, positions, seq, group, scale) -> VerticalSlashIndex:
    stats = window_statistics_from_parts(
        gather_window(q, positions, seq - min(config.last_q, seq), seq, group),
        k.detach(),
        positions,
        seq,
        config,
        scale,
        all_reduce_max=all_reduce_fn(dist.ReduceOp.MAX, group),
        all_reduce_sum=all_reduce_fn(dist.ReduceOp.SUM, group),
    )
    return select_vertical_slash(stats, config, seq)

"""``mtraining``: MTraining's vertical-slash pattern with online top-p budgets.

Under context parallelism the observation window (the last ``last_q`` queries of the
sequence) is assembled on every rank by one sum of a ``[B, last_q, Hq, D]`` buffer; the
row maxima, normalisers and column / diagonal mass are reduced, and every rank runs the
single-device selection on them (``window_statistics_from_parts``).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from ..context_parallel.distributed_index import all_reduce_fn, gather_window, rank_positions, unsupported_under_cp
from ..sparse.index import VerticalSlashIndex
from ..sparse.vertical_slash import (
    VerticalSlashConfig,
    build_vertical_slash_index,
    select_vertical_slash,
    window_statistics_from_parts,
)
from .base import Pattern
from .registry import register


@register
class VerticalSlashPattern(Pattern):
    name = "mtraining"
    settings = VerticalSlashConfig
    size_field = "block_size"

    def local_index(self, q, k, scale, cu_seqlens=None) -> VerticalSlashIndex:
        return build_vertical_slash_index(q, k, self.config, softmax_scale=scale, cu_seqlens=cu_seqlens)

    def distributed_index(self, q, k, layout, group, scale, cu_seqlens=None) -> VerticalSlashIndex:
        unsupported_under_cp(cu_seqlens)
        config, seq = self.config, layout.seq_len
        positions = rank_positions(layout, group, q.device)
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

    @classmethod
    def index_state_bytes(cls, config, batch, heads, query_groups, seq, local_seq) -> float:
        # int64 column ids and block-diagonal offsets per head, at their caps.
        return 8 * batch * heads * (config.vertical_cap + math.ceil(config.slash_cap / config.block_size))

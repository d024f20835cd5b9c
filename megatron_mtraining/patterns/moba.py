"""``moba``: MoBA (mixture of block attention), the baseline.

Under context parallelism the chunk key sums are reduced (``[B, chunks, Hkv, D]``) and each
rank gates its own queries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..context_parallel.distributed_index import all_reduce_fn, rank_positions
from ..sparse.documents import packed_documents
from ..sparse.index import BlockTopKIndex
from ..sparse.moba import MoBAConfig, build_moba_index, moba_select_from_parts
from .base import Pattern
from .registry import register


@register
class MoBAPattern(Pattern):
    name = "moba"
    settings = MoBAConfig
    size_field = "chunk_size"

    def local_index(self, q, k, scale, cu_seqlens=None) -> BlockTopKIndex:
        return build_moba_index(q, k, self.config, cu_seqlens=cu_seqlens)

    def distributed_index(self, q, k, layout, group, scale, cu_seqlens=None) -> BlockTopKIndex:
        bsz, _, hq, _ = q.shape
        seq, config = layout.seq_len, self.config
        positions = rank_positions(layout, group, q.device)
        blocks = torch.full((bsz, seq, hq, config.topk), -1, dtype=torch.int32, device=q.device)
        documents = packed_documents(cu_seqlens, seq, q.device)
        blocks[:, positions] = moba_select_from_parts(
            q, positions, k, positions, seq, config, all_reduce_fn(dist.ReduceOp.SUM, group), documents
        )
        return BlockTopKIndex(blocks=blocks, block_size=config.chunk_size, num_heads=hq, documents=documents)

    @classmethod
    def index_state_bytes(cls, config, batch, heads, query_groups, seq, local_seq) -> float:
        # int64 chunk ids per query head, over the whole sequence on every rank.
        return 8 * batch * seq * heads * config.topk

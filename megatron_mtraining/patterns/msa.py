"""``msa``: MiniMax Sparse Attention, whose trainable index branch picks top-k KV blocks
per GQA group (``sparse/msa.py``: the branch, the selection, the KL loss).

Under context parallelism the index keys circulate the ring; each rank keeps the running
block maxima of its own queries (``block_max_scores``), then picks their top-k. No rank
holds the whole sequence's index keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..context_parallel.comm import RingExchange
from ..context_parallel.distributed_index import rank_positions
from ..sparse.documents import packed_documents
from ..sparse.index import BlockTopKIndex, select_topk_blocks
from ..sparse.msa import MSAConfig, block_max_scores, msa_select_blocks
from ..sparse.validation import check_index_qk, fail
from .base import Pattern
from .registry import register

KL_METRIC = "msa_kl_loss"
# The MSA paper's indexer quality (section 5.2) on the last 64 queries (``sparse.msa_recall``):
# the share of the main branch's top-k blocks the index selects, and of their attention mass.
BLOCK_RECALL_METRIC = "msa_block_recall"
SCORE_RECALL_METRIC = "msa_score_recall"


@register
class MSAPattern(Pattern):
    """MSA settings with, once bound by :meth:`with_inputs`, the index branch's outputs on
    this rank's tokens: ``q_idx [B, L, Hkv, d_idx]`` and ``k_idx [B, L, 1, d_idx]``."""

    name = "msa"
    settings = MSAConfig
    size_field = "block_size"
    has_index_branch = True
    metrics = (KL_METRIC, BLOCK_RECALL_METRIC, SCORE_RECALL_METRIC, *Pattern.metrics)

    def __init__(self, config: MSAConfig | None = None, q_idx: torch.Tensor | None = None, k_idx=None):
        super().__init__(config)
        if q_idx is not None or k_idx is not None:
            check_index_qk(q_idx, k_idx, self.config.index_head_dim)
        self.q_idx, self.k_idx = q_idx, k_idx

    def with_inputs(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> MSAPattern:
        return MSAPattern(self.config, q_idx, k_idx)

    def __eq__(self, other) -> bool:
        return super().__eq__(other) and other.q_idx is self.q_idx and other.k_idx is self.k_idx

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_idx is None:
            fail("MSAPattern.q_idx", None, "the index branch's outputs: bind them with MSAPattern.with_inputs")
        return self.q_idx.detach(), self.k_idx.detach()

    def local_index(self, q, k, scale, cu_seqlens=None) -> BlockTopKIndex:
        q_idx, k_idx = self._inputs()
        return msa_select_blocks(q_idx, k_idx, self.config, q.shape[2], cu_seqlens=cu_seqlens)

    def distributed_index(self, q, k, layout, group, scale, cu_seqlens=None) -> BlockTopKIndex:
        cfg, seq = self.config, layout.seq_len
        q_idx, k_idx = self._inputs()
        positions = rank_positions(layout, group, q.device)
        documents = packed_documents(cu_seqlens, seq, q.device)
        starts = None if documents is None else documents.starts
        bsz, _, groups, _ = q_idx.shape
        n_blocks = -(-seq // cfg.block_size)
        members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        exchange = RingExchange(members)
        block_max = None
        keys, key_pos = k_idx, positions
        for step in range(len(members)):
            if step + 1 < len(members):
                exchange.start([keys, key_pos])
            part = block_max_scores(q_idx, positions, keys, key_pos, n_blocks, cfg.block_size, starts)
            block_max = part if block_max is None else torch.maximum(block_max, part)
            if step + 1 < len(members):
                keys, key_pos = exchange.wait()
        blocks = torch.full((bsz, seq, groups, cfg.topk), -1, dtype=torch.int32, device=q_idx.device)
        blocks[:, positions] = select_topk_blocks(block_max, positions // cfg.block_size, cfg.topk).permute(0, 2, 1, 3)
        return BlockTopKIndex(blocks=blocks, block_size=cfg.block_size, num_heads=q.shape[2], documents=documents)

    @classmethod
    def index_parameters(cls, config, hidden_size, query_groups) -> int:
        # IndexBranch: hidden -> one d_idx head per GQA group, and hidden -> one shared key head.
        return hidden_size * query_groups * config.index_head_dim + hidden_size * config.index_head_dim

    @classmethod
    def index_state_bytes(cls, config, batch, heads, query_groups, seq, local_seq) -> float:
        # The branch's 16-bit projections of this rank's tokens, and int64 block ids per
        # GQA group over the whole sequence on every rank.
        projections = local_seq * batch * (query_groups + 1) * config.index_head_dim * 2
        return projections + 8 * batch * seq * query_groups * config.topk

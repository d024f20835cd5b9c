"""MoBA baseline: mixture of block attention with a mean-pooled key gate.

Per query head and query token: score each earlier chunk by ``q . mean(k over the
chunk)``, then attend the query's own chunk (causally) plus the top
``topk - 1`` earlier chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .index import BlockTopKIndex, select_topk_blocks, single_device
from .validation import ValidatedConfig, check_int, check_power_of_two, check_qk, setting


@dataclass(frozen=True)
class MoBAConfig(ValidatedConfig):
    chunk_size: int = setting(4096, check_power_of_two, minimum=16)
    topk: int = setting(12, check_int, minimum=1)


@torch.no_grad()
def build_moba_index(q: torch.Tensor, k: torch.Tensor, config: MoBAConfig) -> BlockTopKIndex:
    """The MoBA index of q ``[B, S, Hq, D]`` and k ``[B, S, Hkv, D]``, one selection per query head."""
    check_qk(q, k)
    positions = torch.arange(q.shape[1], device=q.device)
    blocks = moba_select_from_parts(q, positions, k, positions, q.shape[1], config)
    return BlockTopKIndex(blocks=blocks, block_size=config.chunk_size, num_heads=q.shape[2])


def moba_select_from_parts(
    q: torch.Tensor,
    query_positions: torch.Tensor,
    k: torch.Tensor,
    key_positions: torch.Tensor,
    seq_len: int,
    config: MoBAConfig,
    all_reduce_sum=single_device,
) -> torch.Tensor:
    """MoBA chunk choices ``[B, Lq, Hq, topk]`` of some queries, from some of the keys
    (both with global positions); ``all_reduce_sum`` adds the chunk sums of the other
    key holders (identity on one device). fp64 sums and gate scores make the choice
    independent of how the keys are split."""
    bsz, _, hq, _ = q.shape
    hkv = k.shape[2]
    cs = config.chunk_size
    n_chunks = -(-seq_len // cs)
    sums = torch.zeros(bsz, n_chunks, hkv, k.shape[-1], dtype=torch.float64, device=k.device)
    sums.index_add_(1, key_positions // cs, k.double())
    sums = all_reduce_sum(sums)
    counts = torch.clamp(seq_len - torch.arange(n_chunks, device=k.device) * cs, max=cs).double()
    pooled = sums / counts.view(1, -1, 1, 1)
    gate = torch.einsum("bskgd,bckd->bkgsc", q.double().unflatten(2, (hkv, hq // hkv)), pooled).flatten(1, 2)
    own = query_positions // cs
    earlier = torch.arange(n_chunks, device=q.device).view(1, -1) < own.view(-1, 1)
    blocks = select_topk_blocks(gate.masked_fill(~earlier, float("-inf")), own, config.topk)  # [B, Hq, Lq, k]
    return blocks.permute(0, 2, 1, 3).contiguous()

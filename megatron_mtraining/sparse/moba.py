"""MoBA baseline: mixture of block attention with a mean-pooled key gate.

Per query head and query token: score each earlier chunk by ``q . mean(k over the
chunk)``, then attend the query's own chunk (causally) plus the top
``topk - 1`` earlier chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .index import BlockTopKIndex, select_topk_blocks
from .validation import ValidatedConfig, check_int, check_power_of_two, check_qk, setting


@dataclass(frozen=True)
class MoBAConfig(ValidatedConfig):
    chunk_size: int = setting(4096, check_power_of_two, minimum=16)
    topk: int = setting(12, check_int, minimum=1)


@torch.no_grad()
def build_moba_index(q: torch.Tensor, k: torch.Tensor, config: MoBAConfig) -> BlockTopKIndex:
    """The MoBA index of q ``[B, S, Hq, D]`` and k ``[B, S, Hkv, D]``, one selection per query head."""
    check_qk(q, k)
    bsz, seq, hq, d = q.shape
    hkv = k.shape[2]
    cs = config.chunk_size
    n_chunks = -(-seq // cs)
    padded = torch.nn.functional.pad(k.float(), (0, 0, 0, 0, 0, n_chunks * cs - seq))
    counts = torch.clamp(seq - torch.arange(n_chunks, device=q.device) * cs, max=cs).float()
    pooled = padded.unflatten(1, (n_chunks, cs)).sum(2) / counts.view(1, -1, 1, 1)  # [B, C, Hkv, D]
    gate = torch.einsum("bskgd,bckd->bkgsc", q.float().unflatten(2, (hkv, hq // hkv)), pooled).flatten(1, 2)
    own = torch.arange(seq, device=q.device) // cs
    earlier = torch.arange(n_chunks, device=q.device).view(1, -1) < own.view(-1, 1)
    gate = gate.masked_fill(~earlier, float("-inf"))
    blocks = select_topk_blocks(gate, own, config.topk)  # [B, Hq, S, k]
    return BlockTopKIndex(blocks=blocks.permute(0, 2, 1, 3).contiguous(), block_size=cs, num_heads=hq)

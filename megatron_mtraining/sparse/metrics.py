"""Quality metrics of a sparse index against dense attention."""

from __future__ import annotations

import torch

from .index import SparseIndex
from .validation import check_int, check_qk, check_softmax_scale, fail


@torch.no_grad()
def attention_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    num_rows: int = 64,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Share of the dense causal attention mass of the last ``num_rows`` queries that
    falls on keys the index attends, ``[B, Hq]`` float32 (1.0 = nothing lost)."""
    check_qk(q, k)
    bsz, seq, hq, d = q.shape
    hkv = k.shape[2]
    index.check_compatible(bsz, hq, seq, hkv, q.device)
    check_int("num_rows", num_rows, minimum=1)
    if num_rows > seq:
        fail("num_rows", num_rows, f"at most the sequence length {seq}")
    scale = check_softmax_scale(softmax_scale, d)
    first = seq - num_rows
    rows = torch.arange(first, seq, device=q.device)
    qr = q[:, first:].float().unflatten(2, (hkv, hq // hkv))
    logits = torch.einsum("brkgd,bskd->bkgrs", qr, k.float()).flatten(1, 2) * scale
    logits.masked_fill_(torch.arange(seq, device=q.device).view(1, -1) > rows.view(-1, 1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [B, Hq, R, S]

    attended = torch.zeros(bsz, hq, num_rows, seq + 1, dtype=torch.bool, device=q.device)
    chunk = index.query_chunk
    for q0 in range(first // chunk * chunk, seq, chunk):
        q1 = min(q0 + chunk, seq)
        keys = index.key_lists(q0, q1)
        keys = keys.expand(bsz, -1, q1 - q0, -1).repeat_interleave(hq // keys.shape[1], dim=1)
        lo = max(q0, first)
        keys = torch.where(keys >= 0, keys, seq)[:, :, lo - q0 :]
        attended[:, :, lo - first : q1 - first].scatter_(-1, keys.long(), True)
    return (probs * attended[..., :seq]).sum(-1).mean(-1)

"""Quality metrics of a sparse index against dense attention."""

from __future__ import annotations

import torch

from .index import SparseIndex, position_lookup, single_device
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
    falls on keys the index attends, ``[B, Hq]`` float32 (1.0 = nothing lost); with the
    index's packed documents, the dense mass within each row's document."""
    check_qk(q, k)
    bsz, seq, hq, d = q.shape
    index.check_compatible(bsz, hq, seq, k.shape[2], q.device)
    check_recall_rows(num_rows, seq)
    scale = check_softmax_scale(softmax_scale, d)
    if index.complete:
        return torch.ones(bsz, hq, dtype=torch.float32, device=q.device)
    return recall_from_parts(q[:, seq - num_rows :], k, torch.arange(seq, device=q.device), index, scale)


def check_recall_rows(num_rows: int, seq: int) -> None:
    check_int("num_rows", num_rows, minimum=1)
    if num_rows > seq:
        fail("num_rows", num_rows, f"at most the sequence length {seq}")


def recall_from_parts(
    q_window: torch.Tensor,
    k: torch.Tensor,
    key_positions: torch.Tensor,
    index: SparseIndex,
    scale: float,
    all_reduce_max=single_device,
    all_reduce_sum=single_device,
) -> torch.Tensor:
    """``attention_recall`` from the window queries (the last ``R`` of ``index.seq_len``)
    and *some* of the keys, given with their global positions; ``all_reduce_*`` combine
    the partial softmax statistics across the holders of the other keys (identity on one
    device). ``index`` must hold the window rows (a context-parallel builder's top-k
    index holds only its own rows)."""
    bsz, rows, hq, _ = q_window.shape
    hkv, n_keys, seq = k.shape[2], k.shape[1], index.seq_len
    first = seq - rows
    qr = q_window.float().unflatten(2, (hkv, hq // hkv))
    logits = torch.einsum("brkgd,bskd->bkgrs", qr, k.float()).flatten(1, 2) * scale
    hidden = key_positions.view(1, -1) > torch.arange(first, seq, device=k.device).view(-1, 1)
    if index.documents is not None:  # dense attention within each row's document
        hidden |= key_positions.view(1, -1) < index.documents.starts[first:seq].view(-1, 1)
    logits.masked_fill_(hidden, float("-inf"))
    row_max = all_reduce_max(logits.amax(-1, keepdim=True))  # every row sees its document's start: finite
    weights = torch.exp(logits - row_max)  # [B, Hq, R, keys here]

    # Global key position -> its column here (n_keys where it is elsewhere or padding).
    column = position_lookup(key_positions, seq, missing=n_keys)
    attended = torch.zeros(bsz, hq, rows, n_keys + 1, dtype=torch.bool, device=k.device)
    chunk = index.query_chunk
    for q0 in range(first // chunk * chunk, seq, chunk):
        q1 = min(q0 + chunk, seq)
        keys = index.key_lists(q0, q1)
        keys = keys.expand(bsz, -1, q1 - q0, -1).repeat_interleave(hq // keys.shape[1], dim=1)
        lo = max(q0, first)
        keys = column[torch.where(keys >= 0, keys, seq).long()][:, :, lo - q0 :]
        attended[:, :, lo - first : q1 - first].scatter_(-1, keys, True)
    kept = all_reduce_sum(torch.stack([(weights * attended[..., :n_keys]).sum(-1), weights.sum(-1)]))
    return (kept[0] / kept[1]).mean(-1)

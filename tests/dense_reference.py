"""Independent ground truth: dense attention in float64 under an explicit boolean mask."""

import torch


def dense_attention(q, k, v, mask, softmax_scale=None):
    """q [B, S, Hq, D], k/v [B, S, Hkv, D], mask [B, Hq, Sq, Sk] (True = attended).

    Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq]) in float64, differentiable; rows
    with no attended key give zeros and lse = -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(logits - safe.unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def finite(lse):
    """lse with -inf rows zeroed, for use inside a loss."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

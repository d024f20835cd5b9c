"""Independent ground truth for MSA's KL loss: fp64, from a dense boolean mask."""

import math

import torch


def kl_parts(q, k, q_idx, k_idx, mask, softmax_scale=None):
    """(per-row KL ``[B, Hkv, S]``, index LSE ``[B, Hkv, S]``, main LSE ``[B, Hq, S]``) in fp64,
    differentiable in q_idx and k_idx: teacher = mean over the group's heads of the main
    softmax under ``mask [B, Hq, S, S]``, student = index softmax under the group's mask."""
    b, s, hq, d = q.shape
    groups = k.shape[2]
    g = hq // groups
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    main = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(g, 2)) * scale
    main = main.masked_fill(~mask, -math.inf)
    lse_main = torch.logsumexp(main, -1)
    teacher = torch.softmax(main, -1).unflatten(1, (groups, g)).mean(2)
    group_mask = mask[:, ::g]
    idx = torch.einsum("bird,bjd->brij", q_idx.double(), k_idx[:, :, 0].double()) / math.sqrt(q_idx.shape[-1])
    idx = idx.masked_fill(~group_mask, -math.inf)
    lse_idx = torch.logsumexp(idx, -1)
    log_student = idx - lse_idx.unsqueeze(-1)
    terms = torch.where(group_mask, teacher * (torch.log(teacher) - log_student), 0.0)
    return terms.sum(-1), lse_idx, lse_main


def brute_force_kl(q, k, q_idx, k_idx, mask, softmax_scale=None):
    """fp64 KL(mean-over-group main softmax || index softmax) on the masked tokens, averaged
    over rows, groups and batch."""
    rows, _, _ = kl_parts(q, k, q_idx, k_idx, mask, softmax_scale)
    return rows.sum() / rows.numel()

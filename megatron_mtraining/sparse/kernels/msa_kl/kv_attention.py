"""MSA's main attention and KL loss in one autograd function on the KV-outer kernels, the
KL's teacher taken from the attention's backward.

The KL's teacher is the main branch's attention probabilities over the selected keys,
averaged over the GQA group's query heads. Computed apart (``kv_loss.KLBackward`` alone),
each of its tiles recomputes the G heads' products ``q_h . k`` from the main queries and
keys, most of the KL backward's work; the attention's own backward has those probabilities
in hand, tile by tile. So here one function returns the attention's output and LSE and the
KL's zero scalar: in the backward both gradients arrive together, and per query chunk the
attention's dK/dV kernel stores each (token, group, slot)'s sums of P over the group's heads
(``kv_outer.kernels._store_group_sums``) into a chunk-sized buffer that the KL's kernels
read next (``kv_loss.KLBackward`` as the backward's ``ChunkFollower``). The extra work of the
attention's kernel is one small product a tile (P against a 0/1 membership matrix) and a
store of ``1 / G`` of P.

The teacher is then P as the attention's dV product reads it, in q's dtype (bf16 in
training), where the separate kernels compute it in fp32. ``dispatch.kl_kernel`` (with
``with_attention``) decides where this runs; ``sparse.msa.msa_attention`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...index import BlockTopKIndex
from ..kv_outer import attention as kv
from .kv_loss import KLBackward, kv_index_lse


class KVOuterMSA(torch.autograd.Function):
    """(out, lse, zero scalar) of MSA on one device: ``sparse_attention`` of ``index`` on the
    KV-outer kernels, and ``loss.FusedMSAKL``'s KL objective (the mean over ``rows``; its
    value to ``on_value`` in the backward), gradients to q, k, v and to q_idx, k_idx."""

    @staticmethod
    def forward(ctx, q, k, v, q_idx, k_idx, index: BlockTopKIndex, scale: float, rows: int, on_value):
        p = kv._Problem.of(q, k, v, index, scale)
        out, lse = kv.kv_outer_forward(p)
        lse_idx = kv_index_lse(q_idx, k_idx, index, q.numel() * q.element_size())
        ctx.save_for_backward(q, k, v, out, lse, q_idx, k_idx, lse_idx)
        ctx.index, ctx.scale, ctx.rows, ctx.on_value = index, scale, rows, on_value
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return out, lse, torch.zeros((), dtype=torch.float32, device=q.device)

    @staticmethod
    def backward(ctx, dout, _dlse, grad):
        q, k, v, out, lse, q_idx, k_idx, lse_idx = ctx.saved_tensors
        if dout is None:  # the KL alone still needs the attention's P, which its backward computes
            dout = torch.zeros_like(out)
        if grad is None:
            p = kv._Problem.of(q, k, v, ctx.index, ctx.scale)
            return *kv.kv_outer_backward(p, out, lse, dout, None), None, None, None, None, None, None
        args = (q, k, v, out, lse, dout, q_idx, k_idx, lse_idx, ctx.index, ctx.scale, grad, ctx.rows)
        dq, dk, dv, dq_idx, dk_idx, kl = kv_outer_msa_backward(*args)
        if ctx.on_value is not None:
            ctx.on_value(kl.sum() / ctx.rows)
        return dq, dk, dv, dq_idx, dk_idx, None, None, None, None


def kv_outer_msa_backward(q, k, v, out, lse, dout, q_idx, k_idx, lse_idx, index: BlockTopKIndex, scale: float, grad,
                          rows: int):  # fmt: skip
    """(dq, dk, dv, dq_idx, dk_idx, per-row KL ``[B, Hkv, S]`` fp32): the attention's
    backward for ``dout`` and the KL's for ``grad * sum_rows KL / rows``, the KL's kernels
    run after each of the attention's query chunks on the teacher it stored."""
    p = kv._Problem.of(q, k, v, index, scale)
    # p's q and k: contiguous once (the layer's q is a transposed view), not copied again here.
    chunks = kv.backward_chunks(p)
    follower = KLBackward(p.q, p.k, lse, q_idx, k_idx, lse_idx, index, scale, grad, rows, chunks=chunks)
    return *kv.kv_outer_backward(p, out, lse, dout, None, follower), *follower.result()


def kv_outer_msa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    index: BlockTopKIndex,
    scale: float,
    on_value: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`KVOuterMSA` on one device: (out, lse, the KL's zero scalar), the KL the mean
    over ``B * S * Hkv`` rows. The main queries and keys get no gradient from the KL."""
    b, s, hkv, _ = q_idx.shape
    return KVOuterMSA.apply(q, k, v, q_idx, k_idx, index, scale, b * s * hkv, on_value)

"""Reference sparse attention in PyTorch: exact, blockwise, any device.

Works on chunks of query rows, gathering only the keys each chunk's key lists
name, so memory grows with the attended area rather than S^2. The backward
recomputes probabilities from the saved log-sum-exp (FlashAttention style)
instead of keeping them. It is the CPU path and the ground truth the GPU
kernels are checked against; it is not meant to be fast.
"""

from __future__ import annotations

import torch

from .index import SparseIndex


class _Chunk:
    """One chunk of query rows and the keys they visit, with K/V gathered once.

    Query heads are viewed as ``[Hs, Gs]``: selection head ``s`` serves query heads
    ``s * Gs ... s * Gs + Gs - 1`` and reads KV head ``s // (Hs / Hkv)``.
    """

    def __init__(self, index: SparseIndex, q0: int, q1: int, batch: int, num_kv_heads: int, key_len: int, device):
        keys = index.key_lists(q0, q1)
        if keys.shape[1] == 1:
            keys = keys.expand(-1, num_kv_heads, -1, -1)
        self.keys = keys.expand(batch, -1, -1, -1)
        hs = keys.shape[1]
        kv_head = torch.arange(hs, device=device) // (hs // num_kv_heads)
        base = (torch.arange(batch, device=device).view(-1, 1) * num_kv_heads + kv_head) * key_len
        self.flat = base.view(batch, hs, 1, 1) + self.keys.clamp(min=0)
        # [B, Hs, 1, nq, nk]: the extra axis broadcasts over the Gs heads of a selection head.
        self.valid = index.visible(self.keys, q0, q1).unsqueeze(2)
        self.shared = self.keys.shape[2] == 1  # all rows of the chunk read the same keys
        self.q0, self.q1, self.hs = q0, q1, hs

    def gather(self, x_flat: torch.Tensor) -> torch.Tensor:
        """``x_flat [B*Hkv*S, D]`` -> ``[B, Hs, nk, D]`` (shared) or ``[B, Hs, nq, nk, D]``."""
        g = x_flat[self.flat]
        return g.squeeze(2) if self.shared else g

    def scatter_add(self, dest_flat: torch.Tensor, grad: torch.Tensor) -> None:
        """Adds per-key gradients (shaped as :meth:`gather` returns them) into ``dest_flat``."""
        dest_flat.index_add_(0, self.flat.reshape(-1), grad.reshape(-1, grad.shape[-1]))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, Hq, D]`` rows of this chunk -> ``[B, Hs, Gs, nq, D]``."""
        b, _, hq, d = x.shape
        return x[:, self.q0 : self.q1].reshape(b, -1, self.hs, hq // self.hs, d).permute(0, 2, 3, 1, 4)

    def scores(self, qh: torch.Tensor, kk: torch.Tensor) -> torch.Tensor:
        """Masked logits ``[B, Hs, Gs, nq, nk]``; invisible keys are -inf."""
        s = torch.einsum("bsgqd,bskd->bsgqk" if self.shared else "bsgqd,bsqkd->bsgqk", qh, kk)
        return s.masked_fill(~self.valid, float("-inf"))

    def weighted_values(self, p: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsgqk,bskd->bsgqd" if self.shared else "bsgqk,bsqkd->bsgqd", p, vv)

    def key_grad(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Sum over the heads (and rows, when shared) that read each key: ``w^T x``."""
        return torch.einsum("bsgqk,bsgqd->bskd" if self.shared else "bsgqk,bsgqd->bsqkd", w, x)


def finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    """LSE with -inf (rows with no visible key) replaced by 0, so exp(s - lse) is 0
    there rather than NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def combine(out_a, lse_a, out_b, lse_b):
    """(out, lse) over the union of two disjoint key sets, in the inputs' precision
    (at least fp32). Rows empty on both sides stay zero with lse = -inf; no NaN in
    values or gradients."""
    dt = torch.promote_types(torch.promote_types(out_a.dtype, lse_a.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(dt), lse_b.to(dt)
    peak = finite_or_zero(torch.maximum(lse_a, lse_b))
    total = torch.exp(lse_a - peak) + torch.exp(lse_b - peak)
    # The clamp keeps log's gradient finite on rows empty on both sides, which the where discards.
    lse = torch.where(total > 0, peak + torch.log(total.clamp_min(torch.finfo(dt).tiny)), float("-inf"))
    safe = finite_or_zero(lse)
    w_a = torch.exp(lse_a - safe).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).transpose(1, 2).unsqueeze(-1)
    return w_a * out_a.to(dt) + w_b * out_b.to(dt), lse


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hs, Gs, nq, D]`` -> ``[B, nq, Hq, D]``."""
    b, hs, gs, nq, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, nq, hs * gs, d)


def chunks(index: SparseIndex, q: torch.Tensor, k: torch.Tensor):
    """Query-row chunks of ``q`` against keys ``k`` (which may be another length: a
    context-parallel K/V chunk)."""
    for q0, q1 in index.query_ranges(q.shape[1]):
        yield _Chunk(index, q0, q1, q.shape[0], k.shape[2], k.shape[1], q.device)


def flat_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, Hkv, D]`` -> ``[B*Hkv*S, D]`` in the compute dtype."""
    return x.to(dtype).permute(0, 2, 1, 3).reshape(-1, x.shape[-1])


def unflat_kv(x_flat: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    b, s, h, d = like.shape
    return x_flat.view(b, h, s, d).permute(0, 2, 1, 3).to(dtype or like.dtype)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def forward_partial(q, k, v, index, scale):
    """Attention of q over k/v under ``index``: (out, lse) in the compute dtype (fp32 or
    fp64), lse ``[B, Hq, Sq]``. k/v may be a context-parallel chunk of another length."""
    dt = compute_dtype(q.dtype)
    b, s, hq, d = q.shape
    k_flat, v_flat = flat_kv(k, dt), flat_kv(v, dt)
    out = torch.zeros(b, s, hq, d, dtype=dt, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=dt, device=q.device)
    for c in chunks(index, q, k):
        logits = c.scores(c.heads(q).to(dt) * scale, c.gather(k_flat))
        chunk_lse = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - finite_or_zero(chunk_lse).unsqueeze(-1))
        out[:, c.q0 : c.q1] = to_rows(c.weighted_values(p, c.gather(v_flat)))
        lse[:, :, c.q0 : c.q1] = chunk_lse.flatten(1, 2)
    return out, lse


def backward_partial(q, k, v, index, scale, out, lse, dout, dlse):
    """Gradients of the attention of q over k/v under ``index`` given the *final* out and
    lse of each row (so partial results over several K/V chunks add up): (dq, dk, dv)
    in the compute dtype."""
    dt = compute_dtype(q.dtype)
    k_flat, v_flat = flat_kv(k, dt), flat_kv(v, dt)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk_flat, dv_flat = torch.zeros_like(k_flat), torch.zeros_like(v_flat)
    for c in chunks(index, q, k):
        qh = c.heads(q).to(dt)
        kk, vv = c.gather(k_flat), c.gather(v_flat)
        do = c.heads(dout).to(dt)
        chunk_lse = c.heads(lse.transpose(1, 2).unsqueeze(-1)).squeeze(-1)
        # d(loss)/d(logit) = p * (dP - rowsum(dO * O) + dLSE)
        delta = (do * c.heads(out)).sum(-1) - c.heads(dlse.transpose(1, 2).unsqueeze(-1)).squeeze(-1)
        p = torch.exp(c.scores(qh * scale, kk) - finite_or_zero(chunk_lse).unsqueeze(-1))
        ds = p * (torch.einsum("bsgqd,bskd->bsgqk" if c.shared else "bsgqd,bsqkd->bsgqk", do, vv) - delta.unsqueeze(-1))
        dq[:, c.q0 : c.q1] = to_rows(c.weighted_values(ds, kk) * scale)
        c.scatter_add(dk_flat, c.key_grad(ds, qh) * scale)
        c.scatter_add(dv_flat, c.key_grad(p, do))
    return dq, unflat_kv(dk_flat, k, dt), unflat_kv(dv_flat, v, dt)


class ReferenceSparseAttention(torch.autograd.Function):
    """Autograd wrapper: ``(q, k, v, index, scale) -> (out, lse fp32)``; with
    ``keep_precision`` both stay in the compute dtype (partials to be merged)."""

    @staticmethod
    def forward(ctx, q, k, v, index, scale, keep_precision=False):
        out, lse = forward_partial(q, k, v, index, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.scale = index, scale
        return (out, lse) if keep_precision else (out.to(q.dtype), lse.float())

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dlse is None:
            dlse = torch.zeros_like(lse)
        dq, dk, dv = backward_partial(q, k, v, ctx.index, ctx.scale, out, lse, dout, dlse.to(lse.dtype))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None

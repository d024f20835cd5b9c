"""Merging two partial attention results in one pass over the outputs, forward and backward.

``merge_attention_outputs`` merges two results computed apart. The reference ``combine``
(``sparse/reference.py``) does it in about eight elementwise passes over fp32 ``[B, S, H, D]``
tensors and keeps their autograd graph (a fifth of the ring's forward as its per-step merge:
docs/benchmarks.md, "2 x H200 at 512K after removing the last sync and fusing the merge").
Here each row's weights come
from its two LSEs (``merge_weights``, which the forward kernel's accumulate mode shares: the
ring now merges inside the attention kernel) and the row is read and written once. The backward
needs only the inputs: ``d out_i = w_i dout`` and ``d lse_i = w_i (dlse + dout . (out_i - out))``,
with ``dout . out = w_a dout . out_a + w_b dout . out_b``.

``merge_rows`` merges a partial result into named rows of a running one, in place, in one launch
(``varlen_blocks``' forward: a slot's rows, in the order its sort left them, into row order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # (position, head) rows per program


@triton.jit
def merge_weights(la, lb):
    """Per row of two results over disjoint keys, from their LSEs (natural log, fp32): the
    weights ``w_a``, ``w_b`` of each in the merged result, and its LSE. A row empty on
    both sides (both -inf) gets 0, 0 and -inf, with no NaN on the way."""
    peak = tl.maximum(la, lb)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    ea = tl.exp(la - peak)
    eb = tl.exp(lb - peak)
    total = ea + eb
    some = total > 0
    total = tl.where(some, total, 1.0)
    return ea / total, eb / total, tl.where(some, peak + tl.log(total), float("-inf"))


@triton.jit
def _weights(LSE_A, LSE_B, b, s, h, H, S, ok):
    """Per row: ``w_a``, ``w_b``, the merged LSE (natural log), and the LSE offsets."""
    offs = (b * H + h) * S + s
    la = tl.load(LSE_A + offs, mask=ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(LSE_B + offs, mask=ok, other=float("-inf")).to(tl.float32)
    wa, wb, lse = merge_weights(la, lb)
    return wa, wb, lse, offs


@triton.jit
def _rows(pid, N, H, S, ROWS: tl.constexpr, D_PAD: tl.constexpr, D):
    r = pid * ROWS + tl.arange(0, ROWS)
    ok = r < N
    h = r % H
    s = (r // H) % S
    b = r // (H * S)
    d = tl.arange(0, D_PAD)
    ptr = r[:, None] * D + d[None, :]
    return r, ok, b, s, h, ptr, ok[:, None] & (d < D)[None, :]


@triton.jit
def _combine_fwd(OUT_A, LSE_A, OUT_B, LSE_B, OUT, LSE, N, H, S, D, ROWS: tl.constexpr, D_PAD: tl.constexpr):
    r, ok, b, s, h, ptr, ok2 = _rows(tl.program_id(0), N, H, S, ROWS, D_PAD, D)
    wa, wb, lse, offs = _weights(LSE_A, LSE_B, b, s, h, H, S, ok)
    oa = tl.load(OUT_A + ptr, mask=ok2, other=0.0).to(tl.float32)
    ob = tl.load(OUT_B + ptr, mask=ok2, other=0.0).to(tl.float32)
    tl.store(OUT + ptr, (wa[:, None] * oa + wb[:, None] * ob).to(OUT.dtype.element_ty), mask=ok2)
    tl.store(LSE + offs, lse, mask=ok)


@triton.jit
def _combine_bwd(
    OUT_A, LSE_A, OUT_B, LSE_B, DOUT, DLSE, DOUT_A, DLSE_A, DOUT_B, DLSE_B, N, H, S, D,
    ROWS: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    r, ok, b, s, h, ptr, ok2 = _rows(tl.program_id(0), N, H, S, ROWS, D_PAD, D)
    wa, wb, _, offs = _weights(LSE_A, LSE_B, b, s, h, H, S, ok)
    oa = tl.load(OUT_A + ptr, mask=ok2, other=0.0).to(tl.float32)
    ob = tl.load(OUT_B + ptr, mask=ok2, other=0.0).to(tl.float32)
    g = tl.load(DOUT + ptr, mask=ok2, other=0.0).to(tl.float32)
    dlse = tl.load(DLSE + offs, mask=ok, other=0.0).to(tl.float32)
    ga = tl.sum(g * oa, 1)
    gb = tl.sum(g * ob, 1)
    g_out = wa * ga + wb * gb
    tl.store(DOUT_A + ptr, (wa[:, None] * g).to(DOUT_A.dtype.element_ty), mask=ok2)
    tl.store(DOUT_B + ptr, (wb[:, None] * g).to(DOUT_B.dtype.element_ty), mask=ok2)
    tl.store(DLSE_A + offs, (wa * (dlse + ga - g_out)).to(DLSE_A.dtype.element_ty), mask=ok)
    tl.store(DLSE_B + offs, (wb * (dlse + gb - g_out)).to(DLSE_B.dtype.element_ty), mask=ok)


def _launch(kernel, out_a, *args):
    b, s, h, d = out_a.shape
    n = b * s * h
    kernel[(triton.cdiv(n, ROWS),)](*args, n, h, s, d, ROWS=ROWS, D_PAD=triton.next_power_of_2(d))


class FusedCombine(torch.autograd.Function):
    """``combine`` for contiguous ``out_* [B, S, H, D]`` and ``lse_* [B, H, S]``: the output
    in ``out_a``'s dtype (the running result's, fp32 in the ring), the LSE in fp32."""

    @staticmethod
    def forward(ctx, out_a, lse_a, out_b, lse_b):
        out_a, lse_a, out_b, lse_b = (t.contiguous() for t in (out_a, lse_a, out_b, lse_b))
        out = torch.empty_like(out_a)
        lse = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)
        _launch(_combine_fwd, out_a, out_a, lse_a, out_b, lse_b, out, lse)
        ctx.save_for_backward(out_a, lse_a, out_b, lse_b)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out_a, lse_a, out_b, lse_b = ctx.saved_tensors
        dout = dout.contiguous() if dout is not None else torch.zeros_like(out_a)
        dlse = dlse.contiguous() if dlse is not None else torch.zeros(lse_a.shape, device=lse_a.device)
        grads = (torch.empty_like(out_a), torch.empty_like(lse_a), torch.empty_like(out_b), torch.empty_like(lse_b))
        _launch(_combine_bwd, out_a, out_a, lse_a, out_b, lse_b, dout, dlse, *grads)
        return grads[0], grads[1], grads[2], grads[3]


@triton.jit
def _merge_rows(OUT, LSE, PART, PART_LSE, ORDER, N, D, ROWS: tl.constexpr, D_PAD: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = i < N
    r = tl.load(ORDER + i, mask=ok, other=0).to(tl.int64)
    la = tl.load(LSE + r, mask=ok, other=float("-inf")).to(tl.float32)
    lb = tl.load(PART_LSE + i, mask=ok, other=float("-inf")).to(tl.float32)
    wa, wb, lse = merge_weights(la, lb)
    d = tl.arange(0, D_PAD)
    ok2 = ok[:, None] & (d < D)[None, :]
    to = r[:, None] * D + d[None, :]
    oa = tl.load(OUT + to, mask=ok2, other=0.0).to(tl.float32)
    ob = tl.load(PART + i.to(tl.int64)[:, None] * D + d[None, :], mask=ok2, other=0.0).to(tl.float32)
    tl.store(OUT + to, (wa[:, None] * oa + wb[:, None] * ob).to(OUT.dtype.element_ty), mask=ok2)
    tl.store(LSE + r, lse.to(LSE.dtype.element_ty), mask=ok)


def merge_rows(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor, order: torch.Tensor):
    """Merges, in place and in one launch, a partial result over other keys into some rows of a
    running one: row ``order[i]`` of ``out [rows, D]`` / ``lse [rows]`` (fp32 LSE) takes
    ``part [n, D]`` / ``part_lse [n]`` row ``i``. ``order`` (int32 or int64, ``[n]``) names
    each row at most once, so no two programs write one row. No autograd: the caller's own
    backward takes the merged result."""
    n, d = part.shape
    if n:
        _merge_rows[(triton.cdiv(n, ROWS),)](
            out, lse, part, part_lse, order, n, d, ROWS=ROWS, D_PAD=triton.next_power_of_2(d)
        )

"""``VarlenBlockAttention``: a ``BlockTopKIndex`` of wide blocks (MoBA's chunks) a key block at
a time on a library's varlen attention (``library``).

A row (token, query head) attends its own block causally and, in full, the earlier blocks it
chose. So the work is, with no row computed against a block it did not choose:

* the diagonal: one causal varlen call whose segments are the blocks, each block's rows against
  its own keys (q, k, v as they lie, the library's GQA);
* the rest: one call per selection slot ``j`` (each row's ``j``-th chosen block), over the rows
  whose ``j``-th block is an earlier one, sorted into one segment per (batch, KV head, block)
  that attends that block's keys with no mask. The rows of every query head of a GQA group
  share their KV head's segments, so K and V are laid out KV-head-major (a block's keys one
  contiguous run, one head) and nothing is repeated per query head.

A row appears at most once per slot, so one call's partial results go back to row order by a
gather (the inverse of the sort) and merge into the running result by their LSEs; nothing is
scattered and nothing is added by atomics. A call per slot, rather than one for all, gathers at
most one copy of q at a time, where all slots at once would gather ``topk - 1`` copies.

The backward runs each piece's library backward with its rows' *merged* output and LSE: then
``P = exp(s - lse)`` and ``rowsum(dO * O)`` make each piece's gradients exactly its share of
the whole attention's, with no gradient through the pieces' own LSEs. dQ sums the pieces by
gathers in row order, dK / dV the slots' per-block results, both in fp32. A gradient through the
returned LSE has no input in the library's backward (it computes ``rowsum(dO * O)`` itself), so
such a backward runs where the softmax gradient takes it: the block-bar Triton kernels on CUDA,
the PyTorch reference elsewhere.

The sort's layout is built on the device; the per-slot row counts and largest segments (the
library's ``max_q``) are read on the host once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...index import BlockTopKIndex, SparseIndex
from ...reference import backward_partial, combine, compute_dtype
from .. import triton_available
from ..block_bar.tables import tile_tables
from . import library as varlen

REQUIREMENTS = (
    "a BlockTopKIndex without packed documents; on CUDA, fp16/bf16 inputs whose head dim is a multiple of 8 up "
    "to 256 on sm80 or later, with PyTorch's FlashAttention-2 ops (on a CPU a PyTorch stand-in runs the calls)"
)


def unsupported(q: torch.Tensor, index: SparseIndex) -> str | None:
    """Why ``VarlenBlockAttention`` cannot compute ``sparse_attention(q, k, v, index)``, or
    None when it can (on a CPU with the stand-in calls)."""
    if not isinstance(index, BlockTopKIndex):
        return f"got a {type(index).__name__}"
    if index.documents is not None:
        return "got packed documents (cu_seqlens), which the varlen calls are not given"
    return varlen.unsupported(q) if q.is_cuda else None


@dataclass
class _Slot:
    """The rows one selection slot sends to earlier blocks, as one varlen call takes them."""

    order: torch.Tensor  # [rows] int32: the row (in q's [B, S, Hq] order) of each gathered row
    back: torch.Tensor  # [B*S*Hq] int32: each row's gathered row (clamped where it has none)
    present: torch.Tensor  # [B*S*Hq] bool: whether the row is in this slot's call
    cu_q: torch.Tensor  # [segments + 1] int32
    max_q: int


@dataclass
class Layout:
    """The varlen calls of an index: the diagonal's segments over the ``B*S`` token rows, the
    blocks' over the KV-head-major ``B*Hkv*S`` keys, and the slots with rows."""

    diagonal_cu: torch.Tensor
    key_cu: torch.Tensor
    block_len: int  # the longest segment of keys (and of diagonal rows)
    slots: list[_Slot]
    own: torch.Tensor | None  # [B, S, Hq] bool whether each row chose its own block; None: all did


def layout(index: BlockTopKIndex, hq: int, hkv: int) -> Layout:
    """The calls of ``index`` for ``hq`` query heads reading ``hkv`` KV heads. A chosen block
    after the row's own (which no builder chooses) is invisible and skipped, as are -1."""
    blocks = index.blocks
    b, s, hs, topk = blocks.shape
    bs, dev = index.block_size, blocks.device
    n = -(-s // bs)
    starts = torch.arange(n, device=dev) * bs
    diagonal_cu = _bounds(torch.arange(b, device=dev).view(-1, 1) * s + starts, b * s)
    key_cu = _bounds(torch.arange(b * hkv, device=dev).view(-1, 1) * s + starts, b * hkv * s)
    own_block = (torch.arange(s, device=dev) // bs).view(1, s, 1)
    kv_head = torch.arange(hq, device=dev) // (hq // hkv)
    segment_base = (torch.arange(b, device=dev).view(b, 1, 1) * hkv + kv_head.view(1, 1, hq)) * n
    segments = b * hkv * n
    bounds = torch.arange(segments + 1, device=dev)
    rows = torch.arange(b * s * hq, device=dev)
    sorts, stats = [], []
    for j in range(topk):
        chosen = blocks[..., j].repeat_interleave(hq // hs, dim=2).long()
        earlier = (chosen >= 0) & (chosen < own_block)
        # Rows of no earlier block sort last, past every segment.
        key = torch.where(earlier, segment_base + chosen, segments).flatten()
        sorted_key, order = torch.sort(key, stable=True)
        cu = torch.searchsorted(sorted_key, bounds, out_int32=True)
        sorts.append((order, cu))
        stats += [(cu[1:] - cu[:-1]).max().long(), cu[-1].long()]
    own = (blocks == own_block.unsqueeze(-1)).any(-1).repeat_interleave(hq // hs, dim=2)
    host = torch.stack([*stats, own.all().long()]).tolist()  # the one read on the host
    slots = []
    for (order, cu), max_q, count in zip(sorts, host[0:-1:2], host[1:-1:2], strict=True):
        if count == 0:
            continue
        inverse = torch.empty_like(order)
        inverse[order] = rows  # a permutation: each element written once
        slots.append(_Slot(order[:count].int(), inverse.clamp(max=count - 1).int(), inverse < count, cu, max_q))
    return Layout(diagonal_cu, key_cu, min(bs, s), slots, None if host[-1] else own)


def _bounds(starts: torch.Tensor, total: int) -> torch.Tensor:
    """int32 ``[starts..., total]``."""
    return torch.cat([starts.flatten(), starts.new_tensor([total])]).int()


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial results over disjoint keys merged by their LSEs (``[B, S, H, D]``,
    ``[B, H, S]``), in ``out_a``'s dtype."""
    if out_a.is_cuda and triton_available():
        from ..shared.combine import FusedCombine  # imports Triton

        return FusedCombine.apply(out_a, lse_a.float(), out_b, lse_b.float())
    return combine(out_a, lse_a, out_b, lse_b)


def _kv_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, Hkv, D]`` -> ``[B*Hkv*S, 1, D]``: each KV head's keys one run, as ``key_cu`` cuts them."""
    return x.transpose(1, 2).reshape(-1, 1, x.shape[-1])


class VarlenBlockAttention(torch.autograd.Function):
    """``(q, k, v, index, scale) -> (out, lse fp32 [B, Hq, S])`` of a ``BlockTopKIndex`` on the
    varlen calls of ``library`` (the module docstring). Callers check ``unsupported`` first."""

    @staticmethod
    def forward(ctx, q, k, v, index: BlockTopKIndex, scale: float):
        calls = varlen.library(q)
        q, k, v = (t.contiguous() for t in (q, k, v))
        b, s, hq, d = q.shape
        hkv = k.shape[2]
        plan = layout(index, hq, hkv)
        cu, length = plan.diagonal_cu, plan.block_len
        diagonal, lse = calls.forward(
            q.view(b * s, hq, d), k.view(b * s, hkv, d), v.view(b * s, hkv, d), cu, cu, length, length, True, scale
        )
        out = diagonal.view(b, s, hq, d).to(compute_dtype(q.dtype))
        lse = lse.view(hq, b, s).transpose(0, 1)
        if plan.own is not None:  # rows that did not choose their own block take nothing from it
            out = out.masked_fill(~plan.own.unsqueeze(-1), 0)
            lse = lse.masked_fill(~plan.own.transpose(1, 2), float("-inf"))
        k_major, v_major = _kv_major(k), _kv_major(v)
        q_rows = q.view(-1, d)
        for slot in plan.slots:
            segments = (slot.cu_q, plan.key_cu, slot.max_q, length, False, scale)
            part, part_lse = calls.forward(q_rows[slot.order].unsqueeze(1), k_major, v_major, *segments)
            part = part.view(-1, d)[slot.back].view(b, s, hq, d)
            part_lse = torch.where(slot.present, part_lse.view(-1)[slot.back], float("-inf"))
            out, lse = _merge(out, lse, part, part_lse.view(b, s, hq).transpose(1, 2))
        out = out.to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.plan, ctx.scale = index, plan, scale
        ctx.set_materialize_grads(False)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only the LSE reached the loss
            dout = torch.zeros_like(out)
        if dlse is not None:
            return *_with_lse_gradient(q, k, v, ctx.index, ctx.scale, out, lse, dout, dlse), None, None
        calls, plan, scale = varlen.library(q), ctx.plan, ctx.scale
        b, s, hq, d = q.shape
        hkv = k.shape[2]
        dout = dout.to(q.dtype).contiguous()
        cu, length = plan.diagonal_cu, plan.block_len
        diagonal_lse = lse.transpose(0, 1)
        if plan.own is not None:  # an LSE of +inf gives those rows no probability in their block
            diagonal_lse = diagonal_lse.masked_fill(~plan.own.permute(2, 0, 1), float("inf"))
        dq, dk, dv = calls.backward(
            dout.view(b * s, hq, d), q.view(b * s, hq, d), k.view(b * s, hkv, d), v.view(b * s, hkv, d),
            out.view(b * s, hq, d), diagonal_lse.reshape(hq, b * s).contiguous(), cu, cu, length, length, True, scale,
        )  # fmt: skip
        dt = compute_dtype(q.dtype)
        dq = dq.view(-1, d).to(dt)
        k_major, v_major = _kv_major(k), _kv_major(v)
        dk_major = torch.zeros(k_major.shape, dtype=dt, device=k.device)
        dv_major = torch.zeros(v_major.shape, dtype=dt, device=v.device)
        dout_rows, q_rows, out_rows = dout.view(-1, d), q.view(-1, d), out.view(-1, d)
        lse_rows = lse.transpose(1, 2).reshape(-1)
        for slot in plan.slots:
            g = slot.order
            dq_part, dk_part, dv_part = calls.backward(
                dout_rows[g].unsqueeze(1), q_rows[g].unsqueeze(1), k_major, v_major, out_rows[g].unsqueeze(1),
                lse_rows[g].unsqueeze(0).contiguous(), slot.cu_q, plan.key_cu, slot.max_q, length, False, scale,
            )  # fmt: skip
            dq += torch.where(slot.present.unsqueeze(-1), dq_part.view(-1, d)[slot.back], 0)
            dk_major += dk_part
            dv_major += dv_part
        dk = dk.view(b, s, hkv, d).to(dt) + dk_major.view(b, hkv, s, d).transpose(1, 2)
        dv = dv.view(b, s, hkv, d).to(dt) + dv_major.view(b, hkv, s, d).transpose(1, 2)
        return dq.view(b, s, hq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _with_lse_gradient(q, k, v, index, scale, out, lse, dout, dlse):
    """(dq, dk, dv) of a backward with an LSE gradient, given the final out and lse."""
    if q.is_cuda:
        if not triton_available():
            raise RuntimeError("a gradient through the LSE of the 'varlen_blocks' kernel needs the Triton kernels")
        from ..block_bar.attention import kernel_backward  # imports Triton

        return kernel_backward(q, k, v, tile_tables(index), scale, out, lse.float(), dout, dlse)
    dq, dk, dv = backward_partial(q, k, v, index, scale, out, lse, dout, dlse.to(lse.dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

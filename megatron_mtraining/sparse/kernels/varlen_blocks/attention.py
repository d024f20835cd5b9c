"""``VarlenBlockAttention``: a ``BlockTopKIndex`` of wide blocks (MoBA's chunks) a key block at
a time on a library's varlen attention (``library``).

A row (token, query head) attends its own block causally and, in full, the earlier blocks it
chose. So the work is, with no row computed against a block it did not choose:

* the diagonal: one causal varlen call whose segments are the blocks, each block's rows against
  its own keys (q, k, v as they lie, the library's GQA);
* the rest: per selection slot ``j`` (each row's ``j``-th chosen block), the rows whose
  ``j``-th block is an earlier one, sorted into one segment per (batch, KV head, block) that
  attends that block's keys with no mask. The rows of every query head of a GQA group share
  their KV head's segments, so K and V are laid out KV-head-major (a block's keys one
  contiguous run, one head) and nothing is repeated per query head. Slots share a call up to
  ``CALL_ROWS`` rows (``_calls``), each slot's segments over its own copy of the keys (a few
  MiB), so that no two segments of a call write one key's gradient.

A row appears at most once per slot, so a slot's partial results merge by their LSEs straight
into the rows the sort names (``order``), in place in the running result (kept in row order,
``[B*S*Hq, D]`` and ``[B*S*Hq]``): on CUDA one Triton launch per slot reads the partial rows,
the running rows they name, and writes the merge back; no row is written twice, so nothing is
added by atomics and no inverse permutation is built. A call of a few slots, rather than one
for all, gathers a few copies of q at a time, where all slots at once would gather ``topk - 1``
copies.

The backward runs each piece's library backward with its rows' *merged* output and LSE: then
``P = exp(s - lse)`` and ``rowsum(dO * O)`` make each piece's gradients exactly its share of
the whole attention's, with no gradient through the pieces' own LSEs. dQ adds each slot's rows
into row order (each row once a slot), dK / dV the slots' per-block results, both in fp32 sums
begun with the diagonal's. A gradient through the returned LSE has no input in the library's
backward (it computes ``rowsum(dO * O)`` itself), so such a backward runs where the softmax
gradient takes it: the block-bar Triton kernels on CUDA, the PyTorch reference elsewhere.

Every launch of the layer is a cost of its own: at 128K tokens the GPU waited on the host between
the small ones (issue 21). So the layout (``layout``) is built for all slots at once on the
device, in a fixed number of operations whatever ``topk`` (one sort per ``SORT_ENTRIES`` keys),
and a call costs the forward one gather, the library call and a merge per slot, the backward
one gather, the library call and three adds per slot. On CUDA the rows move on ``shared.rows``: a slot's
rows of dO, q, O and the LSE in one launch (``gather_rows``: PyTorch's indexing takes one a
source and reads the index each time), and dQ's sum in one launch that converts the part as it
adds (``add_rows``, with no atomics: a slot names a row once); elsewhere PyTorch's indexing and
``index_add_``, which they equal bit for bit. The per-slot row counts and largest segments (the
library's ``max_q``) are read on the host once per forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ...index import BlockTopKIndex, SparseIndex
from ...reference import backward_partial, combine, compute_dtype
from .. import triton_available
from ..block_bar.tables import tile_tables
from . import choose
from . import library as varlen

REQUIREMENTS = (
    "a BlockTopKIndex without packed documents; on CUDA, fp16/bf16 inputs whose head dim is a multiple of 8 up "
    "to 256 on sm80 or later, with PyTorch's FlashAttention-2 ops (on a CPU a PyTorch stand-in runs the calls)"
)
# Sort keys per ``torch.sort`` in ``layout``: every slot of a 128K-token, 16-head layer's (2M rows
# a slot) in two sorts, with the sort's temporaries (int32 keys, int64 indices, their copies)
# bounded near 400 MiB whatever the length.
SORT_ENTRIES = 1 << 24
# Gathered rows a call of several selection slots may hold (``_calls``). cuDNN's backward gives
# each program a key tile and walks that tile's segment rows, so a slot's few long segments
# (the blocks most rows choose) ran on a few programs with the GPU idle beside them; a second
# slot's segments fill it (docs/benchmarks.md, "MoBA's varlen calls two slots at a time"). Each
# slot more holds its gathered rows (q, dO, O) and cuDNN's dQ accumulator for them, so a call
# takes a second slot only within this bound: two at 128K tokens of 16 heads, one a call from
# 256K on, where a slot's rows alone pass it and the memory stays what one slot needs.
CALL_ROWS = 1 << 22


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
    own: torch.Tensor | None  # [B*S*Hq] bool whether each row chose its own block; None: all did


def layout(index: BlockTopKIndex, hq: int, hkv: int) -> Layout:
    """The calls of ``index`` for ``hq`` query heads reading ``hkv`` KV heads. A chosen block
    after the row's own (which no builder chooses) is invisible and skipped, as are -1.

    Every slot is laid out by the same few operations, not a round of them per slot: each row's
    sort key is its segment offset by ``slot * (segments + 1)`` (rows of no earlier block take
    the slot's last key, past its segments), so one stable sort of up to ``SORT_ENTRIES`` keys
    orders several slots at once, each slot's rows one contiguous run in its own order, and one
    ``searchsorted`` cuts every slot's segments."""
    blocks = index.blocks
    b, s, hs, topk = blocks.shape
    bs, dev = index.block_size, blocks.device
    n = -(-s // bs)
    segments = b * hkv * n
    rows = b * s * hq
    # Key segment i (a KV head's block, KV-head-major) starts at (i // n) * s + (i % n) * bs; the
    # first b * n + 1 bounds are also the diagonal's over the token rows.
    bound = torch.arange(segments + 1, device=dev)
    key_cu = ((bound // n) * s + (bound % n) * bs).int()
    # [topk, B, S, Hs, Hq / Hs]: slot-major, so that each slot's keys are one contiguous run.
    chosen = blocks.permute(3, 0, 1, 2).unsqueeze(-1)
    own_block = torch.arange(s, device=dev, dtype=blocks.dtype).view(1, 1, s, 1, 1) // bs
    kv_head = torch.arange(hq, device=dev, dtype=blocks.dtype) // (hq // hkv)
    base = (torch.arange(b, device=dev, dtype=blocks.dtype).view(b, 1) * hkv + kv_head) * n
    slot_base = torch.arange(topk, device=dev, dtype=blocks.dtype).view(-1, 1, 1, 1, 1) * (segments + 1)
    earlier = (chosen >= 0) & (chosen < own_block)
    key = torch.empty(topk, rows, device=dev, dtype=blocks.dtype)  # slot-major: written so, not copied
    torch.where(
        earlier,
        chosen + (base.view(1, b, 1, hs, -1) + slot_base),
        slot_base + segments,
        out=key.view(topk, b, s, hs, -1),
    )
    per_sort = max(1, SORT_ENTRIES // rows)
    offsets = torch.arange(min(per_sort, topk), device=dev, dtype=torch.int32).view(-1, 1) * rows
    orders, cus = [], []
    for j0 in range(0, topk, per_sort):
        j1 = min(j0 + per_sort, topk)
        sorted_key, order = torch.sort(key[j0:j1].flatten(), stable=True)
        bounds = torch.arange(j0 * (segments + 1), j1 * (segments + 1), device=dev, dtype=key.dtype)
        # Positions in the sorted run of slots j0..j1-1 less each slot's start: its own.
        cu = torch.searchsorted(sorted_key, bounds, out_int32=True).view(j1 - j0, -1) - offsets[: j1 - j0]
        orders.append(order.int().view(j1 - j0, rows) - offsets[: j1 - j0])
        cus.append(cu)
    order = orders[0] if len(orders) == 1 else torch.cat(orders)
    cu = cus[0] if len(cus) == 1 else torch.cat(cus)  # [topk, segments + 1]
    own = (blocks == own_block.view(1, s, 1, 1)).any(-1)  # [B, S, Hs]
    longest = (cu[:, 1:] - cu[:, :-1]).amax(1)
    host = torch.cat([longest, cu[:, -1], own.all().view(1)]).tolist()  # the one read on the host
    slots = [
        _Slot(order[j, :count], cu[j], max_q)
        for j, (max_q, count) in enumerate(zip(host[:topk], host[topk:-1], strict=True))
        if count
    ]
    own = None if host[-1] else own.repeat_interleave(hq // hs, dim=2).flatten()
    return Layout(key_cu[: b * n + 1], key_cu, min(bs, s), slots, own)


@dataclass
class _Call:
    """One library call over several slots' rows (``CALL_ROWS``): the slots' rows one
    run after another, each slot's segments reading its own copy of the keys, so that no two
    segments of the call write one key's gradient."""

    order: torch.Tensor  # [rows] int32: the slots' orders, one after another
    cu_q: torch.Tensor  # [copies * segments + 1] int32
    cu_k: torch.Tensor  # [copies * segments + 1] int32, over ``copies`` copies of the keys
    max_q: int
    copies: int
    runs: list[tuple[int, int]]  # each slot's rows [a, b) among the call's


def _calls(plan: Layout, keys: int, call_rows: int) -> list[_Call]:
    """The slots of ``plan`` in calls of at most ``call_rows`` rows (a slot of more runs alone);
    ``keys``: the rows of the KV-head-major keys. The largest slot left opens each call and
    the smallest left join it while they fit, so that the calls' rows come out even."""
    left = sorted(plan.slots, key=lambda slot: -slot.order.shape[0])
    groups: list[list[_Slot]] = []
    while left:
        group = [left.pop(0)]
        rows = group[0].order.shape[0]
        while left and rows + left[-1].order.shape[0] <= call_rows:
            group.append(left.pop())
            rows += group[-1].order.shape[0]
        groups.append(group)
    calls = []
    for group in groups:
        counts = [slot.order.shape[0] for slot in group]
        starts = list(itertools.accumulate([0, *counts[:-1]]))
        runs = [(a, a + n) for a, n in zip(starts, counts, strict=True)]
        max_q = max(slot.max_q for slot in group)
        if len(group) == 1:
            calls.append(_Call(group[0].order, group[0].cu_q, plan.key_cu, max_q, 1, runs))
            continue
        # Each slot's (and key copy's) bounds past those before it; the first's as they are.
        cu_q = [group[0].cu_q[:-1], *(slot.cu_q[:-1] + a for slot, (a, _) in zip(group[1:], runs[1:], strict=True))]
        cu_k = [plan.key_cu[:-1], *(plan.key_cu[:-1] + c * keys for c in range(1, len(group)))]
        calls.append(
            _Call(
                order=torch.cat([slot.order for slot in group]),
                cu_q=torch.cat([*cu_q, group[-1].cu_q[-1:] + starts[-1]]),
                cu_k=torch.cat([*cu_k, plan.key_cu[-1:] + (len(group) - 1) * keys]),
                max_q=max_q,
                copies=len(group),
                runs=runs,
            )
        )
    return calls


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor, order):
    """Merges the partial result ``part [n, D]`` / ``part_lse [n]`` over disjoint keys into rows
    ``order`` of the running ``out [rows, D]`` / ``lse [rows]``, in place, by their LSEs."""
    if out.is_cuda and triton_available():
        from ..shared.combine import merge_rows  # imports Triton

        merge_rows(out, lse, part, part_lse, order)
        return
    rows, d = order.long(), out.shape[-1]
    merged, merged_lse = combine(
        out[rows].view(1, -1, 1, d), lse[rows].view(1, 1, -1), part.view(1, -1, 1, d), part_lse.view(1, 1, -1)
    )
    out[rows] = merged.view(-1, d).to(out.dtype)
    lse[rows] = merged_lse.view(-1).to(lse.dtype)


def _triton_rows(t: torch.Tensor) -> bool:
    """Whether rows indexed by ``t`` move on the Triton kernels (``shared.rows``): on CUDA.
    Elsewhere PyTorch's indexing, which the kernels equal bit for bit (the tests force them on
    a CPU, under the interpreter, to show it)."""
    return t.is_cuda and triton_available()


def _gather(order: torch.Tensor, *sources: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``source[order]`` of each source: on CUDA one launch for all (``gather_rows``)."""
    if _triton_rows(order):
        from ..shared.rows import gather_rows  # imports Triton

        return gather_rows(order, *sources)
    return tuple(x[order] for x in sources)


def _add_into(target: torch.Tensor, order: torch.Tensor, part: torch.Tensor):
    """``target[order] += part`` in ``target``'s dtype, ``order`` naming each row once: on CUDA
    one launch that converts ``part`` on the way (``add_rows``)."""
    if _triton_rows(order):
        from ..shared.rows import add_rows  # imports Triton

        add_rows(target, order, part)
        return
    target.index_add_(0, order, part.to(target.dtype))


def _kv_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, Hkv, D]`` -> ``[B*Hkv*S, 1, D]``: each KV head's keys one run, as ``key_cu`` cuts them."""
    return x.transpose(1, 2).reshape(-1, 1, x.shape[-1])


def _copies(x: torch.Tensor, slot_calls: list[_Call]) -> torch.Tensor:
    """``x`` once for each key copy the widest call reads, one after another."""
    copies = max((call.copies for call in slot_calls), default=1)
    return x if copies == 1 else x.repeat(copies, 1, 1)


def _transposed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, S1, S2, D]`` as a contiguous ``[B, S2, S1, D]`` of ``dtype``, in one copy."""
    b, s1, s2, d = x.shape
    return torch.empty(b, s2, s1, d, dtype=dtype, device=x.device).copy_(x.transpose(1, 2))


class VarlenBlockAttention(torch.autograd.Function):
    """``(q, k, v, index, scale) -> (out, lse fp32 [B, Hq, S])`` of a ``BlockTopKIndex`` on the
    varlen calls of ``library`` (the module docstring). Callers check ``unsupported`` first."""

    @staticmethod
    def forward(ctx, q, k, v, index: BlockTopKIndex, scale: float):
        calls = choose.library(q)
        q, k, v = (t.contiguous() for t in (q, k, v))
        b, s, hq, d = q.shape
        hkv = k.shape[2]
        plan = layout(index, hq, hkv)
        cu, length = plan.diagonal_cu, plan.block_len
        diagonal, lse = calls.forward(
            q.view(b * s, hq, d), k.view(b * s, hkv, d), v.view(b * s, hkv, d), cu, cu, length, length, True, scale
        )
        # The running result in q's row order: [B*S*Hq, D] and [B*S*Hq].
        out = diagonal.view(-1, d).to(compute_dtype(q.dtype))
        lse = lse.t().reshape(-1)
        if plan.own is not None:  # rows that did not choose their own block take nothing from it
            out.masked_fill_(~plan.own.unsqueeze(-1), 0)
            lse.masked_fill_(~plan.own, float("-inf"))
        k_major, v_major = _kv_major(k), _kv_major(v)
        keys = k_major.shape[0]
        slot_calls = _calls(plan, keys, CALL_ROWS)
        k_copies, v_copies = (_copies(t, slot_calls) for t in (k_major, v_major))
        q_rows = q.view(-1, d)
        for call in slot_calls:
            (rows,) = _gather(call.order, q_rows)
            part, part_lse = calls.forward(
                rows.unsqueeze(1), k_copies[: call.copies * keys], v_copies[: call.copies * keys], call.cu_q,
                call.cu_k, call.max_q, length, False, scale,
            )  # fmt: skip
            part, part_lse = part.view(-1, d), part_lse.view(-1)
            for a, z in call.runs:
                _merge_into(out, lse, part[a:z], part_lse[a:z], call.order[a:z])
        out = out.view(b, s, hq, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.plan, ctx.slot_calls, ctx.scale = index, plan, slot_calls, scale
        ctx.set_materialize_grads(False)
        return out, _transposed(lse.view(b, s, hq, 1), torch.float32).view(b, hq, s)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors  # lse: [B*S*Hq], q's row order
        b, s, hq, d = q.shape
        hkv = k.shape[2]
        if dout is None:  # only the LSE reached the loss
            dout = torch.zeros_like(out)
        if dlse is not None:
            lse = lse.view(b, s, hq).transpose(1, 2).contiguous()
            return *_with_lse_gradient(q, k, v, ctx.index, ctx.scale, out, lse, dout, dlse), None, None
        calls, plan, scale = choose.library(q), ctx.plan, ctx.scale
        dout = dout.to(q.dtype).contiguous()
        cu, length = plan.diagonal_cu, plan.block_len
        diagonal_lse = lse
        if plan.own is not None:  # an LSE of +inf gives those rows no probability in their block
            diagonal_lse = diagonal_lse.masked_fill(~plan.own, float("inf"))
        dq, dk, dv = calls.backward(
            dout.view(b * s, hq, d), q.view(b * s, hq, d), k.view(b * s, hkv, d), v.view(b * s, hkv, d),
            out.view(b * s, hq, d), diagonal_lse.view(b * s, hq).t().contiguous(), cu, cu, length, length, True,
            scale,
        )  # fmt: skip
        # The sums in fp32, begun with the diagonal's: dQ in row order, dK / dV KV-head-major.
        dt = compute_dtype(q.dtype)
        dq = dq.view(-1, d).to(dt)
        dk_major, dv_major = (_transposed(t.view(b, s, hkv, d), dt).view(-1, 1, d) for t in (dk, dv))
        k_major, v_major = _kv_major(k), _kv_major(v)
        keys = k_major.shape[0]
        k_copies, v_copies = (_copies(t, ctx.slot_calls) for t in (k_major, v_major))
        dout_rows, q_rows, out_rows = dout.view(-1, d), q.view(-1, d), out.view(-1, d)
        for call in ctx.slot_calls:
            dout_g, q_g, out_g, lse_g = _gather(call.order, dout_rows, q_rows, out_rows, lse)
            n = call.copies * keys
            dq_part, dk_part, dv_part = calls.backward(
                dout_g.unsqueeze(1), q_g.unsqueeze(1), k_copies[:n], v_copies[:n], out_g.unsqueeze(1),
                lse_g.unsqueeze(0), call.cu_q, call.cu_k, call.max_q, length, False, scale,
            )  # fmt: skip
            dq_part = dq_part.view(-1, d)
            for a, z in call.runs:  # each row once a slot: nothing added twice
                _add_into(dq, call.order[a:z], dq_part[a:z])
            for c in range(call.copies):
                dk_major += dk_part[c * keys : (c + 1) * keys]
                dv_major += dv_part[c * keys : (c + 1) * keys]
        dk, dv = (_transposed(t.view(b, hkv, s, d), k.dtype) for t in (dk_major, dv_major))
        return dq.view(b, s, hq, d).to(q.dtype), dk, dv, None, None


def _with_lse_gradient(q, k, v, index, scale, out, lse, dout, dlse):
    """(dq, dk, dv) of a backward with an LSE gradient, given the final out and lse."""
    if q.is_cuda:
        if not triton_available():
            raise RuntimeError("a gradient through the LSE of the 'varlen_blocks' kernel needs the Triton kernels")
        from ..block_bar.attention import kernel_backward  # imports Triton

        return kernel_backward(q, k, v, tile_tables(index), scale, out, lse.float(), dout, dlse)
    dq, dk, dv = backward_partial(q, k, v, index, scale, out, lse, dout, dlse.to(lse.dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

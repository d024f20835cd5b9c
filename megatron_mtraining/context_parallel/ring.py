"""Sparse ring attention over a context-parallel group.

Q and O stay on their rank; K/V chunks travel around the ring, each rank attending
its queries to every chunk under the per-step view of one global sparse index
(``StepIndex``), merging partial (out, lse). The next chunk's transfer is posted
before the current step's compute. In the backward, dK/dV accumulators travel
with their chunk and reach its owner after a full turn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..sparse.index import SparseIndex, VerticalSlashIndex, VerticalSlashPart
from ..sparse.reference import (
    ReferenceSparseAttention,
    backward_partial,
    combine,
    compute_dtype,
    forward_partial,
)
from ..sparse.validation import check_qkv, check_softmax_scale, fail
from .comm import RingExchange
from .imbalance import RingStats
from .layout import ContextParallelLayout
from .step_index import StepIndex


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, steps: list[StepIndex], ring: list[int], scale: float):
        dt = compute_dtype(q.dtype)
        b, s, h, d = q.shape
        out = torch.zeros(b, s, h, d, dtype=dt, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=dt, device=q.device)
        exchange = RingExchange(ring)
        k_cur, v_cur = k, v
        for i, step in enumerate(steps):
            if i + 1 < len(steps):
                exchange.start([k_cur, v_cur])
            if step.may_attend():
                out, lse = combine(out, lse, *forward_partial(q, k_cur, v_cur, step, scale))
            if i + 1 < len(steps):
                k_cur, v_cur = exchange.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.steps, ctx.ring, ctx.scale = steps, ring, scale
        return out, lse  # compute dtype: merged with the local bars before the cast

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dt = out.dtype
        kv_exchange, grad_exchange = RingExchange(ctx.ring), RingExchange(ctx.ring)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        k_cur, v_cur = k, v
        dlse = torch.zeros_like(lse) if dlse is None else dlse.to(dt)
        for i, step in enumerate(ctx.steps):
            if i + 1 < len(ctx.steps):
                kv_exchange.start([k_cur, v_cur])
            if step.may_attend():
                dq_s, dk_s, dv_s = backward_partial(q, k_cur, v_cur, step, ctx.scale, out, lse, dout, dlse)
                dq += dq_s
            else:
                dk_s, dv_s = (torch.zeros(k.shape, dtype=dt, device=k.device) for _ in range(2))
            # The accumulator of the chunk held now arrived from the previous rank last step.
            dk_acc, dv_acc = grad_exchange.wait() if i else (dk_s.new_zeros(dk_s.shape), dv_s.new_zeros(dv_s.shape))
            grad_exchange.start([dk_acc + dk_s, dv_acc + dv_s])
            if i + 1 < len(ctx.steps):
                k_cur, v_cur = kv_exchange.wait()
        dk, dv = grad_exchange.wait()  # our own chunk's, after a full turn
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _GatherColumns(torch.autograd.Function):
    """K/V at global token positions ``columns`` on every rank: each owner fills in its
    tokens and one sum assembles them (exact: one owner per column). The gradient
    is summed over ranks and returned to the owners."""

    @staticmethod
    def forward(ctx, k, v, columns, local_positions, seq_len, group):
        local_of = torch.full((seq_len,), -1, dtype=torch.long, device=k.device)
        local_of[local_positions] = torch.arange(len(local_positions), device=k.device)
        mine = local_of[columns] >= 0
        ctx.mine, ctx.local, ctx.group = mine, local_of[columns[mine]], group
        gathered = []
        for x in (k, v):
            buf = x.new_zeros(x.shape[0], len(columns), *x.shape[2:])
            buf[:, mine] = x[:, ctx.local]
            dist.all_reduce(buf, group=group)
            gathered.append(buf)
        ctx.shapes = (k.shape, v.shape)
        return tuple(gathered)

    @staticmethod
    def backward(ctx, dk_cols, dv_cols):
        grads = []
        for g, shape in zip((dk_cols, dv_cols), ctx.shapes, strict=True):
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.group)
            local = g.new_zeros(shape)
            local[:, ctx.local] = g[:, ctx.mine]
            grads.append(local)
        return grads[0], grads[1], None, None, None, None


def ring_work(index: SparseIndex) -> SparseIndex:
    """What the ring computes: everything but a vertical-slash index's bars, which every
    rank computes locally against the gathered vertical K/V (balanced across ranks,
    whereas on the ring a chunk holding sink columns would load one rank per step)."""
    return VerticalSlashPart(index, "tiles") if isinstance(index, VerticalSlashIndex) else index


def _local_bars(q, k, v, index: VerticalSlashIndex, q_pos, group, scale):
    """(bar index, (out, lse)) of this rank's queries over the vertical columns, or None
    when the index has none."""
    columns = torch.unique(index.vertical[index.vertical >= 0]).long()
    if not len(columns):
        return None
    k_cols, v_cols = _GatherColumns.apply(k, v, columns, q_pos, index.seq_len, group)
    bars = StepIndex(VerticalSlashPart(index, "bars"), q_pos, columns)
    return bars, ReferenceSparseAttention.apply(q, k_cols, v_cols, bars, scale, True)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern,
    layout: ContextParallelLayout,
    cp_group=None,
    hierarchy=None,
    softmax_scale: float | None = None,
    stats: RingStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of this rank's tokens over the whole sequence.

    q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]`` hold this rank's tokens in the
    layout's order (``layout.shard``); returns (out ``[B, L, Hq, D]``, lse
    ``[B, Hq, L]`` fp32), equal to the single-device ``sparse_attention`` on the
    whole sequence, sharded. ``pattern``: a global ``SparseIndex`` built for the
    whole sequence (identical on every rank), or a pattern config whose index is
    built here from the distributed q/k (see ``distributed_index``).
    ``stats``: filled with the attended area per ring step (imbalance accounting).
    """
    from .distributed_index import build_distributed_index

    check_qkv(q, k, v)
    group_size = dist.get_world_size(cp_group)
    if layout.cp_size != group_size:
        fail("layout.cp_size", layout.cp_size, f"the size of cp_group ({group_size})")
    if q.shape[1] != layout.local_len:
        fail("q.shape[1]", q.shape[1], f"the layout's tokens per rank ({layout.local_len})")
    if hierarchy is not None:
        fail("hierarchy", hierarchy, "None: the hierarchical ring is not available in this version")
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    rank = dist.get_rank(cp_group)
    index = (
        pattern if isinstance(pattern, SparseIndex) else build_distributed_index(pattern, q, k, layout, cp_group, scale)
    )
    q_pos = layout.positions(rank, q.device)
    # Flat ring: at step i this rank holds the K/V chunk of rank (rank - i) mod W.
    sources = [(rank - i) % group_size for i in range(group_size)]
    steps = [StepIndex(ring_work(index), q_pos, layout.positions(src, q.device)) for src in sources]
    ring = [dist.get_global_rank(cp_group, r) if cp_group is not None else r for r in range(group_size)]
    out, lse = _RingAttention.apply(q, k, v, steps, ring, scale)
    local = _local_bars(q, k, v, index, q_pos, cp_group, scale) if isinstance(index, VerticalSlashIndex) else None
    if local is not None:
        out, lse = combine(out, lse, *local[1])
    if stats is not None:
        per_step = [int(step.attended_area().sum()) if step.may_attend() else 0 for step in steps]
        stats.record(rank, per_step, int(local[0].attended_area().sum()) if local is not None else 0)
    return out.to(q.dtype), lse.float()

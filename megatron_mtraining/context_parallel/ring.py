"""Sparse context-parallel attention: the ring (flat or hierarchical) and its entry point.

Q and O stay on their rank; K/V chunks travel around the ring (inside a node, and
from node to node for the hierarchical ring, in the flat ring's step order:
``ring_schedule``), each rank attending its queries to
every chunk under the per-step view of one global sparse index (``StepIndex``) and
adding each chunk's part into one running (out, lse), inside the attention kernel
where the kernels run. Transfers are posted before the compute they overlap. In the
backward, dK/dV accumulators follow their chunk back to its owner. A
vertical-slash index's vertical columns are attended locally, against their gathered
K/V rather than on the ring, which keeps the ring's work balanced; on the kernels, in
the launch of the last ring step, so that its tiles and the columns share one program
per query block. Their K/V are taken from the chunks as they pass, and the host builds
their tile tables once the first step's kernel is launched, so that no host work but that
step's one-launch tables (``tables_kernel``) precedes the GPU's first attention kernel.

``ring_attention`` also runs the all-gather exchange (``kv_allgather``), which ``auto``
picks for a flat group on one node.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..sparse.attention import sparse_attention
from ..sparse.dispatch import attention_kernel, log_decision
from ..sparse.index import SparseIndex, VerticalSlashIndex, VerticalSlashPart, compact
from ..sparse.reference import compute_dtype
from ..sparse.validation import check_choice, check_qkv, check_softmax_scale, fail
from .distributed_index import build_index, scatter_rows
from .hierarchy import hierarchy_ranks
from .imbalance import RingStats
from .kv_allgather import AllGatherAttention, GatheredKV
from .layout import ContextParallelLayout, TokenPositions
from .node_gather import NodeGatherSchedule
from .pieces import Piece, last_attending, nothing_attended
from .ring_schedule import RingSchedule
from .step_index import StepIndex
from .step_tables import StepTables

KV_EXCHANGES = ("auto", "ring", "allgather")


class _RingAttention(torch.autograd.Function):
    """All of a rank's attention as one result: the ring's steps in ``RingSchedule``'s order,
    ``steps[o][i]`` the view of the chunk held at outer step ``o``, inner step ``i``, then the
    vertical columns (``columns``; None when the index has none). Every piece adds into one
    running result (``Piece``). The columns' K/V are taken from each chunk as it passes, and
    their piece is made once the first step's kernel is launched, so that the host's column
    work overlaps it; they ride along in the last step's launch where the kernels allow, else
    run as a piece of their own after the ring. ``schedule`` has posted its first outer
    transfer (``RingSchedule.post_first``).

    Backward: each piece is recomputed from the final out / lse, so no piece keeps its
    own result. dK/dV accumulators go home as ``ring_schedule.Accumulators`` says; the
    columns' gradients go back to their owners by one sum over ranks.
    """

    @staticmethod
    def forward(ctx, q, k, v, columns, steps, schedule, group, scale: float, comm_timer):
        carrier = steps[-1][-1]
        if columns is not None and columns.rides:
            carrier.attends = True
        own_piece = columns is not None and not columns.rides  # the columns' piece ends the result
        last = None if own_piece else last_attending([s for row in steps for s in row])
        result = None
        for o, i, kv in schedule.chunks([k, v]):
            step = steps[o][i]
            if columns is not None:  # the own chunk too: a node's gathered chunks hold others'
                columns.take(step.index.keys, *kv)
            result = step.forward(q, *kv, scale, result, step is last, columns.kv if columns else None)
            if columns is not None and (o, i) == (0, 0):
                columns.start()
        if own_piece:
            result = columns.piece.forward(q, *columns.kv, scale, result, True)
        out, lse = result if result is not None else nothing_attended(q)
        ctx.save_for_backward(q, k, v, *(columns.kv if columns else (None, None)), out, lse)
        ctx.columns, ctx.steps, ctx.last = columns, steps, columns.piece if own_piece else last
        ctx.schedule = schedule
        ctx.group, ctx.scale, ctx.comm_timer = group, scale, comm_timer
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, k_cols, v_cols, out, lse = ctx.saved_tensors
        dt = compute_dtype(q.dtype)
        schedule = ctx.schedule.backward()

        def zeros():
            return [torch.zeros(k.shape, dtype=dt, device=k.device), torch.zeros(v.shape, dtype=dt, device=v.device)]

        def piece(step, kv, dq):
            return step.backward(q, *kv, ctx.scale, out, lse, dout, dlse, dq, step is ctx.last, (k_cols, v_cols))

        accumulators = schedule.accumulators(zeros)
        dq, col_grads = None, None
        for o, i, kv in schedule.chunks([k, v]):
            dq, grads, cols = piece(ctx.steps[o][i], kv, dq)
            if cols is not None:  # the step that attended the columns
                col_grads = cols
            accumulators.add(i, grads)
        if ctx.columns is not None and not ctx.columns.rides:
            dq, col_grads, _ = piece(ctx.columns.piece, (k_cols, v_cols), dq)
        dk, dv = accumulators.own()  # every rank's parts of our own chunk
        if col_grads is not None:
            dk, dv = ctx.columns.add_grads(col_grads, dk, dv, ctx.group)
        dq = torch.zeros_like(q) if dq is None else dq.to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


class _VerticalColumns:
    """A vertical-slash index's vertical columns, which every rank attends locally against
    their K/V gathered from every rank (balanced, where on the ring a chunk holding sink
    columns would load one rank per step). ``rides``: whether the ring's last step attends
    them in its own launch (``ColumnKeys``, both as tile tables; tiles and bars in
    programs of their own cost about 14% on one GPU), else they are a piece of their own.

    Forward: ``take`` copies the columns held in each chunk as it passes this rank: every
    chunk passes every rank, so the column K/V are whole by the last step, at the cost of
    one small copy per step and no collective of their own (a sum over ranks after the
    first step's kernel waited for that kernel and for the other rank; docs/benchmarks.md,
    "Context-parallel layouts in one launch"), the own chunk at the first step included.
    ``start`` makes the columns' piece and its tables while the first step's kernel runs.
    Backward, ``add_grads``: the columns' gradients, summed over ranks, added to the owners'
    dK/dV."""

    def __init__(self, index: VerticalSlashIndex, queries: TokenPositions, use_kernels: bool, timer, carrier):
        self.index, self.queries, self.use_kernels, self.timer = index, queries, use_kernels, timer
        self.carrier = carrier
        self.rides = use_kernels and StepTables(VerticalSlashPart(index, "bars"), queries).whole_blocks()
        self.positions = vertical_columns(index)
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.piece: Piece | None = None
        self.mine: torch.Tensor | None = None  # each column's row in this rank's chunk, or -1

    def take(self, keys: TokenPositions, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Adds the columns among the chunk's keys (at ``keys``) to the column K/V; returns
        each column's row in the chunk (-1 where it is not there)."""
        with record_function("mtraining.ring.take_columns"):
            # Masks rather than boolean indexing: the sizes come from shapes, not from the device.
            found = keys.index_of(self.positions, self.index.seq_len)  # -1: in another chunk, or padding
            held = (found >= 0).view(1, -1, 1, 1)
            rows = [x.index_select(1, found.clamp(min=0)) for x in (k, v)]
            before = self.kv if self.kv is not None else (0, 0)
            self.kv = tuple(torch.where(held, r, b) for r, b in zip(rows, before, strict=True))
        return found

    def start(self) -> None:
        """Once the first step's kernel is launched: where this rank's own columns lie among
        its keys, and the columns' piece and its tables, which the host builds while that
        kernel runs."""
        if self.piece is not None:
            return
        self.mine = self.queries.index_of(self.positions, self.index.seq_len)
        with record_function("mtraining.ring.column_piece"):
            self.piece = _column_piece(self.index, self.queries, self.positions, self.use_kernels, self.timer)
            if self.rides:
                self.carrier.columns = self.piece
                _ = self.piece.tables

    def add_grads(self, grads, dk: torch.Tensor, dv: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for g, acc in zip(grads, (dk, dv), strict=True):
            g = g.to(acc.dtype).contiguous().clone()
            dist.all_reduce(g, group=group)
            out.append(acc + scatter_rows(g, self.mine, acc.shape[1]))
        return out[0], out[1]


def ring_work(index: SparseIndex) -> SparseIndex:
    """What the ring computes: everything but a vertical-slash index's bars, which every
    rank computes locally against the gathered vertical K/V (balanced across ranks,
    whereas on the ring a chunk holding sink columns would load one rank per step)."""
    return VerticalSlashPart(index, "tiles") if isinstance(index, VerticalSlashIndex) else index


def vertical_columns(index: VerticalSlashIndex) -> torch.Tensor:
    """Every head's vertical columns, ascending, each once, -1 padded to a width that
    shapes fix (one per list entry, at most the sequence), so that sizing the gather
    reads nothing from the device. Where heads share columns the union is narrower
    than that, by up to the head count; the padding gathers zero rows no bar reads."""
    ordered = index.vertical.flatten().sort().values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return compact(ordered, first & (ordered >= 0), min(len(ordered), index.seq_len))[0]


def _column_piece(index: VerticalSlashIndex, queries: TokenPositions, keys, use_kernels: bool, timer) -> Piece:
    """This rank's queries over the vertical columns, whose K/V rows are at ``keys`` (the
    gathered columns, or the whole sequence)."""
    bars = StepIndex(VerticalSlashPart(index, "bars"), queries, keys)
    # Taken as attending: asking (``may_attend``) would read gathered positions from the device.
    return Piece(bars, StepTables(bars.index, queries) if use_kernels else None, timer, True)


def _rings(members: list[int], rank: int, hierarchy) -> tuple[list[int], list[int]]:
    """Global ranks of this rank's inner and outer rings. Flat: the inner ring is the
    whole group; hierarchical: see ``hierarchy_ranks``."""
    if hierarchy is None:
        return members, [members[rank]]
    return hierarchy_ranks(members, rank, hierarchy)


def _exchange(kv_exchange: str, hierarchy, one_node: bool) -> str:
    """The K/V exchange to run: ``ring``, ``allgather`` or, with a hierarchy, ``allgather``
    inside each node and the ring across nodes (``node_allgather``, ``node_gather``). ``auto``:
    the all-gather on a flat group whose ranks share a node (``one_node``), the ring
    otherwise. On one node the all-gather kept more of the single-GPU throughput than the
    ring on 2 and on 8 H200s (docs/benchmarks.md, "Context parallelism over all-gathered
    K/V" and "8 x H200"). Across nodes its K/V bytes would cross the slow link with nothing
    to hide them but the index build, where the ring overlaps every transfer with a step's
    kernel; with a hierarchy ``auto`` keeps the ring until the node gather has run on NCCL."""
    if kv_exchange == "auto":
        return "allgather" if hierarchy is None and one_node else "ring"
    if kv_exchange == "allgather" and hierarchy is not None:
        return "node_allgather"
    return kv_exchange


_ONE_NODE: dict[tuple[int, ...], bool] = {}


def _on_one_node(members: list[int], group) -> bool:
    """Whether every rank of the group runs on one host: asked once per group and process
    (one small all-gather of host names), then remembered."""
    key = tuple(members)
    if key not in _ONE_NODE:
        hosts = [None] * len(members)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _ONE_NODE[key] = len(set(hosts)) == 1
    return _ONE_NODE[key]


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
    backend: str | None = None,
    kv_exchange: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of this rank's tokens over the whole sequence.

    q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]`` hold this rank's tokens in the
    layout's order (``layout.shard``); returns (out ``[B, L, Hq, D]``, lse
    ``[B, Hq, L]`` fp32), equal to the single-device ``sparse_attention`` on the
    whole sequence, sharded. ``pattern``: a global ``SparseIndex`` built for the
    whole sequence (identical on every rank), or a pattern
    (``megatron_mtraining.patterns``) whose index is built here from the distributed
    q/k (``distributed_index.IndexSource``).
    ``hierarchy``: None (flat ring) or ``(inner_group, outer_group)`` for the
    hierarchical ring (inner ring inside a node, outer ring across nodes, each
    inter-node transfer but the forward's first overlapped with a whole inner ring; the
    steps in the flat ring's order, which striping balances). cp_size 1 runs the
    local kernel. ``kv_exchange``: ``ring``, ``allgather`` (flat: every rank gathers the
    whole K/V and attends it in one piece, ``kv_allgather``; with a hierarchy: each node
    gathers the K/V of one node at a time, which travel the outer ring, ``node_gather``;
    balanced with the layout's ``node_size`` set to the inner size) or ``auto`` (the all-gather
    for a flat group on one node, else the ring; see ``_exchange``). ``stats``: filled with
    the attended area per ring step (outer-major; one step for the all-gather, one per outer
    step for the node gather) and of the local vertical-column pass, and with
    ``time_kernels`` their kernel times and the exposed transfer wait (imbalance
    accounting). ``backend``: as for ``sparse_attention``; a step whose
    tokens are not whole kernel blocks runs on the reference path. ``cu_seqlens``: the
    whole sequence's packed documents (by global position, the same on every rank), for a
    pattern's index (an index passed as ``pattern`` carries its own); every ring step
    masks each row by its document start, by global position.
    """
    check_qkv(q, k, v)
    group_size = dist.get_world_size(cp_group) if dist.is_initialized() else 1
    if layout.cp_size != group_size:
        fail("layout.cp_size", layout.cp_size, f"the size of cp_group ({group_size})")
    if q.shape[1] != layout.local_len:
        fail("q.shape[1]", q.shape[1], f"the layout's tokens per rank ({layout.local_len})")
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    check_choice("kv_exchange", kv_exchange, KV_EXCHANGES)
    if group_size == 1:
        index = build_index(pattern, q, k, scale, cu_seqlens=cu_seqlens)
        return sparse_attention(q, k, v, index, softmax_scale=scale, backend=backend)
    rank = dist.get_rank(cp_group)
    members = dist.get_process_group_ranks(cp_group) if cp_group is not None else list(range(group_size))
    one_node = kv_exchange == "auto" and hierarchy is None and _on_one_node(members, cp_group)
    exchange = _exchange(kv_exchange, hierarchy, one_node)
    inner, outer = _rings(members, rank, hierarchy)
    n_inner, n_outer = {"allgather": (1, 1), "node_allgather": (1, len(outer)), "ring": (len(inner), len(outer))}[
        exchange
    ]
    step_timers, local_timer, comm_timer = (stats if stats is not None else RingStats()).new_timers(
        rank, n_outer * n_inner, q.device
    )
    # Posted before the index build, which the transfer then overlaps.
    gathered = GatheredKV(k, v, layout.gathered(layout.ranks, q.device), cp_group) if exchange == "allgather" else None
    schedule = None
    if exchange == "ring":
        schedule = RingSchedule(inner, outer, comm_timer)
    elif exchange == "node_allgather":
        schedule = NodeGatherSchedule(inner, outer, hierarchy[0], layout, comm_timer)
    if schedule is not None:
        schedule.post_first([k, v])
    index = build_index(pattern, q, k, scale, layout, cp_group, cu_seqlens)
    queries = layout.token_positions(rank, q.device)
    work = ring_work(index)
    step_tables = StepTables(work, queries)
    decision = attention_kernel(q, index, backend, piece=True, whole_blocks=step_tables.whole_blocks())
    log_decision(decision, f"ring_attention ({exchange}) rank {rank}")
    use_kernels = decision.kernel == "block_bar"
    step_tables = step_tables if use_kernels else None
    has_columns = isinstance(index, VerticalSlashIndex) and index.vertical.shape[-1]

    # Named ranges show where a call's host time goes in torch.profiler / Nsight traces.
    # Nothing here reads the device (bar a top-k index's table widths, once), so the host
    # runs ahead of the GPU: it builds each ring step's tables while the kernel of the
    # step before runs (the first's before any launch).
    if gathered is not None:
        # One piece: the whole index (tiles and vertical columns) over the whole sequence's
        # keys, in one set of tile tables, as on one device.
        keys = layout.whole_sequence(q.device)
        whole = Piece(
            StepIndex(index, queries, keys), StepTables(index, queries) if use_kernels else None, step_timers[0], True
        )
        with record_function("mtraining.allgather.attention"):
            out, lse = AllGatherAttention.apply(q, k, v, gathered, whole, scale, comm_timer)
        steps, column_piece = [[whole]], None
    else:
        # Each step's K/V are those the schedule names: one rank's chunk in the flat ring's
        # order, or a node's chunks.
        def step(o: int, i: int) -> Piece:
            view = StepIndex(work, queries, schedule.keys(o, i, layout, q.device))
            return Piece(view, step_tables, step_timers[o * n_inner + i], view.may_attend())

        steps = [[step(o, i) for i in range(n_inner)] for o in range(n_outer)]
        # The last step carries the columns: its tables are built while earlier steps run.
        columns = _VerticalColumns(index, queries, use_kernels, local_timer, steps[-1][-1]) if has_columns else None
        with record_function("mtraining.ring.steps"):
            out, lse = _RingAttention.apply(q, k, v, columns, steps, schedule, cp_group, scale, comm_timer)
        column_piece = columns.piece if columns is not None else None
    if stats is not None:
        per_step = [int(s.index.attended_area().sum()) if s.attends else 0 for row in steps for s in row]
        local_area = int(column_piece.index.attended_area().sum()) if column_piece is not None else 0
        stats.record(rank, per_step, local_area)
    return out, lse.float()

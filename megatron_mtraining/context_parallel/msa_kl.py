"""MSA's KL loss under context parallelism: the index keys travel the ring as the main K/V do,
and the KL is computed where the queries live.

Each rank holds its rows' main queries q ``[B, L, Hq, D]``, index queries q_idx
``[B, L, Hkv, d_idx]`` and the main pass's LSE ``[B, Hq, L]`` over every key of the rows
(``ring_attention``'s second output: the teacher's normaliser), and its tokens' main keys k
``[B, L, Hkv, D]`` and index keys k_idx ``[B, L, 1, d_idx]``. :class:`RingMSAKL`:

* Forward: the index keys go round the ring (``RingExchange``; each transfer is posted before
  the step whose compute it overlaps). Per step, the partial index LSE of this rank's rows over
  the visiting chunk's visible selected keys: the fused ``index_lse`` kernel with the step's
  tile tables (``StepTables``) on the kernels, ``msa.kl_index_lse`` on a ``StepIndex``
  otherwise; the steps merge per row by ``logaddexp``. No KL value is computed: the result is
  a zero scalar that carries the graph, as the fused single-device loss does.
* Backward: the main keys and index keys go round again. Per step: this rank's rows' dq_idx
  (added up here), the chunk's dk_idx (an fp32 accumulator that travels with its chunk and is
  back at its owner after the full circle, as ring attention's dK/dV) and the rows' KL terms;
  ``on_value`` then gets this rank's share of the KL, on both backends.
* Scale: every step divides by ``B * S * Hkv``, the whole sequence's rows, so each rank's
  share is the sum over its rows / the whole sequence's row count, and the shares add up to
  the single-device loss and gradient under Megatron's context-parallel scaling of auxiliary
  losses (``megatron/msa_loss.py``).

No rank holds a tensor of the whole sequence's size: its own tokens, one visiting chunk (and
in the backward one travelling dk_idx accumulator), its rows' LSEs, and the global index,
which every rank holds already. ``dispatch.kl_kernel`` decides the backend once per call
(the kernels where they serve the inputs and the layout's tokens are whole kernel blocks).
Packed documents: both backends mask each row by its document start at its global position
(the kernels through the step's tables, which carry the whole sequence's start vector; the
PyTorch steps through the ``StepIndex``), as the ring attention does. The ring is flat over
the whole group, hierarchical context-parallel groups included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..sparse.dispatch import kl_kernel, log_decision
from ..sparse.kernels.block_bar.tables import TileTables
from ..sparse.msa import _check_kl_inputs, kl_backward_partial, kl_index_lse
from ..sparse.reference import compute_dtype
from ..sparse.validation import check_tensor, fail
from .comm import RingExchange
from .layout import ContextParallelLayout
from .step_index import StepIndex
from .step_tables import StepTables


class _Step:
    """One ring step: this rank's rows against the chunk of keys it holds then (``view``);
    with ``step_tables`` (the kernels) its tile tables, built once when the forward reaches
    it and kept for the backward."""

    def __init__(self, view: StepIndex, step_tables: StepTables | None):
        self.view, self.step_tables = view, step_tables
        self.attends = view.may_attend()  # False: every key of the chunk lies after every row

    @functools.cached_property
    def tables(self) -> TileTables:
        tables = self.step_tables.of(self.view.keys)
        if tables is None:
            # ``StepTables.whole_blocks`` promised every step's tables.
            raise RuntimeError("a ring step of the MSA KL on the kernels has no tile tables")
        return tables

    def index_lse(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, L]`` partial index LSE of the rows over the chunk's keys."""
        if self.step_tables is None:
            return kl_index_lse(q_idx, k_idx, self.view)
        from ..sparse.kernels.msa_kl.loss import index_lse  # imports Triton

        return index_lse(q_idx, k_idx, self.tables)

    def backward(self, q, k, lse, q_idx, k_idx, lse_idx, scale: float, grad: torch.Tensor, rows: int):
        """(the rows' dq_idx, the chunk's dk_idx, the rows' KL terms) of this step."""
        if self.step_tables is None:
            return kl_backward_partial(q, k, lse, q_idx, k_idx, lse_idx, self.view, scale, grad, rows)
        from ..sparse.kernels.msa_kl.loss import kl_backward  # imports Triton

        # fp32: dq_idx adds up over the steps, dk_idx in the accumulator travelling to its owner.
        return kl_backward(q, k, lse, q_idx, k_idx, lse_idx, self.tables, scale, grad, rows, torch.float32)


@dataclass
class _Ring:
    """A layer call's ring: the group's global ranks in ring order, the steps (step ``i``
    holds the chunk of the rank ``i`` places before this one), the softmax scale and the
    whole sequence's row count ``B * S * Hkv``."""

    members: list[int]
    steps: list[_Step]
    scale: float
    rows: int


class RingMSAKL(torch.autograd.Function):
    """This rank's share of MSA's KL loss under context parallelism (the module docstring):
    a zero scalar (fp32; fp64 for fp64 inputs) whose gradient is the share's, reaching ``q_idx`` and ``k_idx`` (the
    latter through its owner's returning accumulator); ``on_value`` gets the share in the
    backward."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, q, k, lse, ring: _Ring, on_value):
        exchange = RingExchange(ring.members)
        n = len(ring.steps)
        lse_idx = None
        keys = k_idx
        for i, step in enumerate(ring.steps):
            if i + 1 < n:
                exchange.start([keys])
            if step.attends:
                part = step.index_lse(q_idx, keys)
                lse_idx = part if lse_idx is None else torch.logaddexp(lse_idx, part)
            if i + 1 < n:
                (keys,) = exchange.wait()
        if lse_idx is None:  # no row sees a key (not under causal attention, where each sees itself)
            b, length, hkv, _ = q_idx.shape
            lse_idx = torch.full((b, hkv, length), float("-inf"), dtype=compute_dtype(q_idx.dtype), device=q.device)
        ctx.save_for_backward(q_idx, k_idx, q, k, lse, lse_idx)
        ctx.ring, ctx.on_value = ring, on_value
        # In the compute dtype (fp32, fp64 for fp64 inputs): the upstream gradient arrives in it.
        return torch.zeros((), dtype=compute_dtype(q_idx.dtype), device=q_idx.device)

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, q, k, lse, lse_idx = ctx.saved_tensors
        ring = ctx.ring
        n = len(ring.steps)
        dt = compute_dtype(q_idx.dtype)
        chunks_x, grads_x = RingExchange(ring.members), RingExchange(ring.members)
        dq_idx = torch.zeros(q_idx.shape, dtype=dt, device=q_idx.device)
        kl = torch.zeros(lse_idx.shape, dtype=dt, device=q_idx.device)
        chunk = (k, k_idx)
        for i, step in enumerate(ring.steps):
            if i + 1 < n:
                chunks_x.start(list(chunk))
            dk_s = None
            if step.attends:
                k_s, k_idx_s = chunk
                dq_s, dk_s, kl_s = step.backward(q, k_s, lse, q_idx, k_idx_s, lse_idx, ring.scale, grad, ring.rows)
                dq_idx += dq_s
                kl += kl_s
            # The accumulator of the chunk held now arrived from the predecessor (ours starts here).
            acc = grads_x.wait()[0] if i else torch.zeros(k_idx.shape, dtype=dt, device=k_idx.device)
            grads_x.start([acc if dk_s is None else acc + dk_s])
            if i + 1 < n:
                chunk = tuple(chunks_x.wait())
        (dk_idx,) = grads_x.wait()  # our own chunk's, after the full circle
        if ctx.on_value is not None:
            ctx.on_value((kl.sum() / ring.rows).float())
        return dq_idx.to(q_idx.dtype), dk_idx.to(k_idx.dtype), None, None, None, None, None


def ring_msa_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    index,
    lse: torch.Tensor,
    layout: ContextParallelLayout,
    cp_group=None,
    softmax_scale: float | None = None,
    on_value: Callable[[torch.Tensor], None] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """This rank's share of ``msa_kl_loss`` on the whole sequence (:class:`RingMSAKL`): a zero
    scalar to back-propagate; ``on_value`` receives the share (0-dim fp32) in the backward.

    q ``[B, L, Hq, D]``, k ``[B, L, Hkv, D]``, q_idx ``[B, L, Hkv, d_idx]``, k_idx
    ``[B, L, 1, d_idx]`` hold this rank's tokens in the layout's order; ``lse [B, Hq, L]`` the
    main pass's LSE of these rows (``ring_attention``'s); ``index`` the global selection
    (``BlockTopKIndex``, or ``DenseIndex`` in warmup), the same on every rank."""
    scale = _check_kl_inputs(q, k, q_idx, k_idx, index, softmax_scale, layout.seq_len)
    b, length, hq, _ = q.shape
    group_size = dist.get_world_size(cp_group)
    if layout.cp_size != group_size:
        fail("layout.cp_size", layout.cp_size, f"the size of cp_group ({group_size})")
    if length != layout.local_len:
        fail("q.shape[1]", length, f"the layout's tokens per rank ({layout.local_len})")
    check_tensor("lse", lse, ndim=3)
    if lse.shape != (b, hq, length):
        fail("lse.shape", tuple(lse.shape), f"[B, Hq, L] = {[b, hq, length]}, the main pass's logsumexp of the rows")
    rank = dist.get_rank(cp_group)
    members = dist.get_process_group_ranks(cp_group) if cp_group is not None else list(range(group_size))
    queries = layout.token_positions(rank, q.device)
    step_tables = StepTables(index, queries)
    decision = kl_kernel(q, q_idx, index, backend, whole_blocks=step_tables.whole_blocks())
    log_decision(decision, f"ring_msa_kl rank {rank}")
    use_kernels = decision.kernel == "msa_kl"
    steps = [
        _Step(
            StepIndex(index, queries, layout.token_positions((rank - i) % group_size, q.device)),
            step_tables if use_kernels else None,
        )
        for i in range(group_size)
    ]
    ring = _Ring(members, steps, scale, b * layout.seq_len * k.shape[2])
    return RingMSAKL.apply(q_idx, k_idx, q.detach(), k.detach(), lse.detach(), ring, on_value)

"""A piece of one rank's context-parallel attention: one K/V chunk's ring step, the
local pass over gathered vertical columns, or the whole sequence's K/V after an
all-gather, each adding its part into the running result of the pieces before it.
"""

from __future__ import annotations

import functools

import torch
from torch.profiler import record_function

from ..sparse.kernels.block_bar.tables import TileTables
from ..sparse.reference import backward_partial, combine, compute_dtype, forward_partial
from .imbalance import KernelTimer, timed
from .step_index import StepIndex
from .step_tables import StepTables


class Piece:
    """One piece of a rank's attention work (a ring step, or the local vertical-column
    pass): its index view, whether it has anything to compute (``attends``) and, where the
    kernels serve it (``step_tables`` given), its tile tables (built once, used by the
    forward and the backward); with a ``timer`` its computations are timed (``RingStats``).

    Each piece adds its part into the running result of the pieces before it: the
    forward into ``(out, lse)``, the backward into ``dq``. On the kernels the sum is fp32
    and added inside the kernel (no merge or accumulation pass of its own over the
    rows), and the ``last`` piece writes it in q's dtype (no cast pass). The reference
    path merges with ``combine`` and keeps the compute dtype, as single-device
    ``sparse_attention`` does.

    ``columns``: the local column piece, whose keys (the gathered columns, passed to
    ``forward`` / ``backward`` as ``cols``) this step's kernels attend as bars beside its
    tiles (``ColumnKeys``); the step then also returns the columns' gradients."""

    def __init__(self, index: StepIndex, step_tables: StepTables | None, timer: KernelTimer | None, attends: bool):
        self.index, self.step_tables, self.timer, self.attends = index, step_tables, timer, attends
        self.columns: Piece | None = None

    @functools.cached_property
    def tables(self) -> TileTables | None:
        # Built when the forward reaches the step: building them reads nothing from the device,
        # so the host does it while the previous step's kernel runs.
        if self.step_tables is None:
            return None
        with record_function("mtraining.ring.step_tables"):
            return self.step_tables.of(self.index.keys)

    def _column_keys(self, cols):
        if self.columns is None:
            return None
        if self.tables is None or self.columns.tables is None:
            # ``StepTables.whole_blocks`` promised both tables before they were built.
            raise RuntimeError("a ring step attending the vertical columns has no tile tables")
        from ..sparse.kernels.block_bar.attention import ColumnKeys  # imports Triton

        return ColumnKeys(*cols, self.columns.tables)

    def forward(self, q, k, v, scale, running, last: bool, cols=None):
        """``running`` (out, lse) with this piece's keys added (this piece's alone when
        ``running`` is None)."""
        if not self.attends:
            return running
        with timed(self.timer, "fwd"):
            columns = self._column_keys(cols)
            if self.tables is None:
                partial = forward_partial(q, k, v, self.index, scale)
                return partial if running is None else combine(*running, *partial)
            from ..sparse.kernels.block_bar.attention import kernel_forward  # imports Triton

            out_dtype = q.dtype if last else torch.float32
            return kernel_forward(q, k, v, self.tables, scale, running, out_dtype, columns=columns)

    def backward(self, q, k, v, scale, out, lse, dout, dlse, dq, last: bool, cols=None):
        """(``dq`` with this piece's added (its own when ``dq`` is None), (dk, dv), the
        columns' (dk, dv) or None), given the final ``out`` / ``lse``, which is all a
        piece's gradient needs."""
        if not self.attends:
            return dq, (torch.zeros_like(k), torch.zeros_like(v)), None
        with timed(self.timer, "bwd"):
            columns = self._column_keys(cols)
            if self.tables is None:
                dlse = torch.zeros_like(lse) if dlse is None else dlse.to(lse.dtype)
                dq_s, dk, dv = backward_partial(q, k, v, self.index, scale, out, lse, dout, dlse)
                return (dq_s if dq is None else dq.add_(dq_s)), (dk, dv), None
            from ..sparse.kernels.block_bar.attention import kernel_backward  # imports Triton

            dq_dtype = q.dtype if last else torch.float32
            dq, *grads = kernel_backward(
                q, k, v, self.tables, scale, out, lse, dout, dlse, dq, dq_dtype, columns=columns
            )
            return dq, tuple(grads[:2]), (tuple(grads[2:]) if self.columns is not None else None)


def last_attending(pieces) -> Piece | None:
    """The piece that completes the result (``pieces`` in the forward's and backward's
    order; None entries skipped), if any attends."""
    attending = [p for p in pieces if p is not None and p.attends]
    return attending[-1] if attending else None


def nothing_attended(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of rows that see no key: zeros and -inf, as on one device."""
    b, s, h, _ = q.shape
    return torch.zeros_like(q), torch.full((b, h, s), float("-inf"), dtype=compute_dtype(q.dtype), device=q.device)

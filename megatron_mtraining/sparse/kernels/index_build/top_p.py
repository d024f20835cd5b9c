"""The top-p take of the vertical-slash selection in one Triton launch (CUDA inputs).

``vertical_slash._selected`` marks which of a head's best ``cap`` scores the budget takes
(the fewest, best first, whose mass reaches ``p`` of the total; never a zero) and adds the
forced first entries: about 20 small torch operations per statistic, each a kernel launch
and a node of the index build's CUDA graph. Here one program per head does the fp64
running sum over the candidates and writes the candidate list that ``sort_kept`` orders.
The running sum adds in another order than ``torch.cumsum``, so a budget can differ from
the torch path's only where a prefix's mass equals ``p`` of the total to fp64 rounding;
the tests compare the two on random scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...index import INT32_MAX

CHUNK = 1024  # candidates per loop step
_DROPPED = tl.constexpr(INT32_MAX)  # a candidate not taken; sort_kept turns it into padding


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["k", "forced", "n_first", "width"])
def _take_kernel(TOP, ORDER, LIMIT, OUT, k, forced, n_first, width, CH: tl.constexpr):
    row = tl.program_id(0)
    limit = tl.load(LIMIT + row)
    c = tl.arange(0, CH)
    for i0 in range(0, n_first, CH):
        i = i0 + c
        tl.store(OUT + row * width + i, i, mask=i < n_first)
    mass = limit * 0.0  # fp64 mass of the candidates before this step
    for i0 in range(0, k, CH):
        i = i0 + c
        ok = i < k
        top = tl.load(TOP + row * k + i, mask=ok, other=0.0).to(tl.float64)
        before = mass + tl.cumsum(top, 0) - top
        idx = tl.load(ORDER + row * k + i, mask=ok, other=0)
        take = ok & (before < limit) & (top > 0) & (idx >= forced)
        tl.store(OUT + row * width + n_first + i, tl.where(take, idx, _DROPPED).to(tl.int32), mask=ok)
        mass += tl.sum(top, 0)


def take_top_p(top: torch.Tensor, order: torch.Tensor, limit: torch.Tensor, forced: int, n_first: int) -> torch.Tensor:
    """``vertical_slash._taken`` in one launch: from the best scores ``top [..., k]``
    (descending, fp32) at ``order`` (int64) and the mass to reach ``limit [..., 1]`` (fp64),
    ``[..., n_first + k]`` int32: the first ``n_first`` indices, then each candidate's index
    where the budget takes it and it is not among the first ``forced``, else ``INT32_MAX``."""
    k = top.shape[-1]
    out = torch.empty(*top.shape[:-1], n_first + k, dtype=torch.int32, device=top.device)
    _take_kernel[(limit.numel(),)](
        top.contiguous(), order.contiguous(), limit.contiguous(), out, k, forced, n_first, n_first + k, CH=CHUNK
    )
    return out

"""Load-balance accounting of ring attention (MTraining paper, Table 3).

``area[r, s]``: attended (query, key) pairs rank ``r`` computes at ring step ``s``
(summed over batch and heads). Worker-level imbalance degree: max/mean over ranks
within a step, averaged over steps; step-level: max/mean over steps within a rank,
averaged over ranks. 1.0 is perfect balance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..sparse.index import SparseIndex
from .layout import ContextParallelLayout


def imbalance_degrees(area: torch.Tensor) -> tuple[float, float]:
    """(worker-level ID, step-level ID) of a ``[ranks, steps]`` area matrix."""
    a = area.double()
    worker = a.amax(0) / a.mean(0).clamp_min(1e-30)
    step = a.amax(1) / a.mean(1).clamp_min(1e-30)
    busy_steps = a.sum(0) > 0
    return float(worker[busy_steps].mean()), float(step.mean())


@dataclass
class RingStats:
    """Per-rank, per-step attended area recorded by ``ring_attention``."""

    area: dict[int, list[int]] = field(default_factory=dict)

    def record(self, rank: int, per_step: list[int]) -> None:
        self.area[rank] = per_step

    def gather(self, group=None) -> torch.Tensor:
        """All ranks' rows as a ``[ranks, steps]`` matrix (a small all-gather)."""
        rows = [None] * dist.get_world_size(group)
        dist.all_gather_object(rows, self.area, group=group)
        merged = {r: a for part in rows for r, a in part.items()}
        return torch.tensor([merged[r] for r in sorted(merged)], dtype=torch.float64)


def block_area_matrix(index: SparseIndex, block: int) -> torch.Tensor:
    """``[n, n]`` attended pairs between query block i and key block j (``block`` tokens),
    summed over batch and heads, from the key lists the kernels read."""
    n = -(-index.seq_len // block)
    area = torch.zeros(n * n, dtype=torch.float64, device=index.device)
    for q0, q1 in index.query_ranges(index.seq_len):
        keys = index.key_lists(q0, q1)
        visible = index.visible(keys, q0, q1)
        keys = keys.expand_as(visible)  # a list shared by a chunk's rows counts for each row
        rows = torch.arange(q0, q1, device=keys.device).view(1, 1, -1, 1).expand_as(keys)
        pair = (rows // block) * n + keys.clamp(min=0) // block
        # Each entry stands for the query heads of its selection head (and for every
        # batch element when the list is shared across the batch).
        weight = index.num_heads // index.selection_heads * index.batch_size // keys.shape[0]
        area.index_add_(
            0, pair[visible], torch.full(pair[visible].shape, float(weight), device=area.device, dtype=torch.float64)
        )
    return area.view(n, n)


def simulate_ring_areas(index: SparseIndex, layout: ContextParallelLayout, block: int) -> torch.Tensor:
    """``[ranks, steps]`` areas of the flat ring for ``index`` under ``layout``, without
    processes. ``block`` must divide the layout's stripes (or zigzag chunks)."""
    tiles = block_area_matrix(index, block)
    owner = torch.empty(tiles.shape[0], dtype=torch.long)
    for r in range(layout.cp_size):
        owner[layout.positions(r)[::block] // block] = r
    per_rank = torch.zeros(layout.cp_size, layout.cp_size, dtype=torch.float64)
    per_rank.index_put_((owner.view(-1, 1).expand_as(tiles), owner.view(1, -1).expand_as(tiles)), tiles.cpu(), True)
    # Step s of rank r computes against the chunk of rank (r - s) mod W.
    steps = (torch.arange(layout.cp_size).view(-1, 1) - torch.arange(layout.cp_size).view(1, -1)) % layout.cp_size
    return per_rank.gather(1, steps)

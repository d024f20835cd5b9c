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
    """Attended area recorded by ``ring_attention``: per rank and ring step, and per rank
    for the local pass over gathered vertical columns (vertical-slash only)."""

    ring: dict[int, list[int]] = field(default_factory=dict)
    local: dict[int, int] = field(default_factory=dict)

    def record(self, rank: int, per_step: list[int], local: int = 0) -> None:
        self.ring[rank] = per_step
        self.local[rank] = local

    def gather(self, group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' figures (a small all-gather): ``[ranks, steps]`` ring areas and
        ``[ranks]`` local areas."""
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (self.ring, self.local), group=group)
        ring = {r: a for part, _ in parts for r, a in part.items()}
        local = {r: a for _, part in parts for r, a in part.items()}
        return (
            torch.tensor([ring[r] for r in sorted(ring)], dtype=torch.float64),
            torch.tensor([local[r] for r in sorted(local)], dtype=torch.float64),
        )


def simulate_ring_areas(index: SparseIndex, layout: ContextParallelLayout, block: int) -> torch.Tensor:
    """``[ranks, steps]`` areas the flat ring computes for ``index`` under ``layout``
    (for a vertical-slash index pass its tiles, ``ring_work(index)``), without
    processes. ``block`` must divide the layout's stripes (or zigzag chunks)."""
    tiles = index.block_areas(block)
    owner = torch.empty(tiles.shape[0], dtype=torch.long)
    for r in range(layout.cp_size):
        owner[layout.positions(r)[::block] // block] = r
    per_rank = torch.zeros(layout.cp_size, layout.cp_size, dtype=torch.float64)
    per_rank.index_put_((owner.view(-1, 1).expand_as(tiles), owner.view(1, -1).expand_as(tiles)), tiles.cpu(), True)
    # Step s of rank r computes against the chunk of rank (r - s) mod W.
    steps = (torch.arange(layout.cp_size).view(-1, 1) - torch.arange(layout.cp_size).view(1, -1)) % layout.cp_size
    return per_rank.gather(1, steps)

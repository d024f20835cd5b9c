"""Load-balance accounting of ring attention (MTraining paper, Table 3).

``area[r, s]``: attended (query, key) pairs rank ``r`` computes at ring step ``s``
(summed over batch and heads). Worker-level imbalance degree: max/mean over ranks
within a step, averaged over steps; step-level: max/mean over steps within a rank,
averaged over ranks. 1.0 is perfect balance. With ``RingStats(time_kernels=True)``
the same matrices hold measured kernel milliseconds, and the time each rank's
compute stream stood waiting for ring transfers (exposed communication).
"""

from __future__ import annotations

import contextlib
import time
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


def ring_time_degree(area: torch.Tensor) -> float:
    """The ring's time over a balanced ring's, when every step waits for its busiest rank: the
    sum over steps of the most loaded rank's area over the sum of the steps' means. The
    worker-level degree weighs every step alike, so a step holding 1% of the work moves it as
    much as one holding 8%; this one weighs them by their work, as the ring's time does."""
    a = area.double()
    return float(a.amax(0).sum() / a.mean(0).sum().clamp_min(1e-30))


class KernelTimer:
    """Milliseconds spent per phase ("fwd", "bwd") by the work run under ``phase``:
    CUDA events on the current stream (read without stalling until ``elapsed``), or
    the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.spans.setdefault(name, []).append((start, end))

    def elapsed(self, name: str) -> float:
        """Total ms of phase ``name`` (synchronises the device on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.spans.get(name, []))
        return sum(b - a for a, b in self.spans.get(name, [])) * 1e3


def timed(timer: KernelTimer | None, phase: str):
    """``timer.phase(phase)``, or nothing without a timer."""
    return timer.phase(phase) if timer is not None else contextlib.nullcontext()


def _gather_by_rank(mine: dict, group) -> list:
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    merged = {r: x for part in parts for r, x in part.items()}
    return [merged[r] for r in sorted(merged)]


@dataclass
class RingStats:
    """Filled by ``ring_attention``: the attended area per rank and ring step (outer-major),
    and per rank of the local pass over gathered vertical columns (vertical-slash only);
    with ``time_kernels`` also their kernel times and each rank's exposed transfer wait,
    accumulated over every call (forward and backward) made with this object. On the
    kernels the local pass runs in the launch of the last ring step, and its time
    counts in that step's."""

    time_kernels: bool = False
    ring: dict[int, list[int]] = field(default_factory=dict)
    local: dict[int, int] = field(default_factory=dict)
    timers: dict[int, tuple[list[KernelTimer], KernelTimer, KernelTimer]] = field(default_factory=dict)

    def record(self, rank: int, per_step: list[int], local: int = 0) -> None:
        self.ring[rank] = per_step
        self.local[rank] = local

    def new_timers(self, rank: int, steps: int, device: torch.device):
        """(per-step timers, local-pass timer, transfer-wait timer) of ``rank``, or Nones
        without ``time_kernels``. A later call reuses the rank's timers, so figures add up."""
        if not self.time_kernels:
            return [None] * steps, None, None
        if rank not in self.timers:
            self.timers[rank] = ([KernelTimer(device) for _ in range(steps)], KernelTimer(device), KernelTimer(device))
        return self.timers[rank]

    def gather(self, group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' figures (a small all-gather): ``[ranks, steps]`` ring areas and
        ``[ranks]`` local areas."""
        ring, local = _gather_by_rank(self.ring, group), _gather_by_rank(self.local, group)
        return torch.tensor(ring, dtype=torch.float64), torch.tensor(local, dtype=torch.float64)

    def gather_times(self, phase: str, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All ranks' milliseconds of ``phase``: ``[ranks, steps]`` ring-step kernels,
        ``[ranks]`` local pass, ``[ranks]`` exposed transfer wait (needs ``time_kernels``)."""
        if not self.time_kernels:
            raise ValueError("RingStats.time_kernels is False: construct RingStats(time_kernels=True) to time kernels")
        mine = {
            r: ([t.elapsed(phase) for t in steps], local.elapsed(phase), comm.elapsed(phase))
            for r, (steps, local, comm) in self.timers.items()
        }
        rows = _gather_by_rank(mine, group)
        return tuple(torch.tensor([row[i] for row in rows], dtype=torch.float64) for i in range(3))


def simulate_ring_areas(
    index: SparseIndex,
    layout: ContextParallelLayout,
    block: int,
    tiles: torch.Tensor | None = None,
    node_size: int | None = None,
) -> torch.Tensor:
    """``[ranks, steps]`` areas the ring computes for ``index`` under ``layout``
    (for a vertical-slash index pass its tiles, ``ring_work(index)``), without
    processes; flat and hierarchical rings alike (``ring_schedule``). ``block`` must divide
    the layout's stripes (or zigzag chunks). ``tiles``: ``index.block_areas(block)`` when
    the caller has it (one count for several layouts). ``node_size``: the ranks of a node
    under the exchange that gathers K/V inside nodes (``node_gather``), whose steps are the
    outer ones: rank ``node * G + local`` holds node ``node - o``'s chunks at step ``o``."""
    tiles = index.block_areas(block) if tiles is None else tiles
    w = layout.cp_size
    owner = torch.empty(tiles.shape[0], dtype=torch.long)
    for r in range(w):
        owner[layout.positions(r)[::block] // block] = r
    per_rank = torch.zeros(w, w, dtype=torch.float64)
    per_rank.index_put_((owner.view(-1, 1).expand_as(tiles), owner.view(1, -1).expand_as(tiles)), tiles.cpu(), True)
    if node_size is None:
        return per_rank.gather(1, ring_sources(w))
    per_node = per_rank.view(w, w // node_size, node_size).sum(-1)  # [ranks, source nodes]
    return per_node.gather(1, ring_sources(w // node_size).repeat_interleave(node_size, 0))


def ring_sources(cp_size: int) -> torch.Tensor:
    """``[ranks, steps]``: whose chunk each rank holds at each ring step: rank ``r`` holds
    rank ``(r - s) mod W``'s at step ``s``, on the flat and the hierarchical ring
    (``ring_schedule.RingSchedule``)."""
    rank, step = torch.arange(cp_size).view(-1, 1), torch.arange(cp_size).view(1, -1)
    return (rank - step) % cp_size

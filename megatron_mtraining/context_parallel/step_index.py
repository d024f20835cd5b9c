"""Per-rank, per-ring-step view of a global sparse index (MTraining's convert_index).

``StepIndex(index, query_positions, key_positions)`` is the part of the global
``index`` that this rank's queries (global positions ``query_positions``) attend
within one K/V chunk (global positions ``key_positions``), in local coordinates:
its key lists hold positions inside the chunk, and causality compares global
positions. It works for every index type through the ``key_lists`` contract, so
the ring needs no per-pattern code; each one is built once per layer call and
serves the forward and the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sparse.index import SparseIndex, compact


@dataclass
class StepIndex(SparseIndex):
    index: SparseIndex
    query_positions: torch.Tensor  # [Lq] int64 global positions of the local query rows
    key_positions: torch.Tensor  # [Lk] int64 global positions of the chunk's keys
    _segments: dict | None = field(init=False, repr=False, default=None)  # local row range -> global row range
    _local_key: torch.Tensor = field(init=False, repr=False)
    _may_attend: bool = field(init=False, repr=False)
    host_query_positions: torch.Tensor = field(init=False, repr=False)
    host_key_positions: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        # Bookkeeping on host copies (no device syncs); the kernels and the reference engine
        # read device copies. Positions are usually made on the host (layout.positions).
        self.host_query_positions = qpos = self.query_positions.cpu()
        self.host_key_positions = self.key_positions.cpu()
        self._may_attend = bool(self.host_key_positions.min() <= qpos.max())
        self.query_positions = self.query_positions.to(self.index.device, non_blocking=True)
        self.key_positions = self.key_positions.to(self.index.device, non_blocking=True)
        dev = self.key_positions.device
        self._local_key = torch.full((self.index.seq_len + 1,), -1, dtype=torch.int64, device=dev)
        self._local_key[self.key_positions] = torch.arange(len(self.key_positions), device=dev)

    @property
    def batch_size(self) -> int:
        return self.index.batch_size

    @property
    def num_heads(self) -> int:
        return self.index.num_heads

    @property
    def seq_len(self) -> int:
        return len(self.query_positions)

    @property
    def selection_heads(self) -> int:
        return self.index.selection_heads

    @property
    def device(self) -> torch.device:
        return self.query_positions.device

    def segments(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Local row runs that are contiguous globally and inside one of the global index's
        query chunks -> their global row range. Built on first use: only the reference
        path walks rows this way, and a striped rank has thousands of runs."""
        if self._segments is None:
            qpos = self.host_query_positions
            chunk = qpos // self.index.query_chunk
            breaks = torch.nonzero((qpos[1:] != qpos[:-1] + 1) | (chunk[1:] != chunk[:-1])).flatten() + 1
            bounds = [0, *breaks.tolist(), len(qpos)]
            starts, ends = qpos[bounds[:-1]].tolist(), (qpos[[b - 1 for b in bounds[1:]]] + 1).tolist()
            self._segments = {
                (a, b): (g0, g1) for a, b, g0, g1 in zip(bounds[:-1], bounds[1:], starts, ends, strict=True)
            }
        return self._segments

    def query_ranges(self, num_rows: int) -> list[tuple[int, int]]:
        return list(self.segments())

    def key_lists(self, q_start: int, q_end: int) -> torch.Tensor:
        g0, g1 = self.segments()[q_start, q_end]
        global_keys = self.index.key_lists(g0, g1)
        local = torch.where(global_keys >= 0, self.local_key(global_keys), -1)
        return compact(local, local >= 0)[0].long()

    def local_key(self, positions: torch.Tensor) -> torch.Tensor:
        """Index in this chunk of each global key position (-1 where it is not here)."""
        return self._local_key[positions.clamp(min=0).long()]

    def may_attend(self) -> bool:
        """False when every key of the chunk lies after every query (causally nothing to do)."""
        return self._may_attend

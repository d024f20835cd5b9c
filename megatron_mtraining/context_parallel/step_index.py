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
from .layout import TokenPositions


@dataclass
class StepIndex(SparseIndex):
    """Positions are tensors, or ``TokenPositions`` (the ring passes its cached ones, whose
    host-side facts are then computed once per run rather than once per step); either
    way the fields hold the device tensors after construction, and ``queries`` / ``keys``
    the ``TokenPositions``."""

    index: SparseIndex
    query_positions: torch.Tensor  # [Lq] int64 global positions of the local query rows
    key_positions: torch.Tensor  # [Lk] int64 global positions of the chunk's keys (-1: padding)
    queries: TokenPositions = field(init=False, repr=False)
    keys: TokenPositions = field(init=False, repr=False)
    _segments: dict | None = field(init=False, repr=False, default=None)  # local row range -> global row range

    def __post_init__(self):
        self.queries, self.keys = (
            p if isinstance(p, TokenPositions) else TokenPositions(p, self.index.device)
            for p in (self.query_positions, self.key_positions)
        )
        self.query_positions, self.key_positions = self.queries.values, self.keys.values

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
    def documents(self):
        # The global index's: its row starts are indexed by global position, which
        # ``visible`` compares with the chunk's global key positions.
        return self.index.documents

    @property
    def device(self) -> torch.device:
        return self.query_positions.device

    def segments(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Local row runs that are contiguous globally and inside one of the global index's
        query chunks -> their global row range. Built on first use: only the reference
        path walks rows this way, and a striped rank has thousands of runs."""
        if self._segments is None:
            qpos = self.queries.host
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
        local = self.local_key(self.index.key_lists(g0, g1))
        return compact(local, local >= 0)[0].long()

    def attended_area(self) -> torch.Tensor:
        return self.index.area_between(self.query_positions, self.key_positions)

    def local_key(self, positions: torch.Tensor) -> torch.Tensor:
        """Index in this chunk of each global key position (-1 where it is not here)."""
        return self.keys.index_of(positions, self.index.seq_len)

    def may_attend(self) -> bool:
        """False when every key of the chunk lies after every query (causally nothing to do)."""
        return _span(self.keys)[0] <= _span(self.queries)[1]


def _span(positions: TokenPositions) -> tuple[int, int]:
    """(lowest, highest) position, read from the host copy once."""
    return positions.derived("span", lambda p: (int(p.host.min()), int(p.host.max())))

"""The context-parallel token layout the patches make Megatron follow."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_mtraining.context_parallel.layout import KINDS, ContextParallelLayout
from megatron_mtraining.sparse.validation import check_choice, check_int


@dataclass(frozen=True)
class LayoutChoice:
    """Layout kind and stripe; the CP size and sequence length come from each call."""

    kind: str
    stripe: int = 128

    def __post_init__(self):
        check_choice("layout_kind", self.kind, KINDS)
        check_int("stripe", self.stripe, minimum=1)

    def layout(self, cp_size: int, seq_len: int) -> ContextParallelLayout:
        return ContextParallelLayout(self.kind, cp_size, seq_len, stripe=self.stripe)

    def positions(self, cp_size: int, seq_len: int, rank: int, device, what: str) -> torch.Tensor:
        """Global positions of ``rank``'s tokens on ``device``; ``what`` names the split
        dimension in the error when ``seq_len`` does not divide into the layout."""
        try:
            return _positions(self.layout(cp_size, seq_len), rank, torch.device(device))
        except ValueError as err:
            raise ValueError(f"{what}={seq_len} cannot be split over {cp_size} context-parallel ranks: {err}") from err


@functools.lru_cache(maxsize=64)
def _positions(layout: ContextParallelLayout, rank: int, device: torch.device) -> torch.Tensor:
    # Every micro-batch splits the same few shapes: building the index and copying it to the
    # device once per shape keeps a host-to-device copy out of every step.
    return layout.positions(rank, device)

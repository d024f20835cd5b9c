"""``dense``: full causal attention, through the same code path as the sparse patterns."""

from __future__ import annotations

from ..sparse.index import DenseIndex
from .base import Pattern
from .registry import register


@register
class DensePattern(Pattern):
    name = "dense"

    def local_index(self, q, k, scale) -> DenseIndex:
        return DenseIndex(q.shape[0], q.shape[2], q.shape[1], device=q.device)

    def distributed_index(self, q, k, layout, group, scale) -> DenseIndex:
        return DenseIndex(q.shape[0], q.shape[2], layout.seq_len, device=q.device)

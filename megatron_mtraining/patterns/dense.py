"""``dense``: full causal attention, through the same code path as the sparse patterns."""

from __future__ import annotations

from ..context_parallel.step_tables import kernel_tiles
from ..sparse.documents import packed_documents
from ..sparse.index import DenseIndex
from .base import Pattern
from .registry import register


@register
class DensePattern(Pattern):
    name = "dense"

    @classmethod
    def ring_tiles(cls, config) -> tuple[int, ...]:
        return kernel_tiles(DenseIndex, None)

    def local_index(self, q, k, scale, cu_seqlens=None) -> DenseIndex:
        documents = packed_documents(cu_seqlens, q.shape[1], q.device)
        return DenseIndex(q.shape[0], q.shape[2], q.shape[1], device=q.device, documents=documents)

    def distributed_index(self, q, k, layout, group, scale, cu_seqlens=None) -> DenseIndex:
        documents = packed_documents(cu_seqlens, layout.seq_len, q.device)
        return DenseIndex(q.shape[0], q.shape[2], layout.seq_len, device=q.device, documents=documents)

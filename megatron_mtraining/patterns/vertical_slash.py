"""``mtraining``: MTraining's vertical-slash pattern with online top-p budgets.

Under context parallelism the observation window (the last ``last_q`` queries of the
sequence) is assembled on every rank by one sum of a ``[B, last_q, Hq, D]`` buffer; the
row maxima, normalisers and column / diagonal mass are reduced, and every rank runs the
single-device selection on them (``window_statistics_from_parts``).

With packed documents, the statistics of every document of at least ``dense_below`` tokens
are built at once: their last ``last_q`` rows gathered by one sum, the statistics of this
rank's keys in each document computed in one batched pass (``document_statistics_from_parts``)
and reduced together (five collectives in all, whatever the number of documents); every rank
then selects all documents' indexes at once (``document_index``), which equals the
single-device build.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..context_parallel.distributed_index import all_reduce_fn, gather_rows, gather_window, rank_positions
from ..context_parallel.step_tables import kernel_tiles
from ..sparse.documents import Documents, packed_documents
from ..sparse.host_tables import to_device
from ..sparse.index import VerticalSlashIndex
from ..sparse.vertical_slash import (
    ObservationWindows,
    VerticalSlashConfig,
    build_vertical_slash_index,
    document_index,
    document_statistics_from_parts,
    select_vertical_slash,
    window_statistics_from_parts,
)
from .base import Pattern
from .registry import register


@register
class VerticalSlashPattern(Pattern):
    name = "mtraining"
    settings = VerticalSlashConfig
    size_field = "block_size"

    @classmethod
    def ring_tiles(cls, config) -> tuple[int, ...]:
        return kernel_tiles(VerticalSlashIndex, config.block_size)

    def local_index(self, q, k, scale, cu_seqlens=None) -> VerticalSlashIndex:
        return build_vertical_slash_index(q, k, self.config, softmax_scale=scale, cu_seqlens=cu_seqlens)

    def distributed_index(self, q, k, layout, group, scale, cu_seqlens=None) -> VerticalSlashIndex:
        config, seq = self.config, layout.seq_len
        positions = rank_positions(layout, group, q.device)
        documents = packed_documents(cu_seqlens, seq, q.device)
        if documents is not None:
            return self._documents(q, k, layout, group, scale, documents)
        stats = window_statistics_from_parts(
            gather_window(q, positions, seq - min(config.last_q, seq), seq, group),
            k.detach(),
            positions,
            seq,
            config,
            scale,
            all_reduce_max=all_reduce_fn(dist.ReduceOp.MAX, group),
            all_reduce_sum=all_reduce_fn(dist.ReduceOp.SUM, group),
        )
        return select_vertical_slash(stats, config, seq)

    def building_rows(self, seq, documents=None) -> list[tuple[int, int]]:
        # The observation window: the last last_q rows of the sequence, or of each document.
        bounds = (0, seq) if documents is None else documents.bounds
        return [(max(a, b - self.config.last_q), b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def _documents(self, q, k, layout, group, scale, documents: Documents) -> VerticalSlashIndex:
        """The per-document index from this rank's tokens: every sparse document's window
        gathered in one sum, and the statistics of this rank's keys in each reduced at once."""
        config = self.config
        held = layout.token_positions(dist.get_rank(group), q.device)
        reduce_max, reduce_sum = all_reduce_fn(dist.ReduceOp.MAX, group), all_reduce_fn(dist.ReduceOp.SUM, group)

        def statistics(bounds):
            # Each document's keys among this rank's, found on the host copy of the positions.
            windows = ObservationWindows.of_documents(bounds, config.last_q, documents.seq_len, held.host)
            rows = to_device(torch.tensor(windows.row_positions()), q.device)
            return document_statistics_from_parts(
                gather_rows(q, held.values, rows, group), k.detach(), held.values, windows, config, scale, reduce_max,
                reduce_sum,
            )  # fmt: skip

        return document_index(documents, config, q.shape[0], q.shape[2], q.device, statistics)

    @classmethod
    def index_state_bytes(cls, config, batch, heads, query_groups, seq, local_seq) -> float:
        # int64 column ids and block-diagonal offsets per head, at their caps.
        return 8 * batch * heads * (config.vertical_cap + math.ceil(config.slash_cap / config.block_size))

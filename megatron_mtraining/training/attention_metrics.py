"""Per-layer attention metrics for the training loop: attended fraction, recall and ring
imbalance.

:class:`MeasuredCoreAttention` is :class:`SparseCoreAttention` that, on the micro-batches the
training loop flags (:func:`collect_attention_metrics`), records per layer into the plugin's
metrics tracker (``get_attention_metrics_tracker``, next to MSA's KL):

* ``attended_fraction``: attended (query, key) pairs over the attendable ones (the causal
  pairs of the whole sequence, or of each packed document), averaged over batch and heads
  (1.0 for dense attention). Each CP rank records its queries' share; the tracker sums the
  shares over the CP group.
* ``document_area`` (packed documents only): the documents' causal pairs over those of the
  whole sequence, what the document mask leaves; times ``attended_fraction``, the share of
  the causal area computed (``scripts/bench_training.py`` counts FLOPs by it). The same on
  every CP rank, so each rank records ``1 / cp_size`` of it.
* ``index_recall``: the share of the dense attention mass of the last 64 queries that the
  index attends (``sparse.attention_recall``; under CP ``distributed_attention_recall``,
  which reduces the rows' softmax over the ranks' keys), averaged over batch and heads. The
  same on every CP rank, so each rank records ``1 / cp_size`` of it. For ``mtraining``
  those are the queries whose attention built the index: an in-sample figure.
* ``index_recall_heldout``: the same share for 64 sampled queries that did not build the
  index (``sparse.heldout_recall`` / ``distributed_heldout_recall``; measured with the
  last queries' in one pass over both sets of rows, ``window_and_heldout_recall``): 4 runs of 16
  consecutive rows drawn uniformly from the sequence outside the pattern's
  ``building_rows``, seeded by the training iteration (the same rows on every rank and in
  every layer of a step, and again on a resumed run); recorded like ``index_recall``.
* ``msa_block_recall`` / ``msa_score_recall`` (MSA, warmup included): the MSA paper's
  indexer quality on the same last 64 queries (``sparse.msa_recall``; under CP
  ``distributed_msa_recall``): the share of the main branch's dense top-k blocks that the
  index branch selects, and of their attention mass, averaged over batch, rows and query
  heads; recorded like ``index_recall`` (``1 / cp_size`` per CP rank). In warmup the index
  selects for those rows only, so the figures say when it is ready to leave warmup.
* ``worker_imbalance`` / ``step_imbalance`` (CP > 1): the MTraining paper's imbalance
  degrees of the ring's attended area (``context_parallel.imbalance_degrees``), the same on
  every CP rank, so each rank records ``1 / cp_size`` of it.

The loop flags only the last step of each logging interval and gives its values the weight
of the whole interval (``weight``): the tracker's one scale then averages them with the KL,
which is recorded every step. The values stay on the device until the tracker reports
them, and a dense index's fraction and recall are 1 without counting. A layer
records once per micro-batch: activation recomputation runs its attention a second time in
the backward, which must not count twice.

Evaluation forwards (the model in eval mode) record nothing of the above: an evaluation
flags its micro-batches with :func:`collect_evaluation_metrics`, and the layers then record
only the attended fraction, into the evaluation's own tracker, and call its ``on_train``
when the model goes back to training mode (Megatron's ``evaluate`` ends so).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..context_parallel import RingStats, imbalance_degrees, ring_attention
from ..context_parallel.distributed_index import build_index
from ..context_parallel.recall import (
    distributed_attention_recall,
    distributed_msa_recall,
    distributed_window_and_heldout_recall,
)
from ..megatron.core_attention import SparseCoreAttention
from ..megatron.msa_loss import AttentionMetricsTracker, get_attention_metrics_tracker
from ..megatron.profiler_ranges import part_range
from ..patterns.base import (
    DOCUMENT_AREA_METRIC,
    FRACTION_METRIC,
    HELDOUT_RECALL_METRIC,
    RECALL_METRIC,
    STEP_METRIC,
    WORKER_METRIC,
)
from ..patterns.msa import BLOCK_RECALL_METRIC, SCORE_RECALL_METRIC
from ..sparse import attention_recall, msa_recall
from ..sparse.documents import packed_documents
from ..sparse.metrics import heldout_rows, window_and_heldout_recall

RECALL_ROWS = 64
# The held-out recall's sample: as many rows as the window's, in runs of 16 so that each run
# reads the key lists of one or two index chunks.
HELDOUT_RUNS, HELDOUT_RUN_ROWS = 4, 16
COLLECT_ATTRIBUTE = "mtraining_collect_metrics"


# Numbers the flagged micro-batches: a layer records once per number.
_MICRO_BATCHES = itertools.count()


@dataclasses.dataclass(frozen=True)
class MetricsFlag:
    """What the layers built from a config record on one micro-batch (``micro_batch``: its
    number): with ``weight`` (0: nothing), the held-out recall's rows drawn with ``seed``;
    an evaluation's flag carries its ``tracker`` and ``on_train``."""

    micro_batch: int
    weight: float
    seed: int = 0
    tracker: AttentionMetricsTracker | None = None
    on_train: Callable[[], None] | None = None

    @property
    def evaluation(self) -> bool:
        return self.tracker is not None


def collect_attention_metrics(config, weight: float, seed: int = 0) -> None:
    """Makes the layers built from ``config`` record their training metrics of the next
    micro-batch with ``weight`` (0: off), once; ``seed`` (the training iteration) draws the
    held-out recall's rows. Called before each training micro-batch."""
    setattr(config, COLLECT_ATTRIBUTE, MetricsFlag(next(_MICRO_BATCHES), weight, seed))


def collect_evaluation_metrics(config, tracker: AttentionMetricsTracker, on_train: Callable[[], None]) -> None:
    """Makes the layers built from ``config``, in eval mode, record the attended fraction of
    the next micro-batch into ``tracker`` (weight 1), and call ``on_train`` (which must be
    idempotent) when they go back to training mode. Called before each evaluation micro-batch."""
    setattr(config, COLLECT_ATTRIBUTE, MetricsFlag(next(_MICRO_BATCHES), 1.0, tracker=tracker, on_train=on_train))


@functools.lru_cache(maxsize=4)
def _heldout_rows(seq: int, excluded: tuple[tuple[int, int], ...], seed: int) -> torch.Tensor:
    """The held-out recall's rows, drawn once per step for every layer. They stay in host
    memory: the recall copies the union of them and the window's rows to the device
    (``RowUnion``, pinned there), never these."""
    return heldout_rows(seq, excluded, HELDOUT_RUNS, HELDOUT_RUN_ROWS, seed)


class MeasuredCoreAttention(SparseCoreAttention):
    """:class:`SparseCoreAttention` that records the attended fraction, recalls and ring
    imbalance (and MSA's block and score recall, through the ``_msa_metrics`` hook)."""

    _measured_micro_batch = None

    def _measuring(self) -> MetricsFlag | None:
        """The flag of this forward if it records (a training flag in training mode, an
        evaluation's in eval mode, once per micro-batch), else None."""
        flag = getattr(self.config, COLLECT_ATTRIBUTE, None)
        if flag is None or not flag.weight or flag.micro_batch == self._measured_micro_batch:
            return None
        return flag if flag.evaluation != self.training else None

    def train(self, mode: bool = True):
        flag = getattr(self.config, COLLECT_ATTRIBUTE, None)
        if mode and not self.training and flag is not None and flag.on_train is not None:
            flag.on_train()
        return super().train(mode)

    def _msa_metrics(self, q, k, q_idx, k_idx, index, layout) -> None:
        # Runs before _attend, which marks the micro-batch measured.
        flag = self._measuring()
        if flag is None or flag.evaluation:
            return
        cfg, scale = self.attention_config.msa, self.softmax_scale
        with part_range("metrics"):
            if layout is None:
                rows = min(RECALL_ROWS, q.shape[1])
                block, score = msa_recall(q, k, q_idx, k_idx, cfg, index, rows, scale)
                share, group = flag.weight, None
            else:
                rows = min(RECALL_ROWS, layout.seq_len)
                block, score = distributed_msa_recall(
                    q, k, q_idx, k_idx, cfg, index, layout, self.cp_group, rows, scale
                )
                share, group = flag.weight / layout.cp_size, self.cp_group
            self._record(BLOCK_RECALL_METRIC, block.mean() * share, group)
            self._record(SCORE_RECALL_METRIC, score.mean() * share, group)

    def _index_metrics(self, q, k, index, cu_seqlens=None) -> None:
        # Marks the micro-batch measured, as _attend does.
        flag = self._measuring()
        if flag is None:
            return
        self._measured_micro_batch = flag.micro_batch
        with part_range("metrics"):
            attendable = _causal_pairs(q, q.shape[1], cu_seqlens)
            fraction = index.attended_area().sum().double() / attendable
            self._record(FRACTION_METRIC, fraction * flag.weight, None, flag.tracker)
            self._document_area(q, q.shape[1], attendable, cu_seqlens, flag.weight, None, flag.tracker)
            if not flag.evaluation:
                self._recalls(q, k, index, None, flag)

    def _attend(self, q, k, v, pattern, layout, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        flag = self._measuring()
        if flag is None:
            return super()._attend(q, k, v, pattern, layout, cu_seqlens)
        if layout is None:
            with part_range("index"):
                source = self._source(pattern, q, k, None, cu_seqlens)
                index = build_index(source, q, k, self.softmax_scale, cu_seqlens=cu_seqlens)
            # The metrics after the attention's launches: the device runs the attention while
            # the host launches the metrics' small operations. Before it, they ran on an empty
            # queue, which the vertical-slash build's read of its list widths had just drained.
            out = super()._attend(q, k, v, index, layout)
            self._index_metrics(q, k, index, cu_seqlens)
            return out
        self._measured_micro_batch = flag.micro_batch
        weight, tracker = flag.weight, flag.tracker
        causal = _causal_pairs(q, layout.seq_len, cu_seqlens)
        # Built here rather than inside the ring so that the recall scores the index the ring runs.
        with part_range("index"):
            source = self._source(pattern, q, k, layout, cu_seqlens)
            index = build_index(source, q, k, self.softmax_scale, layout, self.cp_group, cu_seqlens)
        stats = RingStats()
        out, lse = ring_attention(
            q,
            k,
            v,
            index,
            layout,
            self.cp_group,
            self.hierarchy,
            self.softmax_scale,
            stats=stats,
            backend=self.attention_config.backend,
            kv_exchange=self.attention_config.kv_exchange,
            cu_seqlens=cu_seqlens,
        )
        with part_range("metrics"):
            rank = dist.get_rank(self.cp_group)
            mine = sum(stats.ring[rank]) + stats.local[rank]
            self._record(FRACTION_METRIC, weight * mine / causal, self.cp_group, tracker)
            self._document_area(q, layout.seq_len, causal, cu_seqlens, weight / layout.cp_size, self.cp_group, tracker)
            if not flag.evaluation:
                worker, step = imbalance_degrees(stats.gather(self.cp_group)[0])
                self._record(WORKER_METRIC, weight * worker / layout.cp_size, self.cp_group)
                self._record(STEP_METRIC, weight * step / layout.cp_size, self.cp_group)
                self._recalls(q, k, index, layout, flag)
        return out, lse

    def _recalls(self, q, k, index, layout, flag: MetricsFlag) -> None:
        """``index_recall`` of the last queries and ``index_recall_heldout`` of sampled ones."""
        scale, seq = self.softmax_scale, q.shape[1] if layout is None else layout.seq_len
        building = self.pattern.building_rows(seq, index.documents)
        rows = _heldout_rows(seq, tuple(building), flag.seed)
        # Both from one pass over the union of their rows where there are held-out rows.
        window, heldout = min(RECALL_ROWS, seq), None
        if layout is None:
            if len(rows):
                recall, heldout = window_and_heldout_recall(q, k, index, window, rows, scale)
            else:
                recall = attention_recall(q, k, index, window, scale)
            share, group = flag.weight, None
        else:
            if len(rows):
                recall, heldout = distributed_window_and_heldout_recall(
                    q, k, index, layout, window, rows, self.cp_group, scale
                )
            else:
                recall = distributed_attention_recall(q, k, index, layout, self.cp_group, window, scale)
            share, group = flag.weight / layout.cp_size, self.cp_group
        self._record(RECALL_METRIC, recall.mean() * share, group)
        if heldout is not None:  # None: every run of rows built the index (a short sequence)
            self._record(HELDOUT_RECALL_METRIC, heldout.mean() * share, group)

    def _document_area(self, q, seq: int, attendable: float, cu_seqlens, weight: float, group, tracker) -> None:
        """With packed documents, records ``attendable`` (their causal pairs, which the
        fraction was taken over) over the whole sequence's."""
        if cu_seqlens is not None:
            area = attendable / _causal_pairs(q, seq)
            self._record(DOCUMENT_AREA_METRIC, weight * area, group, tracker)

    def _record(self, name: str, value: float | torch.Tensor, group, tracker=None) -> None:
        # Device tensors stay on the device: reading them here would stall the launch queue
        # once per layer. A number is filled in on the device: copied from pageable host
        # memory, it would wait for the stream to drain (``sparse/host_tables.py``).
        device = torch.cuda.current_device()
        if isinstance(value, torch.Tensor):
            tensor = value.to(device=device, dtype=torch.float32)
        else:
            tensor = torch.full((), value, dtype=torch.float32, device=device)
        tracker = get_attention_metrics_tracker() if tracker is None else tracker
        tracker.record(name, tensor, self.layer_number, self.config.num_layers, group)


def _causal_pairs(q: torch.Tensor, seq: int, cu_seqlens=None) -> float:
    """Attendable pairs of a ``seq``-token sample: the causal triangle, or each packed
    document's, per batch row and query head."""
    lengths = [seq] if cu_seqlens is None else packed_documents(cu_seqlens, seq).lengths()
    return q.shape[0] * q.shape[2] * sum(n * (n + 1) / 2 for n in lengths)


def measured(block_spec):
    """A copy of a decoder-block spec whose layers use :class:`MeasuredCoreAttention`."""
    layers = []
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        core = dataclasses.replace(attention.submodules.core_attention, module=MeasuredCoreAttention)
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, core_attention=core)
        )
        layers.append(
            dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))
        )
    return dataclasses.replace(block_spec, layer_specs=layers)

"""Per-layer attention metrics for the training loop: attended fraction and ring imbalance.

:class:`MeasuredCoreAttention` is :class:`SparseCoreAttention` that, on the micro-batches the
training loop flags (:func:`collect_attention_metrics`), records per layer into the plugin's
metrics tracker (``get_attention_metrics_tracker``, next to MSA's KL):

* ``attended_fraction``: attended (query, key) pairs over the causal pairs of the whole
  sequence, averaged over batch and heads (1.0 for dense attention). Each CP rank records
  its queries' share; the tracker sums the shares over the CP group.
* ``index_recall``: the share of the dense attention mass of the last 64 queries that the
  index attends (``sparse.attention_recall``; under CP ``distributed_attention_recall``,
  which reduces the rows' softmax over the ranks' keys), averaged over batch and heads. The
  same on every CP rank, so each rank records ``1 / cp_size`` of it.
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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..context_parallel import RingStats, imbalance_degrees, ring_attention
from ..context_parallel.distributed_index import build_index
from ..context_parallel.recall import distributed_attention_recall, distributed_msa_recall
from ..megatron.core_attention import SparseCoreAttention
from ..megatron.msa_loss import get_attention_metrics_tracker
from ..megatron.profiler_ranges import part_range
from ..patterns.base import FRACTION_METRIC, RECALL_METRIC, STEP_METRIC, WORKER_METRIC
from ..patterns.msa import BLOCK_RECALL_METRIC, SCORE_RECALL_METRIC
from ..sparse import attention_recall, msa_recall
from ..sparse.documents import packed_documents

RECALL_ROWS = 64
COLLECT_ATTRIBUTE = "mtraining_collect_metrics"


def collect_attention_metrics(config, weight: float, micro_batch: int) -> None:
    """Makes the layers built from ``config`` record their metrics with ``weight`` (0: off)
    for the micro-batch numbered ``micro_batch`` (a number the loop never repeats), once."""
    setattr(config, COLLECT_ATTRIBUTE, (weight, micro_batch))


class MeasuredCoreAttention(SparseCoreAttention):
    """:class:`SparseCoreAttention` that records the attended fraction, recall and ring
    imbalance (and MSA's block and score recall, through the ``_msa_metrics`` hook)."""

    _measured_micro_batch = None

    def _measuring(self) -> tuple[float, int | None]:
        """(weight, micro-batch) of this forward: weight 0 unless it records."""
        weight, micro_batch = getattr(self.config, COLLECT_ATTRIBUTE, (0, None))
        if not weight or not self.training or micro_batch == self._measured_micro_batch:
            return 0, micro_batch
        return weight, micro_batch

    def _msa_metrics(self, q, k, q_idx, k_idx, index, layout) -> None:
        # Runs before _attend, which marks the micro-batch measured.
        weight, _ = self._measuring()
        if not weight or index.documents is not None:
            # The recall's dense reference does not take packed documents yet: not recorded.
            return
        cfg, scale = self.attention_config.msa, self.softmax_scale
        with part_range("metrics"):
            if layout is None:
                rows = min(RECALL_ROWS, q.shape[1])
                block, score = msa_recall(q, k, q_idx, k_idx, cfg, index, rows, scale)
                share, group = weight, None
            else:
                rows = min(RECALL_ROWS, layout.seq_len)
                block, score = distributed_msa_recall(
                    q, k, q_idx, k_idx, cfg, index, layout, self.cp_group, rows, scale
                )
                share, group = weight / layout.cp_size, self.cp_group
            self._record(BLOCK_RECALL_METRIC, block.mean() * share, group)
            self._record(SCORE_RECALL_METRIC, score.mean() * share, group)

    def _attend(self, q, k, v, pattern, layout, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        weight, micro_batch = self._measuring()
        if not weight:
            return super()._attend(q, k, v, pattern, layout, cu_seqlens)
        self._measured_micro_batch = micro_batch
        seq = q.shape[1] if layout is None else layout.seq_len
        # Attendable pairs: the causal triangle, or each packed document's.
        lengths = [seq] if cu_seqlens is None else packed_documents(cu_seqlens, seq).lengths()
        causal = q.shape[0] * q.shape[2] * sum(n * (n + 1) / 2 for n in lengths)
        if layout is None:
            with part_range("index"):
                source = self._source(pattern, q, k, None, cu_seqlens)
                pattern = build_index(source, q, k, self.softmax_scale, cu_seqlens=cu_seqlens)
            with part_range("metrics"):
                self._record(FRACTION_METRIC, pattern.attended_area().sum().double() * (weight / causal), None)
                recall = attention_recall(q, k, pattern, min(RECALL_ROWS, seq), self.softmax_scale)
                self._record(RECALL_METRIC, recall.mean() * weight, None)
            return super()._attend(q, k, v, pattern, layout)
        # Built here rather than inside the ring so that the recall scores the index the ring runs.
        with part_range("index"):
            source = self._source(pattern, q, k, layout, cu_seqlens)
            pattern = build_index(source, q, k, self.softmax_scale, layout, self.cp_group, cu_seqlens)
        stats = RingStats()
        out, lse = ring_attention(
            q,
            k,
            v,
            pattern,
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
            self._record(FRACTION_METRIC, weight * mine / causal, self.cp_group)
            worker, step = imbalance_degrees(stats.gather(self.cp_group)[0])
            self._record(WORKER_METRIC, weight * worker / layout.cp_size, self.cp_group)
            self._record(STEP_METRIC, weight * step / layout.cp_size, self.cp_group)
            recall = distributed_attention_recall(
                q, k, pattern, layout, self.cp_group, min(RECALL_ROWS, layout.seq_len), self.softmax_scale
            )
            self._record(RECALL_METRIC, recall.mean() * (weight / layout.cp_size), self.cp_group)
        return out, lse

    def _record(self, name: str, value: float | torch.Tensor, group) -> None:
        # Device tensors stay on the device: reading them here would stall the launch queue
        # once per layer.
        tensor = torch.as_tensor(value).to(device=torch.cuda.current_device(), dtype=torch.float32)
        get_attention_metrics_tracker().record(name, tensor, self.layer_number, self.config.num_layers, group)


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

"""Sparse indexes kept from a checkpointed forward for its recomputation.

Activation recomputation (Megatron's full recompute, or selective recompute of the core
attention) runs a layer's core attention twice per micro-batch: first under ``no_grad``,
then again inside the backward. Both runs see the same inputs and the index builders are
deterministic, so the second run's index equals the first's; building it again (MSA's block
selection, a vertical-slash build and its collectives under context parallelism) is pure
waste. :class:`KeptIndexes` keeps the first run's index and hands it to the recomputation;
its :meth:`~KeptIndexes.source` wraps a pattern so that the builders stay where they run (the
ring builds its index while the first K/V transfer is in flight).

Recomputation replays the checkpointed forwards in the order they ran (one micro-batch after
another without pipelining; 1F1B's backwards follow its forwards' order), so the kept indexes
form a queue per layer. Each carries a key (training iteration and input shapes); a key that
does not match drops the queue and the index is built again, which is always correct.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

import torch

from ..context_parallel.distributed_index import IndexSource
from ..sparse.index import SparseIndex


def recomputes_core_attention(config) -> bool:
    """Whether Megatron's ``TransformerConfig`` runs the core attention again in the backward."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return True
    return granularity == "selective" and "core_attn" in (getattr(config, "recompute_modules", None) or ())


class KeptIndexes:
    """One layer's queue of indexes built by checkpointed forwards, awaiting their recompute."""

    def __init__(self):
        self._queue: deque[tuple[Hashable, SparseIndex]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def build(self, make: Callable[[], SparseIndex], key: Hashable, recomputed: bool) -> SparseIndex:
        """``make()``, kept for the recomputation when this is the first run of a recomputed
        forward (``recomputed``, autograd off), or the kept index when this is that recompute."""
        if not recomputed:
            return make()
        if not torch.is_grad_enabled():
            index = make()
            # Entries of an earlier iteration were never recomputed (a forward without a
            # backward): they must not be taken by this iteration's recompute.
            while self._queue and self._queue[0][0][0] != key[0]:
                self._queue.popleft()
            self._queue.append((key, index))
            return index
        if self._queue:
            kept_key, index = self._queue.popleft()
            if kept_key == key:
                return index
            self._queue.clear()
        return make()

    def source(self, pattern: IndexSource, key: Hashable, recomputed: bool) -> IndexSource:
        """``pattern`` as an index source whose builds go through :meth:`build`."""
        return _KeptSource(self, pattern, key, recomputed)


class _KeptSource:
    """An index source building through ``KeptIndexes``; ``pattern`` is the one it wraps."""

    def __init__(self, kept: KeptIndexes, pattern: IndexSource, key: Hashable, recomputed: bool):
        self.pattern = pattern
        self._kept, self._key, self._recomputed = kept, key, recomputed

    def local_index(self, q, k, scale, **documents) -> SparseIndex:
        return self._kept.build(lambda: self.pattern.local_index(q, k, scale, **documents), self._key, self._recomputed)

    def distributed_index(self, q, k, layout, group, scale, **documents) -> SparseIndex:
        make = lambda: self.pattern.distributed_index(q, k, layout, group, scale, **documents)  # noqa: E731
        return self._kept.build(make, self._key, self._recomputed)

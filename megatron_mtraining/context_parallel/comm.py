"""Asynchronous point-to-point exchange around a ring of ranks (NCCL or gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .imbalance import timed


class RingExchange:
    """Sends tensors to the next rank of a ring and receives the same shapes from the
    previous one, without blocking: ``start`` posts, ``wait`` returns what arrived.

    ``ranks`` are the global ranks of the ring in order; this process is one of them.
    Messages between a pair are matched in posting order, which every rank keeps.
    A ring of one rank hands the tensors back without communication. With a ``timer``
    (``KernelTimer``), ``wait`` is timed under ``phase``: on CUDA that is how long the
    compute stream stalls on the transfer, i.e. the communication compute did not hide.
    """

    def __init__(self, ranks: list[int], timer=None, phase: str = "fwd"):
        me = dist.get_rank()
        self.ranks = ranks
        self.timer, self.phase = timer, phase
        pos = ranks.index(me)
        self.next = ranks[(pos + 1) % len(ranks)]
        self.prev = ranks[(pos - 1) % len(ranks)]
        self._pending = None

    def start(self, tensors: list[torch.Tensor]) -> None:
        if len(self.ranks) == 1:  # a ring of one: what is sent comes straight back
            self._pending = ([], tensors, tensors)
            return
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev) for r in received]
        self._pending = (dist.batch_isend_irecv(ops), received, sent)  # sent stays alive until wait

    def wait(self) -> list[torch.Tensor]:
        requests, received, _ = self._pending
        with timed(self.timer, self.phase):
            for r in requests:
                r.wait()
        self._pending = None
        return received

"""Asynchronous point-to-point exchanges between ranks (NCCL or gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .imbalance import timed


class PeerExchange:
    """Posts sends to and receives from any ranks without blocking: ``start`` posts,
    ``wait`` returns what arrived, one list of tensors per receive, in the order asked.

    Ranks are global. A receive names its source and the tensors whose shapes and dtypes it
    expects. Messages between a pair are matched in posting order, which every rank keeps. A
    send to this rank is not communicated: the receive from this rank in the same ``start``
    gets its tensors. With a ``timer`` (``KernelTimer``), ``wait`` is timed under ``phase``:
    on CUDA that is how long the compute stream stalls on the transfer, i.e. the
    communication compute did not hide.
    """

    def __init__(self, timer=None, phase: str = "fwd"):
        self.me = dist.get_rank()
        self.timer, self.phase = timer, phase
        self._pending = None

    def start(self, sends: list[tuple[int, list[torch.Tensor]]], receives: list[tuple[int, list[torch.Tensor]]]):
        own = [tensors for dst, tensors in sends if dst == self.me]
        ops, sent, received = [], [], []
        for dst, tensors in sends:
            if dst != self.me:
                contiguous = [t.contiguous() for t in tensors]
                ops += [dist.P2POp(dist.isend, t, dst) for t in contiguous]
                sent += contiguous
        for src, like in receives:
            if src == self.me:
                received.append(own.pop(0))
                continue
            bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
            ops += [dist.P2POp(dist.irecv, b, src) for b in bufs]
            received.append(bufs)
        if own:
            raise RuntimeError("a send to this rank without a receive from it")
        # ``sent`` stays alive until ``wait``.
        self._pending = (dist.batch_isend_irecv(ops) if ops else [], received, sent)

    def wait(self) -> list[list[torch.Tensor]]:
        requests, received, _ = self._pending
        with timed(self.timer, self.phase):
            for r in requests:
                r.wait()
        self._pending = None
        return received


class RingExchange:
    """Sends tensors to the next rank of a ring and receives the same shapes from the
    previous one, without blocking (``PeerExchange`` around ``ranks``, the ring's global ranks
    in order, this process one of them). A ring of one hands the tensors back."""

    def __init__(self, ranks: list[int], timer=None, phase: str = "fwd"):
        self.peers = PeerExchange(timer, phase)
        pos = ranks.index(self.peers.me)
        self.next, self.prev = ranks[(pos + 1) % len(ranks)], ranks[(pos - 1) % len(ranks)]

    def start(self, tensors: list[torch.Tensor]) -> None:
        self.peers.start([(self.next, tensors)], [(self.prev, tensors)])

    def wait(self) -> list[torch.Tensor]:
        return self.peers.wait()[0]

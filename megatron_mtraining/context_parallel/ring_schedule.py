"""The ring's schedule: which K/V chunk each rank holds at each step, the transfers that bring
it, and the way each chunk's dK/dV accumulator gathers its parts and goes home.

Ranks are ``r = node * G + local`` (``G`` ranks a node, ``O`` nodes, ``W = O * G``), steps
``s = o * G + i`` (outer step ``o``, inner step ``i``). At step ``s`` every rank holds the
chunk of rank ``(r - s) mod W``: the flat ring's order, on one node and across nodes alike.
That order is what striping balances: a step puts the same diagonal offset of the attention
on every rank, so its ranks' work differs by at most one stripe pair per rank. The textbook
two-level ring (node ``node - o``, local ``local - i``) breaks it: ranks whose local index
wraps around the node at an inner step hold a chunk ``G`` stripes farther from the diagonal
than the others, and a pattern whose work gathers near the diagonal (the vertical-slash
pattern's slashes) loads them unevenly (``docs/benchmarks.md``, "Ring balance on the kernels'
index, and under the hierarchical ring").

Across nodes the flat order still moves K/V between nodes once per chunk and outer step, and
hides that transfer behind a whole inner ring, as the two-level ring does. Call the chunk of
node ``node - o``, local ``j`` this node's *current* chunk ``j`` at outer step ``o``, and
that of node ``node - o - 1`` its *next* chunk ``j``. At inner step ``i`` the ranks
``local >= i`` hold current chunk ``local - i`` and the ranks ``local < i`` next chunk
``local - i + G``. So within a node chunks still pass from each rank to the next; only local
0 takes, at step ``i``, the next chunk ``G - i`` rather than what local ``G - 1`` held. Each
rank ``j`` receives its next chunk over the outer ring (from the rank of its local index one
node back, which used it as current one outer step before) an outer step ahead, and sends it
to local 0 for the step that needs it. The first one is posted before the index build
(``post_first``) and kept for the backward, which needs it again at once. With one node the
next chunk is the current one, and the inner ring's last hop carries it: the flat ring.

Backward: each chunk's accumulator follows its chunk through a node: current chunk ``j``'s
from local ``j`` to ``G - 1``, whence the node's part goes straight home to local ``j``;
next chunk ``j``'s from local 0 to ``j - 1``, and on to local ``j``, where it seeds the
accumulator of the same chunk as current one outer step later. Home, the node's part joins
the outer ring, as in the two-level ring. Within a node a rank thus sends one K/V chunk and
one accumulator a step, as before, and once an outer step one next chunk more (to local 0,
which then receives nothing from local ``G - 1``); across nodes one K/V chunk (none in the
backward's first outer step) and one accumulator per outer step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from .comm import PeerExchange, RingExchange
from .layout import ContextParallelLayout, TokenPositions

Chunk = list[torch.Tensor]


class RingSchedule:
    """One rank's view of the schedule for one pass (forward or backward) of the ring over
    ``inner`` (the node's global ranks, in local order) and ``outer`` (the global ranks of
    this local index on every node, in node order)."""

    def __init__(
        self, inner: list[int], outer: list[int], timer=None, phase: str = "fwd", first_next: Chunk | None = None
    ):
        self.inner, self.outer, self.n_outer = inner, outer, len(outer)
        me = dist.get_rank()
        self.g, self.local, self.node = len(inner), inner.index(me), outer.index(me)
        self.two_chunks = self.n_outer > 1  # with one node the next chunk is the current one
        self.timer, self.phase = timer, phase
        self.outer_x = RingExchange(outer, timer, phase)
        # This rank's next chunk of outer step 0: received by the forward, kept for the backward.
        self.first_next = first_next

    def source(self, o: int, i: int) -> int:
        """The group rank (``node * G + local``) whose chunk this rank holds at outer step
        ``o``, inner step ``i``."""
        w = self.n_outer * self.g
        return (self.node * self.g + self.local - o * self.g - i) % w

    def keys(self, o: int, i: int, layout: ContextParallelLayout, device) -> TokenPositions:
        """The positions of the chunk held at step ``(o, i)``."""
        return layout.token_positions(self.source(o, i), device)

    def backward(self) -> RingSchedule:
        """The backward's pass, after the forward's: the same order, the first next chunk kept."""
        return RingSchedule(self.inner, self.outer, self.timer, "bwd", first_next=self.first_next)

    def accumulators(self, zeros) -> Accumulators:
        return Accumulators(self, zeros, self.timer)

    def post_first(self, own: Chunk) -> None:
        """Sends this rank's own chunk one node on, which is that node's next chunk of outer
        step 0, and receives ours (posted before the index build, which it then overlaps)."""
        if self.two_chunks:
            self.outer_x.start(own)

    def _next_chunk(self, o: int, own: Chunk) -> Chunk:
        """This rank's next chunk of outer step ``o``, forwarding it one node on for the outer
        step after (a node's next chunk there is ours now)."""
        if o == self.n_outer - 1:  # the node one full turn back: ours
            return own
        got = self.first_next if o == 0 and self.first_next is not None else self.outer_x.wait()
        if o == 0:
            self.first_next = got
        if o + 1 < self.n_outer - 1:
            self.outer_x.start(got)
        return got

    def _hop(self, i: int) -> tuple[int | None, int]:
        """(The local to which this rank's chunk of inner step ``i`` goes, or None; the local
        whence its chunk of step ``i + 1`` comes.) With two chunks nothing passes from local
        ``G - 1`` to local 0, which takes next chunk ``G - 1 - i`` from its holder."""
        g, local = self.g, self.local
        if self.two_chunks:
            return (local + 1 if local + 1 < g else None), (local - 1 if local else g - 1 - i)
        return (local + 1) % g, (local - 1) % g

    def chunks(self, own: Chunk) -> Iterator[tuple[int, int, Chunk]]:
        """``(o, i, chunk)`` for every step in order, the chunk this rank holds then. The
        transfer of the next step's chunk is posted before the step is yielded, so it
        overlaps the caller's compute; a next chunk goes to local 0 once the step is back."""
        g, local = self.g, self.local
        inner_x, to_first = PeerExchange(self.timer, self.phase), PeerExchange(self.timer, self.phase)
        sent_first = False
        cur = own
        for o in range(self.n_outer):
            held, nxt = cur, None
            for i in range(g):
                if i + 1 < g:
                    dst, src = self._hop(i)
                    inner_x.start([(self.inner[dst], held)] if dst is not None else [], [(self.inner[src], held)])
                yield o, i, held
                if self.two_chunks and local == g - 1 - i and local > 0:
                    nxt = self._next_chunk(o, own)
                    if sent_first:
                        to_first.wait()
                    to_first.start([(self.inner[0], nxt)], [])
                    sent_first = True
                if i + 1 < g:
                    held = inner_x.wait()[0]
            cur = nxt if nxt is not None else self._next_chunk(o, own)
        if sent_first:
            to_first.wait()


class Accumulators:
    """The backward's dK/dV accumulators of one rank over ``RingSchedule``'s steps: ``add(i,
    grads)`` after each step's kernel (its part of the chunk held then); ``own()`` at the end:
    this rank's own chunk's dK/dV, every rank's parts added. After each outer step the node's
    sum for this rank's current chunk joins the outer ring (the sum so far from the nodes
    before), so it reaches its owner after a full turn; with two chunks the last outer step's
    part of the own chunk as a next chunk is added there."""

    def __init__(self, schedule: RingSchedule, zeros, timer=None):
        self.s, self.zeros = schedule, zeros
        self.x = PeerExchange(timer, "bwd")
        self.outer_x = RingExchange(schedule.outer, timer, "bwd")
        self.outer_started = False
        self.seed: Chunk | None = None  # the next chunk's part, which seeds it as current
        self.done: Chunk | None = None
        self._expect = (False, False)  # what the pending exchange receives: (chain, home)

    def add(self, i: int, grads: Chunk) -> None:
        s, g, local = self.s, self.s.g, self.s.local
        # None: zeros (the first outer step; at local 0 of two chunks a next chunk's accumulator starts)
        start = (self.seed if i == 0 else self._take()) or self.zeros()
        acc = [a + b for a, b in zip(start, grads, strict=True)]
        # From local G - 1 with two chunks current chunk G - 1 - i's node part goes home;
        # with one the ring closes.
        dst = local + 1 if local + 1 < g else (g - 1 - i if s.two_chunks else 0)
        chain, home = local > 0 or not s.two_chunks, s.two_chunks and local == g - 1 - i
        receives = []
        if chain:
            receives.append((s.inner[(local - 1) % g], acc))
        if home:
            receives.append((s.inner[g - 1], acc))
        self.x.start([(s.inner[dst], acc)], receives)
        self._expect = (chain, home)
        if i == g - 1:
            self._outer_step()

    def _take(self) -> Chunk | None:
        """Waits for the last step's receives: returns the chain's accumulator from the
        previous local (None at local 0 of two chunks), keeping a node part that came home."""
        got = self.x.wait()
        chain, home = self._expect
        chain_acc = got.pop(0) if chain else None
        if home:
            self.done = got.pop(0)
        return chain_acc

    def _outer_step(self) -> None:
        """The node's sum for this rank's current chunk onto the outer ring, added to the
        nodes' before; the next chunk's part kept as the seed of the next outer step."""
        chain = self._take()
        if self.s.two_chunks:
            self.seed = chain or self.zeros()
            part, self.done = self.done, None
        else:  # the whole node's sum came round the inner ring
            part = chain
        before = self.outer_x.wait() if self.outer_started else self.zeros()
        self.outer_x.start([a + b for a, b in zip(before, part, strict=True)])
        self.outer_started = True

    def own(self) -> Chunk:
        """This rank's own chunk's dK/dV, after the last ``add``."""
        total = self.outer_x.wait()
        if self.s.two_chunks:
            total = [a + b for a, b in zip(total, self.seed, strict=True)]
        return total

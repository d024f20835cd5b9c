"""The ``balanced`` layout's stripe-to-rank assignment, from a packed sample's documents.

Striping balances one causal sequence: every rank holds every ``W``-th stripe, so a block
diagonal ``d`` of the attention lands on ring step ``d mod W`` with equal work on every
rank. With packed documents the work of a document stays inside it, and documents about
as long as the stripe period (``W`` stripes) put their few diagonals on a few ranks of a
few steps: a ring step of vertical-slash attention may then hold one rank's tiles only.

The assignment keeps striping where it works and makes the short documents balance each
other by symmetry rather than by a cost model, so it holds for any pattern made of block
diagonals (dense, vertical-slash), which the layout cannot know (it is fixed before the
index exists):

* each stripe belongs to the document holding most of its tokens (the earliest of equals),
  so documents become runs of whole stripes;
* documents of at least ``2 W`` stripes are striped one after the other, as striping
  places them with the shorter ones left out: each starts on the rank after the previous
  one's last stripe, so together they hold the same count on every rank;
* the shorter documents, ordered by length (longest first, then by position), get the
  rotations ``j mod W``: documents of similar length form orbits of ``W`` rotations, and a
  pattern rotated over every rank sums to the same work on each. Document ``j`` puts its
  stripe ``i`` on rank ``j + i (i + 1) / 2``: its neighbouring stripes sit at every
  distance around the ring, so its near diagonals (most of a slash pattern's work) spread
  over all ring steps instead of filling the first few;
* ranks then holding more than ``n / W`` stripes hand stripes to the emptiest rank,
  those of the shortest documents first (a one-stripe document's work stays on its rank).

Host work only: a few passes over the stripes and documents, no tile or area counts, the
same on every rank (integer operations, stable sorts). ``docs/benchmarks.md`` ("Ring
balance with packed documents") has the measured imbalance against striping.
"""

from __future__ import annotations

import torch

# Documents of at least this many stripe periods are striped like one sequence.
LONG_PERIODS = 2


def stripe_documents(bounds: tuple[int, ...], seq_len: int, stripe: int) -> torch.Tensor:
    """``[seq_len // stripe]`` int64: the document holding most tokens of each stripe (the
    earliest of equals). Only a document's first and last stripes hold part of it, so
    those are the candidates; a stripe inside a document is that document's."""
    cu = torch.tensor(bounds, dtype=torch.int64)
    n_docs = len(bounds) - 1
    begin, end = cu[:-1], cu[1:]
    firsts, lasts = begin // stripe, (end - 1) // stripe
    # Tokens in the first and last stripe, ranked with the earlier document ahead on a tie.
    later = n_docs - torch.arange(n_docs)
    rank_first = (torch.minimum(end, (firsts + 1) * stripe) - begin) * (n_docs + 1) + later
    rank_last = (end - torch.maximum(begin, lasts * stripe)) * (n_docs + 1) + later
    best = torch.full((seq_len // stripe,), -1, dtype=torch.int64)
    best.scatter_reduce_(0, firsts, rank_first, "amax")
    best.scatter_reduce_(0, lasts, rank_last, "amax")
    inside = torch.searchsorted(cu, torch.arange(0, seq_len, stripe), right=True) - 1
    return torch.where(best >= 0, n_docs - best % (n_docs + 1), inside)


def balanced_stripe_ranks(bounds: tuple[int, ...], seq_len: int, stripe: int, cp_size: int) -> torch.Tensor:
    """``[seq_len // stripe]`` int64: the rank holding each stripe, each rank ``seq_len /
    (stripe * cp_size)`` of them, for the documents ``bounds`` (``cu_seqlens`` on the host)."""
    n, w = seq_len // stripe, cp_size
    owner = stripe_documents(bounds, seq_len, stripe)
    # Documents as runs of stripes (owners never decrease), in stripe order.
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(owner[1:] != owner[:-1]).flatten() + 1])
    lengths = torch.diff(starts, append=torch.tensor([n]))
    run = torch.repeat_interleave(torch.arange(len(starts)), lengths)
    offset = torch.arange(n) - starts[run]
    long = lengths >= LONG_PERIODS * w
    rotation = torch.empty_like(lengths)
    striped = torch.nonzero(long).flatten()
    rotation[striped] = (torch.cumsum(lengths[striped], 0) - lengths[striped]) % w
    short = torch.nonzero(~long).flatten()
    short = short[torch.sort(-lengths[short], stable=True).indices]
    rotation[short] = torch.arange(len(short)) % w
    span = lengths[run]
    step = torch.where(long[run], offset, offset * (offset + 1) // 2)
    ranks = (rotation[run] + step) % w
    return _equal_counts(ranks, span, w)


def _equal_counts(ranks: torch.Tensor, span: torch.Tensor, w: int) -> torch.Tensor:
    """``ranks`` with stripes moved from ranks over ``n / w`` to the emptiest rank (the
    lowest on a tie), stripes of the shortest documents first, then by position."""
    per_rank = len(ranks) // w
    counts = torch.bincount(ranks, minlength=w).tolist()
    if max(counts) == per_rank:
        return ranks
    ranks = ranks.clone()
    order = torch.sort(span, stable=True).indices.tolist()
    held = ranks.tolist()
    for s in order:
        if counts[held[s]] > per_rank:
            to = counts.index(min(counts))
            counts[held[s]] -= 1
            counts[to] += 1
            ranks[s] = to
    return ranks

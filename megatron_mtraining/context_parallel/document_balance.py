"""The ``balanced`` layout's stripe-to-rank assignment, from a packed sample's documents.

Striping balances one causal sequence: every rank holds every ``W``-th stripe, so a block
diagonal ``d`` of the attention lands on ring step ``d mod W`` with equal work on every
rank. With packed documents the work of a document stays inside it, and documents about
as long as the stripe period (``W`` stripes) put their few diagonals on a few ranks of a
few steps: a ring step of vertical-slash attention may then hold one rank's tiles only.

The layout is fixed before any index exists, so it places documents by a cost model of
what it does know, the causal area of each document, and keeps every pattern made of
block diagonals in view by balancing windows of diagonals as well as the whole area:

* each stripe belongs to the document holding most of its tokens (the earliest of equals),
  so documents become runs of whole stripes;
* a document's shape fixes which rank offset and ring step each of its tiles (pairs of
  its stripes) falls on, up to a rotation over the ranks. Documents of at least ``2 W``
  stripes are striped, forwards or backwards (every diagonal spread over all ranks of one
  step, as striping places one sequence); shorter ones put their stripe ``i`` on rank
  offset ``i (i + 1) / 2``, so their near diagonals spread over all ring steps instead of
  filling the first few;
* documents, longest first, take in turn the rotation (and, striped ones, the direction)
  that least adds to ``sum_j (J - j) sum_(rank, step) load_j^2``, where ``load_j`` is the
  area of the tiles less than ``2^(j+1)`` diagonals from the main one (``j < J - 1``, up to
  ``2 W``; ``load_(J-1)`` is all of it). The whole area is what dense attention does; the
  windows, the narrower the heavier, stand for slash patterns, whose work gathers near the
  diagonal, so the documents fill each other's gaps for any such pattern rather than for
  the whole area alone. Short documents, in groups of ``W``, take rotations not yet taken
  in their group: a group of similar documents then holds every rotation of one shape,
  which balances every rank at every step by symmetry, whatever the pattern;
* ranks then holding more than ``n / W`` stripes hand stripes to the emptiest rank,
  those of the shortest documents first (a one-stripe document's work stays on its rank).

Areas are counted in whole tiles (a stripe with itself is half a tile; a document's
tokens in its neighbours' stripes are left out) as int64: exact integers, so every rank
computes the same assignment from the same bounds whatever its CPU (the sums stay far
below 2^63 up to documents of 32768 stripes). Host work only, a few small tensor
operations per document (``docs/benchmarks.md``, "Ring balance with packed documents",
has the measured imbalance and time).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

# Documents of at least this many stripe periods are striped.
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
    loads = WindowLoads(w)
    rotation, direction = [0] * len(starts), [1] * len(starts)
    free, shorts = np.ones(w, dtype=bool), 0
    for m in torch.sort(-lengths, stable=True).indices.tolist():
        if long[m]:
            direction[m], rotation[m] = loads.place_striped(int(lengths[m]))
            continue
        if shorts % w == 0:
            free[:] = True
        rotation[m] = loads.place_short(int(lengths[m]), free)
        free[rotation[m]] = False
        shorts += 1
    rotation, direction = torch.tensor(rotation), torch.tensor(direction)
    step = torch.where(long[run], direction[run] * offset, offset * (offset + 1) // 2)
    return _equal_counts((rotation[run] + step) % w, lengths[run], w)


def window_count(w: int) -> int:
    """Windows of diagonals the cost model balances: widths 2, 4, ... up to ``2 w``, and all."""
    return (2 * w).bit_length()


def diagonal_bucket(d: np.ndarray, w: int) -> np.ndarray:
    """How many of the windows leave out diagonal ``d`` (the narrowest holding it)."""
    powers = 2 ** np.arange(1, window_count(w))
    return (np.expand_dims(d, -1) >= powers).sum(-1)


def window_coupling(w: int) -> np.ndarray:
    """``[b, b']``: the summed weights of the windows holding both buckets, those wider
    than the farther one. Window ``j`` (from the narrowest, 0) weighs ``windows - j``."""
    farther = window_count(w) - np.arange(window_count(w))
    farther = np.minimum(farther[:, None], farther[None, :])
    return farther * (farther + 1) // 2


class WindowLoads:
    """The cost model's state: the windows' loads of the documents placed so far, kept as
    the potential ``phi[b, cell] = sum_j (J - j) [window j holds bucket b] load_j[cell]``
    per bucket of diagonals ``b`` and (rank, ring step) cell. Placing a document changes the
    weighted squares by twice ``sum_tiles area * phi[bucket, cell]`` plus the document's
    own squares, which its rotation and direction do not change: that sum is its cost.

    NumPy, not torch: a few small operations per document, which torch hands to its
    intra-op threads (on a busy 2-core host that made the layout 50 times slower)."""

    def __init__(self, w: int):
        self.w = w
        self.coupling = window_coupling(w)
        self.phi = np.zeros((window_count(w), w * w), dtype=np.int64)

    def place_short(self, length: int, free: np.ndarray) -> int:
        """The rotation, among the ``free`` ones, for a document of ``length < LONG_PERIODS *
        w`` stripes, placed."""
        cells, reads, area, adds = _short_tiles(self.w)
        m = length * (length + 1) // 2  # its tiles lead the table
        cost = area[:m] @ self.phi.reshape(-1)[reads[:m]]
        c = int(np.argmin(np.where(free, cost, np.iinfo(np.int64).max)))
        self.phi += _summed(np.arange(len(self.phi))[:, None] * self.w**2 + cells[:m, c], adds[:, :m], self.phi.shape)
        return c

    def place_striped(self, length: int) -> tuple[int, int]:
        """(direction, rotation) for a document of ``length`` stripes striped forwards (+1) or
        backwards (-1), placed; forwards and the lowest rotation win ties."""
        w = self.w
        forward = striped_tiles(length, w)
        mirror = -np.arange(w) % w
        shapes = {1: forward, -1: forward[:, mirror][:, :, mirror]}
        # circular[:, rho, c, :]: the potential of rank rho + c.
        circular = self.phi.reshape(-1, w, w)[:, (np.arange(w)[:, None] + np.arange(w)) % w]
        best = None
        for direction, tiles in shapes.items():
            cost = np.einsum("brs,brcs->c", tiles, circular)
            c = int(np.argmin(cost))
            if best is None or cost[c] < best[0]:
                best = (cost[c], direction, c)
        _, direction, c = best
        added = (self.coupling @ shapes[direction].reshape(len(self.coupling), -1)).reshape(-1, w, w)
        self.phi.reshape(-1, w, w)[:, (np.arange(w) + c) % w] += added
        return direction, c


def _summed(index: np.ndarray, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """int64 ``shape``: ``values`` summed at the flat ``index`` (repeats add up). Through
    float64, exact: the sums are integers far below 2^53."""
    size = int(np.prod(shape))
    return np.bincount(index.ravel(), weights=values.ravel(), minlength=size).astype(np.int64).reshape(shape)


@functools.lru_cache(maxsize=8)
def _short_tiles(w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tiles ``(i, j)``, ``j <= i``, of the longest short document, by ``i`` then ``j``
    (a document of ``L`` stripes has the first ``L (L + 1) / 2``): ``cells [T, w]`` (rank *
    w + step at each rotation), ``reads [T, w]`` (their potential entries), ``area [T]`` and
    ``adds [windows, T]`` (what each adds to every bucket's potential)."""
    longest = LONG_PERIODS * w - 1
    i = np.repeat(np.arange(longest), np.arange(longest) + 1)
    j = np.arange(len(i)) - i * (i + 1) // 2
    rank = i * (i + 1) // 2 % w
    step = (rank - j * (j + 1) // 2) % w
    bucket = diagonal_bucket(i - j, w)
    area = np.where(i == j, 1, 2)
    cells = (rank[:, None] + np.arange(w)) % w * w + step[:, None]
    return cells, bucket[:, None] * w * w + cells, area, window_coupling(w)[:, bucket] * area


def striped_tiles(length: int, w: int) -> np.ndarray:
    """``[windows, w, w]`` int64: the area of a document of ``length`` whole stripes striped
    forwards from rank 0 (stripe ``i`` on rank ``i mod w``), per bucket, rank and ring step:
    diagonal ``d`` puts its tiles ``(i, i - d)``, ``i >= d``, on rank ``i`` at step ``d``."""
    d = np.arange(length)[:, None]
    rank = np.arange(w)
    # Stripes i in [d, length) with i = rank (mod w).
    count = (length + w - 1 - rank) // w - (d + w - 1 - rank) // w
    index = (diagonal_bucket(d[:, 0], w)[:, None] * w + rank) * w + d % w
    return _summed(index, np.where(d == 0, 1, 2) * count, (window_count(w), w, w))


def _equal_counts(ranks: torch.Tensor, span: torch.Tensor, w: int) -> torch.Tensor:
    """``ranks`` with stripes moved from ranks over ``n / w`` to the emptiest rank (the
    lowest on a tie), stripes of the shortest documents first, then by position."""
    per_rank = len(ranks) // w
    counts = torch.bincount(ranks, minlength=w)
    if int(counts.max()) == per_rank:
        return ranks
    # Only stripes of ranks over their share move, and no rank ever rises above it.
    over = torch.nonzero(counts[ranks] > per_rank).flatten()
    order = over[torch.sort(span[over], stable=True).indices].tolist()
    ranks = ranks.clone()
    counts, held = counts.tolist(), ranks.tolist()
    for s in order:
        if counts[held[s]] > per_rank:
            to = counts.index(min(counts))
            counts[held[s]] -= 1
            counts[to] += 1
            ranks[s] = to
    return ranks

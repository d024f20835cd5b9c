"""The ``balanced`` layout's stripe-to-rank assignment, from a packed sample's documents.

Striping balances one causal sequence: every rank holds every ``W``-th stripe, so a block
diagonal ``d`` of the attention lands on ring step ``d mod W`` with equal work on every
rank. With packed documents the work of a document stays inside it, and documents about
as long as the stripe period (``W`` stripes) put their few diagonals on a few ranks of a
few steps: a ring step of vertical-slash attention may then hold one rank's tiles only.

The layout is fixed before any index exists, so it places documents by a cost model of
what it does know, the causal area of each document at token precision, and keeps every
pattern made of block diagonals in view by balancing windows of diagonals as well as the
whole area:

* each stripe belongs to the document holding most of its tokens (the earliest of equals),
  so documents become runs of whole stripes;
* the cost is the per-step variance of the windows' loads, ``sum_j (J - j) sum_step (W
  sum_rank load_j^2 - (sum_rank load_j)^2)``, where ``load_j`` is the area of the tiles less
  than ``2^(j+1)`` diagonals from the main one (``j < J - 1``, up to ``2 W``; ``load_(J-1)``
  is all of it) per (rank, ring step) cell. The whole area is what dense attention does;
  the windows, the narrower the heavier, stand for slash patterns, whose work gathers near
  the diagonal. The metric is per step (the most loaded rank against the step's mean), so
  the cost is too: moving work between steps is free, unevenness within one is not;
* a tile's area is its document's token pairs in the two stripes, in eighths of a whole
  tile (``TILE_UNITS``, rounded), so the tokens a document has in its neighbours' stripes
  count where they are computed: every boundary inside a stripe ties the two documents'
  stripes together;
* a document's shape fixes which rank offset and ring step each of its tiles falls on, up
  to a rotation over the ranks. Documents of at least ``2 W`` stripes are striped, forwards
  or backwards (every diagonal spread over all ranks of one step, as striping places one
  sequence); shorter ones put their stripe ``i`` on rank offset ``i (i + 1) / 2``, so their
  near diagonals spread over all ring steps instead of filling the first few;
* documents of at least ``filler_length(W)`` stripes, longest first, each take the
  rotation that least raises the cost to first order given those placed before them (its
  tiles with placed stripes of other documents included); striped ones take the rotation
  and direction that least raise the windows' squared loads by their own tiles, counted
  whole in closed form (their steps do not move with the rotation). Those shorter than
  ``2 W`` stripes, in groups of ``W``, take rotations not yet taken in their group: a group
  of similar documents then holds every rotation of one shape, which balances every rank at
  every step by symmetry;
* ranks then holding more than ``n / W`` stripes give up stripes of documents shorter than
  ``2 W``, the shortest documents' first, and the stripes left (these and the documents
  shorter than ``filler_length(W)``) are placed one at a time, longest documents' first,
  each on the rank with room whose cost its tiles to placed stripes least raise: short
  documents and released stripes, tied to few others, fill the cells the shapes left
  uneven (what striped documents alone leave over their share moves to the emptiest rank).

All integers (int64; float64 only for sums of integers far below ``2^53``, which are
exact), so every rank computes the same assignment from the same bounds whatever its CPU;
each cost is checked against overflow before it is summed (a striped document of 32768
stripes after another as long stays near ``2^59``). Host work only, from the bounds, a few
small array operations per document and per filler stripe (``docs/benchmarks.md``, "Ring
balance with packed documents", has the measured imbalance and time).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

# Documents of at least this many stripe periods are striped.
LONG_PERIODS = 2
# A whole tile's area in the cost model: partial tiles count to an eighth of a tile.
TILE_UNITS = 8
# The cost's sums must stay below this (int64 with a margin).
_COST_LIMIT = 2**62
_NEVER = np.iinfo(np.int64).max


def filler_length(w: int) -> int:
    """Documents shorter than this many stripes are placed stripe by stripe, after the others."""
    return max(2, w // 4)


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
    if w == 1:
        return torch.zeros(n, dtype=torch.int64)
    placement = Placement(bounds, seq_len, stripe, w)
    lengths = placement.lengths
    free, shorts = np.ones(w, dtype=bool), 0
    for m in np.argsort(-lengths, kind="stable"):
        if lengths[m] < filler_length(w):
            break
        if placement.striped[m]:
            placement.place_striped(m)
            continue
        if shorts % w == 0:
            free[:] = True
        free[placement.place_short(m, free)] = False
        shorts += 1
    placement.release_surplus()
    placement.place_fillers()
    return torch.from_numpy(_even_counts(placement.ranks, lengths[placement.run], w))


def document_tiles(bounds: tuple[int, ...], seq_len: int, stripe: int, cp_size: int) -> tuple[np.ndarray, ...]:
    """``(q, k, area)``: every tile the cost model counts, one entry per document and tile:
    the runs' own (``Placement.run_tiles``) and the tiles across runs' edges
    (``boundary_tiles``); striped documents' own tiles, counted whole in closed form, are
    not among them."""
    placement = Placement(bounds, seq_len, stripe, cp_size)
    parts = [placement.run_tiles(m) for m in np.flatnonzero(~placement.striped)]
    parts.append((placement.q, placement.k, placement.area))
    q, k, area = (np.concatenate(x) for x in zip(*parts, strict=True))
    return q[area > 0], k[area > 0], area[area > 0]


def tile_area(tokens_q: np.ndarray, tokens_k: np.ndarray, diagonal: np.ndarray, stripe: int) -> np.ndarray:
    """A document's tile area from its tokens in the query and key stripes: its token pairs
    (on the diagonal, the causal half with its own diagonal) in ``TILE_UNITS`` per whole
    tile, rounded half up."""
    twice = np.where(diagonal, tokens_q * (tokens_q + 1), 2 * tokens_q * tokens_k)
    return (TILE_UNITS * twice + stripe * stripe) // (2 * stripe * stripe)


def boundary_tiles(
    cu: np.ndarray, stripe: int, run_doc: np.ndarray, starts: np.ndarray, lengths: np.ndarray, striped: np.ndarray
) -> tuple[np.ndarray, ...]:
    """``(q, k, area)`` int64: the tiles of every document but the ``striped`` ones with a
    stripe outside the document's run (its first or last stripe, where another document holds
    most tokens; every tile of a document that holds no stripe), those of some area. A
    document's tiles inside its run are ``Placement.run_tiles``."""
    n_docs = len(cu) - 1
    lo, hi = np.full(n_docs, -1), np.full(n_docs, -1)
    lo[run_doc], hi[run_doc] = starts, starts + lengths
    keep = np.ones(n_docs, dtype=bool)
    keep[run_doc[striped]] = False
    d = np.flatnonzero(keep)
    begin, end = cu[d], cu[d + 1]
    first, last = begin // stripe, (end - 1) // stripe
    span, owns = last - first + 1, lo[d] >= 0
    first_out, last_out = ~owns | (first < lo[d]), ~owns | (last >= hi[d])
    # The last stripe's row (last, j) where it lies outside; the first stripe's column (i,
    # first) where it does, less (last, first) when the row holds it.
    row = np.where(last_out, span, 0)
    column = np.where(first_out, span - last_out, 0)
    row_doc, column_doc = np.repeat(np.arange(len(d)), row), np.repeat(np.arange(len(d)), column)
    q = np.concatenate([last[row_doc], first[column_doc] + _ramp(column)])
    k = np.concatenate([first[row_doc] + _ramp(row), first[column_doc]])
    doc = np.concatenate([row_doc, column_doc])

    def tokens(x: np.ndarray) -> np.ndarray:
        return np.minimum(end[doc], (x + 1) * stripe) - np.maximum(begin[doc], x * stripe)

    area = tile_area(tokens(q), tokens(k), q == k, stripe)
    return q[area > 0], k[area > 0], area[area > 0]


def _ramp(counts: np.ndarray) -> np.ndarray:
    """``0, 1, ..., c - 1`` for every ``c`` in ``counts``, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


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


def _triangular(i: np.ndarray) -> np.ndarray:
    return i * (i + 1) // 2


class Placement:
    """The assignment under way and the cost model's state: ``phi[b, rank, step] = sum_j (J -
    j) [window j holds bucket b] load_j[rank, step]`` over the tiles counted so far (a tile
    counts once both its stripes are placed). Adding a tile of area ``a`` and bucket ``b`` on
    cell ``(r, s)`` raises the cost by ``2 a (W phi[b, r, s] - psi[b, s])`` to first order,
    ``psi[b, s] = sum_r phi[b, r, s]`` (the per-step variance's derivative); the factor 2 is
    left out throughout.

    A run's own tiles (its document's, both stripes in the run) follow from the document's
    tokens in its stripes and are made when needed (``run_tiles``); the tiles across runs'
    edges are listed once (``boundary_tiles``), by run. NumPy, not torch: a few small
    operations per document and stripe, which torch hands to its intra-op threads (on a busy
    2-core host that made the layout 50 times slower)."""

    def __init__(self, bounds: tuple[int, ...], seq_len: int, stripe: int, w: int):
        n = seq_len // stripe
        owner = stripe_documents(bounds, seq_len, stripe).numpy()
        # Documents as runs of stripes (owners never decrease), in stripe order.
        self.starts = np.flatnonzero(np.diff(owner, prepend=-1))
        self.lengths = np.diff(self.starts, append=n)
        self.doc, self.striped = owner[self.starts], self.lengths >= LONG_PERIODS * w
        self.w, self.stripe, self.cu = w, stripe, np.asarray(bounds, dtype=np.int64)
        self.run = np.repeat(np.arange(len(self.starts)), self.lengths)
        self.ranks = np.full(n, -1, dtype=np.int64)
        q, k, area = boundary_tiles(self.cu, stripe, self.doc, self.starts, self.lengths, self.striped)
        run_q, run_k = self.run[q], self.run[k]
        # Listed tiles with both stripes in one run (other documents' tokens in its first or
        # last stripe), by run, with their slot in the run's triangle of tiles; the tiles
        # between runs under both.
        own = np.flatnonzero(run_q == run_k)
        own = own[np.argsort(run_q[own], kind="stable")]
        base = self.starts[run_q[own]]
        self.own, self.own_slot = own, _triangular(q[own] - base) + k[own] - base
        self.own_ptr = np.searchsorted(run_q[own], np.arange(len(self.starts) + 1))
        cross = np.flatnonzero(run_q != run_k)
        cross_run = np.concatenate([run_q[cross], run_k[cross]])
        order = np.argsort(cross_run, kind="stable")
        self.cross = np.concatenate([cross, cross])[order]
        self.cross_ptr = np.searchsorted(cross_run[order], np.arange(len(self.starts) + 1))
        self.q, self.k, self.area, self.bucket = q, k, area, diagonal_bucket(q - k, w)
        self._touching: dict = {}
        self.coupling = window_coupling(w)
        self.coupling_f = self.coupling.astype(np.float64)
        self.phi = np.zeros((window_count(w), w, w), dtype=np.int64)
        self.psi = np.zeros((window_count(w), w), dtype=np.int64)  # phi summed over the ranks

    # -- tiles ------------------------------------------------------------------------------
    def run_tiles(self, m: int) -> tuple[np.ndarray, ...]:
        """``(q, k, area)`` of run ``m``'s document inside the run (shorter than ``LONG_PERIODS
        * w`` stripes), every tile ``(i, j)``, ``j <= i``, by ``i`` then ``j``."""
        lo, length, d = int(self.starts[m]), int(self.lengths[m]), self.doc[m]
        stripes = np.arange(lo, lo + length)
        tokens = np.minimum(self.cu[d + 1], (stripes + 1) * self.stripe) - np.maximum(self.cu[d], stripes * self.stripe)
        i, j = _triangle(self.w)
        i, j = i[: _triangular(length)], j[: _triangular(length)]
        return lo + i, lo + j, tile_area(tokens[i], tokens[j], i == j, self.stripe)

    def _own(self, m: int) -> np.ndarray:
        return self.own[self.own_ptr[m] : self.own_ptr[m + 1]]

    def _cross(self, m: int) -> np.ndarray:
        """Run ``m``'s listed tiles with stripes of other runs, those whose other stripe is placed."""
        cross = self.cross[self.cross_ptr[m] : self.cross_ptr[m + 1]]
        q = self.q[cross]
        return cross[self.ranks[np.where(self.run[q] == m, self.k[cross], q)] >= 0]

    def _listed(self, tiles: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.q[tiles], self.k[tiles], self.area[tiles], self.bucket[tiles]

    def _incident(self, s: int) -> tuple[np.ndarray, ...]:
        """``(q, k, area, bucket)``: stripe ``s``'s tiles whose other stripe is placed, and its
        own tile (a stripe of a run shorter than ``LONG_PERIODS * w``)."""
        m = self.run[s]
        if m not in self._touching:  # every tile with a stripe in the run, made once
            q, k, area = self.run_tiles(m)
            listed = self._listed(np.concatenate([self._own(m), self.cross[self.cross_ptr[m] : self.cross_ptr[m + 1]]]))
            own = (q, k, area, diagonal_bucket(q - k, self.w))
            self._touching[m] = tuple(np.concatenate(x) for x in zip(own, listed, strict=True))
        q, k, area, bucket = self._touching[m]
        keep = ((q == s) & ((k == s) | (self.ranks[k] >= 0))) | ((k == s) & (q != s) & (self.ranks[q] >= 0))
        return q[keep], k[keep], area[keep], bucket[keep]

    def _count(self, q: np.ndarray, k: np.ndarray, area: np.ndarray, bucket: np.ndarray, sign: int = 1) -> None:
        """Adds (or takes out) placed tiles to the potential and its step sums."""
        w, rq, rk = self.w, self.ranks[q], self.ranks[k]
        self._add((bucket * w + rq) * w + (rq - rk) % w, sign * area)

    def _add(self, index: np.ndarray, area: np.ndarray) -> None:
        """Adds ``area`` at the flat (bucket, rank, step) ``index`` to the potential and its
        step sums: a few tiles one by one, many through a float64 sum per (bucket, cell) and
        the coupling product (exact: sums far below 2^53)."""
        windows, w = len(self.phi), self.w
        if len(index) <= 4 * windows:
            bucket, cell = np.divmod(index, w * w)
            added = self.coupling[:, bucket] * area
            np.add.at(self.phi.reshape(windows, -1), (slice(None), cell), added)
            np.add.at(self.psi, (slice(None), cell % w), added)
            return
        raw = np.bincount(index, weights=area, minlength=self.phi.size).reshape(windows, -1)
        added = (self.coupling_f @ raw).round().astype(np.int64).reshape(self.phi.shape)
        self.phi += added
        self.psi += added.sum(1)

    def _first_order(self, tiles: tuple[np.ndarray, ...], rq: np.ndarray, rk: np.ndarray) -> np.ndarray:
        """``[K]``: the first-order cost of ``tiles`` (``(q, k, area, bucket)``) with query and
        key ranks ``rq``, ``rk`` (``[K, T]``, one row per candidate)."""
        _, _, area, b = tiles
        w = self.w
        step = (rq - rk) % w
        gain = w * self.phi.reshape(-1)[(b * w + rq) * w + step] - self.psi.reshape(-1)[b * w + step]
        return gain @ area

    def _check(self, area: int) -> None:
        if area * int(self.phi.max(initial=0)) * self.w >= _COST_LIMIT:
            raise ValueError(
                f"balanced layout: a document's cost ({area} x {int(self.phi.max())} x {self.w}) would overflow "
                "int64; the sample has too many stripes for the cost model (use longer stripes)"
            )

    # -- documents --------------------------------------------------------------------------
    def place_short(self, m: int, free: np.ndarray) -> int:
        """Places run ``m`` (shorter than ``LONG_PERIODS * w`` stripes) at the rotation, among
        the ``free`` ones, that least raises the cost; returns the rotation."""
        w, lo, length = self.w, int(self.starts[m]), int(self.lengths[m])
        own, cross = self._own(m), self._cross(m)
        # The run's tiles by slot of its triangle: a rotation moves every one to another rank
        # on its step, so the steps' sums (psi) do not change with it, only phi's gather.
        slot_area = self.run_tiles(m)[2] + _summed(
            self.own_slot[self.own_ptr[m] : self.own_ptr[m + 1]], self.area[own], (_triangular(length),)
        )
        self._check(int(slot_area.sum() + self.area[cross].sum()))
        rotations = np.flatnonzero(free)
        reads = _short_tiles(w)[: len(slot_area)]
        cost = w * (slot_area @ self.phi.reshape(-1)[reads[:, rotations]])
        # Tiles to stripes of other runs: both rank and step move with the rotation.
        offset = (_triangular(np.arange(length))[None, :] + np.arange(w)[:, None]) % w
        if len(cross):
            cq, ck = self.q[cross], self.k[cross]
            in_q = cq < lo + length  # else the key is this run's and the query lies after it
            at = offset[rotations]
            rq = np.where(in_q, at[:, np.where(in_q, cq - lo, 0)], self.ranks[cq])
            rk = np.where(in_q, self.ranks[ck], at[:, np.where(in_q, 0, ck - lo)])
            cost = cost + self._first_order(self._listed(cross), rq, rk)
        c = int(rotations[np.argmin(cost)])
        self.ranks[lo : lo + length] = offset[c]
        self._add(reads[:, c], slot_area)
        self._count(*self._listed(cross))
        return c

    def place_striped(self, m: int) -> None:
        """Places run ``m`` striped forwards (+1) or backwards (-1) at the rotation that least
        raises the squared loads of its own tiles (counted whole, in closed form: the steps do
        not move with the rotation); forwards and the lowest rotation win ties."""
        w, lo, length = self.w, int(self.starts[m]), int(self.lengths[m])
        forward = striped_tiles(length, w, TILE_UNITS // 2, TILE_UNITS)
        self._check(int(forward.sum()))
        mirror = -np.arange(w) % w
        shapes = {1: forward, -1: forward[:, mirror][:, :, mirror]}
        # circular[:, rho, c, :]: the potential of rank rho + c.
        circular = self.phi[:, (np.arange(w)[:, None] + np.arange(w)) % w]
        best = None
        for direction, tiles in shapes.items():
            cost = np.einsum("brs,brcs->c", tiles, circular)
            c = int(np.argmin(cost))
            if best is None or cost[c] < best[0]:
                best = (cost[c], direction, c)
        _, direction, c = best
        added = (self.coupling @ shapes[direction].reshape(len(self.coupling), -1)).reshape(-1, w, w)
        self.phi[:, (np.arange(w) + c) % w] += added
        self.psi += added.sum(1)
        # Other documents' tiles on its stripes (their tokens in its first and last stripes).
        self.ranks[lo : lo + length] = (c + direction * np.arange(length)) % w
        self._count(*self._listed(np.concatenate([self._own(m), self._cross(m)])))

    # -- stripes ----------------------------------------------------------------------------
    def release_surplus(self) -> None:
        """Ranks over ``n / w`` stripes give up stripes of runs shorter than ``LONG_PERIODS *
        w``, the shortest runs' first, then by position, until at their share."""
        w, per_rank = self.w, len(self.ranks) // self.w
        counts = np.bincount(self.ranks[self.ranks >= 0], minlength=w)
        if counts.max(initial=0) <= per_rank:
            return
        span = self.lengths[self.run]
        over = np.flatnonzero((self.ranks >= 0) & (span < LONG_PERIODS * w))
        over = over[counts[self.ranks[over]] > per_rank]
        for s in over[np.argsort(span[over], kind="stable")]:
            if counts[self.ranks[s]] > per_rank:
                self._count(*self._incident(s), -1)
                counts[self.ranks[s]] -= 1
                self.ranks[s] = -1

    def place_fillers(self) -> None:
        """Places every stripe left, the longest runs' first, then by position, each on the
        rank with room (below ``n / w``) whose cost its tiles to placed stripes least raise
        (the lowest rank of equals)."""
        w, per_rank = self.w, len(self.ranks) // self.w
        left = np.flatnonzero(self.ranks < 0)
        counts = np.bincount(self.ranks[self.ranks >= 0], minlength=w)
        candidates = np.arange(w)[:, None]
        for s in left[np.argsort(-self.lengths[self.run[left]], kind="stable")]:
            tiles = self._incident(s)
            q, k = tiles[:2]
            rq = np.where(q == s, candidates, self.ranks[q])
            rk = np.where(k == s, candidates, self.ranks[k])
            cost = self._first_order(tiles, rq, rk)
            r = int(np.argmin(np.where(counts < per_rank, cost, _NEVER)))
            self.ranks[s] = r
            counts[r] += 1
            self._count(*tiles)


@functools.lru_cache(maxsize=8)
def _triangle(w: int) -> tuple[np.ndarray, np.ndarray]:
    """``(i, j)``: the tiles ``j <= i`` of the longest short run, by ``i`` then ``j`` (a run
    of ``L`` stripes has the first ``L (L + 1) / 2``)."""
    longest = LONG_PERIODS * w - 1
    i = np.repeat(np.arange(longest), np.arange(longest) + 1)
    return i, np.arange(len(i)) - _triangular(i)


@functools.lru_cache(maxsize=8)
def _short_tiles(w: int) -> np.ndarray:
    """``[T, w]``: for the tiles ``(i, j)``, ``j <= i``, of the longest short run, by ``i``
    then ``j`` (a run of ``L`` stripes has the first ``L (L + 1) / 2``), their flat (bucket,
    rank, step) entry of the potential at each rotation: stripe ``i`` on rank offset ``i (i +
    1) / 2``, the tile on the step between its stripes' offsets."""
    i, j = _triangle(w)
    rank = _triangular(i) % w
    step = (rank - _triangular(j)) % w
    cells = (rank[:, None] + np.arange(w)) % w * w + step[:, None]
    return diagonal_bucket(i - j, w)[:, None] * w * w + cells


def _summed(index: np.ndarray, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """int64 ``shape``: ``values`` summed at the flat ``index`` (repeats add up). Through
    float64, exact: the sums are integers far below 2^53."""
    size = int(np.prod(shape))
    return np.bincount(index.ravel(), weights=values.ravel(), minlength=size).astype(np.int64).reshape(shape)


def striped_tiles(length: int, w: int, diagonal: int = 1, whole: int = 2) -> np.ndarray:
    """``[windows, w, w]`` int64: the area of a document of ``length`` whole stripes striped
    forwards from rank 0 (stripe ``i`` on rank ``i mod w``), per bucket, rank and ring step,
    a tile on the diagonal counting ``diagonal`` and any other ``whole``: diagonal ``d`` puts
    its tiles ``(i, i - d)``, ``i >= d``, on rank ``i`` at step ``d``."""
    d = np.arange(length)[:, None]
    rank = np.arange(w)
    # Stripes i in [d, length) with i = rank (mod w).
    count = (length + w - 1 - rank) // w - (d + w - 1 - rank) // w
    index = (diagonal_bucket(d[:, 0], w)[:, None] * w + rank) * w + d % w
    return _summed(index, np.where(d == 0, diagonal, whole) * count, (window_count(w), w, w))


def _even_counts(ranks: np.ndarray, span: np.ndarray, w: int) -> np.ndarray:
    """``ranks`` with stripes moved from ranks over ``n / w`` to the emptiest rank (the
    lowest on a tie), stripes of the shortest runs first, then by position: only striped
    runs can leave a rank over its share once the others' stripes are released."""
    per_rank = len(ranks) // w
    counts = np.bincount(ranks, minlength=w)
    if counts.max() == per_rank:
        return ranks
    over = np.flatnonzero(counts[ranks] > per_rank)
    ranks = ranks.copy()
    for s in over[np.argsort(span[over], kind="stable")]:
        if counts[ranks[s]] > per_rank:
            to = int(np.argmin(counts))
            counts[ranks[s]] -= 1
            counts[to] += 1
            ranks[s] = to
    return ranks

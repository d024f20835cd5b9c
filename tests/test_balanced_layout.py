"""The ``balanced`` context-parallel layout: stripes placed by a packed sample's documents.

Its invariants on fresh random boundaries (a permutation of whole, ascending stripes, the
same count on every rank, the same on every call), the tiles' token areas and the assignment
rule against a brute-force replay on fresh random and hand-made documents, the ring on it
against fp64 dense attention under the block-diagonal causal mask (gloo CP 2 and 4), and
its simulated balance against striping.
"""

import pytest
import torch
from cp_workers import check_ring_with_documents
from documents_reference import random_boundaries
from gloo import run

from megatron_mtraining.context_parallel import (
    ContextParallelLayout,
    imbalance_degrees,
    ring_work,
    simulate_ring_areas,
)
from megatron_mtraining.context_parallel.document_balance import (
    LONG_PERIODS,
    TILE_UNITS,
    balanced_stripe_ranks,
    diagonal_bucket,
    document_tiles,
    filler_length,
    stripe_documents,
    striped_tiles,
)
from megatron_mtraining.examples.synthetic import DOCUMENT_MIXES, sampled_document_bounds, slash_heavy_index
from megatron_mtraining.sparse import DenseIndex
from megatron_mtraining.sparse.documents import packed_documents


def _random_documents(rng, seq: int, stripe: int) -> torch.Tensor:
    """Boundaries of one of the sampled mixes (mean about two stripe periods of 8 ranks) or
    the documents tests' hand-picked shapes, chosen at random."""
    pick = int(torch.randint(0, len(DOCUMENT_MIXES) + 1, (1,), generator=rng))
    if pick == len(DOCUMENT_MIXES):
        return random_boundaries(rng, seq, stripe)
    return sampled_document_bounds(DOCUMENT_MIXES[pick], seq, 16 * stripe, rng)


@pytest.mark.parametrize("cp_size, seq, stripe", [(2, 512, 16), (4, 1024, 16), (8, 4096, 16), (6, 3072, 32)])
def test_balanced_layout_is_a_permutation_of_whole_stripes_in_equal_shares(cp_size, seq, stripe, rng):
    for _ in range(5):
        cu = _random_documents(rng, seq, stripe)
        layout = ContextParallelLayout("balanced", cp_size, seq, stripe=stripe, documents=cu)
        parts = [layout.positions(r) for r in range(cp_size)]
        assert {len(p) for p in parts} == {seq // cp_size}
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
        for p in parts:
            runs = p.view(-1, stripe)
            assert (runs[:, 0] % stripe == 0).all() and torch.equal(runs, runs[:, :1] + torch.arange(stripe))
            assert (runs[1:, 0] > runs[:-1, 0]).all()
        x = torch.randn(1, seq, 3, generator=rng)
        assert torch.equal(layout.unshard([layout.shard(x, r) for r in range(cp_size)]), x)
        # The same from another form of the bounds and from a second computation.
        again = ContextParallelLayout("balanced", cp_size, seq, stripe=stripe, documents=cu.tolist())
        assert again == layout and all(torch.equal(again.positions(r), parts[r]) for r in range(cp_size))
        ranks = balanced_stripe_ranks(tuple(cu.tolist()), seq, stripe, cp_size)
        assert torch.equal(ranks, balanced_stripe_ranks(tuple(cu.tolist()), seq, stripe, cp_size))
        assert all(
            torch.equal(torch.nonzero(ranks == r).flatten() * stripe, parts[r][::stripe]) for r in range(cp_size)
        )


def test_without_documents_or_with_one_it_is_striped(rng):
    striped = ContextParallelLayout("striped", 4, 1024, stripe=16)
    for documents in (None, torch.tensor([0, 1024], dtype=torch.int32)):
        layout = ContextParallelLayout("balanced", 4, 1024, stripe=16, documents=documents)
        assert layout.documents is None
        assert all(torch.equal(layout.positions(r), striped.positions(r)) for r in range(4))
    # Other kinds do not read the documents: equal layouts whatever the sample.
    cu = _random_documents(rng, 1024, 16)
    assert ContextParallelLayout("striped", 4, 1024, stripe=16, documents=cu) == striped


def test_a_stripe_belongs_to_the_document_holding_most_of_it(rng):
    seq, stripe = 1024, 16
    for _ in range(5):
        cu = _random_documents(rng, seq, stripe)
        bounds = cu.tolist()
        owner = stripe_documents(tuple(bounds), seq, stripe).tolist()
        for s, got in enumerate(owner):
            tokens = [
                max(0, min(b, (s + 1) * stripe) - max(a, s * stripe)) for a, b in zip(bounds, bounds[1:], strict=False)
            ]
            # The first document with the most tokens: Python's max keeps the first of equals.
            assert got == max(range(len(tokens)), key=lambda d: (tokens[d], -d)), (s, tokens)


def _token_tiles(bounds: list[int], stripe: int, skip: set) -> list[tuple[int, int, int]]:
    """Every document's tiles but those of the documents in ``skip``, their token pairs
    counted one by one: ``(q, k, area)`` with ``area`` the pairs (key at or before the query)
    in ``TILE_UNITS`` per whole tile, rounded half up, tiles of no area left out."""
    tiles = []
    for d, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if d in skip:
            continue
        for sq in range(a // stripe, (b - 1) // stripe + 1):
            for sk in range(a // stripe, sq + 1):
                rows = range(max(a, sq * stripe), min(b, (sq + 1) * stripe))
                cols = range(max(a, sk * stripe), min(b, (sk + 1) * stripe))
                pairs = sum(1 for x in rows for y in cols if y <= x)
                area = (TILE_UNITS * 2 * pairs + stripe * stripe) // (2 * stripe * stripe)
                if area:
                    tiles.append((sq, sk, area))
    return tiles


def _brute_force_ranks(bounds: list[int], seq: int, stripe: int, w: int) -> tuple[list[int], dict]:
    """The assignment rule replayed with every cost counted from scratch. The state is a
    function of the ranks placed so far: every tile whose two stripes are placed (each
    document's token pairs, counted one by one; a striped document's own tiles whole), summed
    per window of diagonals (widths 2, 4, ... up to 2 w, then all; the narrowest weighing
    the most) and (rank, ring step) cell. A candidate's cost is the first-order rise of the
    per-step variance ``sum W load^2 - (sum_rank load)^2`` by the tiles it completes (a
    striped document: the rise of the squared loads by its own tiles). Also counts what the
    rule did (striped documents, released and filled stripes, moved by the last even-out)."""
    n = seq // stripe
    owner = stripe_documents(tuple(bounds), seq, stripe).tolist()
    starts = [s for s in range(n) if s == 0 or owner[s] != owner[s - 1]]
    lengths = [b - a for a, b in zip(starts, [*starts[1:], n], strict=True)]
    run_of = [m for m, length in enumerate(lengths) for _ in range(length)]
    striped = {m for m, length in enumerate(lengths) if length >= LONG_PERIODS * w}
    tiles = _token_tiles(bounds, stripe, {owner[starts[m]] for m in striped})
    whole = {
        m: [
            (starts[m] + i, starts[m] + j, TILE_UNITS // 2 if i == j else TILE_UNITS)
            for i in range(lengths[m])
            for j in range(i + 1)
        ]
        for m in striped
    }
    widths = [2**k for k in range(1, 2 * w + 1) if 2**k <= 2 * w] + [float("inf")]
    weights = [len(widths) - j for j in range(len(widths))]
    ranks = [-1] * n

    def cell(q, k, rank):
        return rank[q], (rank[q] - rank[k]) % w

    def loads():
        load, steps = {}, {}
        counted = [t for m in striped if ranks[starts[m]] >= 0 for t in whole[m]]
        counted += [t for t in tiles if ranks[t[0]] >= 0 and ranks[t[1]] >= 0]
        for q, k, area in counted:
            r, s = cell(q, k, ranks)
            for j, width in enumerate(widths):
                if q - k < width:
                    load[j, r, s] = load.get((j, r, s), 0) + area
                    steps[j, s] = steps.get((j, s), 0) + area
        return load, steps

    def rise(added, rank, variance=True):
        load, steps = loads()
        total = 0
        for q, k, area in added:
            r, s = cell(q, k, rank)
            for j, width in enumerate(widths):
                if q - k < width:
                    total += (
                        weights[j] * area * (w * load.get((j, r, s), 0) - (steps.get((j, s), 0) if variance else 0))
                    )
        return total

    def completed(stripes, rank):
        return [t for t in tiles if (t[0] in stripes or t[1] in stripes) and rank[t[0]] >= 0 and rank[t[1]] >= 0]

    stats = {"striped": 0, "released": 0, "filled": 0, "moved": 0}
    free, shorts = set(), 0
    for m in sorted(range(len(starts)), key=lambda m: -lengths[m]):
        if lengths[m] < filler_length(w):
            break
        run = range(starts[m], starts[m] + lengths[m])
        if m in striped:
            best = None
            for sign in (1, -1):
                for c in range(w):
                    rank = list(ranks)
                    for i in range(lengths[m]):
                        rank[starts[m] + i] = (c + sign * i) % w
                    cost = rise(whole[m], rank, variance=False)
                    if best is None or cost < best[0]:
                        best = (cost, rank)
            ranks = best[1]
            stats["striped"] += 1
            continue
        free = set(range(w)) if shorts % w == 0 else free
        shorts += 1
        best = None
        for c in sorted(free):
            rank = list(ranks)
            for i in range(lengths[m]):
                rank[starts[m] + i] = (c + i * (i + 1) // 2) % w
            cost = rise(completed(set(run), rank), rank)
            if best is None or cost < best[0]:
                best = (cost, c, rank)
        ranks = best[2]
        free.discard(best[1])
    # Ranks over their share release stripes of documents not striped, shortest first.
    counts = [ranks.count(r) for r in range(w)]
    for s in sorted(range(n), key=lambda s: lengths[run_of[s]]):
        if ranks[s] >= 0 and run_of[s] not in striped and counts[ranks[s]] > n // w:
            counts[ranks[s]] -= 1
            ranks[s] = -1
            stats["released"] += 1
    # Every stripe left, longest documents' first, on the rank with room its tiles least load.
    for s in sorted((s for s in range(n) if ranks[s] < 0), key=lambda s: -lengths[run_of[s]]):
        best = None
        for r in range(w):
            if counts[r] < n // w:
                rank = list(ranks)
                rank[s] = r
                cost = rise(completed({s}, rank), rank)
                if best is None or cost < best[0]:
                    best = (cost, r)
        ranks[s] = best[1]
        counts[best[1]] += 1
        stats["filled"] += 1
    # What striped documents alone left over their share moves to the emptiest ranks.
    for s in sorted(range(n), key=lambda s: lengths[run_of[s]]):
        if counts[ranks[s]] > n // w:
            to = counts.index(min(counts))
            counts[ranks[s]] -= 1
            counts[to] += 1
            ranks[s] = to
            stats["moved"] += 1
    return ranks, stats


def test_document_tiles_count_every_token_pair(rng):
    """The tiles the cost model counts (each run's own, made from its document's tokens, and
    those listed across runs' edges) equal every document's token pairs counted one by one,
    the striped documents' left out."""
    for _ in range(6):
        stripe, w = int(torch.randint(2, 17, (1,), generator=rng)), int(torch.randint(2, 9, (1,), generator=rng))
        seq = 512 - 512 % (stripe * w)
        cu = _random_documents(rng, seq, stripe).tolist()
        owner = stripe_documents(tuple(cu), seq, stripe).tolist()
        runs = [owner[s] for s in range(len(owner)) if s == 0 or owner[s] != owner[s - 1]]
        striped = {d for d in runs if owner.count(d) >= LONG_PERIODS * w}
        q, k, area = document_tiles(tuple(cu), seq, stripe, w)
        got = sorted(zip(q.tolist(), k.tolist(), area.tolist(), strict=True))
        assert got == sorted(_token_tiles(cu, stripe, striped)), (cu, stripe, w)


@pytest.mark.parametrize("cp_size, seq, stripe", [(2, 256, 8), (3, 384, 8), (4, 512, 8)])
def test_assignment_equals_the_rule_replayed_by_brute_force(cp_size, seq, stripe, rng):
    """Fresh random documents, short, striped and filler ones: every document's rotation (and
    direction), every released stripe and every filler's rank are those the rule picks with
    each cost counted again from the placed ranks."""
    seen = dict.fromkeys(("striped", "released", "filled", "moved"), 0)
    for _ in range(4):
        cu = _random_documents(rng, seq, stripe)
        want, stats = _brute_force_ranks(cu.tolist(), seq, stripe, cp_size)
        assert balanced_stripe_ranks(tuple(cu.tolist()), seq, stripe, cp_size).tolist() == want, cu.tolist()
        seen = {key: seen[key] + stats[key] for key in seen}
    print(f"what the rule did: {seen}")


def test_surplus_stripes_move_as_the_rule_moves_them():
    """Documents of 1, 27, 11, 10, 1 and 14 tokens in stripes of 2 over 4 ranks: one is
    striped, the shapes of the others leave a rank over its share, which releases a stripe,
    and it and the one-stripe document go where the replayed rule puts them."""
    bounds = [0, 1, 28, 39, 49, 50, 64]
    want, stats = _brute_force_ranks(bounds, 64, 2, 4)
    assert stats == {"striped": 1, "released": 1, "filled": 2, "moved": 0}
    assert balanced_stripe_ranks(tuple(bounds), 64, 2, 4).tolist() == want


def test_striped_tiles_count_every_tile(rng):
    """The closed-form areas of a striped document equal its tiles counted one by one."""
    for _ in range(5):
        w = int(torch.randint(1, 9, (1,), generator=rng))
        length = int(torch.randint(1, 6 * w + 2, (1,), generator=rng))
        got = striped_tiles(length, w)
        want = [[[0] * w for _ in range(w)] for _ in range(len(got))]
        for i in range(length):
            for k in range(i + 1):
                want[diagonal_bucket(i - k, w)][i % w][(i - k) % w] += 1 if i == k else 2
        assert got.tolist() == want, (length, w)


def test_balanced_layout_errors_name_the_field():
    with pytest.raises(ValueError, match=r"ContextParallelLayout.seq_len=100 .*stripe x cp_size \(8 x 4 = 32\)"):
        ContextParallelLayout("balanced", 4, 100, stripe=8)
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\]=96 .*the sequence length 128"):
        ContextParallelLayout("balanced", 4, 128, stripe=8, documents=[0, 40, 96])
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\]=40 .*above cu_seqlens\[1\] = 40"):
        ContextParallelLayout("balanced", 4, 128, stripe=8, documents=[0, 40, 40, 128])


@pytest.mark.parametrize("world, kv_exchange", [(2, "ring"), (2, "allgather"), (4, "ring")])
def test_ring_on_the_balanced_layout_equals_block_diagonal_attention(world, kv_exchange, rng):
    """Every pattern's ring (or all-gather) on the balanced layout of fresh random boundaries,
    fp64 reference path: out, lse and gradients equal fp64 dense attention under the index's
    mask, inside the block-diagonal causal mask."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    run(world, check_ring_with_documents, seed, 192, False, kv_exchange, ("balanced",))


def test_balanced_beats_striped_on_the_simulated_ring(rng, capsys):
    """Documents about half a stripe period long (uniform, mean 64 tokens; 16-token stripes,
    8 ranks): the striped ring's steps hold a document's work on a few ranks, the balanced
    layout's spread it. Over 30 seeds: striped 1.14-1.39 worker-level (dense and
    vertical-slash), balanced 1.02-1.04."""
    seq, stripe, w = 16384, 16, 8
    index = slash_heavy_index(seq, stripe, 4, rng)
    cu = sampled_document_bounds("uniform", seq, 64, rng)
    docs = packed_documents(cu, seq)
    works = {
        "dense": DenseIndex(1, 4, seq, documents=docs),
        "vertical-slash": ring_work(index.within(docs)),
    }
    for pattern, work in works.items():
        tiles = work.block_areas(stripe)
        worker = {}
        for kind in ("striped", "balanced"):
            layout = ContextParallelLayout(kind, w, seq, stripe=stripe, documents=cu)
            worker[kind] = imbalance_degrees(simulate_ring_areas(work, layout, stripe, tiles))[0]
        with capsys.disabled():
            print(f"\n{pattern}: worker-level imbalance {worker}")
        assert worker["balanced"] < 1.10 < worker["striped"], pattern

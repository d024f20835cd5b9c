"""The ``balanced`` context-parallel layout: stripes placed by a packed sample's documents.

Its invariants on fresh random boundaries (a permutation of whole, ascending stripes, the
same count on every rank, the same on every call), the assignment rule on hand-made
documents, the ring on it against fp64 dense attention under the block-diagonal causal mask
(gloo CP 2 and 4), and its simulated balance against striping.
"""

import dataclasses

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
from megatron_mtraining.context_parallel.document_balance import balanced_stripe_ranks, stripe_documents
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


def test_assignment_rule_on_whole_stripe_documents():
    """Documents of whole stripes, lengths chosen so that no stripe moves: long documents
    striped one after the other, short ones rotated by their rank in length order and
    placed at triangular steps."""
    stripe, w = 4, 4
    # Lengths in stripes: 8 and 9 (long: at least 2 W), 4, 3 and 1 (short).
    lengths = [4, 8, 1, 3, 9, 4, 3, 1, 7]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n * stripe)
    seq = bounds[-1]
    # Long: document 1 from rank 0, document 4 after its 8 stripes (rank 0 again).
    # Short, by length then position: 7 (doc 8), 4 (doc 0), 4 (doc 5), 3 (doc 3), 3 (doc 6), 1 (doc 2), 1 (doc 7).
    rotation = {1: 0, 4: 8 % w, 8: 0, 0: 1, 5: 2, 3: 3, 6: 0, 2: 1, 7: 2}
    want = []
    for d, n in enumerate(lengths):
        want += [(rotation[d] + (i if n >= 2 * w else i * (i + 1) // 2)) % w for i in range(n)]
    assert torch.bincount(torch.tensor(want), minlength=w).tolist() == [seq // stripe // w] * w
    assert balanced_stripe_ranks(tuple(bounds), seq, stripe, w).tolist() == want


def test_surplus_stripes_move_from_the_shortest_documents():
    """Stripes over a rank's share move to the emptiest rank, those of the shortest documents
    first."""
    stripe, w = 2, 4
    lengths = [10, 2, 1, 1, 1, 1]  # 16 stripes, 4 per rank
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n * stripe)
    ranks = balanced_stripe_ranks(tuple(bounds), bounds[-1], stripe, w)
    assert torch.bincount(ranks, minlength=w).tolist() == [4] * w
    # Before moving: the long document on 0,1,2,3,0,1,2,3,0,1; the two-stripe one (rotation 0)
    # on 0, 1; the one-stripe ones (rotations 1, 2, 3, 0) on 1, 2, 3, 0. Ranks 0 and 1 hold
    # five, 2 and 3 three. In order of document length, then position: the first one-stripe
    # document's (rank 1) goes to rank 2, the last one's (rank 0) to rank 3.
    assert ranks.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 1, 2, 2, 3, 3]


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
    vertical-slash), balanced 1.03-1.07."""
    seq, stripe, w = 16384, 16, 8
    index = slash_heavy_index(seq, stripe, 4, rng)
    cu = sampled_document_bounds("uniform", seq, 64, rng)
    docs = packed_documents(cu, seq)
    works = {
        "dense": DenseIndex(1, 4, seq, documents=docs),
        "vertical-slash": ring_work(
            dataclasses.replace(index, slash=index.slash.unsqueeze(2).expand(-1, -1, docs.count, -1), documents=docs)
        ),
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

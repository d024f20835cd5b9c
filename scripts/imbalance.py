"""Simulated load imbalance of the sparse ring: per-rank, per-step attended area for
each layout, without processes.

    python scripts/imbalance.py [--seq-len 65536] [--cp-size 32] [--block 64] [--seeds 20]
                                [--documents none uniform lognormal one_long] [--mean-doc 2048]
                                [--index slash-heavy | natural] [--layouts ...]
                                [--search 0]

The vertical-slash index is slash-dominated, as in the MTraining paper: per head 8
local block diagonals, 1/16 of the other diagonals at random, 16 sink and 64
scattered vertical columns (``--index natural``: the kernels' benchmark index instead,
``planning.workload.natural_index`` at 5% density: 4 local block diagonals, far ones and
columns until the density is reached). Vertical columns run in the local pass (every rank,
balanced), so the ring's work is the tiles (``ring_work``). The hierarchical ring runs the
flat ring's steps (``context_parallel.ring_schedule``), so these figures hold for both. With
packed documents
(``--documents``, drawn by ``examples.synthetic.sampled_document_bounds`` with mean length
``--mean-doc``) the same index is masked to each row's document, and dense attention
becomes block-diagonal causal: both rows are printed per document mix, and the
``balanced`` layout places each sample's stripes by its documents (without documents it is
``striped``). Prints the worker-level and step-level imbalance degrees (max/mean across
ranks in a step, across steps for a rank; 1.0 = balanced), min-max over seeds, and the
granularity of the work: its largest tile over the mean area of a (rank, step) cell (an
indivisible tile larger than a cell's mean would force a most loaded rank above it).

The ``all-gather ID`` column is the all-gather exchange's worker-level imbalance
(``ring_attention(..., kv_exchange="allgather")``): each rank attends the whole gathered K/V
in one piece, so its one sync is the whole pass, and the degree is max/mean of the ranks'
total areas. The last, ``ring time``, is the ring's time over a balanced ring's when every
step waits for its busiest rank (``ring_time_degree``): the worker-level degree averages the
steps alike, and the light ones (a few percent of the work each) can carry it.

``--node-gather G`` adds, for each layout, the exchange that gathers K/V inside nodes of ``G``
ranks and rings across nodes (``ring_attention(..., hierarchy, kv_exchange="allgather")``,
``context_parallel.node_gather``), whose steps are the outer ones, under the layout numbered
node-major (``ContextParallelLayout.node_size``): rows ``<layout>, node gather``.

``--search N`` adds the ``searched`` layout: the balanced layout improved by ``N``
proposed swaps of two stripes between ranks, each kept if it lowers a smooth maximum of
every step's per-rank areas (``_search``), on the sample's own tiles of each pattern.
The layout cannot do this (the index does not exist yet, and it takes seconds to minutes);
it shows how far a layout that knew the work could get, an upper bound on the best one.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from megatron_mtraining.context_parallel import (
    ContextParallelLayout,
    imbalance_degrees,
    ring_time_degree,
    ring_work,
    simulate_ring_areas,
)
from megatron_mtraining.examples.synthetic import DOCUMENT_MIXES, sampled_document_bounds, slash_heavy_index
from megatron_mtraining.planning.workload import natural_index
from megatron_mtraining.sparse import DenseIndex
from megatron_mtraining.sparse.documents import packed_documents

LAYOUTS = ("striped", "balanced", "zigzag", "contiguous")
# The smooth maximum's power: high enough to track the most loaded rank, low enough that
# every rank above the mean pulls.
SEARCH_POWER = 16
# The attended fraction of ``--index natural`` (bench_kernels' and bench_ring_pieces' default).
NATURAL_DENSITY = 0.05


def _works(args, mix: str, gen: torch.Generator) -> tuple[dict, torch.Tensor | None]:
    """The ring work of each pattern for one seed and document mix, and the documents."""
    if args.index == "natural":
        index = natural_index(args.seq_len, args.block, NATURAL_DENSITY, gen, args.heads)
    else:
        index = slash_heavy_index(args.seq_len, args.block, args.heads, gen)
    if mix == "none":
        return {"vertical-slash": ring_work(index)}, None
    cu = sampled_document_bounds(mix, args.seq_len, args.mean_doc, gen)
    docs = packed_documents(cu, args.seq_len)
    return {
        "dense": DenseIndex(1, args.heads, args.seq_len, documents=docs),
        # Every document keeps the synthetic diagonals (its own local lines and far ones).
        "vertical-slash": ring_work(index.within(docs)),
    }, cu


def _search(layout: ContextParallelLayout, tiles: torch.Tensor, proposals: int, seed: int) -> torch.Tensor:
    """``[ranks, steps]`` areas of ``layout``'s stripes (``tiles`` of stripe-sized blocks)
    after ``proposals`` random swaps of two stripes of different ranks, each kept if it lowers
    ``sum_steps (mean_ranks (area / step mean)^p)^(1/p)``: swaps keep every rank's count."""
    w, n = layout.cp_size, tiles.shape[0]
    owner = np.empty(n, dtype=np.int64)
    for r in range(w):
        owner[layout.positions(r)[:: layout.stripe].numpy() // layout.stripe] = r
    q, k = (x.numpy() for x in torch.nonzero(tiles, as_tuple=True))
    area = tiles[q, k].numpy()
    # Each stripe's tiles, as query and as key, by index into (q, k, area).
    by_q, by_k = np.argsort(q, kind="stable"), np.argsort(k, kind="stable")
    q_start, k_start = np.searchsorted(q[by_q], np.arange(n + 1)), np.searchsorted(k[by_k], np.arange(n + 1))

    def touching(s: int) -> np.ndarray:
        return np.concatenate([by_q[q_start[s] : q_start[s + 1]], by_k[k_start[s] : k_start[s + 1]]])

    def cells(t: np.ndarray) -> np.ndarray:
        return owner[q[t]] * w + (owner[q[t]] - owner[k[t]]) % w

    def objective(a: np.ndarray) -> float:
        m = a.mean(0)
        busy = m > 0
        return float((((a[:, busy] / m[busy]) ** SEARCH_POWER).mean(0) ** (1 / SEARCH_POWER)).sum())

    a = np.bincount(cells(np.arange(len(q))), weights=area, minlength=w * w).reshape(w, w)
    best = objective(a)
    rng = np.random.default_rng(seed)
    for x, y in rng.integers(0, n, (proposals, 2)):
        if owner[x] == owner[y]:
            continue
        t = np.unique(np.concatenate([touching(x), touching(y)]))
        moved = a.copy().reshape(-1)
        np.subtract.at(moved, cells(t), area[t])
        owner[x], owner[y] = owner[y], owner[x]
        np.add.at(moved, cells(t), area[t])
        found = objective(moved.reshape(w, w))
        if found < best:
            a, best = moved.reshape(w, w), found
        else:
            owner[x], owner[y] = owner[y], owner[x]
    return torch.from_numpy(a)


def _row(area: torch.Tensor, unit: float) -> tuple[float, ...]:
    """A layout's printed figures from its ``[ranks, steps]`` ring areas: the ring's worker-
    and step-level degrees, the granularity ``unit``, the all-gather's worker-level degree
    (its one sync: the ranks' total areas) and the ring's time degree (``ring_time_degree``)."""
    return (*imbalance_degrees(area), unit, imbalance_degrees(area.sum(1, keepdim=True))[0], ring_time_degree(area))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--cp-size", type=int, default=32)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--documents", nargs="+", default=["none"], choices=("none", *DOCUMENT_MIXES))
    p.add_argument("--mean-doc", type=int, default=2048, help="mean document length of the packed mixes")
    p.add_argument(
        "--index", default="slash-heavy", choices=("slash-heavy", "natural"), help="the vertical-slash index"
    )
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--search", type=int, default=0, help="stripe swaps proposed for the searched layout (0: none)")
    p.add_argument(
        "--node-gather",
        type=int,
        default=0,
        help="ranks a node: also the exchange gathering K/V inside nodes (0: none)",
    )
    args = p.parse_args()
    print(
        f"seq_len={args.seq_len} cp_size={args.cp_size} block={args.block} seeds={args.seeds} "
        f"index={args.index} heads={args.heads}"
    )
    print(
        f"{'documents':<10} {'pattern':<15} {'layout':<22} {'worker-level ID':>18} {'step-level ID':>18}"
        f" {'largest tile / mean cell':>25} {'all-gather ID':>18} {'ring time':>18}"
    )
    for mix in args.documents:
        results: dict = {}
        for seed in range(args.seeds):
            works, cu = _works(args, mix, torch.Generator().manual_seed(seed))
            for pattern, work in works.items():
                tiles = work.block_areas(args.block)
                unit = float(tiles.max() / tiles.sum() * args.cp_size**2)
                for kind in args.layouts:
                    layout = ContextParallelLayout(kind, args.cp_size, args.seq_len, stripe=args.block, documents=cu)
                    area = simulate_ring_areas(work, layout, args.block, tiles)
                    results.setdefault((pattern, kind), []).append(_row(area, unit))
                    if args.node_gather:
                        node_major = ContextParallelLayout(
                            kind,
                            args.cp_size,
                            args.seq_len,
                            stripe=args.block,
                            documents=cu,
                            node_size=args.node_gather,
                        )
                        area = simulate_ring_areas(work, node_major, args.block, tiles, node_size=args.node_gather)
                        results.setdefault((pattern, f"{kind}, node gather"), []).append(_row(area, unit))
                    if kind == "balanced" and args.search:
                        area = _search(layout, tiles, args.search, seed)
                        results.setdefault((pattern, "searched"), []).append(_row(area, unit))
        for (pattern, kind), found in results.items():
            w, s, u, g, t = ([f[i] for f in found] for i in range(5))
            print(
                f"{mix:<10} {pattern:<15} {kind:<22} {min(w):>8.3f} - {max(w):<7.3f} {min(s):>8.3f} - {max(s):<7.3f}"
                f" {min(u):>12.3f} - {max(u):<7.3f} {min(g):>8.3f} - {max(g):<7.3f} {min(t):>8.3f} - {max(t):<7.3f}"
            )


if __name__ == "__main__":
    main()

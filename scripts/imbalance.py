"""Simulated load imbalance of the sparse ring: per-rank, per-step attended area for
each layout, without processes.

    python scripts/imbalance.py [--seq-len 65536] [--cp-size 32] [--block 64] [--seeds 20]
                                [--documents none uniform lognormal one_long] [--mean-doc 2048]

The vertical-slash index is slash-dominated, as in the MTraining paper: per head 8
local block diagonals, 1/16 of the other diagonals at random, 16 sink and 64
scattered vertical columns. Vertical columns run in the local pass (every rank,
balanced), so the ring's work is the tiles (``ring_work``). With packed documents
(``--documents``, drawn by ``examples.synthetic.sampled_document_bounds`` with mean length
``--mean-doc``) the same index is masked to each row's document, and dense attention
becomes block-diagonal causal: both rows are printed per document mix, and the
``balanced`` layout places each sample's stripes by its documents (without documents it is
``striped``). Prints the worker-level and step-level imbalance degrees (max/mean across
ranks in a step, across steps for a rank; 1.0 = balanced), min-max over seeds.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megatron_mtraining.context_parallel import ContextParallelLayout, imbalance_degrees, ring_work, simulate_ring_areas
from megatron_mtraining.examples.synthetic import DOCUMENT_MIXES, sampled_document_bounds, slash_heavy_index
from megatron_mtraining.sparse import DenseIndex
from megatron_mtraining.sparse.documents import packed_documents

LAYOUTS = ("striped", "balanced", "zigzag", "contiguous")


def _works(args, mix: str, gen: torch.Generator) -> tuple[dict, torch.Tensor | None]:
    """The ring work of each pattern for one seed and document mix, and the documents."""
    index = slash_heavy_index(args.seq_len, args.block, args.heads, gen)
    if mix == "none":
        return {"vertical-slash": ring_work(index)}, None
    cu = sampled_document_bounds(mix, args.seq_len, args.mean_doc, gen)
    docs = packed_documents(cu, args.seq_len)
    return {
        "dense": DenseIndex(1, args.heads, args.seq_len, documents=docs),
        # Every document keeps the synthetic diagonals (its own local lines and far ones).
        "vertical-slash": ring_work(
            dataclasses.replace(index, slash=index.slash.unsqueeze(2).expand(-1, -1, docs.count, -1), documents=docs)
        ),
    }, cu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--cp-size", type=int, default=32)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--documents", nargs="+", default=["none"], choices=("none", *DOCUMENT_MIXES))
    p.add_argument("--mean-doc", type=int, default=2048, help="mean document length of the packed mixes")
    args = p.parse_args()
    print(f"seq_len={args.seq_len} cp_size={args.cp_size} block={args.block} seeds={args.seeds}")
    print(f"{'documents':<10} {'pattern':<15} {'layout':<11} {'worker-level ID':>18} {'step-level ID':>18}")
    for mix in args.documents:
        results: dict = {}
        for seed in range(args.seeds):
            works, cu = _works(args, mix, torch.Generator().manual_seed(seed))
            for pattern, work in works.items():
                tiles = work.block_areas(args.block)
                for kind in LAYOUTS:
                    layout = ContextParallelLayout(kind, args.cp_size, args.seq_len, stripe=args.block, documents=cu)
                    found = imbalance_degrees(simulate_ring_areas(work, layout, args.block, tiles))
                    results.setdefault((pattern, kind), []).append(found)
        for (pattern, kind), found in results.items():
            w, s = [f[0] for f in found], [f[1] for f in found]
            print(f"{mix:<10} {pattern:<15} {kind:<11} {min(w):>8.3f} - {max(w):<7.3f} {min(s):>8.3f} - {max(s):<7.3f}")


if __name__ == "__main__":
    main()

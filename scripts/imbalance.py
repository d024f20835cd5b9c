"""Simulated load imbalance of the sparse ring: per-rank, per-step attended area for
each layout, without processes.

    python scripts/imbalance.py [--seq-len 65536] [--cp-size 32] [--block 64] [--seeds 20]

The vertical-slash index is slash-dominated, as in the MTraining paper: per head 8
local block diagonals, 1/16 of the other diagonals at random, 16 sink and 64
scattered vertical columns. Vertical columns run in the local pass (every rank,
balanced), so the ring's work is the tiles (``ring_work``). Prints the worker-level
and step-level imbalance degrees (max/mean across ranks in a step, across steps for a
rank; 1.0 = balanced), min-max over seeds.
"""

from __future__ import annotations

import argparse

import torch

from megatron_mtraining.context_parallel import ContextParallelLayout, imbalance_degrees, ring_work, simulate_ring_areas
from megatron_mtraining.examples.synthetic import slash_heavy_index


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--cp-size", type=int, default=32)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seeds", type=int, default=20)
    args = p.parse_args()
    results = {kind: [] for kind in ("striped", "zigzag", "contiguous")}
    for seed in range(args.seeds):
        work = ring_work(slash_heavy_index(args.seq_len, args.block, args.heads, torch.Generator().manual_seed(seed)))
        for kind, found in results.items():
            layout = ContextParallelLayout(kind, args.cp_size, args.seq_len, stripe=args.block)
            found.append(imbalance_degrees(simulate_ring_areas(work, layout, args.block)))
    print(f"seq_len={args.seq_len} cp_size={args.cp_size} block={args.block} seeds={args.seeds}")
    print(f"{'layout':<11} {'worker-level ID':>18} {'step-level ID':>18}")
    for kind, found in results.items():
        w = [f[0] for f in found]
        s = [f[1] for f in found]
        print(f"{kind:<11} {min(w):>8.3f} - {max(w):<7.3f} {min(s):>8.3f} - {max(s):<7.3f}")


if __name__ == "__main__":
    main()

"""Context-parallel benchmark: sparse ring attention over NCCL (one process per GPU).

    torchrun --nproc_per_node 2 scripts/bench_context_parallel.py [--seq-lens 65536 262144] [--check-len 8192]

Qwen2.5-3B attention shape (16 query heads, 2 KV heads, head dim 128), bf16, causal.
First checks, at ``--check-len``, that each rank's output equals single-GPU
``sparse_attention`` on the whole sequence (sharded). Then, per total length, times
forward and backward (median over iterations, slowest rank) for: the dense ring,
the vertical-slash ring on the striped layout and on the zigzag layout (density
``--density``, the index shape of ``bench_kernels.py``), and reports per-GPU useful
TFLOP/s (attended area only; backward 2.5x forward) and the worker / step imbalance
degrees of the ring's work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import HKV, HQ, D, natural_index  # noqa: E402

from megatron_mtraining.context_parallel import (  # noqa: E402
    ContextParallelLayout,
    RingStats,
    imbalance_degrees,
    ring_attention,
)
from megatron_mtraining.sparse import DenseIndex, sparse_attention  # noqa: E402


def timed(fn, iters: int) -> float:
    """Median ms of ``fn`` on this rank, then the slowest rank's."""
    times = []
    for _ in range(iters + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    t = torch.tensor(sorted(times[1:])[len(times[1:]) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def check(seq: int, rank: int, world: int, gen: torch.Generator) -> float:
    q, k, v = (torch.randn(1, seq, h, D, generator=gen).cuda().bfloat16() for h in (HQ, HKV, HKV))
    index = natural_index(seq, 128, 0.1, gen, "cuda")
    ref, _ = sparse_attention(q, k, v, index)
    layout = ContextParallelLayout("striped", world, seq, stripe=128)
    out, _ = ring_attention(*(layout.shard(t, rank) for t in (q, k, v)), index, layout, None)
    return float((out.float() - layout.shard(ref, rank).float()).abs().max())


def bench(seq: int, kind: str, layout_kind: str, args, rank: int, world: int, gen: torch.Generator) -> dict:
    layout = ContextParallelLayout(layout_kind, world, seq, stripe=128)
    index = (
        DenseIndex(1, HQ, seq, device="cuda") if kind == "dense" else natural_index(seq, 128, args.density, gen, "cuda")
    )
    q, k, v = (
        layout.shard(torch.randn(1, seq, h, D, generator=gen).cuda().bfloat16(), rank).requires_grad_()
        for h in (HQ, HKV, HKV)
    )
    stats = RingStats()
    out, _ = ring_attention(q, k, v, index, layout, None, stats=stats)
    ring_area, local_area = stats.gather()
    grad = torch.randn_like(out)
    fwd = timed(lambda: ring_attention(q, k, v, index, layout, None), args.iters)
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), args.iters)
    area = float(ring_area.sum() + local_area.sum())
    flops_per_gpu = 4 * area * D / world
    worker, step = imbalance_degrees(ring_area)
    return {
        "seq": seq, "attention": kind, "layout": layout_kind, "density": area / (HQ * seq * (seq + 1) / 2),
        "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops_per_gpu": flops_per_gpu / fwd / 1e9,
        "bwd_tflops_per_gpu": 2.5 * flops_per_gpu / bwd / 1e9, "worker_id": worker, "step_id": step,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[65536])
    p.add_argument("--check-len", type=int, default=8192)
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    gen = torch.Generator().manual_seed(0)
    err = check(args.check_len, rank, world, gen)
    rows = []
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}; check at {args.check_len} tokens: "
              f"max |ring - single GPU| = {err:.3e} (bf16)", flush=True)  # fmt: skip
    for seq in args.seq_lens:
        for kind, layout_kind in (("dense", "zigzag"), ("vertical_slash", "striped"), ("vertical_slash", "zigzag")):
            r = bench(seq, kind, layout_kind, args, rank, world, gen)
            rows.append(r)
            if rank == 0:
                print(f"{seq:>7} {kind:<15} {layout_kind:<8} density {r['density']:.4f} fwd {r['fwd_ms']:8.2f} ms "
                      f"({r['fwd_tflops_per_gpu']:6.1f} TF/GPU)  bwd {r['bwd_ms']:8.2f} ms ({r['bwd_tflops_per_gpu']:6.1f})"
                      f"  worker ID {r['worker_id']:.3f} step ID {r['step_id']:.3f}", flush=True)  # fmt: skip
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"check_max_abs_err": err, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Context-parallel benchmark: sparse ring attention over NCCL (one process per GPU).

    torchrun --nproc_per_node N scripts/bench_context_parallel.py [--seq-lens 262144 524288]
        [--inner 2] [--check-len 8192] [--out results.json]

Qwen2.5-3B attention shape (16 query heads, 2 KV heads, head dim 128), bf16, causal.
First checks, at ``--check-len``, that each rank's output equals single-GPU
``sparse_attention`` on the whole sequence (sharded), on the flat and (with
``--inner``) the hierarchical ring. Then, per total length, times forward and
backward (median over iterations, slowest rank) of:

* the dense ring (zigzag, Megatron's layout);
* the vertical-slash ring (density ``--density``, the index of ``bench_kernels.py``)
  on the striped layout, flat, and hierarchical with ``--inner`` GPUs per emulated
  node (inner ring over them, outer ring across the groups);
* the vertical-slash ring on the zigzag layout (flat), for comparison;
* the vertical-slash attention over all-gathered K/V (``kv_exchange="allgather"``, what
  ``auto`` picks on two GPUs), striped;
* with ``--inner``, the vertical-slash attention over K/V gathered inside each emulated node
  and passed round the nodes (``kv_exchange="allgather"`` with the hierarchy,
  ``context_parallel.node_gather``), striped with the ranks numbered node-major;

and reports per-GPU useful TFLOP/s at the slowest rank's time (attended area only,
backward 2.5x forward), the host-device synchronisations of one forward and one
backward (most over ranks, as ``torch.cuda.set_sync_debug_mode`` reports them), the
exposed communication (forward: time the compute stream stood waiting for ring
transfers, slowest rank; backward: wall minus kernel time, an upper bound), and
worker / step imbalance degrees of the attended area and of the measured kernel times.
The vertical-slash rows are compared with the single-GPU kernel on the same index
(``single_*``; per-GPU work is 1/N of it, throughput is comparable), the "85% of
single-GPU" figure: once per isolated call (synchronised before and after, so each call's
host work before its first kernel is exposed), and for the forward also per call of
``--back-to-back`` calls issued without synchronisation, as a model's layers run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

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
from megatron_mtraining.context_parallel.hierarchy import new_hierarchy  # noqa: E402
from megatron_mtraining.sparse import DenseIndex, sparse_attention  # noqa: E402


def slowest(ms: float) -> float:
    t = torch.tensor(ms, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn, iters: int, calls: int = 1) -> float:
    """Median ms per call of ``fn`` on this rank (after one warm-up round), then the slowest
    rank's. Each round issues ``calls`` calls back to back, as a model's layers issue theirs:
    no synchronisation between them, so with more than one, each call's host work (tile tables,
    launches) overlaps the GPU work queued before it."""
    times = []
    for _ in range(iters + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return slowest(sorted(times[1:])[len(times[1:]) // 2])


def synchronisations(fn) -> int:
    """Host-device synchronisations PyTorch reports while ``fn`` runs on this rank (``item``,
    ``nonzero``, device-to-host copies, ...), most over ranks: each one stalls the host
    until the GPU's queue drains, exposing the host work queued behind it."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return int(slowest(sum("synchroniz" in str(w.message) for w in caught)))


def qkv(seq: int, layout: ContextParallelLayout, rank: int, gen: torch.Generator):
    return [
        layout.shard(torch.randn(1, seq, h, D, generator=gen).cuda().bfloat16(), rank).requires_grad_()
        for h in (HQ, HKV, HKV)
    ]


def check(seq: int, rank: int, world: int, hierarchy, gen: torch.Generator) -> dict:
    q, k, v = (torch.randn(1, seq, h, D, generator=gen).cuda().bfloat16() for h in (HQ, HKV, HKV))
    index = natural_index(seq, 128, 0.1, gen, "cuda")
    ref, _ = sparse_attention(q, k, v, index)
    errors = {}
    for name, h, exchange in (
        ("flat", None, "ring"),
        ("allgather", None, "allgather"),
        ("hierarchical", hierarchy, "ring"),
        ("node gather", hierarchy, "allgather"),
    ):
        if name in ("hierarchical", "node gather") and h is None:
            continue
        layout = case_layout(world, seq, h, exchange)
        shards = (layout.shard(t, rank) for t in (q, k, v))
        out, _ = ring_attention(*shards, index, layout, None, hierarchy=h, kv_exchange=exchange)
        errors[name] = slowest(float((out.float() - layout.shard(ref, rank).float()).abs().max()))
    return errors


def single_gpu(seq: int, index, gen: torch.Generator, args) -> tuple[float, float, float]:
    """Forward and backward ms of the single-GPU kernel on the whole sequence, and the
    forward's ms per call back to back."""
    q, k, v = (torch.randn(1, seq, h, D, generator=gen).cuda().bfloat16().requires_grad_() for h in (HQ, HKV, HKV))
    out, _ = sparse_attention(q, k, v, index)
    grad = torch.randn_like(out)
    fwd = timed(lambda: sparse_attention(q, k, v, index), args.iters)
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), args.iters)
    return fwd, bwd, timed(lambda: sparse_attention(q, k, v, index), args.iters, args.back_to_back)


def case_layout(world: int, seq: int, hierarchy, exchange: str, kind: str = "striped") -> ContextParallelLayout:
    """The layout of a case: under the node gather its ranks numbered node-major (nodes of
    the hierarchy's inner size), which balances it."""
    node_size = hierarchy[0].size() if hierarchy is not None and exchange == "allgather" else None
    return ContextParallelLayout(kind, world, seq, stripe=128, node_size=node_size)


def bench(seq, kind, layout_kind, hierarchy, exchange, index, args, rank, world, gen) -> dict:
    layout = case_layout(world, seq, hierarchy, exchange, layout_kind)
    q, k, v = qkv(seq, layout, rank, gen)

    def ring(stats=None):
        return ring_attention(q, k, v, index, layout, None, hierarchy=hierarchy, stats=stats, kv_exchange=exchange)

    out, _ = ring()
    grad = torch.randn_like(out)
    backward = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)  # noqa: E731
    fwd, bwd = timed(ring, args.iters), timed(backward, args.iters)
    fwd_b2b = timed(ring, args.iters, args.back_to_back)
    syncs = synchronisations(ring), synchronisations(backward)
    # One instrumented call: attended areas, kernel times and transfer waits per rank and step.
    stats = RingStats(time_kernels=True)
    out_t, _ = ring(stats)
    torch.autograd.grad(out_t, (q, k, v), grad)
    ring_area, local_area = stats.gather()
    area = float(ring_area.sum() + local_area.sum())
    flops_per_gpu = 4 * area * D / world
    r = {
        "seq": seq, "attention": kind, "layout": layout_kind,
        "ring": exchange if hierarchy is None else f"{'node gather' if exchange == 'allgather' else 'hierarchical'} "
        f"{world // args.inner}x{args.inner}",
        "density": area / (HQ * seq * (seq + 1) / 2), "fwd_ms": fwd, "bwd_ms": bwd, "fwd_ms_back_to_back": fwd_b2b,
        "fwd_tflops_per_gpu": flops_per_gpu / fwd / 1e9, "bwd_tflops_per_gpu": 2.5 * flops_per_gpu / bwd / 1e9,
        "fwd_syncs": syncs[0], "bwd_syncs": syncs[1],
    }  # fmt: skip
    r["worker_id"], r["step_id"] = imbalance_degrees(ring_area)
    if args.profile is not None and layout_kind == "striped" and kind != "dense":
        tag = f"{seq}_{exchange}"
        profile(ring, out, grad, (q, k, v), rank, args.profile, tag)
    for phase in ("fwd", "bwd"):
        step_ms, local_ms, wait_ms = stats.gather_times(phase)
        r[f"{phase}_kernel_worker_id"], r[f"{phase}_kernel_step_id"] = imbalance_degrees(step_ms)
        r[f"{phase}_kernel_ms_max"] = float((step_ms.sum(1) + local_ms).max())
        r[f"{phase}_transfer_wait_ms"] = float(wait_ms.max())
    # The backward's transfer-wait events have summed to more than its wall time on GPUs
    # (docs/benchmarks.md), so its exposed communication is bounded by the non-kernel time.
    r["fwd_exposed_comm_ms"] = r["fwd_transfer_wait_ms"]
    r["bwd_exposed_comm_ms"] = max(0.0, bwd - r["bwd_kernel_ms_max"])
    return r


def profile(ring, out, grad, inputs, rank: int, trace_dir: str, tag: str) -> None:
    """Host and device time per op and named range of one forward and one backward (every
    rank runs them; rank 0 prints, by host time and by device time; every rank writes
    its forward's Chrome trace into ``trace_dir`` if named)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def tables(prof, rows: int) -> None:
        if rank == 0:
            for key in ("cpu_time_total", "self_device_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=rows), flush=True)

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ring()
        torch.cuda.synchronize()
    tables(prof, 30)
    if trace_dir:
        prof.export_chrome_trace(os.path.join(trace_dir, f"ring_fwd_{tag}_rank{rank}.json"))
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(out, inputs, grad, retain_graph=True)
        torch.cuda.synchronize()
    tables(prof, 20)


def report(r: dict) -> None:
    print(
        f"{r['seq']:>7} {r['attention']:<14} {r['layout']:<8} {r['ring']:<16} {r['density']:.4f} "
        f"fwd {r['fwd_ms']:8.2f} ms {r['fwd_tflops_per_gpu']:6.1f} TF/GPU (kernels {r['fwd_kernel_ms_max']:7.2f}, "
        f"exposed comm {r['fwd_exposed_comm_ms']:6.2f})  bwd {r['bwd_ms']:8.2f} ms {r['bwd_tflops_per_gpu']:6.1f} "
        f"(kernels {r['bwd_kernel_ms_max']:7.2f}, non-kernel {r['bwd_exposed_comm_ms']:6.2f})  area ID worker "
        f"{r['worker_id']:.3f} step {r['step_id']:.3f}; kernel-time ID fwd {r['fwd_kernel_worker_id']:.3f}/"
        f"{r['fwd_kernel_step_id']:.3f} bwd {r['bwd_kernel_worker_id']:.3f}/{r['bwd_kernel_step_id']:.3f}; "
        f"syncs fwd {r['fwd_syncs']} bwd {r['bwd_syncs']}"
        + (
            f"; single GPU fwd {r['single_fwd_tflops']:.1f} bwd {r['single_bwd_tflops']:.1f} TF/s -> ring/single "
            f"{r['ring_over_single_fwd']:.2f} / {r['ring_over_single_bwd']:.2f}; forward back to back: ring "
            f"{r['fwd_ms_back_to_back']:.2f} ms, single {r['single_fwd_ms_back_to_back']:.2f} ms -> ring/single "
            f"{r['ring_over_single_fwd_back_to_back']:.2f}"
            if "single_fwd_tflops" in r
            else ""
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[262144])
    p.add_argument("--check-len", type=int, default=8192)
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--inner", type=int, default=None, help="GPUs per emulated node for the hierarchical ring")
    p.add_argument("--dense-max", type=int, default=524288, help="longest total length to time the dense ring at")
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU comparison")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument(
        "--back-to-back", type=int, default=4, help="forward calls issued back to back for the per-call throughput"
    )
    p.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="TRACE_DIR",
        help="print a torch.profiler breakdown of one striped ring call (rank 0), its forward's trace into TRACE_DIR",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if args.inner and world % args.inner:
        raise SystemExit(f"--inner={args.inner} must divide the number of GPUs ({world})")
    # Emulated nodes of --inner consecutive GPUs; one inner ring of all GPUs is the flat ring.
    hierarchy = new_hierarchy(args.inner) if args.inner and args.inner not in (1, world) else None
    gen = torch.Generator().manual_seed(0)
    errors = check(args.check_len, rank, world, hierarchy, gen)
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}; check at {args.check_len} tokens: "
              f"max |ring - single GPU| (bf16) = {errors}", flush=True)  # fmt: skip
    rows = []
    for seq in args.seq_lens:
        sparse = natural_index(seq, 128, args.density, torch.Generator().manual_seed(seq), "cuda")
        cases = [
            ("vertical_slash", "striped", None, "ring"),
            ("vertical_slash", "striped", None, "allgather"),
            ("vertical_slash", "zigzag", None, "ring"),
        ]
        if hierarchy is not None:
            cases.insert(1, ("vertical_slash", "striped", hierarchy, "ring"))
            cases.insert(2, ("vertical_slash", "striped", hierarchy, "allgather"))
        if seq <= args.dense_max:
            cases.insert(0, ("dense", "zigzag", None, "ring"))
        single = None
        if not args.no_single:
            single = single_gpu(seq, sparse, gen, args)
        for kind, layout_kind, h, exchange in cases:
            index = DenseIndex(1, HQ, seq, device="cuda") if kind == "dense" else sparse
            r = bench(seq, kind, layout_kind, h, exchange, index, args, rank, world, gen)
            if single is not None and kind != "dense":
                flops = 4 * float(sparse.attended_area().sum()) * D
                r["single_fwd_ms"], r["single_bwd_ms"], r["single_fwd_ms_back_to_back"] = single
                r["single_fwd_tflops"], r["single_bwd_tflops"] = flops / single[0] / 1e9, 2.5 * flops / single[1] / 1e9
                r["ring_over_single_fwd"] = r["fwd_tflops_per_gpu"] / r["single_fwd_tflops"]
                r["ring_over_single_bwd"] = r["bwd_tflops_per_gpu"] / r["single_bwd_tflops"]
                # Same per-GPU work: the ring does 1/world of the single GPU's in each call.
                r["ring_over_single_fwd_back_to_back"] = (
                    r["single_fwd_ms_back_to_back"] / world / r["fwd_ms_back_to_back"]
                )
            rows.append(r)
            if rank == 0:
                report(r)
        del sparse
        torch.cuda.empty_cache()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"world": world, "inner": args.inner, "check_max_abs_err": errors, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

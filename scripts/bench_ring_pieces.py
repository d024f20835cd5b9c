"""One context-parallel rank's attention work, emulated on one GPU: the kernel time of
each piece (every ring step, the last attending the gathered vertical columns too, as
the ring does; with ``--separate-columns`` the columns as a piece of their own, as the
ring did before; with ``--allgather`` the one piece over the whole sequence's K/V that
``kv_exchange="allgather"`` runs; with ``--node-gather G`` one piece per outer step over a
node's gathered K/V, as the hierarchical ``allgather`` runs on nodes of ``G`` ranks, the layout
numbered node-major) against the single-GPU kernel on the whole sequence, with no process
group and no transfer.

    python scripts/bench_ring_pieces.py [--seq-len 524288] [--cp 2] [--layout striped]
        [--block 128] [--documents MIX [--mean-doc 2048]]
        [--separate-columns | --allgather | --node-gather 8]
        [--link-gbs 300 50 25] [--out r.json]

Same index and shape as ``bench_context_parallel.py`` (16 query heads, 2 KV heads,
head dim 128, bf16, vertical-slash at density ``--density``, on ``--block``-token blocks,
which are also the layout's stripes). With ``--documents`` the sample is packed
(``examples.synthetic.sampled_document_bounds``, mean length ``--mean-doc``) and the same
index is masked to its documents (``VerticalSlashIndex.within``). The pieces run as the
ring runs them: the first piece starts the fp32 running result, each later one adds
into it inside the kernel, the last writes bf16 (the backward likewise for dQ).
``kernel bound`` is (single-GPU time / cp) over the sum of a rank's pieces: the
ring-over-single throughput the 2-GPU benchmark would reach with free, hidden
transfers. The single-GPU time is also split into its tiles and its bars (the index
without vertical columns, and without slash diagonals), which the pieces divide, and
timed with the block-id positions a rank's tile tables carry (``TileTables.query_blocks`` /
``key_blocks``, here every block), which isolates what the positions cost.

When every rank runs on the ring, the worker- and step-level imbalance degrees
(``imbalance_degrees``: max/mean across ranks in a step, across steps for a rank) are
printed for the measured fwd+bwd kernel milliseconds of each (rank, step) piece and for the
attended areas (``simulate_ring_areas``, the figures ``scripts/imbalance.py`` prints): the
load balance a layout reaches in kernel time, beside the model it was built on; and the
ring's time with its transfers at ``--link-gbs`` (``ring_with_transfers``), beside the same
with every step at its mean rank: what balance can still buy once the links are counted.
With many ranks, a small ``--rep-ms`` (10) keeps the run to a few seconds a rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import HKV, HQ, D, natural_index  # noqa: E402

from megatron_mtraining.context_parallel import (  # noqa: E402
    ContextParallelLayout,
    imbalance_degrees,
    ring_sources,
    simulate_ring_areas,
)
from megatron_mtraining.context_parallel.node_gather import node_members  # noqa: E402
from megatron_mtraining.context_parallel.ring import ring_work, vertical_columns  # noqa: E402
from megatron_mtraining.context_parallel.step_index import StepIndex  # noqa: E402
from megatron_mtraining.context_parallel.step_tables import StepTables  # noqa: E402
from megatron_mtraining.examples.synthetic import DOCUMENT_MIXES, sampled_document_bounds  # noqa: E402
from megatron_mtraining.sparse.documents import packed_documents  # noqa: E402
from megatron_mtraining.sparse.index import VerticalSlashPart  # noqa: E402
from megatron_mtraining.sparse.kernels.block_bar.attention import ColumnKeys, kernel_backward, kernel_forward  # noqa: E402
from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables  # noqa: E402


def timed(fn, rep_ms: int) -> float:
    return do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median")


def piece_times(q, k, v, tables, scale, rep_ms, running=None, last=True, columns=None) -> dict:
    """Forward and backward ms of one kernel piece (with ``columns``, attended beside its
    tiles), adding into fp32 running buffers unless it is the ``last`` (then its result is
    written in q's dtype)."""
    out, lse = kernel_forward(q, k, v, tables, scale, columns=columns)
    dout = torch.randn_like(out)
    out_dtype = q.dtype if last else torch.float32
    dq_run = None if running is None else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    fwd = timed(lambda: kernel_forward(q, k, v, tables, scale, running, out_dtype, columns=columns), rep_ms)
    bwd = timed(
        lambda: kernel_backward(q, k, v, tables, scale, out, lse, dout, None, dq_run, out_dtype, columns=columns),
        rep_ms,
    )
    return {"tiles": int(tables.tile_count.sum()), "fwd_ms": fwd, "bwd_ms": bwd}


def rank_pieces(
    q,
    k,
    v,
    index,
    layout: ContextParallelLayout,
    rank: int,
    scale: float,
    rep_ms: int,
    separate_columns: bool,
    node_size: int | None = None,
) -> dict:
    """Kernel times of ``rank``'s pieces, in the ring's order (flat ring), or with ``node_size``
    in the node gather's: one piece per outer step over the K/V of node ``node - o``."""
    dev = q.device
    queries = layout.token_positions(rank, dev)
    q_r = layout.shard(q, rank)
    b, s, h, d = q_r.shape
    running = (torch.zeros(b, s, h, d, device=dev), torch.full((b, h, s), float("-inf"), device=dev))
    pieces = {}
    cols = vertical_columns(index)
    bars = StepIndex(VerticalSlashPart(index, "bars"), queries, cols)
    present = (cols >= 0).view(1, -1, 1, 1)
    k_cols, v_cols = (torch.where(present, x[:, cols.clamp(min=0)], 0) for x in (k, v))
    bar_tables = StepTables(bars.index, queries).of(bars.keys)
    columns = ColumnKeys(k_cols, v_cols, bar_tables)
    if separate_columns:
        pieces["columns"] = piece_times(q_r, k_cols, v_cols, bar_tables, scale, rep_ms, None, last=False)
        columns = None
    steps = StepTables(ring_work(index), queries)
    n_steps = ring_steps(layout.cp_size, node_size)
    sources = ring_sources(n_steps)[rank if node_size is None else rank // node_size].tolist()
    for i, source in enumerate(sources):
        if node_size is None:
            keys = layout.token_positions(source, dev)
        else:
            keys = layout.gathered(node_members(source, node_size), dev).keys
        step_tables = steps.of(keys)
        k_s, v_s = (x.index_select(1, keys.values) for x in (k, v))
        last = i == n_steps - 1
        # The first piece starts the running result: it reads none.
        run = None if i == 0 and not separate_columns else running
        pieces[f"step {i}"] = piece_times(
            q_r, k_s, v_s, step_tables, scale, rep_ms, run, last, columns if last else None
        )
    return pieces


def ring_steps(cp_size: int, node_size: int | None) -> int:
    """A rank's ring steps: one per rank, or with the node gather one per node."""
    return cp_size if node_size is None else cp_size // node_size


def allgather_piece(q, k, v, index, layout: ContextParallelLayout, rank: int, scale: float, rep_ms: int) -> dict:
    """Kernel time of ``rank``'s one piece over the whole sequence's K/V, under one set of
    tile tables, tiles and vertical columns (``kv_exchange="allgather"``)."""
    queries, keys = layout.token_positions(rank, q.device), layout.whole_sequence(q.device)
    whole = StepTables(index, queries).of(keys)
    return {"whole": piece_times(layout.shard(q, rank), k, v, whole, scale, rep_ms)}


def ring_with_transfers(ms: dict, chunk_bytes: int, gbs: float, balanced: bool = False) -> float:
    """A flat ring's ms (forward + backward) if each step waits for its busiest rank (with
    ``balanced``, for the mean of its ranks: what perfect balance would reach) and for its
    transfer at ``gbs`` GB/s, overlapped: the ``chunk_bytes`` of K/V in the forward; those
    and the fp32 dK/dV accumulators (twice as many bytes) in the backward; no K/V after
    the last step."""
    total = 0.0
    for phase, per_chunk in (("fwd", chunk_bytes), ("bwd", 3 * chunk_bytes)):
        compute = ms[phase].mean(0) if balanced else ms[phase].amax(0)
        transfer = torch.full_like(compute, per_chunk / gbs / 1e6)
        transfer[-1] = 2 * chunk_bytes / gbs / 1e6 if phase == "bwd" else 0.0
        total += float(torch.maximum(compute, transfer).sum())
    return total


def balance(
    ranks: dict, index, layout: ContextParallelLayout, block: int, chunk_bytes: int, links: list, node_size=None
) -> dict:
    """Worker- and step-level imbalance degrees of every rank's ring steps, in measured
    kernel time (forward, backward, both) and in attended area, and the ring's time with
    its transfers at each of ``links`` GB/s (``ring_with_transfers``; the flat ring's only:
    the node gather's steps move a node's K/V inside it besides); printed."""
    steps = [f"step {i}" for i in range(ring_steps(layout.cp_size, node_size))]
    ms = {
        ph: torch.tensor([[ranks[r]["pieces"][s][f"{ph}_ms"] for s in steps] for r in sorted(ranks)])
        for ph in ("fwd", "bwd")
    }
    ms["fwd+bwd"] = ms["fwd"] + ms["bwd"]
    areas = simulate_ring_areas(ring_work(index), layout, block, node_size=node_size)
    found = {name: imbalance_degrees(m) for name, m in (*ms.items(), ("area", areas))}
    for name, (worker, step) in found.items():
        print(f"  imbalance ({name:<7}) worker-level {worker:.3f}  step-level {step:.3f}")
    total = float(ms["fwd+bwd"].sum())
    busiest = float(ms["fwd+bwd"].amax(0).sum())
    print(f"  ring kernels: {total:.2f} ms over all pieces; {busiest:.2f} ms if each step waits for its busiest rank")
    timed_links = {}
    for gbs in links if node_size is None else ():
        timed_links[gbs] = [ring_with_transfers(ms, chunk_bytes, gbs, balanced) for balanced in (False, True)]
        print(
            f"  with transfers at {gbs:g} GB/s: {timed_links[gbs][0]:.2f} ms; with every step at its mean rank "
            f"{timed_links[gbs][1]:.2f} ms"
        )
    return {"degrees": found, "total_ms": total, "synchronised_ms": busiest, "with_transfers_ms": timed_links}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=524288)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--layout", default="striped", choices=("striped", "balanced", "zigzag"))
    p.add_argument("--block", type=int, default=128, help="the index's block and the layout's stripe")
    p.add_argument("--documents", default=None, choices=DOCUMENT_MIXES, help="pack the sample's documents")
    p.add_argument("--mean-doc", type=int, default=2048, help="mean document length of --documents")
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--ranks", type=int, nargs="*", default=None, help="ranks to emulate (default: all)")
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--separate-columns", action="store_true", help="the columns as a piece of their own")
    p.add_argument("--allgather", action="store_true", help="one piece over the whole K/V (kv_exchange='allgather')")
    p.add_argument(
        "--node-gather",
        type=int,
        default=None,
        help="ranks a node: one piece per outer step over a node's K/V (the hierarchical allgather)",
    )
    p.add_argument(
        "--link-gbs",
        type=float,
        nargs="*",
        default=[300.0, 50.0, 25.0],
        help="link speeds (GB/s) to time the ring's steps with their transfers at (NVLink, NDR, HDR)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    seq, dev = args.seq_len, torch.device("cuda")
    block = args.block
    index = natural_index(seq, block, args.density, torch.Generator().manual_seed(seq), dev)
    gen = torch.Generator().manual_seed(0)
    cu = None
    if args.documents:
        cu = sampled_document_bounds(args.documents, seq, args.mean_doc, gen)
        index = index.within(packed_documents(cu.to(dev), seq))
    q, k, v = (torch.randn(1, seq, h, D, generator=gen).to(dev, torch.bfloat16) for h in (HQ, HKV, HKV))
    scale = D**-0.5
    no_columns = dataclasses.replace(index, vertical=torch.full_like(index.vertical[..., :1], -1))
    no_slash = dataclasses.replace(index, slash=torch.full_like(index.slash[..., :1], -1))
    single = {
        name: piece_times(q, k, v, tile_tables(ix), scale, args.rep_ms)
        for name, ix in (("whole", index), ("tiles", no_columns), ("bars", no_slash))
    }
    blocks = torch.arange(seq // block, device=dev, dtype=torch.int32)
    with_ids = dataclasses.replace(tile_tables(index), query_blocks=blocks, key_blocks=blocks)
    single["positions"] = piece_times(q, k, v, with_ids, scale, args.rep_ms)
    packed = "" if cu is None else f", {len(cu) - 1} {args.documents} documents (mean {args.mean_doc})"
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {seq} tokens{packed}, cp {args.cp} "
        f"{args.layout}, block {block}"
    )
    for name, r in single.items():
        print(f"  single GPU, {name:<9} fwd {r['fwd_ms']:8.2f}  bwd {r['bwd_ms']:8.2f} ms  ({r['tiles']} tiles)")
    layout = ContextParallelLayout(args.layout, args.cp, seq, stripe=block, documents=cu, node_size=args.node_gather)
    result = {"seq": seq, "cp": args.cp, "layout": args.layout, "block": block, "device": torch.cuda.get_device_name(),
              "documents": None if cu is None else cu.tolist(), "separate_columns": args.separate_columns,
              "allgather": args.allgather, "node_gather": args.node_gather, "single": single, "ranks": {}}  # fmt: skip
    ranks = args.ranks if args.ranks is not None else range(args.cp)
    for rank in ranks:
        if args.allgather:
            pieces = allgather_piece(q, k, v, index, layout, rank, scale, args.rep_ms)
        else:
            pieces = rank_pieces(
                q, k, v, index, layout, rank, scale, args.rep_ms, args.separate_columns, args.node_gather
            )
        total = {ph: sum(r[f"{ph}_ms"] for r in pieces.values()) for ph in ("fwd", "bwd")}
        bound = {ph: single["whole"][f"{ph}_ms"] / args.cp / total[ph] for ph in ("fwd", "bwd")}
        result["ranks"][rank] = {"pieces": pieces, "total": total, "kernel_bound": bound}
        for name, r in pieces.items():
            print(f"  rank {rank} {name:<8} fwd {r['fwd_ms']:8.2f}  bwd {r['bwd_ms']:8.2f} ms  ({r['tiles']} tiles)")
        print(
            f"  rank {rank} total    fwd {total['fwd']:8.2f}  bwd {total['bwd']:8.2f} ms; kernel bound on "
            f"ring / single: fwd {bound['fwd']:.3f}, bwd {bound['bwd']:.3f}",
            flush=True,
        )
    if sorted(ranks) == list(range(args.cp)) and not args.allgather:
        chunk_bytes = 2 * k.numel() // args.cp * k.element_size()  # a rank's K and V
        result["imbalance"] = balance(
            result["ranks"], index, layout, block, chunk_bytes, args.link_gbs, args.node_gather
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Bounds on MSA's main-branch kernel in its two loop orders, counted from a selection on the CPU.

    python scripts/msa_loop_orders.py [--seq-len 131072] [--msa-index structured|untrained]
                                      [--tile-tokens 8 16 32 64 128] [--hbm-tbs 3.35] [--l2-chunk 256]
                                      [--dense-tflops 502.8 565.7] [--triton-tflops 367.9 372.5]
                                      [--out bounds.json]

Builds an MSA selection as ``bench_kernels.py``'s MSA rows do (Qwen2.5-3B's heads, top-16
blocks of 128, the structured index by default, on a seed of its own; a few minutes at 128K
on two cores) and counts, with no attention run, what each loop order must do for it:

* **Q-outer** (a program per tile of ``T`` query tokens x the ``G`` heads of a group, walking
  the union of the tokens' selected blocks and masking each row to its own, as
  ``block_bar`` does on ``block_topk_tables``): the computed area (union blocks x block x
  ``T`` x ``G``) and the useful share of it. Its useful rate is at most that share times
  a dense kernel's rate on full tiles.
* **KV-outer** (``kv_outer``, the shipped order: a program per key block and the queries
  that chose it, ``block_m // G`` tokens a tile; the forward's per-slot partials merged
  afterwards, the backward's dQ partials summed afterwards), with the launch defaults and
  query chunks of ``kv_outer.attention``: its tiles and items (``reverse_index.work_list``)
  and the bytes every pass moves: each selection gathers its token's ``G`` query rows (and
  dO in the backward) and writes a partial in 16 bits, which the merge (the slot sums) reads
  back; each item reads its block's K/V (and adds to the fp32 dK/dV sums).

It prints the useful FLOPs (``bench_kernels``' convention: forward ``4 * area * d`` over the
query heads, backward 2.5x) and, as shares of cuDNN's dense rate (``--dense-tflops``,
forward and backward; defaults: the H100 figures of docs/benchmarks.md, "Issues 21 and 22 on
an H100"), the most each design can reach:

* KV-outer with every byte through HBM once a use (``--hbm-tbs``, default the H100 SXM's
  3.35 TB/s): time at least bytes / bandwidth;
* KV-outer whatever the caches hold of the gathered queries: the merge (slot sums) runs
  after the attention kernel, over partials the size of which no cache holds, so time is
  at least the tile products at a dense kernel's rate plus the merge's bytes from HBM
  (shown at cuDNN's rate and at the project's Triton dense kernel's, ``--triton-tflops``);
* KV-outer on query chunks of ``--l2-chunk`` tokens whose partials are merged while the
  cache still holds them (a design not built: it would need the merge inside the attention
  kernel, by whichever program writes a token's last slot): time at least its computed pairs
  (smaller chunks fill fewer tiles) at a dense rate, or the bytes that still reach HBM
  (gathers, K/V once an item, the output), whichever is longer; forward only, since the
  backward's dK/dV sums grow with the items that small chunks add;
* Q-outer at tile ``T``: the useful share times the dense rate (cuDNN's, Triton's).

These are ceilings of designs, not measurements: the measured rates are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import HKV, HQ, D, msa_index_inputs, structured_qk  # noqa: E402

from megatron_mtraining.sparse import msa_select_blocks  # noqa: E402
from megatron_mtraining.sparse.kernels.kv_outer import attention as kv  # noqa: E402
from megatron_mtraining.sparse.kernels.kv_outer.reverse_index import reverse_index, work_list  # noqa: E402

BF16 = 2
FP32 = 4


def q_outer_areas(blocks: torch.Tensor, n_blocks: int, block: int, group: int, tile_tokens: int) -> int:
    """(query, key) pairs a Q-outer kernel computes over ``blocks [1, S, Hs, k]`` (``-1``
    padded) with tiles of ``tile_tokens`` tokens x ``group`` heads: every tile's union of
    selected blocks, whole, for every row of the tile."""
    _, s, hs, k = blocks.shape
    tiles = -(-s // tile_tokens)
    padded = torch.full((tiles * tile_tokens, hs, k), -1, dtype=torch.long)
    padded[:s] = blocks[0]
    chosen = padded.view(tiles, tile_tokens, hs, k).permute(0, 2, 1, 3).reshape(tiles, hs, -1)
    hit = torch.zeros(tiles, hs, n_blocks + 1, dtype=torch.bool)
    hit.scatter_(2, torch.where(chosen < 0, n_blocks, chosen), True)
    union = hit[..., :n_blocks].sum(-1)
    return int(union.sum()) * block * tile_tokens * group


def kv_outer_counts(blocks: torch.Tensor, seq: int, block: int, l2_chunk: int) -> dict:
    """Tiles, items and bytes of the KV-outer forward and backward at the launch defaults,
    and of the forward on query chunks of ``l2_chunk`` tokens (``fwd_l2``)."""
    _, _, hs, k = blocks.shape
    group = HQ // hs
    n_blocks = -(-seq // block)
    q_meta = torch.empty((1, seq, HQ, D), dtype=torch.bfloat16, device="meta")
    selections = int((blocks >= 0).sum())
    rows = selections * group  # (token, head, slot) rows: each gathers one query row
    out = {"selections": selections}
    for name, cfg_name, chunk in (
        ("fwd", "fwd", kv.query_chunk("fwd", q_meta, k)),
        ("bwd", "bwd", kv.query_chunk("bwd", q_meta, k)),
        ("fwd_l2", "fwd", l2_chunk),
    ):
        cfg = kv.DEFAULTS[cfg_name]
        block_m, block_n = kv.tile_shape(cfg, D, torch.bfloat16, block, group)
        rev = reverse_index(blocks.int(), HKV, n_blocks, chunk)
        work = work_list(rev, block_m // group, max(1, cfg.tiles_per_item // (block // block_n)))
        tiles = int((work.tiles[:, 1] > 0).sum())
        items = int((work.items[:, 2] > 0).sum())
        kv_bytes = items * 2 * block * D * BF16
        if cfg_name == "fwd":
            gathers = rows * D * BF16
            partials = rows * (D * BF16 + FP32)  # bf16 partial and its fp32 LSE
            merge = partials + blocks.numel() * FP32 + seq * HQ * (D * BF16 + FP32)
            attention = gathers + partials + kv_bytes
        else:
            gathers = rows * (2 * D * BF16 + 2 * FP32)  # q, dO, LSE, delta
            partials = rows * D * BF16  # bf16 dQ slots (kv.dq_slot_dtype)
            merge = partials + blocks.numel() * FP32 + seq * HQ * D * BF16
            sums = items * 2 * block * D * FP32 * 2  # dK/dV fp32 sums read and written
            delta = seq * HQ * D * BF16 * 2 + seq * HQ * FP32
            attention = gathers + partials + kv_bytes + sums + delta
        out[name] = {
            "chunk_tokens": chunk,
            "tile_rows": block_m,
            "tiles": tiles,
            "items": items,
            "computed_pairs": tiles * block_m * block,
            "attention_bytes": attention,
            "merge_bytes": merge,
            "gather_bytes": gathers,
            "partial_bytes": partials,
            # What reaches HBM if the partials never leave the cache: gathers, K/V, the output.
            "without_partials_bytes": attention - partials + merge - partials,
        }
    return out


def bounds(useful_area: int, counts: dict, q_outer: dict, args) -> dict:
    """Each design's ceiling as a share of cuDNN's useful rate, forward and backward."""
    flops = {"fwd": 4 * useful_area * D, "bwd": 2.5 * 4 * useful_area * D}
    bw = args.hbm_tbs * 1e12
    out = {}
    for i, name in enumerate(("fwd", "bwd")):
        cudnn, triton = args.dense_tflops[i] * 1e12, args.triton_tflops[i] * 1e12
        c = counts[name]
        all_hbm = (c["attention_bytes"] + c["merge_bytes"]) / bw
        merge = c["merge_bytes"] / bw
        if name == "fwd":
            # Partials merged while the cache holds them (not built): the computed pairs at a
            # dense rate, or the bytes that still reach HBM, whichever is longer.
            l2 = counts["fwd_l2"]
            products = 4 * l2["computed_pairs"] * D
            hbm = l2["without_partials_bytes"] / bw
            l2_bounds = {f"kv_outer_l2_partials_{rate_name}": flops[name] / max(products / rate, hbm) / cudnn
                         for rate_name, rate in (("cudnn", cudnn), ("triton", triton))}  # fmt: skip
        else:
            l2_bounds = dict.fromkeys(("kv_outer_l2_partials_cudnn", "kv_outer_l2_partials_triton"), float("nan"))
        out[name] = {
            "useful_tflop": flops[name] / 1e12,
            "kv_outer_all_hbm": flops[name] / all_hbm / cudnn,
            "kv_outer_cudnn_tiles_then_merge": flops[name] / (flops[name] / cudnn + merge) / cudnn,
            "kv_outer_triton_tiles_then_merge": flops[name] / (flops[name] / triton + merge) / cudnn,
            **l2_bounds,
            **{f"q_outer_T{t}_cudnn": share for t, share in q_outer.items()},
            **{f"q_outer_T{t}_triton": share * triton / cudnn for t, share in q_outer.items()},
        }
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--msa-index", choices=("structured", "untrained"), default="structured")
    p.add_argument("--tile-tokens", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--hbm-tbs", type=float, default=3.35, help="HBM bandwidth, TB/s")
    p.add_argument("--l2-chunk", type=int, default=256, help="query chunk of the cache-resident forward")
    p.add_argument("--dense-tflops", type=float, nargs=2, default=[502.8, 565.7], help="cuDNN fwd, bwd")
    p.add_argument("--triton-tflops", type=float, nargs=2, default=[367.9, 372.5], help="our dense kernel fwd, bwd")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    seq = args.seq_len
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    q_idx, k_idx, config = msa_index_inputs(*structured_qk(seq, gen, device="cpu"), gen, args.msa_index)
    index = msa_select_blocks(q_idx, k_idx, config, HQ)
    blocks = index.blocks
    print(f"selection: {args.msa_index} index, {seq} tokens, top-{config.topk} blocks of {config.block_size} "
          f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    useful = int(index.attended_area().sum())
    group = HQ // blocks.shape[2]
    n_blocks = -(-seq // config.block_size)
    print(f"useful pairs {useful:.4e} (density {useful / (HQ * seq * (seq + 1) / 2):.4f} of causal)")

    q_outer = {}
    print(f"{'Q-outer tile tokens':>20} {'rows':>5} {'computed pairs':>15} {'useful share':>13}")
    for t in args.tile_tokens:
        computed = q_outer_areas(blocks, n_blocks, config.block_size, group, t)
        q_outer[t] = useful / computed
        print(f"{t:>20} {t * group:>5} {computed:>15.4e} {q_outer[t]:>13.3f}")

    counts = kv_outer_counts(blocks, seq, config.block_size, args.l2_chunk)
    print(f"KV-outer: {counts['selections']} selections (token, group, block)")
    for name in ("fwd", "bwd", "fwd_l2"):
        c = counts[name]
        print(f"  {name}: chunks of {c['chunk_tokens']} tokens, {c['tiles']} tiles of {c['tile_rows']} rows "
              f"({useful / c['computed_pairs']:.3f} of their pairs useful), {c['items']} items; "
              f"GB: gathers {c['gather_bytes'] / 1e9:.2f}, partials {c['partial_bytes'] / 1e9:.2f}, "
              f"attention kernel {c['attention_bytes'] / 1e9:.2f}, merge {c['merge_bytes'] / 1e9:.2f}")  # fmt: skip

    result = bounds(useful, counts, q_outer, args)
    print(f"ceilings as a share of cuDNN's useful rate ({args.dense_tflops[0]} / {args.dense_tflops[1]} TFLOP/s), "
          f"HBM {args.hbm_tbs} TB/s, Triton dense {args.triton_tflops[0]} / {args.triton_tflops[1]}:")  # fmt: skip
    print(f"  {'design':<40} {'fwd':>6} {'bwd':>6}")
    for key in result["fwd"]:
        if key != "useful_tflop":
            print(f"  {key:<40} {result['fwd'][key]:>6.3f} {result['bwd'][key]:>6.3f}")
    print(f"  useful TFLOP: fwd {result['fwd']['useful_tflop']:.3f}, bwd {result['bwd']['useful_tflop']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "useful_pairs": useful, "q_outer_useful_share": q_outer,
                       "kv_outer": counts, "ceilings": result}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

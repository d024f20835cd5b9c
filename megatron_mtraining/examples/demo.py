"""Sparse attention on synthetic long-context data: every pattern against dense.

    python -m megatron_mtraining.examples.demo [--seq-len 4096] [--device cpu|cuda] ...

Queries and keys share a per-head mean direction and carry RoPE, the structure
that makes trained LLM attention local (slash lines) with attention sinks
(vertical lines). For each attention type the demo prints the attended fraction
of the causal area, the share of the last queries' dense attention mass the
index keeps (recall), the relative error of the sparse output against dense
attention on those queries, and the forward + backward time.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from ..sparse import (
    DenseIndex,
    IndexBranch,
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    attention_recall,
    build_moba_index,
    build_vertical_slash_index,
    msa_kl_loss,
    msa_select_blocks,
    sparse_attention,
)
from .synthetic import rope


def synthetic_inputs(args, generator):
    b, s, hq, hkv, d, hidden = 1, args.seq_len, args.heads, args.kv_heads, args.head_dim, args.hidden
    dev = args.device

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dev)

    x = randn(b, s, hidden)
    mean = randn(1, 1, hkv, d) * 1.5
    k = mean + randn(b, s, hkv, d)
    q = mean.repeat_interleave(hq // hkv, dim=2) + randn(b, s, hq, d)
    k[:, : args.sinks] = mean * 4  # attention sinks: keys every query likes
    q, k = rope(q), rope(k)
    v = randn(b, s, hkv, d)
    dtype = getattr(torch, args.dtype)
    return x, q.to(dtype), k.to(dtype), v.to(dtype)


def dense_rows(q, k, v, rows: int):
    """Dense causal attention of the last ``rows`` queries, fp32."""
    s, hq, hkv = q.shape[1], q.shape[2], k.shape[2]
    pos = torch.arange(s - rows, s, device=q.device)
    kk, vv = (t.float().repeat_interleave(hq // hkv, dim=2) for t in (k, v))
    logits = torch.einsum("bqhd,bkhd->bhqk", q[:, -rows:].float(), kk) / math.sqrt(q.shape[-1])
    logits.masked_fill_(torch.arange(s, device=q.device).view(1, -1) > pos.view(-1, 1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(logits, -1), vv)


def run(args) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)  # the index branch's initialisation
    x, q, k, v = synthetic_inputs(args, gen)
    b, s, hq, _ = q.shape
    msa_cfg = MSAConfig(block_size=args.msa_block, topk=args.msa_topk, index_head_dim=args.head_dim)
    branch = IndexBranch(args.hidden, args.kv_heads, msa_cfg).to(args.device)
    q_idx, k_idx = branch(x)
    builders = {
        "dense": lambda: DenseIndex(b, hq, s, device=q.device),
        "mtraining": lambda: build_vertical_slash_index(
            q, k, VerticalSlashConfig(vertical_topp=args.topp, slash_topp=args.topp, block_size=args.block)
        ),
        "msa": lambda: msa_select_blocks(q_idx, k_idx, msa_cfg, hq),
        "moba": lambda: build_moba_index(q, k, MoBAConfig(chunk_size=args.moba_chunk, topk=args.moba_topk)),
    }
    reference = dense_rows(q, k, v, args.rows)
    results = []
    for name in args.patterns:
        start = time.perf_counter()
        index = builders[name]()
        built = time.perf_counter()
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = sparse_attention(qg, kg, vg, index)
        out.float().square().mean().backward()
        done = time.perf_counter()
        tail = out[:, -args.rows :].float()
        row = {
            "attention": name,
            "density": index.density(),
            "recall": attention_recall(q, k, index, num_rows=args.rows).mean().item(),
            "rel_error": ((tail - reference).norm() / reference.norm()).item(),
            "index_s": built - start,
            "fwd_bwd_s": done - built,
        }
        if name == "msa":
            row["kl"] = msa_kl_loss(q, k, q_idx, k_idx, index).item()
        results.append(row)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256, help="hidden size feeding the MSA index branch")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--topp", type=float, default=0.9, help="MTraining vertical and slash top-p")
    p.add_argument("--block", type=int, default=64, help="MTraining block size")
    p.add_argument("--msa-block", type=int, default=64)
    p.add_argument("--msa-topk", type=int, default=8)
    p.add_argument("--moba-chunk", type=int, default=256)
    p.add_argument("--moba-topk", type=int, default=4)
    p.add_argument("--rows", type=int, default=64, help="last queries used for recall and error")
    p.add_argument("--patterns", nargs="+", default=["dense", "mtraining", "msa", "moba"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = set(args.patterns) - {"dense", "mtraining", "msa", "moba"}
    if unknown:
        p.error(f"--patterns: unknown {sorted(unknown)}; accepted: dense, mtraining, msa, moba")

    print(
        f"seq_len={args.seq_len} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
        f"dtype={args.dtype} device={args.device}"
    )
    print(f"{'attention':<10} {'density':>8} {'recall':>8} {'rel_err':>9} {'index_s':>8} {'fwd+bwd_s':>10}  notes")
    for r in run(args):
        note = f"KL(main || untrained index) = {r['kl']:.3f}" if "kl" in r else ""
        print(
            f"{r['attention']:<10} {r['density']:>8.4f} {r['recall']:>8.4f} {r['rel_error']:>9.2e} "
            f"{r['index_s']:>8.3f} {r['fwd_bwd_s']:>10.3f}  {note}"
        )


if __name__ == "__main__":
    main()

"""The KV-outer kernels' query chunks: time and peak memory per chunk setting (one GPU).

    python scripts/bench_chunks.py [--seq 131072] [--merge-chunks 0 128 256 512 1024]
                                   [--attention-shares 0.16 0.32 0.64 1.0 1.5 2.0]
                                   [--kl-shares 0.16 0.32 0.5 1.0 2.0] [--out chunks.json]

The forward (``forward``, first): per ``--merge-chunks`` value as
``kv_outer.attention.FWD_MERGE_CHUNK`` (0: each chunk's slots merged by a kernel of their
own; else the attention's items ordered by query chunks of that many tokens and each token
merged by the tile that writes its last slot), the forward of ``KVOuterAttention`` on the
MSA index below: median time, each kernel's device time, peak memory above the inputs, and
the largest difference of output and LSE from the separate merge's. An empty list skips a
part (``--attention-shares --kl-shares`` times the forward alone).

The KV-outer backward streams query chunks whose slot buffers take a share of q's bytes
(``kv_outer.attention.CHUNKS``, and the KL's ``msa_kl.kv_loss.CHUNKS``): a smaller share
keeps the kernel's peak memory down, a larger one runs fewer, fuller launches. For each
share, set in place of the default for the sweep:

* ``attention``: the backward of ``KVOuterAttention`` on ``bench_kernels.py``'s MSA index
  (structured, k 16, blocks of 128, Qwen2.5-3B's attention shape, bf16) for a random output
  gradient: the chunk length and count, the median time (``triton.testing.do_bench``), each
  kernel's device time per call, and the peak memory above the forward's tensors;
* ``kl``: the KV-outer KL's index LSE (``lse``) and whole backward (``bwd``) on
  ``bench_msa_kl.py``'s top-k index (CUDA events, median of 7), each with its peak memory.

The default shares are those of docs/benchmarks.md, "The KV-outer backward's chunks".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

import bench_kernels as bk
import bench_msa_kl as bm
import torch

from megatron_mtraining.sparse import msa_select_blocks
from megatron_mtraining.sparse.kernels.kv_outer import attention as kv
from megatron_mtraining.sparse.kernels.msa_kl import kv_loss


def peak_extra_mib(fn) -> float:
    """Peak memory of a call of ``fn`` above what was allocated before it, MiB (after a warm call)."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@contextlib.contextmanager
def share_of(chunks: dict, name: str, share: float):
    """``chunks[name]`` (a ``CHUNKS`` table's entry) at ``share`` of q's bytes inside the block."""
    old = chunks[name]
    chunks[name] = dataclasses.replace(old, buffer_share=share)
    try:
        yield
    finally:
        chunks[name] = old


def msa_problem(seq: int):
    """q, k, v (bf16, Qwen2.5-3B's attention shape) and ``bench_kernels.py``'s MSA index."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, seq, h, bk.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (bk.HQ, bk.HKV, bk.HKV)
    )
    q_idx, k_idx, config = bk.msa_index_inputs(*bk.structured_qk(seq, gen), gen)
    return q, k, v, msa_select_blocks(q_idx, k_idx, config, bk.HQ)


def forward_rows(seq: int, merge_chunks: list[int]) -> list[dict]:
    """The KV-outer forward per ``kv.FWD_MERGE_CHUNK`` (0: the separate merge kernel), its
    output against the separate merge's."""
    if not merge_chunks:
        return []
    q, k, v, index = msa_problem(seq)
    old = kv.FWD_MERGE_CHUNK

    def forward():
        return kv.KVOuterAttention.apply(q, k, v, index, bk.D**-0.5)

    rows = []
    try:
        kv.FWD_MERGE_CHUNK = 0
        want, want_lse = forward()
        for merge_chunk in merge_chunks:
            kv.FWD_MERGE_CHUNK = merge_chunk
            out, lse = forward()
            diff = max((out.float() - want.float()).abs().max().item(), (lse - want_lse).abs().max().item())
            extra = peak_extra_mib(forward)
            ms = bk.timed(forward, 400)
            kernels = bk.device_times(forward, calls=3)
            row = {"part": "attention-fwd", "merge_chunk": merge_chunk, "ms": ms, "max_abs_diff": diff,
                   "kernels_ms": {key: t for t, _, key in kernels}, "peak_extra_mib": extra}  # fmt: skip
            rows.append(row)
            top = ", ".join(f"{key[:24]} {t:.2f}" for t, _, key in kernels[:3])
            print(f"attention fwd merge chunk {merge_chunk:5d}: {ms:7.2f} ms  peak +{extra:6.0f} MiB  "
                  f"max |diff| {diff:.1e}  [{top}]", flush=True)  # fmt: skip
    finally:
        kv.FWD_MERGE_CHUNK = old
    return rows


def attention_rows(seq: int, shares: list[float]) -> list[dict]:
    if not shares:
        return []
    q, k, v, index = msa_problem(seq)
    out = kv.KVOuterAttention.apply(q, k, v, index, bk.D**-0.5)[0]
    grad = torch.randn_like(out)

    def backward():
        return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    rows = []
    for share in shares:
        with share_of(kv.CHUNKS, "bwd", share):
            extra = peak_extra_mib(backward)
            ms = bk.timed(backward, 400)
            kernels = bk.device_times(backward, calls=3)
            chunk = kv.query_chunk("bwd", q, index.blocks.shape[-1])
        row = {"part": "attention-bwd", "share": share, "chunk": chunk, "chunks": -(-seq // chunk), "ms": ms,
               "kernels_ms": {key: t for t, _, key in kernels}, "peak_extra_mib": extra}  # fmt: skip
        rows.append(row)
        top = ", ".join(f"{key[:24]} {t:.2f}" for t, _, key in kernels[:3])
        print(f"attention bwd share {share:5.2f}: chunk {chunk:6d} ({row['chunks']:3d} chunks) {ms:7.2f} ms"
              f"  peak +{extra:6.0f} MiB  [{top}]", flush=True)  # fmt: skip
    return rows


def kl_rows(seq: int, shares: list[float]) -> list[dict]:
    if not shares:
        return []
    prepared = bm.prepared(seq, torch.Generator().manual_seed(3))
    index, _, _, tensors, lse, attention = next(v for name, v in prepared.items() if name != "dense")
    calls = bm.kv_outer_calls(index, tensors, lse, attention)
    rows = []
    for part in ("lse", "bwd"):
        for share in shares:
            with share_of(kv_loss.CHUNKS, part, share):
                extra = peak_extra_mib(calls["kv-" + part])
                ms = bm.events_ms(calls["kv-" + part], 7)
            rows.append({"part": f"kl-{part}", "share": share, "ms": ms, "peak_extra_mib": extra})
            print(f"kl {part} share {share:5.2f}: {ms:7.2f} ms  peak +{extra:6.0f} MiB", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--attention-shares", type=float, nargs="*", default=[0.16, 0.32, 0.64, 1.0, 1.5, 2.0])
    p.add_argument("--kl-shares", type=float, nargs="*", default=[0.16, 0.32, 0.5, 1.0, 2.0])
    p.add_argument("--merge-chunks", type=int, nargs="*", default=[0, 128, 256, 512, 1024])
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_chunks.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  seq {args.seq}")
    rows = forward_rows(args.seq, args.merge_chunks) + attention_rows(args.seq, args.attention_shares)
    rows += kl_rows(args.seq, args.kl_shares)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

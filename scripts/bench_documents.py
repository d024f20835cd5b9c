"""Packed documents on one GPU: document-masked attention against the same attention
unmasked and against a library's varlen kernel.

    python scripts/bench_documents.py [--seq-len 131072] [--mean 8192] [--mix lognormal] [--block 64]
        [--kernels] [--out DIR]

One packed sample of ``--seq-len`` tokens whose documents follow ``--mix`` (``examples.synthetic
.sampled_document_bounds``) with mean length ``--mean``; Qwen2.5-3B's attention shape (16 query heads,
2 KV heads, head dim 128, bf16). Forward and backward medians (``triton.testing.do_bench``) of:

* cuDNN dense causal attention with no document mask (the unpacked yardstick);
* PyTorch's varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``) on the documents,
  where this PyTorch has it: the library answer for document-masked dense attention;
* the plugin's dense attention with and without the documents (``DenseIndex``);
* the plugin's vertical-slash attention with and without the documents, its index built from
  the inputs (``build_vertical_slash_index`` with ``--block``-token blocks, the tiles the
  balanced ring's stripes need to match; per document with ``cu_seqlens``: every sparse
  document's statistics in one batched pass, ``document_statistics_from_parts``, then one
  selection for all), the build timed apart; and the whole-sequence index with the
  documents' mask (the same lists, like for like). The first build of another packing (which
  captures its CUDA graph, as a training step's first layer does) is timed apart. The
  per-document index is checked against each sparse document's index built alone (printed:
  how many of them have the same lists).

The plugin's rows run its Triton kernels (``backend="triton"``: ``auto`` sends a dense index
without documents to SDPA). Each row's tile tables are built once, timed apart ("tables"), and
kept for the index, so its forward and backward times are the kernels' alone (as in training,
where the index build keeps its tables and the forward and backward share them).

``--kernels`` also prints, for the vertical-slash rows (the whole-sequence lists unmasked and
under the documents' mask, the like-for-like pair, and the per-document index), each kernel's
device time in the forward and in the backward (torch profiler), side by side: where the
mask's cost lands, and the per-document index's; and each index build's kernels, whose
device time against the build's median says how much of the build waits on the host.

The q/k carry RoPE over a shared mean direction, so vertical-slash statistics are local as in
trained models. Prints a table and writes ``DIR/bench_documents.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import device_times, profile_kernels  # noqa: E402

from megatron_mtraining.examples.synthetic import DOCUMENT_MIXES, rope, sampled_document_bounds  # noqa: E402
from megatron_mtraining.sparse import DenseIndex, VerticalSlashConfig, build_vertical_slash_index, sparse_attention  # noqa: E402
from megatron_mtraining.sparse.documents import packed_documents  # noqa: E402
from megatron_mtraining.sparse.index import INT32_MAX, VerticalSlashIndex  # noqa: E402
from megatron_mtraining.sparse.kernels.block_bar.tables import keep_tables, tile_tables, vertical_slash_tables  # noqa: E402
from megatron_mtraining.sparse.vertical_slash import dense_where_cheaper, uncovered_columns  # noqa: E402

HQ, HKV, D = 16, 2, 128


def timed(fn, rep_ms: int) -> float:
    return do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


def fwd_bwd(forward, inputs, rep_ms: int) -> tuple[float, float]:
    fwd = timed(lambda: forward(*inputs), rep_ms)
    out = forward(*inputs)
    grad = torch.randn_like(out)
    bwd = timed(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), rep_ms)
    return fwd, bwd


def fresh_tables(index):
    """The index's tile tables built now (``tile_tables`` returns those the build kept)."""
    return vertical_slash_tables(index) if isinstance(index, VerticalSlashIndex) else tile_tables(index)


def sample_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that fix the sample (``scripts/document_tiles.py`` counts the same one)."""
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--mean", type=int, default=8192)
    p.add_argument("--mix", default="lognormal", choices=DOCUMENT_MIXES)
    p.add_argument("--seed", type=int, default=0)


def sample(args, device) -> tuple[torch.Tensor, ...]:
    """(document bounds, q, k, v in bf16) on ``device``, from ``args.seed``'s generator."""
    gen = torch.Generator().manual_seed(args.seed)
    seq = args.seq_len
    cu = sampled_document_bounds(args.mix, seq, args.mean, gen)
    mean = torch.randn(1, 1, HKV, D, generator=gen) * 1.5
    k = rope((mean + torch.randn(1, seq, HKV, D, generator=gen)).to(device))
    q = rope((mean.repeat_interleave(HQ // HKV, 2) + torch.randn(1, seq, HQ, D, generator=gen)).to(device))
    v = torch.randn(1, seq, HKV, D, generator=gen).to(device)
    return cu.to(device), *(t.to(torch.bfloat16) for t in (q, k, v))


def cudnn_dense(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
    return out.transpose(1, 2)


def varlen_flash(cu_seqlens: torch.Tensor, longest: int):
    """Causal varlen FlashAttention over the documents, in the call this PyTorch takes (the
    keyword for causality and GQA changed across releases); None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def run(q, k, v):
        if not gqa:
            k, v = (t.repeat_interleave(HQ // HKV, 2) for t in (k, v))
        extra = {"enable_gqa": True} if gqa else {}
        return varlen_attn(q[0], k[0], v[0], cu_seqlens, cu_seqlens, longest, longest, **causal, **extra)[None]

    return run


def kernel_split(indexes: dict, q, k, v, scale) -> dict:
    """Per index (name -> index, tables kept): each kernel's device ms in one forward and in
    one backward; printed side by side, the kernels in the first index's order."""
    split = {}
    for name, index in indexes.items():
        forward = lambda i=index: sparse_attention(q, k, v, i, scale, backend="triton")[0]  # noqa: E731
        out = forward()
        grad = torch.randn_like(out)
        backward = lambda o=out, g=grad: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)  # noqa: E731
        split[name] = {
            phase: {key: ms for ms, _, key in device_times(fn, calls=5)}
            for phase, fn in (("forward", forward), ("backward", backward))
        }
    names = list(split)
    for phase in ("forward", "backward"):
        keys = list(dict.fromkeys(key for name in names for key in split[name][phase]))
        print(f"{phase} kernels, device ms per call: " + " | ".join(names))
        for key in keys:
            cells = " | ".join(f"{split[name][phase].get(key, 0.0):8.3f}" for name in names)
            print(f"  {key[:60]:<60} {cells}")
        totals = " | ".join(f"{sum(split[name][phase].values()):8.3f}" for name in names)
        print(f"  {'total':<60} {totals}")
    return split


@torch.no_grad()
def documents_alone_agree(q, k, config, scale, index) -> tuple[int, int]:
    """How many of the sparse documents have the lists, in the per-document ``index``, of the
    index built on the document alone (``q[:, a:b]``, ``k[:, a:b]``; its columns less those
    its tiles cover on the sequence's block grid, ``uncovered_columns``; a head's whole
    triangle where that costs no more, ``dense_where_cheaper``), of how many."""
    same = sparse = 0
    bounds = index.documents.bounds
    for m, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if b - a < config.dense_below:
            continue
        sparse += 1
        alone = build_vertical_slash_index(q[:, a:b], k[:, a:b], config, scale)
        bs, span = config.block_size, (b - 1) // config.block_size - a // config.block_size + 1
        listed = torch.where(alone.vertical >= 0, alone.vertical + a, INT32_MAX).unsqueeze(2)
        alone_slash = F.pad(alone.slash, (0, max(0, span - alone.slash.shape[-1])), value=-1).unsqueeze(2)
        alone_columns = uncovered_columns(listed, alone_slash, torch.tensor([b], device=q.device), bs)
        if config.dense_if_cheaper:
            first, spans = (torch.tensor([x], device=q.device) for x in (a // bs, span))
            alone_columns, alone_slash = dense_where_cheaper(alone_columns, alone_slash, first, spans, bs)
        columns = [c[(c >= a) & (c < b)] for c in index.vertical[0]]
        same += all(
            torch.equal(c, w[(w >= a) & (w < b)]) for c, w in zip(columns, alone_columns[0, :, 0], strict=True)
        ) and all(
            torch.equal(d[d >= 0], w[w >= 0]) for d, w in zip(index.slash[0, :, m], alone_slash[0, :, 0], strict=True)
        )
    return same, sparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sample_arguments(p)
    p.add_argument("--rep-ms", type=int, default=150)
    p.add_argument("--block", type=int, default=64, help="the vertical-slash index's block (its kernels' tile)")
    p.add_argument("--kernels", action="store_true", help="per-kernel device times of the vertical-slash rows")
    p.add_argument("--out", default="runs/bench_documents")
    args = p.parse_args()
    seq = args.seq_len
    cu, *qkv = sample(args, "cuda")
    lengths = (cu[1:] - cu[:-1]).tolist()
    docs = packed_documents(cu, seq)
    q, k, v = (t.requires_grad_() for t in qkv)
    scale = D**-0.5
    rows: list[dict] = []

    def record(name, forward, area, index=None):
        try:
            tables = None
            if index is not None:  # the tables apart, then kept: the kernels read them, as in training
                tables = timed(lambda: fresh_tables(index), args.rep_ms)
                keep_tables(index, fresh_tables(index))
            fwd, bwd = fwd_bwd(forward, (q, k, v), args.rep_ms)
        except Exception as err:  # a library kernel this build lacks: say so, keep going
            rows.append({"name": name, "error": f"{type(err).__name__}: {err}"[:300]})
            print(f"{name:<40} failed: {rows[-1]['error']}")
            return
        rows.append({"name": name, "fwd_ms": fwd, "bwd_ms": bwd, "area": area, "tables_ms": tables})
        extra = "" if tables is None else f"  tables {tables:6.3f} ms"
        print(f"{name:<40} fwd {fwd:9.2f} ms  bwd {bwd:9.2f} ms  fwd+bwd {fwd + bwd:9.2f} ms  area {area:.4g}{extra}")

    causal = HQ * seq * (seq + 1) / 2
    packed = HQ * sum(n * (n + 1) / 2 for n in lengths)
    print(f"seq {seq}, {len(lengths)} documents ({args.mix}, mean {seq / len(lengths):.0f}, longest {max(lengths)})")
    record("cudnn dense, no document mask", cudnn_dense, causal)
    flash = varlen_flash(cu, max(lengths))
    if flash is None:
        rows.append({"name": "varlen flash (torch)", "error": "torch.nn.attention.varlen is missing"})
    else:
        record("varlen flash (torch), documents", flash, packed)
    dense = DenseIndex(1, HQ, seq, device=q.device)
    dense_docs = DenseIndex(1, HQ, seq, device=q.device, documents=docs)
    for name, index, area in (("no document mask", dense, causal), ("documents", dense_docs, packed)):
        record(
            f"ours dense, {name}",
            lambda a, b, c, i=index: sparse_attention(a, b, c, i, scale, backend="triton")[0],
            area,
            index,
        )
    config = VerticalSlashConfig(block_size=args.block)
    builds = {}
    split_indexes = {}  # the vertical-slash rows' indexes, for --kernels
    for name, bounds in (("vertical-slash, no document mask", None), ("vertical-slash, documents", cu)):
        with torch.no_grad():
            index = build_vertical_slash_index(q, k, config, scale, cu_seqlens=bounds)
            builds[name] = timed(lambda b=bounds: build_vertical_slash_index(q, k, config, scale, cu_seqlens=b), 100)
            if bounds is not None:  # another packing's first build captures its graph (a step's first layer)
                other = sampled_document_bounds(args.mix, seq, args.mean, torch.Generator().manual_seed(args.seed + 1))
                other = other.to(q.device)
                torch.cuda.synchronize()
                start = time.perf_counter()
                build_vertical_slash_index(q, k, config, scale, cu_seqlens=other)
                torch.cuda.synchronize()
                first = (time.perf_counter() - start) * 1e3
        area = float(index.attended_area().sum())
        record(
            f"ours {name}",
            lambda a, b, c, i=index: sparse_attention(a, b, c, i, scale, backend="triton")[0],
            area,
            index,
        )
        rows[-1]["index_build_ms"] = builds[name]
        split_indexes["unmasked" if bounds is None else "per-document index"] = index
        print(f"{'':<40} index build {builds[name]:.2f} ms (its tables included: it keeps them)")
        if bounds is not None:
            rows[-1]["new_packing_build_ms"] = first
            print(f"{'':<40} a new packing's first build (captures its graph) {first:.2f} ms")
        if args.kernels:  # device time against the build's median: the rest is the host's
            rows[-1]["index_build_device_ms"] = profile_kernels(
                lambda b=bounds: build_vertical_slash_index(q, k, config, scale, cu_seqlens=b),
                f"{name} index build, GPU time per kernel",
                top=20,
            )
        if bounds is not None:
            same, sparse = documents_alone_agree(q, k, config, scale, index)
            rows[-1]["documents_equal_alone"] = [same, sparse]
            print(f"{'':<40} {same} of {sparse} sparse documents' lists equal their index built alone")
        if bounds is None:
            # Like for like: the same lists with the documents' mask, which only removes work.
            masked = index.within(docs)
            record(
                "ours vertical-slash, same index, documents",
                lambda a, b, c, i=masked: sparse_attention(a, b, c, i, scale, backend="triton")[0],
                float(masked.attended_area().sum()),
                masked,
            )
            split_indexes["documents' mask"] = masked
    os.makedirs(args.out, exist_ok=True)
    result = {"seq_len": seq, "mix": args.mix, "mean": args.mean, "block": args.block, "documents": lengths, "rows": rows,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    if args.kernels:
        result["kernel_ms"] = kernel_split(split_indexes, q, k, v, scale)
    with open(os.path.join(args.out, "bench_documents.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

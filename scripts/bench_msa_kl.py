"""MSA's fused KL kernels (``sparse/kernels/msa_kl``) timed on one GPU, with a config sweep.

    python scripts/bench_msa_kl.py [--seq 131072] [--sweep] [--configs "dq:32,64,8,2;fused:32,128,8,1" ...]
                                   [--kl-order both|union|kv-outer] [--kv-configs "bwd:64,128,8,1,8" ...]
                                   [--teacher-stages 0 2 ...] [--documents N] [--runs 5]
                                   [--check-seq 4096] [--out kl.json]

Qwen2.5-3B's attention shape (16 query heads, 2 KV heads, head dim 128), index head dim
128, bf16, batch 1, random RoPE-free inputs. Two indices: the dense warmup index
(causal, every tile) and MSA top-k (block 128, k 16, selected by ``msa_select_blocks``
from structured index queries/keys, so neighbouring rows pick similar blocks, as a
trained indexer does; union-of-tiles tables). The main LSE is the sparse forward's on the
same index (the teacher is normalised as in training). Per config (``MTRAINING_KL_CONFIG``
syntax, see ``msa_kl.loss.parse_configs``; the empty config is the built-in table) and
index it times ``_index_lse_kernel`` (``lse``) and both forms of the backward (median of
``--runs`` runs, CUDA events): the two passes ``_dq_kl_kernel`` (``dq``) and
``_dk_kl_kernel`` (``dk``), which deterministic mode runs, and the one pass
``_dk_kl_kernel`` with ``FUSE_DQ`` (``fused``: dq_idx and the KL rows by atomics, zeroing
and the cast of dq_idx included), which runs otherwise; ``dq+dk`` is the two passes' sum,
printed beside it. They go against cuDNN's dense causal forward (SDPA, ``enable_gqa``) of
the same layer, the yardstick. Before timing a config it checks, at ``--check-seq`` tokens
on both indices, dq_idx / dk_idx / the KL value of both forms against ``msa_kl_loss``
(PyTorch, fp32 of the same values): a config outside tolerance is reported WRONG; one that
fails to compile or launch is reported with its error.

``--kl-order`` picks the loop orders timed on the top-k index: the union of tiles (the
kernels above; the dense index has no other) and KV-outer (``msa_kl.kv_loss``, what
``dispatch.kl_kernel`` picks for a top-k index as sparse as 128K's): ``kv-lse`` (reverse
index, work list, per-slot LSEs and their merge) and ``kv-bwd`` (reverse index, work lists,
dk_idx, dq_idx and the KL terms, the slot sums: the whole backward, to set beside the
union's dq + dk), each checked as above at ``--check-seq`` tokens; and beside them the
KV-outer attention's backward alone (``attn-bwd``, for a random output gradient) and with
the KL run after each of its query chunks on the teacher it stored (``joint-bwd``,
``msa_kl.kv_attention``: what training runs, against ``attn-bwd`` + ``kv-bwd``; its KL
checked as above). ``MTRAINING_KL_TEACHER`` does not apply: both are timed. ``--kv-configs`` sets its
launch parameters (``pass:block_m,block_n,num_warps,num_stages,tiles_per_item`` for the
passes ``lse``, ``bwd``, ``dq``, ``;``-separated; '' = its defaults), one timing per string.
``--teacher-stages`` times each of those with the teacher's head loop (where a kernel
recomputes it: the union's dq, dk and fused, KV-outer's kv-bwd) unrolled (0) or pipelined
over that many stages (``msa_kl.kernels._teacher``), in both orders.

``--documents N`` packs ``N`` documents into each sequence (the timed one and the checked
one; ``documents_of``): both indices carry them (the top-k one selected within them), so the
main pass and the KL kernels mask each row by its document start. The KV-outer order takes
no documents, so it needs ``--kl-order union``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_mtraining.sparse import (
    BlockTopKIndex,
    DenseIndex,
    MSAConfig,
    msa_kl_loss,
    msa_select_blocks,
    packed_documents,
    sparse_attention,
)
from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables
from megatron_mtraining.sparse.kernels.kv_outer import attention as kv
from megatron_mtraining.sparse.kernels.kv_outer.attention import PassConfig
from megatron_mtraining.sparse.kernels.msa_kl import kv_attention, kv_loss, loss
from megatron_mtraining.sparse.kernels.shared import arch
from megatron_mtraining.training.allocator import use_expandable_segments

HQ, HKV, D, DI, BLOCK, TOPK = 16, 2, 128, 128, 128, 16
# The training step's allocator, before any CUDA allocation.
use_expandable_segments()

# Built-in sweep: "" is the default table; the others vary rows, key steps, warps, stages.
SWEEP = [
    "",
    "dq:16,64,4,2;dk:64,64,8,1;fused:32,128,8,1",
    "dq:32,128,8,2;dk:64,128,8,1;fused:64,128,8,1",
    "dq:64,64,8,2;dk:64,64,8,2;fused:64,64,8,1",
    "dq:32,64,4,3;dk:32,64,4,2;fused:32,64,4,2",
    "dq:64,128,8,1;dk:128,64,8,1;fused:128,64,8,1",
]


def inputs(seq: int, gen: torch.Generator):
    """q, k, v, q_idx, k_idx in bf16 on the GPU; index queries/keys share a mean direction
    per group (structured, so top-k selections of neighbouring rows overlap)."""
    mean = torch.randn(1, 1, HKV, DI, generator=gen)

    def t(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = t(1, seq, HQ, D), t(1, seq, HKV, D), t(1, seq, HKV, D)
    q_idx = mean + t(1, seq, HKV, DI)
    k_idx = mean.mean(2, keepdim=True) + t(1, seq, 1, DI)
    return [x.to(torch.bfloat16).cuda() for x in (q, k, v, q_idx, k_idx)]


def documents_of(seq: int, n: int | None, device) -> torch.Tensor | None:
    """``cu_seqlens`` of ``n`` documents of about ``seq / n`` tokens, each boundary 37 tokens
    past a multiple of ``seq // n``, so documents start inside a block; None for one."""
    if not n or n < 2:
        return None
    cuts = [i * (seq // n) + 37 for i in range(1, n)]
    return torch.tensor([0, *cuts, seq], dtype=torch.int32, device=device)


def indices(q_idx, k_idx, seq, cu_seqlens=None):
    documents = packed_documents(cu_seqlens, seq, q_idx.device)
    config = MSAConfig(BLOCK, TOPK, DI)
    return {
        "dense": DenseIndex(1, HQ, seq, device=q_idx.device, documents=documents),
        f"top-k k{TOPK} b{BLOCK}": msa_select_blocks(q_idx.float(), k_idx.float(), config, HQ, cu_seqlens),
    }


def events_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def prepared(seq, gen, documents=None):
    """Per index: (index, tables, the kernels' arguments, inputs, the main LSE, (v, the main
    output, a random output gradient)) for the KL of the mean over rows; ``documents``: how
    many packed documents (``documents_of``)."""
    q, k, v, q_idx, k_idx = inputs(seq, gen)
    dout = torch.randn(q.shape, generator=gen).to(q)
    out = {}
    for name, index in indices(q_idx, k_idx, seq, documents_of(seq, documents, q.device)).items():
        main_out, lse = sparse_attention(q, k, v, index, backend="triton")
        tables = tile_tables(index, dense_block=BLOCK)
        lse_idx = loss.index_lse(q_idx, k_idx, tables)
        grad = torch.ones(1, device=q.device)
        args = loss.kl_arguments(q, k, lse, q_idx, k_idx, lse_idx, tables, D**-0.5, grad, seq * HKV)
        out[name] = (index, tables, args, (q, k, q_idx, k_idx), lse, (v, main_out, dout))
    return out


def kv_outer_calls(index, tensors, lse, attention) -> dict:
    """The KV-outer order's closures on a top-k index: the KL's index LSE (``kv-lse``) and
    whole backward (``kv-bwd``), the attention's backward alone (``attn-bwd``) and with the
    KL on its teacher (``joint-bwd``); the KL ones return (dq_idx, dk_idx, per-row KL)."""
    q, k, q_idx, k_idx = tensors
    v, out, dout = attention
    q_bytes = q.numel() * q.element_size()
    lse_idx = kv_loss.kv_index_lse(q_idx, k_idx, index, q_bytes)
    grad = torch.ones(1, device=q.device)
    rows = q.shape[1] * HKV
    problem = kv._Problem.of(q, k, v, index, D**-0.5)
    joint = (q, k, v, out, lse, dout, q_idx, k_idx, lse_idx, index, D**-0.5, grad, rows)
    return {
        "kv-lse": lambda: kv_loss.kv_index_lse(q_idx, k_idx, index, q_bytes),
        "kv-bwd": lambda: kv_loss.kv_kl_backward(q, k, lse, q_idx, k_idx, lse_idx, index, D**-0.5, grad, rows),
        "attn-bwd": lambda: kv.kv_outer_backward(problem, out, lse, dout, None),
        "joint-bwd": lambda: kv_attention.kv_outer_msa_backward(*joint)[3:],
    }


def _errors(name, q, k, q_idx, k_idx, index, dq, dk, kl) -> tuple[bool, list[str]]:
    qi, ki = (t.detach().float().clone().requires_grad_() for t in (q_idx, k_idx))
    ref = msa_kl_loss(q.float(), k.float(), qi, ki, index)
    ref.backward()
    value = kl.sum() / (q.shape[1] * HKV)
    worst, ok = [], True
    for what, got, want in (("dq_idx", dq, qi.grad), ("dk_idx", dk, ki.grad)):
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        worst.append(f"{name} {what} {err:.1e}")
        ok &= math.isfinite(err) and err < 6e-2
    err = abs(value.item() - ref.item()) / max(abs(ref.item()), 1e-6)
    worst.append(f"{name} value {err:.1e}")
    ok &= math.isfinite(err) and err < 2e-2
    return ok, worst


def check(small, orders) -> tuple[bool, str]:
    """dq_idx, dk_idx and the KL value of the current config against msa_kl_loss (fp32), in
    each of ``orders`` that serves the index."""
    worst = []
    ok = True
    for name, (index, _, args, tensors, lse, attention) in small.items():
        if "union" in orders:
            dq, kl = loss.kl_dq(args)
            for form, outputs in (("two-pass", (dq, loss.kl_dk(args), kl)), ("fused", loss.kl_fused(args))):
                good, errs = _errors(f"{name} {form}", *tensors, index, *outputs)
                ok &= good
                worst += errs
        if "kv-outer" in orders and isinstance(index, BlockTopKIndex):
            calls = kv_outer_calls(index, tensors, lse, attention)
            for form in ("kv-bwd", "joint-bwd"):
                good, errs = _errors(f"{name} {form}", *tensors, index, *calls[form]())
                ok &= good
                worst += errs
    return ok, ", ".join(worst)


def kv_overrides(text: str) -> dict[str, PassConfig]:
    try:
        return kv_loss.parse_overrides(text)
    except ValueError as err:
        raise SystemExit(f"--kv-configs: {err}") from None


def cudnn_forward_ms(seq, gen, runs) -> float:
    q, k, v = (x.transpose(1, 2) for x in inputs(seq, gen)[:3])
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return events_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--sweep", action="store_true", help="run --configs, or the built-in list")
    parser.add_argument("--configs", nargs="*", default=None, help="MTRAINING_KL_CONFIG strings ('' = defaults)")
    parser.add_argument("--kl-order", choices=("both", "union", "kv-outer"), default="both")
    parser.add_argument("--kv-configs", nargs="*", default=[""], help="KV-outer launch parameters ('' = defaults)")
    parser.add_argument(
        "--teacher-stages",
        nargs="*",
        type=int,
        default=None,
        help="stages of the teacher's head loop (default: built-in)",
    )
    parser.add_argument("--documents", type=int, default=None, help="packed documents per sequence")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--check-seq", type=int, default=4096)
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args()
    if args.documents and args.kl_order != "union":
        parser.error(f"--documents {args.documents} takes --kl-order union (the KV-outer kernels take no documents)")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    configs = (
        args.configs if args.configs is not None else (SWEEP if args.sweep else [os.environ.get(loss.CONFIG_ENV, "")])
    )
    gen = torch.Generator().manual_seed(0)
    shape = {"hq": HQ, "hkv": HKV, "d": D, "d_idx": DI, "block": BLOCK, "topk": TOPK}
    results = {"seq": args.seq, "documents": args.documents, "shape": shape}
    try:
        results["cudnn_dense_forward_ms"] = cudnn_forward_ms(args.seq, gen, args.runs)
    except Exception as e:  # noqa: BLE001
        results["cudnn_dense_forward_ms"] = None
        print(f"cuDNN forward FAILED: {type(e).__name__}: {e}")
    print(f"seq {args.seq}: cuDNN dense causal forward {results['cudnn_dense_forward_ms']} ms (the yardstick)")
    small = prepared(args.check_seq, gen, args.documents)
    big = prepared(args.seq, gen, args.documents)
    for name, (_, tables, *_) in big.items():
        print(f"  {name}: {int(tables.tile_count.sum())} query-block x tile pairs")
    orders = ("union", "kv-outer") if args.kl_order == "both" else (args.kl_order,)
    results["kl_orders"] = list(orders)
    rows = []
    print(f"{'config':<34} {'index':<16} {'kernel':<7} {'ms':>9}  check")
    # (union config, KV-outer config, the order timed): each order's configs in turn.
    runs = [(c, "", "union") for c in configs] if "union" in orders else []
    runs += [("", kc, "kv-outer") for kc in args.kv_configs] if "kv-outer" in orders else []
    built_in = {loss: loss.TEACHER_STAGES, kv_loss: kv_loss.TEACHER_STAGES}
    stages = args.teacher_stages or [None]
    for (config, kv_config, order), teacher_stages in ((r, t) for r in runs for t in stages):
        for module, value in built_in.items():
            module.TEACHER_STAGES = value if teacher_stages is None else teacher_stages
        os.environ[loss.CONFIG_ENV] = config
        kv_loss.OVERRIDES.clear()
        kv_loss.OVERRIDES.update(kv_overrides(kv_config))
        label = (config or "(defaults)") if order == "union" else f"kv-outer {kv_config or '(defaults)'}"
        if teacher_stages is not None:
            label += f" heads@{teacher_stages}"
        entry = {
            "teacher_stages": {"union": loss.TEACHER_STAGES, "kv-outer": kv_loss.TEACHER_STAGES},
            "config": config,
            "kv_config": kv_config,
            "order": order,
            "effective": {n: vars(loss.launch_config(n, BLOCK)) for n in loss.DEFAULT_CONFIGS},
            "kv_effective": {
                n: vars(kv_loss.OVERRIDES.get(n, c))
                for n, c in kv_loss.pass_defaults(arch.major(torch.device("cuda"))).items()
            },
        }
        try:
            entry["ok"], entry["check"] = check(small, (order,))
        except Exception as e:  # noqa: BLE001
            entry.update(ok=False, check=f"FAILED: {type(e).__name__}: {e}"[:300])
            print(f"{label:<34} {entry['check']}")
            rows.append(entry)
            continue
        print(f"{label:<34} check at {args.check_seq}: {'ok' if entry['ok'] else 'WRONG'} ({entry['check']})")
        for name, (index, tables, kargs, tensors, lse, attention) in big.items():
            _, _, q_idx, k_idx = tensors
            calls = []
            if order == "union":
                calls += [
                    ("lse", lambda q_idx=q_idx, k_idx=k_idx, tables=tables: loss.index_lse(q_idx, k_idx, tables)),
                    ("dq", lambda kargs=kargs: loss.kl_dq(kargs)),
                    ("dk", lambda kargs=kargs: loss.kl_dk(kargs)),
                    ("fused", lambda kargs=kargs: loss.kl_fused(kargs)),
                ]
            if order == "kv-outer" and isinstance(index, BlockTopKIndex):
                calls += list(kv_outer_calls(index, tensors, lse, attention).items())
            for kernel, fn in calls:
                try:
                    ms = events_ms(fn, args.runs)
                except Exception as e:  # noqa: BLE001
                    ms = None
                    entry.setdefault("errors", []).append(f"{name} {kernel}: {type(e).__name__}: {e}"[:300])
                entry[f"{name} {kernel} ms"] = ms
                shown = f"{ms:9.2f}" if ms is not None else "   FAILED"
                print(f"{label:<34} {name:<16} {kernel:<7} {shown}  {'ok' if entry['ok'] else 'WRONG'}")
            for kind, parts, beside in (
                ("union", ("dq", "dk"), "the two passes, beside fused"),
                ("kv-outer", ("attn-bwd", "kv-bwd"), "attention and KL apart, beside joint-bwd"),
            ):
                times = [entry.get(f"{name} {kernel} ms") for kernel in parts]
                if order == kind and f"{name} {parts[0]} ms" in entry and None not in times:
                    entry[f"{name} {'+'.join(parts)} ms"] = sum(times)
                    print(f"{label:<34} {name:<16} {'+'.join(parts):<7} {sum(times):9.2f}  ({beside})")
        rows.append(entry)
        if args.out:  # after each config, so a timeout keeps what ran
            with open(args.out, "w") as f:
                json.dump({**results, "rows": rows}, f, indent=1)
    os.environ.pop(loss.CONFIG_ENV, None)
    kv_loss.OVERRIDES.clear()
    for module, value in built_in.items():
        module.TEACHER_STAGES = value
    results["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

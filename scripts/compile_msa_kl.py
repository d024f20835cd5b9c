"""MSA's KL kernels compiled ahead of time for A100 (sm80) and H100/H200 (sm90), no GPU needed.

    python scripts/compile_msa_kl.py [--arch 80 90] [--launch lse dq dk fused] [--index dense top-k]
                                     [--dtype bf16|fp16|fp32] [--head-dim 128] [--group 8]
                                     [--documents] [--out resources.json]

Each launch of the union-of-tiles KL (``index_lse``, the two passes ``kl_dq`` / ``kl_dk`` and
the one pass ``kl_fused``, on the dense warmup index and on a top-k index) is captured from
the real launch path, run on small CPU tensors of the given shape with the launch table as it
stands (``MTRAINING_KL_CONFIG`` honoured), and compiled by Triton for each target. Printed per
launch and target: shared memory, registers, spill stack, and whether the shared memory fits
the GPU (sm80: an A100's 163 KiB a block; sm90: an H100's 227 KiB). Exit status 1 when one
does not: the users' clusters are A100s as well as H100s, so a launch table is checked here
before a GPU sweep picks from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_mtraining.sparse import DenseIndex, MSAConfig, msa_select_blocks, packed_documents
from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables
from megatron_mtraining.sparse.kernels.msa_kl import loss

# Largest dynamic shared memory a block may opt in to (CUDA programming guide, compute
# capabilities 8.0 and 9.0).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POINTER = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.bool: "*i1",
}
KERNELS = ("_index_lse_kernel", "_dq_kl_kernel", "_dk_kl_kernel")
LAUNCHES = ("lse", "dq", "dk", "fused")


class _Capture:
    """Stands in for a kernel in ``loss``'s namespace: records each launch instead of running it."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _case(dtype, head_dim: int, group: int, documents: bool, seq: int = 512, block: int = 128):
    """Inputs, and the dense and top-k indexes' tile tables, of a one-sample case with two KV
    groups; with ``documents``, three packed documents starting inside blocks."""
    gen = torch.Generator().manual_seed(0)
    hkv, d_idx = 2, 128
    q = torch.randn(1, seq, hkv * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, seq, hkv, head_dim, generator=gen).to(dtype)
    q_idx = torch.randn(1, seq, hkv, d_idx, generator=gen).to(dtype)
    k_idx = torch.randn(1, seq, 1, d_idx, generator=gen).to(dtype)
    cu_seqlens = torch.tensor([0, seq // 4 + 37, seq // 2 + 37, seq], dtype=torch.int32) if documents else None
    dense = DenseIndex(1, hkv * group, seq, documents=packed_documents(cu_seqlens, seq, q.device))
    topk = msa_select_blocks(q_idx.float(), k_idx.float(), MSAConfig(block, 2, d_idx), hkv * group, cu_seqlens)
    return (q, k, q_idx, k_idx), {
        "dense": tile_tables(dense, dense_block=block),
        "top-k": tile_tables(topk, dense_block=block),
    }


def captured_launches(dtype, head_dim: int, group: int, documents: bool) -> list[tuple[str, str, object, tuple, dict]]:
    """(launch, index, kernel, args, kwargs) of every launch of the KL kernels' entry points."""
    (q, k, q_idx, k_idx), tables = _case(dtype, head_dim, group, documents)
    seq, hq = q.shape[1], q.shape[2]
    lse = torch.zeros(1, hq, seq)
    out = []
    saved = {name: getattr(loss, name) for name in KERNELS}
    try:
        for index, table in tables.items():
            for launch in LAUNCHES:
                launches: list = []
                for name in KERNELS:
                    setattr(loss, name, _Capture(saved[name], launches))
                if launch == "lse":
                    loss.index_lse(q_idx, k_idx, table)
                else:
                    args = loss.kl_arguments(
                        q, k, lse, q_idx, k_idx, lse[:, :2], table, 1 / math.sqrt(head_dim), torch.ones(1), seq
                    )
                    {"dq": loss.kl_dq, "dk": loss.kl_dk, "fused": loss.kl_fused}[launch](args)
                out += [(launch, index, fn, a, kw) for fn, a, kw in launches]
    finally:
        for name, fn in saved.items():
            setattr(loss, name, fn)
    return out


def _signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of a captured launch, specialised as Triton's
    launcher does by default: pointers and integers divisible by 16 marked so."""
    kwargs = dict(kwargs)
    options = {"num_warps": kwargs.pop("num_warps", 4), "num_stages": kwargs.pop("num_stages", 3)}
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    return signature, constexprs, attrs, options


def resources(fn, args: tuple, kwargs: dict, arch: int) -> dict:
    """Shared memory (bytes), registers and spill stack of one launch compiled for ``arch``."""
    signature, constexprs, attrs, options = _signature(fn, args, kwargs)
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True)
    fields = dict(item.split(":", 1) for line in usage.stdout.splitlines() if "REG:" in line for item in line.split())
    shared = compiled.metadata.shared
    return {
        "shared_bytes": shared,
        "fits": shared <= SHARED_LIMIT[arch],
        "registers": int(fields["REG"]),
        "spill_stack_bytes": int(fields["STACK"]),
        "num_warps": options["num_warps"],
        "num_stages": options["num_stages"],
        "block_m": kwargs.get("BLOCK_M"),
        "block_n": kwargs.get("BLOCK_N"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_LIMIT))
    p.add_argument("--launch", nargs="+", default=list(LAUNCHES), choices=LAUNCHES)
    p.add_argument("--index", nargs="+", default=["dense", "top-k"], choices=["dense", "top-k"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=8, help="query heads per KV group")
    p.add_argument("--documents", action="store_true", help="packed documents (the HAS_DOCS variants)")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    print(f"launch table: {os.environ.get(loss.CONFIG_ENV) or '(defaults)'}; {args.dtype}, head dim "
          f"{args.head_dim}, {args.group} heads a group{', documents' if args.documents else ''}")  # fmt: skip
    print(f"{'launch':<7}{'index':<7}{'arch':<6}{'rows x keys':<13}{'warps':<7}{'stages':<8}"
          f"{'shared KiB':>11}{'regs':>6}{'spill B':>9}  fits")  # fmt: skip
    rows = []
    for launch, index, fn, a, kw in captured_launches(DTYPES[args.dtype], args.head_dim, args.group, args.documents):
        if launch not in args.launch or index not in args.index:
            continue
        for arch in args.arch:
            r = {"launch": launch, "index": index, "arch": arch, **resources(fn, a, kw, arch)}
            rows.append(r)
            print(f"{launch:<7}{index:<7}sm{arch:<4}{r['block_m']:>4} x {r['block_n']:<6}{r['num_warps']:<7}"
                  f"{r['num_stages']:<8}{r['shared_bytes'] / 1024:>11.1f}{r['registers']:>6}"
                  f"{r['spill_stack_bytes']:>9}  {'yes' if r['fits'] else 'NO'}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "head_dim": args.head_dim, "group": args.group,
                       "documents": args.documents, "config": os.environ.get(loss.CONFIG_ENV, ""),
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

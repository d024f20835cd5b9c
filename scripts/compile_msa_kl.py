"""MSA's KL kernels compiled ahead of time for A100 (sm80) and H100/H200 (sm90), no GPU needed.

    python scripts/compile_msa_kl.py [--arch 80 90] [--kl-order union|kv-outer] [--launch PASS ...]
                                     [--index dense top-k] [--kv-configs "bwd:64,128,8,1,8"]
                                     [--dtype bf16|fp16|fp32] [--head-dim 128] [--group 8]
                                     [--documents] [--max-spill 4096] [--out resources.json]

Each kernel launch of the KL's entry points is captured from the real launch path, run on
small CPU tensors of the given shape, and compiled by Triton for each target: in the union
of tiles (``--kl-order union``) ``index_lse``, the two passes ``kl_dq`` / ``kl_dk`` and the
one pass ``kl_fused``, on the dense warmup index and on a top-k index, with the launch table
as it stands (``MTRAINING_KL_CONFIG`` honoured); in the KV-outer order (top-k index only)
``kv_index_lse`` and ``kv_kl_backward`` with every kernel they launch, with ``kv_loss``'s
passes (``--kv-configs`` overrides them, as ``bench_msa_kl.py``'s). Printed per
launch and target: shared memory, registers, spill stack, and whether the launch is fit to
run: its shared memory within the GPU's (sm80: an A100's 163 KiB a block; sm90: an H100's
227 KiB) and its stack within ``--max-spill`` bytes a thread (ptxas can spill a kernel
wholesale on one architecture and not the other). Exit status 1 when one is not: the users'
clusters are A100s as well as H100s, so a launch table is checked here before a GPU sweep
picks from it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from megatron_mtraining.sparse import DenseIndex, MSAConfig, msa_select_blocks, packed_documents
from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables
from megatron_mtraining.sparse.kernels.msa_kl import kv_loss, loss

# Largest dynamic shared memory a block may opt in to (CUDA programming guide, compute
# capabilities 8.0 and 9.0).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PASSES = ("lse", "dq", "dk", "fused", "bwd")


class _Capture:
    """Stands in for a kernel: records each launch instead of running it."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


class _CapturedModule:
    """Stands in for a module of kernels (``kv_outer.kernels``): each kernel a :class:`_Capture`."""

    def __init__(self, module, launches: list):
        self.module, self.launches = module, launches

    def __getattr__(self, name):
        return _Capture(getattr(self.module, name), self.launches)


@contextlib.contextmanager
def _capturing(module, names: tuple[str, ...], launches: list):
    """``module``'s kernels (or kernel modules) ``names`` record into ``launches`` meanwhile."""
    saved = {name: getattr(module, name) for name in names}
    try:
        for name, fn in saved.items():
            setattr(module, name, (_CapturedModule if inspect.ismodule(fn) else _Capture)(fn, launches))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _case(dtype, head_dim: int, group: int, documents: bool, seq: int = 512, block: int = 128):
    """Inputs, and the dense and top-k indexes, of a one-sample case with two KV groups; with
    ``documents``, three packed documents starting inside blocks."""
    gen = torch.Generator().manual_seed(0)
    hkv, d_idx = 2, 128
    q = torch.randn(1, seq, hkv * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, seq, hkv, head_dim, generator=gen).to(dtype)
    q_idx = torch.randn(1, seq, hkv, d_idx, generator=gen).to(dtype)
    k_idx = torch.randn(1, seq, 1, d_idx, generator=gen).to(dtype)
    cu_seqlens = torch.tensor([0, seq // 4 + 37, seq // 2 + 37, seq], dtype=torch.int32) if documents else None
    dense = DenseIndex(1, hkv * group, seq, documents=packed_documents(cu_seqlens, seq, q.device))
    topk = msa_select_blocks(q_idx.float(), k_idx.float(), MSAConfig(block, 2, d_idx), hkv * group, cu_seqlens)
    return (q, k, q_idx, k_idx), {"dense": dense, "top-k": topk}


def _union_calls(q, k, q_idx, k_idx, index, lse, scale):
    """(launch, call) of the union-of-tiles order's entry points on ``index``."""
    table = tile_tables(index, dense_block=128)

    def backward(which):
        args = loss.kl_arguments(q, k, lse, q_idx, k_idx, lse[:, :2], table, scale, torch.ones(1), q.shape[1])
        return lambda: which(args)

    return (loss, ("_index_lse_kernel", "_dq_kl_kernel", "_dk_kl_kernel")), [
        ("lse", lambda: loss.index_lse(q_idx, k_idx, table)),
        ("dq", backward(loss.kl_dq)),
        ("dk", backward(loss.kl_dk)),
        ("fused", backward(loss.kl_fused)),
    ]


def _kv_outer_calls(q, k, q_idx, k_idx, index, lse, scale):
    """(launch, call) of the KV-outer order's entry points on a top-k ``index``."""
    lse_idx = lse[:, :2]
    grad = torch.ones(1)
    return (kv_loss, ("_kl_lse_kernel", "_kl_bwd_kernel", "_kl_dq_kernel", "kv_kernels")), [
        ("lse", lambda: kv_loss.kv_index_lse(q_idx, k_idx, index)),
        ("bwd", lambda: kv_loss.kv_kl_backward(q, k, lse, q_idx, k_idx, lse_idx, index, scale, grad, q.shape[1])),
    ]


def captured_launches(
    dtype, head_dim: int, group: int, documents: bool, order: str = "union", arch: int = 90
) -> list[tuple[str, str, object, tuple, dict]]:
    """(launch, index, kernel, args, kwargs) of each kernel that the entry points of the KL's
    loop ``order`` (``union``, ``kv-outer``) launch with the launch parameters they take on
    ``arch``; a launch is named by its pass, and by the pass and the kernel where a pass
    launches several (``bwd/reduce``)."""
    if order == "kv-outer" and documents:
        raise ValueError("the KV-outer order takes no documents")
    if order == "kv-outer":  # what kv_loss takes on such a GPU, under the overrides given
        chosen = kv_loss.pass_defaults(arch // 10) | kv_loss.OVERRIDES
        with mock.patch.dict(kv_loss.OVERRIDES, chosen):
            return _captured(dtype, head_dim, group, documents, order)
    return _captured(dtype, head_dim, group, documents, order)


def _captured(dtype, head_dim: int, group: int, documents: bool, order: str) -> list:
    (q, k, q_idx, k_idx), indexes = _case(dtype, head_dim, group, documents)
    lse = torch.zeros(1, q.shape[2], q.shape[1])
    out = []
    for index_name, index in indexes.items():
        if order == "kv-outer" and index_name == "dense":
            continue
        calls = _union_calls if order == "union" else _kv_outer_calls
        (module, names), entries = calls(q, k, q_idx, k_idx, index, lse, 1 / math.sqrt(head_dim))
        for launch, call in entries:
            launches: list = []
            with _capturing(module, names, launches):
                call()
            seen = set()
            for fn, a, kw in launches:
                if fn.__name__ in seen:  # the same kernel again (another query chunk)
                    continue
                short = fn.__name__.strip("_").removesuffix("_kernel")
                out.append((f"{launch}/{short}" if seen else launch, index_name, fn, a, kw))
                seen.add(fn.__name__)
    return out


def _signature(fn, args: tuple, kwargs: dict, arch: int) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of a captured launch, specialised by Triton's
    own rule (``native_specialize_impl``, as its launcher: integers equal to 1 become
    constants, pointers and integers divisible by 16 are marked so)."""
    kwargs = dict(kwargs)
    options = {"num_warps": kwargs.pop("num_warps", 4), "num_stages": kwargs.pop("num_stages", 3)}
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    backend = CUDABackend(GPUTarget("cuda", arch, 32))
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        value = values.get(name, param.default)
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        if isinstance(value, float | bool):  # Triton does not specialise these
            kind, key = native_specialize_impl(BaseBackend, value, False, False, False)
        else:
            kind, key = native_specialize_impl(
                BaseBackend, value, False, not param.do_not_specialize, not param.do_not_specialize_on_alignment
            )
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = key
        elif isinstance(key, str) and key:
            attrs[(i,)] = backend.parse_attr(key)
    return signature, constexprs, attrs, options


def resources(fn, args: tuple, kwargs: dict, arch: int, max_spill: int = 4096) -> dict:
    """Shared memory (bytes), registers and spill stack of one launch compiled for ``arch``,
    and whether it fits (shared memory within the GPU's, stack within ``max_spill``)."""
    signature, constexprs, attrs, options = _signature(fn, args, kwargs, arch)
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
        "fits": shared <= SHARED_LIMIT[arch] and int(fields["STACK"]) <= max_spill,
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
    p.add_argument("--kl-order", default="union", choices=["union", "kv-outer"], help="the KL's loop order")
    p.add_argument(
        "--launch", nargs="+", default=None, choices=PASSES, help="passes (union: lse dq dk fused; kv-outer: lse bwd)"
    )
    p.add_argument("--kv-configs", default="", help="the KV-outer passes' parameters, as bench_msa_kl.py's")
    p.add_argument("--index", nargs="+", default=["dense", "top-k"], choices=["dense", "top-k"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=8, help="query heads per KV group")
    p.add_argument("--documents", action="store_true", help="packed documents (the HAS_DOCS variants)")
    p.add_argument("--max-spill", type=int, default=4096, help="bytes of stack a thread a fit launch may use")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    try:
        kv_loss.OVERRIDES.update(kv_loss.parse_overrides(args.kv_configs))
    except ValueError as err:
        p.error(f"--kv-configs: {err}")
    print(f"launch table: {os.environ.get(loss.CONFIG_ENV) or '(defaults)'}; {args.dtype}, head dim "
          f"{args.head_dim}, {args.group} heads a group{', documents' if args.documents else ''}")  # fmt: skip
    print(f"{'launch':<14}{'index':<7}{'arch':<6}{'rows x keys':<13}{'warps':<7}{'stages':<8}"
          f"{'shared KiB':>11}{'regs':>6}{'spill B':>9}  fits")  # fmt: skip
    rows = []
    for arch in args.arch:
        launches = captured_launches(DTYPES[args.dtype], args.head_dim, args.group, args.documents, args.kl_order, arch)
        for launch, index, fn, a, kw in launches:
            if (args.launch and launch.split("/")[0] not in args.launch) or index not in args.index:
                continue
            r = {"launch": launch, "index": index, "arch": arch, **resources(fn, a, kw, arch, args.max_spill)}
            rows.append(r)
            blocks = f"{r['block_m']:>4} x {r['block_n']:<6}" if r["block_m"] else f"{'-':<13}"
            print(f"{launch:<14}{index:<7}sm{arch:<4}{blocks}{r['num_warps']:<7}"
                  f"{r['num_stages']:<8}{r['shared_bytes'] / 1024:>11.1f}{r['registers']:>6}"
                  f"{r['spill_stack_bytes']:>9}  {'yes' if r['fits'] else 'NO'}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "head_dim": args.head_dim, "group": args.group,
                       "documents": args.documents, "config": os.environ.get(loss.CONFIG_ENV, ""),
                       "kl_order": args.kl_order, "kv_configs": args.kv_configs,
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

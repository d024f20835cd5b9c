"""The package's Triton kernels compiled ahead of time for A100 (sm80) and H100/H200 (sm90),
with no GPU: shared memory, registers and spills of every launch, and whether each fits.

    python scripts/compile_kernels.py [--family kl kl-kv-outer attention kv-outer msa-kv-outer window combine gate]
                                      [--arch 80 90]
                                      [--launch NAME ...] [--index NAME ...] [--documents]
                                      [--kv-configs "bwd:64,128,8,1,8"] [--dtype bf16|fp16|fp32]
                                      [--head-dim 128] [--group 8] [--max-spill 4096]
                                      [--out resources.json]

Each kernel launch of a family's entry points is captured from the real launch path, run on
small CPU tensors of the given shape with the launch parameters it takes on the target's
architecture (``kernels.shared.arch``), and compiled by Triton for that target, specialised
as Triton's launcher specialises it:

* ``kl``: MSA's KL over the union of tiles (``msa_kl.loss``: ``index_lse``, the two passes
  ``kl_dq`` / ``kl_dk``, the one pass ``kl_fused``) on the dense warmup index and a top-k
  index; ``MTRAINING_KL_CONFIG`` honoured;
* ``kl-kv-outer``: MSA's KL in the KV-outer order (``kv_index_lse``, ``kv_kl_backward``) on a
  top-k index; ``--kv-configs`` overrides its passes, as ``bench_msa_kl.py``'s;
* ``attention``: ``sparse_attention`` on the Triton kernels, forward and backward, on a dense,
  a vertical-slash and a top-k index (what ``block_bar`` launches);
* ``kv-outer``: the KV-outer attention's forward and backward on a top-k index;
* ``msa-kv-outer``: MSA's attention and KL in one function (``msa_kl.kv_attention``), whose
  backward's kernels take the teacher variants (``HAS_TEACHER``);
* ``window``: the window-statistics passes (``index_build.window_stats``) of the
  vertical-slash build and of the recalls: row maxima and normalisers, the index recall's
  kept sums (on 64-key tiles: with the marks tile, 128 keys spill on sm80), MSA's block
  sums, the mass pass and its pooling;
* ``combine``: the LSE merges of partial results (``kernels.shared.combine``): the two-way
  merge forward and backward (the ring's and the varlen path's) and the varlen path's in-place
  merge into named rows (``merge_rows``), a running fp32 result taking bf16/fp16 parts; and the
  varlen path's row moves (``kernels.shared.rows``): its forward's gather of q, its backward's
  of dO, q, O and the LSE in one launch, and dQ's add of a part into fp32 rows;
* ``gate``: MoBA's gate choice (``index_build.topk_blocks``) on the fp64 gate of the case's
  query heads, causal (and from each row's document's first chunk with ``--documents``):
  32 chunks, top-12 (``select``), and the kernel's widest rows, 128 chunks (``select-wide``).

``--documents`` packs three documents into the sample (the kernels' ``HAS_DOCS`` variants;
the KV-outer orders take none). Printed per launch and target: shared memory, registers,
spill stack, and whether the launch is fit to run: its shared memory within the GPU's (sm80:
an A100's 163 KiB a block; sm90: an H100's 227 KiB) and its stack within ``--max-spill`` bytes
a thread (ptxas can spill a kernel wholesale on one architecture and not the other). Exit
status 1 when one is not: the users' clusters are A100s as well as H100s, so launch
parameters are checked here before a GPU sweep picks among them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from megatron_mtraining.sparse import (
    DenseIndex,
    MSAConfig,
    VerticalSlashConfig,
    build_vertical_slash_index,
    msa_select_blocks,
    packed_documents,
    sparse_attention,
)
from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar
from megatron_mtraining.sparse.kernels.block_bar.tables import tile_tables
from megatron_mtraining.sparse.kernels.index_build import topk_blocks, window_stats
from megatron_mtraining.sparse.kernels.kv_outer import attention as kv_outer
from megatron_mtraining.sparse.kernels.msa_kl import kv_attention, kv_loss, loss
from megatron_mtraining.sparse.kernels.shared import arch as shared_arch
from megatron_mtraining.sparse.kernels.shared import combine, rows
from megatron_mtraining.sparse.vertical_slash import ObservationWindows

# Largest dynamic shared memory a block may opt in to (CUDA programming guide, compute
# capabilities 8.0 and 9.0).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAMILIES = ("kl", "kl-kv-outer", "attention", "kv-outer", "msa-kv-outer", "window", "combine", "gate")
KV_OUTER_FAMILIES = ("kl-kv-outer", "kv-outer", "msa-kv-outer")  # no documents


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


@dataclasses.dataclass
class _Case:
    """One sample: main q/k/v, MSA's index queries and keys, the indexes, the scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    indexes: dict
    scale: float


def _case(dtype, head_dim: int, group: int, documents: bool, seq: int = 512, block: int = 128) -> _Case:
    """A one-sample case with two KV groups and its dense, vertical-slash and top-k (k 2)
    indexes, on blocks of 128 as the recipes'; with ``documents``, three packed documents starting
    inside blocks."""
    gen = torch.Generator().manual_seed(0)
    hkv, d_idx = 2, 128

    def t(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v = t(1, seq, hkv * group, head_dim), t(1, seq, hkv, head_dim), t(1, seq, hkv, head_dim)
    q_idx, k_idx = t(1, seq, hkv, d_idx), t(1, seq, 1, d_idx)
    scale = 1 / math.sqrt(head_dim)
    cu_seqlens = torch.tensor([0, seq // 4 + 37, seq // 2 + 37, seq], dtype=torch.int32) if documents else None
    indexes = {
        "dense": DenseIndex(1, hkv * group, seq, documents=packed_documents(cu_seqlens, seq, q.device)),
        "v-s": build_vertical_slash_index(
            # Every document sparse (none is dense_below's 1024 tokens here, and none turns
            # dense where that would cost no more), so that the documents' variants of the
            # bar kernels have columns to launch on.
            q.float(),
            k.float(),
            VerticalSlashConfig(block_size=block, dense_below=0, dense_if_cheaper=False),
            scale,
            cu_seqlens=cu_seqlens,
        ),
        "top-k": msa_select_blocks(q_idx.float(), k_idx.float(), MSAConfig(block, 2, d_idx), hkv * group, cu_seqlens),
    }
    return _Case(q, k, v, q_idx, k_idx, indexes, scale)


def _kl(c: _Case, index) -> list:
    table = tile_tables(index, dense_block=128)
    lse = torch.zeros(1, c.q.shape[2], c.q.shape[1])

    def backward(which):
        grad = torch.ones(1)
        args = loss.kl_arguments(c.q, c.k, lse, c.q_idx, c.k_idx, lse[:, :2], table, c.scale, grad, c.q.shape[1])
        return lambda: which(args)

    return [
        ("lse", lambda: loss.index_lse(c.q_idx, c.k_idx, table)),
        ("dq", backward(loss.kl_dq)),
        ("dk", backward(loss.kl_dk)),
        ("fused", backward(loss.kl_fused)),
    ]


def _kl_kv_outer(c: _Case, index) -> list:
    lse = torch.zeros(1, c.q.shape[2], c.q.shape[1])
    rows = c.q.shape[1]
    return [
        ("lse", lambda: kv_loss.kv_index_lse(c.q_idx, c.k_idx, index)),
        (
            "bwd",
            lambda: kv_loss.kv_kl_backward(
                c.q, c.k, lse, c.q_idx, c.k_idx, lse[:, :2], index, c.scale, torch.ones(1), rows
            ),
        ),
    ]


def _forward_backward(attend):
    """The entry points of an attention call ``attend(q, k, v, index, scale) -> out``:
    a family's entries on ``index`` (fwd, then bwd on the forward's graph)."""

    def entries(c: _Case, index) -> list:
        state = {}

        def fwd():
            state["inputs"] = tuple(t.detach().requires_grad_() for t in (c.q, c.k, c.v))
            state["out"] = attend(*state["inputs"], index, c.scale)

        def bwd():
            out = state.pop("out")
            torch.autograd.grad(out, state["inputs"], torch.ones_like(out))

        return [("fwd", fwd), ("bwd", bwd)]

    return entries


_attention = _forward_backward(
    lambda q, k, v, index, scale: sparse_attention(q, k, v, index, scale, backend="triton")[0]
)
_kv_outer = _forward_backward(lambda q, k, v, index, scale: kv_outer.KVOuterAttention.apply(q, k, v, index, scale)[0])


def _msa_kv_outer(c: _Case, index) -> list:
    """MSA's attention and KL in one function (``msa_kl.kv_attention``): the backward's
    kernels take the teacher variants (``HAS_TEACHER``)."""
    state = {}

    def fwd():
        state["inputs"] = tuple(t.detach().requires_grad_() for t in (c.q, c.k, c.v, c.q_idx, c.k_idx))
        out, _, kl = kv_attention.kv_outer_msa(*state["inputs"], index, c.scale)
        state["outputs"] = (out, kl)

    def bwd():
        out, kl = state.pop("outputs")
        torch.autograd.grad((out, kl), state["inputs"], (torch.ones_like(out), torch.ones_like(kl)))

    return [("fwd", fwd), ("bwd", bwd)]


def _window(c: _Case, index) -> list:
    """The window-statistics passes on the last 64 rows (of each of ``index``'s documents
    they cross) against every key, in the case's 128-token blocks; what a pass reads needs
    only the right shapes, the launches being captured."""
    seq, hq, rows = c.q.shape[1], c.q.shape[2], 64
    bounds = (0, seq) if index.documents is None else index.documents.bounds
    windows = ObservationWindows.of_rows(range(seq - rows, seq), bounds, seq)
    parts = window_stats.WindowKernels(c.q[:, seq - rows :], c.k, None, windows, c.scale, 128)
    row_max = torch.zeros(len(windows.rows), 1, hq, max(windows.rows))
    attended = torch.zeros(1, hq, rows, seq, dtype=torch.bool)
    runs = torch.zeros(1, hq, parts.n_tiles * 2, parts.run_len, dtype=torch.float64)
    return [
        ("row_max", parts.row_max),
        ("row_sum", lambda: parts.row_sum(row_max)),
        ("kept_sums", lambda: parts.kept_sums(row_max, attended)),
        ("block_sums", lambda: parts.block_sums(row_max)),
        ("mass", lambda: parts.mass(row_max, row_max.double())),
        ("pool", lambda: parts.totals(torch.zeros(1, hq, seq), runs, parts.tables)),
    ]


class _Context:
    """What ``FusedCombine``'s forward and backward use of an autograd context."""

    def __init__(self, *saved):
        self.saved_tensors = saved

    def save_for_backward(self, *saved):
        self.saved_tensors = saved


def _combine(c: _Case, index) -> list:
    """The merges as the varlen path runs them: a running fp32 result (``[B, S, H, D]``, LSE
    ``[B, H, S]``) and a part in the case's dtype; ``merge_rows`` on half the rows; the row
    gathers and dQ's add of a slot (``gather_rows``, ``add_rows``) on the same half."""
    b, s, h, d = c.q.shape
    out, lse = torch.zeros(b, s, h, d), torch.zeros(b, h, s)
    part = c.q.new_zeros(b, s, h, d)
    saved = (out, lse, part, lse)
    n = b * s * h
    order = torch.arange(0, n, 2, dtype=torch.int32)
    q_rows, out_rows, lse_rows = c.q.reshape(n, d), out.view(n, d), lse.view(n)
    return [
        ("combine", lambda: combine.FusedCombine.forward(_Context(), *saved)),
        ("combine-bwd", lambda: combine.FusedCombine.backward(_Context(*saved), out, lse)),
        ("merge_rows", lambda: combine.merge_rows(out_rows, lse_rows, part.view(n, d)[: len(order)],
                                                  lse_rows[: len(order)], order)),
        ("gather_q", lambda: rows.gather_rows(order, q_rows)),
        ("gather_rows", lambda: rows.gather_rows(order, q_rows, q_rows, q_rows, lse_rows)),
        ("add_rows", lambda: rows.add_rows(out_rows, order, part.view(n, d)[: len(order)])),
    ]  # fmt: skip


def _gate(c: _Case, index) -> list:
    """MoBA's gate choice as ``moba_select_from_parts`` launches it: the ``[B, Hq, S, chunks]``
    fp64 gate, each row's own chunk, top-12, written into a ``[B, S, Hq, 12]`` result; with
    ``index``'s documents, each row's first chunk."""
    b, s, h, _ = c.q.shape
    topk = 12

    def select(n_chunks):
        cs = s // n_chunks
        gate = torch.zeros(b, h, s, n_chunks, dtype=torch.float64)
        first = None if index.documents is None else index.documents.starts.long() // cs
        out = torch.empty(b, s, h, topk, dtype=torch.int32).permute(0, 2, 1, 3)
        return lambda: topk_blocks.select_topk_blocks(gate, torch.arange(s) // cs, topk, True, first, out=out)

    return [("select", select(32)), ("select-wide", select(topk_blocks.MAX_BLOCKS))]


# Per family: its entry points on an index, the indexes it serves, and the kernels it may
# launch (module, names: a kernel, or a module of kernels).
_FAMILIES = {
    "kl": (_kl, ("dense", "top-k"), [(loss, ("_index_lse_kernel", "_dq_kl_kernel", "_dk_kl_kernel"))]),
    "kl-kv-outer": (
        _kl_kv_outer,
        ("top-k",),
        [(kv_loss, ("_kl_lse_kernel", "_kl_bwd_kernel", "_kl_dq_kernel", "kv_kernels"))],
    ),
    "attention": (
        _attention,
        ("dense", "v-s", "top-k"),
        [(block_bar, ("_fwd_kernel", "_dq_kernel", "_bar_dkdv_kernel", "_tile_dkdv_kernel")), (kv_outer, ("kernels",))],
    ),
    "kv-outer": (_kv_outer, ("top-k",), [(kv_outer, ("kernels",))]),
    "msa-kv-outer": (
        _msa_kv_outer,
        ("top-k",),
        [(kv_outer, ("kernels",)), (kv_loss, ("_kl_lse_kernel", "_kl_bwd_kernel", "_kl_dq_kernel", "kv_kernels"))],
    ),
    "window": (_window, ("dense",), [(window_stats, ("_row_stats_kernel", "_mass_kernel", "_pool_kernel"))]),
    "combine": (
        _combine,
        ("dense",),
        [(combine, ("_combine_fwd", "_combine_bwd", "_merge_rows")), (rows, ("_gather_rows", "_add_rows"))],
    ),
    "gate": (_gate, ("dense",), [(topk_blocks, ("_topk_blocks_kernel",))]),
}


def captured_launches(
    family: str, dtype, head_dim: int, group: int, documents: bool, arch: int = 90
) -> list[tuple[str, str, object, tuple, dict]]:
    """(launch, index, kernel, args, kwargs) of each kernel that ``family``'s entry points
    launch with the launch parameters they take on ``arch``; a launch is named by its entry
    point (``bwd``), and by the entry point and the kernel where it launches several
    (``bwd/reduce``)."""
    entries, served, patched = _FAMILIES[family]
    if documents and family in KV_OUTER_FAMILIES:
        raise ValueError(f"{family}: the KV-outer order takes no documents")
    case = _case(dtype, head_dim, group, documents)
    out = []
    # The launch parameters the entry points take on such a GPU.
    with mock.patch.object(shared_arch, "major", lambda device: arch // 10):
        for index_name in served:
            for launch, call in entries(case, case.indexes[index_name]):
                launches: list = []
                with contextlib.ExitStack() as stack:
                    for module, names in patched:
                        stack.enter_context(_capturing(module, names, launches))
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
    p.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_LIMIT))
    p.add_argument("--launch", nargs="+", default=None, help="entry points to keep (lse, dq, dk, fused, bwd, fwd)")
    p.add_argument("--index", nargs="+", default=None, help="indexes to keep (dense, v-s, top-k)")
    p.add_argument("--documents", action="store_true", help="packed documents (the HAS_DOCS variants)")
    p.add_argument("--kv-configs", default="", help="the KV-outer KL's passes, as bench_msa_kl.py's")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=8, help="query heads per KV group")
    p.add_argument("--max-spill", type=int, default=4096, help="bytes of stack a thread a fit launch may use")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    try:
        kv_loss.OVERRIDES.update(kv_loss.parse_overrides(args.kv_configs))
    except ValueError as err:
        p.error(f"--kv-configs: {err}")
    families = [f for f in args.family if not (args.documents and f in KV_OUTER_FAMILIES)]
    print(f"KL table: {os.environ.get(loss.CONFIG_ENV) or '(defaults)'}; {args.dtype}, head dim {args.head_dim}, "
          f"{args.group} heads a group{', documents' if args.documents else ''}")  # fmt: skip
    print(f"{'family':<12}{'launch':<16}{'index':<7}{'arch':<6}{'rows x keys':<13}{'warps':<7}{'stages':<8}"
          f"{'shared KiB':>11}{'regs':>6}{'spill B':>9}  fits")  # fmt: skip
    rows = []
    for family in families:
        for arch in args.arch:
            for launch, index, fn, a, kw in captured_launches(
                family, DTYPES[args.dtype], args.head_dim, args.group, args.documents, arch
            ):
                if (args.launch and launch.split("/")[0] not in args.launch) or (
                    args.index and index not in args.index
                ):
                    continue
                r = {"family": family, "launch": launch, "kernel": fn.__name__, "index": index, "arch": arch}
                r |= resources(fn, a, kw, arch, args.max_spill)
                rows.append(r)
                blocks = f"{r['block_m']:>4} x {r['block_n']:<6}" if r["block_m"] else f"{'-':<13}"
                print(f"{family:<12}{launch:<16}{index:<7}sm{arch:<4}{blocks}{r['num_warps']:<7}"
                      f"{r['num_stages']:<8}{r['shared_bytes'] / 1024:>11.1f}{r['registers']:>6}"
                      f"{r['spill_stack_bytes']:>9}  {'yes' if r['fits'] else 'NO'}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "head_dim": args.head_dim, "group": args.group,
                       "documents": args.documents, "kl_config": os.environ.get(loss.CONFIG_ENV, ""),
                       "kv_configs": args.kv_configs, "rows": rows}, f, indent=1)  # fmt: skip
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Rows named by an index, copied out of several tensors or added into one, a launch each.

``gather_rows`` is ``source[order]`` for several sources at once: one program reads a run of
``order`` once and copies those rows of every source, where PyTorch's indexing launches a
gather per source and reads the index each time. ``add_rows`` is ``target.index_add_(0, order,
part)`` for an ``order`` that names each row at most once: a plain read-modify-write of each
named row, in fp32, with the part converted on the way in rather than by a copy of its own.

``varlen_blocks`` takes both: a slot's rows of q (forward), of dO, q, O and the LSE (backward),
and dQ's sum over the slots. A program copies a 2-D block of rows (``ROWS`` of them, each
padded to a power of two), so wide rows move in vector loads and stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import buffers

# Elements of one source a program moves: rows of a 128-wide head (bf16) 32 at a time, enough
# loads in flight per thread to keep a gather near the memory's rate.
ELEMENTS = 4096
MAX_D = 256
# Sources one gather launch takes; more take further launches.
MATRICES = 4


@triton.jit
def _copy(SRC, DST, src, dst, ok):
    tl.store(DST + dst, tl.load(SRC + src, mask=ok), mask=ok)


@triton.jit
def _gather_rows(
    ORDER, N, SRC0, DST0, SRC1, DST1, SRC2, DST2, SRC3, DST3, VEC, VEC_OUT,
    D: tl.constexpr, SOURCES: tl.constexpr, HAS_VEC: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = i < N
    r = tl.load(ORDER + i, mask=ok, other=0).to(tl.int64)
    if SOURCES > 0:
        d = tl.arange(0, D_PAD)
        # D a constant: with no padding the column mask folds away and rows move as vectors.
        ok2 = ok[:, None] & (d < D)[None, :]
        src = r[:, None] * D + d[None, :]
        dst = i.to(tl.int64)[:, None] * D + d[None, :]
        _copy(SRC0, DST0, src, dst, ok2)
        if SOURCES > 1:
            _copy(SRC1, DST1, src, dst, ok2)
        if SOURCES > 2:
            _copy(SRC2, DST2, src, dst, ok2)
        if SOURCES > 3:
            _copy(SRC3, DST3, src, dst, ok2)
    if HAS_VEC:
        _copy(VEC, VEC_OUT, r, i, ok)


@triton.jit
def _add_rows(TARGET, ORDER, PART, N, PART_STRIDE, D: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = i < N
    r = tl.load(ORDER + i, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    ok2 = ok[:, None] & (d < D)[None, :]
    to = r[:, None] * D + d[None, :]
    # No atomics: ``order`` names a row at most once, so no other program reads or writes it.
    t = tl.load(TARGET + to, mask=ok2)
    p = tl.load(PART + i.to(tl.int64)[:, None] * PART_STRIDE + d[None, :], mask=ok2).to(tl.float32)
    tl.store(TARGET + to, t + p, mask=ok2)


def _shape(d: int) -> tuple[int, int]:
    """(ROWS, D_PAD) of rows ``d`` wide."""
    d_pad = max(16, triton.next_power_of_2(d))
    return max(1, ELEMENTS // d_pad), d_pad


def _check(order: torch.Tensor, *tensors: torch.Tensor):
    if order.dim() != 1 or order.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"order must be a 1-D int32 or int64 tensor, got {order.dtype} {tuple(order.shape)}")
    for t in (order, *tensors):
        if not t.is_contiguous():
            raise ValueError("the rows and order must be contiguous")
        if t.device != order.device:
            raise ValueError(f"a tensor on {t.device}, order on {order.device}")


def gather_rows(order: torch.Tensor, *sources: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tuple(source[order] for source in sources)``, contiguous, in one launch for up to
    ``MATRICES`` 2-D sources ``[N, D]`` and one 1-D ``[N]`` (a row's scalar: an LSE); further
    sources take further launches. The 2-D sources share D (at most ``MAX_D``), each keeps its
    own dtype; ``order`` (``[n]`` int32 or int64) may repeat or skip rows. Every copy is exact."""
    _check(order, *sources)
    matrices = [j for j, s in enumerate(sources) if s.dim() == 2]
    vectors = [j for j, s in enumerate(sources) if s.dim() == 1]
    if len(matrices) + len(vectors) != len(sources):
        raise ValueError(f"sources must be 1-D or 2-D, got {[tuple(s.shape) for s in sources]}")
    widths = {sources[j].shape[1] for j in matrices}
    if len(widths) > 1 or max(widths, default=0) > MAX_D:
        raise ValueError(f"2-D sources must share one width of at most {MAX_D}, got {sorted(widths)}")
    n = order.numel()
    d = widths.pop() if widths else 1
    out = tuple(buffers.new_buffer((n, *s.shape[1:]), s.dtype, s.device) for s in sources)
    if n == 0:
        return out
    rows, d_pad = _shape(d)
    while matrices or vectors:
        mats, matrices = matrices[:MATRICES], matrices[MATRICES:]
        vec, vectors = vectors[:1], vectors[1:]
        # Unused slots take any pointer: the kernel does not touch them.
        spare = sources[(mats + vec)[0]]
        pairs = [t for j in mats for t in (sources[j], out[j])] + [spare, spare] * (MATRICES - len(mats))
        vec_pair = (sources[vec[0]], out[vec[0]]) if vec else (spare, spare)
        _gather_rows[(triton.cdiv(n, rows),)](
            order, n, *pairs, *vec_pair, D=d, SOURCES=len(mats), HAS_VEC=bool(vec), ROWS=rows, D_PAD=d_pad
        )
    return tuple(out)


def add_rows(target: torch.Tensor, order: torch.Tensor, part: torch.Tensor) -> None:
    """``target[order[i]] += part[i]`` in place, in one launch: ``target [N, D]`` fp32 and
    contiguous, ``part [n, D]`` of any float dtype whose rows may lie apart (a library's
    output), added in fp32 as ``target.index_add_(0, order, part.float())`` adds it, with the
    same result. ``order [n]`` (int32 or int64) names each row of ``target`` at most once, which
    the caller guarantees: then each row is read, summed and written by one program alone, so
    plain loads and stores suffice where a row named twice would need atomics (two programs
    would read it before either wrote, and one part be lost)."""
    _check(order, target)
    if part.device != order.device:
        raise ValueError(f"part on {part.device}, order on {order.device}")
    if part.dim() != 2 or part.stride(1) != 1:
        raise ValueError(f"part must be [n, D] rows of contiguous elements, got strides {part.stride()}")
    if target.dtype != torch.float32 or target.dim() != 2 or part.shape != (order.numel(), target.shape[1]):
        raise ValueError(
            f"target must be fp32 [N, D] and part [len(order), D], got {target.dtype} {tuple(target.shape)}, "
            f"{tuple(part.shape)} and {order.numel()} rows"
        )
    n, d = part.shape
    if d > MAX_D:
        raise ValueError(f"rows of at most {MAX_D}, got {d}")
    if n:
        rows, d_pad = _shape(d)
        _add_rows[(triton.cdiv(n, rows),)](target, order, part, n, part.stride(0), D=d, ROWS=rows, D_PAD=d_pad)

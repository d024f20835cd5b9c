"""``index.select_topk_blocks`` in one Triton launch (CUDA inputs, or Triton's interpreter):
MoBA's gate choice of chunks from the gate scores.

``select_topk_blocks`` ranks ``[..., nq, n_blocks]`` scores with two ``torch.topk`` and a
sort over every row, plus the ``nan_to_num``, ``scatter`` and ``where`` passes around them;
with MoBA's few chunks a row (a few dozen) these are millions of short rows, on which
``torch.topk`` is slow. A row's whole ranking fits in registers instead: one program takes
a tile of rows, holds each row's scores padded to a power of two, and counts per block the
blocks ranked above it (a higher score, or an equal score and a lower id; the row's own
block above all), one compared block per loop step, its score loaded for every row of the
tile. A block is kept when fewer than ``topk`` rank above it and it is visible (its score
is above -inf, or it is the own block); it is written at the count of kept blocks of
lower id (a prefix sum), so the ids come out ascending, and the rest of the row is -1.

This is ``select_topk_blocks``'s selection exactly: the top by (score descending, block id
ascending) with the own block first, NaN ranked as -inf (never taken), +inf scores ranked as
scores, -inf never taken. Scores in fp64 are rounded to fp32 as they are loaded (as
``.float()`` rounds them), and the visibility MoBA gives by masking the gate to -inf can be
passed as limits instead (``causal``: no block after the own one; ``first_block``: none
before the row's first), so the fp64 gate is read once, never masked or copied.

The pairwise count costs ``n_blocks`` steps over a ``[rows, next_pow2(n_blocks)]`` tile, so
the kernel takes rows of at most :data:`MAX_BLOCKS` blocks; longer rows go to
``select_topk_blocks``, whose ``torch.topk`` is efficient on long rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...validation import check_int, fail
from .msa_index import with_fewer_rows

# A row's scores and ranks live in registers, a [rows, next_pow2(n_blocks)] tile each, and
# the count takes n_blocks steps: up to 128 blocks (MoBA's 4096-token chunks at 512K).
MAX_BLOCKS = 128


@dataclass(frozen=True)
class TopkLaunch:
    """Tile sizes: ``elements`` scores a program (rows x padded blocks), rows capped at
    ``max_rows``; fewer rows for wider rows keeps the tile's registers bounded. The tile's
    scores, ids and ranks take several registers per element a thread: four times these
    elements spilled at 128 blocks, and held registers enough to cut the resident warps
    (``scripts/compile_kernels.py --family gate``)."""

    elements: int = 1024
    max_rows: int = 256
    num_warps: int = 4


# Tests shrink the tiles so that tiny inputs span several programs in Triton's interpreter.
LAUNCH = TopkLaunch()


@triton.jit
def _scores(ptrs, j, own, first, ok, CAUSAL: tl.constexpr, HAS_FIRST: tl.constexpr):
    """Scores of blocks ``j`` as ranked: fp32, -inf where NaN, out of range (``ok``) or hidden
    by the limits, +inf for the own block."""
    s = tl.load(ptrs, mask=ok, other=float("-inf")).to(tl.float32)
    visible = ok & (s == s)
    if CAUSAL:
        visible = visible & (j < own)
    if HAS_FIRST:
        visible = visible & (j >= first)
    s = tl.where(visible, s, float("-inf"))
    return tl.where(j == own, float("inf"), s)


@triton.jit
def _topk_blocks_kernel(
    SCORES, OWN, FIRST, OUT, n_rows, nq, n_blocks, lead1, s_l0, s_l1, s_q, s_n, o_l0, o_l1, o_q, topk,
    BLOCK_R: tl.constexpr, NP: tl.constexpr, PAD_W: tl.constexpr, CAUSAL: tl.constexpr, HAS_FIRST: tl.constexpr,
):  # fmt: skip
    """``BLOCK_R`` rows (of the flattened ``[lead0, lead1, nq]``): each row's own block plus
    its ``topk - 1`` best other visible blocks, ascending, -1 padded (module docstring)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    r = rows.to(tl.int64)
    qi = r % nq
    lead = r // nq
    l0 = lead // lead1
    l1 = lead % lead1
    s_row = SCORES + l0 * s_l0 + l1 * s_l1 + qi * s_q
    o_row = OUT + l0 * o_l0 + l1 * o_l1 + qi * o_q
    own = tl.load(OWN + qi, mask=row_ok, other=-1).to(tl.int32)
    first = own
    lo = 0
    hi = n_blocks
    if HAS_FIRST:
        first = tl.load(FIRST + qi, mask=row_ok, other=0).to(tl.int32)
        # Blocks before every row's first (and own) one are hidden from the whole tile.
        lo = tl.min(tl.where(row_ok, tl.minimum(first, own), n_blocks))
    if CAUSAL:  # blocks after every row's own one likewise
        hi = tl.minimum(tl.max(tl.where(row_ok, own, 0)) + 1, n_blocks)
    j = tl.arange(0, NP)[None, :]
    s_j = _scores(s_row[:, None] + j * s_n, j, own[:, None], first[:, None], row_ok[:, None] & (j < n_blocks),
                  CAUSAL, HAS_FIRST)  # fmt: skip
    # Ties go to the lower id, the own block's taken as -1: above every other block.
    id_j = tl.where(j == own[:, None], -1, j)
    rank = tl.zeros([BLOCK_R, NP], tl.int32)
    # A hidden block (-inf) ranks above no visible one: only the tile's visible range counts.
    for i in range(lo, hi):
        s_i = _scores(s_row + i * s_n, i, own, first, row_ok, CAUSAL, HAS_FIRST)[:, None]
        id_i = tl.where(own == i, -1, i)[:, None]
        rank += ((s_i > s_j) | ((s_i == s_j) & (id_i < id_j))).to(tl.int32)
    keep = (rank < topk) & (s_j > float("-inf")) & row_ok[:, None]
    kept = keep.to(tl.int32)
    place = tl.cumsum(kept, 1) - kept  # kept blocks of lower id
    tl.store(o_row[:, None] + place, tl.broadcast_to(j, [BLOCK_R, NP]), mask=keep)
    count = tl.sum(kept, 1)[:, None]
    c = tl.arange(0, PAD_W)[None, :]
    for c0 in range(0, topk, PAD_W):
        col = c0 + c
        tl.store(o_row[:, None] + col, -1, mask=row_ok[:, None] & (col >= count) & (col < topk))


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """``t [..., nq, last]`` as ``[lead0, lead1, nq, last]`` (a view where the leading dims allow)."""
    if t.dim() < 4:
        return t.view((1,) * (4 - t.dim()) + tuple(t.shape))
    return t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])


def _ids(t: torch.Tensor) -> torch.Tensor:
    """Block ids as the kernel loads them: int32 or int64 (MoBA's, taken as they are)."""
    return (t if t.dtype in (torch.int32, torch.int64) else t.long()).contiguous()


def _launch(scores, own, first, out, topk: int, causal: bool) -> None:
    s4, o4 = _as_4d(scores), _as_4d(out)
    lead0, lead1, nq, n = s4.shape
    n_rows = lead0 * lead1 * nq
    np_ = triton.next_power_of_2(n)
    block_r = min(LAUNCH.max_rows, max(1, LAUNCH.elements // np_), triton.next_power_of_2(n_rows))

    def launch(block_r: int) -> None:
        _topk_blocks_kernel[(triton.cdiv(n_rows, block_r),)](
            s4, own, own if first is None else first, o4, n_rows, nq, n, lead1, *s4.stride()[:3], s4.stride(3),
            *o4.stride()[:3], topk, BLOCK_R=block_r, NP=np_, PAD_W=min(triton.next_power_of_2(topk), 128),
            CAUSAL=causal, HAS_FIRST=first is not None, num_warps=LAUNCH.num_warps,
        )  # fmt: skip

    with_fewer_rows(launch, block_r)


@torch.no_grad()
def select_topk_blocks(
    scores: torch.Tensor,
    own_block: torch.Tensor,
    topk: int,
    causal: bool = False,
    first_block: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``index.select_topk_blocks(scores, own_block, topk)``, exactly: per row its own block plus
    the ``topk - 1`` best other visible blocks, ties to the lower id, int32 ``[..., nq, topk]``
    ascending, -1 padded. ``scores [..., nq, n_blocks]`` fp32 or fp64 (ranked rounded to fp32),
    at most :data:`MAX_BLOCKS` blocks; ``own_block [nq]`` (each in range, as a scatter index is);
    ``causal``: blocks after the own one count as -inf; ``first_block [nq]``: blocks before it
    do. ``out``: where to write, an int32 ``[..., nq, topk]`` whose last dimension is contiguous
    (at most two leading dimensions), e.g. a permuted view of a ``[B, nq, H, topk]`` result."""
    check_int("topk", topk, minimum=1)
    if scores.dtype not in (torch.float32, torch.float64):
        fail("scores.dtype", scores.dtype, "torch.float32 or torch.float64 (the Triton top-k)")
    if scores.dim() < 2 or scores.shape[-1] > MAX_BLOCKS:
        fail("scores.shape", tuple(scores.shape), f"[..., nq, n_blocks] with n_blocks <= {MAX_BLOCKS}")
    nq = scores.shape[-2]
    if own_block.shape != (nq,):
        fail("own_block.shape", tuple(own_block.shape), f"({nq},)")
    if first_block is not None and first_block.shape != (nq,):
        fail("first_block.shape", tuple(first_block.shape), f"({nq},)")
    shape = (*scores.shape[:-1], topk)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=scores.device)
    elif out.shape != shape or out.dtype != torch.int32 or out.stride(-1) != 1 or out.dim() > 4:
        fail("out", f"{out.dtype} {tuple(out.shape)}", f"int32 {shape}, last dimension contiguous, at most 4 dims")
    if out.numel():
        if scores.shape[-1] == 0:
            fail("scores.shape", tuple(scores.shape), "at least one block (the own one)")
        own, first = (None if t is None else _ids(t) for t in (own_block, first_block))
        _launch(scores, own, first, out, topk, causal)
    return out

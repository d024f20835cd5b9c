"""The MSA block selection in Triton: block-max index scores and their top-k, with no
token-level score matrix in global memory (CUDA inputs, or Triton's interpreter).

``msa.msa_select_blocks`` computes, per chunk of query rows, the ``[B, Hkv, rows, S]``
fp32 scores, a scatter-reduce max per key block and a top-k over ``[.., n_blocks]``:
O(S^2) memory traffic and about a thousand large launches per layer at 128K tokens.
Here one program takes a tile of ``BLOCK_M`` query rows of one (batch, group) and walks
the key blocks up to the tile's causal limit. Per key block it multiplies the tile
against the block's keys (``BLOCK_N`` at a time), masks the keys after each row's
position and keeps the row maximum: the block's score, which stays in registers. The
blocks that end before the tile's first row, most of a long walk, need no mask (without
packed documents) and skip it.

* ``block_max_scores_triton`` writes every score, ``[B, Hkv, S, n_blocks]`` fp32
  (``msa.block_max_scores`` on positions ``0 .. S-1``): still S x S / block_size.
* ``select_blocks`` writes only the selection, ``[B, S, Hkv, topk]`` int32 (what
  ``msa.msa_select_blocks`` runs on CUDA).
  Each row keeps a register-resident set of ``topk`` slots: slot 0 holds its own block
  (score +inf, never evicted), the others the best other blocks seen so far. A block
  whose score beats the set's worst replaces it; at the end each id is written at its place in
  ascending order (empty slots last, as -1), as ``index.select_topk_blocks`` returns them.

Tie rule: blocks are visited in ascending order and a block enters only when its score
is strictly above the worst kept one, which among equal worst scores is the one with
the highest id. The selection is therefore the top by (score descending, block id
ascending), exactly. ``torch.topk`` (the torch path) leaves the order of ties
unspecified, so the two can pick different blocks among equally scored ones only.
Blocks with no visible key score -inf and are never taken; a NaN score never enters.

Packed documents (``doc_starts``, ``[S]`` int32 by position): a row sees no key before its
document's start (one load per row, a compare per score), and a tile's walk starts at the
key block of its first row's start, so blocks wholly before every row's document cost
nothing; blocks before one row's document score -inf for it and are never taken.

Scores are fp32 ``q . k / sqrt(d_idx)``; 16-bit products are exact in fp32. fp32 inputs
use 3xTF32 products (``tf32x3``: fp32 accuracy on the tensor cores), not IEEE products: a
128-row tile of fp32 index queries held for an IEEE (FMA) product spills its registers
and ran three orders of magnitude slower (docs/benchmarks.md, "MSA selection"). Scores
then differ from the torch path's by the order of the fp32 sums and the 3xTF32 rounding.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ...validation import check_index_qk, check_int, check_launch, fail

# The set of kept blocks lives in registers, [BLOCK_M, next_pow2(topk)] scores and ids.
MAX_TOPK = 128
_EMPTY = tl.constexpr(1 << 30)  # ids of empty slots start here; above any block id


@dataclass(frozen=True)
class SelectLaunch:
    """Tile sizes and launch parameters. Rows per tile amortise each key load; the top-k
    set takes ``2 * block_m * next_pow2(topk)`` registers across the program, so wide
    selections take smaller row tiles."""

    block_m: int = 128
    block_m_wide: int = 64  # rows per tile when topk > 32
    block_n: int = 128  # keys per matrix product (at most the block size): long products amortise the top-k merge
    num_warps: int = 8
    num_stages: int = 2
    # fp32 inputs (3xTF32 products) keep split copies of both tiles in shared memory: one
    # stage fits 128-row tiles in an H100's / H200's 227 KiB, two do not.
    num_stages_fp32: int = 1


# The one place the launch is decided: tests shrink the tiles so that tiny inputs span several
# of each in Triton's interpreter, and ``scripts/bench_kernels.py --tune msa_select`` replaces
# it with each candidate; every launch checks it.
LAUNCH = SelectLaunch()


@triton.jit
def _block_max(
    q, k_base, j, rows, row_first, seq_len, sk_s, d, d_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """Each row's largest raw score over key block ``j``; ``MASKED``: keys past the sequence,
    after the row or (``HAS_DOCS``) before its document's start are hidden, else every key of
    the block is visible to every row."""
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for t in tl.static_range(BLOCK_SIZE // BLOCK_N):
        keys = j * BLOCK_SIZE + t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + keys.to(tl.int64)[:, None] * sk_s + d[None, :]
        if MASKED:
            key_ok = keys < seq_len
            k = tl.load(k_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            visible = key_ok[None, :] & (keys[None, :] <= rows[:, None])
            if HAS_DOCS:
                visible = visible & (keys[None, :] >= row_first[:, None])
            s = tl.where(visible, s, float("-inf"))
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        best = tl.maximum(best, tl.max(s, 1))
    return best


@triton.jit
def _offer(best, j, own, top_s, top_i, out_row, row_ok, SELECT: tl.constexpr):
    """Block ``j``'s row maxima ``best``: stored (``out_row``), or offered to the kept set
    (``SELECT``), which it enters in place of the worst kept block when strictly better; among
    equally bad slots the highest id goes, so ties keep the lower block ids. The row's own
    block is slot 0 already. Returns the kept set."""
    if SELECT:
        cand = tl.where(own == j, float("-inf"), best)
        worst = tl.min(top_s, 1)
        victim = tl.max(tl.where(top_s == worst[:, None], top_i, -1), 1)
        hit = (top_i == victim[:, None]) & (cand > worst)[:, None]
        top_s, top_i = tl.where(hit, cand[:, None], top_s), tl.where(hit, j, top_i)
    else:
        tl.store(out_row + j, best, mask=row_ok)
    return top_s, top_i


@triton.jit
def _block_select_kernel(
    Q, K, SCORES, BLOCKS, DOC_START, seq_len, n_blocks, HKV, sq_b, sq_s, sq_h, sk_b, sk_s, n_slots, width, scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KP: tl.constexpr, SELECT: tl.constexpr, PRECISION: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """One tile of ``BLOCK_M`` query rows of one (batch, group) against every key block
    up to its causal limit: the block maxima (``SCORES``, unless ``SELECT``) or the
    top-``n_slots`` selection (``BLOCKS``, ``width`` ids per row)."""
    bg = tl.program_id(0)
    # The grid's last tiles see the most key blocks: they start first.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_ptrs = Q + b.to(tl.int64) * sq_b + g * sq_h + rows.to(tl.int64)[:, None] * sq_s + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * sk_b
    last_row = tl.minimum(tile * BLOCK_M + BLOCK_M, seq_len) - 1
    n_visible = last_row // BLOCK_SIZE + 1
    own = rows // BLOCK_SIZE
    first_block = n_visible * 0
    row_first = rows
    if HAS_DOCS:  # each row's document start; blocks before the first row's see nothing
        row_first = tl.load(DOC_START + rows, mask=row_ok, other=0)
        first_block = tl.load(DOC_START + tile * BLOCK_M) // BLOCK_SIZE
    # The kept set (SELECT; one unused slot otherwise). Slot 0: the row's own block, forced.
    # Slots past n_slots: +inf, never evicted.
    col = tl.arange(0, KP)[None, :]
    top_s = tl.where((col == 0) | (col >= n_slots), float("inf"), float("-inf")) + tl.zeros([BLOCK_M, KP], tl.float32)
    top_i = tl.where(col == 0, own[:, None], _EMPTY + col)
    if SELECT:
        out_row = BLOCKS + ((b.to(tl.int64) * seq_len + rows.to(tl.int64)) * HKV + g) * width
    else:
        out_row = SCORES + (bg.to(tl.int64) * seq_len + rows.to(tl.int64)) * n_blocks
        pad = tl.arange(0, 16)
        for j0 in range(0, first_block, 16):  # blocks before every row's document
            unseen = j0 + pad
            tl.store(
                out_row[:, None] + unseen[None, :],
                float("-inf"),
                mask=row_ok[:, None] & (unseen < first_block)[None, :],
            )
    # Blocks that end at or before the tile's first row are seen whole by every row (without
    # documents): their scores skip the masks, which cost more than the product on the bulk
    # of a long tile's walk. The rest, up to the causal limit, are masked.
    n_full = first_block
    if not HAS_DOCS:
        n_full = tl.minimum(tile * BLOCK_M // BLOCK_SIZE, n_visible)
    for j in range(first_block, n_full):
        best = _block_max(q, k_base, j, rows, row_first, seq_len, sk_s, d, d_ok, BLOCK_M, BLOCK_N, BLOCK_SIZE,
                          PRECISION, False, HAS_DOCS) * scale  # fmt: skip
        top_s, top_i = _offer(best, j, own, top_s, top_i, out_row, row_ok, SELECT)
    for j in range(n_full, n_visible):
        best = _block_max(q, k_base, j, rows, row_first, seq_len, sk_s, d, d_ok, BLOCK_M, BLOCK_N, BLOCK_SIZE,
                          PRECISION, True, HAS_DOCS) * scale  # fmt: skip
        top_s, top_i = _offer(best, j, own, top_s, top_i, out_row, row_ok, SELECT)
    if SELECT:
        # Ids are distinct within a row, so each slot's place in ascending order is the
        # count of smaller ids (tl.sort's bitonic network crawls in the interpreter).
        rank = tl.zeros([BLOCK_M, KP], tl.int32)
        for c in tl.static_range(KP):
            other = tl.sum(tl.where(col == c, top_i, 0), 1)
            rank += (other[:, None] < top_i).to(tl.int32)
        ids = tl.where(top_i >= _EMPTY, -1, top_i)
        tl.store(out_row[:, None] + rank, ids, mask=row_ok[:, None] & (rank < width))
        for c0 in range(KP, width, KP):  # topk above the block count: the rest is padding
            tl.store(out_row[:, None] + c0 + col, -1, mask=row_ok[:, None] & (c0 + col < width))
    else:
        pad = tl.arange(0, 16)
        for j0 in range(n_visible, n_blocks, 16):  # blocks no row of the tile sees
            unseen = j0 + pad
            tl.store(
                out_row[:, None] + unseen[None, :], float("-inf"), mask=row_ok[:, None] & (unseen < n_blocks)[None, :]
            )


def _check(q_idx: torch.Tensor, k_idx: torch.Tensor, block_size: int) -> None:
    check_index_qk(q_idx, k_idx)
    if q_idx.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        fail("q_idx.dtype", q_idx.dtype, "torch.float16, torch.bfloat16 or torch.float32 (the Triton selection)")
    check_int("block_size", block_size, minimum=16)
    if block_size & (block_size - 1):
        fail("block_size", block_size, "a power of two >= 16 (the kernel tiles by it)")


def _check_device(q_idx: torch.Tensor) -> None:
    if q_idx.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        fail("q_idx.device", str(q_idx.device), "a CUDA device (or TRITON_INTERPRET=1) for the Triton selection")


def _launch(
    q_idx, k_idx, block_size: int, scores, blocks, n_slots: int, width: int, block_m: int, doc_starts=None
) -> None:
    bsz, seq, groups, d = q_idx.shape
    q = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    k = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
    n_blocks = -(-seq // block_size)
    select = blocks is not None
    kp = triton.next_power_of_2(max(n_slots, 1))
    fp32 = q.dtype == torch.float32
    cfg = _launch_config()

    def launch(block_m: int) -> None:
        _block_select_kernel[(bsz * groups, triton.cdiv(seq, block_m))](
            q, k, scores, blocks, q if doc_starts is None else doc_starts, seq, n_blocks, groups, *q.stride()[:3],
            *k.stride()[:2], n_slots, width,
            1.0 / math.sqrt(d), HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m,
            BLOCK_N=min(cfg.block_n, block_size), BLOCK_SIZE=block_size, KP=kp, SELECT=select,
            PRECISION="tf32x3" if fp32 else "tf32", num_warps=cfg.num_warps,
            num_stages=cfg.num_stages_fp32 if fp32 else cfg.num_stages, HAS_DOCS=doc_starts is not None,
        )  # fmt: skip

    with_fewer_rows(launch, block_m)


def _launch_config() -> SelectLaunch:
    """``LAUNCH``, checked: an error names it, the value and what is accepted."""
    check_launch("msa_index.LAUNCH", LAUNCH, SelectLaunch, {"block_m": 16, "block_m_wide": 16, "block_n": 16})
    return LAUNCH


def with_fewer_rows(launch, rows: int, smallest: int = 16) -> None:
    """``launch(rows)``, halving the rows a program takes while the GPU has less shared memory
    than the tiles need (an A100 has 164 KiB); Triton raises before the launch, so nothing ran."""
    while True:
        try:
            return launch(rows)
        except OutOfResources:
            if rows <= smallest:
                raise
            rows //= 2


@torch.no_grad()
def block_max_scores_triton(
    q_idx: torch.Tensor, k_idx: torch.Tensor, block_size: int, doc_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """``msa.block_max_scores`` over the whole sequence (positions ``0 .. S-1``):
    ``[B, Hkv, S, n_blocks]`` fp32, -inf where the block has no key at or before the row
    (and, with ``doc_starts``, at or after the start of its document)."""
    _check(q_idx, k_idx, block_size)
    _check_device(q_idx)
    bsz, seq, groups, _ = q_idx.shape
    scores = torch.empty(bsz, groups, seq, -(-seq // block_size), dtype=torch.float32, device=q_idx.device)
    if seq:
        _launch(q_idx, k_idx, block_size, scores, None, 1, 1, _launch_config().block_m, _starts(doc_starts, seq))
    return scores


def _starts(doc_starts: torch.Tensor | None, seq: int) -> torch.Tensor | None:
    if doc_starts is not None and (doc_starts.shape != (seq,) or doc_starts.dtype != torch.int32):
        fail("doc_starts", f"{doc_starts.dtype} {tuple(doc_starts.shape)}", f"torch.int32 [{seq}] document starts")
    return None if doc_starts is None else doc_starts.contiguous()


@torch.no_grad()
def select_blocks(
    q_idx: torch.Tensor, k_idx: torch.Tensor, block_size: int, topk: int, doc_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """The MSA selection in one launch: per (query, group) its own block plus the top
    ``topk - 1`` other visible blocks, ``[B, S, Hkv, topk]`` int32 ascending, -1 padded.
    Ties go to the lower block id (module docstring). ``doc_starts``: the ``[S]`` int32
    document start of each position (``Documents.starts``), for packed documents."""
    _check(q_idx, k_idx, block_size)
    check_int("topk", topk, minimum=1)
    if topk > MAX_TOPK:
        fail("topk", topk, f"at most {MAX_TOPK} for the Triton selection (its top-k set is in registers)")
    _check_device(q_idx)
    bsz, seq, groups, _ = q_idx.shape
    blocks = torch.empty(bsz, seq, groups, topk, dtype=torch.int32, device=q_idx.device)
    if seq:
        n_slots = min(topk, -(-seq // block_size))
        cfg = _launch_config()
        block_m = cfg.block_m if n_slots <= 32 else cfg.block_m_wide
        _launch(q_idx, k_idx, block_size, None, blocks, n_slots, topk, block_m, _starts(doc_starts, seq))
    return blocks

"""Triton kernels for the vertical-slash observation-window statistics (``WindowKernels``).

Rows are the window queries of each document (``vertical_slash.ObservationWindows``: a
document's last ``w`` positions; the whole sequence is one document) of each query head
of a KV head's group (``G = Hq / Hkv`` heads); columns are the keys this device holds,
at any global positions (a context-parallel shard), and a row sees its document's keys
only, up to its position. Three passes recompute the same fp32 logits (16-bit products
are exact in fp32; fp32 inputs get exact fp32 products), in log2 units
(``logit * log2 e``), each one launch for every document:

1. row maxima: per (row tile, chunk of a document's keys, batch x KV head), the chunk's
   maximum for the document's rows, the chunks' partials reduced per document in order;
2. row normalisers: the same programs sum ``2^(logit - global row max)``; the recalls
   reuse them, the index recall's adding the mass on the keys the index attends
   (``kept_sums``) and MSA's block recall summing per key block instead of per chunk
   (``block_sums``: a work item is a document's key block by global position, which one
   program writes, so no ``[rows, keys]`` tensor and no atomics);
3. mass: per (block of a document's key *positions*, batch x KV head), found through a
   position -> local key map (-1 where another device holds the key), each head's window
   probabilities summed per key (vertical) and along the token diagonals of each
   (row tile, key block) tile. The diagonals come from a circular skew of the
   tile's rows (``tl.gather``); a tile covers a contiguous run of ``2 * BLOCK``
   token offsets, and the runs (each document in its own region) are added up outside
   the kernel. The graphed index build keeps the kernel's outputs as its graph's input
   buffers and has each call's kernel write over them without clearing them
   (``WindowKernels.mass``).

Then, no longer reading K: the runs added up and pooled into each document's block
diagonals in one pass (``_pool_kernel``, ``WindowKernels.totals``), which reads the
runs once and writes ``[B, Hq, n_blocks]`` (the documents' one after the other); in torch
the sum wrote the ``[B, Hq, S]`` fp64 token profile (16 MiB at 128K) and the pooling read
it twice through two temporaries of its size.

A grid of documents x their longest's work would leave most programs idle where the
lengths differ, so each pass numbers its work items (key chunks, key blocks, diagonal
spans) document after document and a program finds its document by binary search over
the documents' first items (a table built on the host, ``WindowKernels.tables``); every
document gets the row tiles of the longest window (padding rows see no key).

Determinism: every output element has one writer that adds in a fixed order (runs
that overlap go to separate buffers, added by the pooling; the row partials are reduced
without atomics), so results are bitwise independent of launch order. Sums over keys,
tiles or devices add fp32 terms in fp64, and no term depends on how the keys are split
(exponents use the global row maxima, not running ones), so a context-parallel split
moves the statistics only at fp64 rounding, far below their final fp32 rounding.

The floor: each pass is a (window rows x sequence x head dim) matmul, passes 2 and 3
add one exponential per logit, each pass reads K once and the mass pass writes fp64
runs (32-key tiles) that the pooling reads again. The mass pass is the slow one: its
skew and fp64 sums cost several times its matmul (docs/benchmarks.md, "Index build on
CUDA: Triton window statistics" and "Index build without a copy of K").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...host_tables import to_device

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class StatsLaunch:
    """Tile sizes and launch parameters (defaults: sweeps at 128K on an H100, and for the
    mass pass on an H200, where 32-key tiles on 2 warps beat 64-key tiles on 4 warps;
    docs/benchmarks.md, "Index build without a copy of K")."""

    block_m: int = 128  # window rows per tile of the row-statistics passes
    block_n: int = 128  # keys per tile of the row-statistics passes
    # The kept-sums pass (the index recall's) also loads a rows x keys tile of marks: at 128 keys
    # it spills kilobytes a thread to the stack on sm80 (scripts/compile_kernels.py --family window).
    kept_block_n: int = 64
    chunk_blocks: int = 16  # key tiles per row-statistics program (one partial per chunk)
    rows_warps: int = 4
    rows_stages: int = 2
    # Key positions and window rows per tile of the mass pass; its fp64 runs take
    # 2 * ceil(w / block_mass) x seq_len per head (4 x for the default 64-query window).
    block_mass: int = 32
    mass_warps: int = 2


# Tests shrink the tiles so that tiny inputs span several of each in Triton's interpreter.
LAUNCH = StatsLaunch()

# The rows of the documents table (``WindowKernels.tables``), one entry per document: its
# first position, length, window rows, first window row, first and end local key, and its
# first key chunk of the row passes, mass-pass item, run slot, pooling item and output diagonal,
# and its first key-block item of the block sums and the global id of that block.
_START, _LENGTH, _ROWS, _ROW0, _KEY_LO, _KEY_HI, _CHUNK0, _ITEM0, _RUN0, _POOL0, _DIAG0, _BLOCK0, _FIRST_BLOCK = map(
    tl.constexpr, range(13)
)


@triton.jit
def _keys(K, b, kvh, idx, ok, sk_b, sk_s, sk_h, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Keys ``[n, D_PAD]`` at local indices ``idx`` (zeros where not ``ok``)."""
    d = tl.arange(0, D_PAD)
    ptrs = K + b.to(tl.int64) * sk_b + kvh * sk_h + idx.to(tl.int64)[:, None] * sk_s + d[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _query_ptrs(Q, b, heads, n_rows, first, HQ, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Pointers ``[n, D_PAD]`` to window row ``first`` (of ``n_rows`` per batch entry) of
    query heads ``heads`` (add ``row * HQ * HEAD_DIM`` for a later row), and the head-dim mask."""
    d = tl.arange(0, D_PAD)
    return Q + ((b * n_rows + first) * HQ + heads)[:, None] * HEAD_DIM + d[None, :], d < HEAD_DIM


@triton.jit
def _field(DOCS, n_docs, field: tl.constexpr, m):
    """Entry ``field`` of document ``m`` in the documents table (``WindowKernels.tables``)."""
    return tl.load(DOCS + field * n_docs + m)


@triton.jit
def _document_of(DOCS, n_docs, field: tl.constexpr, item):
    """The document of work item ``item``: the last ``m`` whose first item (``field``,
    ascending from 0) is at most ``item``, by binary search."""
    lo = tl.zeros([], tl.int32)
    hi = lo + n_docs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        after = _field(DOCS, n_docs, field, mid) <= item
        lo = tl.where(after, mid, lo)
        hi = tl.where(after, hi, mid)
    return lo


@triton.jit
def _logits2(q, k, qk_scale, PRECISION: tl.constexpr):
    """Logits in log2 units ``[n_q, n_k]``, fp32."""
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale


@triton.jit
def _probabilities(s, row_max, inv_sum, visible):
    return tl.where(visible, tl.exp2(s - row_max[:, None]) * inv_sum[:, None], 0.0)


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["n_docs", "n_rows", "W"])
def _row_stats_kernel(
    Q, K, KPOS, DOCS, ROW_MAX, OUT, ATT, KEPT, BLOCK_FIRST, n_docs, n_rows, n_keys, n_blocks, W, HQ, HKV, G, sk_b,
    sk_s, sk_h, qk_scale, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, SUM: tl.constexpr, HAS_KEPT: tl.constexpr, BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Per row of the tile, over one run of its document's keys: the maximum logit, or
    (``SUM``) the fp64 sum of ``2^(logit - ROW_MAX)``, and with ``HAS_KEPT`` also the sum
    over the keys that ``ATT`` (``[B, Hq, n_rows, n_keys]``, nonzero: attended) marks for
    the row, into ``KEPT`` (the index recall's kept mass, ``WindowKernels.kept_sums``).

    A work item is one run of a document's local keys. By default chunk ``c``,
    ``[lo + c CHUNK, lo + (c + 1) CHUNK)`` (the document's own split, whatever precedes it;
    a document with no key here has one empty chunk), its partial written per item for the
    caller's reduction. With ``BLOCKS`` (and ``SUM``) key block ``p`` of the document by
    global position (``p * block_size`` on): the held keys there are one run of local keys
    because positions ascend, ``BLOCK_FIRST[p]`` its first (every key block's, by
    searchsorted on the device), and the sum is final: written at ``[B, Hq, n_rows,
    n_blocks]`` (MSA's block recall, ``WindowKernels.block_sums``), each (row, block) by the
    one item of the row's document that holds the block.

    A document's rows are (window row, head of the group), ``W x G`` of them, the heads
    minor: the rows past its window (padding, where its window is shorter than the longest,
    ``W``) are the last ones, and a tile of them only skips its key loop, so a short window
    costs its own rows (a held-out run of 16 rows beside a window of 64 did the work of 64).
    Axis 0 numbers (item, row tile), the row tiles of an item neighbours, so they share its
    keys in L2, and items go on axis 0 rather than 1 whose 65535 programs a document's key
    blocks can outnumber."""
    tiles = tl.cdiv(G * W, BLOCK_M)
    tile = tl.program_id(0) % tiles * BLOCK_M
    i = tile + tl.arange(0, BLOCK_M)
    item = tl.program_id(0) // tiles
    bk = tl.program_id(1)
    b = bk // HKV
    kvh = bk % HKV
    if BLOCKS:
        m = _document_of(DOCS, n_docs, _BLOCK0, item)
        block = _field(DOCS, n_docs, _FIRST_BLOCK, m) + item - _field(DOCS, n_docs, _BLOCK0, m)
        first = tl.maximum(tl.load(BLOCK_FIRST + block), _field(DOCS, n_docs, _KEY_LO, m))
        last = tl.minimum(tl.load(BLOCK_FIRST + block + 1), _field(DOCS, n_docs, _KEY_HI, m))
    else:
        m = _document_of(DOCS, n_docs, _CHUNK0, item)
        first = _field(DOCS, n_docs, _KEY_LO, m) + (item - _field(DOCS, n_docs, _CHUNK0, m)) * CHUNK
        last = tl.minimum(first + CHUNK, _field(DOCS, n_docs, _KEY_HI, m))
    end = _field(DOCS, n_docs, _START, m) + _field(DOCS, n_docs, _LENGTH, m)
    rows = _field(DOCS, n_docs, _ROWS, m)
    row0 = _field(DOCS, n_docs, _ROW0, m)
    in_document = i < G * W
    r = i // G
    row_ok = in_document & (r < rows)
    heads = kvh * G + i % G
    last = tl.where(tile < rows * G, last, first)  # a tile of padding rows sees no key
    q_ptrs, d_ok = _query_ptrs(Q, b, heads, n_rows, row0, HQ, HEAD_DIM, D_PAD)
    q = tl.load(q_ptrs + (r * HQ * HEAD_DIM)[:, None], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    row_pos = tl.where(row_ok, end - rows + r, -1)
    n_heads = tl.num_programs(1) * G
    if SUM:
        row_max = tl.load(ROW_MAX + ((m * n_heads + b * HQ + heads) * W + r), mask=row_ok, other=0.0)
        acc = tl.zeros([BLOCK_M], tl.float64)
    else:
        acc = tl.full([BLOCK_M], float("-inf"), tl.float32)
    kept = tl.zeros([BLOCK_M], tl.float64)
    # The row's slot among all window rows, per head: its marks (HAS_KEPT), its block sums (BLOCKS).
    slot = ((b * HQ + heads) * n_rows + row0 + r).to(tl.int64)
    for j0 in range(first, last, BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        col_ok = cols < last
        key_pos = tl.load(KPOS + cols, mask=col_ok, other=0)
        s = _logits2(q, _keys(K, b, kvh, cols, col_ok, sk_b, sk_s, sk_h, HEAD_DIM, D_PAD), qk_scale, PRECISION)
        visible = col_ok[None, :] & (key_pos[None, :] <= row_pos[:, None])
        if SUM:
            p = tl.where(visible, tl.exp2(s - row_max[:, None]), 0.0)
            acc += tl.sum(p.to(tl.float64), 1)
            if HAS_KEPT:
                marks = tl.load(
                    ATT + slot[:, None] * n_keys + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0
                )
                kept += tl.sum(tl.where(marks != 0, p, 0.0).to(tl.float64), 1)
        else:
            acc = tl.maximum(acc, tl.max(tl.where(visible, s, float("-inf")), 1))
    if BLOCKS:
        # Padding rows would land on the next document's slots.
        tl.store(OUT + slot * n_blocks + block, acc, mask=row_ok)
    else:
        out = (item * n_heads + b * HQ + heads) * W + r
        tl.store(OUT + out, acc, mask=in_document)
        if HAS_KEPT:
            tl.store(KEPT + out, kept, mask=in_document)


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["n_docs", "n_rows", "W", "run_len"])
def _mass_kernel(
    Q, K, KEY_AT, DOCS, ROW_MAX, INV_SUM, VERT, RUNS, n_docs, n_rows, W, seq_len, run_len, HQ, HKV, G, sk_b,
    sk_s, sk_h, qk_scale, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """A work item is key block ``p`` of one document: the keys at its positions
    ``[p * BLOCK, (p + 1) * BLOCK)`` (from its start) that this device holds (``KEY_AT``:
    local index of a global position, -1 elsewhere) against each ``BLOCK``-row tile ``j`` of
    each head's window of that document: the probability mass per key (``VERT``, fp32) and
    the tile's diagonal sums (``RUNS``, fp64, in the document's region of each run): slot
    ``t`` of the tile's run holds the diagonal (row index - key index within the tile)
    ``t - BLOCK + 1``."""
    item = tl.program_id(0)
    m = _document_of(DOCS, n_docs, _ITEM0, item)
    p = item - _field(DOCS, n_docs, _ITEM0, m)
    start = _field(DOCS, n_docs, _START, m)
    length = _field(DOCS, n_docs, _LENGTH, m)
    rows = _field(DOCS, n_docs, _ROWS, m)
    n_blocks = tl.cdiv(length, BLOCK)
    bk = tl.program_id(1)
    b = bk // HKV
    kvh = bk % HKV
    c = tl.arange(0, BLOCK)
    key_pos = p * BLOCK + c  # from the document's start
    idx = tl.load(KEY_AT + start + key_pos, mask=key_pos < length, other=-1)
    held = idx >= 0
    if tl.max(held.to(tl.int32), 0) > 0:  # else every sum is 0: the buffers start at 0
        k = _keys(K, b, kvh, idx, held, sk_b, sk_s, sk_h, HEAD_DIM, D_PAD)
        # Slot u of row r's circular skew holds its key (r - u) mod BLOCK: summed over the
        # rows, the keys at or before the row's index give diagonal u, the others u - BLOCK.
        skew = (c[:, None] - c[None, :] + BLOCK) % BLOCK
        wraps = c[:, None] < c[None, :]
        n_tiles = tl.cdiv(W, BLOCK)
        region = _field(DOCS, n_docs, _RUN0, m) + (n_blocks - 1 - p) * BLOCK
        for g in range(G):
            h = kvh * G + g
            bh = (b * HQ + h).to(tl.int64)
            q_ptrs, d_ok = _query_ptrs(
                Q, b, h + tl.zeros([BLOCK], tl.int32), n_rows, _field(DOCS, n_docs, _ROW0, m), HQ, HEAD_DIM, D_PAD
            )
            stat = (m * tl.num_programs(1) * G + bh) * W  # [n_docs, B, HQ, W]
            vertical = tl.zeros([BLOCK], tl.float32)
            for j in range(n_tiles):
                r = j * BLOCK + c
                row_ok = r < rows
                q = tl.load(q_ptrs + (r * HQ * HEAD_DIM)[:, None], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                # Rows past the window load a zero 1/sum: their mass is 0.
                row_max = tl.load(ROW_MAX + stat + r, mask=row_ok, other=0.0)
                inv_sum = tl.load(INV_SUM + stat + r, mask=row_ok, other=0.0)
                visible = held[None, :] & (key_pos[None, :] <= (length - rows + r)[:, None])
                prob = _probabilities(_logits2(q, k, qk_scale, PRECISION), row_max, inv_sum, visible)
                vertical += tl.sum(prob, 0)
                skewed = tl.gather(prob, skew, 1)
                near = tl.sum(tl.where(wraps, 0.0, skewed).to(tl.float64), 0)
                far = tl.sum(tl.where(wraps, skewed, 0.0).to(tl.float64), 0)
                # Runs of blocks p and p + 1 overlap by BLOCK slots: they alternate buffers.
                run = RUNS + ((bh * n_tiles + j) * 2 + p % 2) * run_len + region + j * BLOCK
                tl.store(run + BLOCK - 1 + c, near)
                tl.store(run + c - 1, far, mask=c > 0)
            tl.store(VERT + bh * seq_len + start + key_pos, vertical, mask=held)


# Sizes that follow the step's data: unspecialized (see block_bar/tables_kernel.py).
@triton.jit(do_not_specialize=["n_docs", "n_out", "run_len"])
def _pool_kernel(RUNS, OUT, DOCS, n_docs, n_out, run_len, N_RUNS: tl.constexpr, BS: tl.constexpr,
                 DB: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """A work item is ``DB`` block diagonals ``d`` of one document, of one (batch, head),
    from the mass pass's runs (``BLOCK``: its tile): the token-diagonal mass ``x[o]``, slot
    ``start + o`` of the document's region of every run summed, pooled as
    ``vertical_slash._pool_diagonals`` does (its maths of record):
    ``(sum_t (BS - t) x[d BS + t] + sum_t t x[(d - 1) BS + t]) / BS``, the document's last
    block diagonal also keeping its own spill ``sum_t t x[d BS + t]``; offsets past the
    document hold no mass. The documents' diagonals go one after the other."""
    item = tl.program_id(0)
    m = _document_of(DOCS, n_docs, _POOL0, item)
    length = _field(DOCS, n_docs, _LENGTH, m)
    n_diagonals = tl.cdiv(length, BS)
    # Token diagonal 0's slot (WindowKernels.totals).
    start = tl.cdiv(length, BLOCK) * BLOCK - length + _field(DOCS, n_docs, _ROWS, m) - 1
    start += _field(DOCS, n_docs, _RUN0, m)
    bh = tl.program_id(1).to(tl.int64)
    d = (item - _field(DOCS, n_docs, _POOL0, m)) * DB + tl.arange(0, DB)
    t = tl.arange(0, BS)
    o = d[:, None] * BS + t[None, :]
    here = tl.zeros([DB, BS], tl.float64)
    before = tl.zeros([DB, BS], tl.float64)  # block diagonal d - 1
    for r in tl.static_range(N_RUNS):
        run = RUNS + (bh * N_RUNS + r) * run_len + start
        here += tl.load(run + o, mask=o < length, other=0.0)
        before += tl.load(run + o - BS, mask=(o >= BS) & (o - BS < length), other=0.0)
    spill = t.to(tl.float64)[None, :]
    pooled = tl.sum(here * (BS - spill), 1) + tl.sum(before * spill, 1)
    pooled += tl.where(d == n_diagonals - 1, tl.sum(here * spill, 1), 0.0)  # no diagonal beyond the last
    out = OUT + bh * n_out + _field(DOCS, n_docs, _DIAG0, m)
    tl.store(out + d, pooled / BS, mask=d < n_diagonals)


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))


class WindowKernels:
    """The passes of ``document_statistics_from_parts`` on the kernels, for the documents'
    window queries ``[B, R, Hq, D]`` (``windows``: which rows, of which documents) and keys
    ``[B, n, Hkv, D]`` at global positions ``key_positions`` (None: the whole sequence, in
    order). Row maxima are fp32 in log2 units, ``[M, B, Hq, longest window]``; the caller
    only hands them back (through its reductions).

    Every pass is one launch for all documents: a host table (``tables``, copied to the
    device once) gives each document's bounds, rows and keys and where its work items,
    runs and diagonals start; a work item finds its document by binary search."""

    def __init__(self, q_windows, k, key_positions: torch.Tensor | None, windows, scale: float, block_size: int):
        self.q = q_windows.contiguous()
        self.k = k if k.stride(-1) == 1 else k.contiguous()
        self.windows, self.block_size = windows, block_size
        self.seq_len = seq_len = windows.seq_len
        bsz, self.n_rows, self.hq, d = q_windows.shape
        self.hkv = k.shape[2]
        self.n_keys = k.shape[1]
        dev = k.device
        # The local index of each global position (-1: held elsewhere) for the mass pass.
        if key_positions is None:  # one launch rather than five: every key at its own position
            self.key_positions = self.key_at = torch.arange(self.n_keys, dtype=torch.int32, device=dev)
        else:
            self.key_positions = key_positions.to(torch.int32).contiguous()
            self.key_at = torch.full((seq_len,), -1, dtype=torch.int32, device=dev)
            self.key_at[key_positions.long()] = torch.arange(self.n_keys, dtype=torch.int32, device=dev)
        self.scalars = (self.hq, self.hkv, self.hq // self.hkv, *self.k.stride()[:3], scale * LOG2E)
        self.dims = {"HEAD_DIM": d, "D_PAD": _pow2(d), "PRECISION": "ieee" if k.dtype == torch.float32 else "tf32"}
        self.bkv = bsz * self.hkv
        self.n_docs, self.longest = len(windows.rows), max(windows.rows)
        # Row passes: each document's keys in chunks (one at least: its partials' identity).
        self.chunk = LAUNCH.block_n * LAUNCH.chunk_blocks
        chunks = [max(1, triton.cdiv(hi - lo, self.chunk)) for lo, hi in windows.key_ranges]
        self.n_chunks = sum(chunks)
        # Mass pass: blocks of key positions x row tiles, both of block_mass (at most the window).
        self.block = min(LAUNCH.block_mass, _pow2(self.longest))
        self.n_tiles = triton.cdiv(self.longest, self.block)
        n_blocks = [triton.cdiv(n, self.block) for n in windows.lengths]
        self.n_items = sum(n_blocks)
        # Each document's region of a run: its blocks and row tiles (see ``_mass_kernel``).
        regions = [(n + self.n_tiles) * self.block for n in n_blocks]
        self.run_len = sum(regions)
        # Pooling: block diagonals per program: 1024 offsets, 2 x 8 KiB of fp64.
        self.per_program = max(1, 1024 // block_size)
        n_diagonals = windows.diagonals(block_size)
        self.n_diagonals = sum(n_diagonals)
        pool_items = [triton.cdiv(n, self.per_program) for n in n_diagonals]
        self.n_pool_items = sum(pool_items)
        # Block sums: each document's key blocks by global position, those it shares with a
        # neighbour included (each sums for its own rows).
        key_blocks = [(b - 1) // block_size - a // block_size + 1 for a, b in windows.bounds]
        self.n_block_items = sum(key_blocks)
        chunk0, item0, run0, pool0, diag0, block0 = (
            list(itertools.accumulate([0, *counts[:-1]]))
            for counts in (chunks, n_blocks, regions, pool_items, n_diagonals, key_blocks)
        )
        table = [[a for a, _ in windows.bounds], windows.lengths, windows.rows, windows.row_offsets,
                 *zip(*windows.key_ranges, strict=True), chunk0, item0, run0, pool0, diag0, block0,
                 [a // block_size for a, _ in windows.bounds]]  # fmt: skip
        # One copy to the device: the table, then the chunks' offsets for the row passes'
        # reduction, from a 16-byte boundary whatever the document count (a kernel reads them,
        # and Triton compiles it again for a pointer of another alignment).
        cells = len(table) * self.n_docs
        head = [*itertools.chain(*table)] + [0] * (-cells % 4)
        flat = to_device(torch.tensor([*head, *chunk0, self.n_chunks], dtype=torch.int32), dev)
        self.tables, self.chunk_offsets = flat[:cells].view(len(table), -1), flat[len(head) :]

    def _row_stats(self, row_max: torch.Tensor | None, attended: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``[M, B, Hq, longest window]``: each document's partials, one per key chunk,
        reduced in order (``segment_reduce``: no atomics, so the sums are deterministic);
        with ``attended``, the kept sums beside the row sums."""
        dtype = torch.float32 if row_max is None else torch.float64
        outs = [
            torch.empty(self.n_chunks, self.q.shape[0], self.hq, self.longest, dtype=dtype, device=self.q.device)
            for _ in range(1 if attended is None else 2)
        ]
        marks = outs[0] if attended is None else attended.contiguous().view(torch.uint8)
        self._launch_rows(
            self.n_chunks, outs[0] if row_max is None else row_max, outs[0], marks, outs[-1], self.chunk_offsets,
            block_n=LAUNCH.block_n if attended is None else min(LAUNCH.block_n, LAUNCH.kept_block_n),
            SUM=row_max is not None, HAS_KEPT=attended is not None, BLOCKS=False,
        )  # fmt: skip
        reduce = "max" if row_max is None else "sum"
        return [torch.segment_reduce(out, reduce, offsets=self.chunk_offsets) for out in outs]

    def _launch_rows(self, items: int, row_max, out, marks, kept, block_first, block_n: int, **modes) -> None:
        """``_row_stats_kernel`` over ``items`` runs of keys, each for every row tile of its
        document's (head, window row) pairs; tensors a mode does not read stand in for its
        unused pointers."""
        rows = self.longest * (self.hq // self.hkv)
        block_m = min(LAUNCH.block_m, _pow2(rows))
        n_blocks = triton.cdiv(self.seq_len, self.block_size)
        _row_stats_kernel[(triton.cdiv(rows, block_m) * items, self.bkv)](
            self.q, self.k, self.key_positions, self.tables, row_max.contiguous(), out, marks, kept, block_first,
            self.n_docs, self.n_rows, self.n_keys, n_blocks, self.longest, *self.scalars, BLOCK_M=block_m,
            BLOCK_N=block_n, CHUNK=self.chunk, num_warps=LAUNCH.rows_warps, num_stages=LAUNCH.rows_stages,
            **modes, **self.dims,
        )  # fmt: skip

    def row_max(self) -> torch.Tensor:
        return self._row_stats(None)[0]

    def row_sum(self, row_max: torch.Tensor) -> torch.Tensor:
        return self._row_stats(row_max)[0]

    def kept_sums(self, row_max: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_sum`` and, in the same pass, the sum over the keys ``attended`` marks for each
        row (bool ``[B, Hq, R, n_keys]``: window row slot, local key)."""
        return tuple(self._row_stats(row_max, attended))

    def block_sums(self, row_max: torch.Tensor) -> torch.Tensor:
        """Per window row, the sum of ``2^(logit - row_max)`` over each ``block_size`` block of
        key positions, ``[B, Hq, R, ceil(seq_len / block_size)]`` fp64 (window row slot, global
        block; 0 where the row sees no key held here): one item per (document, key block), no
        ``[.., R, keys]`` tensor. The terms use the given (reduced) maxima, so the sums of the
        holders of other keys add up to the whole sequence's."""
        bsz, dev = self.q.shape[0], self.q.device
        n_blocks = triton.cdiv(self.seq_len, self.block_size)
        out = torch.zeros(bsz, self.hq, self.n_rows, n_blocks, dtype=torch.float64, device=dev)
        starts = torch.arange(0, (n_blocks + 1) * self.block_size, self.block_size, dtype=torch.int32, device=dev)
        block_first = torch.searchsorted(self.key_positions, starts, out_int32=True)
        block_n = min(LAUNCH.block_n, _pow2(self.block_size))
        self._launch_rows(
            self.n_block_items, row_max, out, out, out, block_first, block_n, SUM=True, HAS_KEPT=False, BLOCKS=True
        )
        return out

    def mass(self, row_max: torch.Tensor, row_sum: torch.Tensor, out: tuple | None = None) -> tuple:
        """The mass pass's outputs (``totals`` adds them up): the vertical window mass
        ``[B, Hq, seq_len]`` fp32 (each key's one writer sums its column in fp32, so adding
        the zeros of the other holders is exact), the diagonal runs, fp64, and the documents
        table that ``totals`` reads (in the graphed build, a buffer of its graph).

        ``out``: the outputs of an earlier call with the same shapes, documents and key
        positions, overwritten. They are not cleared first: the kernel stores to the same
        elements every time (addresses and masks follow from the shapes, the documents and
        the held positions), and the elements it never stores to keep the zeros they were
        made with. Clearing would write the runs again (64 MiB at 128K tokens). Its table
        already holds this call's (the same documents)."""
        bsz, dev = self.q.shape[0], self.q.device
        if out is None:
            vertical = torch.zeros(bsz, self.hq, self.seq_len, dtype=torch.float32, device=dev)
            runs = torch.zeros(bsz, self.hq, self.n_tiles * 2, self.run_len, dtype=torch.float64, device=dev)
            tables = self.tables
        else:
            vertical, runs, tables = out
        _mass_kernel[(self.n_items, self.bkv)](
            self.q, self.k, self.key_at, self.tables, row_max.contiguous(), (1.0 / row_sum).float().contiguous(),
            vertical, runs, self.n_docs, self.n_rows, self.longest, self.seq_len, self.run_len, *self.scalars,
            BLOCK=self.block, num_warps=LAUNCH.mass_warps, **self.dims,
        )  # fmt: skip
        return vertical, runs, tables

    def totals(self, vertical: torch.Tensor, runs: torch.Tensor, tables: torch.Tensor) -> tuple:
        """The window mass per key ``[B, Hq, seq_len]`` (fp32) and per block diagonal of
        ``block_size`` of each document, one after the other, ``[B, Hq, sum_m ceil(L_m /
        block_size)]`` (fp64), from ``mass``'s outputs, the runs added up and pooled in one
        pass (``_pool_kernel``). A document of ``L`` positions and ``w`` window rows has
        ``n = ceil(L / BLOCK)`` key blocks; its row tile ``j`` x key block ``p`` has slot ``t``
        at ``u = (n - 1 - p + j) * BLOCK + t`` of its region, offset ``(L - w + j * BLOCK + r)
        - (p * BLOCK + c)`` with ``t = r - c + BLOCK - 1``, that is ``u - n * BLOCK + L - w +
        1``: the same for every run."""
        bsz, hq, n_runs, _ = runs.shape
        pooled = torch.empty(bsz, hq, self.n_diagonals, dtype=torch.float64, device=runs.device)
        _pool_kernel[(self.n_pool_items, bsz * hq)](
            runs, pooled, tables, self.n_docs, self.n_diagonals, self.run_len, N_RUNS=n_runs, BS=self.block_size,
            DB=self.per_program, BLOCK=self.block,
        )  # fmt: skip
        return vertical, pooled

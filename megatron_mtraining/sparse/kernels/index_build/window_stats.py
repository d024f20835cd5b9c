"""Triton kernels for the vertical-slash observation-window statistics (``WindowKernels``).

Rows are the ``w`` window queries (the sequence's last ``w`` positions) of each
query head of a KV head's group (``G = Hq / Hkv`` heads); columns are the keys
this device holds, at any global positions (a context-parallel shard); a key
after a row's position is masked. Three passes recompute the same fp32 logits
(16-bit products are exact in fp32; fp32 inputs get exact fp32 products), in
log2 units (``logit * log2 e``):

1. row maxima: per (row tile, key chunk, batch x KV head), the chunk's maximum;
2. row normalisers: the same programs sum ``2^(logit - global row max)``;
3. mass: per (block of key *positions*, batch x KV head), found through a position
   -> local key map (-1 where another device holds the key), each head's window
   probabilities summed per key (vertical) and along the token diagonals of each
   (row tile, key block) tile. The diagonals come from a circular skew of the
   tile's rows (``tl.gather``); a tile covers a contiguous run of ``2 * BLOCK``
   token offsets, and the runs are added up outside the kernel. The graphed index
   build keeps the kernel's outputs as its graph's input buffers and has each call's
   kernel write over them without clearing them (``WindowKernels.mass``).

Then, no longer reading K: the runs added up and pooled into the index's block
diagonals in one pass (``_pool_kernel``, ``WindowKernels.totals``), which reads the
runs once and writes ``[B, Hq, n_blocks]``; in torch the sum wrote the ``[B, Hq, S]``
fp64 token profile (16 MiB at 128K) and the pooling read it twice through two
temporaries of its size.

Determinism: every output element has one writer that adds in a fixed order (runs
that overlap go to separate buffers, added by the pooling), so results are bitwise
independent of launch order. Sums over keys, tiles or devices add fp32 terms in
fp64, and no term depends on how the keys are split (exponents use the global row
maxima, not running ones), so a context-parallel split moves the statistics only
at fp64 rounding, far below their final fp32 rounding.

The floor: each pass is a (window rows x sequence x head dim) matmul, passes 2 and 3
add one exponential per logit, each pass reads K once and the mass pass writes fp64
runs (32-key tiles) that the pooling reads again. The mass pass is the slow one: its
skew and fp64 sums cost several times its matmul (docs/benchmarks.md, "Index build on
CUDA: Triton window statistics" and "Index build without a copy of K").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class StatsLaunch:
    """Tile sizes and launch parameters (defaults: sweeps at 128K on an H100, and for the
    mass pass on an H200, where 32-key tiles on 2 warps beat 64-key tiles on 4 warps;
    docs/benchmarks.md, "Index build without a copy of K")."""

    block_m: int = 128  # window rows per tile of the row-statistics passes
    block_n: int = 128  # keys per tile of the row-statistics passes
    chunk_blocks: int = 16  # key tiles per row-statistics program (one partial per chunk)
    rows_warps: int = 4
    rows_stages: int = 2
    # Key positions and window rows per tile of the mass pass; its fp64 runs take
    # 2 * ceil(w / block_mass) x seq_len per head (4 x for the default 64-query window).
    block_mass: int = 32
    mass_warps: int = 2


# Tests shrink the tiles so that tiny inputs span several of each in Triton's interpreter.
LAUNCH = StatsLaunch()


@triton.jit
def _keys(K, b, kvh, idx, ok, sk_b, sk_s, sk_h, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Keys ``[n, D_PAD]`` at local indices ``idx`` (zeros where not ``ok``)."""
    d = tl.arange(0, D_PAD)
    ptrs = K + b.to(tl.int64) * sk_b + kvh * sk_h + idx.to(tl.int64)[:, None] * sk_s + d[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _query_ptrs(Q, b, heads, w, HQ, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Pointers ``[n, D_PAD]`` to window row 0 of query heads ``heads`` (add
    ``row * HQ * HEAD_DIM`` for another row), and the head-dim mask."""
    d = tl.arange(0, D_PAD)
    return Q + (b * w * HQ + heads)[:, None] * HEAD_DIM + d[None, :], d < HEAD_DIM


@triton.jit
def _logits2(q, k, qk_scale, PRECISION: tl.constexpr):
    """Logits in log2 units ``[n_q, n_k]``, fp32."""
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale


@triton.jit
def _probabilities(s, row_max, inv_sum, visible):
    return tl.where(visible, tl.exp2(s - row_max[:, None]) * inv_sum[:, None], 0.0)


@triton.jit
def _row_stats_kernel(
    Q, K, KPOS, ROW_MAX, OUT, n_keys, first_row, w, HQ, HKV, G, sk_b, sk_s, sk_h, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, SUM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Per row of the tile, over the chunk's keys: the maximum logit, or (``SUM``) the
    fp64 sum of ``2^(logit - ROW_MAX)``. Rows are (head of the group, window row); the
    row tiles of a chunk are neighbours in the grid, so they share its keys in L2."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    chunk = tl.program_id(1)
    bk = tl.program_id(2)
    b = bk // HKV
    kvh = bk % HKV
    row_ok = i < G * w
    r = i % w
    heads = kvh * G + i // w
    q_ptrs, d_ok = _query_ptrs(Q, b, heads, w, HQ, HEAD_DIM, D_PAD)
    q = tl.load(q_ptrs + (r * HQ * HEAD_DIM)[:, None], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    row_pos = tl.where(row_ok, first_row + r, -1)
    if SUM:
        row_max = tl.load(ROW_MAX + (b * HQ + heads) * w + r, mask=row_ok, other=0.0)
        acc = tl.zeros([BLOCK_M], tl.float64)
    else:
        acc = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for j0 in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, n_keys), BLOCK_N):
        cols = j0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_keys
        key_pos = tl.load(KPOS + cols, mask=col_ok, other=0)
        s = _logits2(q, _keys(K, b, kvh, cols, col_ok, sk_b, sk_s, sk_h, HEAD_DIM, D_PAD), qk_scale, PRECISION)
        visible = col_ok[None, :] & (key_pos[None, :] <= row_pos[:, None])
        if SUM:
            acc += tl.sum(tl.where(visible, tl.exp2(s - row_max[:, None]), 0.0).to(tl.float64), 1)
        else:
            acc = tl.maximum(acc, tl.max(tl.where(visible, s, float("-inf")), 1))
    rows_pad = tl.num_programs(0) * BLOCK_M
    tl.store(OUT + (bk * tl.num_programs(1) + chunk) * rows_pad + i, acc)


@triton.jit
def _mass_kernel(
    Q, K, KEY_AT, ROW_MAX, INV_SUM, VERT, RUNS, seq_len, w, HQ, HKV, G, sk_b, sk_s, sk_h, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The keys at global positions ``[p * BLOCK, (p + 1) * BLOCK)`` that this device
    holds (``KEY_AT``: local index of a position, -1 elsewhere) against each
    ``BLOCK``-row tile ``j`` of each head's window: the probability mass per key
    (``VERT``, fp32) and the tile's diagonal sums (``RUNS``, fp64): slot ``t`` of the
    tile's run holds the diagonal (row index - key index within the tile) ``t - BLOCK + 1``."""
    p = tl.program_id(0)
    n_blocks = tl.num_programs(0)
    bk = tl.program_id(1)
    b = bk // HKV
    kvh = bk % HKV
    c = tl.arange(0, BLOCK)
    key_pos = p * BLOCK + c
    idx = tl.load(KEY_AT + key_pos, mask=key_pos < seq_len, other=-1)
    held = idx >= 0
    if tl.max(held.to(tl.int32), 0) > 0:  # else every sum is 0: the buffers start at 0
        k = _keys(K, b, kvh, idx, held, sk_b, sk_s, sk_h, HEAD_DIM, D_PAD)
        # Slot u of row r's circular skew holds its key (r - u) mod BLOCK: summed over the
        # rows, the keys at or before the row's index give diagonal u, the others u - BLOCK.
        skew = (c[:, None] - c[None, :] + BLOCK) % BLOCK
        wraps = c[:, None] < c[None, :]
        n_tiles = tl.cdiv(w, BLOCK)
        for g in range(G):
            h = kvh * G + g
            bh = (b * HQ + h).to(tl.int64)
            q_ptrs, d_ok = _query_ptrs(Q, b, h + tl.zeros([BLOCK], tl.int32), w, HQ, HEAD_DIM, D_PAD)
            vertical = tl.zeros([BLOCK], tl.float32)
            for j in range(n_tiles):
                r = j * BLOCK + c
                row_ok = r < w
                q = tl.load(q_ptrs + (r * HQ * HEAD_DIM)[:, None], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                # Rows past the window load a zero 1/sum: their mass is 0.
                row_max = tl.load(ROW_MAX + bh * w + r, mask=row_ok, other=0.0)
                inv_sum = tl.load(INV_SUM + bh * w + r, mask=row_ok, other=0.0)
                visible = held[None, :] & (key_pos[None, :] <= (seq_len - w + r)[:, None])
                prob = _probabilities(_logits2(q, k, qk_scale, PRECISION), row_max, inv_sum, visible)
                vertical += tl.sum(prob, 0)
                skewed = tl.gather(prob, skew, 1)
                near = tl.sum(tl.where(wraps, 0.0, skewed).to(tl.float64), 0)
                far = tl.sum(tl.where(wraps, skewed, 0.0).to(tl.float64), 0)
                # Runs of blocks p and p + 1 overlap by BLOCK slots: they alternate buffers.
                run = RUNS + (((bh * n_tiles + j) * 2 + p % 2) * (n_blocks + n_tiles) + n_blocks - 1 - p + j) * BLOCK
                tl.store(run + BLOCK - 1 + c, near)
                tl.store(run + c - 1, far, mask=c > 0)
            tl.store(VERT + bh * seq_len + key_pos, vertical, mask=held)


@triton.jit
def _pool_kernel(RUNS, OUT, start, seq_len, run_len, n_diagonals, N_RUNS: tl.constexpr, BS: tl.constexpr,
                 DB: tl.constexpr):  # fmt: skip
    """Block-diagonal scores of ``DB`` block diagonals ``d`` of one (batch, head) from the
    mass pass's runs: the token-diagonal mass ``x[o]``, slot ``start + o`` of every run
    summed, pooled as ``vertical_slash._pool_diagonals`` does (its maths of record):
    ``(sum_t (BS - t) x[d BS + t] + sum_t t x[(d - 1) BS + t]) / BS``, the last block
    diagonal also keeping its own spill ``sum_t t x[d BS + t]``; offsets past the sequence
    hold no mass."""
    bh = tl.program_id(1).to(tl.int64)
    d = tl.program_id(0) * DB + tl.arange(0, DB)
    t = tl.arange(0, BS)
    o = d[:, None] * BS + t[None, :]
    here = tl.zeros([DB, BS], tl.float64)
    before = tl.zeros([DB, BS], tl.float64)  # block diagonal d - 1
    for r in tl.static_range(N_RUNS):
        run = RUNS + (bh * N_RUNS + r) * run_len + start
        here += tl.load(run + o, mask=o < seq_len, other=0.0)
        before += tl.load(run + o - BS, mask=(o >= BS) & (o - BS < seq_len), other=0.0)
    spill = t.to(tl.float64)[None, :]
    pooled = tl.sum(here * (BS - spill), 1) + tl.sum(before * spill, 1)
    pooled += tl.where(d == n_diagonals - 1, tl.sum(here * spill, 1), 0.0)  # no diagonal beyond the last
    tl.store(OUT + bh * n_diagonals + d, pooled / BS, mask=d < n_diagonals)


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))


class WindowKernels:
    """The passes of ``window_statistics_from_parts`` on the kernels, for the window
    queries ``[B, w, Hq, D]`` (the sequence's last ``w``) and keys ``[B, n, Hkv, D]`` at
    global positions ``key_positions`` (None: the whole sequence, in order). Row maxima are
    fp32 in log2 units; the caller only hands them back (through its reductions)."""

    def __init__(self, q_window, k, key_positions: torch.Tensor | None, seq_len: int, scale: float):
        self.q = q_window.contiguous()
        self.k = k if k.stride(-1) == 1 else k.contiguous()
        self.seq_len = seq_len
        bsz, self.w, self.hq, d = q_window.shape
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
        self.scalars = (self.w, self.hq, self.hkv, self.hq // self.hkv, *self.k.stride()[:3], scale * LOG2E)
        self.dims = {"HEAD_DIM": d, "D_PAD": _pow2(d), "PRECISION": "ieee" if k.dtype == torch.float32 else "tf32"}
        self.bkv = bsz * self.hkv
        # Mass pass: blocks of key positions x row tiles, both of block_mass (at most the window).
        self.block = min(LAUNCH.block_mass, _pow2(self.w))
        self.n_blocks, self.n_tiles = triton.cdiv(seq_len, self.block), triton.cdiv(self.w, self.block)

    def _row_stats(self, row_max: torch.Tensor | None) -> torch.Tensor:
        launch = LAUNCH
        rows = self.w * (self.hq // self.hkv)
        block_m = min(launch.block_m, _pow2(rows))
        chunk = launch.block_n * launch.chunk_blocks
        grid = (triton.cdiv(rows, block_m), max(1, triton.cdiv(self.n_keys, chunk)), self.bkv)
        dtype = torch.float32 if row_max is None else torch.float64
        out = torch.empty(grid[2], grid[1], grid[0] * block_m, dtype=dtype, device=self.q.device)
        _row_stats_kernel[grid](
            self.q, self.k, self.key_positions, out if row_max is None else row_max.contiguous(), out,
            self.n_keys, self.seq_len - self.w, *self.scalars, BLOCK_M=block_m, BLOCK_N=launch.block_n, CHUNK=chunk,
            SUM=row_max is not None, num_warps=launch.rows_warps, num_stages=launch.rows_stages, **self.dims,
        )  # fmt: skip
        per_row = out.amax(1) if row_max is None else out.sum(1)
        return per_row[:, :rows].reshape(-1, self.hq, self.w)  # rows are (head, window row)

    def row_max(self) -> torch.Tensor:
        return self._row_stats(None)

    def row_sum(self, row_max: torch.Tensor) -> torch.Tensor:
        return self._row_stats(row_max)

    def mass(self, row_max: torch.Tensor, row_sum: torch.Tensor, out: tuple | None = None) -> tuple:
        """The mass pass's outputs (``totals`` adds them up): the vertical window mass
        ``[B, Hq, seq_len]`` fp32 (each key's one writer sums its column in fp32, so adding
        the zeros of the other holders is exact) and the diagonal runs, fp64.

        ``out``: the outputs of an earlier call with the same shapes and key positions,
        overwritten. They are not cleared first: the kernel stores to the same elements
        every time (addresses and masks follow from the shapes and the held positions),
        and the elements it never stores to keep the zeros they were made with. Clearing
        would write the runs again (64 MiB at 128K tokens)."""
        bsz, dev = self.q.shape[0], self.q.device
        if out is None:
            vertical = torch.zeros(bsz, self.hq, self.seq_len, dtype=torch.float32, device=dev)
            runs = torch.zeros(bsz, self.hq, self.n_tiles * 2, (self.n_blocks + self.n_tiles) * self.block,
                               dtype=torch.float64, device=dev)  # fmt: skip
        else:
            vertical, runs = out
        _mass_kernel[(self.n_blocks, self.bkv)](
            self.q, self.k, self.key_at, row_max.contiguous(), (1.0 / row_sum).float().contiguous(), vertical,
            runs, self.seq_len, *self.scalars, BLOCK=self.block, num_warps=LAUNCH.mass_warps, **self.dims,
        )  # fmt: skip
        return vertical, runs

    def totals(self, vertical: torch.Tensor, runs: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window mass per key ``[B, Hq, seq_len]`` (fp32) and per block diagonal of
        ``block_size`` ``[B, Hq, n_diagonals]`` (fp64) from ``mass``'s outputs, the runs
        added up and pooled in one pass (``_pool_kernel``). Row tile ``j`` x key block ``p``
        has its slot ``t`` at ``L = (n_blocks - 1 - p + j) * BLOCK + t``, offset
        ``(seq_len - w + j * BLOCK + r) - (p * BLOCK + c)`` with ``t = r - c + BLOCK - 1``,
        that is ``L - n_blocks * BLOCK + seq_len - w + 1``: the same for every run."""
        bsz, hq, n_runs, run_len = runs.shape
        n_diagonals = triton.cdiv(self.seq_len, block_size)
        pooled = torch.empty(bsz, hq, n_diagonals, dtype=torch.float64, device=runs.device)
        db = max(1, 1024 // block_size)  # block diagonals per program: 1024 offsets, 2 x 8 KiB of fp64
        start = self.n_blocks * self.block - self.seq_len + self.w - 1
        _pool_kernel[(triton.cdiv(n_diagonals, db), bsz * hq)](
            runs, pooled, start, self.seq_len, run_len, n_diagonals, N_RUNS=n_runs, BS=block_size, DB=db
        )
        return vertical, pooled

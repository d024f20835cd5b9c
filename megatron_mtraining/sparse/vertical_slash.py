"""MTraining's dynamic vertical-slash pattern with online top-p budgets.

Per (sample, query head, step), from the softmax of the last ``last_q`` queries
(the observation window, fp32):

* vertical score of key ``j``: the window's average attention on column ``j``;
* slash score of a *block diagonal* ``d`` (tiles with ``query_block - key_block
  == d``): the expected share of a row's attention that the diagonal's tiles
  capture, estimated from the window's token-level diagonal sums. A token
  diagonal at offset ``o = d * bs + t`` (0 <= t < bs) falls in block diagonal
  ``d`` for a fraction ``(bs - t) / bs`` of a block's rows and in ``d + 1`` for
  the rest, so the token profile is pooled with those triangular weights. This
  is the paper's block-pooled slash (the kernel computes whole tiles, so the
  budget is counted in tiles) and it conserves the window's mass.

Budgets: per head, the fewest columns (block diagonals) whose sorted scores
reach ``vertical_topp`` (``slash_topp``) of the total, at most ``vertical_cap``
columns and ``ceil(slash_cap / block_size)`` block diagonals (caps are given in
token lines, as in the reference configs). ``sink_tokens`` first columns and the
block diagonals that hold the last ``local_window`` offsets are added on top, and block
diagonal 0 always is (each query attends at least the keys of its own block up to itself).

Statistics and selection are separate so that a context-parallel builder can
reduce partial statistics across ranks and run the same selection everywhere.

Packed documents (``cu_seqlens``): each document gets the index built on it alone, from
its own last window and budgets, placed at its offset (its columns shifted by its start;
its block-diagonal offsets kept, on the sequence's block grid, which a document that
starts inside a block meets at another phase than its own grid); a document shorter than
``dense_below`` tokens attends densely (every diagonal it touches) without statistics, and
so does a (head, document) whose selected index would cost the kernels no less than that
(``dense_if_cheaper``). The documents' statistics are computed together
(``document_statistics_from_parts``: each document's window against its own keys, one pass
for all of them) and selected together. ``VerticalSlashIndex`` states what the
per-document lists mean.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cuda_graphs import GraphedCalls, graphs_enabled
from .dispatch import backend_choice, index_kernels
from .documents import Documents, packed_documents
from .host_tables import to_device
from .index import INT32_MAX, VerticalSlashIndex, single_device, sort_kept
from .kernels.block_bar.tables import keep_tables, tile_tables
from .validation import (
    ValidatedConfig,
    check_choice,
    check_fraction,
    check_int,
    check_power_of_two,
    check_qk,
    check_softmax_scale,
    fail,
    setting,
)


@dataclass(frozen=True)
class VerticalSlashConfig(ValidatedConfig):
    last_q: int = setting(64, check_int, minimum=1)
    vertical_topp: float = setting(0.9, check_fraction)
    slash_topp: float = setting(0.9, check_fraction)
    vertical_cap: int = setting(4096, check_int, minimum=1)
    slash_cap: int = setting(4096, check_int, minimum=1)
    block_size: int = setting(64, check_power_of_two, minimum=16)
    sink_tokens: int = setting(0, check_int, minimum=0)
    local_window: int = setting(0, check_int, minimum=0)
    # Packed documents (cu_seqlens given) shorter than this many tokens attend densely, with
    # no statistics: under 1024 tokens a document's whole causal triangle is at most 0.5M
    # pairs (1/16000 of a 128K sequence's), and its sparse index (a few block diagonals of
    # 64) would save next to nothing for the window rows its statistics add. 0: every
    # document gets its own sparse index. Without cu_seqlens the sequence is one document
    # and keeps its sparse index at any length.
    dense_below: int = setting(1024, check_int, minimum=0)
    # Packed documents: a (head, document) whose selected index would compute no less than
    # its whole causal triangle (its tiles plus its columns' bar work, the kernels' cost)
    # attends densely instead. Short documents with flat statistics keep nearly every
    # diagonal and column, and their columns are then bars that every block walks inside
    # tiles it computes anyway. The mask only grows. False keeps every selected index.
    dense_if_cheaper: bool = setting(True, check_choice, choices=(True, False))

    @property
    def slash_block_cap(self) -> int:
        return -(-self.slash_cap // self.block_size)


@dataclass
class WindowStatistics:
    """Observation-window statistics, fp32, each normalised to sum to 1 per head (and
    document: the per-document statistics carry a documents axis before the last)."""

    vertical: torch.Tensor  # [B, Hq, S]: mass per key column (per document: [B, Hq, M, longest])
    slash: torch.Tensor  # [B, Hq, n_blocks]: expected mass per block diagonal ([B, Hq, M, most diagonals])


@dataclass(frozen=True)
class ObservationWindows:
    """Where the window statistics look, on the host: documents ``[a, b)`` of a sequence of
    ``seq_len`` tokens (global positions, ascending, not necessarily adjacent), each with its
    last ``rows[m]`` query rows against its own keys only. The window rows are laid out
    document after document; the keys are the sequence's or some of them (a context-parallel
    rank's), ``key_ranges[m]`` the local indices ``[lo, hi)`` of document ``m``'s keys."""

    seq_len: int
    bounds: tuple[tuple[int, int], ...]
    rows: tuple[int, ...]
    key_ranges: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, seq_len: int, rows: int, n_keys: int) -> ObservationWindows:
        """The sequence as one document: its last ``rows`` rows against all ``n_keys`` keys
        (at positions in any order)."""
        return cls(seq_len, ((0, seq_len),), (rows,), ((0, n_keys),))

    @classmethod
    def of_documents(
        cls, bounds, last_q: int, seq_len: int, key_positions: torch.Tensor | None = None
    ) -> ObservationWindows:
        """Documents ``bounds``, each with its last ``min(last_q, b - a)`` rows; keys at the
        host positions ``key_positions`` (None: every position, in order), which must ascend
        so that each document's keys are one run of them (every layout's positions do)."""
        bounds = tuple((int(a), int(b)) for a, b in bounds)
        return cls(seq_len, bounds, tuple(min(last_q, b - a) for a, b in bounds), _key_ranges(bounds, key_positions))

    @classmethod
    def of_rows(
        cls, rows: Sequence[int], doc_bounds: Sequence[int], seq_len: int, key_positions: torch.Tensor | None = None
    ) -> ObservationWindows:
        """The query rows at the ascending positions ``rows``, each against its document's keys
        up to itself (``doc_bounds``: the documents' boundaries ``[0, ..., S]``): one window
        per run of consecutive rows inside one document, as the window of that document cut
        at the run's end. Such windows may overlap, which only the row passes (``row_max``,
        ``row_sum``, ``kept_sums``) allow. Keys as in :meth:`of_documents`."""
        runs: list[list[int]] = []  # [document start, first row, end]
        for row in rows:
            start = doc_bounds[bisect.bisect_right(doc_bounds, row) - 1]
            if runs and runs[-1][2] == row and runs[-1][0] == start:
                runs[-1][2] += 1
            else:
                runs.append([start, row, row + 1])
        bounds = tuple((a, end) for a, _, end in runs)
        return cls(seq_len, bounds, tuple(end - first for _, first, end in runs), _key_ranges(bounds, key_positions))

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in self.bounds]

    @property
    def row_offsets(self) -> list[int]:
        """Where each document's window rows start among all the window rows."""
        return _offsets(self.rows)

    def row_positions(self) -> list[int]:
        """The global positions of the window rows, document after document (ascending)."""
        return [p for (a, b), w in zip(self.bounds, self.rows, strict=True) for p in range(b - w, b)]

    def diagonals(self, block_size: int) -> list[int]:
        """Each document's block diagonals (of its own length, not the sequence's)."""
        return [-(-n // block_size) for n in self.lengths]


def _key_ranges(bounds, key_positions: torch.Tensor | None) -> tuple[tuple[int, int], ...]:
    """The local indices ``[lo, hi)`` of each document's keys among keys at the host
    positions ``key_positions`` (None: every position, in order)."""
    if key_positions is None:
        return tuple(bounds)
    descending = torch.nonzero(key_positions[1:] <= key_positions[:-1]).flatten()
    if len(descending):
        i = int(descending[0]) + 1
        fail(f"key_positions[{i}]", int(key_positions[i]), f"a position after key_positions[{i - 1}] = "
             f"{int(key_positions[i - 1])}: strictly ascending, so that each document's keys are one run")  # fmt: skip
    edges = torch.searchsorted(key_positions, torch.tensor(bounds, dtype=key_positions.dtype))
    return tuple((int(lo), int(hi)) for lo, hi in edges.tolist())


def _offsets(counts) -> list[int]:
    """Where each of ``counts`` consecutive runs starts."""
    return list(itertools.accumulate([0, *counts[:-1]]))


def window_statistics(
    q: torch.Tensor, k: torch.Tensor, config: VerticalSlashConfig, softmax_scale: float | None = None
) -> WindowStatistics:
    check_qk(q, k)
    seq = q.shape[1]
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    w = min(config.last_q, seq)
    return window_statistics_from_parts(q[:, seq - w :], k, None, seq, config, scale)


def window_statistics_from_parts(
    q_window: torch.Tensor,
    k: torch.Tensor,
    key_positions: torch.Tensor | None,
    seq_len: int,
    config: VerticalSlashConfig,
    scale: float,
    all_reduce_max=single_device,
    all_reduce_sum=single_device,
    key_chunk: int = 4096,
) -> WindowStatistics:
    """Window statistics from the window queries (the sequence's last ``w`` positions)
    and *some* of the keys, given with their global positions (None: all of them, in
    order); ``all_reduce_*`` combine partial results across the holders of the other keys
    (identity on one device): :func:`document_statistics_from_parts` of the sequence as one
    document."""
    windows = ObservationWindows.whole(seq_len, q_window.shape[1], k.shape[1])
    return _one_window(
        document_statistics_from_parts(
            q_window, k, key_positions, windows, config, scale, all_reduce_max, all_reduce_sum, key_chunk
        )
    )


def document_statistics_from_parts(
    q_windows: torch.Tensor,
    k: torch.Tensor,
    key_positions: torch.Tensor | None,
    windows: ObservationWindows,
    config: VerticalSlashConfig,
    scale: float,
    all_reduce_max=single_device,
    all_reduce_sum=single_device,
    key_chunk: int = 4096,
) -> WindowStatistics:
    """The window statistics of every document of ``windows`` at once, stacked
    ``[B, Hq, M, longest]`` (zero-padded): document ``m``'s equal those of its rows and keys
    alone (``window_statistics_from_parts`` on them, positions taken from its start).
    ``q_windows [B, R, Hq, D]``: the documents' window rows one after the other; ``k`` and
    ``key_positions`` (global; None: every position, in order) as there.

    The row maxima, row normalisers and column / diagonal mass come from the Triton
    kernels where ``backend_choice`` picks them (CUDA inputs: one launch per pass for all
    documents), else from the fp64 reference below; both round to fp32 once, at the end,
    so the result does not depend on how the keys are split or summed: a context-parallel
    build (one reduction per pass for all documents) equals this one.

    Against a document's own build (``window_statistics_from_parts``) the rule is equality
    to fp32 rounding: the same terms, but fp64 sums may add them in another order before
    the one rounding, a window shorter than the longest sums its fp32 column mass over the
    longest's row tiles, and where the windows differ in length each document is divided
    by its rows as a tensor rather than a scalar (a last-bit difference). The selection is
    the same unless two candidates' scores tie to within that rounding."""
    parts, mass = _key_passes(
        q_windows, k, key_positions, windows, scale, config.block_size, all_reduce_max, all_reduce_sum, key_chunk
    )
    return _from_mass(parts, mass(), all_reduce_sum)


def _key_passes(
    q_windows, k, key_positions, windows: ObservationWindows, scale: float, block_size: int,
    all_reduce_max=single_device, all_reduce_sum=single_device, key_chunk: int = 4096,
):  # fmt: skip
    """The passes over the keys: the row maxima and normalisers, run now, then the parts
    and their mass pass, ``mass()``, for the caller to run (the graphed build has it write
    into its graph's input buffers: ``mass(out)``)."""
    parts = window_parts(q_windows, k, key_positions, windows, scale, block_size, key_chunk)
    row_max = all_reduce_max(parts.row_max())  # every window row sees its document's first key: finite
    row_sum = all_reduce_sum(parts.row_sum(row_max))
    return parts, functools.partial(parts.mass, row_max, row_sum)


def window_parts(
    q_windows, k, key_positions, windows: ObservationWindows, scale: float, block_size: int, key_chunk: int = 4096
):
    """The passes over the keys of ``windows``' rows, on the Triton kernels where
    ``backend_choice`` picks them (``WindowKernels``), else in fp64 torch
    (``_ReferenceParts``): ``row_max()``, ``row_sum(row_max)``, ``kept_sums(row_max,
    attended)`` (each ``[M, B, Hq, longest window]``, the maxima in each one's own units),
    ``block_sums(row_max)`` (per row and key block: MSA's block recall), and the
    vertical-slash mass passes."""
    if backend_choice(q_windows) == "triton":
        from .kernels.index_build.window_stats import WindowKernels  # imports Triton

        return WindowKernels(q_windows, k, key_positions, windows, scale, block_size)
    return _ReferenceParts(q_windows, k, key_positions, windows, scale, block_size, key_chunk)


def _from_mass(parts, mass: tuple, all_reduce_sum=single_device) -> WindowStatistics:
    """The per-document statistics from the mass pass's outputs, which is where the graphed
    build's graph starts (see ``build_vertical_slash_index``). The diagonals are pooled
    before they are reduced across devices (pooling is linear): a context-parallel build
    sums ``[B, Hq, S]`` column mass and each document's pooled diagonals, not its token
    profile. Then each document's share is taken (one gather) and divided by its rows."""
    vertical, slash = (all_reduce_sum(t) for t in parts.totals(*mass))
    windows = parts.windows
    n_diagonals = windows.diagonals(parts.block_size)
    stacked = (
        _stacked(vertical, [a for a, _ in windows.bounds], windows.lengths),
        _stacked(slash, _offsets(n_diagonals), n_diagonals),
    )
    if len(set(windows.rows)) == 1:  # a scalar: no copy to the device (the graphed build's case)
        return WindowStatistics(*((t / windows.rows[0]).float() for t in stacked))
    rows = to_device(torch.tensor(windows.rows).view(-1, 1), vertical.device)  # integers: each t divides in its dtype
    return WindowStatistics(*((t / rows).float() for t in stacked))


def _one_window(stats: WindowStatistics) -> WindowStatistics:
    """The statistics of a single document without their documents axis."""
    return WindowStatistics(stats.vertical.squeeze(-2), stats.slash.squeeze(-2))


class _ReferenceParts:
    """The window softmax in fp64 torch over key chunks: the maths of record.

    Everything is fp64 from the logits on (products of fp32 values are exact in
    fp64), so partial results add up the same however the keys are split. A host loop
    over each document's keys in chunks: the CPU is not launch-bound.
    """

    def __init__(self, q_windows, k, key_positions, windows: ObservationWindows, scale: float, block_size: int,
                 key_chunk: int):  # fmt: skip
        self.qw = q_windows.double().unflatten(2, (k.shape[2], q_windows.shape[2] // k.shape[2]))
        if key_positions is None:
            key_positions = torch.arange(k.shape[1], device=k.device)
        self.k, self.key_positions, self.windows = k, key_positions, windows
        self.scale, self.block_size = scale, block_size
        self.pieces = [
            (m, c0, min(c0 + key_chunk, hi)) for m, (lo, hi) in enumerate(windows.key_ranges)
            for c0 in range(lo, hi, key_chunk)
        ]  # fmt: skip
        self.row_offsets = windows.row_offsets

    def logits(self, m: int, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Document ``m``'s window rows against its keys ``[c0, c1)``: logits ``[B, Hq, w, n]``
        (-inf after the row), the keys' positions and the rows'."""
        end, w, first = self.windows.bounds[m][1], self.windows.rows[m], self.row_offsets[m]
        rows = torch.arange(end - w, end, device=self.k.device)
        pos = self.key_positions[c0:c1]
        chunk = torch.einsum("bwkgd,bskd->bkgws", self.qw[:, first : first + w], self.k[:, c0:c1].double())
        chunk = chunk.flatten(1, 2) * self.scale
        return chunk.masked_fill(pos.view(1, -1) > rows.view(-1, 1), float("-inf")), pos, rows

    def _row_stats(self, fill: float) -> torch.Tensor:
        """``[M, B, Hq, longest window]`` of ``fill`` (rows past a document's window keep it)."""
        bsz, _, hkv, g, _ = self.qw.shape
        shape = (len(self.windows.rows), bsz, hkv * g, max(self.windows.rows))
        return torch.full(shape, fill, dtype=torch.float64, device=self.k.device)

    def row_max(self) -> torch.Tensor:
        row_max = self._row_stats(float("-inf"))
        for m, c0, c1 in self.pieces:
            w = self.windows.rows[m]
            row_max[m, ..., :w] = torch.maximum(row_max[m, ..., :w], self.logits(m, c0, c1)[0].amax(-1))
        return row_max

    def row_sum(self, row_max: torch.Tensor) -> torch.Tensor:
        return self.kept_sums(row_max, None)[0]

    def kept_sums(self, row_max: torch.Tensor, attended: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_sum`` and the sum over the keys ``attended`` marks for each row (bool ``[B, Hq,
        R, n_keys]``: window row slot, local key; None: no kept sums, zeros)."""
        row_sum, kept = self._row_stats(0.0), self._row_stats(0.0)
        for m, c0, c1 in self.pieces:
            w, first = self.windows.rows[m], self.row_offsets[m]
            probs = torch.exp(self.logits(m, c0, c1)[0] - row_max[m, ..., :w, None])
            row_sum[m, ..., :w] += probs.sum(-1)
            if attended is not None:
                kept[m, ..., :w] += (probs * attended[:, :, first : first + w, c0:c1]).sum(-1)
        return row_sum, kept

    def block_sums(self, row_max: torch.Tensor) -> torch.Tensor:
        """Per window row, the sum of ``exp(logit - row_max)`` over each ``block_size`` block
        of key positions, ``[B, Hq, R, ceil(seq_len / block_size)]`` (window row slot, global
        block)."""
        bsz, rows, hkv, g, _ = self.qw.shape
        n_blocks = -(-self.windows.seq_len // self.block_size)
        out = torch.zeros(bsz, hkv * g, rows, n_blocks, dtype=torch.float64, device=self.k.device)
        for m, c0, c1 in self.pieces:
            w, first = self.windows.rows[m], self.row_offsets[m]
            chunk, pos, _ = self.logits(m, c0, c1)
            probs = torch.exp(chunk - row_max[m, ..., :w, None])
            out[:, :, first : first + w].index_add_(-1, (pos // self.block_size).long(), probs)
        return out

    def mass(self, row_max: torch.Tensor, row_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The window mass summed over each document's rows: per key ``[B, Hq, seq_len]``,
        and per token diagonal ``[B, Hq, sum_m ceil(L_m / block_size) * block_size]``, the
        documents' profiles one after the other, each padded to whole blocks."""
        n_diagonals = self.windows.diagonals(self.block_size)
        vertical = torch.zeros(*row_max.shape[1:3], self.windows.seq_len, dtype=torch.float64, device=self.k.device)
        token_slash = torch.zeros(*row_max.shape[1:3], sum(n_diagonals) * self.block_size, dtype=torch.float64,
                                  device=self.k.device)  # fmt: skip
        firsts = [d * self.block_size for d in _offsets(n_diagonals)]
        for m, c0, c1 in self.pieces:
            chunk, pos, rows = self.logits(m, c0, c1)
            w = self.windows.rows[m]
            probs = torch.exp(chunk - row_max[m, ..., :w, None]) / row_sum[m, ..., :w, None]
            vertical[..., pos] = probs.sum(2)
            offset = rows.view(-1, 1) - pos.view(1, -1)  # token diagonal of each (row, key)
            slot = firsts[m] + offset.clamp(min=0)
            token_slash.index_add_(2, slot.flatten(), (probs * (offset >= 0)).flatten(2))
        return vertical, token_slash

    def totals(self, vertical: torch.Tensor, token_slash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mass per key and per block diagonal of each document (one after the other)."""
        ends = [n - 1 for n in itertools.accumulate(self.windows.diagonals(self.block_size))]
        return vertical, _pool_diagonals(token_slash, self.block_size, ends)


def _pool_diagonals(token_slash: torch.Tensor, block_size: int, ends: list[int] | None = None) -> torch.Tensor:
    """Token-diagonal profile ``[..., S]`` -> block-diagonal scores ``[..., n_blocks]``. With
    ``ends``, the profile is several documents' one after the other, each a whole number of
    blocks, and ``ends`` the index of each one's last block: each pools on its own."""
    seq = token_slash.shape[-1]
    n_blocks = -(-seq // block_size)
    if n_blocks * block_size != seq:
        token_slash = torch.nn.functional.pad(token_slash, (0, n_blocks * block_size - seq))
    blocks = token_slash.unflatten(-1, (n_blocks, block_size))
    t = torch.arange(block_size, device=token_slash.device, dtype=token_slash.dtype)
    pooled = (blocks * (block_size - t)).sum(-1)
    spill = (blocks * t).sum(-1)  # goes to diagonal d + 1, unless d is its document's last
    ends = [n_blocks - 1] if ends is None else ends
    pooled[..., 1:] += spill.index_fill(-1, to_device(torch.tensor(ends), spill.device), 0.0)[..., :-1]
    pooled[..., ends] += spill[..., ends]  # no diagonal beyond a document's last: keep the mass
    return pooled / block_size


def _selected(scores: torch.Tensor, p: float, cap: int, forced: int) -> torch.Tensor:
    """Ascending indices (-1 padded) of the fewest top entries of ``scores [..., n]`` whose
    mass reaches ``p`` of the total (at most ``cap``, never a zero-mass entry) and of the
    first ``forced`` ones. The width is the bound ``min(forced, n) + min(cap, n)`` rather
    than the longest row, which would read the counts from the device; the kernels read
    each row's own prefix, not the padding."""
    values = _candidates(scores, p, cap, forced)
    return sort_kept(values, values.shape[-1])


def _candidates(scores: torch.Tensor, p: float, cap: int, forced: int) -> torch.Tensor:
    """Unsorted candidates of :func:`_selected` (``INT32_MAX``: none), ``[..., min(forced, n)
    + min(cap, n)]``: the first ``forced`` indices, then the top entries until the mass
    reaches ``p``."""
    # The best fp32 scores are the best of their fp64 copies (the conversion is exact and
    # monotonic); sums are fp64.
    top, order = scores.topk(min(cap, scores.shape[-1]), dim=-1)
    limit = scores.sum(-1, keepdim=True, dtype=torch.float64) * p
    n_first = min(forced, scores.shape[-1])
    if index_kernels(scores):
        from .kernels.index_build.top_p import take_top_p  # imports Triton

        return take_top_p(top, order, limit, forced, n_first)
    return _taken(top, order, limit, forced, n_first)


def _taken(top, order, limit, forced: int, n_first: int) -> torch.Tensor:
    """The first ``n_first`` indices, then each candidate's (best first) where the budget
    takes it (the mass of the better candidates is below ``limit``) and it is not among
    the first ``forced``, else ``INT32_MAX``."""
    top = top.double()
    take = (top.cumsum(-1) - top < limit) & (top > 0) & (order >= forced)
    first = torch.arange(n_first, device=order.device).expand(*order.shape[:-1], -1)
    return torch.cat([first, torch.where(take, order, INT32_MAX)], -1)


def select_vertical_slash(stats: WindowStatistics, config: VerticalSlashConfig, seq_len: int) -> VerticalSlashIndex:
    # Block diagonal 0 is always forced: it holds each query's own key, so no row can be left
    # attending nothing (zero output) where the budgets skip every column and diagonal it sees.
    local_diagonals = (config.local_window - 1) // config.block_size + 2 if config.local_window else 1
    return VerticalSlashIndex(
        vertical=_selected(stats.vertical, config.vertical_topp, config.vertical_cap, config.sink_tokens),
        slash=_selected(stats.slash, config.slash_topp, config.slash_block_cap, local_diagonals),
        seq_len=seq_len,
        block_size=config.block_size,
    )


# Index builds replayed from CUDA graphs, one per (device, shapes, config, the mass pass's
# tiles); two cover a training run's shape and an evaluation's. Each graph holds its input
# buffers, the mass pass's outputs (the [B, Hq, S] fp32 vertical mass and the fp64 runs,
# 4 x [B, Hq, S] for a 64-query window: 72 MiB at 128K with 16 heads), and a private memory
# pool with the rest of the build's intermediates: the [B, Hq, S] fp32 and fp64 statistics,
# the top-p selection's buffers and the tile tables.
_GRAPHS = GraphedCalls(size=2)
# The per-document builds' graphs, keyed by the documents' bounds besides: a training step's
# packing (its layers replay the graph its first layer captured) and the one before it.
_DOCUMENT_GRAPHS = GraphedCalls(size=2)


@torch.no_grad()
def build_vertical_slash_index(
    q: torch.Tensor,
    k: torch.Tensor,
    config: VerticalSlashConfig,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> VerticalSlashIndex:
    """The vertical-slash index of q ``[B, S, Hq, D]`` and k ``[B, S, Hkv, D]``; with
    ``cu_seqlens`` (packed documents, see ``documents.packed_documents``), one index per
    document (:func:`build_document_index`).

    Where the statistics run on the kernels and CUDA graphs apply (``cuda_graphs.graphs_enabled``;
    ``MTRAINING_INDEX_GRAPHS=0`` turns them off), the passes over the keys run as they come
    (three Triton kernels and a few reductions) and what follows from the mass pass (the
    statistics, the selection and the tile tables: dozens of small kernels) replays one
    graph, equal bit for bit to the eager build; the tables are kept for the index
    (``tables.keep_tables``), so that ``sparse_attention`` does not build them again. The
    passes that read K stay out of the graph because K differs per layer: a graph reads
    fixed addresses, so it would need a copy of K (64 MiB at 128K tokens); the mass kernel
    writes into the graph's input buffers instead."""
    check_qk(q, k)
    seq = q.shape[1]
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    documents = packed_documents(cu_seqlens, seq, q.device)
    if documents is not None:
        index = build_document_index(q, k, config, scale, documents)
        if q.is_cuda:  # its tables in one launch now (tables_kernel), not in the forward
            keep_tables(index, tile_tables(index))
        return index
    q_window = q[:, seq - min(config.last_q, seq) :]
    if not (graphs_enabled(q) and backend_choice(q) == "triton"):
        return select_vertical_slash(window_statistics_from_parts(q_window, k, None, seq, config, scale), config, seq)
    windows = ObservationWindows.whole(seq, q_window.shape[1], k.shape[1])
    parts, mass = _key_passes(q_window, k, None, windows, scale, config.block_size)

    def index_and_tables(*outputs):
        index = select_vertical_slash(_one_window(_from_mass(parts, outputs)), config, seq)
        return index, tile_tables(index)

    key = (q.device, q.shape[0], q.shape[2], seq, config, parts.block)
    index, tables = _GRAPHS.call(key, index_and_tables, mass)
    keep_tables(index, tables)
    return index


@torch.no_grad()
def build_document_index(
    q: torch.Tensor, k: torch.Tensor, config: VerticalSlashConfig, scale: float, documents: Documents
) -> VerticalSlashIndex:
    """The vertical-slash index of packed documents: document ``[a, b)`` gets the index
    built on ``q[:, a:b]``, ``k[:, a:b]`` alone (its last ``last_q`` queries' statistics, its
    budgets and forced entries), its columns placed at ``a``, its block-diagonal offsets as
    they are; one shorter than ``config.dense_below`` gets every diagonal of the blocks it
    touches and no column (dense, no statistics), as does a head whose selected index
    would cost the kernels no less (``config.dense_if_cheaper``: ``dense_is_cheaper``).

    Cost: the sparse documents' window rows gathered (one gather), their statistics in one
    batched pass (``document_statistics_from_parts``: each document's window against its
    own keys only, together no more than one window over the whole sequence reads; on CUDA
    about two dozen launches, the Triton passes and the small operations around them,
    whatever the number of documents), then one selection for all of them and the dense
    ones (``document_lists``: ~40 launches). The bounds were read on the host once, with
    ``cu_seqlens``, and the longest vertical list is read once, to cut the lists' width.

    Where CUDA graphs apply (as for the whole sequence's build), everything after the mass
    pass up to that read replays a graph keyed by the documents' bounds: the layers of a
    training step share one packing, so the step's first layer captures it and the others
    replay it, where an eager build's host time (its launches) exceeded its device time."""
    b, h = q.shape[0], q.shape[2]
    sparse = [documents.bounds[m : m + 2] for m in sparse_documents(documents, config)]
    if not sparse:  # no statistics: a few launches
        return document_index(documents, config, b, h, q.device, None)
    windows = ObservationWindows.of_documents(sparse, config.last_q, q.shape[1])
    q_windows = q.index_select(1, to_device(torch.tensor(windows.row_positions()), q.device))
    if not (graphs_enabled(q) and backend_choice(q) == "triton"):
        stats = lambda _: document_statistics_from_parts(q_windows, k, None, windows, config, scale)  # noqa: E731
        return document_index(documents, config, b, h, q.device, stats)
    parts, mass = _key_passes(q_windows, k, None, windows, scale, config.block_size)

    def lists(*outputs):
        return (document_lists(documents, config, b, h, q.device, lambda _: _from_mass(parts, outputs)),)

    key = ("documents", q.device, b, h, q.shape[1], config, parts.block, documents.bounds)
    (index,) = _DOCUMENT_GRAPHS.call(key, lists, mass)
    # The captured call's documents carry the same bounds; the caller's are the ones it holds.
    return cut_vertical(dataclasses.replace(index, documents=documents))


def sparse_documents(documents: Documents, config: VerticalSlashConfig) -> list[int]:
    """The documents that get statistics (at least ``config.dense_below`` tokens), in order."""
    bounds = documents.bounds
    return [m for m in range(documents.count) if bounds[m + 1] - bounds[m] >= config.dense_below]


def document_index(
    documents: Documents, config: VerticalSlashConfig, batch: int, heads: int, device, statistics
) -> VerticalSlashIndex:
    """``document_lists`` with the vertical lists cut to the longest (``cut_vertical``)."""
    return cut_vertical(document_lists(documents, config, batch, heads, device, statistics))


def cut_vertical(index: VerticalSlashIndex) -> VerticalSlashIndex:
    """``index`` with its vertical lists cut to the longest kept. The lists' width bounds every
    document's cap at once (56535 entries a head for 24 documents at 128K) where a head keeps
    a few hundred columns, and the kernels size their bar K/V gathers and dK/dV partials by
    it: the cut costs one read on the host (bench_documents times what it saves), made after
    the build's other launches are queued."""
    vertical = index.vertical
    if vertical.shape[-1] == 0:
        return index
    return dataclasses.replace(index, vertical=vertical[..., : int((vertical >= 0).sum(-1).max())].contiguous())


def document_lists(
    documents: Documents, config: VerticalSlashConfig, batch: int, heads: int, device, statistics
) -> VerticalSlashIndex:
    """The per-document index, its vertical lists at full width (``sort_kept``'s bound), from
    ``statistics(bounds)``: the window statistics of the documents ``bounds`` (those of
    ``sparse_documents``, as ``(a, b)`` pairs), each alone, stacked as
    ``document_statistics_from_parts`` gives them (on one device, or reduced over a
    context-parallel group); see ``build_document_index``.
    The selection runs once for every document: ``select_vertical_slash``'s budgets taken
    per (head, document) on the stacked statistics (zero-padded to the longest; a zero is
    never taken), equal to each document's own selection (``_selected_per_document``),
    less its covered columns (``uncovered_columns``), dense where that costs no more
    (``dense_is_cheaper``)."""
    bs, bounds = config.block_size, documents.bounds
    docs = list(zip(bounds[:-1], bounds[1:], strict=True))
    spans = [(b - 1) // bs - a // bs + 1 for a, b in docs]
    sparse = sparse_documents(documents, config)
    lengths = [docs[m][1] - docs[m][0] for m in sparse]
    n_diagonals = [-(-n // bs) for n in lengths]
    local_diagonals = (config.local_window - 1) // config.block_size + 2 if config.local_window else 1
    # Each document's own list widths (``_selected``'s bound): the vertical lists concatenated
    # (``cut_vertical`` cuts them to the longest kept), the slash lists padded to the widest.
    vertical_width = sum(min(config.sink_tokens, n) + min(config.vertical_cap, n) for n in lengths)
    slash_width = max(
        [*spans, *(min(local_diagonals, n) + min(config.slash_block_cap, n) for n in n_diagonals)], default=0
    )
    j = torch.arange(slash_width, device=device, dtype=torch.int32)
    span_of = to_device(torch.tensor(spans, dtype=torch.int32), device)
    # Dense documents: every diagonal of the blocks they touch (sparse ones are written over).
    slash = torch.where(j < span_of.view(-1, 1), j, -1).expand(batch, heads, -1, -1).contiguous()
    if not sparse:
        vertical = torch.full((batch, heads, 0), -1, dtype=torch.int32, device=device)
        return VerticalSlashIndex(vertical, slash, documents.seq_len, bs, documents)
    stats = statistics([docs[m] for m in sparse])
    host = torch.tensor([[docs[m][0] for m in sparse], lengths, n_diagonals], dtype=torch.int64)
    starts, n_keys, n_blocks = to_device(host, device).unbind(0)
    columns = _selected_per_document(
        stats.vertical, n_keys, config.vertical_topp, config.vertical_cap, config.sink_tokens
    )
    columns = torch.where(columns != INT32_MAX, columns + starts.view(-1, 1).int(), INT32_MAX)
    diagonals = _selected_per_document(
        stats.slash, n_blocks, config.slash_topp, config.slash_block_cap, local_diagonals
    )
    diagonals = sort_kept(diagonals, min(slash_width, diagonals.shape[-1]))
    columns = uncovered_columns(columns, diagonals, starts + n_keys, bs)
    diagonals = torch.nn.functional.pad(diagonals, (0, slash_width - diagonals.shape[-1]), value=-1)
    sparse_at = to_device(torch.tensor(sparse), device)
    if config.dense_if_cheaper:
        columns, diagonals = dense_where_cheaper(columns, diagonals, starts // bs, span_of[sparse_at], bs)
    vertical = sort_kept(columns.flatten(2), vertical_width)
    slash.index_copy_(2, sparse_at, diagonals)
    return VerticalSlashIndex(vertical, slash, documents.seq_len, bs, documents)


def uncovered_columns(columns: torch.Tensor, diagonals: torch.Tensor, ends: torch.Tensor, block: int) -> torch.Tensor:
    """Documents' selected columns ``[B, H, M, n]`` (global positions, ``INT32_MAX``: none)
    less those that every row able to see them already reads through a tile, given each
    document's ascending, -1 padded diagonals ``[B, H, M, w]`` and end ``ends [M]``.

    The query blocks that see a column ``c`` of document ``m`` through its diagonals (the
    document's rows in a block that it starts inside see ``c`` in their own tile) are
    ``c // block`` up to the document's last block ``L``, at diagonals ``0 .. L - c // block``.
    When the document's diagonals hold all of those, every such row reads ``c`` in a tile
    and the kernels skip it as a bar: listing it changes no row's keys (``to_dense_mask`` is
    the same) but costs its K/V gather, a bar step of every block from ``c`` on, and its
    dK/dV program. A document whose budgets keep all its diagonals (a short one under flat
    statistics) loses every column this way; one missing an early diagonal keeps nearly all."""
    slots = torch.arange(diagonals.shape[-1], device=diagonals.device)
    # Ascending distinct diagonals from 0: the first missing one is the count of leading
    # entries equal to their slot (a -1 pad equals none).
    first_missing = (diagonals == slots).sum(-1, keepdim=True)
    last_block = ((ends - 1) // block).view(-1, 1)
    covered = columns.long() // block > last_block - first_missing
    return torch.where(covered, INT32_MAX, columns)


def dense_is_cheaper(
    columns: torch.Tensor, diagonals: torch.Tensor, first_block: torch.Tensor, span: torch.Tensor, block: int
) -> torch.Tensor:
    """``[B, H, M]``: whether each (head, document)'s selected index costs the kernels no
    less than the document's whole causal triangle, counted in key rows a query block
    computes: ``span - d`` tiles of ``block`` keys for each diagonal ``d`` it keeps (the
    sequence's grid, on which it touches ``span`` blocks from ``first_block``), one key for
    each of its columns ``c`` (global, ``INT32_MAX``: none) in each block that walks it
    (``c``'s block to its last); against ``span * (span + 1) / 2`` tiles, the document's
    dense tiles. Ties go dense: the same work for exact attention."""
    last = (first_block + span - 1).view(-1, 1)
    spans = span.view(-1, 1)
    kept = diagonals >= 0
    tiles = torch.where(kept & (diagonals < spans), spans - diagonals, 0).sum(-1)
    listed = columns != INT32_MAX
    walks = torch.where(listed, last - columns.long() // block + 1, 0).sum(-1)
    dense = span * (span + 1) // 2
    return tiles * block + walks >= dense * block


def dense_where_cheaper(
    columns: torch.Tensor, diagonals: torch.Tensor, first_block: torch.Tensor, span: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(columns, diagonals)`` (as ``dense_is_cheaper`` takes them; ``diagonals`` at least
    the widest ``span`` wide) with every (head, document) for which ``dense_is_cheaper``
    holds given every diagonal of the blocks it touches and no column."""
    dense = dense_is_cheaper(columns, diagonals, first_block, span, block).unsqueeze(-1)
    every = torch.arange(diagonals.shape[-1], dtype=diagonals.dtype, device=diagonals.device)
    whole = torch.where(every < span.view(-1, 1), every, -1)
    return torch.where(dense, INT32_MAX, columns), torch.where(dense, whole, diagonals)


def _stacked(flat: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    """``[..., n_documents, longest]``: entries ``[start, start + length)`` of ``flat``'s last
    dimension per document, zero-padded (one gather); the whole of ``flat`` as one document
    is a view. The gather's index, ``n_documents x longest`` entries, is made on ``flat``'s
    device from the documents' starts and lengths: made on the host, a packed sample's took
    milliseconds of CPU time and a new pinned buffer, twice per new packing (the graphed
    build's warm-up and capture), while the GPU waited (docs/benchmarks.md)."""
    if lengths == [flat.shape[-1]] and starts == [0]:
        return flat.unsqueeze(-2)
    flat = torch.nn.functional.pad(flat, (0, 1))  # the last entry: the padding's 0
    first, n = to_device(torch.tensor([starts, lengths]), flat.device).view(2, -1, 1).unbind(0)
    t = torch.arange(max(lengths), device=flat.device)
    return flat[..., torch.where(t < n, first + t, flat.shape[-1] - 1)]


def _selected_per_document(scores: torch.Tensor, n_valid: torch.Tensor, p: float, cap: int, forced: int):
    """``_selected`` of each document's scores at once: ``scores [B, H, M, longest]`` (the
    document's ``n_valid[m]`` entries, then zeros), unsorted candidates (``INT32_MAX``: none)
    ``[B, H, M, min(forced, longest) + min(cap, longest)]``. The padding's zeros are never
    taken, and a forced first index past a document's end is dropped, so each document's
    candidates are those ``_selected`` finds on its scores alone: the best ``min(cap, n)``
    of its scores are its best ``min(cap, longest)`` but zeros, and the mass to reach is
    the same sum (zeros added)."""
    values = _candidates(scores, p, cap, forced)
    n_first = min(forced, scores.shape[-1])
    slot = torch.arange(values.shape[-1], device=values.device)
    past_end = (slot < n_first) & (slot >= n_valid.view(-1, 1))
    return torch.where(past_end, INT32_MAX, values.to(torch.int32) if values.dtype != torch.int32 else values)

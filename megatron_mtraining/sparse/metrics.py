"""Quality metrics of a sparse index against dense attention: the index recall of any
pattern, and MSA's block and score recall."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .documents import Documents
from .host_tables import to_device
from .index import BlockTopKIndex, DenseIndex, SparseIndex, position_lookup, single_device
from .msa import MSAConfig, block_max_scores
from .validation import check_index_qk, check_int, check_qk, check_softmax_scale, fail
from .vertical_slash import ObservationWindows, window_parts


@torch.no_grad()
def attention_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    num_rows: int = 64,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Share of the dense causal attention mass of the last ``num_rows`` queries that
    falls on keys the index attends, ``[B, Hq]`` float32 (1.0 = nothing lost); with the
    index's packed documents, the dense mass within each row's document."""
    check_recall_rows(num_rows, q.shape[1])
    return _recall(q, k, index, softmax_scale, num_rows=num_rows).mean(-1)


@torch.no_grad()
def heldout_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    rows: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """``attention_recall`` of the queries at positions ``rows`` (ascending int64 on the
    host, as :func:`heldout_rows` draws them) rather than of the last ones, ``[B, Hq]``
    float32: drawn from rows that did not build the index, it is the out-of-sample recall."""
    check_rows(rows, q.shape[1])
    return _recall(q, k, index, softmax_scale, rows=rows).mean(-1)


@torch.no_grad()
def window_and_heldout_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    num_rows: int,
    rows: torch.Tensor,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``attention_recall`` of the last ``num_rows``, ``heldout_recall`` of ``rows``), from
    one pass of the window statistics over the union of the two sets of rows instead of a
    pass each: a row's softmax statistics and kept mass are its own, so each figure equals
    its own call's (to the order of fp32 sums on the kernels)."""
    check_recall_rows(num_rows, q.shape[1])
    union = RowUnion.of(q.shape[1], num_rows, tuple(check_rows(rows, q.shape[1])))
    return union.split(_recall(q, k, index, softmax_scale, rows=union.rows))


@dataclass(frozen=True)
class RowUnion:
    """The ascending union of the last ``num_rows`` positions (the window) and other rows,
    for one recall pass over both. Per-row results come back in the union's order, where the
    window is the last ``num_rows`` and the other rows a few runs of consecutive places:
    :meth:`split` takes them by slices, with no index tensor to copy to the device."""

    rows: torch.Tensor  # int64 on the host (pinned where there is a GPU, so that copying it waits for nothing)
    num_rows: int
    runs: tuple[slice, ...]  # the other rows' places, in runs

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def of(seq: int, num_rows: int, rows: tuple[int, ...]) -> RowUnion:
        """Cached: every layer of a training step asks for the same union."""
        union = sorted(set(rows).union(range(seq - num_rows, seq)))
        place = {r: i for i, r in enumerate(union)}
        runs: list[slice] = []
        for i in (place[r] for r in rows):
            if runs and runs[-1].stop == i:
                runs[-1] = slice(runs[-1].start, i + 1)
            else:
                runs.append(slice(i, i + 1))
        tensor = torch.tensor(union, dtype=torch.int64)
        return RowUnion(tensor.pin_memory() if torch.cuda.is_available() else tensor, num_rows, tuple(runs))

    def split(self, per_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the window's mean, the other rows' mean) of ``per_row [..., len(rows)]``."""
        window = per_row[..., per_row.shape[-1] - self.num_rows :]
        return window.mean(-1), torch.cat([per_row[..., run] for run in self.runs], -1).mean(-1)


def _recall(q, k, index: SparseIndex, softmax_scale, rows=None, num_rows: int = 0) -> torch.Tensor:
    """The recall of each row at ``rows`` (host positions), else of the last ``num_rows``,
    ``[B, Hq, rows]``."""
    check_qk(q, k)
    bsz, seq, hq, d = q.shape
    index.check_compatible(bsz, hq, seq, k.shape[2], q.device)
    scale = check_softmax_scale(softmax_scale, d)
    n_rows = num_rows if rows is None else len(rows)
    if index.complete:
        return torch.ones(bsz, hq, n_rows, dtype=torch.float32, device=q.device)
    q_rows = q[:, seq - num_rows :] if rows is None else q[:, rows.to(q.device, non_blocking=True)]
    return recall_from_parts(q_rows, k, None, index, scale, rows)


def heldout_rows(
    seq: int, excluded: Sequence[tuple[int, int]], blocks: int, block_rows: int, seed: int
) -> torch.Tensor:
    """Query positions for :func:`heldout_recall`: ``blocks`` runs of ``block_rows``
    consecutive rows (aligned to ``block_rows``), drawn uniformly without replacement by a
    generator seeded with ``seed`` from the runs of the sequence holding no row of
    ``excluded`` (``[start, end)`` ranges: the rows whose attention built the index);
    fewer where fewer runs qualify. Ascending int64 on the host; the same on every rank
    for the same arguments."""
    check_int("blocks", blocks, minimum=1)
    check_int("block_rows", block_rows, minimum=1)
    free = [True] * (seq // block_rows)
    for start, end in excluded:
        first, last = start // block_rows, -(-end // block_rows)
        free[first:last] = [False] * len(free[first:last])
    candidates = torch.tensor([run for run, ok in enumerate(free) if ok], dtype=torch.int64)
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))
    first = candidates[order[:blocks]].sort().values * block_rows
    return (first.view(-1, 1) + torch.arange(block_rows)).flatten()


def check_recall_rows(num_rows: int, seq: int) -> None:
    check_int("num_rows", num_rows, minimum=1)
    if num_rows > seq:
        fail("num_rows", num_rows, f"at most the sequence length {seq}")


def check_rows(rows, seq: int) -> list[int]:
    """Query positions for the recall: 1-D int64 on the host, ascending, in the sequence;
    their values."""
    accepted = f"a 1-D int64 tensor on the host of ascending positions in [0, {seq}), at least one"
    if not isinstance(rows, torch.Tensor):
        fail("rows", type(rows).__name__, accepted)
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.device.type != "cpu" or len(rows) == 0:
        fail("rows", f"{rows.dtype} {tuple(rows.shape)} on {rows.device}", accepted)
    values = rows.tolist()  # one read of host memory, which waits for nothing
    if values[0] < 0 or values[-1] >= seq or any(b <= a for a, b in itertools.pairwise(values)):
        fail("rows", values, accepted)
    return values


def recall_from_parts(
    q_rows: torch.Tensor,
    k: torch.Tensor,
    key_positions: torch.Tensor | None,
    index: SparseIndex,
    scale: float,
    rows: torch.Tensor | None = None,
    all_reduce_max=single_device,
    all_reduce_sum=single_device,
    host_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, ``[B, Hq, R]`` in the rows' order, the recall of the queries at positions
    ``rows`` (ascending int64 on the host; None: the last ``R`` of ``index.seq_len``, the
    window) from *some* of the keys,
    given with their global positions (None: every position, in order), on the device and
    on the host (``host_positions``); ``all_reduce_*`` combine the partial softmax
    statistics across the holders of the other keys (identity on one device). ``index``
    must hold those rows (a context-parallel builder's top-k index holds only its own).

    The softmax statistics are the vertical-slash window passes' (``window_parts``: one
    window per run of rows inside a document, on the Triton kernels on CUDA), whose sum
    pass also adds up the mass on the keys the index attends: no ``[B, Hq, R, keys]``
    tensor of probabilities is made. The keys a top-k index attends are marked for every row at
    once from its chosen blocks (``_block_attended``); the other types' from the key lists of
    every index chunk holding a row, in one call (``_listed_attended``)."""
    n_rows, hq = q_rows.shape[1], q_rows.shape[2]
    seq = index.seq_len
    n_keys = k.shape[1]
    row_positions = rows
    rows = range(seq - n_rows, seq) if rows is None else rows.tolist()
    if key_positions is None:
        column = torch.arange(seq + 1, device=k.device)  # position -> column; seq (padding) -> n_keys
    else:
        column = position_lookup(key_positions, seq, missing=n_keys)
    doc_bounds = (0, seq) if index.documents is None else index.documents.bounds
    windows = ObservationWindows.of_rows(rows, doc_bounds, seq, host_positions)
    parts = window_parts(q_rows, k, key_positions, windows, scale, block_size=1)  # (the mass passes' only)
    row_max = all_reduce_max(parts.row_max())  # every row sees its document's start on one holder: finite
    if isinstance(index, BlockTopKIndex):
        attended = _block_attended(index, row_positions, n_rows, key_positions, n_keys, hq)
    else:
        attended = _listed_attended(index, rows, column, hq, n_keys)[..., :n_keys]
    total, kept = all_reduce_sum(torch.stack(parts.kept_sums(row_max, attended)))
    share = kept / total  # [M, B, Hq, longest window]: each window's rows, in the rows' order
    return torch.cat([share[m, ..., :w] for m, w in enumerate(windows.rows)], -1).float()


def _block_attended(
    index: BlockTopKIndex, rows: torch.Tensor | None, n_rows: int, key_positions, n_keys: int, hq: int
) -> torch.Tensor:
    """Which local keys a top-k index attends, bool ``[B, Hq, R, n_keys]`` (row slot, local
    key), for every row at once: the rows' chosen blocks as a block mask, read at each key's
    block. A fixed number of operations, where the key lists cost a round per index chunk of
    rows (one row a round for wide blocks: issue 21). ``rows``: host positions (pinned in
    training, copied without a wait), None: the last ``n_rows``."""
    seq, bs, dev = index.seq_len, index.block_size, index.blocks.device
    n_blocks = -(-seq // bs)
    if rows is None:
        chosen = index.blocks[:, seq - n_rows :]
    else:
        chosen = index.blocks.index_select(1, rows.to(dev, non_blocking=True))
    chosen = chosen.permute(0, 2, 1, 3).long()  # [B, Hs, R, k]
    # Two spare columns: -1 (no block) marks the first, padding keys (position -1) read the second.
    mask = torch.zeros(*chosen.shape[:3], n_blocks + 2, dtype=torch.bool, device=dev)
    mask.scatter_(-1, torch.where(chosen >= 0, chosen, n_blocks), True)
    positions = torch.arange(n_keys, device=dev) if key_positions is None else key_positions.long()
    key_block = torch.where(positions >= 0, positions // bs, n_blocks + 1)
    return mask.repeat_interleave(hq // mask.shape[1], dim=1).index_select(-1, key_block)


def _listed_attended(index: SparseIndex, rows, column, hq: int, n_keys: int) -> torch.Tensor:
    """Which local keys ``index`` attends, bool ``[B, Hq, R, n_keys + 1]`` (the last column
    takes keys absent here), from its key lists: those of every index chunk holding a row in
    one call (``chunk_key_lists``), marked once per chunk and read by each of its rows. A
    fixed number of launches, where a call per chunk cost ~100 a chunk with documents
    (docs/benchmarks.md)."""
    seq, chunk = index.seq_len, index.query_chunk
    starts = sorted({row // chunk * chunk for row in rows})
    keys = index.chunk_key_lists(starts)  # [B, Hs, chunks, width]
    # Marked before the rows and query heads are broadcast: a bounded list can be far wider
    # than what it lists (the vertical-slash lists with documents are padded to every sparse
    # document's cap).
    marks = torch.zeros(*keys.shape[:3], n_keys + 1, dtype=torch.bool, device=column.device)
    marks.scatter_(-1, column[torch.where(keys >= 0, keys, seq).long()], True)
    place = {q0: i for i, q0 in enumerate(starts)}
    of_row = to_device(torch.tensor([place[row // chunk * chunk] for row in rows]), column.device)
    return marks.index_select(2, of_row).repeat_interleave(hq // keys.shape[1], dim=1)


@torch.no_grad()
def msa_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    config: MSAConfig,
    index: SparseIndex | None = None,
    num_rows: int = 64,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MSA's block recall and score recall (MSA paper, section 5.2) of the last ``num_rows``
    queries: ``(block, score)``, each ``[B, Hq]`` float32, averaged over the rows.

    For a query row ``i`` and query head ``h`` of GQA group ``g``:

    * ``P_b`` is the main branch's dense attention probability of ``h`` (softmax of
      ``q_i . k_j * softmax_scale`` over every causally visible ``j <= i``, whatever the
      phase) summed over the tokens of key block ``b`` (``config.block_size``).
    * ``I*`` is the main branch's top-k: the ``config.topk`` visible blocks of largest
      ``P_b`` (ties to the lower block id; every visible block when fewer are visible).
      The query's own block is not forced into it.
    * ``I_hat`` is the index branch's selection for ``(i, g)``, shared by the group's heads:
      the query's own block plus the ``topk - 1`` visible others of largest block score
      (``block_max_scores``), as ``msa_select_blocks`` makes it. ``index`` is the selection
      the layer ran (a ``BlockTopKIndex``: its rows are read); ``None`` or a ``DenseIndex``
      (indexer warmup, dense main branch) selects the window rows from q_idx/k_idx here,
      ties to the lower block id as the selection kernel breaks them.
    * block recall ``= |I* & I_hat| / |I*|``; score recall
      ``= sum_{b in I* & I_hat} P_b / sum_{b in I*} P_b``.

    Both are 1 when every visible block fits in ``topk``. q ``[B, S, Hq, D]``, k
    ``[B, S, Hkv, D]``, q_idx ``[B, S, Hkv, d_idx]``, k_idx ``[B, S, 1, d_idx]``. The block
    masses are fp64 sums (of fp32 terms on the Triton kernels, which CUDA inputs take; fp64
    throughout elsewhere), the index scores fp32 as the selection's; no host synchronisation.
    """
    check_qk(q, k)
    check_index_qk(q_idx, k_idx, config.index_head_dim)
    bsz, seq, hq, d = q.shape
    if q_idx.shape[:3] != (bsz, seq, k.shape[2]):
        fail("q_idx.shape", tuple(q_idx.shape), f"[B, S, Hkv, d_idx] = [{bsz}, {seq}, {k.shape[2]}, d_idx]")
    check_recall_rows(num_rows, seq)
    scale = check_softmax_scale(softmax_scale, d)
    positions = torch.arange(seq, device=q.device)
    starts = document_starts(index)
    if isinstance(index, BlockTopKIndex):
        index.check_compatible(bsz, hq, seq, k.shape[2], q.device)
        selected = index_window_selection(index, num_rows)
    elif index is None or isinstance(index, DenseIndex):
        selected = msa_window_selection(q_idx[:, seq - num_rows :], k_idx, positions, seq, config, doc_starts=starts)
    else:
        fail("index", type(index).__name__, "the BlockTopKIndex the layer ran, or None / a DenseIndex (warmup)")
    documents = None if index is None else index.documents
    return msa_recall_from_parts(q[:, seq - num_rows :], k, None, selected, seq, config, scale, documents=documents)


def document_starts(index: SparseIndex | None) -> torch.Tensor | None:
    """``[S]`` the document start of each position of a packed index, or None (one document,
    or no index)."""
    return None if index is None or index.documents is None else index.documents.starts


def msa_window_selection(
    q_idx_window: torch.Tensor,
    k_idx: torch.Tensor,
    key_positions: torch.Tensor,
    seq: int,
    config: MSAConfig,
    all_reduce_max=single_device,
    doc_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks MSA's index selects for the window (the last ``R`` of ``seq`` queries),
    bool ``[B, Hkv, R, n_blocks]``: own block plus the top ``topk - 1`` visible others by
    block score, ties to the lower block id. ``k_idx`` holds *some* of the index keys, at
    the given global positions; ``all_reduce_max`` combines the block maxima across the
    holders of the others (identity on one device). ``doc_starts``: packed documents'
    starts by global position (a key before its row's document start is not visible)."""
    rows = q_idx_window.shape[1]
    window = torch.arange(seq - rows, seq, device=k_idx.device)
    bs, n_blocks = config.block_size, -(-seq // config.block_size)
    scores = block_max_scores(q_idx_window, window, k_idx, key_positions, n_blocks, bs, doc_starts)
    scores = all_reduce_max(scores)
    own = (window // bs).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
    return _top_blocks(scores.scatter(-1, own, float("inf")), config.topk)


def index_window_selection(index: BlockTopKIndex, num_rows: int, all_reduce_max=single_device) -> torch.Tensor:
    """The blocks ``index`` selects for its last ``num_rows`` rows, bool ``[B, Hs, R,
    n_blocks]``. Rows this holder lacks must be -1 (a context-parallel builder's index):
    ``all_reduce_max`` takes each row from its holder."""
    n_blocks = -(-index.seq_len // index.block_size)
    blocks = all_reduce_max(index.blocks[:, index.seq_len - num_rows :].contiguous()).long()
    blocks = torch.where(blocks >= 0, blocks, n_blocks).permute(0, 2, 1, 3)  # -1 -> a spare column
    mask = torch.zeros(*blocks.shape[:3], n_blocks + 1, dtype=torch.bool, device=blocks.device)
    return mask.scatter_(-1, blocks, True)[..., :n_blocks]


def msa_recall_from_parts(
    q_window: torch.Tensor,
    k: torch.Tensor,
    key_positions: torch.Tensor | None,
    selected: torch.Tensor,
    seq: int,
    config: MSAConfig,
    scale: float,
    all_reduce_max=single_device,
    all_reduce_sum=single_device,
    documents: Documents | None = None,
    host_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``msa_recall`` from the window queries (the last ``R`` of ``seq``), *some* of the
    keys, given with their global positions (None: every position, in order), on the device
    and on the host (``host_positions``, required with ``key_positions``), and the index's
    selection ``selected`` (bool ``[B, Hs, R, n_blocks]``, ``Hs`` dividing Hq).
    ``all_reduce_max`` combines the rows' logit maxima and ``all_reduce_sum`` the block sums
    ``[B, Hq, R, n_blocks]`` across the holders of the other keys (identity on one device).
    ``documents``: the packed documents (a row's softmax and its visible blocks stay inside
    its document).

    The block sums are the window passes' (``window_parts``: one window per run of the rows
    inside a document, on the Triton kernels on CUDA): the row maxima, then per (row, key
    block) the sum of ``exp(logit - reduced max)``, so no ``[B, Hq, R, keys]`` tensor is made.
    They are fp64 (fp32 terms on the kernels), and so is the ranking of the blocks."""
    if key_positions is not None and host_positions is None:
        fail("host_positions", None, "the keys' global positions on the host, given key_positions")
    rows = q_window.shape[1]
    bs, n_blocks = config.block_size, -(-seq // config.block_size)
    doc_bounds = (0, seq) if documents is None else documents.bounds
    windows = ObservationWindows.of_rows(range(seq - rows, seq), doc_bounds, seq, host_positions)
    parts = window_parts(q_window, k, key_positions, windows, scale, bs)
    row_max = all_reduce_max(parts.row_max())  # every row sees itself on one of the holders: finite
    mass = all_reduce_sum(parts.block_sums(row_max))
    mass = mass / mass.sum(-1, keepdim=True)  # P_b
    # Invisible blocks rank last; a visible block of mass 0 (underflow) still counts.
    window = torch.arange(seq - rows, seq, device=k.device)
    first = torch.zeros_like(window) if documents is None else documents.starts[window].long()
    block_ids = torch.arange(n_blocks, device=k.device).view(1, -1)
    visible = (block_ids <= (window // bs).view(-1, 1)) & (block_ids >= (first // bs).view(-1, 1))
    best = _top_blocks(torch.where(visible, mass, float("-inf")), config.topk)
    hit = best & selected.repeat_interleave(mass.shape[1] // selected.shape[1], dim=1)
    block = hit.sum(-1).to(mass.dtype) / best.sum(-1)
    score = (mass * hit).sum(-1) / (mass * best).sum(-1)
    return block.mean(-1).float(), score.mean(-1).float()


def _top_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Bool mask of the ``topk`` largest finite entries along the last dimension (fewer
    where fewer are finite); ties go to the lower index (a stable sort)."""
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    k = min(topk, scores.shape[-1])
    keep = values[..., :k] > float("-inf")
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order[..., :k], keep)

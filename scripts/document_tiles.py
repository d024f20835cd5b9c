"""The work the block-bar kernels' tile tables schedule for packed documents, counted from the
tables alone (no attention), for ``bench_documents.py``'s three vertical-slash rows.

    python scripts/document_tiles.py [--seq-len 131072] [--mean 8192] [--mix lognormal] [--seed 0]
                                     [--diffuse] [--block-size 64]

Builds ``bench_documents.py``'s sample (the same seed, boundaries and q/k; on the CPU, so the
statistics take the fp64 reference path, about a minute at 128K on two cores) and its three
indexes: the whole-sequence lists unmasked, the same lists under the documents' mask, and the
per-document index. For each, from ``vertical_slash_tables`` (the CPU path; the one-launch
CUDA tables equal it entry for entry), prints per kernel the work items (a query block's
64-row program against one listed tile or one 64-column bar step; the dK/dV side's listed
tiles; the bar dK/dV chunks' row steps), the tiles that need no mask, cross a row's document
start (the kernels' masked steps) or hold no visible pair, the computed area (work items
times their rows and keys) against the attended pairs, and the sizes of the per-call
gathers the launcher makes of the vertical columns. The forward and the dQ kernel walk the
same items; the tile dK/dV kernel walks the transposed tiles, checked here to be the same
set.

``--diffuse`` draws q and k independent and standard normal, as a randomly initialised
model's are, in place of the sample's RoPE over a shared direction: its statistics are
nearly flat, so the budgets keep most columns and diagonals. With ``--mix uniform --mean
2048`` the documents are those of Megatron's mock data (lengths uniform below 4096), as in
``bench_training.py``'s packed-documents rows; ``--block-size 128`` is the recipes'.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_documents import HQ, D, sample, sample_arguments  # noqa: E402

from megatron_mtraining.sparse import VerticalSlashConfig, build_vertical_slash_index  # noqa: E402
from megatron_mtraining.sparse.documents import packed_documents  # noqa: E402
from megatron_mtraining.sparse.kernels.block_bar.tables import vertical_slash_tables  # noqa: E402

# The launch defaults on sm90 (attention.launch_config, block 64): forward and dQ take the
# block's 64 rows against 64 keys a step; the bar dK/dV programs 128 columns (64 on sm80)
# against 64 rows a step.
STEP_N, BAR_CHUNK, BAR_ROWS = 64, 128, 64


def row_bounds(index) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of each position's document, ``[S]`` int64 (one document without)."""
    docs, seq = index.documents, index.seq_len
    if docs is None:
        return torch.zeros(seq, dtype=torch.int64), torch.full((seq,), seq, dtype=torch.int64)
    return docs.starts.long(), docs.ends().long()


def tile_pairs(qb: torch.Tensor, kb: torch.Tensor, starts: torch.Tensor, bs: int, seq: int) -> torch.Tensor:
    """Visible (row, key) pairs of each tile (query block ``qb``, key block ``kb``): row ``r``
    sees the keys of ``kb`` from its document's start up to itself."""
    out = torch.empty(len(qb), dtype=torch.int64)
    t = torch.arange(bs)
    for c0 in range(0, len(qb), 1 << 16):
        q, k = qb[c0 : c0 + (1 << 16), None], kb[c0 : c0 + (1 << 16), None]
        rows = q * bs + t
        ok = rows < seq
        lo = torch.maximum(starts[rows.clamp(max=seq - 1)], k * bs)
        hi = torch.minimum((k + 1) * bs, torch.minimum(rows + 1, torch.tensor(seq)))
        out[c0 : c0 + (1 << 16)] = ((hi - lo).clamp(min=0) * ok).sum(1)
    return out


def listed(tiles: torch.Tensor, count: torch.Tensor):
    """(head, block, entry) of every listed entry of a ``[1, H, n, W]`` table."""
    valid = torch.arange(tiles.shape[-1]) < count.unsqueeze(-1)
    h, blk, slot = valid[0].nonzero(as_tuple=True)
    return h, blk, tiles[0, h, blk, slot].long()


def tile_counts(tables, starts, bs: int, seq: int) -> dict:
    h, qb, kb = listed(tables.tiles, tables.tile_count)
    full_pairs = torch.where(qb == kb, bs * (bs + 1) // 2, bs * bs)
    pairs = tile_pairs(qb, kb, starts, bs, seq)
    ht, kt, qt = listed(tables.tiles_t, tables.tile_t_count)
    key = (h * 1 << 40) + (qb << 20) + kb
    key_t = (ht * 1 << 40) + (qt << 20) + kt
    same = torch.equal(key.sort().values, key_t.sort().values)
    per_block = tables.tile_count[0].long()
    per_kv = tables.tile_t_count[0].long()
    return {
        "tiles": len(qb),
        "diagonal 0": int((qb == kb).sum()),
        "off-diagonal": int((qb != kb).sum()),
        "full (no mask needed)": int(((pairs == full_pairs) & (qb != kb)).sum()),
        "crossing a document start": int(((pairs < full_pairs) & (pairs > 0) & (qb != kb)).sum()),
        "no visible pair": int((pairs == 0).sum()),
        "computed area": len(qb) * bs * bs,
        "attended pairs": int(pairs.sum()),
        "tiles per query block (mean, max)": (float(per_block.float().mean()), int(per_block.max())),
        "tiles per KV block (mean, max)": (float(per_kv.float().mean()), int(per_kv.max())),
        "transposed tiles are the same set": same,
        "table widths (tiles, tiles_t)": (tables.tiles.shape[-1], tables.tiles_t.shape[-1]),
    }


def in_tile(index, tables, qb: torch.Tensor, col: torch.Tensor, h: int, bs: int) -> torch.Tensor:
    """The kernels' ``_in_tile``: whether column ``col`` lies in an attended tile of query block
    ``qb`` (the diagonals of the document of the block's first row)."""
    diag = qb - col // bs
    offset = 0 if tables.active_offset is None else tables.active_offset.long()[qb]
    at = (offset + diag).clamp(0, tables.active.shape[-1] - 1)
    return (diag >= 0) & (tables.active[0, h].long()[at] != 0)


def bar_walk(cols: torch.Tensor, ends: torch.Tensor, seq: int, documents: bool) -> int:
    """The 64-row steps that ``_bar_dkdv_kernel``'s loop takes for a chunk of ascending
    columns ``cols``: from its first column's step to the end of its last column's document
    (the sequence's without documents). It visits only the live ones (``bar_reached_steps``),
    the others cost a compare each, and computes those with a column outside the tiles
    (``bar_outside_steps``)."""
    stop = int(ends[cols.max()]) if documents else seq
    return -(-(stop - int(cols.min()) // BAR_ROWS * BAR_ROWS) // BAR_ROWS)


def bar_reached_steps(cols: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """With documents, the first rows of those steps that some column's document reaches,
    ascending: the ones the kernel visits (the others, between two documents' columns, see
    none: it skips them)."""
    firsts = cols // BAR_ROWS * BAR_ROWS
    return torch.unique(
        torch.cat([torch.arange(int(a), int(e), BAR_ROWS) for a, e in zip(firsts, ends[cols], strict=True)])
    )


def bar_outside_steps(
    index, tables, cols: torch.Tensor, ends: torch.Tensor, steps: torch.Tensor, h: int, bs: int
) -> int:
    """Of a chunk's reached ``steps`` (``bar_reached_steps``), those where some column the
    step's rows reach lies outside its query block's attended tiles: the kernel computes
    only those."""
    reached = (cols.view(1, -1) < steps.view(-1, 1) + BAR_ROWS) & (ends[cols].view(1, -1) > steps.view(-1, 1))
    inside = in_tile(index, tables, (steps // bs).view(-1, 1), cols.view(1, -1), h, bs)
    return int((reached & ~inside).any(1).sum())


def bar_counts(index, tables, starts, ends, bs: int, seq: int) -> dict:
    """Forward / dQ bar steps (64 columns a step from ``bar_start`` to ``bar_count``) and the
    bar dK/dV chunks' row steps, with their computed and attended pairs."""
    n_q = tables.tiles.shape[2]
    qb = torch.arange(n_q)
    steps = computed = useful = walked = walked_in_tile = walked_unseen = 0
    chunks = chunk_steps = live_steps = outside_steps = 0
    longest_chunk = longest_live = 0
    v_max = tables.vertical.shape[-1]
    for h in range(tables.vertical.shape[1]):
        vert = tables.vertical[0, h].long()
        cols = vert[vert >= 0]
        n_bars = tables.bar_count[0, h].long()
        first = torch.zeros(n_q, dtype=torch.int64) if tables.bar_start is None else tables.bar_start[0, h].long()
        n_walk = (n_bars - first).clamp(min=0)
        steps += int((-(-n_walk // STEP_N)).sum())
        walked += int(n_walk.sum())
        # Per (query block, column): rows of the block that see the column, none if in a tile.
        lo = torch.maximum(cols.view(1, -1), qb.view(-1, 1) * bs)
        hi = torch.minimum(ends[cols].view(1, -1), torch.clamp((qb.view(-1, 1) + 1) * bs, max=seq))
        rows = (hi - lo).clamp(min=0)
        inside = in_tile(index, tables, qb.view(-1, 1), cols.view(1, -1), h, bs)
        entry = torch.arange(len(cols)).view(1, -1)
        walk = (entry >= first.view(-1, 1)) & (entry < n_bars.view(-1, 1))
        useful += int((rows * ~inside * walk).sum())
        if bool((rows * ~inside * ~walk).any()):
            raise AssertionError("a visible bar outside the walked range")
        walked_in_tile += int((walk & inside).sum())
        walked_unseen += int((walk & ~inside & (rows == 0)).sum())
        for c0 in range(0, len(cols), BAR_CHUNK):
            chunk = cols[c0 : c0 + BAR_CHUNK]
            n = n_live = bar_walk(chunk, ends, seq, index.documents is not None)
            if index.documents is not None:
                reached = bar_reached_steps(chunk, ends)
                n_live = len(reached)
                outside_steps += bar_outside_steps(index, tables, chunk, ends, reached, h, bs)
            chunks += 1
            chunk_steps += n
            longest_chunk = max(longest_chunk, n)
            live_steps += n_live
            longest_live = max(longest_live, n_live)
    computed = steps * bs * STEP_N
    return {
        "vertical entries per head (listed, padded width)": (
            int((tables.vertical >= 0).sum()) / tables.vertical.shape[1],
            v_max,
        ),
        "fwd/dQ bar steps": steps,
        "fwd/dQ bar entries walked": walked,
        "  of which inside an attended tile": walked_in_tile,
        "  of which seen by no row of the block": walked_unseen,
        "fwd/dQ bar computed area": computed,
        "bar attended pairs": useful,
        "bar dK/dV chunks with a column (programs launched)": (chunks, -(-v_max // BAR_CHUNK)),
        "bar dK/dV loop steps (max per chunk)": (chunk_steps, longest_chunk),
        "  of which some column's document reaches (max per chunk)": (live_steps, longest_live),
        "    of which with a column outside the block's tiles (documents: computed)": outside_steps,
        "bar dK/dV computed area": (outside_steps if index.documents is not None else live_steps)
        * BAR_ROWS
        * BAR_CHUNK,
        "bar K/V gathers per call, MiB (each of K and V)": 1 * HQ * v_max * D * 2 / 2**20,
        "bar dK/dV partials buffer, MiB": 2 * HQ * v_max * D * 4 / 2**20,
    }


def report(name: str, index, bs: int, seq: int) -> dict:
    t = time.time()
    tables = vertical_slash_tables(index)
    starts, ends = row_bounds(index)
    out = {**tile_counts(tables, starts, bs, seq), **bar_counts(index, tables, starts, ends, bs, seq)}
    fwd_items = out["tiles"] + out["fwd/dQ bar steps"]
    out["forward work items (tiles + bar steps)"] = fwd_items
    out["forward computed / attended"] = (out["computed area"] + out["fwd/dQ bar computed area"]) / max(
        1, out["attended pairs"] + out["bar attended pairs"]
    )
    out["backward: dQ items, tile dK/dV items, bar dK/dV row steps"] = (
        fwd_items,
        out["tiles"],
        out["bar dK/dV computed area"] // (BAR_ROWS * BAR_CHUNK),
    )
    out["backward computed area (dQ + tile dK/dV + bar dK/dV)"] = (
        out["computed area"] + out["fwd/dQ bar computed area"] + out["computed area"] + out["bar dK/dV computed area"]
    )
    out["attended pairs (tiles + bars)"] = out["attended pairs"] + out["bar attended pairs"]
    print(f"\n== {name} ({time.time() - t:.0f} s)")
    for key, value in out.items():
        print(f"  {key:<58} {value:.4g}" if isinstance(value, float) else f"  {key:<58} {value}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sample_arguments(p)
    p.add_argument("--diffuse", action="store_true", help="independent standard normal q/k (a random model's)")
    p.add_argument("--block-size", type=int, default=VerticalSlashConfig().block_size)
    args = p.parse_args()
    seq = args.seq_len
    cu, q, k, _ = sample(args, "cpu")
    if args.diffuse:
        gen = torch.Generator().manual_seed(args.seed + 1)
        q, k = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    lengths = (cu[1:] - cu[:-1]).tolist()
    print(f"seq {seq}, {len(lengths)} documents ({args.mix}, mean {seq / len(lengths):.0f}, longest {max(lengths)})")
    config, scale = VerticalSlashConfig(block_size=args.block_size), D**-0.5
    docs = packed_documents(cu, seq)
    with torch.no_grad():
        whole = build_vertical_slash_index(q, k, config, scale)
        per_document = build_vertical_slash_index(q, k, config, scale, cu_seqlens=cu)
    masked = whole.within(docs)
    bs = config.block_size
    for name, index in (
        ("vertical-slash, no document mask", whole),
        ("vertical-slash, the same index with the documents' mask", masked),
        ("vertical-slash, per-document index", per_document),
    ):
        report(name, index, bs, seq)


if __name__ == "__main__":
    main()

"""``scripts/msa_loop_orders.py``'s counts against direct counts of the same selections."""

import importlib.util
import pathlib

import torch

_spec = importlib.util.spec_from_file_location(
    "msa_loop_orders", pathlib.Path(__file__).parents[1] / "scripts" / "msa_loop_orders.py"
)
loop_orders = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop_orders)


def _selection(gen, seq, heads, topk, block):
    """Random causal selections ``[1, seq, heads, topk]``: distinct visible blocks a row,
    its own included, ``-1`` past the visible ones."""
    blocks = torch.full((1, seq, heads, topk), -1, dtype=torch.long)
    for t in range(seq):
        own = t // block
        for h in range(heads):
            others = torch.randperm(own, generator=gen)[: topk - 1]
            chosen = torch.cat((torch.tensor([own]), others))
            blocks[0, t, h, : len(chosen)] = chosen
    return blocks


def _union_pairs(blocks, block, group, tile_tokens):
    """Pairs a Q-outer tile computes, from a dense 0/1 map of each tile's chosen key blocks."""
    _, seq, heads, _ = blocks.shape
    n_blocks = -(-seq // block)
    total = 0
    for first in range(0, seq, tile_tokens):
        for h in range(heads):
            hit = torch.zeros(n_blocks, dtype=torch.bool)
            for b in blocks[0, first : first + tile_tokens, h].flatten().tolist():
                if b >= 0:
                    hit[b] = True
            total += int(hit.sum()) * block * tile_tokens * group
    return total


def test_q_outer_areas_equal_a_map_of_each_tiles_blocks():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    seq, heads, topk, block, group = 200, 2, 4, 16, 8
    blocks = _selection(gen, seq, heads, topk, block)
    n_blocks = -(-seq // block)
    per_tile = {}
    for tile_tokens in (1, 8, 16, 64):
        per_tile[tile_tokens] = loop_orders.q_outer_areas(blocks, n_blocks, block, group, tile_tokens)
        assert per_tile[tile_tokens] == _union_pairs(blocks, block, group, tile_tokens)
    # One token a tile computes exactly its selected blocks.
    assert per_tile[1] == int((blocks >= 0).sum()) * block * group
    assert per_tile[1] <= per_tile[8] <= per_tile[16] <= per_tile[64]


def test_kv_outer_counts_cover_every_selection():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    seq, topk, block = 1536, 3, 128
    blocks = _selection(gen, seq, loop_orders.HKV, topk, block)
    q_meta = torch.empty((1, seq, loop_orders.HQ, loop_orders.D), dtype=torch.bfloat16, device="meta")
    half = loop_orders.kv.query_chunk("fwd", q_meta, topk) // 2
    counts = loop_orders.kv_outer_counts(blocks, seq, block, half)
    selections = int((blocks >= 0).sum())
    group = loop_orders.HQ // loop_orders.HKV
    assert counts["selections"] == selections
    fwd, bwd, small = counts["fwd"], counts["bwd"], counts["fwd_l2"]
    assert small["chunk_tokens"] == half and small["gather_bytes"] == fwd["gather_bytes"]
    # Halved chunks cut segments in two: at least as many tiles and items.
    assert fwd["chunk_tokens"] == 2 * half < seq
    assert small["tiles"] >= fwd["tiles"] and small["items"] >= fwd["items"]
    assert small["without_partials_bytes"] < small["attention_bytes"] + small["merge_bytes"]
    assert fwd["gather_bytes"] == selections * group * loop_orders.D * 2
    assert bwd["gather_bytes"] == selections * group * (2 * loop_orders.D * 2 + 8)
    for c in (fwd, bwd, small):
        tokens = c["tile_rows"] // group
        # Each tile holds one segment's tokens: at least the selections over the tile size,
        # at most one partial tile more per (chunk, block, head) segment.
        assert -(-selections // tokens) <= c["tiles"]
        assert c["computed_pairs"] == c["tiles"] * c["tile_rows"] * block
        assert 0 < c["items"] <= c["tiles"]

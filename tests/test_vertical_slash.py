"""MTraining vertical-slash index: statistics, top-p budgets, planted patterns, kernel form."""

import math

import pytest
import torch
from dense_reference import dense_attention

from megatron_mtraining.sparse import (
    VerticalSlashConfig,
    attention_recall,
    build_vertical_slash_index,
    select_vertical_slash,
    sparse_attention,
    window_statistics,
)


def brute_force_statistics(q, k, last_q, block_size):
    """fp64 window softmax; vertical column mass and triangular-pooled block-diagonal mass."""
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    w = min(last_q, s)
    rows = torch.arange(s - w, s)
    logits = torch.einsum("bwhd,bshd->bhws", q[:, s - w :].double(), k.double().repeat_interleave(g, 2)) / math.sqrt(d)
    logits = logits.masked_fill(torch.arange(s).view(1, -1) > rows.view(-1, 1), float("-inf"))
    probs = torch.softmax(logits, -1) / w
    vertical = probs.sum(2)
    n_blocks = -(-s // block_size)
    slash = torch.zeros(b, hq, n_blocks + 1, dtype=torch.float64)
    for r, i in enumerate(rows.tolist()):
        for j in range(i + 1):
            o = i - j
            frac = (o % block_size) / block_size
            slash[:, :, o // block_size] += probs[:, :, r, j] * (1 - frac)
            slash[:, :, o // block_size + 1] += probs[:, :, r, j] * frac
    slash[:, :, n_blocks - 1] += slash[:, :, n_blocks]
    return vertical, slash[:, :, :n_blocks]


def selected(mask_from, index_field, n):
    """[B, H, n] bool from a -1 padded index field."""
    out = torch.zeros(*index_field.shape[:2], n + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where(index_field >= 0, index_field.long(), n), True)
    return out[..., :n]


def test_statistics_match_brute_force(rng, device):
    q = torch.randn(2, 75, 4, 8, generator=rng) * 2
    k = torch.randn(2, 75, 2, 8, generator=rng) * 2
    cfg = VerticalSlashConfig(last_q=20, block_size=16)
    stats = window_statistics(q.to(device), k.to(device), cfg)
    stats = type(stats)(stats.vertical.cpu(), stats.slash.cpu())
    vertical, slash = brute_force_statistics(q, k, 20, 16)
    torch.testing.assert_close(stats.vertical.double(), vertical, atol=1e-6, rtol=0)
    torch.testing.assert_close(stats.slash.double(), slash, atol=1e-6, rtol=0)
    torch.testing.assert_close(stats.slash.sum(-1), torch.ones(2, 4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("p", [0.5, 0.9, 1.0])
def test_top_p_budgets_are_minimal_and_reach_p(p, rng):
    q = torch.randn(2, 300, 4, 16, generator=rng) * 1.5
    k = torch.randn(2, 300, 1, 16, generator=rng) * 1.5
    cfg = VerticalSlashConfig(last_q=32, vertical_topp=p, slash_topp=p, block_size=16)
    stats = window_statistics(q, k, cfg)
    index = select_vertical_slash(stats, cfg, 300)
    for field, scores in ((index.vertical, stats.vertical), (index.slash, stats.slash)):
        chosen = selected(None, field, scores.shape[-1])
        total = scores.double().sum(-1)
        if field is index.slash:
            # Diagonal 0 is forced on top of the budget: the budget took it only where the
            # better diagonals fall short of p without it.
            assert chosen[..., 0].all()
            others = chosen.clone()
            others[..., 0] = False
            enough = (scores.double() * others).sum(-1) >= p * total
            chosen = torch.where(enough.unsqueeze(-1), others, chosen)
        mass = (scores.double() * chosen).sum(-1)
        assert (mass >= p * total - 1e-9).all()
        # Minimal: dropping the weakest chosen entry falls below p.
        weakest = torch.where(chosen, scores.double(), float("inf")).amin(-1)
        assert (mass - weakest < p * total + 1e-9).all()
    # The vertical columns alone carry >= p of the window's attention.
    recall = attention_recall(q, k, index, num_rows=32)
    assert (recall >= p - 1e-5).all(), recall


def test_caps_bind(rng):
    q = torch.randn(1, 256, 2, 16, generator=rng) * 0.1  # near-uniform attention
    k = torch.randn(1, 256, 2, 16, generator=rng) * 0.1
    cfg = VerticalSlashConfig(
        last_q=16, vertical_topp=0.99, slash_topp=0.99, vertical_cap=5, slash_cap=40, block_size=16
    )
    index = build_vertical_slash_index(q, k, cfg)
    assert ((index.vertical >= 0).sum(-1) == 5).all()
    # ceil(40 / 16) block diagonals, and diagonal 0 (forced) on top unless it is among them.
    best = window_statistics(q, k, cfg).slash.topk(3).indices
    assert torch.equal((index.slash >= 0).sum(-1), 4 - (best == 0).any(-1).long())
    assert (index.slash == 0).any(-1).all()


def planted_qk(seq, offset, columns, rng, strength=12.0):
    """q/k whose attention concentrates on key `columns` and on the token diagonal
    j = i - offset (a sum of cosines peaked at zero, as RoPE makes)."""
    pairs, d = 16, 36
    freqs = 2 * math.pi * torch.randint(40, 500, (pairs,), generator=rng).double() / 1024
    amp = math.sqrt(strength * math.sqrt(d) / pairs)
    pos = torch.arange(seq).double()
    q = torch.zeros(seq, d, dtype=torch.float64)
    k = torch.zeros(seq, d, dtype=torch.float64)
    q[:, 0:32:2], q[:, 1:32:2] = amp * torch.cos(pos[:, None] * freqs), amp * torch.sin(pos[:, None] * freqs)
    k[:, 0:32:2] = amp * torch.cos((pos[:, None] + offset) * freqs)
    k[:, 1:32:2] = amp * torch.sin((pos[:, None] + offset) * freqs)
    q[:, 32:] = 1.0
    k[columns, 32:] = strength * math.sqrt(d) / 4
    noise = 0.05 * torch.randn(2, seq, d, generator=rng, dtype=torch.float64)
    return (q + noise[0]).view(1, seq, 1, d).float(), (k + noise[1]).view(1, seq, 1, d).float()


def test_planted_columns_and_diagonal_are_recovered(rng, device):
    seq, bs, offset, columns = 512, 16, 80, [7, 300]
    q, k = (t.to(device) for t in planted_qk(seq, offset, columns, rng))
    cfg = VerticalSlashConfig(last_q=64, vertical_topp=0.9, slash_topp=0.9, block_size=bs)
    stats = window_statistics(q, k, cfg)
    assert set(stats.vertical[0, 0].topk(2).indices.tolist()) == set(columns)
    assert stats.slash[0, 0].argmax().item() == offset // bs
    index = select_vertical_slash(stats, cfg, seq)
    assert set(columns) <= set(index.vertical[0, 0].tolist())
    assert offset // bs in index.slash[0, 0].tolist()
    # Sparse, and the mask keeps most of the window's attention. (The planted
    # columns also appear as window diagonals i - column, so a few extra block
    # diagonals are picked: ~0.25 density here, against 1.0 dense.)
    assert index.density() < 0.35
    assert attention_recall(q, k, index, num_rows=64).item() >= 0.9
    mask = index.to_dense_mask(seq)[0, 0].cpu()
    i = torch.arange(offset, seq)
    assert mask[i, i - offset].all() and mask[300:, 300].all() and mask[7:, 7].all()


def test_every_row_attends_without_sinks_or_local_window(rng, device):
    # The README's config. Peaked random attention leaves, in nearly every draw of these
    # sizes, early rows whose keys no budget takes: they attended nothing before diagonal 0
    # was forced.
    q = (torch.randn(2, 640, 12, 16, generator=rng, dtype=torch.float64) * 2.5).to(device)
    k, v = (torch.randn(2, 640, 4, 16, generator=rng, dtype=torch.float64).to(device) for _ in "kv")
    index = build_vertical_slash_index(q, k, VerticalSlashConfig(vertical_topp=0.9, slash_topp=0.9))
    mask = index.to_dense_mask(640)
    assert mask.any(-1).all()
    out, lse = sparse_attention(q, k, v, index)
    ref_out, ref_lse = dense_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=1e-6)


def test_sinks_and_local_window_are_forced(rng):
    q = torch.randn(1, 200, 2, 8, generator=rng)
    k = torch.randn(1, 200, 1, 8, generator=rng)
    cfg = VerticalSlashConfig(
        last_q=8, vertical_topp=0.01, slash_topp=0.01, block_size=16, sink_tokens=4, local_window=20
    )
    index = build_vertical_slash_index(q, k, cfg)
    mask = index.to_dense_mask(200)
    assert mask[:, :, 4:, :4].all()  # sinks
    i = torch.arange(200)
    for lag in range(20):  # every query sees its previous 20 tokens
        rows = i[lag:]
        assert mask[:, :, rows, rows - lag].all()


def test_block_column_layout(rng, device):
    q = torch.randn(2, 180, 4, 8, generator=rng)
    k = torch.randn(2, 180, 2, 8, generator=rng)
    cfg = VerticalSlashConfig(last_q=16, vertical_topp=0.7, slash_topp=0.5, block_size=16)
    built = build_vertical_slash_index(q.to(device), k.to(device), cfg)
    layout_on_device = built.block_columns()
    index = built.to("cpu")
    layout = index.block_columns()
    for name in ("block_idx", "block_count", "column_idx", "column_count"):
        assert torch.equal(getattr(layout_on_device, name).cpu(), getattr(layout, name)), name
    n_blocks = index.num_blocks
    assert layout.block_idx.shape[:3] == (2, 4, n_blocks) == layout.column_idx.shape[:3]
    mask = index.to_dense_mask(180)
    for b in range(2):
        for h in range(4):
            diags = {d for d in index.slash[b, h].tolist() if d >= 0}
            verticals = [c for c in index.vertical[b, h].tolist() if c >= 0]
            for qb in range(n_blocks):
                n_t, n_c = layout.block_count[b, h, qb].item(), layout.column_count[b, h, qb].item()
                tiles = layout.block_idx[b, h, qb].tolist()
                cols = layout.column_idx[b, h, qb].tolist()
                assert tiles[:n_t] == sorted(qb - d for d in diags if d <= qb) and set(tiles[n_t:]) <= {-1}
                last_row = min((qb + 1) * 16, 180) - 1
                want = [c for c in verticals if c <= last_row and (qb - c // 16) not in diags]
                assert cols[:n_c] == want and set(cols[n_c:]) <= {-1}
                # Tiles and bars cover exactly the block's mask rows.
                rows = slice(qb * 16, last_row + 1)
                covered = torch.zeros(180, dtype=torch.bool)
                for t in tiles[:n_t]:
                    covered[t * 16 : (t + 1) * 16] = True
                covered[torch.tensor(want, dtype=torch.long)] = True
                assert torch.equal(mask[b, h, rows].any(0), covered & (torch.arange(180) <= last_row))

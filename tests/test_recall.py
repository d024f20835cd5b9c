"""Index recall (``attention_recall``) against fp64 dense attention under the index's own
mask, and its context-parallel form against the single-device one on gloo processes."""

import pytest
import torch
import torch.distributed as dist
from gloo import run

from megatron_mtraining.context_parallel import ContextParallelLayout
from megatron_mtraining.context_parallel.recall import distributed_attention_recall
from megatron_mtraining.patterns.dense import DensePattern
from megatron_mtraining.patterns.moba import MoBAPattern
from megatron_mtraining.patterns.msa import MSAPattern
from megatron_mtraining.patterns.vertical_slash import VerticalSlashPattern
from megatron_mtraining.sparse import (
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    attention_recall,
)

B, HQ, HKV, D = 2, 4, 2, 8
ROWS = 24


def _patterns(q, gen):
    s = q.shape[1]
    q_idx = torch.randn(B, s, HKV, 8, generator=gen, dtype=torch.float64)
    k_idx = torch.randn(B, s, 1, 8, generator=gen, dtype=torch.float64)
    return {
        "dense": DensePattern(),
        "vertical_slash": VerticalSlashPattern(
            VerticalSlashConfig(last_q=16, vertical_topp=0.6, slash_topp=0.6, block_size=16)
        ),
        "moba": MoBAPattern(MoBAConfig(chunk_size=32, topk=2)),
        "msa": MSAPattern(MSAConfig(block_size=16, topk=2, index_head_dim=8), q_idx, k_idx),
    }


def _inputs(gen, seq):
    return (torch.randn(B, seq, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV))


@pytest.mark.parametrize("kind", ["dense", "vertical_slash", "moba", "msa"])
def test_recall_equals_dense_mass_under_the_mask(kind, rng):
    seq = 200  # not a multiple of the blocks
    q, k = _inputs(rng, seq)
    index = _patterns(q, rng)[kind].local_index(q, k, D**-0.5)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(HQ // HKV, dim=2)) * D**-0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)[:, :, -ROWS:]
    mask = index.to_dense_mask(seq)
    expected = (probs * mask[:, :, -ROWS:]).sum(-1).mean(-1)
    # An index that says it is complete (its recall is taken as 1) attends the causal mask.
    assert index.complete == bool((mask == causal).all()), (kind, index.complete)
    recall = attention_recall(q, k, index, num_rows=ROWS)
    torch.testing.assert_close(recall, expected.float(), rtol=1e-6, atol=1e-6)
    if kind == "dense":
        assert torch.allclose(recall, torch.ones_like(recall))
    else:
        assert (recall < 1).any()  # the patterns drop mass at this sparsity


def _check_distributed_recall(rank, world, seed, seq):
    gen = torch.Generator().manual_seed(seed)
    q, k = _inputs(gen, seq)
    for name, pattern in _patterns(q, gen).items():
        expected = attention_recall(q, k, pattern.local_index(q, k, D**-0.5), num_rows=ROWS)
        for kind in ("contiguous", "zigzag", "striped"):
            layout = ContextParallelLayout(kind, world, seq, stripe=16)
            lq, lk = layout.shard(q, rank), layout.shard(k, rank)
            local_pattern = pattern
            if isinstance(pattern, MSAPattern):
                local_pattern = pattern.with_inputs(
                    layout.shard(pattern.q_idx, rank), layout.shard(pattern.k_idx, rank)
                )
            index = local_pattern.distributed_index(lq, lk, layout, dist.group.WORLD, D**-0.5)
            recall = distributed_attention_recall(lq, lk, index, layout, num_rows=ROWS)
            torch.testing.assert_close(recall, expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {name} {kind}")


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_recall_equals_single_device(world, rng):
    run(world, _check_distributed_recall, int(torch.randint(0, 2**31, (1,), generator=rng)), 256)

"""The pattern registry: what every caller asks, and a pattern defined outside the package."""

import dataclasses

import pytest
import torch
from dense_reference import dense_attention

from megatron_mtraining import patterns
from megatron_mtraining.context_parallel import ContextParallelLayout, build_index, ring_attention
from megatron_mtraining.megatron.config import MTrainingAttentionConfig
from megatron_mtraining.patterns.base import Pattern
from megatron_mtraining.sparse import BlockTopKIndex, IndexBranch, MSAConfig, sparse_attention
from megatron_mtraining.sparse.validation import ValidatedConfig


def test_every_attention_type_is_one_registered_class():
    assert patterns.names()[0] == "dense"
    assert set(patterns.names()) == {"dense", "mtraining", "msa", "moba"}
    fields = {f.name: f for f in dataclasses.fields(MTrainingAttentionConfig)}
    for name in patterns.names():
        cls = patterns.get(name)
        assert cls.name == name and issubclass(cls, Pattern)
        if cls.settings is None:
            assert name not in fields
            continue
        # Each pattern's settings are the config section named after it, defaults included.
        assert issubclass(cls.settings, ValidatedConfig)
        assert fields[name].type is cls.settings
        assert getattr(MTrainingAttentionConfig(), name) == cls.settings()
        bound = MTrainingAttentionConfig(type=name).pattern
        assert type(bound) is cls and bound.config == cls.settings()
    with pytest.raises(ValueError, match=r"attention.type='flash'.*one of dense, moba, msa, mtraining"):
        patterns.get("flash")


def test_register_rejects_a_taken_name_and_a_non_pattern():
    class Other(Pattern):
        name = "dense"

    with pytest.raises(ValueError, match=r"pattern name='dense'.*not taken \(by DensePattern\)"):
        patterns.register(Other)
    with pytest.raises(ValueError, match=r"pattern class=.*subclass of .*Pattern"):
        patterns.register(dict)
    assert patterns.get("dense").__name__ == "DensePattern"


def test_msa_index_parameters_match_the_index_branch():
    cfg = MSAConfig(index_head_dim=24)
    branch = IndexBranch(64, 3, cfg)
    want = sum(p.numel() for p in branch.parameters())
    assert patterns.get("msa").index_parameters(cfg, 64, 3) == want
    assert patterns.get("mtraining").index_parameters(None, 64, 3) == 0


@pytest.mark.parametrize(
    "name, values, seq, match",
    [
        ("msa", {"block_size": 64, "topk": 2}, 64, r"msa.block_size=64.*below seq_length \(64\)"),
        ("moba", {"chunk_size": 32, "topk": 4}, 128, r"moba.topk=4.*at most 3: .*128 / 32 gives 4 blocks"),
        ("mtraining", {"block_size": 128}, 128, r"mtraining.block_size=128"),
    ],
)
def test_sequence_checks_name_the_section_field(name, values, seq, match):
    cls = patterns.get(name)
    with pytest.raises(ValueError, match=match):
        cls.check_sequence(cls.settings(**values), seq, name)
    cls.check_sequence(cls.settings(**values), 4 * seq, name)


class PreviousBlockPattern(Pattern):
    """A pattern defined outside the package (not registered): each query attends its own
    block and the one before, per KV head."""

    name = "previous_block"

    def local_index(self, q, k, scale):
        bsz, seq, hq, _ = q.shape
        own = torch.arange(seq) // 16
        # Ascending ids, padded with -1 at the end (block 0 has no predecessor).
        first = torch.stack((own - 1, own), -1)
        blocks = torch.where((own == 0).unsqueeze(-1), torch.tensor([0, -1]), first)
        blocks = blocks.view(1, seq, 1, 2).expand(bsz, seq, k.shape[2], 2).to(torch.int32).contiguous()
        return BlockTopKIndex(blocks=blocks, block_size=16, num_heads=hq)


def test_a_pattern_outside_the_registry_runs_through_the_ring(rng):
    """The ring and the core attention take any object with the index-source methods; the
    result equals fp64 dense attention under the index's own mask, gradients included."""
    q, k, v = (torch.randn(2, 64, h, 8, generator=rng, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    pattern = PreviousBlockPattern()
    index = build_index(pattern, q, k, 8**-0.5)
    mask = index.to_dense_mask(64)
    assert mask.sum() == 2 * 4 * sum(min(i + 1, 16 + i % 16 + 1) for i in range(64))
    out, _ = ring_attention(q, k, v, pattern, ContextParallelLayout("striped", 1, 64, stripe=16), None)
    ref, _ = dense_attention(q, k, v, mask, 8**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, exp in zip(grads, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)
    assert torch.equal(sparse_attention(q, k, v, index)[0], out)
    with pytest.raises(ValueError, match=r"pattern='str'.*a pattern .* or a SparseIndex"):
        build_index("dense", q, k, 8**-0.5)

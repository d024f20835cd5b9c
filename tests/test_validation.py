"""Bad input raises ValueError naming the argument, the bad value and what is accepted."""

import re

import pytest
import torch

from megatron_mtraining.sparse import (
    BlockTopKIndex,
    DenseIndex,
    IndexBranch,
    MoBAConfig,
    MSAConfig,
    VerticalSlashConfig,
    VerticalSlashIndex,
    merge_attention_outputs,
    msa_kl_loss,
    msa_select_blocks,
    sparse_attention,
)

B, S, HQ, HKV, D = 2, 40, 4, 2, 8


def randn(rng, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=rng, dtype=torch.float64).to(dtype)


def qkv(rng, b=B, s=S, hq=HQ, hkv=HKV, d=D, dtype=torch.float32):
    return (
        randn(rng, b, s, hq, d, dtype=dtype),
        randn(rng, b, s, hkv, d, dtype=dtype),
        randn(rng, b, s, hkv, d, dtype=dtype),
    )


def raises(fn, name, value, accepted):
    """``fn()`` raises ValueError whose message reads ``name=repr(value) ... expected ...accepted...``."""
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")) as info:
        fn()
    message = str(info.value)
    assert "expected" in message, message
    assert accepted in message, message


# ----------------------------------------------------------------------------- sparse_attention


def test_q_not_4d(rng):
    q, k, v = qkv(rng)
    raises(lambda: sparse_attention(q[0], k, v, DenseIndex(B, HQ, S)), "q.shape", (S, HQ, D), "4-d")


def test_k_wrong_batch(rng):
    q, k, v = qkv(rng)
    k1 = randn(rng, B + 1, S, HKV, D)
    raises(lambda: sparse_attention(q, k1, k1, DenseIndex(B, HQ, S)), "k.shape", (B + 1, S, HKV, D), "batch and length")


def test_k_wrong_length(rng):
    q, k, v = qkv(rng)
    k1 = randn(rng, B, S - 1, HKV, D)
    raises(lambda: sparse_attention(q, k1, k1, DenseIndex(B, HQ, S)), "k.shape", (B, S - 1, HKV, D), "batch and length")


def test_k_head_dim_differs(rng):
    q, k, v = qkv(rng)
    k1 = randn(rng, B, S, HKV, D * 2)
    raises(lambda: sparse_attention(q, k1, k1, DenseIndex(B, HQ, S)), "k.shape[3]", D * 2, f"head dim of q ({D})")


def test_query_heads_not_multiple_of_kv_heads(rng):
    q, k, v = qkv(rng, hq=3, hkv=2)
    raises(lambda: sparse_attention(q, k, v, DenseIndex(B, 3, S)), "k.shape[2]", 2, "divisor of the query head count 3")


def test_dtype_mismatch_q_k(rng):
    q, k, v = qkv(rng)
    raises(
        lambda: sparse_attention(q, k.double(), v.double(), DenseIndex(B, HQ, S)),
        "k.dtype",
        torch.float64,
        "dtype of q (torch.float32)",
    )


def test_v_shape_differs(rng):
    q, k, v = qkv(rng)
    v1 = randn(rng, B, S, HKV, D + 1)
    raises(lambda: sparse_attention(q, k, v1, DenseIndex(B, HQ, S)), "v.shape", (B, S, HKV, D + 1), "shape of k")


def test_integer_q(rng):
    q, k, v = qkv(rng)
    qi = torch.randint(0, 5, q.shape, generator=rng)
    raises(lambda: sparse_attention(qi, k, v, DenseIndex(B, HQ, S)), "q.dtype", torch.int64, "torch.float32")


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale(scale, rng):
    q, k, v = qkv(rng)
    raises(
        lambda: sparse_attention(q, k, v, DenseIndex(B, HQ, S), softmax_scale=scale),
        "softmax_scale",
        scale,
        "positive finite",
    )


def test_index_not_a_sparse_index(rng):
    q, k, v = qkv(rng)
    raises(lambda: sparse_attention(q, k, v, torch.zeros(B, S)), "index", "Tensor", "sparse index")


def test_index_for_other_seq_len(rng):
    q, k, v = qkv(rng)
    raises(
        lambda: sparse_attention(q, k, v, DenseIndex(1, HQ, S + 1)),
        "index.seq_len (DenseIndex)",
        S + 1,
        f"sequence length of q ({S})",
    )


def test_index_for_other_head_count(rng):
    q, k, v = qkv(rng)
    raises(
        lambda: sparse_attention(q, k, v, DenseIndex(B, HQ * 2, S)),
        "index.num_heads (DenseIndex)",
        HQ * 2,
        f"query head count of q ({HQ})",
    )


def test_index_for_other_batch_size(rng):
    q, k, v = qkv(rng)
    raises(
        lambda: sparse_attention(q, k, v, DenseIndex(B + 1, HQ, S)),
        "index.batch_size (DenseIndex)",
        B + 1,
        f"batch size of q ({B})",
    )


def test_vertical_slash_index_for_other_head_count(rng):
    q, k, v = qkv(rng)
    index = VerticalSlashIndex(
        vertical=torch.full((B, HQ + 1, 1), -1, dtype=torch.int32),
        slash=torch.zeros(B, HQ + 1, 1, dtype=torch.int32),
        seq_len=S,
        block_size=16,
    )
    raises(lambda: sparse_attention(q, k, v, index), "index.num_heads (VerticalSlashIndex)", HQ + 1, str(HQ))


def test_block_topk_index_incompatible_selection_heads(rng):
    q, k, v = qkv(rng, hq=6, hkv=2)
    blocks = (torch.arange(S) // 16).int().view(1, S, 1, 1).expand(B, S, 3, 1).contiguous()
    index = BlockTopKIndex(blocks=blocks, block_size=16, num_heads=6)
    raises(
        lambda: sparse_attention(q, k, v, index),
        "index selection heads (BlockTopKIndex)",
        3,
        "multiple of the KV head count 2 that divides 6",
    )


@pytest.mark.parametrize(("bad", "at"), [(3, (1, 39, 0, 1)), (-2, (0, 17, 1, 0)), (10**6, (1, 0, 1, 1))])
def test_block_topk_index_block_ids_out_of_range(bad, at):
    # S = 40 in blocks of 16: key blocks 0, 1, 2 (the last one partial); -1 pads.
    blocks = torch.tensor([0, -1]).int().view(1, 1, 1, 2).repeat(B, S, HKV, 1)
    blocks[..., 0] = torch.arange(S).int().view(1, -1, 1) // 16
    BlockTopKIndex(blocks=blocks, block_size=16, num_heads=HQ)  # the last block and the padding are accepted
    blocks[at] = bad
    raises(
        lambda: BlockTopKIndex(blocks=blocks, block_size=16, num_heads=HQ),
        f"BlockTopKIndex.blocks[{', '.join(map(str, at))}]",
        bad,
        "a key block id in [0, 3) (sequence length 40, block size 16), or -1 for no block",
    )


def test_block_topk_index_float_blocks():
    blocks = torch.zeros(B, S, HKV, 1)
    raises(
        lambda: BlockTopKIndex(blocks=blocks, block_size=16, num_heads=HQ),
        "BlockTopKIndex.blocks.dtype",
        blocks.dtype,
        "int32",
    )


# ----------------------------------------------------------------------------- configs

CONFIG_CASES = [
    (VerticalSlashConfig, "vertical_topp", 0, "(0, 1]"),
    (VerticalSlashConfig, "vertical_topp", 1.5, "(0, 1]"),
    (VerticalSlashConfig, "vertical_topp", float("nan"), "(0, 1]"),
    (VerticalSlashConfig, "slash_topp", -0.1, "(0, 1]"),
    (VerticalSlashConfig, "last_q", 0, ">= 1"),
    (VerticalSlashConfig, "last_q", 2.5, "integer"),
    (VerticalSlashConfig, "block_size", 48, "power of two"),
    (VerticalSlashConfig, "block_size", 8, ">= 16"),
    (VerticalSlashConfig, "vertical_cap", 0, ">= 1"),
    (VerticalSlashConfig, "slash_cap", 0, ">= 1"),
    (VerticalSlashConfig, "sink_tokens", -1, ">= 0"),
    (VerticalSlashConfig, "local_window", -1, ">= 0"),
    (MSAConfig, "topk", 0, ">= 1"),
    (MSAConfig, "block_size", 100, "power of two"),
    (MSAConfig, "index_head_dim", 0, ">= 1"),
    (MSAConfig, "kl_coeff", 0, "positive finite"),
    (MSAConfig, "kl_coeff", float("inf"), "positive finite"),
    (MSAConfig, "warmup_steps", -1, ">= 0"),
    (MoBAConfig, "chunk_size", 1000, "power of two"),
    (MoBAConfig, "topk", 0, ">= 1"),
    (MoBAConfig, "topk", True, "integer"),
]


@pytest.mark.parametrize(
    "cls,field,value,accepted", CONFIG_CASES, ids=[f"{c.__name__}.{f}={v!r}" for c, f, v, _ in CONFIG_CASES]
)
def test_bad_config_field(cls, field, value, accepted):
    raises(lambda: cls(**{field: value}), f"{cls.__name__}.{field}", value, accepted)


def test_default_configs_are_valid():
    VerticalSlashConfig()
    MSAConfig()
    MoBAConfig()


# ----------------------------------------------------------------------------- MSA

MSA_CFG = MSAConfig(block_size=16, topk=2, index_head_dim=8)


def test_msa_select_blocks_k_idx_with_two_heads(rng):
    q_idx, k_idx = randn(rng, B, S, HKV, 8), randn(rng, B, S, 2, 8)
    raises(lambda: msa_select_blocks(q_idx, k_idx, MSA_CFG, HQ), "k_idx.shape[2]", 2, "1 (one index key head")


def test_msa_select_blocks_q_idx_head_dim(rng):
    q_idx, k_idx = randn(rng, B, S, HKV, 4), randn(rng, B, S, 1, 4)
    raises(lambda: msa_select_blocks(q_idx, k_idx, MSA_CFG, HQ), "q_idx.shape[3]", 4, "MSAConfig.index_head_dim (8)")


def test_msa_select_blocks_num_heads_not_multiple_of_groups(rng):
    q_idx, k_idx = randn(rng, B, S, 2, 8), randn(rng, B, S, 1, 8)
    raises(
        lambda: msa_select_blocks(q_idx, k_idx, MSA_CFG, 3), "num_heads", 3, "multiple of the index query head count 2"
    )


def test_msa_kl_loss_wrong_group_count(rng):
    q, k, _ = qkv(rng)
    q_idx, k_idx = randn(rng, B, S, HKV + 1, 8), randn(rng, B, S, 1, 8)
    raises(
        lambda: msa_kl_loss(q, k, q_idx, k_idx, DenseIndex(B, HQ, S)),
        "q_idx.shape",
        (B, S, HKV + 1, 8),
        f"[{B}, {S}, {HKV}, d_idx]",
    )


def test_msa_kl_loss_rejects_vertical_slash_index(rng):
    q, k, _ = qkv(rng)
    q_idx, k_idx = randn(rng, B, S, HKV, 8), randn(rng, B, S, 1, 8)
    index = VerticalSlashIndex(
        vertical=torch.full((B, HQ, 1), -1, dtype=torch.int32),
        slash=torch.zeros(B, HQ, 1, dtype=torch.int32),
        seq_len=S,
        block_size=16,
    )
    raises(lambda: msa_kl_loss(q, k, q_idx, k_idx, index), "index", "VerticalSlashIndex", "BlockTopKIndex")


def test_index_branch_wrong_hidden_size(rng):
    branch = IndexBranch(hidden_size=32, num_kv_heads=HKV, config=MSA_CFG)
    raises(lambda: branch(randn(rng, B, S, 24)), "x.shape[2]", 24, "hidden size 32")


# ----------------------------------------------------------------------------- merge, masks


def test_merge_out_b_shape_differs(rng):
    out_a, out_b = randn(rng, B, S, HQ, D), randn(rng, B, S, HQ, D + 1)
    lse = randn(rng, B, HQ, S)
    raises(lambda: merge_attention_outputs(out_a, lse, out_b, lse), "out_b.shape", (B, S, HQ, D + 1), "shape of out_a")


def test_merge_lse_a_wrong_shape(rng):
    out = randn(rng, B, S, HQ, D)
    lse_a, lse_b = randn(rng, B, S, HQ), randn(rng, B, HQ, S)
    raises(lambda: merge_attention_outputs(out, lse_a, out, lse_b), "lse_a.shape", (B, S, HQ), f"{[B, HQ, S]}")


def test_merge_lse_b_wrong_rank(rng):
    out = randn(rng, B, S, HQ, D)
    lse_a, lse_b = randn(rng, B, HQ, S), randn(rng, B, HQ, S, 1)
    raises(lambda: merge_attention_outputs(out, lse_a, out, lse_b), "lse_b.shape", (B, HQ, S, 1), "3-d")


@pytest.mark.parametrize("kind", ["dense", "vertical_slash", "block_topk"])
def test_to_dense_mask_wrong_seq_len(kind):
    if kind == "dense":
        index = DenseIndex(B, HQ, S)
    elif kind == "vertical_slash":
        index = VerticalSlashIndex(
            vertical=torch.full((B, HQ, 1), -1, dtype=torch.int32),
            slash=torch.zeros(B, HQ, 1, dtype=torch.int32),
            seq_len=S,
            block_size=16,
        )
    else:
        blocks = (torch.arange(S) // 16).int().view(1, S, 1, 1).expand(B, S, HKV, 1).contiguous()
        index = BlockTopKIndex(blocks=blocks, block_size=16, num_heads=HQ)
    raises(lambda: index.to_dense_mask(S + 3), "seq_len", S + 3, f"built for ({S})")


def test_index_on_another_device_is_rejected(rng):
    q = torch.randn(1, 32, 2, 8, generator=rng)
    k = torch.randn(1, 32, 1, 8, generator=rng)
    index = DenseIndex(1, 2, 32, device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"index\.device \(DenseIndex\)='meta'.*index\.to\(device\)"):
        sparse_attention(q, k, k, index)
    assert DenseIndex(1, 2, 32).to("meta").device.type == "meta"


def test_kernels_refuse_inputs_past_int32_offsets():
    from megatron_mtraining.sparse.dispatch import backend_choice

    # An expanded view: 2^31 + 2^17 elements without the memory.
    q = torch.zeros((), dtype=torch.bfloat16).expand(1, 2**20 + 64, 16, 128)
    with pytest.raises(ValueError, match=r"backend='triton'.*fewer than 2\^31 elements.*context parallelism"):
        backend_choice(q, "triton")
    assert backend_choice(q[:, : 2**20 - 64]) == ("triton" if q.is_cuda else "reference")

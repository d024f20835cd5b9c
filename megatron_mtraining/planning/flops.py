"""FLOP counts of a GPT layer with the plugin's attention (the convention of
``docs/benchmarks.md``: useful FLOPs count the matmuls and the attended area only)."""

from __future__ import annotations


def layer_matmul_flops_per_token(shape: dict) -> float:
    """Forward FLOPs of one layer's linear layers (QKV, projection, SwiGLU MLP) per token."""
    h, ffn, d = shape["hidden_size"], shape["ffn_hidden_size"], shape["kv_channels"]
    hq, hkv = shape["num_attention_heads"], shape["num_query_groups"]
    return 2 * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * ffn)


def mlp_share(shape: dict) -> float:
    """The MLP's share of a layer's matmul FLOPs (what selective MLP recomputation runs again)."""
    h, ffn = shape["hidden_size"], shape["ffn_hidden_size"]
    return 2 * 3 * h * ffn / layer_matmul_flops_per_token(shape)


def attention_flops(pairs: float, head_dim: int) -> float:
    """Forward FLOPs of attention over ``pairs`` attended (query head, query, key) triples
    (``4 * area * d``; the backward is 2.5x)."""
    return 4 * pairs * head_dim


def model_flops(shape: dict, seq: int, attended_fraction: float) -> dict:
    """Useful FLOPs of one sample: per layer matmuls and attention (forward; the backward is
    2x the matmuls' and 2.5x the attention's), and the output layer."""
    matmul_fwd = layer_matmul_flops_per_token(shape) * seq
    pairs = attended_fraction * seq * (seq + 1) / 2 * shape["num_attention_heads"]
    attention_fwd = attention_flops(pairs, shape["kv_channels"])
    output_fwd = 2 * shape["hidden_size"] * shape["padded_vocab_size"] * seq
    return {
        "matmul_fwd_per_layer": matmul_fwd,
        "attention_fwd_per_layer": attention_fwd,
        "output_layer_fwd": output_fwd,
        "per_layer_useful": 3 * matmul_fwd + 3.5 * attention_fwd,
    }

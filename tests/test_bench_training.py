"""``scripts/bench_training.py``'s FLOP count: useful attention FLOPs follow the area computed,
with packed documents the attended share of the documents' area only."""

import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_training", pathlib.Path(__file__).parents[1] / "scripts" / "bench_training.py"
)
bench_training = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_training)

SHAPE = {
    "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 64,
    "padded_vocab_size": 1000,
}  # fmt: skip
SEQ, LAYERS = 4096, 2


def _attention_fwd(pairs_share: float) -> float:
    """4 x attended (head, query, key) triples x head dim, the triples counted by hand."""
    causal = SEQ * (SEQ + 1) / 2
    return 4 * pairs_share * causal * SHAPE["num_attention_heads"] * SHAPE["kv_channels"]


@pytest.mark.parametrize("metrics,share", [({"attended_fraction": 0.3}, 0.3),
                                            ({"attended_fraction": 0.9, "document_area": 0.05}, 0.045)])  # fmt: skip
def test_useful_flops_count_the_area_computed(metrics, share):
    row = {"metrics": metrics, "steady_s_per_iteration": 2.0, "device": "NVIDIA H200", "profile": {"parts_ms": {}}}
    summary = bench_training.summarize(row, SHAPE, SEQ, LAYERS, rate=None)
    assert summary["flops"]["attention_fwd_per_layer"] == pytest.approx(_attention_fwd(share), rel=1e-12)
    assert summary["attended_fraction"] == metrics["attended_fraction"]  # the logged figure, as logged
    matmuls = summary["flops"]["matmul_fwd_per_layer"]
    useful = LAYERS * (3 * matmuls + 3.5 * _attention_fwd(share)) + 3 * summary["flops"]["output_layer_fwd"]
    assert summary["model_tflops"] == pytest.approx(useful / 2.0 / 1e12, rel=1e-12)

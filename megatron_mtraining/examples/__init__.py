"""Programs built on the library rather than part of it: the quickstart
(``python -m megatron_mtraining.examples.quickstart``), the sparse-attention demo
(``python -m megatron_mtraining.examples.demo``), and ``synthetic``, the synthetic attention
inputs and index patterns they, the benchmark scripts and the tests share."""

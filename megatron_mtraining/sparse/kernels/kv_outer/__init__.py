"""KV-outer attention over a per-query top-k block selection (MSA, MoBA): a program takes
one key block and the queries that chose it. ``kernels`` holds the Triton kernels,
``attention`` their autograd function and launch settings, ``reverse_index`` the
selection transposed into per-key-block work lists."""

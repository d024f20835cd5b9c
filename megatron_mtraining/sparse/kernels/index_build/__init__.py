"""Triton kernels of the index builders: the vertical-slash window statistics
(``window_stats``) and top-p take (``top_p``), MSA's block selection (``msa_index``), and the
top-k of block scores (``topk_blocks``: MoBA's gate choice)."""

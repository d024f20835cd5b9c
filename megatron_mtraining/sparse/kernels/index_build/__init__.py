"""Triton kernels of the index builders: the vertical-slash window statistics
(``window_stats``) and top-p take (``top_p``), and MSA's block selection (``msa_index``)."""

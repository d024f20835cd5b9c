"""MSA's sparse KL loss in two loop orders. Over the union-of-tiles tables: ``kernels`` holds
the Triton kernels (index LSE, dq_idx with the per-row KL value, dk_idx), ``loss`` their
launches and the autograd function that skips the KL forward (the main pass's LSE makes the
teacher), which runs either order. KV-outer, for a sparse top-k index: ``kv_kernels`` and
``kv_loss``, on ``kv_outer``'s reverse index."""

"""What both attention families share: the Triton device functions their kernels are
built of (``kernels``), the merge of two partial results (``combine``) and the allocation
of every kernel output (``buffers``)."""

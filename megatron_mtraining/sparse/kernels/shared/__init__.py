"""What both attention families share: the Triton device functions their kernels are
built of (``kernels``), the merge of two partial results (``combine``), rows gathered or
added by an index (``rows``), the allocation of every kernel output (``buffers``) and the
architecture a launch targets (``arch``)."""

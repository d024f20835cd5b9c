"""Top-k attention over wide key blocks (MoBA's chunks) on a library's varlen attention, a key
block at a time: ``library`` holds the varlen calls and chooses among them (``choice``: PyTorch's
FlashAttention-2 on CUDA, cuDNN's ragged attention of ``cudnn_library`` on sm90 when asked for,
a PyTorch stand-in elsewhere), ``attention`` the segment layout and the
autograd function that gathers each key block's queries, runs the calls and merges their
partial results by LSE."""

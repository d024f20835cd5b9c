"""Top-k attention over wide key blocks (MoBA's chunks) on a library's varlen attention, a key
block at a time: ``library`` holds the varlen calls (PyTorch's FlashAttention-2 on CUDA, a
PyTorch stand-in elsewhere), ``attention`` the segment layout and the autograd function that
gathers each key block's queries, runs the calls and merges their partial results by LSE."""

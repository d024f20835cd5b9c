"""Top-k attention over wide key blocks (MoBA's chunks) on a library's varlen attention, a key
block at a time: ``library`` holds PyTorch's FlashAttention-2 calls and their PyTorch stand-in,
``cudnn_library`` the same calls on cuDNN's ragged attention, ``choose`` picks one and says why,
and ``attention`` holds the segment layout and the autograd function that gathers each key
block's queries, runs the calls and merges their partial results by LSE."""

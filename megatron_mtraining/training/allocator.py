"""The CUDA caching allocator's setting that the product runs with, in one place.

The training entry point and the GPU benchmarks take it alike, so a kernel's figure is
measured under the allocator a training step has. Long sequences allocate logits- and
K/V-sized blocks of many sizes, which fragment the default allocator; with expandable
segments a freed block's pages serve a larger request (docs/benchmarks.md: 12.6 against 3.0
GiB reserved above the peak in "Training entry point and embedded default on GPUs", and
MoBA's 512K kernel rows on an H100). PyTorch reads the variable at the first CUDA
allocation, so the call must come before any; a value the user set is kept."""

from __future__ import annotations

import os

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments() -> str:
    """Sets ``PYTORCH_CUDA_ALLOC_CONF`` to expandable segments unless set; returns its value."""
    return os.environ.setdefault(ALLOC_CONF_ENV, EXPANDABLE_SEGMENTS)

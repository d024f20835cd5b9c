"""Allocation of every kernel output, in one place so that tests can poison it (NaN), which
shows any row a kernel fails to write. Callers look ``new_buffer`` up on this module at each
call (``buffers.new_buffer``) for the tests' replacement to reach them."""

from __future__ import annotations

import torch


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised kernel output."""
    return torch.empty(shape, dtype=dtype, device=device)

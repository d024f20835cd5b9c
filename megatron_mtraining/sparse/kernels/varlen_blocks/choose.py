"""Which varlen library runs ``varlen_blocks``' calls, and why: the one place it is chosen.

The stand-in (``library.ReferenceVarlen``) off CUDA; on CUDA as ``MTRAINING_VARLEN_LIBRARY``
says. ``auto`` (the default): cuDNN's ragged attention (``cudnn_library.CudnnVarlen``) where
``cudnn_library.unsupported`` has nothing against the call (sm90, cudnn-frontend installed with
cuDNN >= 9.6, fp16/bf16, head dim a multiple of 8 up to 256), else PyTorch's FlashAttention-2
(``library.FlashVarlen``: sm80, or cudnn-frontend missing); cuDNN's Hopper kernels run MoBA's
calls at about 1.5x FlashAttention-2's rate (``docs/benchmarks.md``). ``flash`` forces
FlashAttention-2; ``cudnn`` forces cuDNN, an error where it cannot run. The variable is read on
every call, as ``MTRAINING_ATTENTION_BACKEND`` is.
"""

from __future__ import annotations

import torch

from ...validation import env_choice, fail
from . import cudnn_library
from .library import FlashVarlen, ReferenceVarlen

LIBRARY_ENV = "MTRAINING_VARLEN_LIBRARY"
LIBRARY_SETTINGS = ("auto", "flash", "cudnn")


def library(q: torch.Tensor):
    """The calls for inputs like ``q``, as ``choice`` picks them."""
    return choice(q)[0]


def choice(q: torch.Tensor) -> tuple[type, str]:
    """(the calls for inputs like ``q``, why): the stand-in off CUDA; on CUDA as
    ``MTRAINING_VARLEN_LIBRARY`` says (module docstring).
    Forward and backward each ask; were the answers to differ, the pieces still agree (each
    library's backward takes the caller's output and LSE)."""
    if not q.is_cuda:
        return ReferenceVarlen, f"{q.device.type} tensors: the PyTorch stand-in"
    setting = env_choice(LIBRARY_ENV, LIBRARY_SETTINGS)
    flash = "PyTorch's FlashAttention-2 varlen kernels"
    if setting == "flash":
        return FlashVarlen, f"{flash} ({LIBRARY_ENV}=flash)"
    cudnn = "cuDNN's ragged attention (cudnn-frontend"
    why_not = cudnn_library.unsupported(q)
    if setting == "auto":
        if why_not is None:
            return cudnn_library.CudnnVarlen, f"{cudnn}, {LIBRARY_ENV}=auto)"
        return FlashVarlen, f"{flash} (not cuDNN's ragged attention: {why_not})"
    if why_not is not None:
        fail(LIBRARY_ENV, setting, f"inputs cuDNN's ragged attention serves ({cudnn_library.REQUIREMENTS}); {why_not}")
    return cudnn_library.CudnnVarlen, f"{cudnn}, {LIBRARY_ENV}=cudnn)"

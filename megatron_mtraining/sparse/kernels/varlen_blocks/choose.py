"""Which varlen library runs ``varlen_blocks``' calls, and why: the one place it is chosen.

The stand-in (``library.ReferenceVarlen``) off CUDA; on CUDA as ``MTRAINING_VARLEN_LIBRARY``
says: PyTorch's FlashAttention-2 (``library.FlashVarlen``) under ``auto`` (the default) and
``flash``; cuDNN's ragged attention (``cudnn_library.CudnnVarlen``) under ``cudnn``, where
``cudnn_library.unsupported`` has nothing against the call (sm90, cudnn-frontend installed with
cuDNN >= 9.6, fp16/bf16, head dim a multiple of 8 up to 256), an error where it cannot run.
cuDNN's calls are opt-in until they have run on a GPU (they are verified against an emulated
cuDNN only); ``auto`` is to take them on sm90 once measured. The variable is read on every call,
as ``MTRAINING_ATTENTION_BACKEND`` is.
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
    ``MTRAINING_VARLEN_LIBRARY`` says: FlashAttention-2 under ``auto`` and ``flash``, cuDNN's
    ragged attention under ``cudnn`` (module docstring).
    Forward and backward each ask; were the answers to differ, the pieces still agree (each
    library's backward takes the caller's output and LSE)."""
    if not q.is_cuda:
        return ReferenceVarlen, f"{q.device.type} tensors: the PyTorch stand-in"
    setting = env_choice(LIBRARY_ENV, LIBRARY_SETTINGS)
    flash = "PyTorch's FlashAttention-2 varlen kernels"
    if setting == "flash":
        return FlashVarlen, f"{flash} ({LIBRARY_ENV}=flash)"
    if setting == "auto":
        return FlashVarlen, f"{flash} (cuDNN's ragged attention is opt-in until run on a GPU: {LIBRARY_ENV}=cudnn)"
    why_not = cudnn_library.unsupported(q)
    if why_not is not None:
        fail(LIBRARY_ENV, setting, f"inputs cuDNN's ragged attention serves ({cudnn_library.REQUIREMENTS}); {why_not}")
    return cudnn_library.CudnnVarlen, f"cuDNN's ragged attention (cudnn-frontend, {LIBRARY_ENV}=cudnn)"

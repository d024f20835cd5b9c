"""What megatron.core needs to build, train and optimize a model on a machine without CUDA.

Megatron-Core assumes a CUDA device in a few dozen places. :func:`apply_cpu_compat` patches
them so the plugin's CPU tests (and a CPU run of the training entry point) use the same
Megatron code as a GPU run, with gloo for communication. It does nothing when CUDA is
available, and applying it twice is the same as once. Each patch below says why it exists;
the measurements behind them are in the project's research notes on megatron-core 0.19.2.
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode

_applied = False


class _NoStream:
    """Stands for ``torch.cuda.Stream`` and ``torch.cuda.Event``: on the CPU every operation
    is already complete when the next one starts, so waiting and recording do nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self) -> bool:
        return True

    def _nothing(self, *args, **kwargs):
        return None

    wait_stream = wait_event = record_event = record = wait = synchronize = _nothing


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device='cuda'`` to the CPU and drops ``pin_memory=True`` in every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def apply_cpu_compat() -> bool:
    """Patches torch and megatron.core for CPU-only runs; returns whether it is active
    (False with CUDA). Call it in every process before building a model."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    # Megatron puts new tensors on torch.cuda.current_device() (RoPE frequencies, buffers).
    torch.cuda.current_device = lambda: "cpu"
    # The default RNG tracker reads torch.cuda.get_rng_state(); the inference tracker's
    # add/fork do nothing, so dropout and initialisation draw from the CPU generator.
    seed = tp_random.model_parallel_cuda_manual_seed
    cpu_seed = functools.wraps(seed)(lambda *a, **k: seed(*a, **{**k, "inference_rng_tracker": True}))
    tp_random.model_parallel_cuda_manual_seed = tensor_parallel.model_parallel_cuda_manual_seed = cpu_seed
    # Activation recompute saves and restores the CUDA generator's state around the recomputed
    # region; there is none (Megatron saves the CPU generator's state separately).
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    # Megatron DDP and the optimizers order work on CUDA streams and events.
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.current_stream = torch.cuda.default_stream = torch.cuda.stream = _NoStream
    torch.cuda.synchronize = lambda *a, **k: None
    # Hard-coded .cuda() calls (e.g. the CP RoPE slice) and DataLoader pin-memory threads,
    # which the thread-local function mode below does not reach.
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor.record_stream = lambda self, *a, **k: None
    # About 70 call sites create tensors with device="cuda" or pin_memory=True.
    _CudaToCpu().__enter__()
    _applied = True
    return True

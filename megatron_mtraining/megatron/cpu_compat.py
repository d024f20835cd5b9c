"""What megatron.core (and megatron.training) need to run on a machine without CUDA.

Megatron-Core assumes a CUDA device in a few dozen places. :func:`apply_cpu_compat` patches
them so the plugin's CPU tests (and a CPU run of the training entry point) use the same
Megatron code as a GPU run, with gloo for communication. With ``training=True`` it also
patches what ``megatron.training.pretrain`` needs. It does nothing when CUDA is available, and
applying it twice is the same as once. Each patch below says why it exists; the
measurements behind them are in the project's research notes on megatron-core 0.19.2.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_training_applied = False


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


def apply_cpu_compat(training: bool = False) -> bool:
    """Patches torch and megatron.core (and with ``training`` megatron.training) for CPU-only
    runs; returns whether it is active (False with CUDA). Call it in every process before
    building a model (before ``pretrain``)."""
    global _applied
    if torch.cuda.is_available():
        return False
    if training:
        _apply_training()
    if _applied:
        return True
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    # Megatron puts new tensors on torch.cuda.current_device() (RoPE frequencies, buffers).
    torch.cuda.current_device = lambda: "cpu"
    # The default RNG tracker reads torch.cuda.get_rng_state(); the inference tracker's
    # add/fork do nothing, so dropout and initialisation draw from the CPU generator.
    seed = tp_random.model_parallel_cuda_manual_seed
    signature = inspect.signature(seed)

    @functools.wraps(seed)
    def cpu_seed(*args, **kwargs):
        # megatron.training passes the tracker flags positionally.
        bound = signature.bind(*args, **kwargs)
        bound.arguments["inference_rng_tracker"] = True
        return seed(*bound.args, **bound.kwargs)

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


def _apply_training() -> None:
    global _training_applied
    if _training_applied:
        return
    from megatron.core.optimizer import optimizer as optimizer_module
    from megatron.training import arguments, initialize, training

    # pretrain() calls initialize_megatron() without allow_no_cuda, which asserts CUDA; and
    # with torch.cuda.device_count() == 0 it creates no model-parallel groups and never seeds
    # the model-parallel RNG tracker. During it one (CPU) device is reported, and selecting
    # it does nothing (gloo takes no device).
    init = initialize.initialize_megatron

    @functools.wraps(init)
    def initialize_megatron(*args, **kwargs):
        count, select = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda *a, **k: None)
        try:
            return init(*args, **{**kwargs, "allow_no_cuda": True})
        finally:
            torch.cuda.device_count, torch.cuda.set_device = count, select

    training.initialize_megatron = initialize_megatron
    # validate_args reads the CUDA device's compute capability when TP or CP > 1.
    arguments.get_device_arch_version = lambda: 0
    # Megatron's jit_fuser is torch.compile: on a CPU each fused function costs seconds of C++
    # compilation at start-up, more than small CPU runs ever get back.
    torch._dynamo.config.disable = True
    # pretrain() warms the fused kernels up (initialize._warmup_jit_function) on torch.rand
    # tensors of seq_length / CP tokens. With device="cuda" rewritten to the CPU they draw from
    # the CPU generator, which initialisation draws from next (the CPU tracker's fork does
    # nothing): the initial weights would depend on the CP size. Keep the generator's state.
    warmup = initialize._warmup_jit_function

    @functools.wraps(warmup)
    def warmup_keeping_rng(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warmup(*args, **kwargs)

    initialize._warmup_jit_function = warmup_keeping_rng
    # Gradient clipping asserts CUDA gradients (optimizer/clip_grads.py: param.grad.type()).
    optimizer_module.clip_grad_by_total_norm_fp32 = _clip_grads_cpu
    # Checkpoints save the CUDA generator's state (training/checkpointing.py, get_rng_state);
    # the CPU generator's stands in (restoring it is a lazily queued no-op without CUDA).
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    _training_applied = True


def _clip_grads_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """``clip_grad_by_total_norm_fp32`` without its CUDA assertion: the same in-place scaling
    by ``min(1, max_norm / (total_norm + 1e-6))``."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    coeff = torch.as_tensor(max_norm / (total_norm + 1.0e-6)).clamp_max(1.0)
    if grads:
        torch._foreach_mul_(grads, coeff)

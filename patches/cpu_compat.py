"""Stand-ins for what torch and Megatron-Core need from CUDA, for runs without it.

Megatron-Core assumes a CUDA device in a few dozen places.
:func:`megatron_mtraining.patches.apply_cpu_patches` installs :data:`PATCHES` and
:class:`CudaToCpu` so the plugin's CPU tests, the checkpoint conversion and a CPU run of the
training entry point use the same Megatron code as a GPU run, with gloo for communication;
with ``training=True`` also :data:`TRAINING_PATCHES` and :func:`disable_compilation`, what
``megatron.training.pretrain`` needs. Each patch below says why it exists; the measurements
behind them are in the project's research notes on megatron-core 0.19.2.

The Megatron functions are guarded by their fingerprints, the torch ones by torch's release
(``_guard.TORCH_VERSIONS``): applying checks every patch before anything changes.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.overrides import TorchFunctionMode

from ._guard import FunctionPatch


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


class CudaToCpu(TorchFunctionMode):
    """Rewrites ``device='cuda'`` to the CPU and drops ``pin_memory=True`` in every torch call
    (about 70 Megatron call sites create tensors so)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _stand_in(module: str, name: str, replacement) -> FunctionPatch:
    """A patch of torch whose replacement does not depend on the function it replaces."""
    return FunctionPatch(module, name, {}, (), build=lambda _choice: replacement)


def _seed_with_cpu_tracker(_choice):
    seed = SEED.original
    signature = inspect.signature(seed)

    @functools.wraps(seed)
    def cpu_seed(*args, **kwargs):
        # megatron.training passes the tracker flags positionally.
        bound = signature.bind(*args, **kwargs)
        bound.arguments["inference_rng_tracker"] = True
        return seed(*bound.args, **bound.kwargs)

    return cpu_seed


_RANDOM = "megatron.core.tensor_parallel.random"
# The default RNG tracker reads torch.cuda.get_rng_state(); the inference tracker's add/fork
# do nothing, so dropout and initialisation draw from the CPU generator.
SEED = FunctionPatch(
    module=_RANDOM,
    name="model_parallel_cuda_manual_seed",
    fingerprints={"model_parallel_cuda_manual_seed": "d3db2ff665789365"},
    import_sites=("megatron/core/tensor_parallel/__init__.py",),
    build=_seed_with_cpu_tracker,
)

# Activation recompute saves and restores the CUDA generator's state around the recomputed
# region; there is none (Megatron saves the CPU generator's state separately).
GET_CUDA_RNG_STATE = FunctionPatch(
    module=_RANDOM,
    name="_get_cuda_rng_state",
    fingerprints={"_get_cuda_rng_state": "aa26caaa069c5c4f"},
    import_sites=(),
    build=lambda _choice: lambda *a, **k: torch.get_rng_state(),
)
SET_CUDA_RNG_STATE = FunctionPatch(
    module=_RANDOM,
    name="_set_cuda_rng_state",
    fingerprints={"_set_cuda_rng_state": "b179c9d95438b61c"},
    import_sites=(),
    build=lambda _choice: lambda *a, **k: None,
)

PATCHES = (
    # Megatron puts new tensors on torch.cuda.current_device() (RoPE frequencies, buffers).
    _stand_in("torch.cuda", "current_device", lambda: "cpu"),
    SEED,
    GET_CUDA_RNG_STATE,
    SET_CUDA_RNG_STATE,
    # Megatron DDP and the optimizers order work on CUDA streams and events.
    *(
        _stand_in("torch.cuda", name, _NoStream)
        for name in ("Stream", "Event", "current_stream", "default_stream", "stream")
    ),
    _stand_in("torch.cuda", "synchronize", lambda *a, **k: None),
    # Hard-coded .cuda() calls (e.g. the CP RoPE slice) and DataLoader pin-memory threads,
    # which the thread-local function mode (CudaToCpu) does not reach.
    _stand_in("torch", "Tensor.cuda", lambda self, *a, **k: self),
    _stand_in("torch", "Tensor.pin_memory", lambda self, *a, **k: self),
    _stand_in("torch", "Tensor.record_stream", lambda self, *a, **k: None),
)


def _initialize_without_cuda(_choice):
    init = INITIALIZE.original

    @functools.wraps(init)
    def initialize_megatron(*args, **kwargs):
        count, select = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda *a, **k: None)
        try:
            return init(*args, **{**kwargs, "allow_no_cuda": True})
        finally:
            torch.cuda.device_count, torch.cuda.set_device = count, select

    return initialize_megatron


# pretrain() calls initialize_megatron() without allow_no_cuda, which asserts CUDA; and with
# torch.cuda.device_count() == 0 it creates no model-parallel groups and never seeds the
# model-parallel RNG tracker. During it one (CPU) device is reported, and selecting it does
# nothing (gloo takes no device).
INITIALIZE = FunctionPatch(
    module="megatron.training.initialize",
    name="initialize_megatron",
    fingerprints={"initialize_megatron": "d9b467adcaed1325"},
    import_sites=("megatron/training/__init__.py", "megatron/training/training.py"),
    build=_initialize_without_cuda,
)


def _warmup_keeping_rng(_choice):
    warmup = WARMUP.original

    @functools.wraps(warmup)
    def warmup_keeping_rng(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warmup(*args, **kwargs)

    return warmup_keeping_rng


# pretrain() warms the fused kernels up (initialize._warmup_jit_function) on torch.rand
# tensors of seq_length / CP tokens. With device="cuda" rewritten to the CPU they draw from
# the CPU generator, which initialisation draws from next (the CPU tracker's fork does
# nothing): the initial weights would depend on the CP size. Keep the generator's state.
WARMUP = FunctionPatch(
    module="megatron.training.initialize",
    name="_warmup_jit_function",
    fingerprints={"_warmup_jit_function": "e7c1707d8b9bfdd9"},
    import_sites=(),
    build=_warmup_keeping_rng,
)


def _clip_grads_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """``clip_grad_by_total_norm_fp32`` without its CUDA assertion: the same in-place scaling
    by ``min(1, max_norm / (total_norm + 1e-6))``."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    coeff = torch.as_tensor(max_norm / (total_norm + 1.0e-6)).clamp_max(1.0)
    if grads:
        torch._foreach_mul_(grads, coeff)


TRAINING_PATCHES = (
    INITIALIZE,
    # validate_args reads the CUDA device's compute capability when TP or CP > 1.
    FunctionPatch(
        module="megatron.training.utils.common_utils",
        name="get_device_arch_version",
        fingerprints={"get_device_arch_version": "b7e375abfdb1f4f5"},
        import_sites=("megatron/training/arguments.py", "megatron/training/utils/__init__.py"),
        build=lambda _choice: lambda: 0,
    ),
    WARMUP,
    # Gradient clipping asserts CUDA gradients (optimizer/clip_grads.py: param.grad.type()).
    FunctionPatch(
        module="megatron.core.optimizer.clip_grads",
        name="clip_grad_by_total_norm_fp32",
        fingerprints={"clip_grad_by_total_norm_fp32": "cf07b488fb76a8ae"},
        import_sites=("megatron/core/models/mimo/optimizer.py", "megatron/core/optimizer/optimizer.py"),
        build=lambda _choice: _clip_grads_cpu,
    ),
    # Checkpoints save the CUDA generator's state (training/checkpointing.py, get_rng_state);
    # the CPU generator's stands in (restoring it is a lazily queued no-op without CUDA).
    _stand_in("torch.cuda", "get_rng_state", lambda *a, **k: torch.get_rng_state()),
)


def disable_compilation() -> None:
    """Megatron's jit_fuser is torch.compile: on a CPU each fused function costs seconds of C++
    compilation at start-up, more than small CPU runs ever get back."""
    torch._dynamo.config.disable = True

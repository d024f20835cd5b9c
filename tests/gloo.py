"""Runs a test function on several gloo processes on this machine."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init_file, fn, args, backend):
    # Several processes share two cores: one thread each avoids oversubscription.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run(world: int, fn, *args) -> None:
    """Runs ``fn(rank, world, *args)`` on ``world`` gloo processes; a failure on any rank fails
    the caller with that rank's traceback."""
    _spawn(world, fn, args, "gloo")


def _spawn(world: int, fn, args, backend: str) -> None:
    # Forked workers skip the interpreter start and the imports (torch, Megatron, the test
    # module) that spawned ones repeat: most of a small case's time on two cores. CUDA does
    # not survive a fork, so NCCL workers, or those of a process that has started CUDA, spawn.
    method = "spawn" if backend == "nccl" or torch.cuda.is_initialized() else "fork"
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.start_processes(_entry, args=(world, init, fn, args, backend), nprocs=world, join=True, start_method=method)


def run_on_device(world: int, fn, *args) -> None:
    """``run`` for workers that put their tensors on the GPU when there is one: NCCL with a
    GPU per rank there (gloo cannot send CUDA tensors), gloo on CPU; skips a machine with
    CUDA but fewer GPUs than ``world``."""
    if not torch.cuda.is_available():
        return run(world, fn, *args)
    import pytest

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, one per rank (NCCL)")
    _spawn(world, fn, args, "nccl")

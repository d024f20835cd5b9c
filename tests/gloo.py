"""Runs a test function on several gloo processes on this machine."""

import multiprocessing
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton_interpreter


def _entry(rank, world, init_file, fn, args, backend, environ):
    # A forkserver's worker inherits the server's environment, not the caller's (a test may
    # have set a variable since the server started).
    os.environ.clear()
    os.environ.update(environ)
    triton_interpreter.install()
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
    _start_workers(world, fn, args, "gloo")


# A spawned worker starts an interpreter and imports torch and Megatron: most of a small
# case's time on two cores. A forkserver pays that once per test process and forks each
# worker from a process that has only imported, never run threads (a fork of the pytest
# process itself crashed in Megatron's init, 01653b9). CUDA does not survive a fork: NCCL
# workers spawn.
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed", "megatron.core", "megatron_mtraining", "megatron_workers"]
)


def _start_workers(world: int, fn, args, backend: str) -> None:
    method = "spawn" if backend == "nccl" else "forkserver"
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.start_processes(
            _entry,
            args=(world, init, fn, args, backend, dict(os.environ)),
            nprocs=world,
            join=True,
            start_method=method,
        )


def run_on_device(world: int, fn, *args) -> None:
    """``run`` for workers that put their tensors on the GPU when there is one: NCCL with a
    GPU per rank there (gloo cannot send CUDA tensors), gloo on CPU; skips a machine with
    CUDA but fewer GPUs than ``world``."""
    if not torch.cuda.is_available():
        return run(world, fn, *args)
    import pytest

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, one per rank (NCCL)")
    _start_workers(world, fn, args, "nccl")

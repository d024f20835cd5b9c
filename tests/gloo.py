"""Runs a test function on several gloo processes on this machine."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init_file, fn, args):
    # Several processes share two cores: one thread each avoids oversubscription.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run(world: int, fn, *args) -> None:
    """Runs ``fn(rank, world, *args)`` on ``world`` gloo processes; a failure on any rank fails
    the caller with that rank's traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "init"), fn, args), nprocs=world, join=True)

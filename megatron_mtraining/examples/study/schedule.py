"""The whole study in one command (``study all``): its stage commands, the continued runs
side by side on the machine's GPUs.

The continued runs only read the pretrained model, so they are independent; each gets one
GPU (``CUDA_VISIBLE_DEVICES``) and its own share of the CPU threads. A device may be listed
more than once (``study all --runs-per-gpu``): each listing is a slot that holds one run, so
several small runs can share a GPU that one alone leaves mostly idle. Runs of one seed read
the same samples, and the first of them builds Megatron's dataset index cache for that
seed, which the others read: a run of a seed starts beside another of that seed only once
the cache exists, when the first has logged a training iteration (or finished). A failed run
does not stop the others; the command fails at the end, naming it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..quickstart import StageError

# A stage's progress line: Megatron builds every split's dataset index before the first
# iteration, so once a run of a seed has logged one, that seed's cache is complete.
TRAINING = re.compile(r"^\s*iteration\s+\d+/\d+", re.MULTILINE)


@dataclass(frozen=True)
class Job:
    """One stage command of the study."""

    name: str
    args: tuple[str, ...]  # after ``python -m megatron_mtraining.examples.study``
    seed: int | None = None  # runs of one seed share its dataset cache


def launch(job: Job, device: str | None, threads: int, log: Path) -> subprocess.Popen:
    """Starts ``job`` on ``device`` (a CUDA device number; None: whatever the process sees),
    its output to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    command = [sys.executable, "-m", "megatron_mtraining.examples.study", *job.args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        out.write(f"# command: {shlex.join(command)}\n# device: {device}\n")
        out.flush()
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def run_jobs(
    jobs: Sequence[Job],
    devices: Sequence[str | None],
    logs: Path,
    start: Callable[[Job, str | None, int, Path], subprocess.Popen] = launch,
    poll_seconds: float = 2.0,
) -> list[str]:
    """Runs ``jobs`` in order, at most one per slot of ``devices`` at a time (a device listed
    twice takes two) and no two of one seed together until that seed's dataset cache exists
    (see the module; a job whose seed is building it waits, a later job of another seed may
    pass it); returns the names of those that failed. Each job's output goes to
    ``logs/<name>.log``."""
    threads = max(1, (os.cpu_count() or 1) // len(devices))
    waiting, running, failed = list(jobs), {}, []  # running: slot -> (job, process, start)
    cached = set()  # seeds whose dataset cache a run has finished building
    while waiting or running:
        for slot, (job, proc, began) in list(running.items()):
            if proc.poll() is None:
                if job.seed is not None and job.seed not in cached and _training(logs / f"{job.name}.log"):
                    cached.add(job.seed)
                continue
            del running[slot]
            if proc.returncode == 0 and job.seed is not None:
                cached.add(job.seed)
            minutes = (time.monotonic() - began) / 60
            outcome = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
            print(f"[study] {job.name}: {outcome} in {minutes:.1f} minutes (log: {logs / (job.name + '.log')})")
            if proc.returncode != 0:
                failed.append(job.name)
        busy = {job.seed for job, _, _ in running.values() if job.seed is not None and job.seed not in cached}
        for slot in [i for i in range(len(devices)) if i not in running]:
            job = next((j for j in waiting if j.seed is None or j.seed not in busy), None)
            if job is None:
                break
            waiting.remove(job)
            device = devices[slot]
            where = "this process's devices" if device is None else f"GPU {device}"
            print(f"[study] {job.name}: started on {where}")
            running[slot] = (job, start(job, device, threads, logs / f"{job.name}.log"), time.monotonic())
            if job.seed is not None and job.seed not in cached:
                busy.add(job.seed)
        if running:
            time.sleep(poll_seconds)
    return failed


def _training(log: Path) -> bool:
    try:
        return TRAINING.search(log.read_text(errors="replace")) is not None
    except FileNotFoundError:
        return False


def visible_devices(requested: Sequence[str] | None) -> list[str | None]:
    """The devices to spread the runs over: ``requested`` (CUDA device numbers), else every
    GPU torch sees, else one slot that leaves the device choice to the process (a CPU)."""
    if requested:
        return list(requested)
    import torch

    count = torch.cuda.device_count()
    return [str(i) for i in range(count)] if count else [None]


def check_finished(failed: list[str]) -> None:
    if failed:
        raise StageError(f"runs failed: {', '.join(failed)} (their logs are named above)")

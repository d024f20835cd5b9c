"""Fault injection: a worker of a 2-process CP run is killed and the launcher's run recovers.

``launch/pretrain.sh`` (ALLOW_CPU=1: two gloo processes, CP 2, striped layout) runs
``configs/tiny_cpu.yaml`` for 6 steps, saving every 2. Once step 3 is logged, rank 1 gets
SIGKILL. torchrun must tear down the surviving rank (blocked in a collective with the dead
one, and deaf to SIGTERM: Megatron's exit signal handler takes it, so torchrun kills it after
its fixed 30 s) and fail; the launcher starts torchrun again, whose workers resume from the
last complete checkpoint (``megatron.load`` set to ``megatron.save`` by the launcher) and finish. The steps after the resume must equal an
uninterrupted run's at full precision, and Megatron's consumed-sample count must continue
without a sample repeated or skipped.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_mtraining.training.metrics_line import parse_metrics

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launch" / "pretrain.sh"
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
# The whole faulty run (two start-ups of two processes on 2 cores, about 60 s) must end well
# within this: a surviving rank left hanging would reach it.
TIMEOUT_S = 240
# After a worker's failure torchrun (2.13) gives the others a fixed 30 s after SIGTERM, which
# Megatron's exit signal handler absorbs, before SIGKILL (SHUTDOWN_TIMEOUT applies only when
# torchrun itself gets a signal).
SURVIVOR_LIMIT_S = 45
SHUTDOWN_TIMEOUT_S = 10
OVERRIDES = ("megatron.context_parallel_size=2", "attention.layout=striped", "megatron.save_interval=2")
# Megatron's own line: "iteration        3/       6 | consumed samples:            6 | ..."
CONSUMED = re.compile(r"iteration +(\d+)/ *\d+ \| consumed samples: +(\d+)")
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp: Path, name: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NODE_", "NNODES"))}
    env.update(
        ALLOW_CPU="1",
        CUDA_VISIBLE_DEVICES="",
        NPROC="2",
        MASTER_PORT=str(_free_port()),
        LOG_ROOT=str(tmp / "runs"),
        RUN_NAME=name,
        OMP_NUM_THREADS="1",
        SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT_S),
    )
    return subprocess.Popen(
        ["bash", str(LAUNCHER), str(CONFIG), *OVERRIDES, f"megatron.save={tmp / name / 'ckpt'}"],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so that a failed test can end the whole tree
    )


class _Reader(threading.Thread):
    """Collects a process's output with the time each line arrived."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.proc, self.lines = proc, []

    def run(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str, after: float = 0.0):
        """(time, line) of the first line after ``after`` that contains ``pattern``, or None."""
        return next(((t, line) for t, line in list(self.lines) if t >= after and pattern in line), None)


def _finish(proc: subprocess.Popen, reader: _Reader, deadline: float) -> str:
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own: end them one by one.
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(10)
        pytest.fail(f"the run did not end within {TIMEOUT_S} s (a hanging rank?):\n{reader.output()[-6000:]}")
    reader.join(10)
    return reader.output()


def _workers(launcher_pid: int) -> dict[int, psutil.Process]:
    """The training processes, by global rank: the children of the launcher's torchrun."""
    (torchrun,) = [p for p in psutil.Process(launcher_pid).children() if "torch.distributed.run" in p.cmdline()]
    return {int(p.environ()["RANK"]): p for p in torchrun.children()}


def _losses(output: str) -> dict[int, str]:
    """The full-precision loss text of each logged step (the last one where a step repeats)."""
    return {it: m["lm_loss"] for it, m in parse_metrics(output).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = _launch(tmp, "reference")
    reader = _Reader(proc)
    reader.start()
    output = _finish(proc, reader, time.monotonic() + TIMEOUT_S)
    assert proc.returncode == 0, output[-6000:]
    return output


def test_killed_rank_restarts_and_resumes_exactly(uninterrupted, tmp_path):
    start = time.monotonic()
    deadline = start + TIMEOUT_S
    proc = _launch(tmp_path, "faulty")
    reader = _Reader(proc)
    reader.start()
    while reader.first("[mtraining] iteration        3") is None:
        assert proc.poll() is None, f"the run ended before step 3:\n{reader.output()[-6000:]}"
        assert time.monotonic() < deadline, f"no step 3 within {TIMEOUT_S} s:\n{reader.output()[-6000:]}"
        time.sleep(0.02)
    workers = _workers(proc.pid)
    assert sorted(workers) == [0, 1]
    survivor = workers[0]
    # The killed rank's helpers (Megatron's checkpoint writer) outlive it; ended at the end.
    orphans = workers[1].children(recursive=True)
    killed_at = time.monotonic()
    workers[1].send_signal(signal.SIGKILL)
    try:
        _check_recovery(proc, reader, survivor, killed_at, start, deadline, uninterrupted)
    finally:
        for orphan in orphans:
            with contextlib.suppress(psutil.NoSuchProcess):
                orphan.kill()


def _check_recovery(proc, reader, survivor, killed_at, start, deadline, uninterrupted):
    with contextlib.suppress(psutil.TimeoutExpired):
        survivor.wait(timeout=max(1.0, deadline - time.monotonic()))
    survivor_gone_s = time.monotonic() - killed_at
    output = _finish(proc, reader, deadline)
    total_s = time.monotonic() - start
    assert proc.returncode == 0, output[-6000:]

    loaded = reader.first("successfully loaded checkpoint", after=killed_at)
    assert loaded is not None, output[-6000:]
    resumed = int(LOADED.search(loaded[1]).group(1))
    print(
        f"rank 1 killed after step 3; rank 0 gone {survivor_gone_s:.1f} s later; checkpoint of step {resumed} "
        f"loaded {loaded[0] - killed_at:.1f} s after the kill; whole run {total_s:.1f} s"
    )
    # Step 2 is saved before step 3 is logged; step 4's save may have completed before the kill.
    assert resumed in (2, 4), resumed
    assert survivor_gone_s < SURVIVOR_LIMIT_S, f"the surviving rank took {survivor_gone_s:.1f} s to end"
    assert "restart policy: up to 3 restarts" in output
    assert "restart 1 of 3 (MAX_RESTARTS)" in output and "restart 2 of" not in output, output[-6000:]
    assert "set by the launcher to megatron.save" in output

    after_kill = "".join(line for t, line in reader.lines if t >= loaded[0])
    want, got = _losses(uninterrupted), _losses(after_kill)
    assert sorted(got) == list(range(resumed + 1, 7)), got
    assert got == {i: want[i] for i in got}, (got, want)
    # Megatron counts consumed samples from the checkpoint's: global batch 2 per step, so
    # step N has consumed 2 N samples exactly when none was repeated or skipped.
    consumed = {int(i): int(n) for i, n in CONSUMED.findall(after_kill)}
    assert consumed == {i: 2 * i for i in range(resumed + 1, 7)}, consumed
    assert {int(i): int(n) for i, n in CONSUMED.findall(uninterrupted)} == {i: 2 * i for i in range(1, 7)}

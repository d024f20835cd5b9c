"""The host sampler of the step report (``training/host_sampler.py``): sampled frames name
what the step's thread ran, or the thread it waits on in backward; syncs are counted by the
frame that caused them."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

from megatron_mtraining.training.host_sampler import AUTOGRAD, SYNC_WARNING, HostSampler, frame_name

HERE = "tests/test_host_sampler.py"


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _nap(seconds: float) -> None:
    time.sleep(seconds)


def _engine_run_backward(done: threading.Lock) -> None:
    """Named as torch's: the step's thread waiting in C for the autograd engine's thread."""
    done.acquire()


def _name(function) -> str:
    code = function.__code__
    return f"{HERE}({code.co_firstlineno}): {code.co_name}"


def _at(sampler: HostSampler, t: int) -> str | None:
    return next((name for lo, hi, name in sampler.intervals() if lo <= t < hi), None)


def test_samples_name_the_steps_frame_and_its_time():
    """A Python loop and a sleep of the step's thread: the middle of each is named by its
    function, and each function's sampled time is most of its own."""
    sampler = HostSampler(path=HERE)
    sampler.start()
    marks = [time.time_ns()]
    for phase in (_spin, _nap, _spin):
        phase(0.15)
        marks.append(time.time_ns())
    sampler.stop()
    for (lo, hi), phase in zip(zip(marks, marks[1:], strict=False), (_spin, _nap, _spin), strict=True):
        assert _at(sampler, (lo + hi) // 2) == _name(phase)
    host = sampler.summary()["host_ms_by_frame"]
    spun, napped = (marks[1] - marks[0] + marks[3] - marks[2]) / 1e6, (marks[2] - marks[1]) / 1e6
    assert 0.6 * spun < host[_name(_spin)] < 1.1 * spun, host
    assert 0.6 * napped < host[_name(_nap)] < 1.1 * napped, host
    assert all(lo < hi for lo, hi, _ in sampler.intervals())


# A thread of code outside the package (built-in backward functions), which then calls into it.
ENGINE = """
def engine(spin, marks, done):
    marks.append(time.time_ns())
    time.sleep(0.1)
    marks.append(time.time_ns())
    spin(0.1)
    marks.append(time.time_ns())
    done.release()
"""


def test_a_step_waiting_in_backward_is_named_by_the_thread_it_waits_on():
    """While the step's thread waits (``_engine_run_backward``), samples name another thread's
    package frame, and ``AUTOGRAD`` while no thread runs the package's code."""
    namespace = {"time": time}
    exec(compile(ENGINE, "elsewhere.py", "exec"), namespace)
    sampler = HostSampler(path=HERE)
    done, marks = threading.Lock(), []
    done.acquire()
    worker = threading.Thread(target=namespace["engine"], args=(_spin, marks, done))
    sampler.start()
    worker.start()
    _engine_run_backward(done)
    worker.join()
    sampler.stop()
    assert _at(sampler, (marks[0] + marks[1]) // 2) == AUTOGRAD
    assert _at(sampler, (marks[1] + marks[2]) // 2) == _name(_spin)


def _reads_device() -> None:
    warnings.warn(SYNC_WARNING + " (as torch's sync debug mode warns)", UserWarning, stacklevel=1)


def test_syncs_are_counted_by_the_frame_that_caused_them():
    sampler = HostSampler(path=HERE)
    sampler.start()
    for _ in range(3):
        _reads_device()
    warnings.warn("another warning", UserWarning, stacklevel=1)
    sampler.stop()
    assert sampler.summary()["syncs_by_frame"] == {_name(_reads_device): 3}
    assert frame_name(None) is None


@pytest.mark.gpu
def test_a_host_read_of_a_device_tensor_is_a_sync():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.ones(4, device="cuda")
    sampler = HostSampler(path=HERE)
    sampler.start()
    _item(x)
    (x + 1).sum()  # no sync
    sampler.stop()
    assert torch.cuda.get_sync_debug_mode() == 0
    assert sampler.summary()["syncs_by_frame"] == {_name(_item): 1}


def _item(x: torch.Tensor) -> float:
    return x.sum().item()

"""Where the host is during a profiled step: sampled Python frames and the device syncs.

A step whose device waits on the host is found by the step report's idle gaps; which Python
code the host ran meanwhile is what fixes it. The profiler's own Python stacks cannot say:
torch 2.11 (the GPU image's) lists no Python functions in its events, and recording them
slows every operator. So a thread samples the interpreter's stacks instead, every
``interval_s``, and names each sample by the innermost frame of this package, of the thread
that runs the step's Python work: the step's thread, or while it waits in
``backward`` the autograd engine's thread that runs custom functions' backwards. The samples
become consecutive intervals, ``[t_i, t_(i+1))`` named by sample ``i``, which
``step_report.idle_gaps`` reads in the profiler's clock: ``start`` marks its own start with a
profiler range (``CLOCK_MARK``), which ties the two clocks.

Device syncs are counted by the same frames: ``torch.cuda.set_sync_debug_mode("warn")`` makes
each synchronizing CUDA operation warn in the thread that called it, and a warnings hook takes
the caller's stack there.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import warnings

import torch

# The frames samples and syncs are named by: this package's.
FRAME_PATH = "megatron_mtraining/"
# What torch's sync debug mode warns with.
SYNC_WARNING = "called a synchronizing CUDA operation"
# The innermost frame of a thread that waits in C for the autograd engine's (torch's
# ``backward`` and ``autograd.grad`` both call it).
WAITING = frozenset({"_engine_run_backward"})
# The profiler range ``start`` runs at its start time.
CLOCK_MARK = "host_sampler_clock"
# A sample taken while the main thread waits in backward and no thread runs package code.
AUTOGRAD = "(autograd's built-in backward)"
# How many names the report keeps.
TOP = 16


def frame_name(frame, path: str = FRAME_PATH) -> str | None:
    """``"package/file.py(first line): function"`` of the innermost frame of ``frame``'s stack
    whose file lies under ``path``; None if none does."""
    while frame is not None:
        code = frame.f_code
        at = code.co_filename.rfind(path)
        if at >= 0:
            return f"{code.co_filename[at:]}({code.co_firstlineno}): {code.co_name}"
        frame = frame.f_back
    return None


def _own_name(frame) -> str:
    """``frame``'s own ``"file.py(first line): function"``, its path from the installed package."""
    code = frame.f_code
    path = code.co_filename.rsplit("site-packages/", 1)[-1]
    return f"{path}({code.co_firstlineno}): {code.co_name}"


def _busy_frame(frames: dict, main: int, skip: int, path: str) -> str:
    """What the step's Python work is doing, from every thread's current frame: the package
    frame of thread ``main``, or of another thread while ``main`` waits in backward
    (``WAITING``); ``AUTOGRAD`` when it waits and no thread runs package code (built-in
    backward functions); else ``main``'s own frame (Megatron's code, say)."""
    for ident in sorted(frames, key=lambda i: i != main):
        frame = frames[ident]
        if ident == skip or frame is None or frame.f_code.co_name in WAITING:
            continue
        name = frame_name(frame, path)
        if name is not None:
            return name
    top = frames[main]
    return AUTOGRAD if top.f_code.co_name in WAITING else _own_name(top)


class HostSampler:
    """Samples the host's package frames and counts device syncs between ``start`` and ``stop``,
    for the step that the thread calling ``start`` runs.

    ``intervals(offset_ns)``: (start ns, end ns, name) per sample, shifted by ``offset_ns``
    into another clock (the profiler's: ``CLOCK_MARK`` started at ``started_ns``);
    ``summary()``: samples and syncs by frame."""

    def __init__(self, interval_s: float = 5e-4, path: str = FRAME_PATH):
        self.interval_s = interval_s
        self.path = path
        self.samples: list[tuple[int, str]] = []
        self.syncs: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = None
        self._restore = None
        self.started_ns = None

    def start(self) -> None:
        with torch.profiler.record_function(CLOCK_MARK):
            self.started_ns = time.time_ns()
        self._restore = (sys.getswitchinterval(), warnings.showwarning)
        # The sampler gets the interpreter between the step's bytecodes only this often.
        sys.setswitchinterval(min(self._restore[0], self.interval_s))
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=SYNC_WARNING)
        warnings.showwarning = self._on_warning
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        self._main = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="mtraining-host-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        sys.setswitchinterval(self._restore[0])

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            frames = sys._current_frames()
            self.samples.append((time.time_ns(), _busy_frame(frames, self._main, me, self.path)))

    def _on_warning(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            self.syncs[frame_name(sys._getframe(1), self.path) or f"{filename}({lineno})"] += 1
        else:
            self._restore[1](message, category, filename, lineno, file, line)

    def intervals(self, offset_ns: int = 0) -> list[tuple[int, int, str]]:
        """Each sample as the interval up to the next sample, in the clock ``time.time_ns() + offset_ns``."""
        return [
            (t + offset_ns, t_next + offset_ns, name)
            for (t, name), (t_next, _) in zip(self.samples, self.samples[1:], strict=False)
        ]

    def summary(self) -> dict:
        """The sampled host time by frame, and the syncs by frame."""
        host = collections.Counter()
        for start, end, name in self.intervals():
            host[name] += (end - start) / 1e6
        return {
            "interval_ms": self.interval_s * 1e3,
            "samples": len(self.samples),
            "host_ms_by_frame": {name: round(ms, 3) for name, ms in host.most_common(TOP)},
            "syncs": sum(self.syncs.values()),
            "syncs_by_frame": dict(self.syncs.most_common(TOP)),
        }

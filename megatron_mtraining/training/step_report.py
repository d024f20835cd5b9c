"""The training step, measured: step times, peak memory and where one step's device time goes.

``python -m megatron_mtraining.pretrain --step-report PATH`` (what ``scripts/bench_training.py``
runs) writes a JSON report when the run ends:

* ``iteration_s``: each iteration's wall time, from the start of its first micro-batch to the
  start of the next iteration's (the device synchronised at both ends; the last iteration is
  not timed), less the evaluations run in between (``eval_interval``), and ``steady_s_per_iteration``, their median after the first two, the profiled
  one left out;
* ``evaluation_s``: the evaluations' wall times;
* peak allocated and reserved device memory;
* ``profile``: one step (``--profile-step``, default the second to last) under the PyTorch
  profiler, its device time summed by part and phase. Parts come from annotations: forward
  hooks on the model's modules name norms, projections (``matmuls``), the core attention, the
  embedding and the layer (``layer:N``); ranges inside the core attention name the index
  build and MSA's index branch and KL loss; the chunked loss names ``loss`` (output layer
  included). Whatever else a layer runs (RoPE, SwiGLU, residual adds) is ``elementwise``;
  the rest of the forward step (batch, RoPE tables, loss reduction) is ``other`` (less the
  kernels that name their part, filed by it: ``NAMED_KERNELS``); what runs
  outside forward and backward is ``optimizer`` (the optimizer step, gradient clipping,
  parameter copies); backward work that no forward operation made is ``grads`` (gradient
  accumulation into Megatron's buffers); NCCL kernels are ``communication``. The phase is ``forward``,
  ``recompute`` (forward work run again inside the backward, activation checkpointing) or
  ``backward``, found by linking each backward node to the forward operation that made it
  (the autograd sequence number). ``idle_ms``: the step's wall time less the union of its
  kernels' intervals, the time the device waited for the host; ``idle`` lists the longest
  such gaps with the kernels around them and what the host was doing (``idle_gaps``);
* ``compiles``: the Triton kernels the process compiled (or loaded from Triton's disk cache),
  by iteration, through Triton's JIT hooks (``CompileWatch``): how many and how long before
  the steady iterations and, kernel by kernel, those after them. A kernel specialized on a
  value that changes from step to step compiles again, seconds each, in steps the median
  then leaves out of sight.
``--step-trace PATH`` also writes the profiled step's trace, the operators, ranges and kernels
as the profiler linked them. ``--step-stacks`` samples the host's Python stacks through the
profiled step (``host_sampler``) and counts its device syncs: each gap then also names the
innermost of this package's frames the host was in (``idle_gaps``), as the runtime call a gap
ends at is often only where the host got to after Python work in some caller, and ``host``
sums the sampled host time and the syncs by frame. Sampling slows the profiled step's host a
little, so its gaps grow; the steady iterations' times are not affected.

The annotations cost a few microseconds of host time per module call and are only installed
with ``--step-report``.
"""

from __future__ import annotations

import bisect
import collections
import json
import re
import statistics
import time
from pathlib import Path

import torch

from ..megatron.profiler_ranges import PREFIX, part_range
from .host_sampler import CLOCK_MARK, HostSampler

LAYER_TAG = "layer:"
BACKWARD = "autograd::engine::evaluate_function: "
# Submodule name in Megatron's GPT -> part of the step it belongs to.
MODULE_PARTS = {
    "input_layernorm": "norms",
    "pre_mlp_layernorm": "norms",
    "final_layernorm": "norms",
    "linear_qkv": "matmuls",
    "linear_proj": "matmuls",
    "linear_fc1": "matmuls",
    "linear_fc2": "matmuls",
    "core_attention": "attention",
    "embedding": "embedding",
}
PHASES = ("forward", "recompute", "backward")
TOP_KERNELS = 12
# Kernels filed by name when the profiler links them to a catch-all part (``other``, or a layer's
# ``elementwise``). The plugin's kernels launched outside any operator (a Triton launch, a
# CUDA-graph replay): the profiler links a kernel to the innermost operator on the stack, not to
# a range, so with full recomputation these link to Megatron's CheckpointFunction, which sits
# outside the layer's range. And the dense baselines' fused attention kernels, which run in the
# core attention only, yet one a step now and then links to an operator outside its range on an
# H200 (cuDNN's forward of one layer filed under ``other`` or ``elementwise``). The
# window-statistics passes (``_row_stats_kernel`` and the vertical-slash build's graph) are not
# filed: the same kernels build ``mtraining``'s index and take MSA's and MoBA's recall metric.
NAMED_KERNELS = (
    (re.compile(r"_block_select_kernel$"), "msa_index"),  # MSA's top-k selection, replayed from a CUDA graph
    (re.compile(r"_topk_blocks_kernel$"), "index"),  # MoBA's gate top-k
    (re.compile(r"^_loss_(row_stats|softmax_grad)_kernel$"), "loss"),  # the fused loss's, launched outside operators
    # cuDNN's SDPA and its backward's pre- and post-passes; FlashAttention-2's kernels.
    (re.compile(r"cudnn_generated_fort_native_sdpa|cudnn::fusion::(compute_dot_do_o|convert_dq)|\bflash_(fwd|bwd)_"),
     "attention"),
)  # fmt: skip
CATCH_ALL_PARTS = ("other", "elementwise")


def _named_part(kernel: str, part: str) -> str:
    """``part``, or the part ``NAMED_KERNELS`` files ``kernel`` under where ``part`` is a catch-all."""
    if part in CATCH_ALL_PARTS:
        for pattern, named in NAMED_KERNELS:
            if pattern.search(kernel):
                return named
    return part


# Idle stretches the report lists, the shortest it counts, and the host events it names per gap.
IDLE_GAPS = 10
MIN_GAP_MS = 0.05
HOST_NAMES = 6
# Host events a gap is explained by: runtime calls (syncs, copies), host reads, the step's
# ranges and the backward's nodes.
GAP_HOST_EVENTS = ("cuda", PREFIX, BACKWARD, "aten::item", "aten::_local_scalar_dense", "aten::nonzero")
# Iterations left out of the steady state: compilation, autotuning, allocator growth.
WARMUP_ITERATIONS = 2


def _annotate(module: torch.nn.Module, name: str) -> None:
    ranges = []

    def enter(*_):
        ranges.append(part_range(name))
        ranges[-1].__enter__()

    def leave(*_):
        ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def annotate_model(model: torch.nn.Module) -> None:
    """Names the parts of Megatron's GPT in profiles (see the module docstring)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer):
            _annotate(module, f"{LAYER_TAG}{module.layer_number}")
        elif name.rsplit(".", 1)[-1] in MODULE_PARTS:
            _annotate(module, MODULE_PARTS[name.rsplit(".", 1)[-1]])


def _op_key(name: str) -> str:
    """An operation's name as its forward event and its backward node share it:
    ``aten::_scaled_dot_product_cudnn_attention`` and
    ``ScaledDotProductCudnnAttentionBackward0`` both give ``scaleddotproductcudnnattention``."""
    name = name.removeprefix(BACKWARD).removeprefix("aten::")
    name = re.sub(r"Backward\d*$", "", name)
    return name.replace("_", "").lower()


class _Classifier:
    """(part, layer, phase) of the profiler's host events (``FunctionEvent``s)."""

    def __init__(self, events):
        # (thread, sequence number) -> [(operation key, part, layer)]: several forward events
        # can carry one number (nested operations, and operations that made no node).
        self.forward = collections.defaultdict(list)
        for event in events:
            if event.sequence_nr >= 0 and not event.name.startswith(BACKWARD):
                part, layer, phase = self._walk(event)
                if phase != "backward":
                    self.forward[(event.thread, event.sequence_nr)].append((_op_key(event.name), part, layer))

    def _walk(self, event):
        part = layer = None
        node = event
        while node is not None:
            name = node.name
            if name.startswith(PREFIX):
                tag = name[len(PREFIX) :]
                if tag.startswith(LAYER_TAG):
                    # What a layer runs outside its named modules: RoPE, activation, residuals.
                    layer = layer or int(tag[len(LAYER_TAG) :])
                    part = part or "elementwise"
                elif part is None:
                    part = tag
            elif name.startswith(BACKWARD):
                # Inside a backward: an annotated operation below it is forward work run again
                # (recomputation); otherwise this is a backward node.
                return part, layer, "recompute" if part or layer else "backward"
            node = node.cpu_parent
        return part, layer, "forward"

    def __call__(self, event):
        part, layer, phase = self._walk(event)
        if phase == "backward":
            node = event
            while not node.name.startswith(BACKWARD):
                node = node.cpu_parent
            made = self.forward.get((node.fwd_thread, node.sequence_nr), [])
            key = _op_key(node.name)
            _, part, layer = next((m for m in made if m[0] == key), made[0] if made else (None, None, None))
        if part is None:
            # Outside the forward step's range and outside the backward: the optimizer step;
            # backward nodes no forward operation made: gradient accumulation and its hooks.
            part = "optimizer" if phase == "forward" else "grads"
        return part, layer, phase


def _launched_here(prof, events):
    """A test of whether a host event launched the kernels the profiler lists under it.

    The profiler hands a kernel to every host operation whose id is the kernel's link, and
    operations of the autograd thread (a recomputation) can share an id with one of the main
    thread: the kernel would count twice. Of several operations with one id, the launcher is
    the one whose time holds the launch calls (the runtime events linked to that id)."""
    by_id = collections.Counter(e.id for e in events if e.kernels)
    start = prof.profiler.kineto_results.trace_start_ns()
    launches = collections.defaultdict(list)
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CPU and e.linked_correlation_id() > 0:
            launches[e.linked_correlation_id()].append((e.start_ns() - start) / 1e3)

    def launched(event) -> bool:
        if by_id[event.id] < 2:
            return True
        span = event.time_range
        return any(span.start <= t <= span.end for t in launches.get(event.id, ()))

    return launched


def _busy_ms(device_events) -> float:
    """Milliseconds during which at least one of the device's kernels, copies or fills ran."""
    spans = sorted((e.start_ns(), e.end_ns()) for e in device_events)
    busy, end = 0, None
    for start, stop in spans:
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e6


def idle_gaps(device: list[tuple[int, int, str]], host: list[tuple[int, int, str]], top: int, frames=()) -> dict:
    """The longest stretches in which no device event ran, and what the host did meanwhile.

    ``device`` and ``host``: (start ns, end ns, name). A gap names the device events on either
    side and the host events that overlap it, outermost first: a runtime call such as
    ``cudaStreamSynchronize`` there is a host read; the step's own ranges alone mean the host
    was still launching (Python-bound). ``gaps_ms``: the sum over every gap of at least
    ``MIN_GAP_MS``, so many short gaps show even when no single one stands out; ``events``:
    how many device events ran (kernels, copies, fills), a launch-bound step's other sign.
    With ``frames`` (disjoint (start ns, end ns, "file(line): function") intervals of what the
    host ran, ``HostSampler.intervals``), each gap also names ``frame``, the one at its middle,
    and ``by_frame_ms`` sums every gap by that frame."""
    spans = sorted(device)
    gaps = []
    end, last = None, None
    for start, stop, name in spans:
        if end is not None and start - end >= MIN_GAP_MS * 1e6:
            gaps.append((start - end, end, start, last, name))
        if end is None or stop > end:
            end, last = stop, name
    longest = sorted(gaps, key=lambda g: -g[0])[:top]
    origin = spans[0][0] if spans else 0

    def during(lo: int, hi: int) -> list[str]:
        over = sorted((s, -e, n) for s, e, n in host if s < hi and e > lo)
        return list(dict.fromkeys(n[:80] for _, _, n in over))[:HOST_NAMES]

    report = {
        "events": len(spans),
        "gaps_ms": round(sum(g[0] for g in gaps) / 1e6, 3),
        "gaps": len(gaps),
        "longest": [
            {
                "ms": round(length / 1e6, 3),
                "at_ms": round((lo - origin) / 1e6, 3),
                "after": after[:80],
                "before": before[:80],
                "host": during(lo, hi),
            }
            for length, lo, hi, after, before in longest
        ],
    }
    if frames:
        at = _frame_at(frames)
        frame_at = {lo: at((lo + hi) // 2) for _, lo, hi, *_ in gaps}  # a gap by its start
        by_frame = collections.Counter()
        for length, lo, *_ in gaps:
            by_frame[frame_at[lo]] += length
        for gap, (_, lo, *_) in zip(report["longest"], longest, strict=True):
            gap["frame"] = frame_at[lo]
        report["by_frame_ms"] = {name: round(ns / 1e6, 3) for name, ns in by_frame.most_common(HOST_NAMES * 2)}
    return report


def _frame_at(frames):
    """``at(t)``: the name of the one of the disjoint intervals ``frames`` that holds ``t``; None
    where none does."""
    frames = sorted(frames)
    starts = [f[0] for f in frames]

    def at(t: int) -> str | None:
        i = bisect.bisect_right(starts, t) - 1
        return frames[i][2] if i >= 0 and frames[i][1] > t else None

    return at


def breakdown(prof, wall_s: float, on_device: bool, frames=()) -> dict:
    """The device time of a profiled step by part and phase, per layer, and idle.

    ``on_device``: kernel time; else (a CPU run) the host self time of ATen operations.
    ``frames``: what the host ran, for ``idle_gaps``."""
    events = prof.events()
    classify = _Classifier(events)
    launched = _launched_here(prof, events) if on_device else None
    parts = collections.defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    layers = collections.defaultdict(float)
    kernels_by_part = collections.defaultdict(lambda: collections.defaultdict(float))
    for event in events:
        if on_device:
            kernels = [(k.name, k.duration) for k in event.kernels] if launched(event) else []
        elif event.name.startswith("aten::") and not event.cpu_children:
            kernels = [(event.name, event.self_cpu_time_total)]
        else:
            continue
        if not kernels:
            continue
        part, layer, phase = classify(event)
        for name, us in kernels:
            key = "communication" if "nccl" in name.lower() else _named_part(name, part)
            parts[key][phase] += us / 1e3
            kernels_by_part[key][f"{phase}: {name[:120]}"] += us / 1e3
            if layer:
                layers[layer] += us / 1e3
    total = sum(sum(p.values()) for p in parts.values())
    report = {
        "wall_ms": wall_s * 1e3,
        "parts_ms": {name: {k: round(v, 3) for k, v in p.items()} for name, p in sorted(parts.items())},
        "layers_ms": {str(n): round(v, 3) for n, v in sorted(layers.items())},
        "summed_ms": total,
        # Each part's costliest kernels (phase: name -> ms), to see what a part is made of.
        "top_kernels_ms": {
            part: dict(sorted(((k, round(v, 3)) for k, v in named.items()), key=lambda kv: -kv[1])[:TOP_KERNELS])
            for part, named in sorted(kernels_by_part.items())
        },
    }
    if on_device:
        device, host = device_and_host_events(prof)
        busy = _busy_ms(device)
        # Each device event once: ``summed_ms`` above it means the attribution counted a
        # kernel under two host events.
        kernels = sum(e.end_ns() - e.start_ns() for e in device) / 1e6
        report.update(busy_ms=busy, idle_ms=max(0.0, wall_s * 1e3 - busy), kernels_ms=kernels)
        device = [(e.start_ns(), e.end_ns(), e.name()) for e in device]
        report["idle"] = idle_gaps(device, host, IDLE_GAPS, frames)
    return report


def device_and_host_events(prof) -> tuple[list, list[tuple[int, int, str]]]:
    """A profile's device events (kernels, copies and fills: the device-side copies of
    annotated ranges span gaps) and the host events a gap is explained by
    (``GAP_HOST_EVENTS``) as (start ns, end ns, name), for ``idle_gaps``."""
    events = prof.profiler.kineto_results.events()
    cpu = torch.autograd.DeviceType.CPU
    device = [e for e in events if e.device_type() != cpu and not e.is_user_annotation()]
    host = [
        (e.start_ns(), e.end_ns(), e.name())
        for e in events
        if e.device_type() == cpu and e.name().startswith(GAP_HOST_EVENTS)
    ]
    return device, host


def clock_offset_ns(prof, mark: str, at_ns: int) -> int:
    """The profiler's clock less ``time.time_ns()``: range ``mark`` started at ``at_ns``."""
    events = prof.profiler.kineto_results.events()
    return next(e.start_ns() for e in events if e.name() == mark) - at_ns


class CompileWatch:
    """Every Triton JIT compile of the process while it is installed: (iteration, kernel,
    seconds), the iteration from ``iteration()``. Triton's hooks run before and after each
    compile of a kernel specialization new to the process (a load from the disk cache
    included); hooks installed before this one still run, and come back on ``close``."""

    def __init__(self, iteration):
        self.iteration = iteration
        self.events: list[tuple[int, str, float]] = []
        self._began = None
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            self._knobs = None
            return
        self._knobs = knobs.runtime
        self._previous = (self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook)
        self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._before, self._after

    def _before(self, *args, **kwargs):
        self._began = time.perf_counter()
        previous = self._previous[0]
        return previous(*args, **kwargs) if previous else False  # True would skip the compile

    def _after(self, *args, **kwargs):
        seconds = 0.0 if self._began is None else time.perf_counter() - self._began
        self.events.append((self.iteration(), getattr(kwargs.get("fn"), "name", "?"), seconds))
        previous = self._previous[1]
        return previous(*args, **kwargs) if previous else False

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._previous
            self._knobs = None

    def summary(self, steady_from: int) -> dict:
        """Counts and seconds before iteration ``steady_from`` and the compiles from it on."""
        early = [s for it, _, s in self.events if it < steady_from]
        late = [{"iteration": it, "kernel": k, "s": round(s, 3)} for it, k, s in self.events if it >= steady_from]
        return {"before_steady": len(early), "before_steady_s": round(sum(early), 2), "steady": late}


class StepReport:
    """Times every training iteration and profiles one; ``write`` saves the JSON report."""

    def __init__(
        self, path: str | Path, profile_step: int | None, trace: str | Path | None = None, stacks: bool = False
    ):
        self.path = Path(path)
        self.profile_step = profile_step
        self.trace = None if trace is None else Path(trace)
        self.stacks = stacks
        self.marks: list[tuple[int, float]] = []  # (iteration, time its first micro-batch began)
        # Compiles before the first iteration (model setup, Megatron's warm-up) count as -1.
        self.compiles = CompileWatch(lambda: self.marks[-1][0] if self.marks else -1)
        self.evaluations: list[tuple[int, float]] = []  # (mark it follows, seconds)
        self.evaluation_start = None
        self.profiler = None
        self.sampler = None
        self.profile = None
        self.metrics: dict[str, float] = {}

    def _sync(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin_iteration(self, iteration: int, train_iters: int) -> None:
        """Called as iteration ``iteration`` (0-based) starts its first micro-batch."""
        now = self._sync()
        if self.profiler is not None:
            self._stop_profile(now)
        self.marks.append((iteration, now))
        target = self.profile_step if self.profile_step is not None else train_iters - 2
        if iteration == target:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            if self.stacks:
                self.sampler = HostSampler()
                self.sampler.start()
            self.profile_start = self._sync()

    def begin_evaluation(self) -> None:
        """Called as an evaluation starts: its time is no iteration's, nor in the profile."""
        self.evaluation_start = self._sync()
        if self.profiler is not None:
            self._stop_profile(self.evaluation_start)

    def end_evaluation(self) -> None:
        """Called as the evaluation that :meth:`begin_evaluation` started ends."""
        self.evaluations.append((len(self.marks) - 1, self._sync() - self.evaluation_start))

    def _stop_profile(self, now: float) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        self.profiler.__exit__(None, None, None)
        if self.trace is not None:
            # The operators, ranges and kernels as the profiler linked them: what the parts are read from.
            self.trace.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.trace))
        frames = ()
        if self.sampler is not None:
            frames = self.sampler.intervals(clock_offset_ns(self.profiler, CLOCK_MARK, self.sampler.started_ns))
        self.profile = breakdown(self.profiler, now - self.profile_start, torch.cuda.is_available(), frames)
        if self.sampler is not None:
            self.profile["host"] = self.sampler.summary()
            self.sampler = None
        self.profile["iteration"] = self.marks[-1][0] + 1
        self.profiler = None

    def write(self, args) -> dict:
        now = self._sync()
        if self.profiler is not None:
            self._stop_profile(now)
        # The last iteration's end is not marked (Megatron's shutdown follows it): untimed.
        times = [b - a for (_, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]
        for mark, seconds in self.evaluations:
            if 0 <= mark < len(times):
                times[mark] -= seconds
        profiled = self.profile["iteration"] - 1 if self.profile else None
        steady = [
            t for (it, _), t in zip(self.marks, times, strict=False) if it >= WARMUP_ITERATIONS and it != profiled
        ]
        seconds = statistics.median(steady) if steady else None
        tokens = args.global_batch_size * args.seq_length
        report = {
            "iteration_s": [round(t, 4) for t in times],
            "steady_s_per_iteration": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "tokens_per_iteration": tokens,
            "evaluation_s": [round(t, 4) for _, t in self.evaluations],
            "metrics": self.metrics,
            "profile": self.profile,
            "compiles": self.compiles.summary(WARMUP_ITERATIONS),
        }
        self.compiles.close()
        if torch.cuda.is_available():
            report["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            report["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            report["device"] = torch.cuda.get_device_name()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(report, indent=1))
        return report

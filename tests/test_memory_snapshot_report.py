"""The snapshot report's replay on a hand-made allocator history with a known peak."""

import importlib.util
import pathlib
import random

spec = importlib.util.spec_from_file_location(
    "memory_snapshot_report", pathlib.Path(__file__).parents[1] / "scripts" / "memory_snapshot_report.py"
)
msr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(msr)


def frames(name):
    return [
        {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "f"},
        {"filename": f"/w/{name}.py", "line": 7, "name": name},
    ]


def test_replay_finds_the_peak_and_its_owners():
    rng = random.Random()
    # A pre-trace weight (never freed) and a pre-trace buffer freed inside the trace.
    weight, buf = 512 * rng.randint(1, 9), 512 * rng.randint(1, 9)
    acts = [512 * rng.randint(1, 9) for _ in range(3)]
    logits = 512 * rng.randint(10, 20)
    trace = [{"action": "free_completed", "addr": 2000, "size": buf, "frames": frames("buf")}]
    for i, a in enumerate(acts):
        trace.append({"action": "alloc", "addr": 3000 + i * 100_000, "size": a, "frames": frames("act")})
    trace.append({"action": "alloc", "addr": 9_000_000, "size": logits, "frames": frames("logits")})
    trace.append({"action": "free_requested", "addr": 9_000_000, "size": logits, "frames": frames("logits")})
    trace += [{"action": "free_completed", "addr": 9_000_000, "size": logits, "frames": frames("logits")}]
    trace += [{"action": "free_completed", "addr": 3000 + i * 100_000, "size": a} for i, a in enumerate(acts)]
    snapshot = {
        "segments": [{"device": 0, "address": 1000, "total_size": weight + 512,
                      "blocks": [{"size": weight, "state": "active_allocated", "frames": frames("weight")},
                                 {"size": 512, "state": "inactive"}]}],
        "device_traces": [trace],
    }  # fmt: skip
    events, start, peak_index, peak, end = msr.replay(snapshot, 0)
    assert peak == weight + sum(acts) + logits
    assert peak_index == 4  # after the logits' allocation (free_requested is skipped)
    assert sum(s for s, _ in start.values()) == weight + buf
    at_peak = dict((name, size) for name, size, _ in msr.grouped(msr.live_after(events, start, peak_index), 1))
    assert at_peak == {
        "/w/weight.py:7(weight)": weight,
        "/w/act.py:7(act)": sum(acts),
        "/w/logits.py:7(logits)": logits,
    }
    assert sum(s for s, _ in end.values()) == weight

"""Where a run's peak GPU memory goes, from a PyTorch memory snapshot.

Take the snapshot with Megatron's own switches on any run, e.g.
``python -m megatron_mtraining.pretrain --config C megatron.record_memory_history=true
megatron.memory_snapshot_path=/tmp/snap.pickle megatron.log_interval=1`` (Megatron dumps it
at every logged iteration), then ``python scripts/memory_snapshot_report.py /tmp/snap.pickle``.

The snapshot holds the allocator's segments at dump time and a trace of allocations and frees
(with Python stacks) since recording began. Replaying the trace from the state before its
first event gives the allocated bytes after every event; the report prints the peak, the live
blocks at the peak grouped by the code that allocated them, and the steady state at the end.
Allocated bytes are block sizes (rounded as ``torch.cuda.max_memory_allocated`` counts them).
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

GIB = 1024**3
# Frames from these paths say nothing about who wanted the memory; the first frame outside
# them is the allocation's owner.
_PLUMBING = ("torch/", "<frozen", "contextlib.py", "functools.py", "threading.py", "runpy.py")


def owner(frames: list[dict], depth: int) -> str:
    """``file:line(function)`` of the first ``depth`` frames outside the plumbing paths."""
    kept = [f for f in frames if not any(p in f["filename"] for p in _PLUMBING)]
    if not kept:
        kept = frames
    parts = []
    for f in kept[:depth]:
        path = f["filename"]
        for root in ("site-packages/", "megatron_mtraining/"):
            if root in path:
                path = path.split(root, 1)[1]
        parts.append(f"{path}:{f['line']}({f['name']})")
    return " <- ".join(parts) or "<no stack>"


def live_at_end(snapshot: dict, device: int) -> dict[int, tuple[int, list]]:
    """Blocks allocated when the snapshot was taken: address -> (size, allocation frames)."""
    live = {}
    for seg in snapshot["segments"]:
        if seg.get("device", 0) != device:
            continue
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] in ("active_allocated", "active_pending_free"):
                live[addr] = (block["size"], block.get("frames", []))
            addr += block["size"]
    return live


def replay(snapshot: dict, device: int):
    """``(events, start, peak_index, peak_bytes, end)``: the trace, the live blocks before it,
    the index of the event after which allocation peaked, and the live blocks at the end."""
    events = [e for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]
    end = live_at_end(snapshot, device)
    # Walk back from the end: undo each event to find what was live before the trace began.
    start = dict(end)
    for e in reversed(events):
        if e["action"] == "alloc":
            start.pop(e["addr"], None)
        else:
            start[e["addr"]] = (e["size"], e.get("frames", []))
    total = sum(size for size, _ in start.values())
    peak, peak_index = total, -1
    for i, e in enumerate(events):
        total += e["size"] if e["action"] == "alloc" else -e["size"]
        if total > peak:
            peak, peak_index = total, i
    return events, start, peak_index, peak, end


def live_after(events, start, index) -> dict[int, tuple[int, list]]:
    live = dict(start)
    for e in events[: index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        else:
            live.pop(e["addr"], None)
    return live


def grouped(live: dict, depth: int) -> list[tuple[str, int, int]]:
    """(owner, bytes, blocks), largest first."""
    groups = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        g = groups[owner(frames, depth)]
        g[0] += size
        g[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in groups.items()), key=lambda r: -r[1])


def report(live: dict, title: str, depth: int, top: int) -> str:
    rows = grouped(live, depth)
    total = sum(r[1] for r in rows)
    lines = [f"{title}: {total / GIB:.2f} GiB in {sum(r[2] for r in rows)} blocks"]
    for name, size, count in rows[:top]:
        lines.append(f"  {size / GIB:8.3f} GiB {count:6d} x  {name}")
    rest = rows[top:]
    if rest:
        lines.append(f"  {sum(r[1] for r in rest) / GIB:8.3f} GiB in {len(rest)} other owners")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--depth", type=int, default=2, help="frames outside torch named per owner")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    events, start, peak_index, peak, end = replay(snapshot, args.device)
    reserved = sum(s["total_size"] for s in snapshot["segments"] if s.get("device", 0) == args.device)
    print(f"trace: {len(events)} alloc/free events; reserved at dump {reserved / GIB:.2f} GiB")
    print(report(start, "live before the trace", args.depth, args.top))
    print(
        report(
            live_after(events, start, peak_index), f"live at the peak (after event {peak_index})", args.depth, args.top
        )
    )
    print(report(end, "live at the dump", args.depth, args.top))
    print(f"peak allocated in the trace: {peak / GIB:.2f} GiB")


if __name__ == "__main__":
    main()

"""The training step, side by side for every attention type: ``python scripts/bench_training.py``.

Each row is a real training run of ``python -m megatron_mtraining.pretrain`` (Megatron's own
loop) on mock data, for a recipe's model shape (Qwen2.5-3B by default) cut to ``--num-layers``,
at ``--seq-length``, on one process; ``--step-report`` (``training/step_report.py``) gives its
steady seconds per iteration, peak memory and one profiled step's device time by part. The
script prints a table and writes ``OUT/bench_training.json`` (the rows' reports, the FLOP
counts and floors) and each row's log and report.

Rows (``--rows``):
  cudnn         dense attention on cuDNN / FlashAttention-2 through PyTorch (``backend=sdpa``):
                the baseline a user would otherwise run, with the same model code around it
  dense         ``attention.type=dense`` as configured (``auto``: the same library on a GPU)
  dense-triton  dense attention on the plugin's own Triton kernel
  mtraining, moba, msa   the sparse types (MSA after its indexer warmup)
  mtraining-docs  ``mtraining`` on the mock data's packed documents (each under 4096 tokens) with
                ``reset_attention_mask`` and ``reset_position_ids``: a per-document index a layer,
                its build replayed from the graph the step's first layer captures
  dense-docs    dense attention on the same packed documents: the plugin's block-diagonal Triton
                kernel, which PyTorch's SDPA cannot run (no document bounds) and which beats
                FlashAttention-2 varlen on the same boundaries (``scripts/bench_documents.py``)
  moba-triton   MoBA on the plugin's Triton kernels (``backend=triton``), the path ``moba`` takes
                under context parallelism and with packed documents (``moba`` on one GPU runs
                the varlen calls on the library ``varlen_blocks/choose.py`` picks: cuDNN's on sm90)
  moba-flash    ``moba`` with those calls on FlashAttention-2 (``MTRAINING_VARLEN_LIBRARY=flash``),
                what an A100 runs
  msa-warmup    MSA during warmup (dense main branch, KL against the whole distribution)
  msa-kl-shared ``msa`` with the KL's teacher taken from the attention's backward
                (``MTRAINING_KL_TEACHER=shared``), not recomputed by the KL's own kernels

Per layer, two ways. ``--double`` runs every row again with twice the layers and takes the
difference in steady s/iteration over the added layers: everything a layer costs, with no
attribution, and the fixed part by subtraction (the headline figures). And from the profile:
the device time of the layers' parts in the profiled step (attention, index build,
MSA's branch and KL, matmuls, norms, elementwise; forward, recompute and backward) over the
number of layers; the metric steps (attended area, recall) are logging and counted apart. Useful FLOPs count the matmuls and the attended area only
(``4 * area * d * Hq`` forward, backward 2.5x; recomputation not counted); MFU divides them by
the device's dense bf16 peak. Floors: the matmuls of one forward and one backward at the
measured bf16 matmul rate (an 8192^3 product timed at the start). Last, each row's Triton
compiles: how many before the steady iterations, and every one in them (a steady median can
hide steps that compile again).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_mtraining.planning.flops import model_flops  # noqa: E402
from megatron_mtraining.planning.hardware import gpu_of_device  # noqa: E402

# Megatron's document masking from the EOD tokens of the mock data's packed documents.
DOCUMENTS = ["megatron.reset_attention_mask=true", "megatron.reset_position_ids=true"]
ROWS = {
    "cudnn": ["attention.type=dense", "attention.backend=sdpa"],
    "dense": ["attention.type=dense"],
    "dense-triton": ["attention.type=dense", "attention.backend=triton"],
    "mtraining": ["attention.type=mtraining"],
    "mtraining-docs": ["attention.type=mtraining", *DOCUMENTS],
    "dense-docs": ["attention.type=dense", *DOCUMENTS],
    "moba": ["attention.type=moba"],
    "moba-triton": ["attention.type=moba", "attention.backend=triton"],
    "moba-flash": ["attention.type=moba"],
    "msa": ["attention.type=msa", "attention.msa.warmup_steps=0"],
    "msa-warmup": ["attention.type=msa", "attention.msa.warmup_steps=1000"],
    "msa-kl-shared": ["attention.type=msa", "attention.msa.warmup_steps=0"],
}
# Rows that differ from another by the environment only.
ROW_ENV = {"msa-kl-shared": {"MTRAINING_KL_TEACHER": "shared"}, "moba-flash": {"MTRAINING_VARLEN_LIBRARY": "flash"}}
RECOMPUTE = {
    "full": [
        "megatron.recompute_granularity=full",
        "megatron.recompute_method=uniform",
        "megatron.recompute_num_layers=1",
    ],
    # Keeps the attention's inputs and output; the MLP runs again in the backward. (Megatron's
    # "layernorm" recomputation needs Transformer Engine: without it, a NameError.)
    "mlp": [
        "megatron.recompute_granularity=selective",
        "megatron.recompute_modules=[mlp]",
        "megatron.recompute_method=null",
        "megatron.recompute_num_layers=null",
    ],
    "none": ["megatron.recompute_granularity=null"],
}
# The metric steps are logging, not the layer's work: counted apart (``metrics_ms``).
ATTENTION_PARTS = ("attention", "index", "msa_index", "msa_kl")
LAYER_PARTS = ("matmuls", "norms", "elementwise")
FIXED_PARTS = ("embedding", "loss", "optimizer", "other", "grads", "communication")


def _parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="configs/qwen2.5-3b/base.yaml", help="recipe whose model shape is used")
    p.add_argument("--seq-length", type=int, default=131072)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--rows", default="cudnn,dense,mtraining,moba,msa", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--recompute", default="full", choices=sorted(RECOMPUTE), help="activation recomputation policy")
    p.add_argument(
        "--double",
        action="store_true",
        help="also run every row with twice the layers: per layer = the difference in s/iteration over the "
        "added layers, with no profiler attribution",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also write each row's profiled step as a Chrome trace, OUT/<row>.trace.json.gz (pretrain's --step-trace)",
    )
    p.add_argument(
        "--stacks",
        action="store_true",
        help="sample the profiled step's Python stacks and count its device syncs: each gap also names the "
        "package's innermost frame the host was in (pretrain's --step-stacks; slows the profiled step's host a "
        "little, not the steady iterations)",
    )
    p.add_argument("--iters", type=int, default=6, help="iterations per row: 2 warmup, steady ones, the profiled one")
    p.add_argument("--timeout", type=int, default=400, help="seconds per row")
    p.add_argument("--out", default="runs/bench_training")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="more overrides for every row")
    return p.parse_args(argv)


def _common(args, layers: int) -> list[str]:
    s = args.seq_length
    return [
        "megatron.mock_data=true",
        "megatron.tokenizer_type=NullTokenizer",
        "megatron.vocab_size=151935",
        "megatron.data_path=null",
        "megatron.tokenizer_model=null",
        "megatron.load=null",
        "megatron.save=null",
        f"megatron.train_iters={args.iters}",
        "megatron.global_batch_size=1",
        "megatron.micro_batch_size=1",
        f"megatron.num_layers={layers}",
        "megatron.lr_warmup_iters=0",
        "megatron.log_interval=1",
        f"megatron.seq_length={s}",
        f"megatron.max_position_embeddings={s}",
        *RECOMPUTE[args.recompute],
        *args.overrides,
    ]


def matmul_tflops() -> float | None:
    """Measured bf16 matmul rate (8192^3, median of 20), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return 2 * 8192**3 / (times[len(times) // 2] * 1e-3) / 1e12


def _shape(config: str, overrides: list[str]) -> dict:
    from megatron_mtraining.training.yaml_config import load_config

    m = load_config(config, overrides).megatron
    shape = {k: m[k] for k in ("hidden_size", "ffn_hidden_size", "num_attention_heads")}
    # Megatron's defaults where a config leaves them out.
    shape["kv_channels"] = m.get("kv_channels") or m["hidden_size"] // m["num_attention_heads"]
    shape["num_query_groups"] = m.get("num_query_groups") or m["num_attention_heads"]
    shape["padded_vocab_size"] = m.get("padded_vocab_size") or m.get("vocab_size")
    return shape


def run_row(row: str, args, out: Path, layers: int) -> dict:
    name = row if layers == args.num_layers else f"{row}_{layers}layers"
    report = out / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "megatron_mtraining.pretrain",
        "--config",
        args.config,
        *_common(args, layers),
        *ROWS[row],
        "--step-report",
        str(report),
        "--profile-step",
        str(args.iters - 2),
        *(["--step-trace", str(out / f"{name}.trace.json.gz")] if args.trace else []),
        *(["--step-stacks"] if args.stacks else []),
    ]
    # One process on one device: the entry point's own single-process rendezvous.
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.update(ROW_ENV.get(row, {}))
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"row": name, "command": " ".join(cmd[1:]), "rc": rc, "wall_s": round(time.perf_counter() - start, 1)}
    if rc == 0 and report.exists():
        result.update(json.loads(report.read_text()))
    else:
        result["log_tail"] = (out / f"{name}.log").read_text()[-3000:]
    return result


def summarize(row: dict, shape: dict, seq: int, layers: int, rate: float | None) -> dict:
    """Per-layer, fixed-part and FLOP figures of one row's report."""
    prof = row.get("profile") or {}
    parts = prof.get("parts_ms", {})
    # None where no step logged its metrics (a log interval past the run): no useful FLOPs then.
    metrics = row.get("metrics", {})
    fraction = metrics.get("attended_fraction")
    # With packed documents the fraction is of the documents' area, a share of the causal one.
    computed = None if fraction is None else fraction * metrics.get("document_area", 1.0)
    flops = model_flops(shape, seq, 1.0 if computed is None else computed)

    def total(names):
        return sum(sum(parts.get(n, {}).values()) for n in names)

    summary = {
        "attended_fraction": fraction,
        # From the parts rather than the layer ranges: selective recomputation re-runs a
        # module outside its layer's range, so its work carries no layer number.
        "layer_ms": (total(ATTENTION_PARTS) + total(LAYER_PARTS)) / layers,
        "attention_ms_per_layer": total(ATTENTION_PARTS) / layers,
        "non_attention_ms_per_layer": total(LAYER_PARTS) / layers,
        "fixed_ms": total(FIXED_PARTS),
        "metrics_ms": total(("metrics",)),
        "idle_ms": prof.get("idle_ms"),
        "flops": flops,
    }
    for part in ("attention", "index", "msa_index", "msa_kl", "metrics"):
        for phase in ("forward", "recompute", "backward"):
            summary[f"{part}_{phase}_ms_per_layer"] = parts.get(part, {}).get(phase, 0.0) / layers
    seconds = row.get("steady_s_per_iteration")
    device = row.get("device", "")
    try:
        peak = gpu_of_device(device).bf16_peak_tflops
    except ValueError:  # a device the planner's hardware table does not hold
        peak = None
    if seconds and fraction is not None:
        useful = layers * flops["per_layer_useful"] + 3 * flops["output_layer_fwd"]
        summary["model_tflops"] = useful / seconds / 1e12
        summary["mfu"] = summary["model_tflops"] / peak if peak else None
    if rate:
        summary["non_attention_floor_ms_per_layer"] = 3 * flops["matmul_fwd_per_layer"] / (rate * 1e12) * 1e3
        # The output layer's three GEMMs (logits, and the two gradients) at the matmul rate; the
        # optimizer and embedding are memory-bound passes of a few ms.
        summary["fixed_floor_ms"] = 3 * flops["output_layer_fwd"] / (rate * 1e12) * 1e3
    return summary


def layer_difference(row: dict, doubled: dict, layers: int) -> dict:
    """Per layer from two runs that differ only in their layer count: the added layers' share
    of the steady s/iteration (every kernel, host gap and metric step of a layer included),
    and the rest of the step (embedding, output layer and loss, optimizer) by subtraction."""
    per_layer = (doubled["steady_s_per_iteration"] - row["steady_s_per_iteration"]) / layers
    return {
        "layer_ms_from_difference": per_layer * 1e3,
        "fixed_ms_from_difference": (row["steady_s_per_iteration"] - layers * per_layer) * 1e3,
    }


def _fmt(v, spec=".3g"):
    width = spec.split(".")[0]
    return "-".rjust(int(width or 0)) if v is None else format(v, spec)


def main(argv=None) -> None:
    args = _parse(argv)
    args.config = str(Path(args.config).resolve())  # the rows run in the repository root
    rows = args.rows.split(",")
    for name in rows:
        if name not in ROWS:
            sys.exit(f"--rows: unknown row {name!r}; choose from {', '.join(ROWS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = _shape(args.config, [f"megatron.seq_length={args.seq_length}"])
    rate = matmul_tflops()
    results = []
    for name in rows:
        row = run_row(name, args, out, args.num_layers)
        row["summary"] = summarize(row, shape, args.seq_length, args.num_layers, rate) if row["rc"] == 0 else {}
        print(f"{name}: rc={row['rc']} {row.get('steady_s_per_iteration')} s/iteration ({row['wall_s']} s)", flush=True)
        if args.double and row["summary"]:
            doubled = run_row(name, args, out, 2 * args.num_layers)
            row["doubled"] = doubled
            print(f"  x2 layers: rc={doubled['rc']} {doubled.get('steady_s_per_iteration')} s/iteration", flush=True)
            if doubled["rc"] == 0:
                row["summary"].update(layer_difference(row, doubled, args.num_layers))
        results.append(row)
    base = next((r for r in results if r["row"] == "cudnn" and r["rc"] == 0), None)
    record = {
        "config": args.config,
        "seq_length": args.seq_length,
        "num_layers": args.num_layers,
        "recompute": args.recompute,
        "matmul_tflops": rate,
        "rows": results,
    }
    (out / "bench_training.json").write_text(json.dumps(record, indent=1))
    print(
        f"\nseq {args.seq_length}, {args.num_layers} layers, recompute {args.recompute}, "
        f"matmul {_fmt(rate, '.0f')} TFLOP/s"
    )
    head = (
        "row            s/iter  tokens/s  vs-cudnn  layer_ms  l-vs-cudnn  attn/l  nonattn/l  floor/l  fixed_ms  "
        "idle_ms  MFU    peak_GiB  attended"
    )
    print(head)
    for r in results:
        s = r["summary"]
        if not s:
            print(f"{r['row']:<14} failed: rc={r['rc']} (see {out / (r['row'] + '.log')})")
            continue
        ratio = base and base["steady_s_per_iteration"] / r["steady_s_per_iteration"]
        lratio = base and base["summary"]["layer_ms"] / s["layer_ms"]
        print(
            f"{r['row']:<14} {_fmt(r['steady_s_per_iteration'], '6.3f')}  {_fmt(r['tokens_per_s'], '8.0f')}  "
            f"{_fmt(ratio, '8.2f')}  {_fmt(s['layer_ms'], '8.1f')}  {_fmt(lratio, '10.2f')}  "
            f"{_fmt(s['attention_ms_per_layer'], '6.1f')}  {_fmt(s['non_attention_ms_per_layer'], '9.1f')}  "
            f"{_fmt(s.get('non_attention_floor_ms_per_layer'), '7.1f')}  {_fmt(s['fixed_ms'], '8.1f')}  "
            f"{_fmt(s['idle_ms'], '7.1f')}  {_fmt(s.get('mfu'), '.3f')}  {_fmt(r.get('peak_allocated_gib'), '8.1f')}  "
            f"{_fmt(s['attended_fraction'], '.4f')}"
        )
    print("\nTriton compiles (the step report's): before the steady iterations; in them, kernel@iteration")
    for r in results:
        c = r.get("compiles")
        if c:
            late = ", ".join(f"{e['kernel']}@{e['iteration']} {e['s']:.2f} s" for e in c["steady"]) or "none"
            print(f"{r['row']:<14} {c['before_steady']} ({c['before_steady_s']:.1f} s); {late}")
    if args.double:
        print(
            "\nper layer from the difference of runs with L and 2L layers (ms; fixed part = s/iteration - L x layer):"
        )
        print("row            layer_ms  l-vs-cudnn  fixed_ms  fixed_floor_ms")
        for r in results:
            s = r["summary"]
            if "layer_ms_from_difference" not in s:
                continue
            lratio = base and base["summary"].get("layer_ms_from_difference", 0) / s["layer_ms_from_difference"]
            print(
                f"{r['row']:<14} {s['layer_ms_from_difference']:8.1f}  {_fmt(lratio, '10.2f')}  "
                f"{s['fixed_ms_from_difference']:8.1f}  {_fmt(s.get('fixed_floor_ms'), '8.1f')}"
            )
    print("\nper-part device ms per profiled step (forward / recompute / backward):")
    for r in results:
        for part, phases in (r.get("profile") or {}).get("parts_ms", {}).items():
            print(
                f"  {r['row']:<14} {part:<14} "
                + " / ".join(f"{phases[p]:9.1f}" for p in ("forward", "recompute", "backward"))
            )
    print("\nthe profiled step's longest device-idle gaps (ms, the kernels on either side, the host meanwhile):")
    for r in results:
        idle = (r.get("profile") or {}).get("idle")
        if not idle:
            continue
        print(f"  {r['row']:<14} {idle['events']} device events, {idle['gaps']} gaps, {idle['gaps_ms']:.1f} ms")
        for gap in idle["longest"][:5]:
            print(
                f"    {gap['ms']:7.2f} at {gap['at_ms']:9.1f}: {gap['after']} -> {gap['before']} | {' > '.join(gap['host'])}"
            )
            if gap.get("frame"):
                print(f"            in {gap['frame']}")
        if idle.get("by_frame_ms"):
            print("    every gap's time by the package's innermost frame (ms):")
            for frame, ms in idle["by_frame_ms"].items():
                print(f"      {ms:8.2f}  {frame}")
        host = r["profile"].get("host")
        if host:
            print(f"    sampled host time by frame (ms; {host['samples']} samples every {host['interval_ms']} ms):")
            for frame, ms in host["host_ms_by_frame"].items():
                print(f"      {ms:8.2f}  {frame}")
            print(f"    {host['syncs']} device syncs, by frame:")
            for frame, n in host["syncs_by_frame"].items():
                print(f"      {n:6d}  {frame}")


if __name__ == "__main__":
    main()

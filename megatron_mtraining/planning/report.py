"""The planner's printout: the types side by side, their parts, the attention call per layer
with its transfers per link, and what the figures rest on."""

from __future__ import annotations

from . import model
from .planner import Plan
from .tables import table

# Step parts in print order: (key of StepPrediction.parts_s, label).
PARTS = (
    ("matmuls", "layers' matmuls + elementwise"),
    ("attention_fwd", "attention forward (+ recompute)"),
    ("attention_bwd", "attention backward"),
    ("index", "vertical-slash index build"),
    ("msa_selection", "MSA selection"),
    ("msa_kl", "MSA KL"),
    ("loss", "output layer + loss"),
    ("embedding", "embedding"),
    ("optimizer", "optimizer"),
    ("metrics", "metric steps"),
)


def _ring(run: model.Run) -> str:
    exchange = model.exchange_of(run)
    if exchange == "single":
        return "no context parallelism"
    if exchange == "hierarchical":
        inner = run.attention.hierarchy
        return f"hierarchical ring {inner} inner x {run.cp // inner} outer"
    return {"ring": "flat ring", "allgather": "all-gathered K/V"}[exchange]


def header(plan: Plan) -> str:
    run, cfg = plan.run, plan.run_config
    att = run.attention
    layout = att.layout + (f" (stripe {att.stripe})" if att.layout == "striped" else "")
    return "\n".join(
        [
            f"[plan] {cfg.path}: {run.layers} layers, hidden {run.hidden}, {run.heads} / {run.kv_heads} heads; "
            f"{run.seq} tokens, {run.local_seq} per CP rank",
            f"  cluster: {run.nodes} node(s) x {run.gpus_per_node} {run.gpu.name}, network {run.network}",
            f"  TP {run.tp} x CP {run.cp} x DP {run.dp}; {_ring(run)}; layout {layout}; recompute {run.recompute}"
            + (f" ({run.recomputed_layers} layers)" if run.recomputed_layers else "")
            + f"; micro-batch {run.micro_batch} x {run.micro_batches} per step, {run.global_batch * run.seq:,} tokens",
        ]
    )


def summary(plan: Plan) -> str:
    dense = next((t.step for t in plan.types if t.name == "dense" and t.step), None)
    lines = [
        f"  {'attention':<14} {'s/step':>8} {'tokens/s':>10} {'MFU':>6} {'x dense':>8} {'GiB/GPU':>8}  fits",
    ]
    for t in plan.types:
        if t.step is None:
            lines.append(f"  {t.name:<14} not available: {t.reason}")
            continue
        s = t.step
        ratio = f"{dense.step_s / s.step_s:8.2f}" if dense else f"{'-':>8}"
        fits = "yes" if t.memory.fits() else "NO"
        lines.append(
            f"  {t.name:<14} {s.step_s:8.2f} {s.tokens_per_s:10,.0f} {s.mfu:6.1%} {ratio} {t.memory.total_gib:8.1f}  {fits}"
        )
    return "\n".join(lines)


def parts(plan: Plan) -> str:
    steps = [t for t in plan.types if t.step]
    lines = ["  seconds per step by part (slowest rank)", "  " + f"{'':<34}" + "".join(f"{t.name:>14}" for t in steps)]
    names = (
        list(PARTS)
        + [(f"comm_{link}", f"exposed transfers, {link}") for link in ("nvlink", "network")]
        + [(f"grads_{link}", f"gradient exchange, {link}") for link in ("nvlink", "network")]
    )
    for key, label in names:
        values = [t.step.parts_s.get(key, 0.0) for t in steps]
        if any(v > 0 for v in values):
            lines.append(f"  {label:<34}" + "".join(f"{v:14.3f}" for v in values))
    lines.append(f"  {'total':<34}" + "".join(f"{t.step.step_s:14.3f}" for t in steps))
    return "\n".join(lines)


def attention_detail(plan: Plan) -> str:
    lines = ["  attention per layer and micro-batch (ms, slowest rank)"]
    for t in plan.types:
        if t.step is None:
            continue
        call, work = t.step.layer.attention, t.step.layer.work
        line = f"  {t.name:<14} forward {call.kernels['fwd']:8.2f}  backward {call.kernels['bwd']:8.2f}"
        if call.exchange in ("ring", "hierarchical"):
            fwd, bwd = call.steps["fwd"], call.steps["bwd"]
            line += (
                f"  ({len(fwd)} ring steps of {min(fwd):.2f}-{max(fwd):.2f} forward, "
                f"{min(bwd):.2f}-{max(bwd):.2f} backward)"
            )
        worker, step = work.degrees
        if plan.run.cp > 1:
            line += f"  area imbalance worker {worker:.3f} / step {step:.3f}"
        lines.append(line)
        for d in model.DIRECTIONS:
            moved = call.comm_total.get(d, {})
            hidden = call.comm_exposed.get(d, {})
            if moved:
                text = ", ".join(
                    f"{link} {ms:.2f} ms ({hidden.get(link, 0.0):.2f} exposed)" for link, ms in moved.items()
                )
                lines.append(f"  {'':<14} {d} transfers: {text}")
        if call.critical_path:
            lines.append(f"  {'':<14} critical path: {call.critical_path}")
        index = t.step.layer.parts.get("index")
        if index:
            lines.append(f"  {'':<14} index build {index:.2f} ms a layer (all passes)")
    return "\n".join(lines)


def basis(plan: Plan) -> str:
    gpu = plan.run.gpu
    specs = table("hardware")["gpus"][gpu.name]
    kinds = {k: v["kind"] for k, v in specs.items() if isinstance(v, dict)}
    published = ", ".join(f"{k} ({v})" for k, v in kinds.items() if v != "measured")
    lines = [
        "  basis: kernels, ring and step constants fitted to the measured tables of planning/calibration "
        "(python -m megatron_mtraining.plan --validate lists every figure predicted against measured)",
        f"  {gpu.name}: published or assumed, not measured on this GPU: {published}"
        if published
        else f"  {gpu.name}: measured",
        "  patterns: "
        + ", ".join(f"{t.name} {t.step.layer.work.source}" for t in plan.types if t.step and t.step.layer.work.source),
        f"  network {plan.run.network}: published line rate ({table('hardware')['networks'][plan.run.network]['gb_s_per_gpu']['value']} GB/s per GPU assumed reachable)",
    ]
    if plan.run.cp > 1:
        lines.append(
            "  CP > 1: the step at CP > 1 was never measured (no multi-GPU training step); the attention call is "
            "validated on 2-8 H200s of one host, the rest is the single-GPU step model"
        )
    return "\n".join(lines)


def format_plan(plan: Plan) -> str:
    return "\n".join([header(plan), summary(plan), parts(plan), attention_detail(plan), basis(plan)])

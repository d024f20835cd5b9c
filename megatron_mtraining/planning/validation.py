"""The planner against every recorded measurement of the calibration tables.

Each figure is predicted by the same code that plans a run: kernel rows by the kernel model,
training-step rows by ``model.predict_step`` on the row's run (``calibration.validation_run``),
context-parallel rows by ``model.attention_call`` with the kernels' speed of the row's own
single-GPU figure (``calibration.predict_cp_row``). A figure is a ``fit`` where it set a
constant (``calibration`` says which), else a ``check``; a ``stale`` one was measured on code
that changed since in a way the planner does not model, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import calibration, model, workload
from .hardware import gpu_of_device
from .tables import source, table

TOLERANCE = 0.10


@dataclass(frozen=True)
class Check:
    table: str
    row: str
    quantity: str
    measured: float
    predicted: float
    role: str  # fit | check
    stale: str | None = None  # measured on code that changed since: why
    unmodeled: str | None = None  # rests on what the planner does not model: what

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1

    @property
    def asserted(self) -> bool:
        """Whether the 10% bound is a claim of this planner: a check, not stale."""
        return self.role == "check" and self.stale is None and self.unmodeled is None

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE


def _where(table_name: str, source_key: str) -> str:
    s = source(table_name, source_key)
    return f"{s['device'].split(' (')[0]} {s.get('commit', s['date'])}"


def kernel_checks(c: model.Constants) -> list[Check]:
    """The kernel rows: least-squares calibration rows (``fit``), listed with their residuals."""
    checks = []
    for row in table("kernels")["rows"]:
        work = calibration.attention_work(calibration.kernel_row_spec(row))
        device = gpu_of_device(source("kernels", row["source"])["device"])
        measured = calibration.measured_kernel_ms(row, work)
        name = f"{row['kernel']} {row['pattern']} {row['seq'] // 1024}K, {_where('kernels', row['source'])}"
        for i, d in enumerate(model.DIRECTIONS):
            predicted = model.kernel_ms(c, work, d, row["kernel"], device)
            checks.append(Check("kernels", name, f"{d} ms", measured[i], predicted, "fit"))
    return checks


def step_checks(c: model.Constants) -> list[Check]:
    base, checks = calibration.base_run(), []
    unmodeled = table("training_steps")["unmodeled_reasons"]
    for row in table("training_steps")["rows"]:
        run = calibration.validation_run(base, row)
        pattern, warmup = run.attention.type, row["row"] == "msa-warmup"
        step = model.predict_step(c, run, pattern, warmup)
        layer = step.layer
        metrics_per_layer = step.parts_s.get("metrics", 0.0) * 1e3 / run.layers
        name = f"{row['row']} {row['seq'] // 1024}K {row['layers']}L {row['recompute']}" + (
            f" b{row['block']}" if "block" in row else ""
        )
        name += f", {_where('training_steps', row['source'])}"

        def add(quantity, measured, predicted, role="check", key=None, r=row, n=name):
            stale, gap = r.get("stale", {}).get(key), r.get("unmodeled", {}).get(key)
            checks.append(Check("training_steps", n, quantity, measured, predicted, role, stale, unmodeled.get(gap)))

        add("s/iteration", row["s_per_iter"], step.step_s, key="s_per_iter")
        if "per_layer_ms" in row:
            by_difference = row["per_layer_from"] == "difference"
            predicted = layer.total + (metrics_per_layer if by_difference else 0.0)
            role = "fit" if row.get("role") == "fit" else "check"
            add(f"ms per layer ({row['per_layer_from']})", row["per_layer_ms"], predicted, role, "per_layer_ms")
        if "fixed_ms" in row:
            fixed = (step.step_s - run.layers * layer.total / 1e3) * 1e3 - metrics_per_layer * run.layers
            add("fixed part ms (difference)", row["fixed_ms"], fixed)
        parts = layer.parts
        predicted_parts = {
            "attention_forward": parts["attention_fwd"] / model._passes(run, True)["attention"],
            "attention_recompute": parts["attention_fwd"] / 2,
            "attention_backward": parts["attention_bwd"],
            "non_attention": parts["matmuls"],
            "index_per_pass": parts.get("index", 0.0) / model._passes(run, True)["attention"],
            "metrics": metrics_per_layer,
            "msa_selection": parts.get("msa_selection", 0.0),
            "msa_kl": parts.get("msa_kl", 0.0),
            "attention_main_branch": parts["attention_fwd"] + parts["attention_bwd"],
        }
        for part, measured in row.get("parts_ms_per_layer", {}).items():
            if part in predicted_parts:
                role = "fit" if part in row.get("fit_parts", ()) else "check"
                add(f"{part} ms per layer", measured, predicted_parts[part], role, part)
    return checks


def cp_checks(c: model.Constants) -> list[Check]:
    base, checks = calibration.base_run(), []
    reasons = table("context_parallel")["stale_reasons"]
    for row in table("context_parallel")["rows"]:
        predicted = calibration.predict_cp_row(c, row, base)
        ring = "all-gather" if row["exchange"] == "allgather" else ("flat" if "inner" not in row else "")
        if "inner" in row:
            ring = f"hierarchical {row['gpus'] // row['inner']}x{row['inner']}"
        name = (
            f"{row['gpus']} GPUs {row['tokens'] // 1024}K {row['pattern']} {row['layout']} {ring}, "
            f"{_where('context_parallel', row['source'])}"
        )
        role = row.get("role", "check")
        stale = row.get("stale", {})
        for i, d in enumerate(model.DIRECTIONS):
            if "ratio" in row:
                ratio = predicted[f"single_{d}_ms"] / (row["gpus"] * predicted[f"{d}_ms"])
                checks.append(Check("context_parallel", name, f"{d} ring / single", row["ratio"][i], ratio, role))
                continue
            key = f"{d}_ms"
            why = reasons.get(stale.get(key)) if key in stale else None
            checks.append(Check("context_parallel", name, f"{d} ms", row[key], predicted[key], role, why))
    return checks


def all_checks(c: model.Constants | None = None) -> list[Check]:
    c = c or calibration.fit()
    return kernel_checks(c) + step_checks(c) + cp_checks(c)


def refresh_workloads() -> dict:
    """The works of every calibration row, computed afresh (the content of
    ``calibration/workloads.json``)."""
    calibration.fit.cache_clear()
    with workload.recording() as found:
        all_checks()
    calibration.fit.cache_clear()
    return {
        "about": "The attention work per rank of every calibration row (planning.workload.AttentionWork: attended "
        "(query head, query, key) triples per rank and ring step, the vertical-column piece per rank, the useful "
        "triples per rank, and the single-GPU tile and bar triples), kept so that predicting a recorded "
        "measurement needs no index. Written by python -m megatron_mtraining.plan --refresh-workloads.",
        "works": {key: work.to_json() for key, work in sorted(found.items())},
    }


def report(checks: list[Check]) -> str:
    """A markdown table of every figure, predicted against measured."""
    lines = [
        "| table | measurement | quantity | measured | predicted | error | role |",
        "|---|---|---|---|---|---|---|",
    ]
    for ch in checks:
        role = "stale" if ch.stale else ("unmodeled" if ch.unmodeled else ch.role)
        mark = "" if ch.within or not ch.asserted else " **miss**"
        lines.append(
            f"| {ch.table} | {ch.row} | {ch.quantity} | {ch.measured:.4g} | {ch.predicted:.4g} | "
            f"{ch.error:+.1%}{mark} | {role} |"
        )
    asserted = [ch for ch in checks if ch.asserted]
    inside = sum(ch.within for ch in asserted)
    lines.append("")
    lines.append(
        f"{inside} of {len(asserted)} checks within {TOLERANCE:.0%}; not asserted: "
        f"{sum(ch.role == 'fit' for ch in checks)} fit, {sum(bool(ch.stale) for ch in checks)} stale, "
        f"{sum(bool(ch.unmodeled) for ch in checks)} unmodeled (reasons in the calibration tables)"
    )
    return "\n".join(lines)

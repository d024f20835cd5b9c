"""The study's report: the evaluation of every run in a workdir, as markdown for
``docs/accuracy.md`` and plots.

It reads ``pretrain/`` and ``continue/<type>[-<variant>]-seed<N>/`` (their ``stage.json`` and
``eval/<type>/results.json``, as the stages or an imported archive left them) and writes
``report/study.md``, ``report/study.json`` (the same numbers) and, with matplotlib,
``report/accuracy_by_length.png`` and ``report/loss_by_position.png``.

Accuracy is the harness's exact match (teacher forced): a task's average is over its samples
at every evaluated length. Every run is evaluated on the same samples (one evaluation seed),
so a sparse type is compared with dense sample by sample: the difference of each sample's
score, pooled over the seeds both types ran, gives the difference in points and its
standard error. The target of issue 23: each sparse type within 2 points of dense on every
task average, and within 1% of dense's held-out perplexity at the longest length. A variant
(``continue --variant``: the same type with other settings, a budget sweep) reports as a row of
its own, ``<type> <variant>``, against the dense runs of its seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .runs import ATTENTION_TYPES, CONTINUE, EVAL, PRETRAIN, STAGE_FILE

REPORT = Path("report")
TARGET_POINTS = 2.0
TARGET_PERPLEXITY = 0.01
PLOTS = ("accuracy_by_length.png", "loss_by_position.png")


@dataclass
class Run:
    name: str
    record: dict
    evals: dict[str, dict] = field(default_factory=dict)

    @property
    def attention(self) -> str:
        return self.record["attention"]

    @property
    def label(self) -> str:
        """The row the run reports under: its attention type, and its variant if it has one."""
        variant = self.record.get("variant")
        return f"{self.attention} {variant}" if variant else self.attention

    @property
    def seed(self) -> int:
        return self.record["seed"]

    @property
    def own(self) -> dict | None:
        return self.evals.get(self.attention)


def load_run(workdir: Path, run: Path) -> Run | None:
    path = workdir / run / STAGE_FILE
    if not path.is_file():
        return None
    evals = {
        results.parent.name: json.loads(results.read_text())
        for results in sorted((workdir / run / EVAL).glob("*/results.json"))
    }
    return Run(run.as_posix(), json.loads(path.read_text()), evals)


def load_runs(workdir: Path) -> tuple[Run | None, list[Run]]:
    """The pretrained run (or None) and the continued runs, by attention type then seed."""
    workdir = Path(workdir)
    runs = [r for d in sorted((workdir / CONTINUE).glob("*")) if (r := load_run(workdir, d.relative_to(workdir)))]
    order = {name: i for i, name in enumerate(ATTENTION_TYPES)}
    runs.sort(key=lambda r: (order.get(r.attention, len(order)), r.label, r.seed))
    return load_run(workdir, PRETRAIN), runs


# ---- numbers -----------------------------------------------------------------------------
def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def longest(results: dict) -> str:
    return str(max(results["plan"]["lengths"]))


def perplexity(results: dict, length: str | None = None) -> float | None:
    return results["perplexity"][length or longest(results)]["perplexity"]


def scores(results: dict) -> dict[tuple, bool]:
    """Each sample's exact match by (task, length, depth, index)."""
    return {(r["task"], r["length"], r["depth"], r["index"]): r["correct"] for r in results["samples"]}


def paired_difference(pairs: list[tuple[dict, dict]], task: str | None) -> tuple[float, float, int] | None:
    """(difference in points, its standard error, samples) of the first results' exact match
    against the second's on the samples both scored, of ``task`` (None: every task, each
    weighted as its task average weighs it in the average), pooled over the pairs."""
    diffs, weights = [], []
    for results, reference in pairs:
        mine, theirs = scores(results), scores(reference)
        keys = [k for k in mine if k in theirs and (task is None or k[0] == task)]
        counts = {}
        for key in keys:
            counts[key[0]] = counts.get(key[0], 0) + 1
        for key in keys:
            diffs.append(float(mine[key]) - float(theirs[key]))
            # The average weighs tasks equally, whatever their number of samples.
            weights.append(1.0 / counts[key[0]])
    if not diffs:
        return None
    total = sum(weights)
    mean = sum(w * d for w, d in zip(weights, diffs, strict=True)) / total
    # Standard error of a weighted mean of independent samples.
    variance = sum(w * w * (d - mean) ** 2 for w, d in zip(weights, diffs, strict=True)) / total**2
    return 100 * mean, 100 * math.sqrt(variance * len(diffs) / max(1, len(diffs) - 1)), len(diffs)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _pm(mean: float | None, sd: float | None, scale: float = 100.0, spec: str = ".1f") -> str:
    if mean is None:
        return "-"
    text = format(scale * mean, spec)
    return text if sd is None else f"{text} ± {format(scale * sd, spec)}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


# ---- the report --------------------------------------------------------------------------
def summarize(workdir: Path) -> dict:
    """The report's numbers: per run, per attention type (over seeds), against dense, the
    cross evaluations and the pretrained model."""
    pretrain, runs = load_runs(workdir)
    evaluated = [r for r in runs if r.own is not None]
    if not evaluated:
        raise ValueError(
            f"no evaluated run under {Path(workdir) / CONTINUE} (accepted: a workdir whose continue stages ran "
            "with --eval, or an imported archive of them)"
        )
    tasks = list(evaluated[0].own["plan"]["tasks"])
    per_run = []
    for run in evaluated:
        results = run.own
        per_run.append(
            {
                "run": run.name,
                "attention": run.label,
                "seed": run.seed,
                "iterations": run.record["iterations"],
                "train_iters": run.record["train_iters"],
                "stopped_by_time_limit": run.record["stopped_by_time_limit"],
                "attended_fraction": run.record.get("attended_fraction"),
                "tasks": {t: results["accuracy"]["task_average"][t] for t in tasks},
                "average": results["accuracy"]["average"],
                "lengths": list(results["plan"]["lengths"]),
                "by_length": {
                    n: _mean_of(results["accuracy"]["by_task"], n) for n in map(str, results["plan"]["lengths"])
                },
                "perplexity": perplexity(results),
                "length": longest(results),
            }
        )
    types = list(dict.fromkeys(r["attention"] for r in per_run))
    per_type = {}
    for attention in types:
        rows = [r for r in per_run if r["attention"] == attention]
        per_type[attention] = {
            "seeds": [r["seed"] for r in rows],
            "tasks": {t: mean_sd([r["tasks"][t] for r in rows]) for t in tasks},
            "average": mean_sd([r["average"] for r in rows]),
            "perplexity": mean_sd([r["perplexity"] for r in rows]),
            "attended_fraction": mean_sd([r["attended_fraction"] for r in rows if r["attended_fraction"] is not None]),
        }
    against_dense = {}
    dense = {r.seed: r for r in evaluated if r.label == "dense"}
    for attention in types:
        if attention == "dense":
            continue
        paired = [(r, dense[r.seed]) for r in evaluated if r.label == attention and r.seed in dense]
        if not paired:
            continue
        pairs = [(r.own, d.own) for r, d in paired]
        ratios = [perplexity(a) / perplexity(b) - 1 for a, b in pairs]
        deltas = {t: paired_difference(pairs, t) for t in tasks}
        average = paired_difference(pairs, None)
        ratio = sum(ratios) / len(ratios)
        misses = [f"{t} {d[0]:+.1f} points" for t, d in deltas.items() if d[0] < -TARGET_POINTS]
        if ratio > TARGET_PERPLEXITY:
            misses.append(f"perplexity {100 * ratio:+.2f}%")
        against_dense[attention] = {
            "seeds": [r.seed for r, _ in paired],
            "tasks": deltas,
            "average": average,
            "perplexity_ratio": ratio,
            "met": not misses,
            "misses": misses,
        }
    cross = []
    by_position = _loss_by_position(evaluated)
    for run in runs:
        for attention, results in run.evals.items():
            if attention == run.attention or run.own is None:
                continue
            cross.append(
                {
                    "run": run.name,
                    "trained": run.label,
                    "evaluated": attention,
                    "seed": run.seed,
                    "average": results["accuracy"]["average"],
                    "delta": results["accuracy"]["average"] - run.own["accuracy"]["average"],
                    "perplexity": perplexity(results),
                    "perplexity_ratio": perplexity(results) / perplexity(run.own) - 1,
                }
            )
    same_data = {}
    for seed in sorted({r.seed for r in runs}):
        seeded = [r for r in runs if r.seed == seed]
        same_data[seed] = {
            "runs": [r.name for r in seeded],
            "same_data": len({r.record["data"]["sha256"] for r in seeded}) == 1,
            "same_iterations": len({r.record["iterations"] for r in seeded}) == 1,
            "same_masking": len({r.record.get("documents_masked") for r in seeded}) == 1,
        }
    summary = {
        "tasks": tasks,
        "plan": {
            **{k: evaluated[0].own["plan"][k] for k in ("depths", "samples", "seed", "held_out", "documents")},
            "lengths": sorted({n for r in per_run for n in r["lengths"]}),
        },
        "runs": per_run,
        "per_type": per_type,
        "against_dense": against_dense,
        "cross": cross,
        "loss_by_position": by_position,
        "same_data": same_data,
        "meta": {
            "devices": sorted({r.record["device"] for r in runs}),
            "dates": sorted({r.record["date"][:10] for r in runs}),
            "commits": sorted({str(r.record["commit"]) for r in runs}),
            "data": sorted({f"{r.record['data']['split']} {r.record['data']['sha256']}" for r in runs}),
            "python": sorted({r.record["data"]["python"] for r in runs}),
        },
        "records": {r.name: r.record for r in runs},
    }
    if pretrain is not None and pretrain.own is not None:
        results = pretrain.own
        summary["pretrain"] = {
            "record": pretrain.record,
            "lengths": results["plan"]["lengths"],
            "tasks": {t: results["accuracy"]["task_average"][t] for t in results["plan"]["tasks"]},
            "average": results["accuracy"]["average"],
            "perplexity": perplexity(results),
            "length": longest(results),
        }
    return summary


def _loss_by_position(evaluated: list[Run]) -> dict:
    """The held-out loss by position bucket at the longest length, per attention type or
    variant (mean over the seeds): where along the context a sparse type loses to dense."""
    losses: dict[str, list[list[float]]] = {}
    buckets = None
    for run in evaluated:
        rows = run.own["perplexity"][longest(run.own)]["buckets"]
        buckets = buckets or [(b["start"], b["end"]) for b in rows]
        losses.setdefault(run.label, []).append([b["loss"] for b in rows])
    means = {label: [sum(col) / len(col) for col in zip(*runs, strict=True)] for label, runs in losses.items()}
    return {"buckets": buckets, "per_type": means}


def _mean_of(by_task: dict, length: str) -> float | None:
    values = [v[length] for v in by_task.values() if v.get(length) is not None]
    return sum(values) / len(values) if values else None


def markdown(summary: dict) -> str:
    tasks, plan, meta = summary["tasks"], summary["plan"], summary["meta"]
    length = summary["runs"][0]["length"]
    lines = [
        "## Results",
        "",
        f"Device {', '.join(meta['devices'])}; runs of {', '.join(meta['dates'])} at commit {', '.join(meta['commits'])}; "
        f"data {'; '.join(meta['data'])} (Python {', '.join(meta['python'])}).",
        "",
    ]
    if "pretrain" in summary:
        pre = summary["pretrain"]
        record = pre["record"]
        lines += [
            f"### The pretrained model (dense, {record['seq_length']} tokens)",
            "",
            f"{record['iterations']} iterations ({record['tokens'] / 1e6:.0f}M tokens, "
            f"{_num(record['s_per_iteration'])} s each), lm_loss {_num(record['lm_loss']['first'])} -> "
            f"{_num(record['lm_loss']['last'])}"
            + (" (stopped by the time limit)" if record["stopped_by_time_limit"] else "")
            + f"; exact match (%) at {', '.join(map(str, pre['lengths']))} tokens:",
            "",
            _table(
                [*pre["tasks"], "average", f"perplexity @{pre['length']}"],
                [[*(_pct(v) for v in pre["tasks"].values()), _pct(pre["average"]), _num(pre["perplexity"])]],
            ),
            "",
        ]
    lines += [
        f"### Continued at {length} tokens, each model evaluated with its own attention",
        "",
        f"Exact match (%) over the lengths {', '.join(map(str, plan['lengths']))} ({plan['samples']} samples per task, "
        f"length and needle depth, evaluation seed {plan['seed']}); held-out perplexity at {length} "
        f"({plan['documents']} documents of {plan['held_out']}); attended: the share of the causal area the training "
        "attended (after MSA's warmup). Per attention type: mean ± standard deviation over the seeds.",
        "",
    ]
    fewer = {r["run"]: r["lengths"] for r in summary["runs"] if r["lengths"] != list(plan["lengths"])}
    if fewer:
        lines += [
            "Evaluated at fewer lengths (the evaluation leaves out those its attention would attend densely at, "
            "e.g. a top-k taking every block): "
            + "; ".join(f"{run} at {', '.join(map(str, n))}" for run, n in fewer.items())
            + ". Their averages are over those lengths; their differences from dense below, over the samples "
            "both scored.",
            "",
        ]
    header = ["attention", "seed", "iterations", "attended", *tasks, "average", f"perplexity @{length}"]
    rows = []
    for attention, stats in summary["per_type"].items():
        for r in (r for r in summary["runs"] if r["attention"] == attention):
            stop = " (time limit)" if r["stopped_by_time_limit"] else ""
            rows.append(
                [attention, str(r["seed"]), f"{r['iterations']}{stop}", _num(r["attended_fraction"], ".3f")]
                + [_pct(r["tasks"][t]) for t in tasks]
                + [_pct(r["average"]), _num(r["perplexity"])]
            )
        rows.append(
            [f"**{attention}**", "mean", "", _pm(*stats["attended_fraction"], scale=1, spec=".3f")]
            + [_pm(*stats["tasks"][t]) for t in tasks]
            + [_pm(*stats["average"]), _pm(*stats["perplexity"], scale=1, spec=".3f")]
        )
    lines += [_table(header, rows), ""]
    against = summary["against_dense"]
    if against:
        lines += [
            "### Against dense (the target of issue 23)",
            "",
            "Difference in points of exact match from dense on the same samples, pooled over the seeds both ran "
            "(standard error in brackets), and the held-out perplexity at the longest length relative to dense's "
            f"(mean over the seeds). Target: within {TARGET_POINTS:g} points on every task average and within "
            f"{100 * TARGET_PERPLEXITY:g}% of the perplexity.",
            "",
        ]
        rows = []
        for attention, d in against.items():
            cells = [f"{v[0]:+.1f} ({v[1]:.1f})" if v else "-" for v in (*d["tasks"].values(), d["average"])]
            verdict = "met" if d["met"] else "not met"
            rows.append(
                [attention, ", ".join(map(str, d["seeds"])), *cells, f"{100 * d['perplexity_ratio']:+.2f}%", verdict]
            )
        lines += [_table(["attention", "seeds", *tasks, "average", f"perplexity @{length}", "target"], rows), ""]
        met = [a for a, d in against.items() if d["met"]]
        missed = [f"{a} ({'; '.join(d['misses'])})" for a, d in against.items() if not d["met"]]
        verdict = []
        if met:
            verdict.append(f"met by {', '.join(met)}")
        if missed:
            verdict.append(f"not met by {', '.join(missed)}")
        lines += [f"**Target: {'; '.join(verdict)}.**", ""]
    position = summary["loss_by_position"]
    if "dense" in position["per_type"] and len(position["per_type"]) > 1:
        dense = position["per_type"]["dense"]
        rows = [["dense", *(f"{x:.3f}" for x in dense)]]
        rows += [
            [label, *(f"{x - d:+.3f}" for x, d in zip(losses, dense, strict=True))]
            for label, losses in position["per_type"].items()
            if label != "dense"
        ]
        lines += [
            f"### Held-out loss by position at {length} tokens",
            "",
            "Nats per token, mean over the seeds: dense's, and each type's difference from it (where along the "
            "context a sparse type loses what).",
            "",
            _table(["attention", *(f"{a}-{b}" for a, b in position["buckets"])], rows),
            "",
        ]
    if summary["cross"]:
        lines += [
            "### Evaluated with another attention type",
            "",
            "The same checkpoints evaluated with an attention they did not train with: the dense model sparse at "
            "inference only, the sparse models dense. Differences are against the run's own attention.",
            "",
            _table(
                [
                    "trained",
                    "evaluated",
                    "seed",
                    "average",
                    "difference (points)",
                    f"perplexity @{length}",
                    "perplexity vs own",
                ],
                [
                    [
                        c["trained"],
                        c["evaluated"],
                        str(c["seed"]),
                        _pct(c["average"]),
                        f"{100 * c['delta']:+.1f}",
                        _num(c["perplexity"]),
                        f"{100 * c['perplexity_ratio']:+.2f}%",
                    ]
                    for c in summary["cross"]
                ],
            ),
            "",
        ]
    checks = []
    for seed, check in summary["same_data"].items():
        same = (
            "the same data and iterations"
            if check["same_data"] and check["same_iterations"]
            else (
                ("different data" if not check["same_data"] else "the same data")
                + (", different iterations" if not check["same_iterations"] else "")
            )
        ) + ("" if check.get("same_masking", True) else ", documents masked in some runs only")
        checks.append(f"seed {seed}: {same} ({', '.join(check['runs'])})")
    lines += ["Runs compared: " + "; ".join(checks) + ".", ""]
    rows = [
        [
            name,
            r["device"],
            r["date"][:10],
            str(r["commit"]),
            f"{r['iterations']} of {r['train_iters']}",
            {True: "masked", False: "attend across"}.get(r.get("documents_masked"), "not recorded"),
            _num(r["s_per_iteration"]),
            f"{_num(r['lm_loss']['first'])} -> {_num(r['lm_loss']['last'])}",
            _num((r.get("validation") or {}).get("lm_loss")),
            _num(r.get("index_recall")),
            _num(r.get("index_recall_heldout")),
            _num(r.get("msa_block_recall")),
        ]
        for name, r in summary["records"].items()
    ]
    header = [
        "run",
        "device",
        "date",
        "commit",
        "iterations",
        "documents",
        "s / iteration",
        "lm_loss",
        "validation loss",
    ]
    lines += [
        "Training: whether packed documents attended only within themselves (`reset_attention_mask`, the "
        "indexes built per document); the held-out text's loss at the last validation; the share of the last queries' dense "
        "attention mass the index kept, for those queries (recall) and for sampled queries that did not build "
        "it (held-out recall), and MSA's block recall, means over the logged steps after MSA's warmup.",
        "",
        _table([*header, "recall", "held-out recall", "MSA block recall"], rows),
        "",
    ]
    return "\n".join(lines)


def figures(summary: dict) -> dict:
    """Name -> matplotlib figure: the average accuracy by length, and the held-out loss by
    position at the longest length, per attention type (mean over the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    accuracy, ax = plt.subplots(figsize=(6, 4))
    for attention in summary["per_type"]:
        rows = [r for r in summary["runs"] if r["attention"] == attention]
        lengths = list(rows[0]["by_length"])
        means = [mean_sd([r["by_length"][n] for r in rows if r["by_length"][n] is not None]) for n in lengths]
        ax.errorbar(
            [int(n) for n in lengths],
            [100 * m for m, _ in means],
            yerr=[100 * (s or 0) for _, s in means],
            marker="o",
            capsize=3,
            label=attention,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("task average, exact match (%)")
    ax.set_ylim(0, 100)
    ax.set_title("accuracy by length (mean over seeds)")
    ax.legend(title="attention")
    accuracy.tight_layout()
    loss, ax = plt.subplots(figsize=(6, 4))
    position = summary["loss_by_position"]
    xs = [(start + end) / 2 for start, end in position["buckets"]]
    for attention, ys in position["per_type"].items():
        ax.plot(xs, ys, marker="o", label=attention)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("held-out loss (nats per token)")
    ax.set_title(f"loss by position at {summary['runs'][0]['length']} tokens (mean over seeds)")
    ax.legend(title="attention")
    loss.tight_layout()
    return dict(zip(PLOTS, (accuracy, loss), strict=True))


def write_report(workdir: Path, out_dir: Path | None = None, log=print) -> tuple[str, list[Path]]:
    """Writes the markdown, the JSON and (with matplotlib) the plots; returns the markdown
    and the files."""
    from ...evaluation.report import has_matplotlib

    workdir = Path(workdir)
    out_dir = Path(out_dir) if out_dir is not None else workdir / REPORT
    summary = summarize(workdir)
    text = markdown(summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "study.md", out_dir / "study.json"]
    written[0].write_text(text)
    written[1].write_text(json.dumps(summary, indent=1) + "\n")
    if has_matplotlib():
        from matplotlib import pyplot as plt

        for name, fig in figures(summary).items():
            fig.savefig(out_dir / name, dpi=120)
            plt.close(fig)
            written.append(out_dir / name)
    else:
        log("[study] matplotlib is not installed: no plots (pip install 'megatron-mtraining[eval]')")
    return text, written

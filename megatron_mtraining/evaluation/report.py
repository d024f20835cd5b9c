"""The evaluation's outputs from its results dict: ``results.json``, ``results.md`` (tables),
the plots ``accuracy_heatmap.png`` (needle accuracy, length x depth) and
``loss_by_position.png``, and the scalars and figures for Megatron's TensorBoard and W&B
writers. The plots need matplotlib (the ``eval`` extra); without it the other files are
written and the plots can be drawn later from the JSON (``evaluate --replot``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

HEATMAP, LOSS_PLOT = "accuracy_heatmap.png", "loss_by_position.png"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def markdown(results: dict) -> str:
    """The results as markdown tables: accuracy by task and length, needle accuracy by length
    and depth, the answers' loss, and loss by position."""
    meta, plan, accuracy = results.get("meta", {}), results["plan"], results["accuracy"]
    lengths = [str(n) for n in plan["lengths"]]
    lines = ["# Long-context evaluation", ""]
    if meta:
        lines += [
            f"Checkpoint `{meta['checkpoint']}` (iteration {meta['iteration']}) evaluated with attention "
            f"`{meta['attention']['type']}`, {meta['date']}, commit {meta['commit']}, {meta['device']}, "
            f"CP {meta['context_parallel_size']}; config `{meta['config']}` {' '.join(meta['overrides'])}".rstrip(),
            "",
        ]
    lines += [
        f"Exact match by teacher forcing (%), {plan['samples']} samples per task, length and depth, seed {plan['seed']}.",
        "",
        _table(
            ["task", *lengths, "average"],
            [
                [
                    task,
                    *(_percent(accuracy["by_task"][task][n]) for n in lengths),
                    _percent(accuracy["task_average"][task]),
                ]
                for task in plan["tasks"]
            ]
            + [["average", *([""] * len(lengths)), _percent(accuracy["average"])]],
        ),
        "",
        "Needle tasks (`niah_single`, `niah_multikey`) by length and needle depth (%):",
        "",
        _table(
            ["length", *(str(d) for d in plan["depths"])],
            [[n, *(_percent(v) for v in accuracy["needle_by_length_depth"][n].values())] for n in lengths],
        ),
        "",
        "Mean loss per answer token:",
        "",
        _table(
            ["task", *lengths],
            [[task, *(_number(results["answer_loss"][task][n]) for n in lengths)] for task in plan["tasks"]],
        ),
        "",
        f"Loss by position on held-out documents ({plan['held_out']}, {plan['documents']} per length):",
        "",
    ]
    rows = []
    for n in lengths:
        ppl = results["perplexity"][n]
        rows.append(
            [n, _number(ppl["loss"]), _number(ppl["perplexity"], 2), *(_number(b["loss"]) for b in ppl["buckets"])]
        )
    spans = [f"bucket {b + 1}" for b in range(plan["buckets"])]
    lines += [_table(["length", "loss", "perplexity", *spans], rows), ""]
    lines.append(
        f"Bucket `b` of length `n` holds positions `[b n / {plan['buckets']}, (b + 1) n / {plan['buckets']})`."
    )
    check = results["greedy_check"]
    if check["samples"]:
        lines += ["", f"Greedy decoding agreed with teacher forcing on {check['agree']} of {check['samples']} samples."]
    return "\n".join(lines) + "\n"


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def figures(results: dict) -> dict:
    """Name -> matplotlib figure: the needle accuracy heatmap and the loss by position."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    meta, plan = results.get("meta", {}), results["plan"]
    title = f" ({meta['attention']['type']}, iteration {meta['iteration']})" if meta else ""
    heatmap = results["accuracy"]["needle_by_length_depth"]
    grid = [[float("nan") if v is None else 100 * v for v in heatmap[str(n)].values()] for n in plan["lengths"]]
    fig, ax = plt.subplots(figsize=(1.2 * len(plan["depths"]) + 2, 0.6 * len(plan["lengths"]) + 1.5))
    image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(plan["depths"])), [str(d) for d in plan["depths"]])
    ax.set_yticks(range(len(plan["lengths"])), [str(n) for n in plan["lengths"]])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("length (tokens)")
    ax.set_title("needle accuracy (%)" + title)
    for row, values in enumerate(grid):
        for col, value in enumerate(values):
            ax.text(col, row, "-" if value != value else f"{value:.0f}", ha="center", va="center", color="w")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    loss_fig, ax = plt.subplots(figsize=(6, 4))
    for n in plan["lengths"]:
        buckets = [b for b in results["perplexity"][str(n)]["buckets"] if b["loss"] is not None]
        ax.plot([(b["start"] + b["end"]) / 2 for b in buckets], [b["loss"] for b in buckets], marker="o", label=str(n))
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("loss by position" + title)
    ax.legend(title="length")
    loss_fig.tight_layout()
    return {HEATMAP: fig, LOSS_PLOT: loss_fig}


def write_report(results: dict, out_dir: str | Path, log=print) -> list[Path]:
    """Writes the JSON, the markdown and (with matplotlib) the plots; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.md"]
    written[0].write_text(json.dumps(results, indent=1) + "\n")
    written[1].write_text(markdown(results))
    if not has_matplotlib():
        log("[eval] matplotlib is not installed: no plots (pip install 'megatron-mtraining[eval]', then --replot)")
        return written
    from matplotlib import pyplot as plt

    for name, fig in figures(results).items():
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def scalars(results: dict) -> dict[str, float]:
    """Tag -> value for the writers: each task's accuracy per length and average, the
    average, and the held-out loss and perplexity per length."""
    accuracy = results["accuracy"]
    values = {"eval/accuracy/average": accuracy["average"]}
    for task, by_length in accuracy["by_task"].items():
        values[f"eval/accuracy/{task}"] = accuracy["task_average"][task]
        values.update({f"eval/accuracy/{task}/{n}": v for n, v in by_length.items()})
    for n, ppl in results["perplexity"].items():
        values.update({f"eval/loss/{n}": ppl["loss"], f"eval/perplexity/{n}": ppl["perplexity"]})
    return {tag: value for tag, value in values.items() if value is not None}


def log_to_writers(results: dict, step: int, tensorboard=None, wandb=None) -> None:
    """Logs :func:`scalars` and the figures at ``step`` to Megatron's TensorBoard writer (a
    ``SummaryWriter``) and W&B writer (the ``wandb`` module), where given."""
    if tensorboard is None and wandb is None:
        return
    values = scalars(results)
    figs = (
        {f"eval/{name.removesuffix('.png')}": fig for name, fig in figures(results).items()} if has_matplotlib() else {}
    )
    if tensorboard is not None:
        for tag, value in values.items():
            tensorboard.add_scalar(tag, value, step)
        for tag, fig in figs.items():
            tensorboard.add_figure(tag, fig, step, close=False)
        tensorboard.flush()
    if wandb is not None:
        wandb.log({**values, **{tag: wandb.Image(fig) for tag, fig in figs.items()}}, step)
    if figs:
        from matplotlib import pyplot as plt

        for fig in figs.values():
            plt.close(fig)

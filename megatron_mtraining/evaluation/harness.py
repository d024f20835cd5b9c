"""The evaluation over a model given as a function: task accuracy by teacher forcing, a greedy
decoding check, and loss by position on held-out documents, summarised as one results dict.

The model is a :data:`Forward`: ``(tokens [L], labels [L]) -> (loss [L], prediction [L])``,
the per-token loss of each label (fp32) and the argmax token at each position, in sequence
order. A sample is scored by one forward of its ``length + 1`` ids with the answer appended:
it is correct iff the prediction at every answer position is the answer token, which is what
greedy decoding of the answer yields wherever the attention of a position does not depend on
later tokens (dense, MSA, MoBA; MTraining's vertical-slash index is built from the last
queries, here the question and the answer). :func:`greedy_answer` decodes by brute force to
check it.

Work is shared over data-parallel replicas with ``shard = (rank, size)`` (item ``i`` runs on
rank ``i % size``) and ``gather`` (every rank's records to every rank); both default to one
process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .held_out import HeldOut
from .tasks import TASKS, Codec, Sample, make_sample

Forward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class EvalPlan:
    """What to evaluate: ``samples`` per task, length and (needle tasks) depth, from
    ``seed``; ``greedy_check`` samples also decoded greedily; ``documents`` held-out windows
    per length, their loss in ``buckets`` equal spans of positions."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    samples: int = 8
    seed: int = 0
    greedy_check: int = 0
    documents: int = 4
    buckets: int = 8

    def items(self) -> list[tuple[str, int, float | None, int]]:
        """(task, length, depth, index) of every sample, lengths outermost."""
        return [
            (task, length, depth, index)
            for length in self.lengths
            for task in self.tasks
            for depth in (self.depths if TASKS[task].has_depth else (None,))
            for index in range(self.samples)
        ]


def check_fits(plan: EvalPlan, codec: Codec) -> None:
    """Raises ``ValueError`` naming the length when a task does not fit the shortest length
    with this tokenizer (before any sample runs, the same on every rank)."""
    for task in plan.tasks:
        make_sample(task, min(plan.lengths), plan.depths[0], plan.seed, 0, codec)


def teacher_forced(ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels of ``len(ids) - 1`` positions: label ``p`` is token ``p + 1``."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return ids[:-1], ids[1:]


def answer_span(sample: Sample) -> slice:
    """The positions whose labels are the answer's ids."""
    start = len(sample.context) - 1
    return slice(start, start + len(sample.answer_ids))


def score_sample(sample: Sample, forward: Forward, codec: Codec) -> dict:
    """One sample by teacher forcing: exact match of the answer, the predicted answer's text
    and the answer's mean loss per token."""
    losses, predictions = forward(*teacher_forced(sample.ids()))
    span = answer_span(sample)
    predicted = predictions[span].tolist()
    return {
        "task": sample.task,
        "length": sample.length,
        "depth": sample.depth,
        "position": sample.position,
        "index": sample.index,
        "answer": sample.answer,
        "prediction": codec.decode(predicted),
        "predicted_ids": predicted,
        "answer_ids": list(sample.answer_ids),
        "correct": predicted == list(sample.answer_ids),
        "answer_loss": float(losses[span].double().mean()),
    }


def greedy_answer(sample: Sample, forward: Forward, pad: int) -> list[int]:
    """The answer's length of tokens decoded greedily after the context, one forward per
    token, each run at the sample's length with ``pad`` after the tokens decoded so far."""
    ids = list(sample.context)
    for _ in sample.answer_ids:
        tokens, labels = teacher_forced(ids + [pad] * (sample.length + 1 - len(ids)))
        ids.append(int(forward(tokens, labels)[1][len(ids) - 1]))
    return ids[len(sample.context) :]


def position_losses(ids: Sequence[int], forward: Forward, buckets: int) -> tuple[list[float], list[int]]:
    """Loss sums and token counts of a window's positions in ``buckets`` equal spans."""
    losses, _ = forward(*teacher_forced(ids))
    bucket = torch.arange(losses.numel()) * buckets // losses.numel()
    sums = torch.zeros(buckets, dtype=torch.float64).index_add_(0, bucket, losses.double())
    return sums.tolist(), torch.bincount(bucket, minlength=buckets).tolist()


def _one_process(records: list) -> list:
    return records


def evaluate(
    plan: EvalPlan,
    forward: Forward,
    codec: Codec,
    pad: int,
    held_out: HeldOut,
    shard: tuple[int, int] = (0, 1),
    gather: Callable[[list], list] = _one_process,
    log: Callable[[str], None] = print,
) -> dict:
    """Runs ``plan`` on ``forward``; returns the results dict (:func:`summarize`)."""
    rank, size = shard
    start = time.monotonic()
    records = []
    items = plan.items()
    for i, (task, length, depth, index) in enumerate(items):
        if i % size != rank:
            continue
        sample = make_sample(task, length, depth, plan.seed, index, codec)
        record = score_sample(sample, forward, codec)
        if index < plan.greedy_check:
            record["greedy_ids"] = greedy_answer(sample, forward, pad)
        records.append(record)
    records = sorted(
        gather(records), key=lambda r: (r["length"], plan.tasks.index(r["task"]), r["depth"] or 0, r["index"])
    )
    log(f"[eval] {len(items)} task samples in {time.monotonic() - start:.1f} s")
    start = time.monotonic()
    windows = [(length, index) for length in plan.lengths for index in range(plan.documents)]
    positions = []
    for i, (length, index) in enumerate(windows):
        if i % size == rank:
            sums, counts = position_losses(held_out.window(length, index, codec), forward, plan.buckets)
            positions.append({"length": length, "index": index, "loss_sums": sums, "tokens": counts})
    positions = gather(positions)
    log(f"[eval] {len(windows)} held-out windows in {time.monotonic() - start:.1f} s")
    return summarize(plan, records, positions, held_out.describe())


def _mean(values) -> float | None:
    """The mean of the values that exist (None where none does)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(plan: EvalPlan, records: list[dict], positions: list[dict], held_out: str) -> dict:
    """The results dict: the plan, accuracy by task and length (each task's average over the
    lengths, and their mean), needle accuracy by length and depth, the answers' mean loss,
    loss and perplexity by length and position bucket, the greedy check and every sample."""
    by_task = {
        task: {
            str(n): _mean(r["correct"] for r in records if r["task"] == task and r["length"] == n) for n in plan.lengths
        }
        for task in plan.tasks
    }
    task_average = {task: _mean(by_task[task].values()) for task in plan.tasks}
    needles = [t for t in plan.tasks if TASKS[t].has_depth]
    heatmap = {
        str(n): {
            str(d): _mean(
                r["correct"] for r in records if r["task"] in needles and r["length"] == n and r["depth"] == d
            )
            for d in plan.depths
        }
        for n in plan.lengths
    }
    answer_loss = {
        task: {
            str(n): _mean(r["answer_loss"] for r in records if r["task"] == task and r["length"] == n)
            for n in plan.lengths
        }
        for task in plan.tasks
    }
    perplexity = {}
    for n in plan.lengths:
        windows = [p for p in positions if p["length"] == n]
        sums = [sum(p["loss_sums"][b] for p in windows) for b in range(plan.buckets)]
        tokens = [sum(p["tokens"][b] for p in windows) for b in range(plan.buckets)]
        loss = sum(sums) / sum(tokens) if windows else None
        perplexity[str(n)] = {
            "documents": len(windows),
            "loss": loss,
            "perplexity": math.exp(loss) if loss is not None else None,
            "buckets": [
                {
                    "start": b * n // plan.buckets,
                    "end": (b + 1) * n // plan.buckets,
                    "tokens": tokens[b],
                    "loss": sums[b] / tokens[b] if tokens[b] else None,
                }
                for b in range(plan.buckets)
            ],
        }
    checked = [r for r in records if "greedy_ids" in r]
    return {
        "plan": {**asdict(plan), "held_out": held_out},
        "accuracy": {
            "by_task": by_task,
            "task_average": task_average,
            "average": _mean(task_average.values()),
            "needle_by_length_depth": heatmap,
        },
        "answer_loss": answer_loss,
        "perplexity": perplexity,
        "greedy_check": {
            "samples": len(checked),
            "agree": sum((r["greedy_ids"] == r["answer_ids"]) == r["correct"] for r in checked),
        },
        "samples": records,
    }

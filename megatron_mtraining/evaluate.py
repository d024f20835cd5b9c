"""Long-context evaluation of a training checkpoint:
``python -m megatron_mtraining.evaluate --config run.yaml [key=value ...] [--checkpoint DIR]``.

The config and overrides are the training entry point's (``megatron_mtraining.pretrain``),
so ``attention.type=msa`` evaluates any checkpoint with MSA whatever it was trained with;
the checkpoint is ``--checkpoint``, else the config's ``megatron.load``, else its
``megatron.save``. Under ``torchrun`` every process runs this module with the config's
parallelism (CP as in training; data-parallel replicas share the samples). It runs the
synthetic tasks of ``megatron_mtraining.evaluation.tasks`` at each length and depth, scored by
teacher forcing, and the loss by position on held-out documents
(``evaluation.harness``), then writes ``results.json``, ``results.md`` and the plots to
``--output`` and logs them to the config's TensorBoard / W&B (``evaluation.report``).
``--replot RESULTS_JSON`` redraws the tables and plots from a results file, with no model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from .evaluation.harness import DEFAULT_DEPTHS, EvalPlan
from .evaluation.tasks import TASKS

SHORTEST_DEFAULT = 4096


def _parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.evaluate",
        description="Evaluate a training checkpoint on synthetic long-context tasks and held-out loss by position.",
        epilog="Overrides: megatron.<dest>=value or attention.<field>[.<sub>]=value, as for pretrain.",
    )
    parser.add_argument("--config", help="the training config (a YAML file or a packaged recipe name)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument(
        "--checkpoint", help="the checkpoint directory (default: the config's megatron.load, else megatron.save)"
    )
    parser.add_argument(
        "--output", help="where the results go (default: ./evaluation; with --replot, the results file's folder)"
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=list(TASKS),
        default=list(TASKS),
        metavar="TASK",
        help=f"of {', '.join(TASKS)} (default: all)",
    )
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        help=f"sequence lengths in tokens (default: {SHORTEST_DEFAULT} doubling up to the config's seq_length, and "
        "it, less those the attention cannot be sparse at, e.g. a top-k taking every block)",
    )
    parser.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS), help="needle depths in [0, 1]")
    parser.add_argument("--samples", type=int, default=8, help="samples per task, length and depth (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tasks and synthetic documents")
    parser.add_argument(
        "--greedy-check",
        type=int,
        default=0,
        metavar="N",
        help="also decode the first N samples of each task, length and depth greedily (one forward per answer "
        "token) and report agreement with teacher forcing",
    )
    parser.add_argument(
        "--ppl-data", metavar="PREFIX", help="held-out indexed dataset (default: synthetic long documents)"
    )
    parser.add_argument("--ppl-docs", type=int, default=4, help="held-out documents per length (default 4)")
    parser.add_argument("--buckets", type=int, default=8, help="position buckets of the loss (default 8)")
    parser.add_argument("--replot", metavar="RESULTS_JSON", help="redraw results.md and the plots from a results file")
    # Overrides may stand between the options.
    cli = parser.parse_intermixed_args(argv)
    if cli.replot is None and cli.config is None:
        parser.error("--config is required (or --replot RESULTS_JSON)")
    checks = [
        ("--samples", [cli.samples], lambda v: v >= 1, "a positive integer"),
        ("--greedy-check", [cli.greedy_check], lambda v: v >= 0, "an integer >= 0"),
        ("--ppl-docs", [cli.ppl_docs], lambda v: v >= 0, "an integer >= 0"),
        ("--buckets", [cli.buckets], lambda v: v >= 1, "a positive integer"),
        ("--depths", cli.depths, lambda v: 0 <= v <= 1, "numbers in [0, 1]"),
        ("--lengths", cli.lengths or [], lambda v: v >= 1, "positive integers"),
    ]
    for flag, values, test, accepted in checks:
        bad = [v for v in values if not test(v)]
        if bad:
            parser.error(f"bad value for {flag}: {bad[0]} (accepted: {accepted})")
    return cli


def default_lengths(seq_length: int) -> list[int]:
    """4096 doubling while under ``seq_length``, then ``seq_length`` itself."""
    lengths, n = [], SHORTEST_DEFAULT
    while n < seq_length:
        lengths.append(n)
        n *= 2
    return [*lengths, seq_length]


def _plan(cli: argparse.Namespace, run_config) -> EvalPlan:
    """The plan, checked against the run: lengths up to its seq_length that its attention
    and CP layout can split, buckets no more than the shortest length."""
    from .training.yaml_config import ConfigError

    seq_length, cp = run_config.value("seq_length"), run_config.value("context_parallel_size")
    if seq_length is None:
        raise ConfigError(f"{run_config.path}: no 'megatron.seq_length' (accepted: the length the model trained at)")
    lengths = []
    for n in cli.lengths or default_lengths(seq_length):
        if n > seq_length:
            raise ConfigError(
                f"bad value for --lengths: {n} (accepted: lengths up to megatron.seq_length={seq_length}; "
                "override megatron.seq_length to evaluate longer)"
            )
        try:
            run_config.attention.validate_for_sequence(n, cp)
        except ValueError as err:
            if cli.lengths:
                raise ConfigError(f"bad value for --lengths: {n} ({err})") from None
            # A default length the attention would be dense at (a top-k taking every block of
            # a short length, MSA at 64 blocks of 64 at 4096): left out, and said so.
            print(f"[eval] length {n} left out: {err}", flush=True)
            continue
        lengths.append(n)
    if not lengths:
        raise ConfigError(
            f"no default length {default_lengths(seq_length)} fits the attention (accepted: give --lengths)"
        )
    if cli.buckets > min(lengths):
        raise ConfigError(
            f"bad value for --buckets: {cli.buckets} (accepted: at most the shortest length, {min(lengths)})"
        )
    return EvalPlan(
        tasks=tuple(cli.tasks),
        lengths=tuple(sorted(set(lengths))),
        depths=tuple(cli.depths),
        samples=cli.samples,
        seed=cli.seed,
        greedy_check=cli.greedy_check,
        documents=cli.ppl_docs,
        buckets=cli.buckets,
    )


def _checkpoint_overrides(cli: argparse.Namespace, run_config) -> list[str]:
    """Megatron overrides that load ``--checkpoint`` (or the config's) for evaluation: the
    model only, no optimizer or RNG state, and nothing saved."""
    from .training.yaml_config import ConfigError

    checkpoint = cli.checkpoint or run_config.value("load") or run_config.value("save")
    if not checkpoint:
        raise ConfigError("no checkpoint: give --checkpoint DIR, or a config that sets megatron.load or megatron.save")
    if not (Path(checkpoint) / "latest_checkpointed_iteration.txt").is_file():
        raise ConfigError(
            f"bad value for --checkpoint: {str(checkpoint)!r} holds no Megatron checkpoint (no "
            "latest_checkpointed_iteration.txt; accepted: a directory that pretrain's megatron.save wrote, or an "
            "imported release checkpoint)"
        )
    return [
        f"megatron.load={checkpoint}",
        "megatron.save=null",
        "megatron.no_load_optim=true",
        "megatron.no_load_rng=true",
    ]


def source_commit() -> str | None:
    """The short commit of the source tree this module runs from, or None outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _meta(run_config, model, overrides: list[str]) -> dict:
    import torch

    args = model.args
    return {
        "command": " ".join(sys.argv),
        "config": str(run_config.path),
        "overrides": overrides,
        "checkpoint": args.load,
        "iteration": model.iteration,
        "attention": run_config.attention_dict(),
        "seq_length": args.seq_length,
        "world_size": args.world_size,
        "context_parallel_size": args.context_parallel_size,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": source_commit(),
    }


def main(argv: list[str] | None = None) -> None:
    cli = _parse_cli(sys.argv[1:] if argv is None else argv)
    from .evaluation import report

    if cli.replot is not None:
        results = json.loads(Path(cli.replot).read_text())
        for path in report.write_report(results, cli.output or Path(cli.replot).parent)[1:]:
            print(f"[eval] wrote {path}")
        return
    from .configs import find
    from .training.yaml_config import ConfigError, explain_rejection, load_config

    try:
        config = find(cli.config)
    except FileNotFoundError as err:
        sys.exit(f"config error: {err}")
    try:
        run_config = load_config(config, cli.overrides)
        if run_config.value("tokenizer_type") in (None, "NullTokenizer"):
            raise ConfigError(
                f"bad value for 'megatron.tokenizer_type': {run_config.value('tokenizer_type')!r} (accepted: a "
                "tokenizer of text, e.g. HuggingFaceTokenizer with megatron.tokenizer_model: the tasks are text)"
            )
        overrides = [*cli.overrides, *_checkpoint_overrides(cli, run_config)]
        run_config = load_config(config, overrides)
        plan = _plan(cli, run_config)
        from .evaluation.held_out import HeldOut

        try:
            held_out = HeldOut(cli.ppl_data, cli.seed)
            held_out.check(plan.lengths, plan.documents)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            evaluate_checkpoint(cli, run_config, plan, held_out, overrides)
        except ConfigError as err:
            raise explain_rejection(err, run_config) from None
    except ConfigError as err:
        sys.exit(f"config error: {err}")


def evaluate_checkpoint(cli, run_config, plan: EvalPlan, held_out, overrides: list[str]) -> dict:
    """Loads the checkpoint in this process (one rank of the launch), runs ``plan`` and
    writes the outputs (rank 0) and the writers' logs (the rank Megatron gives them)."""
    import torch.distributed as dist
    from megatron.training import get_tensorboard_writer, get_wandb_writer
    from megatron.training.utils.common_utils import print_rank_0

    from .evaluation import report
    from .evaluation.harness import check_fits, evaluate
    from .evaluation.megatron_model import MegatronModel
    from .training.yaml_config import ConfigError

    model = MegatronModel(run_config)
    try:
        check_fits(plan, model.codec)
    except ValueError as err:
        raise ConfigError(f"bad value for --lengths: {err}") from None
    results = evaluate(
        plan, model, model.codec, model.pad, held_out, shard=model.shard, gather=model.gather, log=print_rank_0
    )
    results = {"meta": _meta(run_config, model, overrides), **results}
    if dist.get_rank() == 0:
        for path in report.write_report(results, cli.output or "evaluation"):
            print(f"[eval] wrote {path}")
        print(report.markdown(results))
    report.log_to_writers(results, model.iteration, get_tensorboard_writer(), get_wandb_writer())
    dist.barrier()
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()

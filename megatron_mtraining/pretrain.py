"""Training entry point: ``python -m megatron_mtraining.pretrain --config run.yaml [key=value ...]``.

Megatron-LM's own ``pretrain`` runs the job (arguments, initialisation, optimizer, schedules,
checkpointing, logging); the plugin contributes the model (its attention in Megatron's GPT),
the forward step and the context-parallel layout. The config file's ``megatron:`` section
holds Megatron arguments by their argparse dest, its ``attention:`` section the plugin's
attention (see ``megatron_mtraining.training.yaml_config``). Under ``torchrun`` every process
runs this module. Without CUDA it runs on the CPU over gloo. ``--dry-run`` validates the config
for the recipe's world size and prints the resolved arguments, the parallel layout and the
memory estimate, with no GPU and no training (``megatron_mtraining.training.dry_run``).
"""

from __future__ import annotations

import argparse
import sys


def _parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.pretrain",
        description="Train a Megatron GPT with the plugin's sparse attention.",
        epilog="Overrides: megatron.<dest>=value or attention.<field>[.<sub>]=value, values as YAML scalars.",
    )
    parser.add_argument(
        "--config",
        required=True,
        help="YAML file with 'megatron' and 'attention' sections, or the name of a recipe packaged with "
        "megatron_mtraining (e.g. qwen2.5-3b/512k.yaml) where no such file exists",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, print the resolved Megatron arguments, parallel layout and memory estimate; "
        "no GPU, no training",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --dry-run: ranks to validate for (default: cluster.nodes x cluster.gpus_per_node, else TP x PP x CP)",
    )
    parser.add_argument(
        "--step-report",
        metavar="PATH",
        help="write a JSON report of the run's steps (times, peak memory, one step's device time by part) to PATH",
    )
    parser.add_argument(
        "--profile-step",
        type=int,
        metavar="N",
        help="with --step-report: the iteration to profile (0-based; default the second to last)",
    )
    parser.add_argument(
        "--step-trace",
        metavar="PATH",
        help="with --step-report: also write the profiled step's trace to PATH (Chrome trace format, gzipped if PATH "
        "ends in .gz), to see in Perfetto or chrome://tracing which operator launched each kernel",
    )
    parser.add_argument(
        "--step-stacks",
        action="store_true",
        help="with --step-report: sample the profiled step's Python stacks and count its device syncs, so that "
        "each of its longest device-idle gaps names the innermost frame of this package the host was in, and the "
        "report sums host time and syncs by frame",
    )
    parser.add_argument(
        "--check-finite",
        action="store_true",
        help="stop at the first transformer layer whose output or input gradient is NaN or infinite, naming it and "
        "its attention type (debugging: one host synchronisation per layer and pass)",
    )
    cli = parser.parse_args(argv)
    given = (
        ("--profile-step", cli.profile_step),
        ("--step-trace", cli.step_trace),
        ("--step-stacks", cli.step_stacks or None),
    )
    for flag, value in given:
        if value is not None and cli.step_report is None:
            parser.error(f"{flag} is for --step-report")
    if cli.world_size is not None and not cli.dry_run:
        parser.error("--world-size is for --dry-run; a real run's world size is the launcher's")
    return cli


def main(argv: list[str] | None = None) -> None:
    cli = _parse_cli(sys.argv[1:] if argv is None else argv)
    from .configs import find
    from .training.yaml_config import ConfigError, explain_rejection, load_config

    try:
        config = find(cli.config)
    except FileNotFoundError as err:
        sys.exit(f"config error: {err}")
    try:
        if cli.dry_run:
            from .training.dry_run import dry_run

            print(dry_run(config, cli.overrides, cli.world_size)[0])
            return
        from .training.job import run

        run_config = load_config(config, cli.overrides)
        missing = run_config.missing_paths() or run_config.empty_splits()
        if missing:
            raise ConfigError("\n".join(missing))
        try:
            run(
                run_config,
                cli.step_report,
                cli.profile_step,
                check_finite=cli.check_finite,
                step_trace=cli.step_trace,
                step_stacks=cli.step_stacks,
            )
        except ConfigError as err:
            raise explain_rejection(err, run_config) from None
    except ConfigError as err:
        sys.exit(f"config error: {err}")


if __name__ == "__main__":
    main()

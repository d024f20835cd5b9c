"""Training entry point: ``python -m megatron_mtraining.pretrain --config run.yaml [key=value ...]``.

Megatron-LM's own ``pretrain`` runs the job (arguments, initialisation, optimizer, schedules,
checkpointing, logging); the plugin contributes the model (its attention in Megatron's GPT),
the forward step and the context-parallel layout. The config file's ``megatron:`` section
holds Megatron arguments by their argparse dest, its ``attention:`` section the plugin's
attention (see ``megatron_mtraining.megatron.yaml_config``). Under ``torchrun`` every process
runs this module. Without CUDA it runs on the CPU over gloo.
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
    parser.add_argument("--config", required=True, help="YAML file with 'megatron' and 'attention' sections")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    cli = _parse_cli(sys.argv[1:] if argv is None else argv)
    from .megatron.training import run
    from .megatron.yaml_config import ConfigError

    try:
        run(cli.config, cli.overrides)
    except ConfigError as err:
        sys.exit(f"config error: {err}")


if __name__ == "__main__":
    main()

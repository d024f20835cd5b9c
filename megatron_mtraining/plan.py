"""``python -m megatron_mtraining.plan --config <yaml> [key=value ...]``: predicted seconds per
step, tokens/s, MFU and memory per GPU of a run, for every attention type side by side, by
part, before renting the cluster (``megatron_mtraining/planning``).

``--search`` ranks the layouts that fit the config's cluster (or ``--nodes`` x
``--gpus-per-node`` of ``--gpu`` on ``--network``); ``--validate`` prints every recorded
measurement of the calibration tables against its prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def _parse(argv):
    from .planning.hardware import gpu_names, network_names
    from .planning.planner import TYPES
    from .planning.workload import PATTERN_SOURCES

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", help="run config (YAML) or a packaged recipe name, e.g. qwen2.5-3b/512k.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the config, as for pretrain")
    p.add_argument("--gpu", choices=gpu_names(), help="GPU type (default: the config's cluster.gpu)")
    p.add_argument(
        "--network",
        choices=network_names(),
        help="network across nodes (default: cluster.network, else the GPU's usual one)",
    )
    p.add_argument("--nodes", type=int, help="nodes (default: cluster.nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: cluster.gpus_per_node)")
    p.add_argument("--types", nargs="+", choices=TYPES, default=list(TYPES), help="attention types side by side")
    sources = sorted({s for v in PATTERN_SOURCES.values() for s in v})
    p.add_argument(
        "--pattern",
        nargs="+",
        choices=sources,
        default=[],
        help="synthetic pattern per type: mtraining diffuse (default: the budgets' caps filled, the most work) or "
        "natural (the kernel benchmark's index); msa structured (default, a trained indexer) or untrained",
    )
    p.add_argument("--search", action="store_true", help="rank the layouts that fit the cluster")
    p.add_argument("--top", type=int, default=10, help="candidates --search prints")
    p.add_argument("--validate", action="store_true", help="print every calibration figure, predicted against measured")
    p.add_argument("--refresh-workloads", action="store_true", help="recompute planning/calibration/workloads.json")
    cli = p.parse_args(argv)
    if not (cli.config or cli.validate or cli.refresh_workloads):
        p.error("--config is required (or --validate / --refresh-workloads)")
    if cli.search and not cli.config:
        p.error("--search needs --config")
    for name in ("nodes", "gpus_per_node", "top"):
        value = getattr(cli, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: not accepted (a positive integer)")
    return cli


def _cluster_overrides(cli) -> list[str]:
    out = []
    if cli.gpu:
        out.append(f"cluster.gpu={cli.gpu}")
    if cli.network:
        out.append(f"cluster.network={cli.network}")
    if cli.nodes:
        out.append(f"cluster.nodes={cli.nodes}")
    if cli.gpus_per_node:
        out.append(f"cluster.gpus_per_node={cli.gpus_per_node}")
    return out


def _search_report(ranked, too_big: int, run, own) -> str:
    from .planning.search import configured

    mine = configured(run)
    place = next(
        (i for i, r in enumerate(ranked, 1) if dataclasses.replace(r.candidate, stripe=mine.stripe) == mine), None
    )
    lines = [
        f"[plan] --search: {run.nodes} node(s) x {run.gpus_per_node} {run.gpu.name}, {run.network}; "
        f"{run.attention.type}; best first ({too_big} layouts left out: over the GPU's memory by the estimate)",
        f"  {'#':>3} {'layout':<66} {'s/step':>8} {'tokens/s':>10} {'MFU':>6} {'GiB':>6}",
    ]
    for i, r in enumerate(ranked, 1):
        s = r.step
        lines.append(
            f"  {i:>3} {r.candidate.label():<66} {s.step_s:8.2f} {s.tokens_per_s:10,.0f} {s.mfu:6.1%} {r.memory_gib:6.1f}"
            + (f"  refused by a real run: {r.valid}" if r.valid else "")
        )
    where = f"#{place} above" if place else f"not in the first {len(ranked)}"
    lines.append(f"  the config's own layout ({mine.label()}): {own.step_s:.2f} s/step, {where}")
    if ranked:
        lines.append("  overrides of the best: " + " ".join(ranked[0].candidate.overrides(run.layers)))
    return "\n".join(lines)


def main(argv=None) -> None:
    cli = _parse(sys.argv[1:] if argv is None else argv)
    from .planning import validation
    from .training.yaml_config import ConfigError

    if cli.refresh_workloads:
        import json
        from importlib import resources

        path = resources.files("megatron_mtraining.planning").joinpath("calibration", "workloads.json")
        path.write_text(json.dumps(validation.refresh_workloads(), indent=1) + "\n")
        print(f"[plan] wrote {path}")
    if cli.validate:
        print(validation.report(validation.all_checks()))
    if not cli.config:
        return
    from .configs import find
    from .planning.planner import plan_config
    from .planning.report import format_plan

    try:
        config = find(cli.config)
        overrides = [*cli.overrides, *_cluster_overrides(cli)]
        plan = plan_config(config, overrides, sources=cli.pattern, types=cli.types)
        print(format_plan(plan))
        if cli.search:
            from .planning.search import search

            own = plan.type_plan(plan.run.attention.type)
            if own.step is None:
                sys.exit(f"plan error: --search: the config's attention cannot run here: {own.reason}")
            own = own.step
            ranked, too_big = search(config, overrides, plan.args, own.run, cli.top)
            print(_search_report(ranked, too_big, own.run, own))
    except (ConfigError, FileNotFoundError, ValueError) as err:
        sys.exit(f"plan error: {err}")


if __name__ == "__main__":
    main()

"""Deterministic mode: the same training run twice per attention type, compared.

    python scripts/check_determinism.py [--types dense,mtraining,moba,msa] [--seq-length 8192] [--cp 2]

With ``--cp N`` each run is ``N`` processes under torchrun, one GPU each, with context
parallelism ``N`` (the recipe's layout and exchange), over NCCL.

Each type runs ``megatron_mtraining.pretrain`` (Megatron's loop, mock data, the recipe's
model shape cut to ``--num-layers``) ``--runs`` times with ``megatron.deterministic_mode=true``
(and Megatron's rule for it, ``cross_entropy_loss_fusion=false``). A run's record is, per
iteration, the LM loss as the plugin logs it (``repr`` of the fp32 value, so equal text is equal
bits) and Megatron's gradient norm; the later iterations' losses depend on every earlier
gradient bit. Prints a table and writes ``OUT/check_determinism.json``; exits 1 when any type's
runs differ.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training import _common  # noqa: E402 (the training bench's mock-data run)

from megatron_mtraining.examples.quickstart import pretrain_command  # noqa: E402

LOSS = re.compile(r"\[mtraining\] iteration\s+(\d+) \| lm_loss: (\S+)")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*grad norm: (\S+) \|")


def record(log: str) -> dict[int, tuple[str, str]]:
    """iteration -> (LM loss, gradient norm) as logged."""
    losses = {int(i): v for i, v in LOSS.findall(log)}
    norms = {int(i): v for i, v in GRAD_NORM.findall(log)}
    return {i: (losses[i], norms.get(i, "-")) for i in sorted(losses)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen2.5-3b/base.yaml")
    p.add_argument("--types", default="dense,mtraining,moba,msa")
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--timeout", type=int, default=150, help="seconds per run")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: processes (GPUs) per run")
    p.add_argument("--out", default="runs/check_determinism")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    args.recompute = "full"  # as the recipes run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, same = {}, True
    for kind in args.types.split(","):
        extra = {
            "msa": ["attention.msa.warmup_steps=1"],  # warmup, then sparse
            # The paper's 4096-token chunks select everything at 8K: a config error.
            "moba": [f"attention.moba.chunk_size={args.seq_length // 8}", "attention.moba.topk=3"],
        }.get(kind, [])
        command = pretrain_command(args.cp, args.config, [
            *_common(args, args.num_layers), f"attention.type={kind}", *extra,
            f"megatron.context_parallel_size={args.cp}",
            "megatron.deterministic_mode=true", "megatron.cross_entropy_loss_fusion=false"])  # fmt: skip
        runs = []
        for n in range(args.runs):
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            (out / f"{kind}_{n}.log").write_text(proc.stdout + proc.stderr)
            runs.append(record(proc.stdout + proc.stderr) if proc.returncode == 0 else {"rc": proc.returncode})
        equal = len(runs[0]) == args.iters and all(r == runs[0] for r in runs[1:])
        same &= equal
        results[kind] = {"equal": equal, "runs": [{str(i): v for i, v in r.items()} for r in runs]}
        print(f"{kind:<10} {'bitwise equal' if equal else 'DIFFERENT'}: {runs}")
    (out / "check_determinism.json").write_text(json.dumps({"command_args": vars(args), "types": results}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

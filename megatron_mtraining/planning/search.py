"""``--search``: the layouts of a run that fit its cluster, ranked by predicted throughput.

For the config's model, sequence, global batch and attention type on ``nodes x
gpus_per_node`` GPUs, every combination of tensor parallelism (dividing the KV heads and a
node; MSA takes TP 1), context parallelism (dividing the world, the rest data parallel),
K/V exchange (inside a node: all-gathered K/V or the ring; across nodes: the flat ring or a
hierarchical one of each inner size that fits a node), stripe, recomputation policy and
micro-batch size; those whose memory estimate (``training/memory.py``) fits the GPU are
predicted and ranked. The best are then validated as a real run is (``dry_run.resolve``:
Megatron's ``validate_args`` and the attention's checks) with the overrides printed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from ..training.memory import GIB, estimate_memory
from ..training.yaml_config import ConfigError, load_config
from . import calibration, model
from .runs import resolve_quietly

STRIPES = (128, 256, 512)
RECOMPUTE = ("full", "half", "mlp", "none")
MICRO_BATCHES = (1, 2)


@dataclass(frozen=True)
class Candidate:
    tp: int
    cp: int
    dp: int
    exchange: str  # allgather | ring | hierarchical
    inner: int | None
    stripe: int
    recompute: str
    micro_batch: int

    def label(self) -> str:
        ring = {"single": "no CP", "allgather": "all-gather", "ring": "flat ring"}.get(
            self.exchange, f"hierarchical {self.inner} x {self.cp // (self.inner or 1)}"
        )
        return f"TP {self.tp} CP {self.cp} DP {self.dp}, {ring}, stripe {self.stripe}, {self.recompute}, mb {self.micro_batch}"

    def overrides(self, layers: int) -> list[str]:
        """The config overrides that run this candidate."""
        out = [
            f"megatron.tensor_model_parallel_size={self.tp}",
            f"megatron.sequence_parallel={'true' if self.tp > 1 else 'false'}",
            f"megatron.context_parallel_size={self.cp}",
            f"megatron.micro_batch_size={self.micro_batch}",
            f"attention.stripe={self.stripe}",
            f"attention.kv_exchange={'allgather' if self.exchange == 'allgather' else ('ring' if self.exchange == 'ring' else 'auto')}",
        ]
        if self.inner:
            out += [
                f"attention.hierarchy={self.inner}",
                f"megatron.hierarchical_context_parallel_sizes=[{self.inner},{self.cp // self.inner}]",
            ]
        else:
            out += ["attention.hierarchy=null", "megatron.hierarchical_context_parallel_sizes=null"]
        out += {
            "full": ["megatron.recompute_granularity=full", "megatron.recompute_method=uniform", "megatron.recompute_num_layers=1"],
            "half": ["megatron.recompute_granularity=full", "megatron.recompute_method=block", f"megatron.recompute_num_layers={layers // 2}"],
            "mlp": ["megatron.recompute_granularity=selective", "megatron.recompute_modules=[mlp]", "megatron.recompute_method=null", "megatron.recompute_num_layers=null"],
            "none": ["megatron.recompute_granularity=null", "megatron.recompute_method=null", "megatron.recompute_num_layers=null"],
        }[self.recompute]  # fmt: skip
        return out


@dataclass
class Ranked:
    candidate: Candidate
    step: model.StepPrediction
    memory_gib: float
    valid: str = ""  # "" or why a real run would refuse it


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(run: model.Run, world: int, pattern: str):
    """Every layout of ``world`` GPUs for ``run``'s model and sequence (see the module docstring)."""
    block = run.attention.mtraining.block_size if pattern == "mtraining" else 128
    for tp in _divisors(run.gpus_per_node):
        if run.kv_heads % tp or run.heads % tp or world % tp or (pattern == "msa" and tp > 1):
            continue
        for cp in _divisors(world // tp):
            dp = world // (tp * cp)
            exchanges = [("single", None)] if cp == 1 else []
            if cp > 1 and cp * tp <= run.gpus_per_node:
                exchanges += [("allgather", None), ("ring", None)]
            elif cp > 1:
                exchanges.append(("ring", None))
                exchanges += [
                    ("hierarchical", g)
                    for g in _divisors(cp)
                    if 1 < g < cp and g * tp <= run.gpus_per_node and run.gpus_per_node % (g * tp) == 0
                ]
            for stripe in STRIPES if cp > 1 else (STRIPES[0],):
                if stripe % block or run.seq % (cp * stripe):
                    continue
                for exchange, inner in exchanges:
                    for recompute in RECOMPUTE:
                        for mb in MICRO_BATCHES:
                            if run.global_batch % (dp * mb):
                                continue
                            yield Candidate(tp, cp, dp, exchange, inner, stripe, recompute, mb)


def _candidate_args(args, cand: Candidate):
    changed = copy.copy(args)
    changed.tensor_model_parallel_size = cand.tp
    changed.sequence_parallel = cand.tp > 1
    changed.context_parallel_size = cand.cp
    changed.data_parallel_size = cand.dp
    changed.micro_batch_size = cand.micro_batch
    policy = {
        "full": ("full", "uniform", 1, None),
        "half": ("full", "block", args.num_layers // 2, None),
        "mlp": ("selective", None, None, ["mlp"]),
        "none": (None, None, None, None),
    }[cand.recompute]
    (changed.recompute_granularity, changed.recompute_method, changed.recompute_num_layers, modules) = policy
    changed.recompute_modules = modules
    return changed


def _candidate_run(run: model.Run, cand: Candidate, params: int) -> model.Run:
    attention = dataclasses.replace(
        run.attention,
        stripe=cand.stripe,
        hierarchy=cand.inner,
        kv_exchange={"allgather": "allgather", "ring": "ring"}.get(cand.exchange, "auto"),
    )
    recompute, recomputed = {"half": ("full", run.layers // 2)}.get(cand.recompute, (cand.recompute, None))
    return run.replace(
        tp=cand.tp, cp=cand.cp, dp=cand.dp, micro_batch=cand.micro_batch, sequence_parallel=cand.tp > 1,
        recompute=recompute, recomputed_layers=recomputed, attention=attention, params=params,
    )  # fmt: skip


def search(config, overrides, args, run: model.Run, top: int = 10, validate: int = 5) -> tuple[list[Ranked], int]:
    """The fitting candidates for the run of ``config`` with ``overrides`` (Megatron's
    ``args``, the cost model's ``run``) best first, and how many the memory estimate
    rejected; the first ``validate`` are checked as a real run would be."""
    from .planner import _attention_for

    c = calibration.fit()
    pattern = run.attention.type
    memory_gib = run.gpu.memory_gb * 1e9 / GIB
    ranked, too_big = [], 0
    world = run.nodes * run.gpus_per_node
    for cand in candidates(run, world, pattern):
        cand_args = _candidate_args(args, cand)
        attention = _candidate_run(run, cand, 0).attention
        estimate = estimate_memory(cand_args, attention, memory_gib, run.gpus_per_node)
        if not estimate.fits():
            too_big += 1
            continue
        cand_run = _candidate_run(run, cand, estimate.params.per_rank)
        ranked.append(Ranked(cand, model.predict_step(c, cand_run, pattern), estimate.total_gib))
    ranked.sort(key=lambda r: r.step.step_s)
    # The stripe rarely matters at these sizes: one row per layout, its best stripe.
    seen, best = set(), []
    for r in ranked:
        key = dataclasses.replace(r.candidate, stripe=0)
        if key not in seen:
            seen.add(key)
            best.append(r)
    ranked = best
    for r in ranked[:validate]:
        try:
            checked = load_config(config, [*overrides, *r.candidate.overrides(run.layers)])
            _attention_for(checked, resolve_quietly(checked), pattern)
        except (ConfigError, ValueError, AssertionError) as err:
            r.valid = str(err).splitlines()[0]
    return ranked[:top], too_big


def configured(run: model.Run) -> Candidate:
    """The candidate the config itself runs."""
    exchange = model.exchange_of(run)
    policy = run.recompute
    if run.recompute == "full" and run.recomputed_layers is not None:
        policy = "half" if run.recomputed_layers == run.layers // 2 else f"block {run.recomputed_layers}"
    inner = run.attention.hierarchy if exchange == "hierarchical" else None
    return Candidate(run.tp, run.cp, run.dp, exchange, inner, run.attention.stripe, policy, run.micro_batch)

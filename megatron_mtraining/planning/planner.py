"""A config's predicted step for every attention type side by side, with its memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..training.memory import GIB, MemoryEstimate, estimate_memory
from ..training.yaml_config import RunConfig, load_config
from . import calibration, model
from .runs import resolve_quietly, run_from_args

TYPES = ("dense", "mtraining", "msa", "moba")


@dataclass
class TypePlan:
    """One attention type's prediction (``None`` with ``reason`` where the run cannot take it)."""

    name: str  # the type, or "msa (warmup)"
    step: model.StepPrediction | None
    memory: MemoryEstimate | None
    reason: str = ""


@dataclass
class Plan:
    run_config: RunConfig
    run: model.Run
    types: list[TypePlan]
    args: object = None

    def type_plan(self, name: str) -> TypePlan:
        return next(t for t in self.types if t.name == name)


def _attention_for(run_config: RunConfig, args, name: str):
    """The config's attention with ``type=name``, checked against the model (MSA needs TP 1)."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    attention = dataclasses.replace(run_config.attention, type=name)
    attention.validate_for(core_transformer_config_from_args(args))
    return attention


def plan_run(run_config: RunConfig, args, gpu_name=None, network=None, sources=(), types=TYPES, constants=None) -> Plan:
    """Every type of ``types`` (the config's first) on the run of ``args`` (Megatron's
    validated arguments of ``run_config``)."""
    c = constants or calibration.fit()
    run = run_from_args(args, run_config, gpu_name, network, sources)
    memory_gib = run.gpu.memory_gb * 1e9 / GIB
    ordered = [run_config.attention.type] + [t for t in types if t != run_config.attention.type]
    plans = []
    for name in ordered:
        try:
            attention = _attention_for(run_config, args, name)
        except (ValueError, AssertionError) as err:
            plans.append(TypePlan(name, None, None, str(err)))
            continue
        typed = run.replace(attention=attention)
        memory = estimate_memory(args, attention, memory_gib, run.gpus_per_node)
        plans.append(TypePlan(name, model.predict_step(c, typed, name), memory))
        if name == "msa" and attention.msa.warmup_steps:
            plans.append(TypePlan("msa (warmup)", model.predict_step(c, typed, name, warmup=True), memory))
    return Plan(run_config, run, plans, args)


def plan_config(config, overrides=(), gpu_name=None, network=None, sources=(), types=TYPES) -> Plan:
    """:func:`plan_run` of a config file (or packaged recipe) with overrides."""
    run_config = load_config(config, list(overrides))
    args = resolve_quietly(run_config)
    return plan_run(run_config, args, gpu_name, network, sources, types)

"""What the callbacks Megatron's ``pretrain`` runs share within one training process: the
device it trains on, and the diagnostics :func:`~megatron_mtraining.training.job.run`
switched on (``--step-report``, ``--check-finite``). Megatron calls the callbacks with its own
arguments only, so these travel here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .step_report import StepReport


@dataclass
class RunState:
    step_report: StepReport | None = None  # the step timer and profile of --step-report
    check_finite: bool = False  # --check-finite


STATE = RunState()


def device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

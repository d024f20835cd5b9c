"""Profiler ranges that name the parts of a training step.

The core attention marks its index build and MSA's index branch and KL loss with them, and the
training program's step report (``megatron_mtraining.training.step_report``) sums a profiled
step's device time by them. They live in the adapter so that the attention does not depend on
the training program.
"""

from __future__ import annotations

import torch

PREFIX = "mtraining::"


def part_range(name: str):
    """A profiler range that names a part of the step (``PREFIX + name``)."""
    return torch.profiler.record_function(PREFIX + name)

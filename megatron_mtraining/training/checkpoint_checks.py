"""What a run checks of the checkpoint it resumes from, before Megatron loads it.

:func:`check_checkpoint` compares the checkpoint being loaded with this run: a changed
learning-rate schedule stops the run with a named error; an attention switch is logged and
Megatron's loader made to accept new MSA parameters.
"""

from __future__ import annotations

import copy
import os
import types
from typing import NamedTuple

from megatron.training.utils.common_utils import print_rank_0

from .. import patterns
from .megatron_args import ARGS_ATTRIBUTE, START_ATTRIBUTE, attention_from_args
from .yaml_config import ConfigError

# Megatron loader strictness modes that fail (or, for the default, crash) on model keys the
# checkpoint lacks; see megatron.core.dist_checkpointing.validation.StrictHandling.
_STRICT_ABOUT_NEW_KEYS = ("assume_ok_unexpected", "raise_unexpected", "raise_all")


def check_checkpoint(args) -> None:
    """Compares the checkpoint ``args.load`` names with this run: its learning-rate schedule
    (:func:`_check_schedule`) and its attention.

    A switch is logged, and MSA warmup counts from the iteration of the switch
    (``args.mtraining_attention_start``, saved with the arguments so a later resume keeps
    it). MSA's index projections exist only in MSA models, so across a switch to or from MSA
    the checkpoint's optimizer state does not fit: unless the run already sets ``finetune``
    or ``no_load_optim``, the optimizer starts fresh, as with Megatron's ``no_load_optim``
    (the iteration count and LR schedule continue). Towards MSA, Megatron's loader must also
    accept model keys the checkpoint lacks (``dist_ckpt_strictness``); the projections keep
    their fresh initialisation.
    """
    found = _read_checkpoint(args)
    if found is None:
        return
    _check_schedule(args, found.common.get("opt_param_scheduler"), found.release)
    saved, saved_start, iteration = found.attention, found.attention_start, found.iteration
    attention = attention_from_args(args)
    saved_type = saved.get("type", "dense")
    if saved_type == attention.type:
        setattr(args, START_ATTRIBUTE, saved_start)
    else:
        setattr(args, START_ATTRIBUTE, 0 if args.finetune else iteration)
    current = getattr(args, ARGS_ATTRIBUTE)
    changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if not changed:
        return
    what = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
    print_rank_0(
        f"[mtraining] attention switch on load from {args.load} (iteration {iteration}): {saved_type!r} -> "
        f"{attention.type!r}; changed settings: {what}"
    )
    # A pattern with an index branch has parameters (and optimizer state) others lack.
    branch, saved_branch = attention.pattern_class.has_index_branch, patterns.get(saved_type).has_index_branch
    if branch == saved_branch:
        return
    if branch and args.dist_ckpt_strictness in _STRICT_ABOUT_NEW_KEYS:
        print_rank_0(
            f"[mtraining] dist_ckpt_strictness {args.dist_ckpt_strictness!r} -> 'log_unexpected': the MSA index "
            "projections are not in the checkpoint and keep their fresh initialisation"
        )
        args.dist_ckpt_strictness = "log_unexpected"
    if not (args.finetune or args.no_load_optim):
        print_rank_0(
            "[mtraining] no_load_optim -> True: the checkpoint's optimizer state does not cover the MSA index "
            "projections; the optimizer starts fresh"
        )
        args.no_load_optim = True


def _check_schedule(args, saved: dict | None, release: bool) -> None:
    """A resume whose learning-rate or weight-decay schedule differs from the checkpoint's
    stops here, naming what differs and the two ways out: Megatron's scheduler asserts it
    only inside the checkpoint load, after every process has started. The comparison is
    Megatron's own, on a scheduler built as its training loop builds one."""
    from unittest import mock

    from megatron.training import training as megatron_training

    loads = not (release or args.finetune or args.no_load_optim)
    chooses = args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler
    if saved is None or not loads or chooses:
        return
    optimizer = types.SimpleNamespace(param_groups=[{}])
    with mock.patch.object(megatron_training, "get_args", lambda: copy.copy(args)):
        scheduler = megatron_training.get_optimizer_param_scheduler(optimizer)
    try:
        scheduler.load_state_dict(saved)
    except AssertionError as err:
        raise ConfigError(
            f"megatron.load={args.load!r}: this run's learning-rate schedule is not the checkpoint's ({err}; "
            "the schedule follows lr, min_lr, lr_decay_style, lr_decay_iters or train_iters, the warmup and the "
            "weight decay). Accepted: the checkpoint's settings, or megatron.use_checkpoint_opt_param_scheduler=true "
            "to continue the checkpoint's schedule, or megatron.override_opt_param_scheduler=true to take this run's"
        ) from None


class _Checkpoint(NamedTuple):
    attention: dict  # a checkpoint without the plugin's settings (plain Megatron) is dense
    attention_start: int  # the iteration that attention type started
    iteration: int
    release: bool
    common: dict  # the checkpoint's common (unsharded) state


def _read_checkpoint(args) -> _Checkpoint | None:
    """What a run needs to know of the checkpoint ``args.load`` names before loading it, or
    None when there is none."""
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename

    if not args.load or args.ckpt_format != "torch_dist":
        return None
    tracker = get_checkpoint_tracker_filename(args.load)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    release = text == "release"
    iteration = args.ckpt_step if args.ckpt_step is not None else (0 if release else int(text))
    name = get_checkpoint_name(args.load, iteration, release, return_base_dir=True)
    if not dist_checkpointing.check_is_distributed_checkpoint(name):
        return None
    common = dist_checkpointing.load_common_state_dict(name)
    saved_args = common.get("args")
    attention = dict(getattr(saved_args, ARGS_ATTRIBUTE, None) or {"type": "dense"})
    return _Checkpoint(attention, getattr(saved_args, START_ATTRIBUTE, 0), iteration, release, common)

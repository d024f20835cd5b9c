"""Indexes kept from a checkpointed forward for its recompute (``megatron/kept_indexes.py``);
the real recompute of an MSA layer is in ``megatron_workers.check_msa_kl_and_checkpoint``."""

from types import SimpleNamespace

import pytest
import torch

from megatron_mtraining.megatron.kept_indexes import KeptIndexes, recomputes_core_attention


class _Builds:
    """A builder returning a fresh object per call, counting its calls."""

    def __init__(self):
        self.made = []

    def __call__(self):
        self.made.append(object())
        return self.made[-1]


def _first_run(kept, make, key):
    with torch.no_grad():
        return kept.build(make, key, recomputed=True)


def test_the_recompute_takes_the_first_runs_index_in_order():
    kept, make = KeptIndexes(), _Builds()
    # Two micro-batches of one iteration: forwards, then their recomputes in the same order.
    first = [_first_run(kept, make, (3, "shape")) for _ in range(2)]
    assert [kept.build(make, (3, "shape"), recomputed=True) for _ in range(2)] == first
    assert len(make.made) == 2 and len(kept) == 0


def test_a_mismatched_key_builds_again_and_drops_the_queue():
    kept, make = KeptIndexes(), _Builds()
    _first_run(kept, make, (1, "a"))
    _first_run(kept, make, (1, "a"))
    index = kept.build(make, (1, "b"), recomputed=True)
    assert index is make.made[-1] and len(make.made) == 3 and len(kept) == 0


def test_an_earlier_iterations_leftovers_are_never_taken():
    kept, make = KeptIndexes(), _Builds()
    stale = _first_run(kept, make, (1, "a"))  # a forward whose backward never ran
    fresh = _first_run(kept, make, (2, "a"))
    assert len(kept) == 1
    taken = kept.build(make, (2, "a"), recomputed=True)
    assert taken is fresh and taken is not stale


@pytest.mark.parametrize("grad", [True, False])
def test_without_recompute_nothing_is_kept(grad):
    kept, make = KeptIndexes(), _Builds()
    with torch.set_grad_enabled(grad):
        kept.build(make, (1,), recomputed=False)
        kept.build(make, (1,), recomputed=False)
    assert len(make.made) == 2 and len(kept) == 0


@pytest.mark.parametrize(
    "granularity, modules, want",
    [("full", None, True), ("selective", ["core_attn"], True), ("selective", ["mlp"], False), (None, None, False)],
)
def test_which_configs_recompute_the_core_attention(granularity, modules, want):
    config = SimpleNamespace(recompute_granularity=granularity, recompute_modules=modules)
    assert recomputes_core_attention(config) is want

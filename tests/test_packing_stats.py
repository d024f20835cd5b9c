"""``scripts/packing_stats.py`` against a token-by-token count of the same packing."""

import importlib.util
import pathlib

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "packing_stats", pathlib.Path(__file__).parents[1] / "scripts" / "packing_stats.py"
)
packing_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(packing_stats)


def _brute_force(lengths, seq_length, window, seed):
    """The same figures from the token stream itself: one document id per token."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    doc = np.concatenate([np.full(lengths[i], i) for i in order])
    samples = len(doc) // seq_length
    cut = doc[: samples * seq_length].reshape(samples, seq_length)
    pieces = sum(len(np.unique(row)) for row in cut)
    last_positions = {}  # document -> (sample, position) of its last token, complete samples only
    for s, row in enumerate(cut):
        for p, d in enumerate(row):
            last_positions[d] = (s, p)
    whole = [d for d in last_positions if np.flatnonzero(doc == d)[-1] < samples * seq_length]
    in_window = np.mean([last_positions[d][1] >= seq_length - window for d in whole])
    held = np.mean([np.sum(row == row[-1]) / seq_length for row in cut])
    return pieces / samples, in_window, held


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_figures_equal_a_token_count(seed):
    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(1, 300, size=int(rng.integers(20, 60)))
    seq_length, window = int(rng.integers(64, 256)), int(rng.integers(1, 32))
    got = packing_stats.packing_statistics(lengths, seq_length, window, seed)
    pieces, in_window, held = _brute_force(lengths, seq_length, window, seed)
    assert got["samples"] == int(lengths.sum()) // seq_length
    assert got["pieces_per_sample"] == pytest.approx(pieces)
    assert got["documents_ending_in_window"] == pytest.approx(in_window)
    assert got["last_document_share_of_sample"] == pytest.approx(held)
    assert got["documents"] == len(lengths) and got["tokens"] == int(lengths.sum())


def test_too_few_tokens_for_a_sample():
    with pytest.raises(ValueError, match="make no sample of 100"):
        packing_stats.packing_statistics(np.array([10, 20]), 100, 8)

"""How packed a Megatron indexed dataset's samples are, as a window-built index sees them:
``python scripts/packing_stats.py PREFIX --seq-length 16384 [--window 64]``.

Megatron's GPT datasets concatenate the documents of an epoch in a shuffled order and cut the
stream into samples of ``seq_length`` tokens, so a document's end (a task's question and
answer, say) sits anywhere in a sample. MTraining's vertical-slash index is built from the
last ``window`` queries of the whole sample unless documents are masked
(``reset_attention_mask``: then from each document's own last window). This prints, for one
shuffled epoch (numpy, ``--seed``): the documents' lengths, the document pieces per sample,
the share of documents whose last token falls in a sample's last ``window`` positions, and
the share of a sample's tokens that belong to the document holding its last token. With
``--out`` it also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def packing_statistics(lengths: np.ndarray, seq_length: int, window: int, seed: int = 0) -> dict:
    """The figures above for documents of ``lengths`` tokens packed in one shuffled order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(lengths))
    ends = np.cumsum(lengths[order])  # exclusive end of each document in the token stream
    starts = ends - lengths[order]
    samples = int(ends[-1] // seq_length)
    if samples == 0:
        raise ValueError(f"{int(ends[-1])} tokens make no sample of {seq_length}")
    last = ends - 1
    whole = last < samples * seq_length  # documents ending inside a complete sample
    in_window = (last % seq_length) >= seq_length - window
    pieces = np.minimum(last, samples * seq_length - 1) // seq_length - starts // seq_length + 1
    sample_ends = (np.arange(samples) + 1) * seq_length - 1
    holder = np.searchsorted(ends, sample_ends, side="right")  # the document holding each sample's last token
    held = (sample_ends + 1 - np.maximum(starts[holder], sample_ends + 1 - seq_length)) / seq_length
    return {
        "documents": int(len(lengths)),
        "tokens": int(lengths.sum()),
        "mean_length": float(lengths.mean()),
        "median_length": float(np.median(lengths)),
        "samples": samples,
        "pieces_per_sample": float(pieces[starts < samples * seq_length].sum() / samples),
        "documents_ending_in_window": float(in_window[whole].mean()),
        "last_document_share_of_sample": float(held.mean()),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="indexed dataset prefix (PREFIX.bin / PREFIX.idx)")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--window", type=int, default=64, help="observation window in queries (MTraining's last_q)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document order")
    p.add_argument("--out", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.seq_length < 1 or not 1 <= args.window <= args.seq_length:
        sys.exit(f"--seq-length {args.seq_length} / --window {args.window}: need 1 <= window <= seq-length")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(args.prefix)
    # A copy: the lengths are a view of the dataset's memory map, closed with the dataset.
    lengths = np.array(dataset.sequence_lengths, dtype=np.int64)
    stats = packing_statistics(lengths, args.seq_length, args.window, args.seed)
    stats.update(prefix=args.prefix, seq_length=args.seq_length, window=args.window, seed=args.seed)
    for key, value in stats.items():
        print(f"{key:32} {value:.4g}" if isinstance(value, float) else f"{key:32} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(stats, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Shared by the evaluation and study tests: a tiny byte-level BPE whose merges cover the task
texts, so every task fits in a few hundred tokens, and a command runner."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from megatron_mtraining.data import generate_documents, load_tokenizer, train_tiny_tokenizer
from megatron_mtraining.evaluation.tasks import TASKS, Codec, make_sample

# Bytes as tokens, to write task texts before any tokenizer exists.
BYTES = Codec(lambda text: list(text.encode()), lambda ids: bytes(ids).decode())


def train_task_tokenizer(out_dir: Path) -> Path:
    texts = [doc.text for doc in generate_documents(12, 3000, seed=0)]
    texts += [BYTES.decode(make_sample(task, 1500, 0.5, 99, i, BYTES).ids()) for task in TASKS for i in range(3)]
    return train_tiny_tokenizer(texts, out_dir)


def codec_of(path: Path) -> tuple[Codec, int]:
    """The tokenizer at ``path`` as a codec (no special tokens, as Megatron's tokenize), and its EOD id."""
    tokenizer = load_tokenizer(path)
    codec = Codec(
        lambda text: tokenizer.encode(text, add_special_tokens=False), lambda ids: tokenizer.decode(list(ids))
    )
    return codec, tokenizer.eos_token_id


def run_command(cmd: list[str], cwd: Path) -> str:
    """The output of ``cmd`` run in ``cwd`` on one thread per process; fails with its end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output[-6000:]}"
    return output

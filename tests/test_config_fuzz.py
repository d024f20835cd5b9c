"""Hostile configs and overrides: each is rejected before any process group starts, with a
message naming the key, the value and what is accepted, and no Python traceback.

The cases run in-process through what the entry point calls: ``dry_run`` for ``--dry-run``
(which shares ``load_config`` and Megatron's ``validate_args`` with a real run), and
``pretrain.main`` for the checks only a real run makes (paths on this machine), with the
training itself replaced by a failure so that reaching it fails the test. One subprocess
shows what reaches the console.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_mtraining import pretrain
from megatron_mtraining.training import job
from megatron_mtraining.training.dry_run import dry_run
from megatron_mtraining.training.yaml_config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"

# (overrides of the tiny config, what the message must say is accepted). The tiny config
# has 4 heads in 2 query groups, hidden 64, sequence 256, mtraining blocks of 16, MSA blocks
# of 16 with top-4, MoBA chunks of 16 with top-3, striped layout with stripes of 16.
BAD_OVERRIDES = [
    # Out of range where Megatron's parser takes any number: a division by zero in the
    # model's init or the loss, a run that trains nothing, or a bare assertion.
    (["megatron.num_layers=0"], r"a positive integer"),
    (["megatron.vocab_size=-1"], r"a positive integer"),
    (["megatron.seq_length=0"], r"a positive integer"),
    (["megatron.hidden_size=-64"], r"a positive integer"),
    (["megatron.train_iters=-5"], r"a positive integer"),
    (["megatron.micro_batch_size=0"], r"a positive integer"),
    (["megatron.global_batch_size=0"], r"a positive integer"),
    (["megatron.save_interval=0"], r"a positive integer"),
    (["megatron.log_interval=0"], r"a positive integer"),
    (["megatron.context_parallel_size=-2"], r"a positive integer"),
    (["megatron.rotary_base=0"], r"a positive integer"),
    (["megatron.lr=-1.0"], r"a finite number >= 0"),
    (["megatron.lr=.nan"], r"a finite number >= 0"),
    (["megatron.lr=.inf"], r"a finite number >= 0"),
    (["megatron.weight_decay=-0.1"], r"a finite number >= 0"),
    (["megatron.seed=-1"], r"an integer >= 0"),
    (["megatron.hidden_dropout=2.0"], r"a probability in \[0, 1\]"),
    (["megatron.rotary_percent=0"], r"a fraction in \(0, 1\]"),
    # Wrong types and shapes of values.
    (["megatron.num_layers=1.5"], r"invalid int value"),
    (["megatron.num_layers=[1,2]"], r"takes one value, not the list"),
    (["megatron.lr=fast"], r"invalid float value"),
    (["megatron.bf16=3"], r"is a flag: give true or false"),
    (["megatron.normalization=BadNorm"], r"choose from 'LayerNorm', 'RMSNorm'"),
    # Combinations Megatron asserts without a message: the condition and the values.
    (["megatron.hidden_size=66"], r"args\.hidden_size % args\.num_attention_heads == 0 must hold"),
    (["megatron.hierarchical_context_parallel_sizes=[1,2]"], r"prod\(args\.hierarchical_context_parallel_sizes\)"),
    # Combinations Megatron lets through and the model or the data loader trips on.
    (["megatron.num_query_groups=3"], r"a divisor of megatron\.num_attention_heads \(4\)"),
    (["megatron.num_attention_heads=3"], r"a divisor of megatron\.num_attention_heads \(3\)"),
    (["megatron.mock_data=false"], r"megatron\.data_path=\[prefix, \.\.\.\] of indexed datasets, or mock_data"),
    (["megatron.max_position_embeddings=128"], r"must be greater than or equal to seq_length"),
    # The attention against the sequence: a layout that cannot split it, patterns that
    # would attend everything (dense attention under a sparse name).
    (
        ["megatron.context_parallel_size=2", "attention.stripe=24"],
        r"stripe=24 .*a divisor of seq_length / context_parallel_size = 256 / 2 = 128: 1, 2, 4, 8, 16, 32, 64, 128",
    ),
    (["megatron.context_parallel_size=3"], r"cannot be split .* a multiple of stripe x cp_size \(16 x 3 = 48\)"),
    # Stripes that are not whole tiles of the ring's kernels: every step on the reference path.
    (
        ["megatron.context_parallel_size=2", "attention.stripe=8"],
        r"stripe=8 .*a multiple of 16 for type 'mtraining' \(mtraining\.block_size = 16\) under context parallelism",
    ),
    (
        ["megatron.context_parallel_size=2", "attention.type=dense", "attention.stripe=8"],
        r"stripe=8 .*a multiple of 16 for type 'dense' under context parallelism: .* tiles of 128, 64, 32, 16 tokens",
    ),
    (["attention.mtraining.block_size=512"], r"block_size=512 .*a power of two below seq_length \(256\)"),
    (["attention.type=msa", "attention.msa.topk=100"], r"topk=100 .*at most 15: .* 256 / 16 gives 16 blocks"),
    (["attention.type=moba", "attention.moba.topk=16"], r"topk=16 .*at most 15: .* 256 / 16 gives 16 blocks"),
    (["attention.type=msa", "megatron.tensor_model_parallel_size=2"], r"1 for type 'msa'"),
    # The attention settings themselves.
    (["attention.type=sparse"], r"one of dense, moba, msa, mtraining"),
    (["attention.stripe=0"], r"an integer >= 1"),
    (["attention.layout=zig"], r"one of contiguous, zigzag, striped"),
    (["attention.mtraining.block_size=24"], r"a power of two >= 16"),
    (["attention.mtraining.vertical_topp=1.5"], r"a number in \(0, 1\]"),
    (["attention.msa.bogus=1"], r"one of the MSAConfig fields"),
    (["attention.backend=cuda"], r"'reference', 'triton', 'flash_attn', 'sdpa', 'varlen_blocks'"),
    (["cluster.nodes=-1"], r"a positive integer"),
    (["cluster.gpu=V100"], r"accepted: A100-40GB"),
]


def quiet_dry_run(path, overrides=(), world_size=None):
    with contextlib.redirect_stdout(io.StringIO()):
        return dry_run(path, overrides, world_size)


@pytest.mark.parametrize(
    ("overrides", "accepted"), BAD_OVERRIDES, ids=lambda o: " ".join(o) if isinstance(o, list) else ""
)
def test_bad_override_is_rejected_naming_key_value_and_accepted(overrides, accepted):
    with pytest.raises(ConfigError, match=accepted) as err:
        quiet_dry_run(TINY, overrides)
    # The override that breaks the config is named, and the error itself names its key's
    # last part and its value.
    where = f"override {overrides[-1]!r}"
    assert where in str(err.value), err.value
    error = str(err.value).replace(where, "")
    key, _, raw = overrides[-1].partition("=")
    assert key.rsplit(".", 1)[-1] in error, err.value
    assert raw in error or repr(yaml.safe_load(raw)).strip("'") in error, err.value


BAD_FILES = [
    (b"megatron:\n  num_layers: 2 # caf\xe9\n", r"byte 0xe9 at offset 31 is not UTF-8 \(accepted: a UTF-8 text file\)"),
    (b"", r"the config is empty \(expected the sections megatron, attention, cluster\)"),
    (b"megatron:\n  num_layers: 2\n  num_layers: 3\n", r"(?s)found duplicate key 'num_layers'.*line 3, column 3"),
    (b"attention: {type: msa, type: dense}\n", r"found duplicate key 'type'"),
    (b"megatron: [1, 2]\n", r"section 'megatron' must be a mapping, not list"),
    (b"- megatron\n", r"expected a mapping with the sections"),
    (b"megatron: {num_layers: 2\n", r"cannot read the config"),
    (b"megatron: {num_layers: 2}\nmodel: {}\n", r"unknown section 'model' \(accepted: base, megatron"),
    (b"megatron: {seq_lenght: 4}\n", r"unknown Megatron argument 'megatron.seq_lenght'"),
]


@pytest.mark.parametrize(("content", "message"), BAD_FILES)
def test_bad_file_is_rejected_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as err:
        quiet_dry_run(path)
    assert str(path) in str(err.value)


def test_world_size_must_be_positive():
    for world_size in (0, -4):
        with pytest.raises(ConfigError, match=rf"--world-size {world_size}: .*accepted: a positive integer"):
            quiet_dry_run(TINY, (), world_size)


@pytest.fixture
def no_training(monkeypatch):
    """The real run's entry point, with the training replaced by a failure: a case that
    reaches it was not rejected before the process group."""

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(job, "run", started)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["megatron.mock_data=false", "megatron.data_path=[0.5, /nonexistent/a, 0.5, /nonexistent/b]"],
            r"names '/nonexistent/a', but /nonexistent/a\.bin / /nonexistent/a\.idx do not exist.*\n.*/nonexistent/b",
        ),
        (["megatron.load=/nonexistent/ckpt"], r"'megatron.load' names '/nonexistent/ckpt', which does not exist"),
        (
            ["megatron.save_interval=3", "megatron.save=/nonexistent/other", "megatron.load=/nonexistent/ckpt"],
            r"the directory of megatron.save \(now '/nonexistent/other'\)",
        ),
    ],
)
def test_real_run_rejects_missing_paths_before_starting(no_training, overrides, message):
    with pytest.raises(SystemExit) as err:
        pretrain.main(["--config", str(TINY), *overrides])
    assert str(err.value).startswith("config error: override ")
    assert re.search(message, str(err.value)), err.value
    # A dry run checks the recipe for another machine: it lists these paths and passes.
    report, _ = quiet_dry_run(TINY, overrides)
    assert "[mtraining] not on this machine: override " in report


def test_load_may_be_the_save_directory_not_created_yet(tmp_path):
    # A job that saves and resumes in one directory starts from scratch the first time.
    ckpt = tmp_path / "ckpt"
    config = load_config(TINY, [f"megatron.load={ckpt}", f"megatron.save={ckpt}/."])
    assert config.missing_paths() == []


def test_console_shows_the_message_and_no_traceback(tmp_path):
    # A real run (no --dry-run) of a combination only Megatron's validate_args rejects, with
    # a bare assertion: one line naming the values, and no process group.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatron_mtraining.pretrain", "--config", str(TINY), "megatron.hidden_size=66"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "initializing torch distributed" not in output, output[-3000:]
    assert (
        "config error: " in output
        and "args.hidden_size % args.num_attention_heads == 0 must hold (megatron.hidden_size=66 from override "
        "'megatron.hidden_size=66'; megatron.num_attention_heads=4 from "
        in output
    ), output[-3000:]

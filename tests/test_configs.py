"""The configs in ``configs/``, ``--dry-run`` and the memory estimate.

Every config passes ``--dry-run`` (in-process: the YAML checks, Megatron's ``validate_args`` for
the recipe's world size, the attention against the ``TransformerConfig``) and every recipe's
estimate fits its GPU. The estimate's parameter count equals a real ``GPTModel`` built by the
entry point's model provider, whole (TP 1) and per rank (TP 2); its activations scale
linearly with the local sequence and reduce to Korthikanti et al.'s count; the loss's memory
follows the loss path (fused at TP 1, chunked Megatron cross entropy otherwise).
"""

from __future__ import annotations

import contextlib
import io
import types
from pathlib import Path

import gloo
import pytest

from megatron_mtraining import pretrain
from megatron_mtraining.training.dry_run import dry_run, resolve
from megatron_mtraining.training.memory import estimate_memory, layer_activation_bytes
from megatron_mtraining.training.yaml_config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL = sorted(p for p in CONFIGS.rglob("*.yaml") if "data" not in p.relative_to(CONFIGS).parts)
# Recipes: the stage files of each model directory (its base.yaml only shares settings).
RECIPES = [p for p in ALL if p.parent != CONFIGS and p.name != "base.yaml"]
TINY = CONFIGS / "tiny_cpu.yaml"
# A model that Megatron can build on a CPU in a test process.
BUILDABLE = ["megatron.use_cpu_initialization=true", "megatron.gradient_accumulation_fusion=false"]


def quiet_dry_run(path, overrides=(), world_size=None):
    with contextlib.redirect_stdout(io.StringIO()):
        return dry_run(path, overrides, world_size)


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_dry_runs(path):
    report, estimate = quiet_dry_run(path)
    print(report.split("[mtraining] parallel layout")[1])
    assert "parallel layout: world" in report and "memory estimate per GPU" in report
    if path in RECIPES:
        assert estimate.gpu_memory_gib is not None, f"{path}: a recipe names its GPU (cluster.gpu)"
        assert estimate.fits(), f"{path}: {estimate.total_gib:.1f} GiB > {estimate.gpu_memory_gib:.1f} GiB"


def test_recipes_cover_the_stages():
    names = {str(p.relative_to(CONFIGS)) for p in RECIPES}
    for stage in ("64k", "128k", "256k", "512k", "512k_h100"):
        assert f"qwen2.5-3b/{stage}.yaml" in names
    for model in ("qwen2.5-7b", "llama-3.1-8b", "llama-3.2-3b"):
        assert {f"{model}/{s}.yaml" for s in ("128k", "512k", "128k_h100", "512k_h100")} <= names


def test_qwen_512k_is_the_mtraining_setting(capsys):
    pretrain.main(["--config", str(CONFIGS / "qwen2.5-3b/512k.yaml"), "--dry-run"])
    out = capsys.readouterr().out
    assert "world 32 = TP 1 x PP 1 x CP 32 x DP 1" in out
    assert "hierarchical ring: 8 inner x 4 outer" in out and "4 node(s) x 8 GPUs per node, A100-40GB" in out
    assert "524288 tokens, 16384 per CP rank" in out and "fits" in out
    # --world-size wins over the recipe's cluster: twice the GPUs is data parallelism 2.
    pretrain.main(["--config", str(CONFIGS / "qwen2.5-3b/512k.yaml"), "--dry-run", "--world-size", "64"])
    assert "world 64 = TP 1 x PP 1 x CP 32 x DP 2" in capsys.readouterr().out


def test_config_names_a_packaged_recipe_where_no_such_file_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    pretrain.main(["--config", "qwen2.5-3b/512k.yaml", "--dry-run"])
    assert f"dry run of {CONFIGS / 'qwen2.5-3b/512k.yaml'}: valid" in capsys.readouterr().out
    # A file of that name where the command runs wins over the packaged recipe.
    (tmp_path / "tiny_cpu.yaml").write_text(TINY.read_text())
    pretrain.main(["--config", "tiny_cpu.yaml", "--dry-run"])
    assert "dry run of tiny_cpu.yaml: valid" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        pretrain.main(["--config", "qwen2.5-3b/1m.yaml", "--dry-run"])
    message = str(err.value)
    assert message.startswith("config error: --config='qwen2.5-3b/1m.yaml': no such file, and no recipe of that name")
    assert "accepted: the path of a YAML run config, or a packaged recipe: " in message
    assert "qwen2.5-3b/512k.yaml" in message and "synthetic_mix" not in message


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("base: nothere.yaml\n", [], r"bad\.yaml: base file: cannot read the config .*nothere\.yaml"),
        ("base: bad.yaml\n", [], r"'base' includes form a cycle"),
        ("base: [a]\n", [], r"'base' must be a file path"),
        ("cluster: {gpu: V100}\n", [], r"bad value for 'cluster.gpu': 'V100'"),
        ("cluster: {nodez: 2}\n", [], r"unknown key 'cluster.nodez'"),
        ("cluster: {nodes: 0}\n", [], r"bad value for 'cluster.nodes': 0"),
        ("megatron: {seq_lenght: 4}\n", [], r"unknown Megatron argument 'megatron.seq_lenght'"),
        ("attention: {hierarchy: 3}\n", ["megatron.context_parallel_size=4"], r"hierarchy.*divisor"),
        ("attention: {type: msa}\n", ["megatron.tensor_model_parallel_size=2"], r"tensor_model_parallel_size=2"),
        ("megatron: {num_layers: 3}\n", ["megatron.pipeline_model_parallel_size=2"], r"Megatron rejected"),
        ("megatron: {vocab_size: null}\n", [], r"needs megatron.padded_vocab_size"),
        (
            "cluster: {nodes: 2, gpus_per_node: 2}\n",
            [
                "megatron.context_parallel_size=4",
                "megatron.hierarchical_context_parallel_sizes=[4,1]",
                "attention.hierarchy=4",
            ],
            r"does not divide",
        ),
    ],
)
def test_bad_dry_run_names_key_and_file(tmp_path, capsys, text, overrides, message):
    # Each bad file builds on the tiny config, so only the bad key is wrong.
    tiny = _write(tmp_path, "tiny.yaml", TINY.read_text())
    text = text if text.startswith("base:") else f"base: {tiny.name}\n{text}"
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(SystemExit) as err:
        pretrain.main(["--config", str(path), *overrides, "--dry-run"])
    assert str(err.value).startswith("config error: ")
    assert str(path) in str(err.value) or any(o in str(err.value) for o in overrides)
    with pytest.raises(ConfigError, match=message):
        quiet_dry_run(path, overrides)


def test_base_include_merges_and_names_sources(tmp_path):
    tiny = _write(tmp_path, "tiny.yaml", TINY.read_text())
    path = _write(
        tmp_path, "stage.yaml", f"base: {tiny.name}\nmegatron: {{seq_length: 128}}\nattention: {{msa: {{topk: 2}}}}\n"
    )
    config = load_config(path)
    assert config.megatron["seq_length"] == 128 and config.megatron["num_layers"] == 2
    assert config.attention.msa.topk == 2 and config.attention.msa.block_size == 16  # merged one level deep
    assert config.sources["megatron.seq_length"] == str(path) and config.sources["megatron.num_layers"] == str(tiny)


def test_activations_scale_with_the_local_sequence():
    args = resolve(load_config(CONFIGS / "qwen2.5-3b/512k_h100.yaml"))
    attention = load_config(CONFIGS / "qwen2.5-3b/512k_h100.yaml").attention
    one = layer_activation_bytes(args, 8192)
    assert layer_activation_bytes(args, 16384) == pytest.approx(2 * one)
    # The whole estimate's activations, for each recompute mode: halving CP doubles the local
    # sequence and the activations (the attention's index state excepted, which is global).
    block = {"recompute_method": "block", "recompute_num_layers": 18}  # half the layers kept
    for mode in (block, {"recompute_granularity": None}, {"recompute_granularity": "selective"}):
        parts = []
        for cp in (32, 16):
            changed = vars(args) | mode | {"context_parallel_size": cp, "data_parallel_size": 32 // cp}
            est = estimate_memory(type(args)(**changed), attention)
            parts.append(next(v for k, v in est.parts.items() if k.startswith("activations")))
        assert parts[1] == pytest.approx(2 * parts[0], rel=1e-3), mode


def test_loss_memory_follows_the_loss_path():
    # Qwen2.5-3B at 16384 tokens per GPU (bf16, vocabulary 151936, hidden 2048).
    path = CONFIGS / "qwen2.5-3b/512k.yaml"
    args, attention = resolve(load_config(path)), load_config(path).attention
    tokens, vocab, hidden = 16384, 151936, 2048
    assert (args.seq_length // args.context_parallel_size, args.padded_vocab_size) == (tokens, vocab)
    # TP 1: the fused loss keeps the hidden-state gradient (bf16), the weight gradient (fp32)
    # and per token a loss, a mask and a label, plus the larger of one chunk's bf16 logits
    # (2**30 // vocab = 7067 rows, with an fp32 LSE each) and the weight gradient's bf16 copy.
    kept = tokens * (2 * hidden + 16) + 4 * vocab * hidden
    fused = kept + max(7067 * (2 * vocab + 4), 2 * vocab * hidden)
    assert estimate_memory(args, attention).parts["logits + loss"] == fused
    # TP 2: Megatron's output layer and cross entropy on 3533-row chunks of half the vocabulary,
    # 10 bytes per logit.
    tp2 = type(args)(**(vars(args) | {"tensor_model_parallel_size": 2}))
    assert estimate_memory(tp2, attention).parts["logits + loss"] == 3533 * (vocab // 2) * 10


def test_node_gather_keeps_the_whole_sequences_kv_and_the_planner_refuses_it():
    """K/V gathered inside nodes: the estimate adds the whole sequence's K/V in bf16 and two
    outer steps' node-chunk gradients in fp32; the planner, which has no model of it, names
    the option."""
    from megatron_mtraining.planning import model

    path = CONFIGS / "qwen2.5-3b/512k.yaml"
    config = load_config(path, ["attention.kv_exchange=allgather"])
    args, attention = resolve(config), config.attention
    assert attention.hierarchy and attention.hierarchy < args.context_parallel_size
    seq, nodes = args.seq_length, args.context_parallel_size // attention.hierarchy
    per_token = 2 * args.num_query_groups * args.kv_channels  # K and V, micro-batch 1
    parts = estimate_memory(args, attention).parts
    assert parts["node-gathered K/V (whole sequence kept)"] == per_token * (2 * seq + 2 * 4 * seq // nodes)
    ring = load_config(path)
    assert not any("gathered" in k for k in estimate_memory(resolve(ring), ring.attention).parts)
    run = types.SimpleNamespace(attention=attention, cp=args.context_parallel_size, tp=1, gpus_per_node=8)
    with pytest.raises(ValueError, match=r"attention.kv_exchange='allgather'.*does not model K/V gathered inside"):
        model.exchange_of(run)


def test_activations_reduce_to_korthikanti():
    # A GPT-3 style layer (MHA, 4h GeLU MLP, TP 1): Korthikanti et al.'s 34 s b h without their
    # two sb h dropout masks and the 5 a s^2 b softmax terms, plus the flash-style fp32 LSE.
    args = resolve(
        load_config(TINY, ["megatron.swiglu=false", "megatron.num_query_groups=4", "megatron.ffn_hidden_size=256"])
    )
    s, b, h, a = args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads
    assert layer_activation_bytes(args, s) == (34 - 2) * s * b * h + 4 * s * b * a


PARAMETER_CASES = [
    [],  # untied, no bias (Llama-style)
    ["megatron.untie_embeddings_and_output_weights=false", "megatron.add_qkv_bias=true"],  # Qwen2.5-3B-style
    ["attention.type=msa"],  # the index branch
    ["megatron.swiglu=false", "megatron.add_bias_linear=true", "megatron.normalization=LayerNorm"],
]


def _check_parameter_count(rank, world):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.training import global_vars

    from megatron_mtraining.patches import apply_cpu_patches
    from megatron_mtraining.training.forward_step import model_provider
    from megatron_mtraining.training.memory import count_parameters

    apply_cpu_patches()
    cases = [(1, c) for c in PARAMETER_CASES] + [(2, PARAMETER_CASES[0]), (2, PARAMETER_CASES[1])]
    for tp, overrides in cases:
        if tp > world:
            continue
        config = load_config(TINY, [*BUILDABLE, f"megatron.tensor_model_parallel_size={tp}", *overrides])
        args = resolve(config, world_size=tp)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        # Counted from vocab_size (127, padded as Megatron pads it), before the tokenizer's
        # padded size that the model provider reads is set.
        count = count_parameters(args, config.attention)
        args.padded_vocab_size = 128
        global_vars._GLOBAL_ARGS = args
        model = model_provider()
        local = sum(p.numel() for p in model.parameters())
        assert count.per_rank == local, (overrides, count, local)
        if tp == 1:
            assert count.total == local, (overrides, count, local)
    parallel_state.destroy_model_parallel()


def test_parameter_count_equals_gptmodel():
    gloo.run(2, _check_parameter_count)


@pytest.mark.parametrize("flag", [["--profile-step", "3"], ["--step-trace", "t.json.gz"], ["--step-stacks"]])
def test_step_report_options_need_a_step_report(flag, capsys):
    """The options of the step report are refused without ``--step-report``, naming the option."""
    with pytest.raises(SystemExit):
        pretrain.main(["--config", str(TINY), *flag])
    assert f"{flag[0]} is for --step-report" in capsys.readouterr().err
    assert pretrain._parse_cli(["--config", str(TINY), "--step-report", "r.json", *flag]).step_report == "r.json"

"""Hugging Face <-> Megatron checkpoint conversion (``megatron_mtraining.convert``).

Tiny random-initialised Hugging Face models (Qwen2 with q/k/v biases and tied embeddings;
Llama untied, GQA 4:2, YaRN) are saved with ``save_pretrained`` and converted. Checked: the
Megatron model's fp32 logits equal Hugging Face's within 1e-5 (dense attention, CP 1); export
reproduces the original safetensors bit for bit and a config Hugging Face loads with the same
YaRN; the Megatron checkpoint reloads in-process and loads in the training entry point, whose
own checkpoint (after a zero-learning-rate step) exports back to the original weights; bad
configs fail naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron_mtraining.convert import (  # noqa: E402
    ConversionError,
    build_megatron_model,
    export_hf,
    import_hf,
    load_hf_weights,
    load_megatron_checkpoint,
    megatron_transformer_config,
    read_hf_checkpoint,
    save_megatron_checkpoint,
    spec_from_hf_config,
)
from megatron_mtraining.convert.hf_import import single_process_megatron  # noqa: E402
from megatron_mtraining.megatron import MTrainingAttentionConfig  # noqa: E402

SEQ, VOCAB = 192, 128
# Larger than HF's 0.02 so that attention and RoPE visibly shape the logits.
INIT_STD = 0.2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
MODELS = {
    "qwen2": lambda **kw: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **{**COMMON, "tie_word_embeddings": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6, **kw}
        )
    ),
    "llama": lambda **kw: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **{
                **COMMON,
                "tie_word_embeddings": False,
                "rope_theta": 1e4,
                "rms_norm_eps": 1e-5,
                "rope_scaling": YARN,
                **kw,
            }
        )
    ),
}


@pytest.fixture(scope="module")
def megatron_state():
    with single_process_megatron():
        yield


def save_hf(kind: str, directory: Path, **config) -> Path:
    torch.manual_seed(0)
    model = MODELS[kind](**config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, INIT_STD)
    model.save_pretrained(directory)
    return directory


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(file))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_logits_match_and_round_trip_is_exact(kind, tmp_path, megatron_state):
    hf_dir = save_hf(kind, tmp_path / "hf")
    model, spec = import_hf(hf_dir)
    assert spec.qkv_bias == (kind == "qwen2") and spec.tied_embeddings == (kind == "qwen2")
    assert (spec.yarn is not None) == (kind == "llama")
    x = tokens()
    reference = hf_logits(hf_dir, x)
    logits = megatron_logits(model, x)
    assert (logits - reference).abs().max().item() < 1e-5

    save_megatron_checkpoint(model, spec, tmp_path / "megatron")
    reloaded, reloaded_spec = load_megatron_checkpoint(tmp_path / "megatron")
    assert reloaded_spec == spec
    assert torch.equal(megatron_logits(reloaded, x), logits)

    export_hf(reloaded, reloaded_spec, tmp_path / "exported")
    assert_same_tensors(safetensors_of(tmp_path / "exported"), safetensors_of(hf_dir))
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "exported").rope_parameters
    original = transformers.AutoConfig.from_pretrained(hf_dir).rope_parameters
    for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings"):
        assert exported.get(key) == original.get(key), key
    assert torch.equal(hf_logits(tmp_path / "exported", x), reference)


def test_yarn_changes_the_logits_and_both_sides_agree(tmp_path, megatron_state):
    """YaRN is really exercised: without it the same weights give other logits (the sequence
    is 3x YaRN's original length), and Megatron follows Hugging Face either way."""
    x = tokens()
    with_yarn = save_hf("llama", tmp_path / "yarn")
    without = save_hf("llama", tmp_path / "plain", rope_scaling=None)
    assert (hf_logits(with_yarn, x) - hf_logits(without, x)).abs().max().item() > 1e-2
    plain_model, plain_spec = import_hf(without)
    assert plain_spec.yarn is None
    assert (megatron_logits(plain_model, x) - hf_logits(without, x)).abs().max().item() < 1e-5


def test_yarn_mscale_follows_hugging_faces_rule(tmp_path, megatron_state):
    """With mscale and mscale_all_dim both set Hugging Face divides the two mscales; with one
    of them zero it ignores both, and Megatron's defaults reproduce that."""
    x = tokens()
    for rope, carried in (
        ({**YARN, "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16.0}, (0.8, 0.5)),
        ({**YARN, "mscale": 0.8, "mscale_all_dim": 0.0}, (1.0, 0.0)),
    ):
        hf_dir = save_hf("llama", tmp_path / str(carried), rope_scaling=rope)
        model, spec = import_hf(hf_dir)
        assert (spec.yarn.mscale, spec.yarn.mscale_all_dim) == carried
        assert (megatron_logits(model, x) - hf_logits(hf_dir, x)).abs().max().item() < 1e-5


def test_llama3_rope_scaling(tmp_path, megatron_state):
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    hf_dir = save_hf(
        "llama", tmp_path / "hf", rope_theta=5e5, rope_scaling={**llama3, "original_max_position_embeddings": 8192}
    )
    plain = save_hf("llama", tmp_path / "plain", rope_theta=5e5, rope_scaling=None)
    x = tokens()
    assert (hf_logits(hf_dir, x) - hf_logits(plain, x)).abs().max().item() > 1e-3
    model, spec = import_hf(hf_dir)
    assert spec.llama3_factor == 32.0 and spec.megatron_args()["rope_scaling_factor"] == 32.0
    assert (megatron_logits(model, x) - hf_logits(hf_dir, x)).abs().max().item() < 1e-5
    export_hf(model, spec, tmp_path / "exported")
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "exported").rope_parameters
    assert exported["rope_type"] == "llama3" and exported["factor"] == 32.0


def test_msa_import_keeps_the_index_branch(tmp_path, megatron_state):
    hf_dir = save_hf("qwen2", tmp_path / "hf")
    attention = MTrainingAttentionConfig.from_dict({"type": "msa", "msa": {"block_size": 16, "topk": 4}})
    model, spec = import_hf(hf_dir, attention=attention)
    dense, _ = import_hf(hf_dir)
    own = dense.state_dict()
    index = [k for k in model.state_dict() if k not in own]
    assert index and all("index" in k for k in index)
    fresh = build_megatron_model(spec, megatron_transformer_config(spec, attention))
    assert load_hf_weights(fresh, spec, read_hf_checkpoint(hf_dir)[1]) == sorted(index)
    for name, value in own.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(model.state_dict()[name], value), name
    export_hf(model, spec, tmp_path / "exported")
    assert_same_tensors(safetensors_of(tmp_path / "exported"), safetensors_of(hf_dir))


def test_sharded_checkpoint_and_padded_vocabulary(tmp_path, megatron_state):
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    MODELS["llama"]().save_pretrained(hf_dir, max_shard_size="100KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    model, spec = import_hf(hf_dir, padded_vocab_size=VOCAB + 64)
    assert model.embedding.word_embeddings.weight.shape[0] == VOCAB + 64
    assert model.embedding.word_embeddings.weight[VOCAB:].abs().sum() == 0
    logits = megatron_logits(model, tokens())
    assert (logits[..., :VOCAB] - hf_logits(hf_dir, tokens())).abs().max().item() < 1e-5
    export_hf(model, spec, tmp_path / "exported")
    assert_same_tensors(safetensors_of(tmp_path / "exported"), safetensors_of(hf_dir))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "mistral"}, "'model_type'"),
        ({"hidden_act": "gelu"}, "'hidden_act'"),
        ({"attention_bias": True}, "'attention_bias'"),
        ({"mlp_bias": True}, "'mlp_bias'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "'rope_scaling.rope_type'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}},
            "'rope_scaling.high_freq_factor'",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'rope_scaling.original_max_position_embeddings'"),
        ({"rope_theta": None}, "'rope_theta'"),
        ({"rope_scaling": {**YARN, "attention_factor": 2.0}}, "'rope_scaling.attention_factor'"),
        ({"rope_scaling": {**YARN, "extrapolation": 1}}, "'rope_scaling.extrapolation'"),
        ({"num_key_value_heads": 3}, "'num_key_value_heads'"),
    ],
)
def test_unsupported_config_names_the_field(change, field):
    config = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        **change,
    }
    with pytest.raises(ConversionError, match=field):
        spec_from_hf_config(config)


def run_script(*args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout + proc.stderr


def test_scripts_and_training_entry_point(tmp_path):
    """convert_hf_to_megatron.py -> the entry point loads the checkpoint (``megatron.load``)
    and saves its own after one step at learning rate 0 -> convert_megatron_to_hf.py on that
    training checkpoint (architecture from its Megatron arguments) gives the original weights."""
    root = Path(__file__).resolve().parents[1]
    hf_dir = save_hf(
        "qwen2", tmp_path / "hf", rope_scaling={**YARN, "factor": 2.0, "original_max_position_embeddings": 128}
    )
    run_script(str(root / "scripts/convert_hf_to_megatron.py"), str(hf_dir), "mg", "--yaml", "model.yaml", cwd=tmp_path)
    megatron = yaml.safe_load((tmp_path / "model.yaml").read_text())["megatron"]
    assert megatron["position_embedding_type"] == "yarn" and megatron["rotary_scaling_factor"] == 2.0
    # NullTokenizer adds one token (EOD); with divisor VOCAB the padded vocabulary is the model's.
    megatron.update(
        seq_length=SEQ,
        micro_batch_size=1,
        global_batch_size=1,
        train_iters=1,
        lr=0.0,
        min_lr=0.0,
        weight_decay=0.0,
        mock_data=True,
        tokenizer_type="NullTokenizer",
        vocab_size=VOCAB - 1,
        make_vocab_size_divisible_by=VOCAB,
        eval_iters=0,
        eval_interval=1000,
        ckpt_format="torch_dist",
        ckpt_fully_parallel_save=False,
        load=str(tmp_path / "mg"),
        save=str(tmp_path / "trained"),
        save_interval=1,
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"megatron": megatron, "attention": {"type": "dense"}}))
    out = run_script("-m", "megatron_mtraining.pretrain", "--config", "run.yaml", cwd=tmp_path)
    assert "loading release distributed checkpoint" in out and "successfully loaded checkpoint" in out
    run_script(
        str(root / "scripts/convert_megatron_to_hf.py"), "trained", "back", "--model-type", "qwen2", cwd=tmp_path
    )
    assert_same_tensors(safetensors_of(tmp_path / "back"), safetensors_of(hf_dir))
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["rope_scaling"]["factor"] == 2.0 and back["tie_word_embeddings"] is True

"""The correspondence between Hugging Face Qwen2 / Llama checkpoints and Megatron's GPTModel.

:class:`ModelSpec` is the architecture both sides agree on. It is read from a Hugging Face
``config.json`` (:func:`spec_from_hf_config`, which refuses every field value Megatron's GPT
cannot reproduce and names the field) or from Megatron's arguments
(:func:`spec_from_megatron_args`), and written back as either (:meth:`ModelSpec.hf_config`,
:meth:`ModelSpec.megatron_args`). :func:`hf_to_megatron` and :func:`megatron_to_hf` move the
weights; they are exact copies (QKV interleaving and gate/up fusion are concatenations), so a
round trip is bit for bit.

Megatron's ``linear_qkv`` holds, per GQA group, the group's query heads, then its key head, then
its value head (rows of ``head_dim``); that grouping is what lets tensor parallelism split the
fused weight by groups. ``linear_fc1`` is ``[gate; up]``, the order Megatron's SwiGLU chunks.

YaRN: Megatron's ``YarnRotaryEmbedding`` and Hugging Face's ``rope_type: yarn`` compute the same
frequencies (same correction range, ramp and blend) and both multiply cos and sin by the
attention factor. They differ in when ``mscale`` / ``mscale_all_dim`` enter that factor:
Hugging Face uses ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` only when
both are non-zero and otherwise ``get_mscale(factor)``; Megatron uses the ratio whenever both
are set (its defaults 1 and 0 give ``get_mscale(factor)``). The mapping therefore carries
``mscale`` / ``mscale_all_dim`` only when Hugging Face would use them and Megatron's defaults
otherwise. An explicit ``attention_factor`` has no Megatron argument and is refused unless it
equals the inferred one.

Llama 3.x's ``rope_type: llama3`` maps to Megatron's ``--use-rope-scaling`` /
``--rope-scaling-factor``, whose other parameters are fixed at Llama 3.1's values
(``low_freq_factor`` 1, ``high_freq_factor`` 4, ``original_max_position_embeddings`` 8192); other
values are refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

import torch

SUPPORTED_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
# The llama3 scaling parameters Megatron's RotaryEmbedding._apply_scaling hard-codes.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class ConversionError(ValueError):
    """A checkpoint or config that the conversion cannot represent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class YarnSpec:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # Hugging Face's mscale / mscale_all_dim when it uses them (both non-zero), else Megatron's defaults.
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_epsilon: float
    rotary_base: float
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool
    yarn: YarnSpec | None = None
    # Llama 3.x frequency scaling factor (rope_type llama3); exclusive with yarn.
    llama3_factor: float | None = None
    attention_dropout: float = 0.0
    # Model-level fields Megatron has no use for (token ids, dtype), kept for the export.
    hf_extra: dict = dataclasses.field(default_factory=dict, compare=False)

    def megatron_args(self) -> dict:
        """Megatron's arguments (argparse dests) for this architecture, as the YAML ``megatron:``
        section takes them."""
        if not float(self.rotary_base).is_integer():
            # Megatron's --rotary-base is an int; the model itself (GPTModel's rotary_base) takes any float.
            raise ConversionError(f"rope_theta = {self.rotary_base!r}: Megatron's --rotary-base takes integers only")
        args = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "group_query_attention": self.num_query_groups != self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "position_embedding_type": "yarn" if self.yarn else "rope",
            "rotary_base": int(self.rotary_base),
            "rotary_percent": 1.0,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.norm_epsilon,
            "swiglu": True,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
            "untie_embeddings_and_output_weights": not self.tied_embeddings,
            # Megatron's defaults are 0.1; these models have no hidden dropout at all.
            "attention_dropout": self.attention_dropout,
            "hidden_dropout": 0.0,
        }
        if self.llama3_factor is not None:
            args.update(use_rope_scaling=True, rope_scaling_factor=self.llama3_factor)
        if self.yarn:
            args.update(
                rotary_scaling_factor=self.yarn.factor,
                yarn_original_max_position_embeddings=self.yarn.original_max_position_embeddings,
                yarn_beta_fast=self.yarn.beta_fast,
                yarn_beta_slow=self.yarn.beta_slow,
                mscale=self.yarn.mscale,
                mscale_all_dim=self.yarn.mscale_all_dim,
                yarn_correction_range_round_to_int=self.yarn.round_to_int,
            )
        return args

    def transformer_config_kwargs(self) -> dict:
        """``TransformerConfig`` fields for this architecture (fusions and dtype are the caller's)."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.norm_epsilon,
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
        }

    def yarn_config_attributes(self) -> dict:
        """The ``yarn_*`` attributes GPTModel reads off its config (Megatron's
        ``_apply_yarn_config_from_args`` sets the same ones from arguments)."""
        if not self.yarn:
            return {}
        return {
            "yarn_rotary_scaling_factor": self.yarn.factor,
            "yarn_original_max_position_embeddings": self.yarn.original_max_position_embeddings,
            "yarn_beta_fast": self.yarn.beta_fast,
            "yarn_beta_slow": self.yarn.beta_slow,
            "yarn_mscale": self.yarn.mscale,
            "yarn_mscale_all_dim": self.yarn.mscale_all_dim,
            "yarn_correction_range_round_to_int": self.yarn.round_to_int,
        }

    def hf_config(self) -> dict:
        """A Hugging Face ``config.json`` for this architecture (legacy ``rope_theta`` /
        ``rope_scaling`` keys, which every transformers version reads)."""
        config = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.norm_epsilon,
            "rope_theta": self.rotary_base,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tied_embeddings,
            "hidden_act": "silu",
            "rope_scaling": None,
            "attention_dropout": self.attention_dropout,
        }
        if self.model_type == "llama":
            config.update(attention_bias=False, mlp_bias=False)
        if self.yarn:
            rope = {
                "rope_type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
                "truncate": self.yarn.round_to_int,
            }
            if self.yarn.mscale and self.yarn.mscale_all_dim:
                rope.update(mscale=self.yarn.mscale, mscale_all_dim=self.yarn.mscale_all_dim)
            config["rope_scaling"] = rope
        if self.llama3_factor is not None:
            config["rope_scaling"] = {"rope_type": "llama3", "factor": self.llama3_factor, **LLAMA3_FIXED}
        return {**self.hf_extra, **config}


# Fields Megatron's GPT has no counterpart for; they are checked to hold the value it implements.
_REQUIRED_VALUES = {
    "hidden_act": ("silu",),
    "mlp_bias": (False, None),
    "attention_bias": (False, None),
    "use_sliding_window": (False, None),
    "pretraining_tp": (1, None),
    "partial_rotary_factor": (1.0, None),
}
# Carried through the export untouched: token ids, dtype, init range, cache flag.
_EXTRA_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "initializer_range",
    "use_cache",
)


def _field_error(field: str, value, accepted: str) -> ConversionError:
    return ConversionError(f"config.json field {field!r} = {value!r} is not supported: {accepted}")


def _rope_fields(config: dict) -> tuple[float, dict | None]:
    """(rope base, scaling dict or None) from either the legacy keys or transformers 5's
    ``rope_parameters``."""
    parameters = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    base = config.get("rope_theta")
    if isinstance(parameters, dict):
        if any(isinstance(v, dict) for v in parameters.values()):
            raise _field_error("rope_parameters", parameters, "one RoPE setting for every layer")
        base = parameters.get("rope_theta", base)
        if scaling is None and parameters.get("rope_type", parameters.get("type", "default")) != "default":
            scaling = parameters
    if base is None:
        raise _field_error("rope_theta", None, "a RoPE base is required")
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(base), scaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_from_hf(scaling: dict, max_position_embeddings: int) -> float:
    # transformers falls back to max_position_embeddings when the original length is absent.
    scaling = {
        **scaling,
        "original_max_position_embeddings": scaling.get("original_max_position_embeddings", max_position_embeddings),
    }
    for key, value in scaling.items():
        if key in LLAMA3_FIXED and float(value) != LLAMA3_FIXED[key]:
            raise _field_error(f"rope_scaling.{key}", value, f"Megatron fixes llama3 scaling at {LLAMA3_FIXED}")
        if key not in {*LLAMA3_FIXED, "rope_type", "type", "factor", "rope_theta"}:
            raise _field_error(f"rope_scaling.{key}", value, "the llama3 keys are factor and the fixed ones")
    return float(scaling["factor"])


def _yarn_from_hf(scaling: dict, max_position_embeddings: int) -> YarnSpec:
    field = "rope_scaling"
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "yarn":
        raise _field_error(f"{field}.rope_type", rope_type, "'yarn', 'llama3' or none (Megatron's GPT has no other)")
    known = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
    known |= {"mscale", "mscale_all_dim", "attention_factor", "truncate", "rope_theta"}
    for key in scaling:
        if key not in known:
            raise _field_error(f"{field}.{key}", scaling[key], f"the YaRN keys are {sorted(known)}")
    original = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    factor = scaling.get("factor")
    # As in transformers: without a factor, the context extension ratio is the factor.
    factor = float(factor) if factor is not None else max_position_embeddings / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        used = (float(mscale), float(mscale_all_dim))
        inferred = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        used, inferred = (1.0, 0.0), _yarn_mscale(factor)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None and not math.isclose(attention_factor, inferred, rel_tol=1e-12):
        raise _field_error(
            f"{field}.attention_factor",
            attention_factor,
            f"Megatron derives it from factor/mscale/mscale_all_dim (here {inferred!r}); an explicit value cannot be carried",
        )
    return YarnSpec(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=used[0],
        mscale_all_dim=used[1],
        round_to_int=bool(scaling.get("truncate", True)),
    )


def spec_from_hf_config(config: dict) -> ModelSpec:
    """The architecture of a Hugging Face ``config.json`` (a dict); raises :class:`ConversionError`
    naming the first field Megatron's GPT cannot reproduce."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise _field_error("model_type", model_type, f"supported are {sorted(SUPPORTED_ARCHITECTURES)}")
    for field, accepted in _REQUIRED_VALUES.items():
        if config.get(field) not in accepted:
            raise _field_error(field, config.get(field), f"accepted {[a for a in accepted if a is not None]}")
    layer_types = config.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise _field_error("layer_types", layer_types, "every layer 'full_attention'")
    if config.get("num_experts") or config.get("num_local_experts"):
        raise _field_error(
            "num_experts", config.get("num_experts") or config.get("num_local_experts"), "dense MLPs only"
        )
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    if heads % groups:
        raise _field_error("num_key_value_heads", groups, f"a divisor of num_attention_heads = {heads}")
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    max_positions = int(config["max_position_embeddings"])
    base, scaling = _rope_fields(config)
    is_llama3 = scaling is not None and scaling.get("rope_type", scaling.get("type")) == "llama3"
    return ModelSpec(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        norm_epsilon=float(config["rms_norm_eps"]),
        rotary_base=base,
        max_position_embeddings=max_positions,
        tied_embeddings=bool(config.get("tie_word_embeddings", model_type == "qwen2")),
        # Qwen2 always has q/k/v biases; Llama's optional ones also cover o_proj, refused above.
        qkv_bias=model_type == "qwen2",
        yarn=_yarn_from_hf(scaling, max_positions) if scaling is not None and not is_llama3 else None,
        llama3_factor=_llama3_from_hf(scaling, max_positions) if is_llama3 else None,
        attention_dropout=float(config.get("attention_dropout") or 0.0),
        hf_extra={k: config[k] for k in _EXTRA_KEYS if k in config},
    )


def spec_from_megatron_args(args: argparse.Namespace | dict, vocab_size: int, model_type: str = "qwen2") -> ModelSpec:
    """The architecture of a Megatron model from its arguments (a checkpoint's ``args``);
    ``vocab_size`` is the unpadded vocabulary the Hugging Face model gets."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)

    def need(name, accepted):
        if a.get(name) not in accepted:
            raise ConversionError(f"Megatron argument {name!r} = {a.get(name)!r} is not supported: accepted {accepted}")

    need("normalization", ("RMSNorm",))
    need("swiglu", (True,))
    need("add_bias_linear", (False,))
    need("position_embedding_type", ("rope", "yarn"))
    need("rotary_percent", (1.0,))
    if a.get("num_experts"):
        raise ConversionError(
            f"Megatron argument 'num_experts' = {a['num_experts']!r} is not supported: dense MLPs only"
        )
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"model_type {model_type!r} is not supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    qkv_bias = bool(a.get("add_qkv_bias"))
    if qkv_bias != (model_type == "qwen2"):
        raise ConversionError(f"Megatron argument 'add_qkv_bias' = {qkv_bias} does not fit model_type {model_type!r}")
    heads = a["num_attention_heads"]
    groups = a["num_query_groups"] if a.get("group_query_attention") else heads
    yarn = None
    if a["position_embedding_type"] == "yarn":
        yarn = YarnSpec(
            factor=float(a.get("rotary_scaling_factor", 1.0)),
            original_max_position_embeddings=int(a.get("yarn_original_max_position_embeddings") or 4096),
            beta_fast=float(a.get("yarn_beta_fast") or 32.0),
            beta_slow=float(a.get("yarn_beta_slow") or 1.0),
            mscale=float(a.get("mscale", 1.0)),
            mscale_all_dim=float(a.get("mscale_all_dim", 0.0)),
            round_to_int=a.get("yarn_correction_range_round_to_int") is not False,
        )
    return ModelSpec(
        model_type=model_type,
        hidden_size=a["hidden_size"],
        num_layers=a["num_layers"],
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=a.get("kv_channels") or a["hidden_size"] // heads,
        ffn_hidden_size=a["ffn_hidden_size"],
        vocab_size=vocab_size,
        norm_epsilon=float(a["layernorm_epsilon"]),
        rotary_base=float(a["rotary_base"]),
        max_position_embeddings=a["max_position_embeddings"],
        tied_embeddings=not a["untie_embeddings_and_output_weights"],
        qkv_bias=qkv_bias,
        yarn=yarn,
        llama3_factor=float(a.get("rope_scaling_factor", 8.0)) if a.get("use_rope_scaling") else None,
        attention_dropout=float(a.get("attention_dropout") or 0.0),
    )


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    # Megatron (local spec) -> Hugging Face; the TE spec's fused-norm names are resolved below.
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _megatron_norm_name(name: str, model_keys: set[str] | None, layer: int) -> str:
    te_name = _TE_NORM_NAMES.get(name)
    if te_name and model_keys is not None and f"decoder.layers.{layer}.{te_name}" in model_keys:
        return te_name
    return name


def _interleave_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = spec.num_query_groups, spec.head_dim
    per_group = spec.num_attention_heads // g
    tail = q.shape[1:]
    parts = (q.reshape(g, per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.num_query_groups, spec.head_dim
    per_group = spec.num_attention_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per_group + 2) * d, *tail)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *tail).clone() for t in (q, k, v))


def hf_to_megatron(spec: ModelSpec, hf: dict[str, torch.Tensor], model_keys: set[str] | None = None) -> dict:
    """Megatron GPTModel state-dict entries from a Hugging Face state dict. ``model_keys`` (the
    model's own keys) selects the TE spec's fused-norm names where the model has them."""
    expected = set(megatron_to_hf_names(spec))
    missing = sorted(expected - set(hf))
    if missing:
        raise ConversionError(f"the Hugging Face checkpoint lacks {missing[:5]} (and {max(0, len(missing) - 5)} more)")
    unexpected = sorted(set(hf) - expected - {"lm_head.weight"})
    if unexpected:
        raise ConversionError(f"the Hugging Face checkpoint has tensors the mapping does not know: {unexpected[:5]}")
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not spec.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mg_name, hf_name in _LAYER_NAMES.items():
            out[m + _megatron_norm_name(mg_name, model_keys, i)] = hf[p + hf_name]
        attn = p + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _interleave_qkv(
            spec, *(hf[f"{attn}{x}_proj.weight"] for x in "qkv")
        )
        if spec.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _interleave_qkv(
                spec, *(hf[f"{attn}{x}_proj.bias"] for x in "qkv")
            )
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    return out


def megatron_to_hf_names(spec: ModelSpec) -> list[str]:
    """The tensor names of the Hugging Face checkpoint for ``spec`` (``lm_head`` only when untied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if spec.tied_embeddings else ["lm_head.weight"])
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in _LAYER_NAMES.values()]
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"] if spec.qkv_bias else []
        names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    return names


def megatron_to_hf(spec: ModelSpec, mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict from Megatron GPTModel state-dict entries (local or TE names);
    rows of a padded vocabulary beyond ``spec.vocab_size`` are dropped."""

    def get(name: str) -> torch.Tensor:
        if name not in mg:
            raise ConversionError(f"the Megatron state dict lacks {name!r}")
        return mg[name]

    keys = set(mg)
    out = {
        "model.embed_tokens.weight": get("embedding.word_embeddings.weight")[: spec.vocab_size],
        "model.norm.weight": get("decoder.final_layernorm.weight"),
    }
    if not spec.tied_embeddings:
        out["lm_head.weight"] = get("output_layer.weight")[: spec.vocab_size]
    for i in range(spec.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mg_name, hf_name in _LAYER_NAMES.items():
            out[p + hf_name] = get(m + _megatron_norm_name(mg_name, keys, i))
        attn = p + "self_attn."
        for x, t in zip("qkv", _split_qkv(spec, get(m + "self_attention.linear_qkv.weight")), strict=True):
            out[f"{attn}{x}_proj.weight"] = t
        if spec.qkv_bias:
            for x, t in zip("qkv", _split_qkv(spec, get(m + "self_attention.linear_qkv.bias")), strict=True):
                out[f"{attn}{x}_proj.bias"] = t
        gate, up = get(m + "mlp.linear_fc1.weight").chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.clone(), up.clone()
    return out

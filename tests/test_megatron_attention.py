"""The Megatron layer: config validation, layer specs, and a tiny GPT built from the plugin's
spec on gloo (CPU), checked against cp_size 1 and against Megatron's own attention.

Model-level runs happen in spawned processes (``megatron_workers``): they initialise
Megatron's parallel state and apply the CPU patches (``patches/cpu_compat.py``), which must not leak into this process.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import megatron_workers as workers
import pytest
import torch
from gloo import run

from megatron_mtraining.context_parallel import ContextParallelLayout
from megatron_mtraining.megatron import (
    MSASelfAttention,
    MTrainingAttentionConfig,
    SparseCoreAttention,
    attach_attention_config,
    get_attention_config,
    get_gpt_decoder_block_spec,
    get_gpt_layer_spec,
)
from megatron_mtraining.patches import apply_cpu_patches, apply_patches, remove_patches
from megatron_mtraining.patterns.dense import DensePattern
from megatron_mtraining.patterns.msa import MSAPattern
from megatron_mtraining.sparse import MSAConfig, VerticalSlashConfig


def _transformer_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0)
    return TransformerConfig(**{**values, **overrides})


# ---------------------------------------------------------------- config


def test_config_from_dict_builds_the_pattern_sections():
    cfg = MTrainingAttentionConfig.from_dict(
        {"type": "msa", "msa": {"block_size": 64, "topk": 8}, "layout": "striped", "stripe": 64, "hierarchy": 2}
    )
    assert cfg.msa == MSAConfig(block_size=64, topk=8)
    assert cfg.settings is cfg.msa and cfg.pattern == MSAPattern(cfg.msa)
    assert cfg.mtraining == VerticalSlashConfig()
    assert MTrainingAttentionConfig(type="dense").pattern == DensePattern()
    assert MTrainingAttentionConfig(mtraining={"last_q": 32}).mtraining.last_q == 32


@pytest.mark.parametrize(
    "values, match",
    [
        ({"type": "flash"}, r"MTrainingAttentionConfig\.type='flash'.*dense, moba, msa, mtraining"),
        ({"layout": "ring"}, r"MTrainingAttentionConfig\.layout='ring'.*contiguous, zigzag, striped"),
        ({"stripe": 0}, r"MTrainingAttentionConfig\.stripe=0"),
        ({"hierarchy": 0}, r"MTrainingAttentionConfig\.hierarchy=0"),
        (
            {"backend": "flash"},
            r"MTrainingAttentionConfig\.backend='flash'.*'reference', 'triton', 'flash_attn', 'sdpa', 'varlen_blocks'",
        ),
        (
            {"type": "msa", "backend": "flash_attn"},
            r"MTrainingAttentionConfig\.backend='flash_attn'.*for type 'msa' \(flash_attn computes dense attention only",
        ),
        (
            {"type": "mtraining", "backend": "varlen_blocks"},
            r"backend='varlen_blocks'.*for type 'mtraining' \(varlen_blocks runs MoBA's wide blocks only",
        ),
        ({"msa": {"blok_size": 64}}, r"attention\.msa\.blok_size=64.*MSAConfig fields"),
        ({"mtraining": {"block_size": 24}}, r"VerticalSlashConfig\.block_size=24.*power of two"),
        ({"moba": [1, 2]}, r"MTrainingAttentionConfig\.moba='list'.*MoBAConfig"),
        ({"tyep": "msa"}, r"attention\.tyep='msa'.*attention settings"),
        ({"kv_exchange": "p2p"}, r"MTrainingAttentionConfig\.kv_exchange='p2p'.*auto, ring, allgather"),
    ],
)
def test_bad_config_names_the_field(values, match):
    with pytest.raises(ValueError, match=match):
        MTrainingAttentionConfig.from_dict(values)


def test_node_gather_numbers_the_layout_node_major():
    """K/V gathered inside nodes (``allgather`` with a hierarchy) number the layout's ranks
    node-major, the batch split's and RoPE's too (``layout_node_size``); the ring keeps flat."""
    gather = MTrainingAttentionConfig.from_dict(
        {"layout": "striped", "stripe": 16, "hierarchy": 2, "kv_exchange": "allgather"}
    )
    ring = MTrainingAttentionConfig.from_dict({"layout": "striped", "stripe": 16, "hierarchy": 2})
    assert gather.layout_node_size == 2 and ring.layout_node_size is None
    flat = ring.cp_layout(4, 256)
    assert flat == ContextParallelLayout("striped", 4, 256, stripe=16)
    for rank in range(4):
        assert torch.equal(gather.cp_layout(4, 256).positions(rank), flat.positions(rank % 2 * 2 + rank // 2))


def test_constructor_rejects_unknown_section_keys():
    with pytest.raises(ValueError, match=r"MTrainingAttentionConfig\.moba\.chunk=4"):
        MTrainingAttentionConfig(moba={"chunk": 4})


@pytest.mark.parametrize(
    "attention, overrides, match",
    [
        ({}, {"attention_dropout": 0.1}, r"TransformerConfig\.attention_dropout=0\.1"),
        ({"type": "msa"}, {"tensor_model_parallel_size": 2}, r"tensor_model_parallel_size=2.*'msa'"),
        ({"hierarchy": 3}, {"context_parallel_size": 4}, r"MTrainingAttentionConfig\.hierarchy=3.*divisor"),
        ({"hierarchy": 2}, {"context_parallel_size": 4}, r"hierarchical_context_parallel_sizes=None.*\[2, 2\]"),
        ({}, {"window_size": (64, 0)}, r"TransformerConfig\.window_size"),
        (
            {"backend": "flash_attn"},
            {"context_parallel_size": 2},
            r"TransformerConfig\.context_parallel_size=2.*1 with MTrainingAttentionConfig\.backend='flash_attn'",
        ),
    ],
)
def test_config_checked_against_the_transformer_config(attention, overrides, match):
    config = _transformer_config(**overrides)
    with pytest.raises(ValueError, match=match):
        attach_attention_config(config, MTrainingAttentionConfig(**attention))


def test_flash_attn_backend_accepted_for_dense_without_context_parallelism():
    attention = MTrainingAttentionConfig.from_dict({"type": "dense", "backend": "flash_attn"})
    assert get_attention_config(attach_attention_config(_transformer_config(), attention)).backend == "flash_attn"


def test_config_travels_with_the_transformer_config():
    config = _transformer_config()
    with pytest.raises(ValueError, match=r"TransformerConfig\.mtraining_attention=None.*attach_attention_config"):
        get_attention_config(config)
    msa = MTrainingAttentionConfig(type="msa")
    assert attach_attention_config(config, msa) is config
    assert get_attention_config(config) is msa
    from megatron_mtraining.megatron import MSALossAutoScaler

    assert config.experimental_attention_variant_loss_scale_func == MSALossAutoScaler.set_loss_scale
    other = _transformer_config(experimental_attention_variant_loss_scale_func=print)
    with pytest.raises(ValueError, match="experimental_attention_variant_loss_scale_func"):
        attach_attention_config(other, msa)


# ---------------------------------------------------------------- specs


def _without_attention(spec):
    attn = spec.submodules.self_attention
    rest = dataclasses.replace(spec.submodules, self_attention=None)
    return rest, dataclasses.replace(attn.submodules, core_attention=None), attn.params


def _same(a, b) -> bool:
    """Structural equality of specs; Megatron builds a new functools.partial per call, and
    partials compare by identity."""
    if isinstance(a, functools.partial):
        return isinstance(b, functools.partial) and _same((a.func, a.args, a.keywords), (b.func, b.args, b.keywords))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("attention", ["dense", "mtraining", "msa", "moba"])
def test_layer_spec_is_megatrons_except_the_attention(attention):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention

    ours = get_gpt_layer_spec(attention, qk_layernorm=True, normalization="RMSNorm")
    theirs = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    assert _same(_without_attention(ours), _without_attention(theirs))
    assert not _same(ours, theirs)
    assert ours.module is theirs.module
    attn = ours.submodules.self_attention
    assert attn.module is (MSASelfAttention if attention == "msa" else SelfAttention)
    assert attn.submodules.core_attention.module is SparseCoreAttention
    assert attn.submodules.core_attention.params == {"attention": attention}
    # Megatron's spec is not modified in place.
    assert get_gpt_layer_local_spec().submodules.self_attention.module is SelfAttention


def test_package_exports_the_megatron_layer():
    import megatron_mtraining

    assert megatron_mtraining.get_gpt_layer_spec is get_gpt_layer_spec
    assert megatron_mtraining.get_gpt_decoder_block_spec is get_gpt_decoder_block_spec
    assert megatron_mtraining.MTrainingAttentionConfig is MTrainingAttentionConfig


def test_decoder_block_spec_uses_the_attached_type():
    config = attach_attention_config(_transformer_config(), MTrainingAttentionConfig(type="moba"))
    block = get_gpt_decoder_block_spec(config, pp_rank=0)  # pp_rank: no parallel state here
    assert len(block.layer_specs) == 2
    for spec in block.layer_specs:
        assert spec.submodules.self_attention.submodules.core_attention.params == {"attention": "moba"}
    msa = get_gpt_decoder_block_spec(config, attention="msa", pp_rank=0)
    assert msa.layer_specs[0].submodules.self_attention.module is MSASelfAttention


def test_spec_errors_name_the_argument():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    with pytest.raises(ValueError, match=r"attention='sparse'"):
        get_gpt_layer_spec("sparse")
    with pytest.raises(ValueError, match=r"backend='apex'"):
        get_gpt_layer_spec("dense", backend="apex")
    with pytest.raises(ValueError, match=r"self_attention='MLASelfAttention'"):
        get_gpt_layer_spec("dense", multi_latent_attention=True)
    if not HAVE_TE:
        with pytest.raises(ValueError, match=r"backend='te'.*Transformer Engine is not installed"):
            get_gpt_layer_spec("dense", backend="te")


def test_core_attention_contract_errors():
    """Constructor and forward reject what sparse attention cannot do, naming the argument
    (no process group needed: the checks come first)."""
    from megatron.core.transformer.enums import AttnMaskType

    config = attach_attention_config(_transformer_config(), MTrainingAttentionConfig(type="mtraining"))
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    with pytest.raises(ValueError, match=r"MTrainingAttentionConfig\.type='mtraining'.*'msa'"):
        SparseCoreAttention(**kwargs, attention="msa")
    with pytest.raises(ValueError, match=r"attn_mask_type=.*padding.*causal"):
        SparseCoreAttention(**{**kwargs, "attn_mask_type": AttnMaskType.padding})
    with pytest.raises(ValueError, match=r"attention_dropout=0\.1"):
        SparseCoreAttention(**kwargs, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"attention_type='cross'"):
        SparseCoreAttention(**{**kwargs, "attention_type": "cross"})

    class _Groups:  # a stand-in process-group collection: one rank everywhere
        tp = cp = None

    module = SparseCoreAttention(**kwargs, pg_collection=_Groups())
    q = torch.randn(64, 1, 4, 16)
    kv = torch.randn(64, 1, 2, 16)
    assert module(q, kv, kv, None).shape == (64, 1, 64)
    with pytest.raises(ValueError, match="attention_bias"):
        module(q, kv, kv, None, attention_bias=torch.zeros(1))
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=44, max_seqlen_kv=44)
    assert module(q[:, 0], kv[:, 0], kv[:, 0], None, packed_seq_params=thd).shape == (64, 1, 64)
    with pytest.raises(ValueError, match=r"packed_seq_params\.qkv_format='bshd'"):
        module(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="bshd", cu_seqlens_q=cu))
    other = torch.tensor([0, 32, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed_seq_params\.cu_seqlens_kv="):
        module(
            q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=other)
        )
    with pytest.raises(ValueError, match=r"micro-batch size=2"):
        module(q.expand(-1, 2, -1, -1), kv.expand(-1, 2, -1, -1), kv.expand(-1, 2, -1, -1), None,
               packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu))  # fmt: skip
    with pytest.raises(ValueError, match=r"attn_mask_type=.*no_mask"):
        module(q, kv, kv, None, attn_mask_type=AttnMaskType.no_mask)


class _CPGroups:
    """A stand-in process-group collection with a context-parallel group of two ranks (the
    layout checks need no communication)."""

    tp = None
    cp = types.SimpleNamespace(size=lambda: 2)


@pytest.fixture
def unpatched():
    remove_patches()
    yield
    remove_patches()


def _cp_core_attention(layout: str, stripe: int = 128):
    from megatron.core.transformer.enums import AttnMaskType

    attention = MTrainingAttentionConfig(layout=layout, stripe=stripe)
    config = attach_attention_config(_transformer_config(context_parallel_size=2), attention)
    return SparseCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=_CPGroups())


@pytest.mark.parametrize(
    "layout, stripe, applied",
    [
        ("zigzag", 128, None),  # Megatron's own order
        ("zigzag", 128, ("zigzag", 16)),
        ("striped", 16, ("striped", 16)),
        ("contiguous", 128, ("contiguous", 64)),  # the stripe does not move contiguous tokens
        ("balanced", 16, ("balanced", 16)),
    ],
)
def test_core_attention_accepts_the_applied_layout(unpatched, layout, stripe, applied):
    if applied:
        apply_patches(*applied)
    _cp_core_attention(layout, stripe)


@pytest.mark.parametrize(
    "layout, stripe, applied, match",
    [
        (
            "striped",
            16,
            None,
            r"attention\.layout='striped', attention\.stripe=16 .* patches are not applied.*"
            r"apply_patches\('striped', 16\) before building the model",
        ),
        (
            "striped",
            16,
            ("striped", 32),
            r"attention\.stripe=16 .* applied with layout 'striped' and stripe 32.*apply_patches\('striped', 16\)",
        ),
        ("contiguous", 128, None, r"attention\.layout='contiguous'.*not applied.*apply_patches\('contiguous', 128\)"),
        ("contiguous", 16, ("striped", 16), r"attention\.layout='contiguous'.*applied with layout 'striped'"),
        (
            "balanced",
            16,
            ("balanced", 32),
            r"attention\.stripe=16 .* applied with layout 'balanced' and stripe 32.*apply_patches\('balanced', 16\)",
        ),
        (
            "zigzag",
            128,
            ("striped", 16),
            r"attention\.layout='zigzag' .* 'striped' layout \(stripe 16\).*attention\.layout='striped'.*"
            r"remove_patches\(\)",
        ),
    ],
)
def test_core_attention_refuses_a_layout_the_patches_do_not_apply(unpatched, layout, stripe, applied, match):
    if applied:
        apply_patches(*applied)
    with pytest.raises(ValueError, match=match):
        _cp_core_attention(layout, stripe)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_patch_check_wants_the_node_gathers_numbering(unpatched, layout):
    """K/V gathered inside nodes number the layout's ranks node-major, zigzag's too, which
    Megatron's own split does not: the patches must apply the same node size."""
    cfg = MTrainingAttentionConfig(layout=layout, stripe=16, hierarchy=2, kv_exchange="allgather")
    check = functools.partial(SparseCoreAttention._check_patches, types.SimpleNamespace(attention_config=cfg), 4)
    for applied in (None, (layout, 16)):
        if applied:
            apply_patches(*applied)
        with pytest.raises(ValueError, match=r"numbered node-major in nodes of 2.*apply_patches\(.*node_size=2\)"):
            check()
    remove_patches()
    apply_patches(layout, 16, 2)
    check()


def test_core_attention_checks_the_patches_again_in_forward(unpatched):
    apply_patches("striped", 16)
    module = _cp_core_attention("striped", 16)
    remove_patches()
    q, kv = torch.randn(64, 1, 4, 16), torch.randn(64, 1, 2, 16)
    with pytest.raises(ValueError, match=r"attention\.layout='striped'.*not applied"):
        module(q, kv, kv, None)


def test_core_attention_refuses_other_documents_than_the_batch_split(unpatched):
    """Under ``balanced`` the tokens sit where the batch split placed them for its documents:
    an attention given other boundaries (or the split none) stops before attending."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_mtraining.patches._layout import record_split_documents

    apply_patches("balanced", 16)
    module = _cp_core_attention("balanced", 16)
    q, kv = torch.randn(64, 1, 4, 16), torch.randn(64, 1, 2, 16)
    cu = torch.tensor([0, 40, 90, 128], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu)
    for split, shown in ((None, r"no documents \(striped\)"), ((0, 40, 128), r"2 documents, ends \[40, 128\]")):
        record_split_documents(split)
        with pytest.raises(
            ValueError,
            match=rf"CP batch split='{shown}'.*cu_seqlens_q \(3 documents\).*batch\['cu_seqlens'\]",
        ):
            module(q, kv, kv, None, packed_seq_params=packed)


def test_cpu_patches_are_a_no_op_with_cuda(monkeypatch):
    current_device = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_cpu_patches() is False
    assert torch.cuda.current_device is current_device


# ---------------------------------------------------------------- models on gloo


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """cp_size-1 state, loss and gradients of every attention type."""
    path = str(tmp_path_factory.mktemp("megatron") / "references.pt")
    run(1, workers.compute_references, path)
    return path


def test_dense_equals_megatron_dot_product_attention():
    run(1, workers.check_dense_equals_megatron)


def test_msa_kl_loss_scale_logging_warmup_recompute_and_checkpoint():
    run(1, workers.check_msa_kl_and_checkpoint)


def test_msa_recall_metrics_recorded_per_layer_in_warmup_and_after():
    run(2, workers.check_msa_recall_metrics)


def test_msa_fused_kl_in_the_layer(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    run(1, workers.check_msa_fused_kl_in_layer)


@pytest.mark.slow  # the attention on the kernels in the interpreter; msa_attention's own test runs by default
def test_msa_kl_with_attention_in_the_layer(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    run(1, workers.check_msa_kl_with_attention_in_layer)


def test_cpu_patches_run_megatron_ddp_and_optimizer():
    run(1, workers.check_cpu_patches_ddp_and_optimizer)


def test_cp2_equals_cp1(references):
    # Layouts alternate so that every switch (apply, replace, remove the patches) happens in one process.
    runs = [(kind, layout, None) for kind in workers.PATTERNS for layout in ("zigzag", "striped", "contiguous")]
    run(2, workers.check_cp_parity, references, runs)


@pytest.mark.slow  # CP 2 parity runs by default; the 2x2 ring on the kernels in test_context_parallel
def test_cp4_equals_cp1(references):
    """Flat and hierarchical (2x2) rings in the zigzag and striped layouts, and K/V gathered
    inside nodes (2x2, the layout numbered node-major through the patches); hierarchical
    groups in the wrong rank order are refused."""
    runs = [
        (kind, layout, hierarchy)
        for kind in workers.PATTERNS
        for layout, hierarchy in (("zigzag", None), ("striped", None), ("zigzag", "ring"))
    ]
    # The hierarchy changes only the ring's schedule, which every type meets in zigzag 2x2;
    # striped 2x2 only for mtraining (the layout's reason to exist) and MSA (selection and KL
    # across ranks) keeps the runtime down; so for the node gather.
    runs += [(kind, "striped", exchange) for kind in ("mtraining", "msa") for exchange in ("ring", "allgather")]
    run(4, workers.check_cp4, references, runs)


# CP 2 parity runs by default (test_cp2_equals_cp1), and the KL's ring steps on the kernels
# in test_context_parallel's test_msa_kl_ring_on_kernels; this layer-level twin takes minutes.
@pytest.mark.slow
def test_msa_cp2_kl_kernels_equal_cp1(references, monkeypatch):
    """MSA at CP 2 with the KL's ring steps on the fused kernels (interpreted without CUDA)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    run(2, workers.check_msa_cp_parity_on_kl_kernels, references)


@pytest.mark.parametrize("layout", ["striped", "balanced"])
def test_packed_documents_equal_separate_samples(layout):
    run(2, workers.check_packed_documents_equal_separate_samples, layout)


def test_msa_selecting_every_block_trains_as_dense():
    run(1, workers.check_msa_selecting_every_block_trains_as_dense)

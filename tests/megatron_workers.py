"""Worker bodies for the gloo Megatron tests (spawned processes import this).

A tiny GPT (2 layers, hidden 64, 4 heads in 2 query groups, sequence 256, vocabulary 256,
fp32) is built from the plugin's layer spec. Losses and gradients follow Megatron's
conventions: each context-parallel rank takes the mean over its tokens, the MSA KL scale is
set through the config hook with ``loss_scale * cp_size / num_microbatches`` (the schedules'
call), and gradients are averaged over the CP ranks (what Megatron DDP does over dp x cp).
Context-parallel runs split the batch and RoPE with Megatron's own functions, patched by
``megatron_mtraining.patches`` for every layout but zigzag, as training does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os
import tempfile

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core import utils as megatron_utils
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_mtraining import patches
from megatron_mtraining.context_parallel import ContextParallelLayout
from megatron_mtraining.megatron import (
    MTrainingAttentionConfig,
    SparseCoreAttention,
    attach_attention_config,
    core_attention,
    get_attention_metrics_tracker,
    get_gpt_layer_spec,
    set_training_iteration,
)
from megatron_mtraining.megatron.layer_specs import get_gpt_decoder_block_spec
from megatron_mtraining.patterns import msa as msa_pattern
from megatron_mtraining.patterns.base import FRACTION_METRIC, HELDOUT_RECALL_METRIC, RECALL_METRIC
from megatron_mtraining.patterns.msa import BLOCK_RECALL_METRIC, KL_METRIC, SCORE_RECALL_METRIC, MSAPattern
from megatron_mtraining.sparse import DenseIndex, block_max_scores, msa_kl_loss, msa_recall, msa_select_blocks
from megatron_mtraining.sparse.metrics import heldout_recall, heldout_rows
from megatron_mtraining.training.attention_metrics import collect_attention_metrics, measured

SEQ, BATCH, VOCAB, SEED = 256, 2, 256, 1234
# Larger than Megatron's 0.02 so that attention is far from uniform and the patterns matter.
INIT_STD = 0.2
# Context-parallel runs see MSA's block scores of layer 2 moved by rounding (its input comes out
# of the ring, which merges partial attention in another order; measured up to 1.4e-5 at
# cp_size 2 and 4, layer 1's scores are exact), so a reference row whose top-k is closer than
# this to a tie could select another block there, which legitimately changes every gradient.
# The reference asserts that no row is closer.
MSA_MIN_MARGIN = 1e-4

PATTERNS = {
    "dense": {},
    "mtraining": {
        "mtraining": {"last_q": 32, "vertical_topp": 0.5, "slash_topp": 0.5, "block_size": 16, "sink_tokens": 2}
    },
    "msa": {"msa": {"block_size": 16, "topk": 4, "index_head_dim": 16, "warmup_steps": 0}},
    "moba": {"moba": {"chunk_size": 32, "topk": 3}},
}


def init_megatron(cp_size: int = 1, hierarchical: list[int] | None = None) -> None:
    patches.apply_cpu_patches()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        context_parallel_size=cp_size, hierarchical_context_parallel_sizes=hierarchical
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    # The weights are drawn from the CPU generator, which the call above leaves alone and which
    # torch seeds at random in every process (megatron.training seeds both): unseeded, every
    # run would test another model, and the parity of a few would hang on a near-tie.
    torch.manual_seed(SEED)


def attention_config(kind: str, **overrides):
    return MTrainingAttentionConfig.from_dict({"type": kind, **PATTERNS[kind], **overrides})


def transformer_config(attention, num_layers: int = 2, **config_overrides) -> TransformerConfig:
    """The tiny GPT's config for the current parallel state, with ``attention`` (an
    MTrainingAttentionConfig) attached unless None."""
    cp = parallel_state.get_context_parallel_world_size()
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        init_method_std=INIT_STD,
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=[2, cp // 2] if attention is not None and attention.hierarchy else None,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=torch.float32,
        **config_overrides,
    )
    if attention is not None:
        attach_attention_config(config, attention)
    return config


def build_model(attention, position_embedding: str = "rope", spec=None, **config_overrides):
    """The tiny GPT for the current parallel state; ``attention`` is an MTrainingAttentionConfig
    (None: no plugin config, for Megatron's own spec)."""
    config = transformer_config(attention, **config_overrides)
    if attention is not None:
        spec = spec or get_gpt_layer_spec(attention.type)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type=position_embedding)


def full_batch():
    gen = torch.Generator().manual_seed(SEED)
    # No token twice in a sequence: repeats have equal layer-1 index keys, so MSA blocks whose
    # best key is the same token would tie exactly and the selection would hang on tie-breaking.
    tokens = torch.stack([torch.randperm(VOCAB, generator=gen)[:SEQ] for _ in range(BATCH)])
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"tokens": tokens, "labels": labels, "position_ids": torch.arange(SEQ).expand(BATCH, -1).contiguous()}


def _cp_split_functions() -> tuple:
    # The RoPE slice is read where RotaryEmbedding's module bound it by name: a patch of
    # rope_utils' attribute alone would not reach the model.
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    return megatron_utils.get_batch_on_this_cp_rank, rotary_pos_embedding.get_pos_emb_on_this_cp_rank


MEGATRON_CP_SPLIT = _cp_split_functions()


def use_layout(layout: str, stripe: int, node_size: int | None = None) -> None:
    """Megatron's CP batch split and RoPE slice for ``layout``: unpatched for zigzag (its own
    order), the plugin's patches otherwise. Removes what the previous case applied."""
    patches.remove_patches()
    assert _cp_split_functions() == MEGATRON_CP_SPLIT, "remove_patches() left a patched function behind"
    if layout != "zigzag" or node_size is not None:
        patches.apply_patches(layout, stripe, node_size)
        assert all(a is not b for a, b in zip(_cp_split_functions(), MEGATRON_CP_SPLIT, strict=True)), (
            "a patch was not installed"
        )


def local_batch():
    """This CP rank's tokens through Megatron's ``get_batch_on_this_cp_rank``, looked up at call
    time: the patches replace it in ``megatron.*`` modules, not in names bound here."""
    group = parallel_state.get_context_parallel_group()
    return megatron_utils.get_batch_on_this_cp_rank(full_batch(), is_hybrid_cp=False, cp_group=group)


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward under Megatron's conventions: (loss, gradients), averaged
    over the CP group (every parameter is expected to get a gradient)."""
    group = parallel_state.get_context_parallel_group()
    cp = group.size()
    model.zero_grad(set_to_none=True)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = per_token.float().mean()
    hook = model.config.experimental_attention_variant_loss_scale_func
    if hook is not None:
        hook(torch.ones(1) * cp / 1)  # loss_scale * cp_size / num_microbatches
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grads[name] = p.grad.clone()
    loss = loss.detach()
    if cp > 1:
        for t in [loss, *grads.values()]:
            dist.all_reduce(t, group=group)
            t.div_(cp)
    return loss, grads


def recorded_kl() -> torch.Tensor:
    """The per-layer MSA KL recorded since the last clear, summed over the CP group (what
    the tracker's ``report`` does before averaging over DP)."""
    values = get_attention_metrics_tracker().metrics["msa_kl_loss"].values.clone()
    dist.all_reduce(values, group=parallel_state.get_context_parallel_group())
    return values


@contextlib.contextmanager
def recorded_msa_selections():
    """Yields a list that collects ``(MSAPattern, BlockTopKIndex)`` for every MSA selection the
    core attention builds inside the block, in layer order."""
    built = []

    def recording(build):
        @functools.wraps(build)
        def build_and_record(source, *args, **kwargs):
            index = build(source, *args, **kwargs)
            pattern = getattr(source, "pattern", source)  # the layer wraps it (KeptIndexes)
            if isinstance(pattern, MSAPattern):
                built.append((pattern, index))
            return index

        return build_and_record

    # core_attention looks the builder up in its own namespace at call time.
    original = core_attention.build_index
    core_attention.build_index = recording(original)
    try:
        yield built
    finally:
        core_attention.build_index = original


def msa_topk_margin(pattern: MSAPattern) -> float:
    """The smallest gap, over the rows that have to choose (more visible blocks than
    ``topk``), between a row's topk-th best block score (its own block first) and the next:
    ``msa_select_blocks``' ranking, on the whole sequence."""
    cfg, q_idx, k_idx = pattern.config, pattern.q_idx.detach(), pattern.k_idx.detach()
    seq = q_idx.shape[1]
    positions = torch.arange(seq)
    scores = block_max_scores(q_idx, positions, k_idx, positions, -(-seq // cfg.block_size), cfg.block_size)
    own = (positions // cfg.block_size).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
    ranked = scores.scatter(-1, own, float("inf")).sort(dim=-1, descending=True).values
    kth, after = ranked[..., cfg.topk - 1], ranked[..., cfg.topk]
    return (kth - after)[after > float("-inf")].min().item()


def reference(kind: str) -> dict:
    """cp_size 1: the state, loss and gradients (and MSA's recorded KL and per-layer
    selection) every CP run is compared with."""
    get_attention_metrics_tracker().clear()
    model = build_model(attention_config(kind))
    with recorded_msa_selections() as selections:
        loss, grads = loss_and_grads(model, full_batch())
    ref = {"state": model.state_dict(), "loss": loss, "grads": grads}
    if kind == "msa":
        ref["kl"] = recorded_kl()
        assert len(selections) == model.config.num_layers, f"{len(selections)} MSA selections recorded"
        for number, (pattern, _) in enumerate(selections, start=1):
            margin = msa_topk_margin(pattern)
            assert margin > MSA_MIN_MARGIN, (
                f"MSA layer {number}: a row's top-k is {margin:.2e} from a tie, not above MSA_MIN_MARGIN = "
                f"{MSA_MIN_MARGIN} (the rounding a CP run may add): choose another SEED"
            )
        ref["selection"] = [index.blocks for _, index in selections]
    return ref


def compute_references(rank, world, path):
    init_megatron()
    refs = {kind: reference(kind) for kind in PATTERNS}
    # The patterns must matter, or parity would not test them.
    for kind in PATTERNS:
        if kind != "dense":
            gap = (refs[kind]["loss"] - refs["dense"]["loss"]).abs()
            assert gap > 1e-4, f"{kind} loss equals the dense loss ({gap}): the pattern selects everything"
    torch.save(refs, path)


def assert_matches(name: str, loss, grads, ref) -> None:
    torch.testing.assert_close(loss, ref["loss"], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} loss: {m}")
    assert grads.keys() == ref["grads"].keys()
    for param, grad in grads.items():
        want = ref["grads"][param]
        tol = 1e-5 * want.abs().max().item() + 1e-7
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=tol, msg=lambda m, p=param: f"{name} {p}: {m}")


def check_cp_parity(rank, world, path, runs):
    """``runs``: (kind, layout, hierarchy) triples, each compared with its cp_size-1 reference;
    ``hierarchy``: None (flat), or the exchange over nodes of 2 ranks, ``ring`` or ``allgather``.

    Every case goes through Megatron's batch split and RoPE slice (patched for the layout), so
    the whole model runs in the layout's token order as in training. Consecutive cases differ
    in layout, so removing and re-applying the patches in one process is exercised too. MSA's
    selections are compared first, so a changed selection is named as such."""
    refs = torch.load(path, weights_only=False)
    hier_sizes = [2, world // 2] if world >= 4 else None
    init_megatron(world, hier_sizes)
    for kind, layout, hierarchy in runs:
        # Whole tiles of the ring's kernels, which the config requires: MoBA's are its chunks.
        stripe = 32 if kind == "moba" else 16
        attention = attention_config(
            kind, layout=layout, stripe=stripe, hierarchy=2 if hierarchy else None, kv_exchange=hierarchy or "auto"
        )
        use_layout(layout, stripe, attention.layout_node_size)
        ref = refs[kind]
        model = build_model(attention)
        model.load_state_dict(ref["state"])
        get_attention_metrics_tracker().clear()
        with recorded_msa_selections() as selections:
            loss, grads = loss_and_grads(model, local_batch())
        name = f"{kind} cp={world} {layout}{f' 2x2 {hierarchy}' if hierarchy else ''}"
        if kind == "msa":
            check_msa_selections(name, selections, ref["selection"], attention)
        assert_matches(name, loss, grads, ref)
        if kind == "msa":
            torch.testing.assert_close(
                recorded_kl(), ref["kl"], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n} KL: {m}"
            )


def check_msa_selections(name, selections, want, attention) -> None:
    """The blocks each layer selected for this rank's rows equal the reference's: checked
    before the gradients, which a different selection changes everywhere."""
    group = parallel_state.get_context_parallel_group()
    rows = attention.cp_layout(group.size(), SEQ).positions(dist.get_rank(group))
    assert len(selections) == len(want), f"{name}: {len(selections)} MSA selections recorded, not {len(want)}"
    for number, ((_, index), blocks) in enumerate(zip(selections, want, strict=True), start=1):
        differ = (index.blocks[:, rows] != blocks[:, rows]).any(-1)
        assert not differ.any(), (
            f"{name} layer {number}: {int(differ.sum())} (sample, query, group) rows select other blocks than "
            "at cp_size 1"
        )


def check_hierarchy_rank_order(rank, world):
    """Hierarchical groups of the right sizes ([2, 2]) but the wrong ranks (inner groups across
    nodes) are refused by name: the ring would pair ranks that do not hold neighbouring
    stripes."""
    init_megatron(world, [2, world // 2])
    patches.remove_patches()
    cp_group = parallel_state.get_context_parallel_group()
    # new_group is collective: every rank creates every group, in one order.
    inner = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])][rank % 2]
    outer = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2]
    config = transformer_config(attention_config("dense", hierarchy=2))
    groups = ProcessGroupCollection(
        tp=parallel_state.get_tensor_model_parallel_group(), cp=cp_group, hcp=[inner, outer]
    )
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    try:
        SparseCoreAttention(**kwargs, pg_collection=groups)
        raise AssertionError("hierarchical groups in the wrong rank order were accepted")
    except ValueError as e:
        assert "hierarchical_context_parallel_sizes" in str(e) and "consecutive CP ranks" in str(e), e
    # Megatron's own groups of the same sizes are accepted.
    SparseCoreAttention(**kwargs, pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp", "cp", "hcp"]))


def check_cp4(rank, world, path, runs):
    """One spawn for the cp_size-4 parity and group checks (spawning costs seconds each)."""
    check_cp_parity(rank, world, path, runs)
    check_hierarchy_rank_order(rank, world)


def check_dense_equals_megatron(rank, world):
    """The dense type against Megatron's local spec (DotProductAttention), same weights."""
    init_megatron()
    ours = build_model(attention_config("dense"))
    theirs = build_model(None, spec=get_gpt_layer_local_spec())
    assert isinstance(theirs.decoder.layers[0].self_attention.core_attention, DotProductAttention)
    theirs.load_state_dict(ours.state_dict())
    loss, grads = loss_and_grads(theirs, full_batch())
    assert_matches("dense vs DotProductAttention", *loss_and_grads(ours, full_batch()), {"loss": loss, "grads": grads})


def _msa_config(warmup_steps: int = 0):
    return MTrainingAttentionConfig.from_dict(
        {"type": "msa", "msa": {**PATTERNS["msa"]["msa"], "warmup_steps": warmup_steps}}
    )


def _capture_core_attention_inputs(model) -> dict:
    """layer number -> (query, key, layer input) of the latest forward, as the core attention saw them."""
    seen = {}

    def hook(module, args, kwargs):
        # Recompute passes the layer input as an argument (index_input is cleared by then).
        hidden = kwargs.get("index_input")
        hidden = module.index_input if hidden is None else hidden
        seen[module.layer_number] = (args[0].detach(), args[1].detach(), hidden)

    for layer in model.decoder.layers:
        layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _scaled_backward(model, scale: float) -> dict[str, torch.Tensor]:
    """Gradients of the mean token loss with the MSA loss scale set through the config hook."""
    batch = full_batch()
    model.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
    model.config.experimental_attention_variant_loss_scale_func(torch.tensor([scale]))
    loss.backward()
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def _independent_kl(model, seen, dense: bool):
    """Per layer: the KL of msa_kl_loss on the captured inputs with the layer's index weights,
    and its gradient in those weights (times kl_coeff)."""
    cfg = model.config.mtraining_attention.msa
    out = {}
    for number, (query, key, hidden) in seen.items():
        branch = model.decoder.layers[number - 1].self_attention.core_attention.index_branch
        wq, wk = (w.detach().clone().requires_grad_() for w in (branch.linear_q.weight, branch.linear_k.weight))
        x = hidden.transpose(0, 1)
        q_idx = (x @ wq.T).unflatten(-1, (key.shape[2], cfg.index_head_dim))
        k_idx = (x @ wk.T).unsqueeze(2)
        q, k = query.transpose(0, 1), key.transpose(0, 1)
        b, s, hq, d = q.shape
        index = DenseIndex(b, hq, s) if dense else msa_select_blocks(q_idx, k_idx, cfg, hq)
        kl = msa_kl_loss(q, k, q_idx, k_idx, index, 1.0 / math.sqrt(d))
        out[number] = (kl.detach(), *torch.autograd.grad(kl * cfg.kl_coeff, [wq, wk]))
    return out


class _Writer:
    """Collects what a TensorBoard SummaryWriter would be given."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name, iteration] = float(value)


def _check_sparse_kl(model, seen, grads, kl_recorded) -> None:
    """The index projections' gradients and each layer's recorded KL equal the independent
    sparse-phase KL of the captured inputs."""
    for number, (kl, dwq, dwk) in _independent_kl(model, seen, dense=False).items():
        prefix = f"decoder.layers.{number - 1}.self_attention.core_attention.index_branch"
        torch.testing.assert_close(grads[f"{prefix}.linear_q.weight"], dwq, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(grads[f"{prefix}.linear_k.weight"], dwk, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(kl_recorded[number - 1], kl, rtol=1e-5, atol=1e-7)


def _check_dist_checkpoint(model) -> None:
    """An MSA model round-trips through dist_checkpointing; a dense checkpoint loads into it,
    leaving the index projections at their initialisation."""
    params = dict(model.named_parameters())
    with tempfile.TemporaryDirectory() as ckpt:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        fresh = build_model(_msa_config())
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
        for n, p in fresh.named_parameters():
            assert torch.equal(p, params[n]), f"{n} did not round-trip"
    with tempfile.TemporaryDirectory() as ckpt:
        dense = build_model(attention_config("dense"))
        dist_checkpointing.save(dense.sharded_state_dict(), ckpt)
        fresh = build_model(_msa_config())
        init = {n: p.detach().clone() for n, p in fresh.named_parameters() if "index_branch" in n}
        # Megatron's "unexpected": keys the model asks for that the checkpoint lacks.
        strict = StrictHandling.RETURN_UNEXPECTED
        state, _, unexpected = dist_checkpointing.load(fresh.sharded_state_dict(), ckpt, strict=strict)
        assert unexpected == {f"decoder.layers.{n.split('layers.0.')[-1]}" for n in init if "layers.0." in n}
        missing = fresh.load_state_dict(state, strict=False).missing_keys
        assert sorted(missing) == sorted(init), missing
        for n, p in fresh.named_parameters():
            if n in init:
                assert torch.equal(p, init[n]) and 0.5 * INIT_STD < p.std() < 1.5 * INIT_STD, n
            else:
                assert torch.equal(p, dense.get_parameter(n)), n


def check_msa_kl_and_checkpoint(rank, world):
    init_megatron()
    tracker = get_attention_metrics_tracker()
    model = build_model(_msa_config())
    seen = _capture_core_attention_inputs(model)
    index_names = [n for n, _ in model.named_parameters() if "index_branch" in n]
    assert len(index_names) == 4, index_names

    # Index projections are checkpointed, in Megatron's stacked layer keys (decoder.layers.*).
    sharded = model.sharded_state_dict()
    for number, layer in enumerate(model.decoder.layers):
        for proj in ("linear_q", "linear_k"):
            name = f"self_attention.core_attention.index_branch.{proj}.weight"
            tensor = sharded[f"decoder.layers.{number}.{name}"]
            assert tensor.key == f"decoder.layers.{name}", tensor.key
            assert tensor.data is layer.get_parameter(name)

    _check_dist_checkpoint(model)

    # The KL reaches the index weights only through the autoscaler, scaled by the hook.
    tracker.clear()
    g1 = _scaled_backward(model, 1.0)
    kl_recorded = tracker.metrics["msa_kl_loss"].values.clone()
    writer = _Writer()
    assert "msa_kl_loss" in tracker.report(loss_scale=1.0, iteration=7, writer=writer, num_layers=2)
    assert writer.scalars.keys() == {("msa_kl_loss", 7)}, writer.scalars
    assert abs(writer.scalars["msa_kl_loss", 7] - kl_recorded.mean().item()) < 1e-6, writer.scalars
    g3, g0 = _scaled_backward(model, 3.0), _scaled_backward(model, 0.0)
    for n in g1:
        if n in index_names:
            assert g1[n].abs().max() > 0, n
            torch.testing.assert_close(g3[n], 3 * g1[n], msg=lambda m, n=n: f"{n}: {m}")
            assert not g0[n].any(), n
        else:  # the index branch reads the layer input detached: the backbone never sees the KL
            assert torch.equal(g1[n], g0[n]) and torch.equal(g3[n], g0[n]), n
    _check_sparse_kl(model, seen, g1, kl_recorded)

    # Selective recompute of the core attention gives the same gradients, and the recompute
    # takes the first run's selection instead of selecting again.
    recomputed = build_model(_msa_config(), recompute_granularity="selective", recompute_modules=["core_attn"])
    recomputed.load_state_dict(model.state_dict())
    assert recomputed.decoder.layers[0].self_attention.checkpoint_core_attention
    selections, select = [], msa_pattern.msa_select_blocks
    msa_pattern.msa_select_blocks = lambda *args, **kwargs: selections.append(1) or select(*args, **kwargs)
    try:
        for n, g in _scaled_backward(recomputed, 1.0).items():
            torch.testing.assert_close(g, g1[n], rtol=1e-5, atol=1e-8, msg=lambda m, n=n: f"recompute {n}: {m}")
    finally:
        msa_pattern.msa_select_blocks = select
    assert len(selections) == 2, selections  # once per layer
    assert not any(len(layer.self_attention.core_attention._kept_indexes) for layer in recomputed.decoder.layers)

    # Warmup: dense main branch, the KL over every visible token trains the indexer.
    warm = build_model(_msa_config(warmup_steps=5))
    warm.load_state_dict(model.state_dict())
    batch = full_batch()
    try:
        warm(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        raise AssertionError("MSA warmup ran without the training iteration")
    except ValueError as e:
        assert "mtraining_iteration" in str(e), e
    dense = build_model(attention_config("dense"))
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if "index_branch" not in k})
    dense_loss = dense(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
    set_training_iteration(warm.config, 4)
    seen = _capture_core_attention_inputs(warm)
    g_warm = _scaled_backward(warm, 1.0)
    warm_loss = warm(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
    torch.testing.assert_close(warm_loss, dense_loss, rtol=1e-6, atol=1e-7)
    for number, (_, dwq, dwk) in _independent_kl(warm, seen, dense=True).items():
        prefix = f"decoder.layers.{number - 1}.self_attention.core_attention.index_branch"
        torch.testing.assert_close(g_warm[f"{prefix}.linear_q.weight"], dwq, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(g_warm[f"{prefix}.linear_k.weight"], dwk, rtol=1e-4, atol=1e-7)
    set_training_iteration(warm.config, 5)
    sparse_loss = warm(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
    assert (sparse_loss - dense_loss).abs() > 1e-5, "after warmup the main branch is still dense"


def check_cpu_patches_ddp_and_optimizer(rank, world):
    """Megatron DDP + get_megatron_optimizer take a step on the CPU, index projections included."""
    init_megatron()
    assert patches.apply_cpu_patches(), "apply_cpu_patches is not active without CUDA"
    assert torch.tensor([1.0], device="cuda").device.type == "cpu"
    model = build_model(_msa_config())
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [ddp])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = full_batch()
    losses = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        model.config.experimental_attention_variant_loss_scale_func(torch.ones(1))
        loss.backward()
        ddp.finish_grad_sync()
        assert optimizer.step()[0], "the optimizer skipped its step"
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), f"{n} did not change"


def _whole_sequence(x: torch.Tensor, layout: ContextParallelLayout | None) -> torch.Tensor:
    """``[B, L, ...]`` of this CP rank -> the whole sequence (itself without a layout)."""
    if layout is None:
        return x
    parts = [torch.empty_like(x) for _ in range(layout.cp_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel_state.get_context_parallel_group())
    return layout.unshard(parts, dim=1)


def check_msa_recall_metrics(rank, world):
    """A measured MSA model records ``msa_block_recall`` / ``msa_score_recall`` per layer on
    flagged micro-batches, in warmup and after, with the flag's weight: ``msa_recall`` of the
    layer's whole-sequence inputs (summed over the CP ranks' shares), once per micro-batch
    (recompute adds nothing, an unflagged step nothing), and the tracker reports them beside
    the KL; ``index_recall_heldout`` likewise: ``heldout_recall`` of the rows the flag's seed
    draws (1 in warmup, where attention is dense). At CP 1 (each rank its own model) and CP 2
    (zigzag)."""
    patches.remove_patches()
    for cp in (1, world):
        init_megatron(cp)
        group = parallel_state.get_context_parallel_group()
        layout = ContextParallelLayout("zigzag", cp, SEQ) if cp > 1 else None
        config = transformer_config(_msa_config(warmup_steps=1), recompute_granularity="selective")
        config.recompute_modules = ["core_attn"]
        model = GPTModel(config, measured(get_gpt_decoder_block_spec(config)), VOCAB, SEQ)
        assert model.decoder.layers[0].self_attention.checkpoint_core_attention
        seen = _capture_core_attention_inputs(model)
        tracker = get_attention_metrics_tracker()
        cfg = config.mtraining_attention.msa
        batch = local_batch() if cp > 1 else full_batch()
        for iteration, weight in ((0, 2), (1, 3), (2, 0)):
            tracker.clear()
            set_training_iteration(config, iteration)
            collect_attention_metrics(config, weight, seed=iteration)
            loss_and_grads(model, batch)  # recomputes the core attention in the backward
            if not weight:
                for name in (BLOCK_RECALL_METRIC, SCORE_RECALL_METRIC, HELDOUT_RECALL_METRIC):
                    assert not tracker.metrics[name].values.any(), f"an unflagged step recorded {name}"
                continue
            got = {}
            for name in (BLOCK_RECALL_METRIC, SCORE_RECALL_METRIC, HELDOUT_RECALL_METRIC):
                got[name] = tracker.metrics[name].values.clone()
                dist.all_reduce(got[name], group=group)
            for number, (query, key, hidden) in seen.items():
                branch = model.decoder.layers[number - 1].self_attention.core_attention.index_branch
                q_idx, k_idx = (_whole_sequence(t, layout) for t in branch(hidden.transpose(0, 1)))
                q, k = (_whole_sequence(t.transpose(0, 1), layout) for t in (query, key))
                index = None if cfg.in_warmup(iteration) else msa_select_blocks(q_idx, k_idx, cfg, q.shape[2])
                block, score = msa_recall(q, k, q_idx, k_idx, cfg, index, 64, 1.0 / math.sqrt(q.shape[-1]))
                name = f"cp={cp} iteration {iteration} layer {number}"
                for metric, want in ((BLOCK_RECALL_METRIC, block), (SCORE_RECALL_METRIC, score)):
                    value = got[metric][number - 1]
                    torch.testing.assert_close(value, want.mean() * weight, msg=lambda m, n=f"{name} {metric}": n + m)
                    assert 0 < value < weight, f"{name} {metric}: {value} (weight {weight})"
                rows = heldout_rows(SEQ, [], 4, 16, seed=iteration)
                dense = DenseIndex(q.shape[0], q.shape[2], SEQ)
                heldout = heldout_recall(q, k, dense if index is None else index, rows)
                value = got[HELDOUT_RECALL_METRIC][number - 1]
                torch.testing.assert_close(value, heldout.mean() * weight, msg=lambda m, n=name: f"{n} heldout {m}")
                assert (value == weight) if index is None else (0 < value < weight), (name, value, weight)
        writer = _Writer()
        set_training_iteration(config, 1)
        tracker.clear()
        collect_attention_metrics(config, 1)
        loss_and_grads(model, batch)
        text = tracker.report(loss_scale=1.0, iteration=3, writer=writer, num_layers=2)
        for name in (KL_METRIC, BLOCK_RECALL_METRIC, SCORE_RECALL_METRIC):
            assert name in text and (name, 3) in writer.scalars, (text, writer.scalars)


def check_msa_fused_kl_in_layer(rank, world):
    """The layer with its KL on the fused kernels (the dispatch's decision forced, so the
    attention stays on the fast reference; Triton's interpreter on a CPU): the index
    weights' gradients and the KL recorded from the backward equal the PyTorch reference's;
    the value is recorded once per layer and backward, under recompute too."""
    from megatron_mtraining.sparse import msa as msa_module
    from megatron_mtraining.sparse.dispatch import Decision
    from megatron_mtraining.sparse.kernels.msa_kl import loss as fused

    init_megatron()
    msa_module.kl_kernel = lambda *args, **kwargs: Decision("msa_kl", "forced by the test")
    calls, fused_kl = [], fused.fused_kl
    fused.fused_kl = lambda *args, **kwargs: calls.append(1) or fused_kl(*args, **kwargs)
    tracker = get_attention_metrics_tracker()
    model = build_model(_msa_config())
    seen = _capture_core_attention_inputs(model)
    tracker.clear()
    g1 = _scaled_backward(model, 1.0)
    kl_recorded = tracker.metrics["msa_kl_loss"].values.clone()
    assert len(calls) == 2, calls  # one per layer
    _check_sparse_kl(model, seen, g1, kl_recorded)
    recomputed = build_model(_msa_config(), recompute_granularity="selective", recompute_modules=["core_attn"])
    recomputed.load_state_dict(model.state_dict())
    tracker.clear()
    for n, g in _scaled_backward(recomputed, 1.0).items():
        torch.testing.assert_close(g, g1[n], rtol=1e-5, atol=1e-8, msg=lambda m, n=n: f"recompute {n}: {m}")
    torch.testing.assert_close(tracker.metrics["msa_kl_loss"].values, kl_recorded, rtol=1e-6, atol=1e-8)


def check_msa_kl_with_attention_in_layer(rank, world):
    """The layer with its attention and KL in one function on the KV-outer kernels
    (``msa_kl_with_attention`` forced; Triton's interpreter on a CPU), the KL's teacher
    from the attention's backward: every gradient, and the KL recorded from the backward,
    equal those of the PyTorch path (attention and KL apart), under recompute too."""
    from megatron_mtraining.sparse import msa as msa_module
    from megatron_mtraining.sparse.dispatch import Decision
    from megatron_mtraining.sparse.kernels.msa_kl import kv_attention

    init_megatron()
    tracker = get_attention_metrics_tracker()
    model = build_model(_msa_config())
    tracker.clear()
    want = _scaled_backward(model, 1.0)
    kl_want = tracker.metrics["msa_kl_loss"].values.clone()
    decide = msa_module.kl_kernel
    msa_module.kl_kernel = lambda *a, with_attention=False, **kw: (
        Decision("msa_kl_with_attention", "forced by the test") if with_attention else decide(*a, **kw)
    )
    calls, joint = [], kv_attention.kv_outer_msa
    kv_attention.kv_outer_msa = lambda *args, **kwargs: calls.append(1) or joint(*args, **kwargs)
    recomputed = build_model(_msa_config(), recompute_granularity="selective", recompute_modules=["core_attn"])
    for built in (model, recomputed):
        built.load_state_dict(model.state_dict())
        tracker.clear()
        calls.clear()
        for n, g in _scaled_backward(built, 1.0).items():
            torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(tracker.metrics["msa_kl_loss"].values, kl_want, rtol=1e-5, atol=1e-8)
        # Once a layer: under recompute the first forward runs without grad, the KL joins the recompute.
        assert len(calls) == 2, calls


def check_msa_cp_parity_on_kl_kernels(rank, world, path):
    """``check_cp_parity`` for MSA with the context-parallel KL's steps on the fused kernels
    (the dispatch's decision forced where the layout allows them, so the attention stays on
    the fast reference; Triton's interpreter on a CPU): the loss, the gradients and the
    recorded KL equal the cp_size-1 reference's, and the kernels ran."""
    from megatron_mtraining.context_parallel import msa_kl
    from megatron_mtraining.sparse.dispatch import Decision
    from megatron_mtraining.sparse.kernels.msa_kl import loss as fused

    decide = msa_kl.kl_kernel

    def forced(*args, whole_blocks=None, **kwargs):
        return Decision("msa_kl", "forced by the test") if whole_blocks else decide(*args, **kwargs)

    msa_kl.kl_kernel = forced
    calls = []
    for name in ("kl_fused", "kl_dk"):  # a step's backward in one pass or two (deterministic mode)
        launch = getattr(fused, name)
        setattr(fused, name, lambda *args, _launch=launch, **kwargs: calls.append(1) or _launch(*args, **kwargs))
    check_cp_parity(rank, world, path, [("msa", "striped", None), ("msa", "zigzag", None)])
    assert calls, "no ring step ran the fused KL kernels"


def check_packed_documents_equal_separate_samples(rank, world, layout_kind="striped"):
    """A packed sample of three documents (an EOD closing each but the last) gives every token
    the loss it gets when each document is its own sample, and the same gradients for the
    summed loss: THD (positions restart) and sbhd (positions run on; RoPE is relative, so the
    same attention), dense attention, at CP 1 and at CP ``world`` in ``layout_kind`` (the
    sample split as one sequence by Megatron's patched batch split, the boundaries global;
    ``balanced`` placed by them, drawn until that differs from striping)."""
    from megatron_mtraining.training.documents import packed_seq_params

    eod = VOCAB - 1
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    while True:
        ends = sorted(torch.randperm(SEQ - 2 * SEQ // 8, generator=gen)[:2].tolist())
        ends = [SEQ // 8 + ends[0], SEQ // 8 + ends[1] + 1]  # documents of at least one token
        bounds = torch.tensor([0, *ends, SEQ], dtype=torch.int32)
        balanced = ContextParallelLayout("balanced", world, SEQ, stripe=16, documents=bounds)
        striped = ContextParallelLayout("striped", world, SEQ, stripe=16)
        if layout_kind != "balanced" or not torch.equal(balanced.positions(0), striped.positions(0)):
            break
    tokens = torch.randint(0, VOCAB - 1, (1, SEQ), generator=gen)
    tokens[0, [e - 1 for e in ends]] = eod
    labels = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    dist.broadcast(tokens, 0)
    dist.broadcast(labels, 0)
    bounds = [0, *(torch.nonzero(tokens[0] == eod).flatten() + 1).tolist(), SEQ]  # rank 0's draw
    init_megatron(1)
    model = build_model(attention_config("dense"))
    state = model.state_dict()

    def run(m, tok, lab, packed=None):
        m.zero_grad(set_to_none=True)
        positions = torch.arange(tok.shape[1]).view(1, -1)
        per_token = m(tok, positions, None, labels=lab, packed_seq_params=packed)
        per_token.float().sum().backward()
        return per_token.detach().float(), {n: p.grad.clone() for n, p in m.named_parameters()}

    parts = [run(model, tokens[:, a:b], labels[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    want = torch.cat([p[0] for p in parts], dim=1)
    want_grads = {n: sum(p[1][n] for p in parts) for n in parts[0][1]}
    for cp in (1, world):
        init_megatron(cp)
        if cp > 1:
            use_layout(layout_kind, 16)
        cp_model = build_model(
            attention_config("dense", layout=layout_kind, stripe=16) if cp > 1 else attention_config("dense")
        )
        cp_model.load_state_dict(state)
        for thd in (True, False):
            packed = packed_seq_params(tokens, eod, reset_position_ids=thd)
            assert torch.equal(packed.cu_seqlens_q, torch.tensor(bounds, dtype=torch.int32))
            tok, lab, expected = tokens, labels, want
            if cp > 1:
                # As the training step splits it: the boundaries ride in the batch.
                group = parallel_state.get_context_parallel_group()
                split = megatron_utils.get_batch_on_this_cp_rank(
                    {"tokens": tokens, "labels": labels, "want": want, "cu_seqlens": packed.cu_seqlens_q},
                    is_hybrid_cp=False,
                    cp_group=group,
                    use_per_sequence_balancing=True,
                )
                tok, lab, expected = split["tokens"], split["labels"], split["want"]
                layout = ContextParallelLayout(layout_kind, cp, SEQ, stripe=16, documents=packed.cu_seqlens_q)
                assert torch.equal(tok, layout.shard(tokens, dist.get_rank(group)))
            got, grads = run(cp_model, tok, lab, packed)
            where = f"cp={cp} {layout_kind} {'thd' if thd else 'sbhd'} documents {bounds}"
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
            if cp > 1:
                for g in grads.values():
                    dist.all_reduce(g)
            for n, g in grads.items():
                # Relative to the tensor's scale: sbhd rotates by other absolute angles (the same
                # relative ones), so its fp32 rounding differs from the separate samples'.
                err = (g - want_grads[n]).abs().max() / want_grads[n].abs().max()
                assert err < 1e-3, f"{where} {n}: max error {err:.2e} of the largest gradient"
        if cp > 1:
            patches.remove_patches()


def check_layer_host_reads(rank, world, kind, want):
    """Host reads (``host_reads.HostReads``) of a one-layer GPT's training step with ``kind``'s
    attention on the Triton kernels (``MTRAINING_ATTENTION_BACKEND=triton``, interpreted on a
    CPU) under full recompute, as ``bench_training.py`` runs it, each ``want[part]``: the
    forward (the layer under ``no_grad``), the backward (the layer again, with the index the
    forward kept, then its backward), and what a logging step's metrics add to the forward
    (nothing to the backward). ``kind`` ending in ``-docs``: a sample of two packed documents
    (THD, as ``reset_attention_mask`` gives them), each with its own sparse index."""
    from host_reads import HostReads

    from megatron_mtraining.sparse.kernels.block_bar import attention as block_bar
    from megatron_mtraining.training.documents import packed_seq_params

    pattern, packed = kind.removesuffix("-docs"), kind.endswith("-docs")
    assert os.environ.get("MTRAINING_ATTENTION_BACKEND") == "triton"
    init_megatron()
    launches = collections.Counter()

    def counted(name, launch):
        def counting(*args, **kwargs):
            launches[name] += 1
            return launch(*args, **kwargs)

        return counting

    for name in ("kernel_forward", "kernel_backward"):
        setattr(block_bar, name, counted(name, getattr(block_bar, name)))
    # With documents, every document gets statistics.
    extra = {pattern: {**PATTERNS[pattern][pattern], "dense_below": 0}} if packed else {}
    attention = attention_config(pattern, **extra)
    config = transformer_config(
        attention, num_layers=1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
    )  # fmt: skip
    model = GPTModel(config, measured(get_gpt_decoder_block_spec(config)), VOCAB, SEQ)
    core = model.decoder.layers[0].self_attention.core_attention
    seq = SEQ // 2  # the kernels' interpretation is most of the time
    tokens = full_batch()["tokens"][:1, :seq].clone()
    positions = torch.arange(seq).view(1, -1)
    if packed:
        tokens[tokens == VOCAB - 1] = 0
        tokens[0, 2 * seq // 5 - 1] = VOCAB - 1  # two documents: an EOD closes the first
    set_training_iteration(config, 0)
    reads = {}
    for step, weight in enumerate((0, 1)):
        get_attention_metrics_tracker().clear()
        collect_attention_metrics(config, weight, seed=step)
        # Each micro-batch's boundaries are a new tensor, read on the host once (its first layer).
        documents = packed_seq_params(tokens, VOCAB - 1, reset_position_ids=True) if packed else None
        with HostReads() as forward:
            # A loss of the logits: Megatron's cross entropy, which training replaces with the
            # fused one at TP 1, masks by indexing.
            loss = model(tokens, positions, None, packed_seq_params=documents).float().square().mean()
        with HostReads() as backward:
            loss.backward()
        reads[weight] = (forward.count, backward.count)
        # The kernels ran, in the forward and the recompute; the recompute took the kept index.
        assert launches == {"kernel_forward": 2 * step + 2, "kernel_backward": step + 1}, (kind, launches)
        assert not len(core._kept_indexes), kind
    recorded = get_attention_metrics_tracker().metrics
    for name in (FRACTION_METRIC, RECALL_METRIC, HELDOUT_RECALL_METRIC):
        assert bool(recorded[name].values.any()), (kind, name)
    got = {"forward": reads[0][0], "backward": reads[0][1], "metrics": reads[1][0] - reads[0][0]}
    assert got == want and reads[1][1] == reads[0][1], (kind, reads)


def _training_setup(model, clip_grad: float):
    """Megatron DDP and optimizer around ``model`` with the training loop's hooks on its config
    (``megatron.training``'s ``setup_model_and_optimizer`` / ``train``): the loss scale reaches
    MSA's KL through Megatron's schedule, and ``finalize_model_grads`` finishes the gradient
    sync. Adam as the study trains: betas (0.9, 0.95), decoupled weight decay 0.1."""
    from megatron.core.distributed import finalize_model_grads

    patches.apply_cpu_patches(training=True)  # gradient clipping on CPU gradients
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=3e-3, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1, clip_grad=clip_grad
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    model.config.grad_scale_func = optimizer.scale_loss
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp, optimizer


def _microbatches(step: int, count: int):
    """Fresh random micro-batches of one sequence for a step (the same for every model)."""
    gen = torch.Generator().manual_seed(SEED + 1000 + step)
    for _ in range(count):
        tokens = torch.randperm(VOCAB, generator=gen)[:SEQ].view(1, SEQ)
        yield {"tokens": tokens, "labels": torch.randint(0, VOCAB, (1, SEQ), generator=gen)}


def _train_step(ddp, optimizer, step: int, microbatches: int) -> dict:
    """One training iteration as ``megatron.training.train_step`` runs it: Megatron's schedule
    over the micro-batches with the plugin's per-token loss triple, then the optimizer (grad
    norm, clipping, Adam). Returns the reported loss, the gradients the optimizer stepped on
    (``main_grad``), the grad norm, and the index branch's share of it."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        positions = torch.arange(SEQ).view(1, SEQ)
        output = model(batch["tokens"], positions, None, labels=batch["labels"])

        def loss_func(output_tensor):
            # training.forward_step.loss_func: (loss sum, token count, report).
            loss = output_tensor.float().sum()
            tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
            return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

        return output, loss_func

    model = ddp.module
    set_training_iteration(model.config, step)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(list(_microbatches(step, microbatches))),
        model=[ddp],
        num_microbatches=microbatches,
        seq_length=SEQ,
        micro_batch_size=1,
    )
    total = torch.stack([r["lm loss"] for r in reports]).sum(0)
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    index = [g for n, g in grads.items() if "index_branch" in n]
    index_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in index])).item() if index else 0.0
    ok, grad_norm, _ = optimizer.step()
    assert ok, f"step {step}: the optimizer skipped its step"
    return {"loss": (total[0] / total[1]).item(), "grads": grads, "grad_norm": grad_norm, "index_norm": index_norm}


def check_msa_selecting_every_block_trains_as_dense(rank, world):
    """MSA with ``topk`` = every block (its main branch is dense attention once the warmup
    ends) trained through Megatron's schedule, DDP and optimizer from the same weights on the
    same data as dense: after one warmup step (dense main branch, dense KL) and three sparse
    steps, with two micro-batches a step (the KL's loss scale divides by their count), the
    reported loss and every main weight's gradient and value equal dense's to fp32 rounding,
    while the KL trains the index branch. So nothing but the selection (the KL and its loss
    scale, the index parameters in the optimizer, the sparse forward and backward) changes the
    main weights' update. Gradient clipping is off: the norm it divides by holds the index
    branch's gradients too, by Megatron's design (asserted each step), so with clipping active
    MSA's main weights take a slightly smaller step. The same MSA with ``topk`` 4 must differ,
    or the comparison could not see the pattern."""
    init_megatron()
    blocks = SEQ // PATTERNS["msa"]["msa"]["block_size"]
    steps, microbatches = 4, 2

    def msa(topk):
        return MTrainingAttentionConfig.from_dict(
            {"type": "msa", "msa": {**PATTERNS["msa"]["msa"], "topk": topk, "warmup_steps": 1}}
        )

    dense = build_model(attention_config("dense"))
    start = {n: p.detach().clone() for n, p in dense.named_parameters()}

    def from_dense(attention):
        model = build_model(attention)
        # Only the fresh index projections are missing from dense's weights, as on a switch on load.
        missing = model.load_state_dict(dense.state_dict(), strict=False).missing_keys
        assert missing and all("index_branch" in n for n in missing), missing
        return model

    every, sparse = from_dense(msa(blocks)), from_dense(msa(4))
    runs = {name: _training_setup(model, clip_grad=0.0) for name, model in (("dense", dense), ("msa", every))}
    tracker = get_attention_metrics_tracker()
    dense_losses = []
    for step in range(steps):
        tracker.clear()
        with recorded_msa_selections() as selections:
            got = {name: _train_step(ddp, opt, step, microbatches) for name, (ddp, opt) in runs.items()}
        want, have = got["dense"], got["msa"]
        dense_losses.append(want["loss"])
        where = f"step {step} ({'warmup' if step == 0 else 'sparse'})"
        if step > 0:  # the sparse path ran, and every row chose every block
            assert len(selections) == microbatches * dense.config.num_layers, len(selections)
            # A row sees the blocks up to its own (the rest of its topk slots are -1).
            ids = torch.arange(blocks)
            visible = torch.where(ids.view(1, -1) <= (torch.arange(SEQ) // (SEQ // blocks)).view(-1, 1), ids, -1)
            for _, index in selections:
                chosen = index.blocks.sort(-1).values
                want_ids = visible.sort(-1).values.view(1, SEQ, 1, blocks).expand_as(chosen)
                assert torch.equal(chosen, want_ids.to(chosen.dtype)), where
        kl = tracker.metrics[KL_METRIC].values
        assert (kl > 1e-3).all(), f"{where}: the KL is too small to train the index branch: {kl}"
        assert have["index_norm"] > 1e-2 * have["grad_norm"], (where, have["index_norm"], have["grad_norm"])
        assert abs(have["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"]), (where, have["loss"], want["loss"])
        for name, grad in want["grads"].items():
            tol = 1e-5 * grad.abs().max().item() + 1e-9
            torch.testing.assert_close(
                have["grads"][name], grad, rtol=1e-5, atol=tol, msg=lambda m, n=f"{where} grad {name}": f"{n}: {m}"
            )
        # The norm Megatron clips by holds the main weights' and the index branch's gradients.
        assert math.isclose(have["grad_norm"] ** 2, want["grad_norm"] ** 2 + have["index_norm"] ** 2, rel_tol=1e-5)
        for name, param in dense.named_parameters():
            torch.testing.assert_close(
                every.get_parameter(name), param, rtol=1e-5, atol=1e-6, msg=lambda m, n=f"{where} {name}": f"{n}: {m}"
            )
    assert all(not torch.equal(p, start[n]) for n, p in dense.named_parameters()), "a main weight did not train"
    # The control: four blocks a row train the same as dense in the warmup step, then differ.
    ddp, opt = _training_setup(sparse, clip_grad=0.0)
    control = [_train_step(ddp, opt, step, microbatches)["loss"] for step in range(2)]
    assert abs(control[0] - dense_losses[0]) <= 1e-6 * dense_losses[0], (control, dense_losses)
    assert abs(control[1] - dense_losses[1]) > 1e-3, (control, dense_losses)

"""The model and the micro-batch step that ``megatron.training.pretrain`` calls back.

* :func:`model_provider` builds Megatron's ``GPTModel`` from the parsed Megatron arguments,
  with the plugin's decoder-block spec; the attention config travels in the arguments
  (``megatron_args.ARGS_ATTRIBUTE``, a plain dict), so Megatron saves it with every checkpoint.
* :func:`forward_step` takes a micro-batch through Megatron's TP broadcast and CP split
  (``get_batch_on_this_cp_rank``, which ``megatron_mtraining.patches`` makes follow the
  configured layout) and returns Megatron's per-token loss triple through :func:`loss_func`.
  It also tells the model the training iteration (MSA warmup) and hands each training
  micro-batch to the per-interval metrics (``step_metrics``), each evaluation micro-batch
  (the model in eval mode: Megatron's ``evaluate``) to the evaluation's (``validation_metrics``).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_tp_rank
from megatron.training import get_args, get_tokenizer
from megatron.training.argument_utils import core_transformer_config_from_args

from ..megatron.config import attach_attention_config
from ..megatron.layer_specs import get_gpt_decoder_block_spec
from ..megatron.msa_loss import set_training_iteration
from ..megatron.profiler_ranges import part_range
from .attention_metrics import measured
from .chunked_loss import chunked_lm_loss
from .documents import packed_seq_params
from .finite_guard import check_losses, install_finite_guard
from .megatron_args import START_ATTRIBUTE, attention_from_args
from .run_state import STATE, device
from .step_metrics import METRICS
from .step_report import annotate_model
from .validation_metrics import VALIDATION

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron's GPT with the plugin's attention in every layer (called by ``get_model``)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    attach_attention_config(config, attention_from_args(args))
    backend = "te" if args.transformer_impl == "transformer_engine" else "local"
    spec = measured(get_gpt_decoder_block_spec(config, backend=backend, vp_stage=vp_stage))
    model = GPTModel(
        config,
        spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    if STATE.step_report is not None:
        annotate_model(model)
    if STATE.check_finite:
        install_finite_guard(model, attention_from_args(args).type)
    return model


def _get_batch(data_iterator) -> dict:
    """This rank's micro-batch: TP rank 0 reads it, Megatron broadcasts it over TP and splits it
    over CP (in the plugin's layout once the patches are applied). With
    ``reset_attention_mask`` it also carries the sample's document boundaries
    (``packed_seq_params``, see ``documents``) in place of Megatron's ``S x S`` mask."""
    args = get_args()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0 and data_iterator is not None:
        batch = next(data_iterator)
        batch = {k: batch[k].to(device(), non_blocking=True) if batch.get(k) is not None else None for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage(),
    )
    packed = None
    if args.reset_attention_mask:
        # Global boundaries from the whole sample, before the CP split scatters its tokens;
        # the split reads them too (Megatron's key), where the layout places tokens by them.
        packed = packed_seq_params(batch["tokens"], get_tokenizer().eod, args.reset_position_ids)
        batch["attention_mask"] = None
        batch["cu_seqlens"] = packed.cu_seqlens_q
    # Looked up at call time: the patches replace the function in megatron.core.utils.
    from megatron.core import utils as core_utils

    # One sequence, documents and all, as Megatron's own split does with per-sequence
    # balancing (without it, cu_seqlens in the batch would ask for its per-document zigzag).
    batch = core_utils.get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=False,
        cp_group=parallel_state.get_context_parallel_group(),
        use_per_sequence_balancing=True,
    )
    batch["packed_seq_params"] = packed
    return batch


def loss_func(loss_mask: torch.Tensor, training: bool, output_tensor: torch.Tensor):
    """Megatron's per-token loss triple: (loss sum, token count, report) over this rank's
    tokens; the loss also goes to the plugin's training or evaluation metrics."""
    losses = output_tensor.view(-1).float()
    if STATE.check_finite:
        check_losses(losses)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    (METRICS if training else VALIDATION).loss.add(loss, num_tokens)
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch forward; Megatron's schedules call the returned loss function."""
    args = get_args()
    config = get_attr_wrapped_model(model, "config")
    if model.training:
        METRICS.begin_step(config, args)
        # MSA warmup counts from the iteration this attention type started (a switch on load).
        set_training_iteration(config, max(0, args.curr_iteration - getattr(args, START_ATTRIBUTE)))
    else:
        VALIDATION.begin_micro_batch(config, args)
    with part_range("other") if STATE.step_report is not None else contextlib.nullcontext():
        batch = _get_batch(data_iterator)
        output = model(
            batch["tokens"],
            batch["position_ids"],
            batch["attention_mask"],
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            packed_seq_params=batch.get("packed_seq_params"),
            output_processor=chunked_lm_loss,
        )
    return output, partial(loss_func, batch["loss_mask"], model.training)

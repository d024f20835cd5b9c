"""A checkpoint of ``python -m megatron_mtraining.pretrain`` as the evaluation's model: the
plugin's GPT built by the training's model provider, with the attention of the config (which
need not be the checkpoint's), loaded with Megatron's ``load_checkpoint`` and run under the
config's parallelism exactly as training runs it.

:class:`MegatronModel` is the harness's ``Forward``. Every rank builds the same full sample
(the tasks are generated from a seed), Megatron's CP batch split (the training's, which the
patches make follow the layout) gives each CP rank its tokens, and the ranks' losses and
argmax predictions are put back at their global positions and summed over the CP group, so
every rank returns the whole sequence. Items are shared over the data-parallel replicas.
Pipeline parallelism is not supported (the forward is called directly, not through
Megatron's schedules).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..training.chunked_loss import row_chunks, sequence_order
from ..training.yaml_config import ConfigError, RunConfig
from .tasks import Codec


def loss_and_prediction(*, hidden_states, output_layer, output_weight, labels, scale_logits, **_):
    """A ``GPTModel`` output processor: each position's loss (fp32, from the logits in the
    compute dtype, as the training loss) and argmax token, ``[b, s]`` each, over chunks of
    rows whose logits are gathered over TP."""
    losses, predictions = [], []
    for hidden, chunk_labels in row_chunks(hidden_states, labels, output_layer, output_layer.output_size):
        logits, _ = output_layer(hidden, weight=output_weight, runtime_gather_output=True)
        logits = scale_logits(logits).transpose(0, 1)
        target = logits.gather(-1, chunk_labels.unsqueeze(-1)).squeeze(-1)
        losses.append(torch.logsumexp(logits.float(), dim=-1) - target.float())
        predictions.append(logits.argmax(dim=-1))
    return sequence_order(losses, output_layer), sequence_order(predictions, output_layer)


class MegatronModel:
    """The checkpoint ``args.load`` of ``run_config``, loaded for evaluation in this process
    (one of the launch's ranks); call it as a ``Forward``."""

    def __init__(self, run_config: RunConfig):
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.utils import get_attr_wrapped_model
        from megatron.training import get_tokenizer
        from megatron.training.checkpointing import load_checkpoint
        from megatron.training.training import get_model

        from ..megatron.msa_loss import set_training_iteration
        from ..training.checkpoint_checks import check_checkpoint
        from ..training.forward_step import model_provider
        from ..training.job import start_process

        self.args = start_process(run_config)
        # Imported once the CPU stand-ins (which replace it without CUDA) are in place.
        from megatron.training.initialize import initialize_megatron

        if self.args.pipeline_model_parallel_size > 1:
            raise ConfigError(
                f"{run_config.path}: bad value for 'megatron.pipeline_model_parallel_size': "
                f"{self.args.pipeline_model_parallel_size} (accepted: 1 for evaluation)"
            )
        # Logs an attention switch and lets a dense checkpoint load into an MSA model.
        check_checkpoint(self.args)
        initialize_megatron()
        model = get_model(model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
        self.iteration, _ = load_checkpoint(model, None, None)
        self.model = model[0].eval()
        # MSA is evaluated with its index selection: past its warmup's dense pass.
        set_training_iteration(get_attr_wrapped_model(self.model, "config"), run_config.attention.msa.warmup_steps)
        self.cp_group = parallel_state.get_context_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        tokenizer = get_tokenizer()
        vocab = tokenizer.vocab_size
        # Padded vocabulary rows are no token: a prediction of one decodes to nothing.
        self.codec = Codec(tokenizer.tokenize, lambda ids: tokenizer.detokenize([i for i in ids if i < vocab]))
        self.pad = tokenizer.eod

    @property
    def shard(self) -> tuple[int, int]:
        return dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)

    def gather(self, records: list) -> list:
        """Every data-parallel replica's records, on every rank."""
        everyone = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(everyone, records, group=self.dp_group)
        return [record for part in everyone for record in part]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core import utils as core_utils

        from ..training.run_state import device

        length = tokens.numel()
        batch = {
            "tokens": tokens.view(1, length),
            "labels": labels.view(1, length),
            "position_ids": torch.arange(length).view(1, length),
        }
        batch = {key: value.to(device()) for key, value in batch.items()}
        # Looked up at call time: the patches replace the function in megatron.core.utils.
        batch = core_utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=self.cp_group)
        losses, predictions = self.model(
            batch["tokens"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            output_processor=loss_and_prediction,
        )
        positions = batch["position_ids"].view(-1)
        loss = torch.zeros(length, dtype=torch.float32, device=positions.device)
        prediction = torch.zeros(length, dtype=torch.long, device=positions.device)
        loss[positions] = losses.view(-1).float()
        prediction[positions] = predictions.view(-1)
        if dist.get_world_size(self.cp_group) > 1:
            dist.all_reduce(loss, group=self.cp_group)
            dist.all_reduce(prediction, group=self.cp_group)
        return loss.cpu(), prediction.cpu()

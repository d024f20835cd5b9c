"""The chunked language-model loss equals Megatron's own loss, values and gradients (gloo):
a tiny GPT at TP 1 and 2, and Megatron's output layer alone under sequence parallelism (the
GPT's torch norms refuse it without Apex). Given the loss mask at TP 1 it takes the fused
linear + cross entropy, which equals the checkpointed path for a loss ``c * sum(losses * mask)``."""

from __future__ import annotations

import megatron_workers as workers
import pytest
import torch
from gloo import run

from megatron_mtraining.patches import apply_cpu_patches
from megatron_mtraining.training import chunked_loss
from megatron_mtraining.training import linear_cross_entropy as lce

ROWS_PER_CHUNK = 24  # divides neither the 256 tokens nor a TP rank's 128


def _loss_and_grads(model, batch, weights, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **kwargs)
    (loss * weights).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _init_tp(world):
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_patches()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(workers.SEED)


def _small_chunks(vocab_per_rank, sp):
    chunked_loss.CHUNK_ELEMENTS = ROWS_PER_CHUNK * workers.BATCH * vocab_per_rank * sp
    lce.CHUNK_ELEMENTS = ROWS_PER_CHUNK * workers.BATCH * vocab_per_rank
    assert chunked_loss.chunk_rows(workers.BATCH, vocab_per_rank, sp) == ROWS_PER_CHUNK


def _compare_gpt(rank, world):
    _init_tp(world)
    model = workers.build_model(workers.attention_config("dense"), tensor_model_parallel_size=world)
    _small_chunks(workers.VOCAB // world, 1)
    batch = workers.full_batch()
    gen = torch.Generator().manual_seed(7)  # the same weights on every TP rank
    weights = torch.rand(workers.BATCH, workers.SEQ, generator=gen, dtype=torch.float64).float()
    ref_loss, ref_grads = _loss_and_grads(model, batch, weights)
    loss, grads = _loss_and_grads(model, batch, weights, output_processor=chunked_loss.chunked_lm_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        # fp32 sums over the rows in another order (per chunk): ~1e-6 apart, where a row or
        # label out of place would be off by the gradients' own size.
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def _compare_sequence_parallel(rank, world):
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import ColumnParallelLinear

    _init_tp(world)
    config = workers.transformer_config(None, tensor_model_parallel_size=world, sequence_parallel=True)
    layer = ColumnParallelLinear(
        config.hidden_size, workers.VOCAB, config=config, init_method=config.init_method, bias=False
    )
    _small_chunks(workers.VOCAB // world, world)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(workers.SEQ, workers.BATCH, config.hidden_size, generator=gen)
    labels = torch.randint(0, workers.VOCAB, (workers.BATCH, workers.SEQ), generator=gen)
    weights = torch.rand(workers.BATCH, workers.SEQ, generator=gen)
    shard = hidden.chunk(world)[rank].clone().requires_grad_()

    def megatron_loss(chunk_labels, logits):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, chunk_labels.t().contiguous()).t()

    def loss_and_grads(loss_fn):
        layer.zero_grad(set_to_none=True)
        shard.grad = None
        loss = loss_fn()
        (loss * weights).sum().backward()
        return loss.detach(), shard.grad.clone(), layer.weight.grad.clone()

    def whole():
        return megatron_loss(labels, layer(shard)[0])

    def chunked():
        return chunked_loss.chunked_lm_loss(
            hidden_states=shard,
            output_layer=layer,
            output_weight=None,
            labels=labels,
            compute_language_model_loss=megatron_loss,
            scale_logits=lambda logits: logits,
        )

    for got, want in zip(loss_and_grads(chunked), loss_and_grads(whole), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _compare_fused(rank, world, tied):
    from megatron.core.models.gpt import GPTModel

    _init_tp(world)
    config = workers.transformer_config(workers.attention_config("dense"), tensor_model_parallel_size=world)
    spec = workers.get_gpt_layer_spec("dense")
    model = GPTModel(config, spec, workers.VOCAB, workers.SEQ, share_embeddings_and_output_weights=tied)
    _small_chunks(workers.VOCAB // world, 1)
    batch = workers.full_batch()
    gen = torch.Generator().manual_seed(7)  # the same mask on every TP rank
    mask = (torch.rand(workers.BATCH, workers.SEQ, generator=gen) > 0.25).float()
    weights = 0.37 * mask  # what Megatron's loss function makes of the per-token losses
    fused_calls = []
    real = chunked_loss.linear_cross_entropy

    def counted(*args, **kwargs):
        fused_calls.append(kwargs["chunk_rows"])
        return real(*args, **kwargs)

    chunked_loss.linear_cross_entropy = counted
    processor = {"output_processor": chunked_loss.chunked_lm_loss}
    ref_loss, ref_grads = _loss_and_grads(model, batch, weights, **processor)
    assert fused_calls == [], "the checkpointed path took the fused loss without a loss mask"
    loss, grads = _loss_and_grads(model, batch, weights, loss_mask=mask, **processor)
    # TP 1 fuses, 24 positions of 2 sequences per chunk.
    assert fused_calls == ([ROWS_PER_CHUNK * workers.BATCH] if world == 1 else []), fused_calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("world", [1, 2])
def test_chunked_loss_equals_megatrons(world):
    run(world, _compare_gpt)


@pytest.mark.parametrize(("world", "tied"), [(1, False), (1, True), (2, True)])
def test_fused_loss_at_tp1_equals_the_checkpointed_path(world, tied):
    run(world, _compare_fused, tied)


def test_chunked_loss_under_sequence_parallelism():
    run(2, _compare_sequence_parallel)


def test_logits_elements_counts_one_chunk():
    step = chunked_loss.chunk_rows(1, 151936, 1)
    assert chunked_loss.logits_elements(100 * step, 1, 151936, 1) == step * 151936
    assert chunked_loss.logits_elements(10, 2, 1000, 4) == 10 * 4 * 2 * 1000

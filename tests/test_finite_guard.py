"""``--check-finite`` (``training/finite_guard.py``): a NaN planted in one layer's forward or
backward is reported at that layer, with its attention type, one planted in the gradient
from the model's head at the head, and a clean model passes; with and without activation
recomputation (gloo, one process)."""

from __future__ import annotations

import megatron_workers as workers
import pytest
import torch
from gloo import run

RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


class _NaNGradient(torch.autograd.Function):
    """Identity forward; the backward sends NaN down."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def _layer(model, number):
    return next(layer for layer in model.decoder.layers if layer.layer_number == number)


def _check_all(rank, world, kind, recompute, plants):
    workers.init_megatron()
    for plant in plants:
        _check(kind, recompute, plant)


def _check(kind, recompute, plant):
    from megatron_mtraining.training.finite_guard import NonFiniteError, install_finite_guard

    model = workers.build_model(workers.attention_config(kind), **RECOMPUTE[recompute])
    assert install_finite_guard(model, kind) == 2
    batch = workers.full_batch()
    if plant == "forward":
        with torch.no_grad():
            _layer(model, 2).mlp.linear_fc1.weight[0, 0] = float("nan")
    elif plant == "backward":
        mlp = _layer(model, 1).mlp
        forward = mlp.forward
        mlp.forward = lambda *a, **k: (_NaNGradient.apply(forward(*a, **k)[0]), None)
    elif plant == "embedding":
        with torch.no_grad():
            model.embedding.word_embeddings.weight[batch["tokens"][0, 5]] = float("inf")
    elif plant == "head":
        norm = model.decoder.final_layernorm
        forward = norm.forward
        norm.forward = lambda *a, **k: _NaNGradient.apply(forward(*a, **k))
    try:
        workers.loss_and_grads(model, batch)
    except NonFiniteError as err:
        message = str(err)
    else:
        message = None
    if plant == "forward":
        assert message and message.startswith(f"transformer layer 2 ({kind} attention)"), message
        assert "forward output" in message, message
    elif plant == "backward":
        assert message and message.startswith(f"transformer layer 1 ({kind} attention)"), message
        assert "gradient of its input" in message, message
    elif plant == "embedding":
        assert message and message.startswith(f"the input of transformer layer 1 ({kind} attention)"), message
        assert "embedding" in message, message
    elif plant == "head":
        assert message and f"output of transformer layer 2 ({kind} attention), the last layer" in message, message
        assert "final norm, output layer or loss" in message, message
    else:
        assert message is None, message


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_first_non_finite_layer_is_named(recompute):
    run(1, _check_all, "mtraining", recompute, [None, "forward", "backward", "head", "embedding"])


def test_dense_layers_are_named_dense():
    run(1, _check_all, "dense", "none", ["forward"])


def test_non_finite_losses_name_the_head():
    from megatron_mtraining.training.finite_guard import NonFiniteError, check_losses

    check_losses(torch.tensor([1.0, 2.0]))
    with pytest.raises(
        NonFiniteError, match=r"output layer and cross entropy produced 2 non-finite per-token losses of 3"
    ):
        check_losses(torch.tensor([1.0, float("nan"), float("inf")]))

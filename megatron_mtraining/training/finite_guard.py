"""A debug guard that stops at the first transformer layer whose output or input gradient
holds a NaN or an infinity, naming the layer and its attention type.

Megatron only counts "nan iterations" once the loss or the gradient norm is already
non-finite, which says nothing of where it came from. ``pretrain --check-finite`` installs
:func:`install_finite_guard` on the model: every layer's forward output is checked, and in
the backward every layer's input gradient while its output gradient is still finite, so the
error names the layer that produced the first non-finite values in each pass (the forward
runs layers upward, the backward downward). With activation recomputation the forward
checks run again in the backward. Each check reads a flag from the device, one host
synchronisation per layer and pass: a debugging aid, not for speed runs.
"""

from __future__ import annotations

import torch


class NonFiniteError(FloatingPointError):
    """A layer produced NaN or infinite values."""


def _first_tensor(value):
    """The hidden states of a layer's output or gradient tuple (Megatron's layers return
    ``(hidden_states, context)``)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in value if isinstance(t, torch.Tensor)), None)
    return None


def _bad_count(t) -> int:
    return 0 if t is None else int((~torch.isfinite(t)).sum())


def _where(layer, attention_type: str) -> str:
    return f"transformer layer {layer.layer_number} ({attention_type} attention)"


def install_finite_guard(model: torch.nn.Module, attention_type: str) -> int:
    """Checks every ``TransformerLayer`` of ``model``; returns how many are guarded."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def check(layer, t, what: str) -> None:
        bad = _bad_count(t)
        if bad:
            raise NonFiniteError(
                f"{_where(layer, attention_type)} produced {bad} non-finite values of {t.numel()} {what}"
            )

    def keep_input(layer, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        bad = _bad_count(x)
        if bad:
            # Every layer below checked its output, so this can only be the first layer's.
            raise NonFiniteError(
                f"the input of {_where(layer, attention_type)} holds {bad} non-finite values of {x.numel()}: the "
                "embedding (or the previous pipeline stage) produced them"
            )
        layer._finite_guard_input = x

    def check_output(layer, _args, _kwargs, output):
        x, layer._finite_guard_input = layer._finite_guard_input, None
        out = _first_tensor(output)
        check(layer, out, "in its forward output; the layers below it gave finite outputs")
        # Megatron passes the hidden states by keyword, which module backward hooks do not
        # see: tensor hooks on the layer's output and input give the same two gradients.
        if not (torch.is_grad_enabled() and out is not None and out.requires_grad):
            return
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            return
        output_ok = []

        def check_output_gradient(g):
            bad = _bad_count(g)
            output_ok.append(bad == 0)
            if bad and layer.layer_number == layer.config.num_layers:
                raise NonFiniteError(
                    f"the gradient reaching the output of {_where(layer, attention_type)}, the last layer, holds "
                    f"{bad} non-finite values of {g.numel()}: the final norm, output layer or loss produced them"
                )

        out.register_hook(check_output_gradient)

        def check_input_gradient(g):
            # Non-finite already in the output's gradient: a layer above made it.
            if all(output_ok):
                check(layer, g, "in the gradient of its input, from a finite gradient of its output")

        x.register_hook(check_input_gradient)

    guarded = 0
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.register_forward_pre_hook(keep_input, with_kwargs=True)
            module.register_forward_hook(check_output, with_kwargs=True)
            guarded += 1
    return guarded


def check_losses(losses: torch.Tensor) -> None:
    """The per-token losses of the output layer and cross entropy, after every layer's
    output was checked: non-finite values here come from the output layer or the loss."""
    bad = _bad_count(losses)
    if bad:
        raise NonFiniteError(
            f"the output layer and cross entropy produced {bad} non-finite per-token losses of {losses.numel()}; "
            "every transformer layer's output was finite"
        )

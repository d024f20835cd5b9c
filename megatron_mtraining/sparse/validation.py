"""Argument checks shared by the sparse API.

Every check raises ``ValueError`` naming the argument, the value it got and what
would be accepted, so a misconfigured run fails at its first call with a message
the user can act on (no silent broadcasting, no shape errors from deep inside a
kernel).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fail(name: str, value, accepted: str) -> None:
    raise ValueError(f"{name}={value!r} is not accepted: expected {accepted}")


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        fail(name, value, "an integer")
    if minimum is not None and value < minimum:
        fail(name, value, f"an integer >= {minimum}")
    if maximum is not None and value > maximum:
        fail(name, value, f"an integer <= {maximum}")


def check_power_of_two(name: str, value, *, minimum: int, maximum: int | None = None) -> None:
    if maximum is None:
        accepted = f"a power of two >= {minimum} (the kernels tile by it)"
    else:
        accepted = f"a power of two from {minimum} to {maximum}"
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or value & (value - 1):
        fail(name, value, accepted)
    if maximum is not None and value > maximum:
        fail(name, value, accepted)


def check_launch(name: str, cfg, expected: type, tiles: dict[str, int]) -> None:
    """A kernel's launch parameters ``cfg`` (a dataclass of integers, e.g. an override a sweep
    set), named ``name`` in errors: of type ``expected``; the fields ``tiles`` powers of two of
    at least their minimum (Triton's ranges and products are powers of two); ``num_warps`` a
    power of two up to 32 (a program's 1024 threads); any other field a positive integer."""
    if type(cfg) is not expected:
        fail(name, cfg, f"a {expected.__name__}")
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name in tiles:
            check_power_of_two(f"{name}.{field.name}", value, minimum=tiles[field.name])
        elif field.name == "num_warps":
            check_power_of_two(f"{name}.num_warps", value, minimum=1, maximum=32)
        else:
            check_int(f"{name}.{field.name}", value, minimum=1)


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        fail(name, value, f"one of {', '.join(map(str, choices))}")


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The setting of environment variable ``name``: the first of ``choices`` where unset or
    empty; a value not among them is an error naming the variable. Read on every call, so a
    test or a run can change it between calls."""
    value = os.environ.get(name) or choices[0]
    check_choice(name, value, choices)
    return value


def check_fraction(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 < value <= 1.0):
        fail(name, value, "a number in (0, 1]")


def check_positive_float(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value > 0 and math.isfinite(value)):
        fail(name, value, "a positive finite number")


def check_tensor(name: str, t, *, ndim: int, float_dtype: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        fail(name, type(t).__name__, "a torch.Tensor")
    if t.dim() != ndim:
        fail(f"{name}.shape", tuple(t.shape), f"a {ndim}-d tensor")
    if float_dtype and t.dtype not in FLOAT_DTYPES:
        fail(f"{name}.dtype", t.dtype, f"one of {', '.join(str(d) for d in FLOAT_DTYPES)}")


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """Returns the scale to use: 1/sqrt(head_dim) unless one is given."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    check_positive_float("softmax_scale", softmax_scale)
    return float(softmax_scale)


def check_qk(q, k, *, q_name: str = "q", k_name: str = "k") -> None:
    """q [B, S, Hq, D] against k [B, S, Hkv, D]: same batch, length, dtype, device,
    head dim, and Hq a multiple of Hkv (GQA)."""
    check_tensor(q_name, q, ndim=4)
    check_tensor(k_name, k, ndim=4)
    if k.device != q.device:
        fail(f"{k_name}.device", str(k.device), f"the device of {q_name} ({q.device})")
    if k.dtype != q.dtype:
        fail(f"{k_name}.dtype", k.dtype, f"the dtype of {q_name} ({q.dtype})")
    bq, sq, hq, dq = q.shape
    bk, sk, hk, dk = k.shape
    if (bk, sk) != (bq, sq):
        fail(
            f"{k_name}.shape",
            tuple(k.shape),
            f"batch and length of {q_name} [{bq}, {sq}, Hkv, D] (causal self-attention)",
        )
    if dk != dq:
        fail(f"{k_name}.shape[3]", dk, f"the head dim of {q_name} ({dq})")
    if hk < 1 or hq % hk:
        fail(f"{k_name}.shape[2]", hk, f"a divisor of the query head count {hq} (GQA)")


def check_index_qk(q_idx, k_idx, index_head_dim: int | None = None) -> None:
    """MSA's index queries ``[B, S, Hkv, d_idx]`` against its one index key head
    ``[B, S, 1, d_idx]``: same batch, length, head dim, dtype and device (and ``d_idx`` the
    config's ``index_head_dim`` where given)."""
    check_tensor("q_idx", q_idx, ndim=4)
    check_tensor("k_idx", k_idx, ndim=4)
    if k_idx.shape[2] != 1:
        fail("k_idx.shape[2]", k_idx.shape[2], "1 (one index key head shared by all groups)")
    if k_idx.shape[:2] != q_idx.shape[:2] or k_idx.shape[3] != q_idx.shape[3]:
        fail("k_idx.shape", tuple(k_idx.shape), f"[B, S, 1, d_idx] matching q_idx {tuple(q_idx.shape)}")
    if k_idx.device != q_idx.device or k_idx.dtype != q_idx.dtype:
        fail("k_idx", f"{k_idx.dtype} on {k_idx.device}", f"{q_idx.dtype} on {q_idx.device} like q_idx")
    if index_head_dim is not None and q_idx.shape[3] != index_head_dim:
        fail("q_idx.shape[3]", q_idx.shape[3], f"MSAConfig.index_head_dim ({index_head_dim})")


def check_qkv(q, k, v) -> None:
    check_qk(q, k)
    check_tensor("v", v, ndim=4)
    if v.shape != k.shape:
        fail("v.shape", tuple(v.shape), f"the shape of k {tuple(k.shape)}")
    if v.dtype != k.dtype or v.device != k.device:
        fail("v", f"{v.dtype} on {v.device}", f"{k.dtype} on {k.device} like k")


def setting(default, check, **limits):
    """A config dataclass field validated by ``check(name, value, **limits)``."""
    return dataclasses.field(default=default, metadata={"check": (check, limits)})


class ValidatedConfig:
    """Base of the frozen config dataclasses: validates every :func:`setting` field
    on construction, naming it ``ClassName.field`` in the error."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if "check" in f.metadata:
                check, limits = f.metadata["check"]
                check(f"{type(self).__name__}.{f.name}", getattr(self, f.name), **limits)

"""Changes megatron-mtraining makes to Megatron-Core, one module per patched function.

Installed as ``megatron_mtraining.patches``. Nothing changes on import: one call,
:func:`apply_patches`, installs them all, so that Megatron's context-parallel batch split
(``cp_batch_split``) and the RoPE rows of a CP rank (``cp_rope_slice``) follow one
``ContextParallelLayout`` kind, and RoPE runs in one pass on CUDA without Transformer Engine
(``fused_rope``); :func:`remove_patches` undoes it. Every patch records the
megatron-core version it was written for and fingerprints of the upstream functions it
replaces or reproduces (``_guard``); if they changed, applying fails before anything is
touched, and the tests fail too.

Call it at start-up, before building the model: code outside ``megatron.*`` that imported
a patched function by name before the call keeps Megatron's original.
"""

from __future__ import annotations

from . import cp_batch_split, cp_rope_slice, fused_rope
from ._guard import SUPPORTED_VERSION, UpstreamChangedError
from ._layout import LayoutChoice

PATCHES = (cp_batch_split.PATCH, cp_rope_slice.PATCH, cp_rope_slice.THD_PATCH, fused_rope.PATCH)

_applied: LayoutChoice | None = None


def apply_patches(layout_kind: str, stripe: int = 128) -> LayoutChoice:
    """Makes Megatron split batches and RoPE over the CP ranks in the order of
    ``ContextParallelLayout(layout_kind, cp_size, seq_len, stripe=stripe)``.

    ``zigzag`` reproduces Megatron's own split. Applying again with the same arguments does
    nothing; with different ones it is a ``ValueError`` (call :func:`remove_patches` first).
    Raises :class:`UpstreamChangedError` if an upstream function is not the one a patch was
    written for; then nothing is changed.
    """
    global _applied
    choice = LayoutChoice(layout_kind, stripe)
    if _applied is not None:
        if choice == _applied:
            return choice
        differ = ", ".join(
            f"{name}={getattr(_applied, field)!r} (now {getattr(choice, field)!r})"
            for name, field in (("layout_kind", "kind"), ("stripe", "stripe"))
            if getattr(_applied, field) != getattr(choice, field)
        )
        raise ValueError(f"the Megatron patches are already applied with {differ}; call remove_patches() first")
    for patch in PATCHES:
        patch.check()
    for patch in PATCHES:
        patch.install(choice)
    _applied = choice
    return choice


def remove_patches() -> None:
    """Restores Megatron's original functions at every site; does nothing if none is applied."""
    global _applied
    for patch in reversed(PATCHES):
        patch.uninstall()
    _applied = None


def applied_layout() -> LayoutChoice | None:
    """The layout the patches currently apply, or None."""
    return _applied


__all__ = [
    "PATCHES",
    "SUPPORTED_VERSION",
    "LayoutChoice",
    "UpstreamChangedError",
    "applied_layout",
    "apply_patches",
    "remove_patches",
]

"""Changes megatron-mtraining makes to Megatron-Core (and, for runs without CUDA, to torch),
one module per patched function, the CPU stand-ins together in ``cpu_compat``.

Installed as ``megatron_mtraining.patches``. Nothing changes on import. Three calls install
them, each for its own case:

* :func:`apply_patches`, for every model with the plugin's attention: Megatron's
  context-parallel batch split (``cp_batch_split``) and the RoPE rows of a CP rank
  (``cp_rope_slice``) follow one ``ContextParallelLayout`` kind, and RoPE runs in one pass on
  CUDA without Transformer Engine (``fused_rope``); :func:`remove_patches` undoes it.
* :func:`apply_cpu_patches`, on a machine without CUDA only: torch's CUDA entry points and
  Megatron's CUDA-only functions get CPU stand-ins (``cpu_compat``).
* :func:`use_prebuilt_dataset_helpers`, by the training entry point: Megatron's start-up uses
  the dataset helpers the megatron-core wheel ships (``dataset_helpers``).
* :func:`use_atomic_checkpoint_tracker`, by the training entry point: Megatron's checkpoint
  tracker file is replaced atomically (``atomic_tracker``).

Every patch records the megatron-core version it was written for and fingerprints of the
upstream functions it replaces or reproduces, or for torch the releases it was checked on
(``_guard``); if they changed, applying fails before anything is touched, and the tests fail
too.

Call them at start-up, before building the model: code outside ``megatron.*`` that imported
a patched function by name before the call keeps Megatron's original.
"""

from __future__ import annotations

import torch

from . import atomic_tracker, cp_batch_split, cp_rope_slice, cpu_compat, dataset_helpers, fused_rope
from ._guard import SUPPORTED_VERSION, TORCH_VERSIONS, UpstreamChangedError
from ._layout import LayoutChoice, record_split_documents, split_documents

PATCHES = (cp_batch_split.PATCH, cp_rope_slice.PATCH, cp_rope_slice.THD_PATCH, fused_rope.PATCH)

_applied: LayoutChoice | None = None
_cpu_applied = False
_cpu_training_applied = False


def apply_patches(layout_kind: str, stripe: int = 128, node_size: int | None = None) -> LayoutChoice:
    """Makes Megatron split batches and RoPE over the CP ranks in the order of
    ``ContextParallelLayout(layout_kind, cp_size, seq_len, stripe=stripe, node_size=node_size)``
    (``node_size``: ranks numbered node-major, for the exchange that gathers K/V inside nodes).

    ``zigzag`` reproduces Megatron's own split. ``balanced`` places each micro-batch by its
    documents, which the split reads from ``batch["cu_seqlens"]`` (absent: striped).
    Applying again with the same arguments does nothing; with different ones it is a
    ``ValueError`` (call :func:`remove_patches` first).
    Raises :class:`UpstreamChangedError` if an upstream function is not the one a patch was
    written for; then nothing is changed.
    """
    global _applied
    choice = LayoutChoice(layout_kind, stripe, node_size)
    if _applied is not None:
        if choice == _applied:
            return choice
        differ = ", ".join(
            f"{name}={getattr(_applied, field)!r} (now {getattr(choice, field)!r})"
            for name, field in (("layout_kind", "kind"), ("stripe", "stripe"), ("node_size", "node_size"))
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
    record_split_documents(None)
    _applied = None


def applied_layout() -> LayoutChoice | None:
    """The layout the patches currently apply, or None."""
    return _applied


def apply_cpu_patches(training: bool = False) -> bool:
    """Patches torch and Megatron-Core (with ``training`` also ``megatron.training``) for a
    machine without CUDA; returns whether they are active (False with CUDA, where nothing
    changes). Call it in every process before building a model (before ``pretrain``); applying
    again is the same as once, and ``training`` can be added later. There is no removal: the
    stand-ins hold for the life of the process. Raises :class:`UpstreamChangedError` if a
    Megatron function is not the one a patch was written for, or torch is not a release in
    ``TORCH_VERSIONS``; then nothing is changed.
    """
    global _cpu_applied, _cpu_training_applied
    if torch.cuda.is_available():
        return False
    # The training patches first: checking them imports megatron.training, whose import then
    # runs outside the CUDA-to-CPU function mode, as it does on a GPU.
    training_pending = training and not _cpu_training_applied
    pending = [
        *(cpu_compat.TRAINING_PATCHES if training_pending else ()),
        *(() if _cpu_applied else cpu_compat.PATCHES),
    ]
    for patch in pending:
        patch.check()
    for patch in pending:
        patch.install()
    if training_pending:
        cpu_compat.disable_compilation()
        _cpu_training_applied = True
    if not _cpu_applied:
        cpu_compat.CudaToCpu().__enter__()
        _cpu_applied = True
    return True


def use_prebuilt_dataset_helpers() -> bool:
    """Makes Megatron's start-up use the dataset helpers the megatron-core wheel ships rather
    than compile them (the wheel has no Makefile); returns whether it does: False where the
    prebuilt module does not import, and Megatron compiles them as before. Raises
    :class:`UpstreamChangedError` if Megatron's ``compile_helpers`` is not the one the patch was
    written for."""
    if dataset_helpers.PATCH.replacement is not None:
        return True
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    dataset_helpers.PATCH.check()
    dataset_helpers.PATCH.install()
    return True


def use_atomic_checkpoint_tracker() -> None:
    """Makes Megatron's ``save_checkpoint`` replace ``latest_checkpointed_iteration.txt``
    atomically (a synced temporary file and ``os.replace``), so that a save killed at any point
    leaves the previous tracker, naming a complete checkpoint. Applying again is the same as
    once. Raises :class:`UpstreamChangedError` if Megatron's ``MaybeMultiStorageClient`` or
    ``save_checkpoint`` is not the one the patch was written for."""
    if atomic_tracker.PATCH.replacement is not None:
        return
    atomic_tracker.PATCH.check()
    atomic_tracker.PATCH.install()


__all__ = [
    "PATCHES",
    "SUPPORTED_VERSION",
    "TORCH_VERSIONS",
    "LayoutChoice",
    "UpstreamChangedError",
    "applied_layout",
    "apply_cpu_patches",
    "apply_patches",
    "remove_patches",
    "split_documents",
    "use_atomic_checkpoint_tracker",
    "use_prebuilt_dataset_helpers",
]

"""Patch of ``megatron.core.datasets.utils.compile_helpers``: the prebuilt dataset helpers.

The megatron-core wheel ships the compiled dataset helpers (``helpers_cpp``) but no Makefile,
so the ``make`` that Megatron's start-up runs (``initialize._compile_dependencies``) fails.
Where the prebuilt module imports, :func:`megatron_mtraining.patches.use_prebuilt_dataset_helpers`
installs this patch and the start-up compiles nothing.
"""

from __future__ import annotations

from ._guard import FunctionPatch


def _build(choice):
    def compile_helpers():
        """Megatron's helper compilation, for an install that ships them prebuilt: nothing to do
        (see ``megatron_mtraining.patches.dataset_helpers``)."""

    return compile_helpers


PATCH = FunctionPatch(
    module="megatron.core.datasets.utils",
    name="compile_helpers",
    fingerprints={"compile_helpers": "84029a50ae8cfac1"},
    import_sites=("megatron/training/initialize.py",),
    build=_build,
)

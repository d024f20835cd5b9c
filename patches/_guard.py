"""Version guard, upstream fingerprints and the swap of a Megatron-Core or torch function.

A patch replaces a Megatron-Core function wholesale, so it is right only while that
function (and any upstream helper whose behaviour the replacement reproduces) is the one
the patch was written against. Each patch records the SHA-256 of those functions' source
for megatron-core :data:`SUPPORTED_VERSION`. Before anything is changed, the installed
functions must match: on the supported version this fails only if Megatron was modified in
place or someone else already replaced the function; on another version the patch still
applies when upstream left the functions untouched, and otherwise refuses, naming both
versions. A patch of a torch function (the CPU stand-ins of ``cpu_compat``) is guarded by
torch's version instead (:data:`TORCH_VERSIONS`).

Python binds ``from module import name`` at import time, so replacing the attribute of the
defining module is not enough: every loaded ``megatron.*`` module that holds the function
(under any name) gets the replacement, and the swap is undone the same way. Modules
imported later bind the replacement through the defining module.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SUPPORTED_VERSION = "0.19.2"
# The torch releases the CPU stand-ins accept: from the package's floor (pyproject.toml) to the
# newest minor release with a tested CPU path (constraints.txt). torch is guarded by release,
# not by fingerprints: the stand-ins replace CUDA entry points (streams, events, synchronize,
# RNG state, Tensor.cuda / pin_memory / record_stream) rather than reproduce them, three of
# them are C methods with no source, and the Python ones change their source (docstrings,
# device checks) in releases that change nothing the stand-ins rely on. What can break them is
# a change of torch's CUDA behaviour (a new entry point on a path Megatron takes, a changed
# stream API), which comes with minor releases: the range fails loudly on the first minor
# release not tested and accepts its patch releases (2.13.1).
TORCH_VERSIONS = ((2, 6), (2, 13))


class UpstreamChangedError(RuntimeError):
    """A Megatron-Core function a patch replaces is not the one the patch was written for."""


def installed_version() -> str:
    """megatron-core's version without a local ``+<git sha>`` suffix."""
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]


def installed_torch_version() -> tuple[int, int]:
    """torch's (major, minor) release."""
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _release(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def fingerprint(fn: Callable) -> str:
    """The first 16 hex digits of the SHA-256 of ``fn``'s source."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _megatron_modules() -> list:
    return [m for n, m in list(sys.modules.items()) if m is not None and (n == "megatron" or n.startswith("megatron."))]


@dataclass
class FunctionPatch:
    """Replaces ``module.name`` by ``build(choice)`` at every site that holds it.

    ``name`` is an attribute of ``module``, or of a class in it (``Tensor.cuda``).
    ``fingerprints`` maps the patched function and the upstream helpers whose behaviour the
    replacement reproduces (all in ``module``) to their fingerprints on
    :data:`SUPPORTED_VERSION`; a patch of torch has none and is checked against
    :data:`TORCH_VERSIONS`. ``import_sites`` lists the files of the installed megatron
    package that import the function by name; a test keeps the list current, so an upstream
    change there is reviewed. ``on_swap`` runs after each install and uninstall (to drop
    caches of the old function's results). ``callers`` maps functions elsewhere in Megatron
    (by full dotted name) whose use of the patched one the replacement relies on to their
    fingerprints, checked the same way. While installed, and while ``build`` runs,
    ``original`` is the replaced function.
    """

    module: str
    name: str
    fingerprints: dict[str, str]
    import_sites: tuple[str, ...]
    build: Callable[..., Callable]
    on_swap: Callable[[], None] | None = None
    callers: dict[str, str] = field(default_factory=dict)
    original: Callable | None = field(default=None, init=False)
    replacement: Callable | None = field(default=None, init=False)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def patches_torch(self) -> bool:
        return self.module.partition(".")[0] == "torch"

    def _owner(self):
        """The module or class that holds the patched attribute, and the attribute's name."""
        owner = importlib.import_module(self.module)
        *classes, attribute = self.name.split(".")
        for name in classes:
            owner = getattr(owner, name)
        return owner, attribute

    def check(self) -> None:
        """Raises :class:`UpstreamChangedError` unless every fingerprinted function matches
        (for a patch of torch: unless torch is a release in :data:`TORCH_VERSIONS`)."""
        if self.patches_torch:
            self._check_torch()
            return
        version = installed_version()
        named = {f"{self.module}.{name}": recorded for name, recorded in self.fingerprints.items()}
        for where, recorded in {**named, **self.callers}.items():
            module_name, _, name = where.rpartition(".")
            fn = getattr(importlib.import_module(module_name), name, None)
            if fn is None:
                raise UpstreamChangedError(
                    f"{where} does not exist in the installed megatron-core {version}; the patch of "
                    f"{self.target} was written for megatron-core {SUPPORTED_VERSION}"
                )
            try:
                actual = fingerprint(fn)
            except (OSError, TypeError) as err:
                actual = f"unreadable ({err})"
            if actual == recorded:
                continue
            why = (
                "the version matches, so Megatron was modified in place or another patch already replaced it"
                if version == SUPPORTED_VERSION
                else "upstream changed it"
            )
            raise UpstreamChangedError(
                f"{where} is not the function the patch of {self.target} was written for: installed "
                f"megatron-core {version}, supported {SUPPORTED_VERSION}; source fingerprint {actual}, "
                f"recorded {recorded} ({why}). Review the upstream function, adapt the patch in "
                f"megatron_mtraining.patches and record the new fingerprint."
            )
        if version != SUPPORTED_VERSION:
            logger.warning(
                "megatron-core %s is not the supported %s; patching %s because its source is unchanged",
                version,
                SUPPORTED_VERSION,
                self.target,
            )

    def _check_torch(self) -> None:
        import torch

        first, last = TORCH_VERSIONS
        supported = f"torch {_release(first)} to {_release(last)}"
        if not first <= installed_torch_version() <= last:
            raise UpstreamChangedError(
                f"{self.target} is patched for {supported}, not the installed torch {torch.__version__}: review "
                f"the stand-ins in megatron_mtraining.patches.cpu_compat against this release and widen "
                f"TORCH_VERSIONS in megatron_mtraining.patches._guard"
            )
        owner, attribute = self._owner()
        if getattr(owner, attribute, None) is None:
            raise UpstreamChangedError(
                f"{self.target} does not exist in the installed torch {torch.__version__}; the patch was "
                f"written for {supported}"
            )

    def install(self, choice=None) -> list[str]:
        """Swaps in ``build(choice)``; returns the ``module.attribute`` sites changed."""
        owner, attribute = self._owner()
        self.original = getattr(owner, attribute)
        self.replacement = self.build(choice)
        sites = _swap(self.original, self.replacement, owner, attribute, self.target)
        if self.on_swap is not None:
            self.on_swap()
        return sites

    def uninstall(self) -> None:
        if self.replacement is None:
            return
        _swap(self.replacement, self.original, *self._owner(), self.target)
        self.original = self.replacement = None
        if self.on_swap is not None:
            self.on_swap()


def _swap(old: Callable, new: Callable, owner, attribute: str, target: str) -> list[str]:
    # The owner first: a torch module or class is not among the megatron modules.
    setattr(owner, attribute, new)
    sites = [target]
    for module in _megatron_modules():
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                sites.append(f"{module.__name__}.{attr}")
    return sites

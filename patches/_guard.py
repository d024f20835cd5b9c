"""Version guard, upstream fingerprints and the swap of a Megatron-Core function.

A patch replaces a Megatron-Core function wholesale, so it is right only while that
function (and any upstream helper whose behaviour the replacement reproduces) is the one
the patch was written against. Each patch records the SHA-256 of those functions' source
for megatron-core :data:`SUPPORTED_VERSION`. Before anything is changed, the installed
functions must match: on the supported version this fails only if Megatron was modified in
place or someone else already replaced the function; on another version the patch still
applies when upstream left the functions untouched, and otherwise refuses, naming both
versions.

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


class UpstreamChangedError(RuntimeError):
    """A Megatron-Core function a patch replaces is not the one the patch was written for."""


def installed_version() -> str:
    """megatron-core's version without a local ``+<git sha>`` suffix."""
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]


def fingerprint(fn: Callable) -> str:
    """The first 16 hex digits of the SHA-256 of ``fn``'s source."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _megatron_modules() -> list:
    return [m for n, m in list(sys.modules.items()) if m is not None and (n == "megatron" or n.startswith("megatron."))]


@dataclass
class FunctionPatch:
    """Replaces ``module.name`` by ``build(choice)`` at every site that holds it.

    ``fingerprints`` maps the patched function and the upstream helpers whose behaviour the
    replacement reproduces (all in ``module``) to their fingerprints on
    :data:`SUPPORTED_VERSION`. ``import_sites`` lists the files of the installed megatron
    package that import the function by name; a test keeps the list current, so an upstream
    change there is reviewed. ``on_swap`` runs after each install and uninstall (to drop
    caches of the old function's results). While installed, ``original`` is the replaced
    function.
    """

    module: str
    name: str
    fingerprints: dict[str, str]
    import_sites: tuple[str, ...]
    build: Callable[..., Callable]
    on_swap: Callable[[], None] | None = None
    original: Callable | None = field(default=None, init=False)
    replacement: Callable | None = field(default=None, init=False)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"

    def check(self) -> None:
        """Raises :class:`UpstreamChangedError` unless every fingerprinted function matches."""
        module = importlib.import_module(self.module)
        version = installed_version()
        for name, recorded in self.fingerprints.items():
            fn = getattr(module, name, None)
            where = f"{self.module}.{name}"
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

    def install(self, choice) -> list[str]:
        """Swaps in ``build(choice)``; returns the ``module.attribute`` sites changed."""
        original = getattr(importlib.import_module(self.module), self.name)
        replacement = self.build(choice)
        sites = _swap(original, replacement)
        self.original, self.replacement = original, replacement
        if self.on_swap is not None:
            self.on_swap()
        return sites

    def uninstall(self) -> None:
        if self.replacement is None:
            return
        _swap(self.replacement, self.original)
        self.original = self.replacement = None
        if self.on_swap is not None:
            self.on_swap()


def _swap(old: Callable, new: Callable) -> list[str]:
    sites = []
    for module in _megatron_modules():
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                sites.append(f"{module.__name__}.{attr}")
    return sites

"""Triton's interpreter (TRITON_INTERPRET=1, the CPU suite's kernels) without two of its
per-call overheads, the same results.

A kernel launch patches the language modules once for the whole grid
(``GridExecutor.__call__``). A jit helper called from the kernel patches them again, on every
call (``InterpretedFunction.__call__``): ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and
``tl.math`` per helper call, per program, per loop iteration. The package's kernels are built
from helpers called in their inner loops, so that was a large share of a kernel test's time
(``docs/benchmarks.md``, "The CPU suite's time").
The patches a nested call makes are never undone (Triton keeps no handle on them), and a
second patch of the same modules changes nothing, so within one launch a helper's modules
need patching once: the first call from each module's globals patches them, as before (the
language's own helpers, ``tl.zeros`` say, reach it as ``triton.language.core``, which the
launch's patch may not cover), and later calls only run the rewritten function. Outside a
launch (a helper called directly) the original path runs.

The NumPy dtype of a Triton type (``_get_np_dtype``, called by most interpreted operations)
builds its table of every type afresh at every call; it is looked up once per scalar type.
"""

from __future__ import annotations

import os

# The launch in progress (depth: 0 outside one) and the helpers' globals patched in it.
_launch = {"depth": 0, "patched": set()}


def install() -> None:
    """Applies the shortcut under TRITON_INTERPRET=1 (once a process; a no-op otherwise)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    if getattr(interpreter.GridExecutor.__call__, "_nested_calls_patch_once", False):
        return
    launch, nested = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    def counted_launch(self, *args, **kwargs):
        if not _launch["depth"]:
            _launch["patched"] = set()
        _launch["depth"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch["depth"] -= 1

    def nested_call(self, *args, **kwargs):
        module = id(self.fn.__globals__)
        if not _launch["depth"] or module not in _launch["patched"]:
            _launch["patched"].add(module)
            return nested(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    numpy_dtype, numpy_dtypes = interpreter._get_np_dtype, {}

    def cached_numpy_dtype(tt_dtype):
        # A block's NumPy dtype is its element's; pointers (unhashable) take the original's
        # first, table-free test.
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, interpreter.tl.block_type) else tt_dtype
        if isinstance(scalar, interpreter.tl.pointer_type):
            return numpy_dtype(scalar)
        found = numpy_dtypes.get(scalar)
        if found is None:
            found = numpy_dtypes[scalar] = numpy_dtype(scalar)
        return found

    counted_launch._nested_calls_patch_once = True
    interpreter.GridExecutor.__call__ = counted_launch
    interpreter.InterpretedFunction.__call__ = nested_call
    interpreter._get_np_dtype = cached_numpy_dtype

"""Patch of ``megatron.core.msc_utils.MaybeMultiStorageClient.__getattr__``: the checkpoint
tracker file is replaced atomically.

Megatron-Core's ``save_checkpoint`` writes ``latest_checkpointed_iteration.txt`` last, on rank
0, only after every rank has written its shards (a barrier for a sync save; for an async save
the finalize functions, which run once an all-reduce says every rank's writer is done). But it
writes it with ``maybe_msc.open(tracker, 'w')``: the file is truncated, then written, never
synced. A process killed (or a node lost) in between leaves an empty or stale-cached tracker,
and ``read_metadata`` then calls ``sys.exit()`` (status 0) on the next start: the run cannot
resume and its launcher sees a success. With this patch the new content goes to a temporary
file in the same directory, is synced, and replaces the tracker with ``os.replace``; a crash
leaves the previous tracker whole, and the checkpoint it names is complete.

Only the local-file path changes: where the multi-storage client is enabled
(``--enable-msc``), its own ``open`` is returned as before.
"""

from __future__ import annotations

import builtins
import contextlib
import os

from ._guard import FunctionPatch

TRACKER = "latest_checkpointed_iteration.txt"


@contextlib.contextmanager
def atomic_text_writer(path, **kwargs):
    """A text file object whose content replaces ``path`` only when the ``with`` block ends
    without an error; until then, and after an error, ``path`` is untouched."""
    path = os.fspath(path)
    # Named after the process, in the same directory (os.replace does not cross file
    # systems); builtins.open honours the umask, as the plain write did.
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with builtins.open(tmp, "w", **kwargs) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename itself survives a crash of the machine only once the directory is synced.
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _open(file, mode="r", *args, **kwargs):
    if mode == "w" and not args and os.path.basename(os.fspath(file)) == TRACKER:
        return atomic_text_writer(file, **kwargs)
    return builtins.open(file, mode, *args, **kwargs)


def _build(choice):
    original = PATCH.original

    def __getattr__(self, name):
        found = original(self, name)
        if name == "open" and found is builtins.open:
            return _open
        return found

    return __getattr__


PATCH = FunctionPatch(
    module="megatron.core.msc_utils",
    name="MaybeMultiStorageClient.__getattr__",
    fingerprints={"MaybeMultiStorageClient": "eee51c5158a95389"},
    import_sites=(),
    build=_build,
    # save_checkpoint writes the tracker through maybe_msc.open(tracker, 'w') after its barrier.
    callers={"megatron.training.checkpointing.save_checkpoint": "b652984ca8c8309d"},
)

"""Counting host reads of tensor data: each would make the host wait for a GPU's queue to
drain, which then idles while the host launches what follows. The tests run on CPU tensors
and count every read, so a count bounds the GPU's."""

from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile


class HostReads(TorchFunctionMode):
    """Counts, while active, the operations that read tensor data on the host: on a CUDA
    tensor each one waits for the device's queue to drain (``.item()``, ``int`` / ``bool``,
    boolean indexing and ``nonzero``, ``unique``, ``torch.equal``, ``.tolist()`` / ``.cpu()``
    / ``.numpy()``). On CPU every tensor counts, host-made ones included, so this bounds a
    GPU's count. Copies from the host to the device read nothing on the host and are not
    counted (a blocking one, ``non_blocking=False``, from pageable memory waits for the
    device too: the code avoids them by hand)."""

    ATEN = {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::unique_dim",
        # On a CPU computed without _local_scalar_dense; on a GPU it reads its result.
        "aten::equal",
    }
    COPIES = {"tolist", "cpu", "numpy"}  # seen here, not as aten ops, when the tensor is on the CPU

    def __enter__(self):
        self.count = 0
        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.profiler.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.profiler.__exit__(*exc)
        self.count += sum(e.name in self.ATEN for e in self.profiler.events())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.COPIES
        return func(*args, **(kwargs or {}))

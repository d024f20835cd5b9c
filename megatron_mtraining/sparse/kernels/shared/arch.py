"""The GPU architecture a launch targets, for launch parameters that differ by architecture
(ptxas compiles some kernels to wholesale spills on sm80 and not on sm90:
``scripts/compile_kernels.py`` shows which)."""

from __future__ import annotations

import torch


def major(device: torch.device) -> int | None:
    """``device``'s compute capability major version (8: Ampere, 9: Hopper); None off CUDA,
    where the kernels run in Triton's interpreter."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None

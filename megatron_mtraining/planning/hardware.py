"""GPU and link figures (``calibration/hardware.json``): measured on this project's machines,
published, or assumed, each marked as such."""

from __future__ import annotations

from dataclasses import dataclass

from .tables import table


@dataclass(frozen=True)
class GPU:
    name: str
    compute_capability: int  # 80: sm80, 90: sm90
    memory_gb: float
    hbm_tb_s: float
    bf16_peak_tflops: float
    matmul_tflops: float
    nvlink_gb_s: float
    # Time of the plugin's attention kernels on this GPU over their sm90 calibration.
    attention_time_factor: float
    # What PyTorch's fused attention runs here: cuDNN ("sdpa") on sm90, FlashAttention-2 on sm80.
    sdpa_kernel: str


def gpu_names() -> tuple[str, ...]:
    return tuple(table("hardware")["gpus"])


def network_names() -> tuple[str, ...]:
    return tuple(table("hardware")["networks"])


def gpu(name: str) -> GPU:
    """The GPU called ``name`` or one of its aliases (``H200`` for ``H200-141GB``)."""
    gpus = table("hardware")["gpus"]
    found = next((key for key, spec in gpus.items() if name == key or name in spec["aliases"]), None)
    if found is None:
        raise ValueError(f"gpu={name!r} is not a GPU the planner knows (accepted: {', '.join(gpus)})")
    spec = gpus[found]
    values = {k: v["value"] for k, v in spec.items() if isinstance(v, dict)}
    return GPU(found, spec["compute_capability"], sdpa_kernel=spec["sdpa_kernel"], **values)


def gpu_of_device(device: str) -> GPU:
    """The GPU a measurement's device string names (``NVIDIA H200 (nvidia-h200-x2)``)."""
    for name, spec in table("hardware")["gpus"].items():
        if any(alias in device for alias in (*spec["aliases"], name)):
            return gpu(name)
    raise ValueError(f"device {device!r} names no GPU of calibration/hardware.json")


def network_gb_s(name: str) -> float:
    """Reachable bandwidth per GPU, each way, across nodes (GB/s)."""
    networks = table("hardware")["networks"]
    if name not in networks:
        raise ValueError(f"network={name!r} is not a network the planner knows (accepted: {', '.join(networks)})")
    return networks[name]["gb_s_per_gpu"]["value"]


def default_network(gpu_name: str) -> str:
    return table("hardware")["default_network"][gpu(gpu_name).name]

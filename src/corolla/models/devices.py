"""Which accelerator a server computes on (`--device`), what its dtype defaults to, and its memory.

`resolve_device(None)` is the best device torch can use here: the current CUDA device, else Apple's MPS,
else the CPU. A named device that this machine or this build of torch lacks is refused with what is
missing, never silently replaced by the CPU. The weights, the attention cache and every pass of the
engine live on the chosen device; what crosses the wire stays on the CPU (models/span.py,
engine/model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from corolla.errors import InvalidRequest
from corolla.utils import cpu_name

DEVICE_KINDS = ("cpu", "cuda", "mps")


def resolve_device(name: str | None, option: str = "device (--device)") -> torch.device:
    """`name` ("cpu", "cuda", "cuda:N", "mps"; None or "auto": the best available) as a usable device;
    `option` names the setting in errors."""
    if name is None or name == "auto":
        return best_device()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in DEVICE_KINDS:
        raise InvalidRequest(f"{option} must be one of auto, cpu, cuda, cuda:N, mps, got {name!r}")
    if device.type == "cuda":
        return _cuda(device, f"{option} {name!r}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidRequest(f"{option} {name!r}: MPS is not available on this machine")
    return device


def best_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def enter_device(device: torch.device) -> None:
    """Make `device` the calling thread's current one (kernels that launch on the current CUDA device then
    find their tensors'); nothing to do for the CPU and MPS."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _cuda(device: torch.device, asked: str) -> torch.device:
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise InvalidRequest(
            f"{asked}: no CUDA device is visible (torch {torch.__version__} is {build}; "
            "see docs/operators.md, 'Installing and deploying', for the CUDA install)"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise InvalidRequest(f"{asked}: this machine has CUDA devices 0..{count - 1}")
    return torch.device("cuda", index)


def default_dtype(device: torch.device) -> str:
    """The compute dtype when none is asked for: float32 on the CPU (its fast kernels), bfloat16 on GPUs
    that have it (the range of float32 at half the memory), float16 on older GPUs and MPS."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    if device.type == "mps":
        return "float16"
    return "float32"


@dataclass(frozen=True)
class DeviceInfo:
    """What a server announces about where it computes."""

    kind: str  # cpu | cuda | mps
    name: str  # "NVIDIA H200", or the CPU's model name
    total_memory: int  # bytes (the machine's RAM for the CPU)


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return DeviceInfo("cuda", properties.name, properties.total_memory)
    if device.type == "mps":
        return DeviceInfo("mps", "Apple MPS", torch.mps.recommended_max_memory())
    return DeviceInfo("cpu", cpu_name(), psutil.virtual_memory().total)


def free_memory(device: torch.device) -> int:
    """Bytes this device can still give to weights and cache."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type == "mps":
        return max(0, torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return psutil.virtual_memory().available

"""Which device a rank runs on, and the facts about it that every rank must share.

`device: auto` takes a GPU where torch can use one and the CPU where the machine has none, but it
refuses to fall back to the CPU on a machine that has an NVIDIA GPU this torch cannot use (a CPU
build, or a CUDA build newer than the driver): that fallback would serve, slowly and silently, on
the wrong device. `cpu` and `cuda` are demands. Each rank on a host needs a GPU of its own (NCCL
refuses two ranks on one GPU), so more ranks on a host than GPUs is refused here, at start-up,
rather than by NCCL at the first request.
"""

from __future__ import annotations

import glob
import subprocess
from dataclasses import dataclass

import torch

from tpserve.ranks.errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DEVICE_TYPES = ("cpu", "cuda")
NVIDIA_SMI_TIMEOUT_S = 20.0


class DeviceError(UserError):
    """This rank cannot run on the device asked for (or, with auto, on the device it found)."""


@dataclass(frozen=True)
class DeviceFacts:
    """What the ranks compare in their flags rows: ranks on different devices or builds would run
    different kernels (or meet in different collectives), so they refuse to start together."""

    device_type: str  # "cpu" or "cuda"
    torch_version: tuple[int, int, int]
    cuda_version: tuple[int, int, int]  # (0, 0, 0) on the CPU
    nccl_version: tuple[int, int, int]  # (0, 0, 0) on the CPU
    # the GPU's compute capability (9, 0 for an H100, 12, 1 for a GB10): ranks on different GPU
    # generations would run different kernels; (0, 0) on the CPU
    capability: tuple[int, int] = (0, 0)


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU, whatever torch can make of it: the driver's device
    nodes, or `nvidia-smi -L` listing one."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def why_no_cuda() -> str:
    """Why torch.cuda.is_available() is False, as far as torch's build tells."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but finds no usable GPU "
        f"(is the driver older than CUDA {torch.version.cuda} needs?)"
    )


def choose_device(choice: str, local_rank: int, local_world_size: int) -> torch.device:
    """The device of the rank `local_rank` of the `local_world_size` ranks on this host."""
    if choice not in DEVICE_CHOICES:
        raise DeviceError(f"device must be one of {', '.join(DEVICE_CHOICES)}, not {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if choice == "cuda":
            raise DeviceError(f"device is cuda, but {why_no_cuda()}")
        if nvidia_gpu_present():
            raise DeviceError(
                f"this machine has an NVIDIA GPU, but {why_no_cuda()}; refusing to fall back to the "
                "CPU. Install a CUDA build of torch (rm -rf .venv && make setup), or set device: cpu "
                "to serve on the CPU on purpose"
            )
        return torch.device("cpu")
    num_gpus = torch.cuda.device_count()
    if local_world_size > num_gpus or not 0 <= local_rank < num_gpus:
        raise DeviceError(
            f"{local_world_size} ranks on this host but {num_gpus} GPU(s): NCCL needs a GPU of its own "
            f"for every rank. Serve with --tp 1 here, run one rank per host (launch.sh --rank R "
            f"--master HOST), or set device: cpu"
        )
    return torch.device("cuda", local_rank)


def device_facts(device: torch.device) -> DeviceFacts:
    gpu = device.type == "cuda"
    return DeviceFacts(
        device_type=device.type,
        torch_version=version_numbers(torch.__version__),
        cuda_version=version_numbers(torch.version.cuda) if gpu else (0, 0, 0),
        nccl_version=_nccl_version() if gpu else (0, 0, 0),
        capability=tuple(torch.cuda.get_device_capability(device)) if gpu else (0, 0),
    )


def _nccl_version() -> tuple[int, int, int]:
    version = torch.cuda.nccl.version()  # (2, 27, 7); older torch builds gave NCCL's version code
    if isinstance(version, int):  # 2708 before NCCL 2.9, 21903 since
        if version >= 10_000:
            return version // 10_000, version // 100 % 100, version % 100
        return version // 1000, version // 100 % 10, version % 100
    return tuple((tuple(version) + (0, 0, 0))[:3])


def version_numbers(text: str | None) -> tuple[int, int, int]:
    """(major, minor, patch) of a version such as "2.13.0+cu130" or "13.0"; zeros for None."""
    numbers = []
    for part in (text or "").split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part else ""
        numbers.append(int(digits) if digits else 0)
    return tuple((numbers + [0, 0, 0])[:3])

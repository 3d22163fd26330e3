"""What a GPU report says about the GPU it ran on (name, memory, driver, CUDA, NCCL); the CPU side
comes from the project's own machine facts (tpserve/kernels/machine.py), as the start-up probe logs them."""

from __future__ import annotations

import subprocess

import torch

NVIDIA_SMI_TIMEOUT_S = 20.0


def gpu_facts() -> dict | None:
    """None where torch sees no GPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "num_gpus": torch.cuda.device_count(),
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "integrated": bool(props.is_integrated),
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "cudnn": torch.backends.cudnn.version(),
        "driver": _driver_version(),
    }


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.strip().splitlines()[0] if out.strip() else "unknown"

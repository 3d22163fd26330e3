"""What a benchmark report says about the machine it ran on: the CPU (model, vector extensions),
torch (version, BLAS, threads) and, where there is one, the GPU (name, memory, driver, CUDA, NCCL).
A figure means little without the machine it came from."""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import torch

# The vector extensions that decide which CPU kernels run (x86-64 flags, aarch64 features).
VECTOR_EXTENSIONS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm", "sme",
)  # fmt: skip
NVIDIA_SMI_TIMEOUT_S = 20.0


def host_facts() -> dict:
    cpuinfo = _read("/proc/cpuinfo")
    flags = set(_first_field(cpuinfo, ("flags", "Features")).split())
    return {
        "machine": platform.machine(),
        "cpu_model": _first_field(cpuinfo, ("model name", "Model name"))
        or _lscpu_model()
        or platform.processor(),
        "num_cpus": _num_cpus(cpuinfo),
        "vector_extensions": [name for name in VECTOR_EXTENSIONS if name in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": _build_setting("BLAS_INFO"),
        "lapack": _build_setting("LAPACK_INFO"),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


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


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _first_field(cpuinfo: str, names: tuple[str, ...]) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return ""


def _num_cpus(cpuinfo: str) -> int:
    return sum(1 for line in cpuinfo.splitlines() if line.startswith("processor")) or 0


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return _first_field(out, ("Model name",))


def _build_setting(name: str) -> str:
    found = re.search(rf"{name}=([^,\s]+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


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

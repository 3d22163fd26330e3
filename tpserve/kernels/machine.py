"""What the numbers depend on: the CPU, its vector extensions, the BLAS, torch and its threads.

Batch invariance is checked on the machine at hand (tpserve/ranks/probe.py), and every benchmark's figures
belong to one machine: both name it with machine_facts().
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

# The extensions that change which kernels the BLAS and torch run.
_VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
    "asimd",
    "sve",
    "sve2",
    "i8mm",
    "bf16",
)


def machine_facts() -> dict[str, object]:
    model, flags = _cpu_info()
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"Math Kernel Library Version ([\w.\-]+)", config)
    return {
        "cpu_model": model,
        "machine": platform.machine(),
        "vector_extensions": [f for f in _VECTOR_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": (blas.group(1) if blas else "unknown") + (f" {mkl.group(1)}" if mkl else ""),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "num_cpus": os.cpu_count(),
    }


def describe_machine() -> str:
    facts = machine_facts()
    isa = facts["mkl_enable_instructions"]
    return (
        f"{facts['cpu_model']} ({' '.join(facts['vector_extensions']) or 'no vector extensions'}), "
        f"torch {facts['torch']} ({facts['torch_cpu_capability']}), BLAS {facts['blas']}"
        + (f" limited to {isa}" if isa else "")
        + f", {facts['threads']} thread"
        + ("s" if facts["threads"] != 1 else "")
    )


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (avx2, avx512_vnni, ...); empty where unread."""
    return _cpu_info()[1]


def _cpu_info() -> tuple[str, set[str]]:
    model, flags, numbers = platform.processor() or platform.machine(), set(), {}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key in ("cpu family", "model") and key not in numbers:
            numbers[key] = value.strip()
    if numbers:
        model += f" (family {numbers.get('cpu family', '?')} model {numbers.get('model', '?')})"
    return model, flags

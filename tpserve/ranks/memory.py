"""How much memory a rank finds free, for sizing its KV pool when no budget is configured."""

from __future__ import annotations

import os

import torch


def host_available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        # Blocks freed while loading (the weights' unfused copies, staging buffers) stay in torch's
        # caching allocator, and both figures below count them as used: hand them back first.
        torch.cuda.empty_cache()
        # A unified-memory GPU (a GB10 reports itself integrated) shares the host's memory, and
        # CUDA's free figure does not see what the host uses.
        if torch.cuda.get_device_properties(device).is_integrated:
            return host_available_bytes()
        return torch.cuda.mem_get_info(device)[0]
    # Ranks on one host share its memory.
    return host_available_bytes() // int(os.environ.get("LOCAL_WORLD_SIZE", "2"))

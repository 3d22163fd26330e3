"""The flags row: what every rank must have been started with alike, agreed before anything loads.

Each rank all-gathers one row of integers (model fingerprint, dtype, KV dtype, quantization, tp, lanes, context, cache
budget, code version, the device type, the torch, CUDA and NCCL versions, the GPU's compute
capability and the attention kernel it would serve with: tpserve/kernels/attention_kernels.py's
attention_choice, so a rank with FlashInfer beside one without refuses rather than give its heads
other numbers); rows that differ make
every rank refuse, printing every row. A rank that refused its device says so in its row, so the
others refuse at once instead of waiting for it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist

from tpserve.kernels.attention_kernels import ATTENTION_CHOICES, rank_attention_choice
from tpserve.ranks.collectives_choice import CHOICES
from tpserve.ranks.device import DEVICE_TYPES, DeviceFacts
from tpserve.ranks.errors import StartupError
from tpserve.ranks.settings import DTYPE_CHOICES, QUANTIZE_CHOICES, EngineSettings
from tpserve.ranks.version import VERSION


def fingerprint(model_dir: str | Path) -> int:
    """A cheap identity of the model files: config.json's bytes and the weight files' sizes."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return int.from_bytes(digest.digest()[:7], "little")


FLAG_NAMES = (
    "model",
    "dtype",
    "kv_dtype",
    "quantize",
    "tp",
    "lanes",
    "context",
    "prefix_caching",
    "kv_block_size",
    "max_prefill",
    "batch_invariant",
    "cpu_collectives",
    "version",
    "device",
    "torch",
    "cuda",
    "nccl",
    "capability",
    "attention",
)
REFUSED = -1  # a rank that refused its device shows this as its device


def flags_row(settings: EngineSettings, facts: DeviceFacts | None) -> list[int]:
    """One rank's row; `facts` None when this rank refused its device (its reason is its own)."""
    version = int.from_bytes(hashlib.sha256(VERSION.encode()).digest()[:7], "little")
    return [
        fingerprint(settings.model_dir),
        DTYPE_CHOICES.index(settings.dtype),
        DTYPE_CHOICES.index(settings.kv_dtype),
        QUANTIZE_CHOICES.index(settings.quantize),
        settings.tp_size,
        settings.num_lanes,
        settings.context_size,
        int(settings.prefix_caching),
        settings.kv_block_size,
        settings.max_prefill_tokens,
        REFUSED if settings.batch_invariant is None else int(settings.batch_invariant),
        CHOICES.index(settings.cpu_collectives) if settings.cpu_collectives in CHOICES else -1,
        version,
        DEVICE_TYPES.index(facts.device_type) if facts else REFUSED,
        *(_packed(numbers) for numbers in _versions(facts)),
        _packed((*facts.capability, 0)) if facts else REFUSED,
        _attention(settings, facts),
    ]


def _attention(settings: EngineSettings, facts: DeviceFacts | None) -> int:
    """The attention kernel family this rank would serve with (decided before loading)."""
    if facts is None or settings.dtype == "auto" or settings.batch_invariant is None:
        return REFUSED
    dtype = getattr(torch, settings.dtype)
    return ATTENTION_CHOICES.index(rank_attention_choice(settings.batch_invariant, dtype, facts.device_type))


def _versions(facts: DeviceFacts | None) -> tuple[tuple[int, int, int], ...]:
    if facts is None:
        return ((0, 0, 0),) * 3
    return facts.torch_version, facts.cuda_version, facts.nccl_version


def _packed(numbers: tuple[int, int, int]) -> int:
    major, minor, patch = numbers
    return major * 10_000 + min(minor, 99) * 100 + min(patch, 99)


def _unpacked(value: int) -> str:
    return f"{value // 10_000}.{value // 100 % 100}.{value % 100}" if value > 0 else "none"


def shown_row(row: list[int]) -> str:
    """A flags row as a person reads it (named choices by name rather than by their index)."""
    named = {
        "dtype": DTYPE_CHOICES,
        "kv_dtype": DTYPE_CHOICES,
        "quantize": QUANTIZE_CHOICES,
        "cpu_collectives": CHOICES,
        "device": DEVICE_TYPES,
        "attention": ATTENTION_CHOICES,
    }
    values = []
    for name, value in zip(FLAG_NAMES, row):
        if name in named:
            value = named[name][value] if 0 <= value < len(named[name]) else "refused"
        elif name in ("torch", "cuda", "nccl"):
            value = _unpacked(value)
        elif name == "capability":
            value = f"sm_{value // 10_000}{value // 100 % 100}" if value > 0 else "none"

        values.append(value)
    return ", ".join(f"{n}={v}" for n, v in zip(FLAG_NAMES, values))


def agree_on_flags(
    settings: EngineSettings,
    facts: DeviceFacts | None,
    rank: int,
    world_size: int,
    group,
    refusal: Exception | None = None,
) -> None:
    """Every rank gathers every row; any difference (or a rank that refused its device, whose row
    says so) refuses the start on every rank, printing every row."""
    mine = torch.tensor(flags_row(settings, facts), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine, group=group)
    if refusal is not None:
        raise StartupError(f"rank {rank}: {refusal}") from refusal
    if any(not torch.equal(row, rows[0]) for row in rows):
        shown = "; ".join(f"rank {r}: {shown_row(row.tolist())}" for r, row in enumerate(rows))
        refused = [r for r, row in enumerate(rows) if int(row[FLAG_NAMES.index("device")]) == REFUSED]
        why = "".join(f" (rank {r} refused its device: its log says why)" for r in refused)
        raise StartupError(
            f"rank {rank}: the ranks were started with different flags, refusing to serve{why} ({shown})"
        )

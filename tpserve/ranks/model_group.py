"""The group the model's forward collectives use: the control group on the CPU; between GPUs an
NCCL group, initialised eagerly and exercised before the rank reports it started.

NCCL left to itself connects at its first collective, so a misconfiguration (two ranks on one GPU,
an unreachable interface) would show only at the first request, after the daemon said "serving".
Here the group is built with its device (`device_id`: NCCL connects at once), then one all_reduce
and one gather run on it, waited for with a deadline; any failure refuses the start, on every rank.
The NCCL watchdog's own timeout is set past the rank's deadlines, so the rank's clear error comes
first and the watchdog's abort only ever backs it up.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from tpserve.ranks.channel import gist_of
from tpserve.ranks.device_wait import to_host
from tpserve.ranks.errors import UserError


class ModelGroupError(UserError):
    """The NCCL group between the GPUs could not be built or did not pass its first collectives."""


def watchdog_timeout_s(collective_timeout_s: float) -> float:
    """NCCL's watchdog timeout: past every deadline the rank keeps itself (collective_timeout_s)."""
    return 2 * collective_timeout_s + 30.0


def open_model_group(device: torch.device, rank: int, world_size: int, timeout_s: float):
    """The group for the model's collectives; `timeout_s` bounds building and exercising it."""
    if device.type != "cuda" or world_size == 1:
        return dist.group.WORLD
    group = _within(
        timeout_s,
        f"rank {rank}: NCCL's connection to the other ranks",
        lambda: dist.new_group(
            backend="nccl", timeout=timedelta(seconds=watchdog_timeout_s(timeout_s)), device_id=device
        ),
    )
    exercise(group, rank, world_size, device, timeout_s)
    return group


def exercise(group, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    """One all_reduce and one gather to rank 0 with known answers, waited for with a deadline."""
    peers = ", ".join(f"rank {r}" for r in range(world_size) if r != rank)
    try:
        total = torch.full((1,), rank + 1, dtype=torch.float32, device=device)
        dist.all_reduce(total, group=group)
        mine = torch.full((1,), float(rank), dtype=torch.float32, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
        dist.gather(mine, gather_list=gathered, group=group, group_dst=0)
        results = torch.cat([total, *(gathered or [])])
        seen = to_host(results, timeout_s, f"rank {rank}: NCCL's first all_reduce and gather with {peers}")
    except RuntimeError as error:  # DeviceTimeout, or NCCL's own errors
        raise ModelGroupError(
            f"rank {rank}: NCCL between the GPUs failed at start-up: {gist_of(error)}"
        ) from None
    want = [world_size * (world_size + 1) / 2] + (list(range(world_size)) if rank == 0 else [])
    if seen.tolist() != want:
        raise ModelGroupError(
            f"rank {rank}: NCCL's first all_reduce and gather gave {seen.tolist()}, not {want}"
        )


def _within(timeout_s: float, what: str, build):
    """build() in a thread, given up on after timeout_s (the rank then exits: it cannot be cancelled)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(("ok", build()))
        except BaseException as error:  # handed to the waiting thread
            outcome.append(("error", error))

    thread = threading.Thread(target=run, name="nccl-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise ModelGroupError(f"{what} did not form within {timeout_s:g}s")
    kind, value = outcome[0]
    if kind == "error":
        raise ModelGroupError(f"{what} failed: {gist_of(value)}") from value
    return value

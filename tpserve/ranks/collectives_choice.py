"""Which collectives a rank's forward pass uses: shared memory between CPU ranks on one host, else
the process group (NCCL between GPUs, gloo otherwise).

Every rank reaches the same decision through the control group (no store keys, which a reused
store could hold from an earlier run): first every rank's host identity is gathered (same boot,
same process namespace, same shared-memory directory, or no shared memory); then rank 0 broadcasts
the name of the segment it created, and a vote says whether every rank mapped it. Rank 0 unlinks the segment
after the second vote, so nothing is left in /dev/shm whatever happens to the ranks later.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from tpserve.kernels.collectives import Collectives, GroupCollectives
from tpserve.kernels.shared_memory import (
    TOKEN_BYTES,
    SharedMemoryCollectives,
    create_segment,
    open_segment,
    usable,
)
from tpserve.ranks.errors import UserError

log = logging.getLogger(__name__)

CHOICES = ("auto", "shared_memory", "gloo")
SHARED_MEMORY_DIR = "/dev/shm"


def choose_collectives(
    choice: str,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    model_group,
    control_group,
    timeout_s: float,
    directory: str | Path = SHARED_MEMORY_DIR,
) -> Collectives | None:
    """None at tp=1. `choice` is the same on every rank (agreed with the other flags)."""
    if choice not in CHOICES:
        raise UserError(f"cpu_collectives must be one of {', '.join(CHOICES)}, not {choice!r}")
    if world_size == 1:
        return None
    if device.type == "cpu" and choice != "gloo":
        shared = _connect(rank, world_size, control_group, timeout_s, Path(directory))
        if shared is not None:
            log.info("rank %d: forward collectives over shared memory", rank)
            return shared
        if choice == "shared_memory":
            raise UserError(
                f"rank {rank}: cpu_collectives is shared_memory, but the ranks cannot share a segment "
                f"in {directory} (they must run on one Linux x86-64 host, in one process namespace)"
            )
    log.info("rank %d: forward collectives over the process group (%s)", rank, dist.get_backend(model_group))
    return GroupCollectives(model_group, rank, world_size)


def choose_wire_exchange(
    choice: str,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    control_group,
    timeout_s: float,
    directory: str | Path = SHARED_MEMORY_DIR,
) -> SharedMemoryCollectives | None:
    """The channel's own segment (tpserve/ranks/channel.py: messages and votes) where the forward
    collectives take one, CPU ranks on one host and `choice` not gloo; None elsewhere: the wire
    stays on gloo. Every rank calls it at the same point (it meets the others on `control_group`)."""
    if world_size == 1 or device.type != "cpu" or choice == "gloo":
        return None
    exchange = _connect(rank, world_size, control_group, timeout_s, Path(directory))
    if exchange is not None:
        log.info("rank %d: the wire over shared memory", rank)
    return exchange


def _connect(
    rank: int, world_size: int, control_group, timeout_s: float, directory: Path
) -> SharedMemoryCollectives | None:
    # rows[r] = (rank r's host identity, 0 when it cannot map a segment; its process id)
    here = _host_identity(directory) if usable(directory) else 0
    rows = [torch.empty(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(rows, torch.tensor([here, os.getpid()]), group=control_group)
    # Every rank compares every row, so all reach the same answer.
    if here == 0 or any(int(row[0]) != here for row in rows):
        return None
    pids = [int(row[1]) for row in rows]
    # Rank 0 names the segment by a random token, sent with whether it could create it.
    segment, created = None, None
    token = secrets.token_bytes(TOKEN_BYTES)
    if rank == 0:
        path = directory / f"tpserve-{token.hex()}"
        try:
            segment, created = create_segment(path, world_size, token), path
        except OSError as error:
            log.warning("rank 0: cannot create a shared-memory segment in %s (%s)", directory, error)
    sent = torch.tensor([int(segment is not None), *struct.unpack("<2q", token)], dtype=torch.int64)
    dist.broadcast(sent, src=0, group=control_group)
    if rank != 0 and sent[0]:
        token = struct.pack("<2q", *sent[1:].tolist())
        segment = open_segment(directory / f"tpserve-{token.hex()}", world_size, token)
    mapped = _every_rank(control_group, segment is not None)
    if created is not None:
        created.unlink()  # every rank that could map it has: the memory lives until the last one exits
    if not mapped:
        if segment is not None:
            segment.close()
        return None
    return SharedMemoryCollectives(segment, rank, world_size, pids, timeout_s)


def _host_identity(directory: Path) -> int:
    """Equal on two ranks when they run on one boot of one machine, see each other's process ids,
    and name the same shared-memory directory; 0 when unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
        where = os.stat(directory)
    except OSError:
        return 0
    identity = f"{boot}:{pid_namespace}:{where.st_dev}:{where.st_ino}".encode()
    return 1 + int.from_bytes(hashlib.sha256(identity).digest()[:7], "little")


def _every_rank(group, yes: bool) -> bool:
    vote = torch.tensor([int(yes)], dtype=torch.int64)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    return bool(vote.item())

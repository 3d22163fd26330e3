"""Runs the followers of a group as child processes of rank 0 on this host (tp=2 without torchrun)."""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tpserve.ranks.follow import run_follower
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import RankRuntime, leave, shutdown, start_rank

# Ports handed out by this process: two asks never get the same one, though neither is bound yet.
_GIVEN: set[int] = set()
_PICK = random.Random()  # its own: a seeded global random (a test plugin's) would repeat picks


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' own ports (Linux's default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _own_share() -> tuple[int, int]:
    """(k, n): this process picks only ports p with p % n == k, where n processes pick side by side
    (pytest-xdist's workers) and could otherwise hand out the same port before either binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return index % count, count


def free_port(address: str = "127.0.0.1") -> int:
    """A port on `address` free now, outside the kernel's ephemeral range: between this call and the
    listener's bind, an outgoing connection (gloo's, the store's, a client's) cannot take it as its own
    port, as one could take a port that bind(0) handed out."""
    low, high = _ephemeral_range()
    index, count = _own_share()
    first = 10000 if low > 11000 else high + 1
    last = low if low > 11000 else 65536
    below = range(first + (index - first) % count, last, count)
    for port in _PICK.sample(below, min(200, len(below))):
        if port in _GIVEN:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as probe:  # every try taken: what the kernel gives
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _follower_process(settings: EngineSettings, rank: int, world_size: int, port: int) -> None:
    leave(run_follower(settings, rank, world_size, "127.0.0.1", port))


@contextmanager
def local_followers(settings: EngineSettings, port: int, join_timeout_s: float = 30.0):
    """Start ranks 1..tp-1 as spawned processes; on exit wait for them, then kill stragglers.

    Yields the list of processes so the caller can watch them.
    """
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_follower_process, args=(settings, rank, settings.tp_size, port), daemon=True)
        for rank in range(1, settings.tp_size)
    ]
    for process in processes:
        process.start()
    try:
        yield processes
    finally:
        for process in processes:
            process.join(join_timeout_s)
            if process.is_alive():
                process.kill()
                process.join(5)


@contextmanager
def local_rank0(settings: EngineSettings) -> Iterator[tuple[RankRuntime, list]]:
    """Rank 0 started in this process on a free port, ranks 1..tp-1 as its child processes; rank 0
    leaves the group on exit (after the caller's Stop), then the followers are waited for.

    Yields the runtime and the follower processes. One per process at a time."""
    port = free_port()
    with local_followers(settings, port) as followers:
        runtime = start_rank(settings, 0, settings.tp_size, "127.0.0.1", port)
        try:
            yield runtime, followers
        finally:
            shutdown(runtime)

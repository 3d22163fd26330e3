"""How the ranks meet: the store on rank 0 (bound to the master address), one seat per rank, every
rank's arrival within the start-up timeout, then the liveness link between rank 0 and each follower.

Exposure: torch's TCPStore has no authentication. Whoever reaches it can read and write every key,
and so could join or disturb the group. Rank 0 therefore serves it on the master address alone
(with `interface` set, that interface's address), never on every interface; the gloo pairs and
the liveness link listen on that interface too. Keep the master address on a link only the pair
uses (a direct cable, a private VLAN), or firewall the store's port and gloo's to the peer's address.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from tpserve.ranks.errors import StartupError
from tpserve.ranks.liveness import LeaderWatch, LivenessHub
from tpserve.ranks.settings import EngineSettings

__all__ = ["meet", "watch_peers"]


def meet(rank: int, world_size: int, host: str, port: int, timeout_s: float, agent_store: bool) -> dist.Store:
    """Connect to the store on rank 0 (or torchrun's agent), take this rank's seat, and wait for
    every rank to arrive.

    Rank 0 serves the store on the master address only (not on every interface): the store has no
    authentication, and whoever reaches it could join the group. A rank whose seat is taken (a
    second rank 1 joining a running pair) is refused before it touches anything the pair uses.
    """
    timeout = timedelta(seconds=timeout_s)
    serves = rank == 0 and not agent_store
    listener = _store_listener(host, port) if serves else None
    try:
        store = dist.TCPStore(
            host,
            port,
            is_master=serves,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach() if listener is not None else None,
        )
    except (RuntimeError, dist.DistStoreError) as error:
        raise StartupError(
            f"rank {rank}: rank 0's store at {host}:{port} never answered within {timeout_s:.0f}s ({error})"
        ) from None
    if store.add(f"tpserve/seat/{rank}", 1) > 1:
        raise StartupError(
            f"rank {rank}: a rank {rank} has already joined the pair whose store is at {host}:{port}; "
            "refusing to join a running pair (stop that pair first)"
        )
    store.set(f"tpserve/arrived/{rank}", "1")
    missing = []
    for other in range(world_size):
        try:
            store.wait([f"tpserve/arrived/{other}"], timeout)
        except (RuntimeError, dist.DistStoreError):
            missing.append(other)
    if missing:
        names = ", ".join(f"rank {other}" for other in missing)
        raise StartupError(f"rank {rank}: {names} never arrived within {timeout_s:.0f}s")
    return store


def _store_listener(host: str, port: int) -> socket.socket:
    """Rank 0's listening socket for the store, bound to the master address alone."""
    try:
        return socket.create_server((host, port), backlog=64)
    except OSError as error:
        raise StartupError(
            f"rank 0: cannot serve the store on {host}:{port} ({error.strerror or error}); the master "
            "address must be one of this host's addresses and the port free"
        ) from None


def watch_peers(store: dist.Store, rank: int, world_size: int, host: str, settings: EngineSettings):
    """Open the liveness link (tpserve/ranks/liveness.py), once start-up can no longer refuse: rank 0
    listens on the master address and publishes where, in the store; a follower connects there."""
    timeout_s = settings.init_timeout_s
    dead_after_s = settings.leader_dead_after_s
    if world_size == 1:
        return None
    try:
        if rank == 0:
            hub = LivenessHub(host, world_size, dead_after_s)
            store.set("tpserve/liveness", f"{hub.port}:{hub.token.hex()}")
            hub.accept_followers(timeout_s)
            return hub
        store.wait(["tpserve/liveness"], timedelta(seconds=timeout_s))
        port, token = store.get("tpserve/liveness").decode().split(":")
        return LeaderWatch(
            host, int(port), bytes.fromhex(token), rank=rank, dead_after_s=dead_after_s, timeout_s=timeout_s
        )
    except (OSError, ConnectionError, RuntimeError, dist.DistStoreError) as error:
        raise StartupError(f"rank {rank}: {error}") from None

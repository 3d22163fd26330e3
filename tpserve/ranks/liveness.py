"""The liveness link: one TCP connection from each follower to rank 0, beside the process group,
carrying a beat each way every `beat_s`, busy or idle.

A rank cannot learn a lost peer from the collectives in time: behind a cut link a gloo collective
waits out its whole timeout, and a follower idle on the store can wait on it longer still. A plain
socket read with a timeout is bounded. A peer whose process ended closes its end (end of file here
within milliseconds); a cut link, a host gone or a hung peer shows as silence for `dead_after_s`.
A rank that leaves on purpose (after Stop) says BYE first, so its peer does not take the close for
a loss. The beats are sent and read on a native thread (tpserve/ranks/beats.py), so a call that holds the
GIL for longer than dead_after_s (a tokenizer on a huge prompt) is no loss; an interpreter that runs
no Python at all for stall_after_s (120 s, or 4 x dead_after_s if longer) stops them, so a peer hung
for good is still found, within stall_after_s + dead_after_s. Rank 0 learns a loss as `lost` (the daemon fails every stream and exits non-zero); a
follower calls `on_lost`, which by default ends the process with exit code 1 whatever its main
thread is waiting on.

A follower finds the link's port and a random token in the store; rank 0 accepts exactly one
connection per follower rank, with that token, and then closes its listening socket.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

from tpserve.ranks.beats import ENDED, LIVE, SILENT, stall_after, start_beats

__all__ = ["LeaderWatch", "LivenessHub", "beat_interval", "exit_on_lost"]

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<q16s")  # follower rank, token
_WELCOME = b"W"
TOKEN_BYTES = 16
CHECK_IN_S = 1.0  # how often a link's watcher checks in with its beats (well within stall_after_s)


def beat_interval(dead_after_s: float) -> float:
    """A beat often enough that a few lost in a row (TCP retransmits) stay well within dead_after_s."""
    return min(2.0, dead_after_s / 5)


def exit_on_lost(message: str) -> None:
    """A follower without rank 0: log why and leave at once with exit code 1 (a supervisor restarts
    the pair). The main thread may be inside a collective or a store wait that would outlast us."""
    log.error("%s; exiting", message)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class _Peer:
    """One end of the link: its beats (tpserve/ranks/beats.py) and a thread that waits for the link to end
    (end of file, silence, an error) and reports it as a loss unless the peer said BYE. The thread
    is what checks in with the beats: an interpreter that runs no Python for stall_after_s stops
    them."""

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        dead_after_s: float,
        on_lost: Callable[[str], None],
        stall_after_s: float | None = None,
    ):
        stall_after_s = stall_after(dead_after_s) if stall_after_s is None else stall_after_s
        self.name = name
        self.dead_after_s = dead_after_s
        self.ended: str | None = None  # why the link ended, once it did
        self.closing = False  # this end is closing
        self._on_lost = on_lost
        self._beats = start_beats(sock, beat_interval(dead_after_s), dead_after_s, stall_after_s)
        self._watcher = threading.Thread(target=self._watch, name=f"liveness-{name}", daemon=True)
        self._watcher.start()

    def close(self, bye: bool = True) -> None:
        """Say BYE (unless told not to: the peer then takes the close for a loss) and close (idempotent)."""
        if self.closing:
            return
        self.closing = True
        self._beats.close(bye)
        self._watcher.join(timeout=5 * CHECK_IN_S)
        if not self._watcher.is_alive():
            self._beats.free()

    def _watch(self) -> None:
        state = LIVE
        while state == LIVE:
            state = self._beats.wait(CHECK_IN_S)
        if state == SILENT:
            message = (
                f"no heartbeat from {self.name} for {self._beats.silent_s():.1f}s "
                f"(dead_after_s {self.dead_after_s:g}: the link is down, its host gone or it hung)"
            )
        elif state == ENDED:
            message = f"{self.name} closed the liveness link (its process ended)"
        else:
            message = f"the liveness link to {self.name} failed: {os.strerror(self._beats.error())}"
        self.ended = message
        if not (self.closing or self._beats.leaving()):
            self._on_lost(message)


class LivenessHub:
    """Rank 0's end: listens on `host` (the master address), one link per follower."""

    def __init__(self, host: str, world_size: int, dead_after_s: float, stall_after_s: float | None = None):
        self.world_size = world_size
        self.dead_after_s = dead_after_s
        self.stall_after_s = stall_after_s  # None: stall_after(dead_after_s)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.lost: str | None = None  # why a follower is lost, once one is
        self._peers: dict[int, _Peer] = {}
        self._listener = socket.create_server((host, 0), backlog=world_size)
        self.port = self._listener.getsockname()[1]

    def accept_followers(self, timeout_s: float) -> None:
        """Wait up to timeout_s for every follower's link (each beats from its arrival); then stop
        listening."""
        deadline = time.monotonic() + timeout_s
        try:
            while len(self._peers) < self.world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(1, self.world_size) if r not in self._peers]
                    names = ", ".join(f"rank {r}" for r in missing)
                    raise TimeoutError(f"{names} never opened the liveness link within {timeout_s:.0f}s")
                self._listener.settimeout(left)
                try:
                    sock, _ = self._listener.accept()
                except TimeoutError:
                    continue
                self._greet(sock, deadline)
        finally:
            self._listener.close()

    def _greet(self, sock: socket.socket, deadline: float) -> None:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            rank, token = _HELLO.unpack(_receive_exactly(sock, _HELLO.size))
        except (OSError, ConnectionError, struct.error):
            sock.close()
            return
        if token != self.token or not 0 < rank < self.world_size or rank in self._peers:
            log.warning("rank 0: refused a liveness link claiming rank %d (wrong token or taken)", rank)
            sock.close()
            return
        sock.sendall(_WELCOME)
        sock.settimeout(None)
        self._peers[rank] = _Peer(
            sock, f"rank {rank}", self.dead_after_s, self._follower_lost, self.stall_after_s
        )

    def _follower_lost(self, message: str) -> None:
        if self.lost is None:
            self.lost = message
            log.error("rank 0: %s", message)

    def close(self) -> None:
        """Say BYE to every follower (after Stop) and close the links."""
        self._close(bye=True)

    def sever(self) -> None:
        """Close the links with no BYE: every follower takes it for rank 0's end and exits 1 now, not
        after dead_after_s (rank 0 is leaving without Stop while its followers are well)."""
        self._close(bye=False)

    def _close(self, bye: bool) -> None:
        for peer in self._peers.values():
            peer.close(bye)
        self._listener.close()


class LeaderWatch:
    """A follower's end: connects to rank 0's hub and watches it."""

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        *,
        rank: int,
        dead_after_s: float,
        timeout_s: float,
        on_lost: Callable[[str], None] = exit_on_lost,
        stall_after_s: float | None = None,
    ):
        what = f"rank {rank}: rank 0's liveness link at {host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.sendall(_HELLO.pack(rank, token))
            if _receive_exactly(sock, len(_WELCOME)) != _WELCOME:
                raise ConnectionError("refused")
        except (OSError, ConnectionError) as error:
            raise ConnectionError(f"{what} did not take this rank: {error}") from None
        sock.settimeout(None)
        self._peer = _Peer(
            sock, "rank 0", dead_after_s, lambda message: on_lost(f"rank {rank}: {message}"), stall_after_s
        )

    def alive(self) -> bool:
        """Rank 0 still beats on the link (the channel's idle wait asks, tpserve/ranks/channel.py)."""
        return self._peer.ended is None

    def close(self) -> None:
        """Say BYE to rank 0 (after Stop) and close."""
        self._peer.close()


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data

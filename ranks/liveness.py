"""The liveness link: one TCP connection from each follower to rank 0, beside the process group,
carrying a beat each way every `beat_s`, busy or idle.

A rank cannot learn a lost peer from the collectives in time: behind a cut link a gloo collective
waits out its whole timeout, and a follower idle on the store can wait on it longer still. A plain
socket read with a timeout is bounded. A peer whose process ended closes its end (end of file here
within milliseconds); a cut link, a host gone or a hung peer shows as silence for `dead_after_s`.
A rank that leaves on purpose (after Stop) says BYE first, so its peer does not take the close for
a loss. Rank 0 learns a loss as `lost` (the daemon fails every stream and exits non-zero); a
follower calls `on_lost`, which by default ends the process with exit code 1 whatever its main
thread is waiting on.

A follower finds the link's port and a random token in the store; rank 0 accepts exactly one
connection per follower rank, with that token, and then closes its listening socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["LeaderWatch", "LivenessHub", "beat_interval", "exit_on_lost"]

log = logging.getLogger(__name__)

_BEAT, _BYE = b".", b"B"
_HELLO = struct.Struct("<q16s")  # follower rank, token
_WELCOME = b"W"
TOKEN_BYTES = 16


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
    """One end of the link: a thread reading beats (silence or end of file is a loss unless the
    peer said BYE), and beats sent by whoever calls beat()."""

    def __init__(self, sock: socket.socket, name: str, dead_after_s: float, on_lost: Callable[[str], None]):
        sock.settimeout(dead_after_s)
        self.sock = sock
        self.name = name
        self.dead_after_s = dead_after_s
        self.leaving = False  # the peer said BYE
        self.closing = False  # this end is closing
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"liveness-{name}", daemon=True)
        self._reader.start()

    def beat(self) -> None:
        self._send(_BEAT)

    def close(self, bye: bool = True) -> None:
        """Say BYE (unless told not to: the peer then takes the close for a loss) and close (idempotent)."""
        if self.closing:
            return
        self.closing = True
        if bye:
            self._send(_BYE)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _send(self, what: bytes) -> None:
        # On failure the reader notices the loss (silence or end of file) and reports it.
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.sendall(what)

    def _read(self) -> None:
        heard = time.monotonic()
        while True:
            try:
                data = self.sock.recv(64)
            except TimeoutError:
                self._lost(
                    f"no heartbeat from {self.name} for {time.monotonic() - heard:.1f}s "
                    f"(dead_after_s {self.dead_after_s:g}: the link is down, its host gone or it hung)"
                )
                return
            except ConnectionResetError:  # closed with our beats unread: it ended too
                data = b""
            except OSError as error:
                self._lost(f"the liveness link to {self.name} failed: {error}")
                return
            if not data:
                self._lost(f"{self.name} closed the liveness link (its process ended)")
                return
            heard = time.monotonic()
            if _BYE in data:
                self.leaving = True

    def _lost(self, message: str) -> None:
        if not (self.closing or self.leaving):
            self._on_lost(message)


class _Beater:
    """Calls beat() on the peers every beat_s until stopped."""

    def __init__(self, peers: Callable[[], list[_Peer]], beat_s: float):
        self._peers = peers
        self._beat_s = beat_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._beat_s):
            for peer in self._peers():
                peer.beat()

    def stop(self) -> None:
        self._stop.set()


class LivenessHub:
    """Rank 0's end: listens on `host` (the master address), one link per follower."""

    def __init__(self, host: str, world_size: int, dead_after_s: float):
        self.world_size = world_size
        self.dead_after_s = dead_after_s
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.lost: str | None = None  # why a follower is lost, once one is
        self._peers: dict[int, _Peer] = {}
        self._listener = socket.create_server((host, 0), backlog=world_size)
        self.port = self._listener.getsockname()[1]
        self._beater: _Beater | None = None

    def accept_followers(self, timeout_s: float) -> None:
        """Wait up to timeout_s for every follower's link; then stop listening and start beating."""
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
        self._beater = _Beater(lambda: list(self._peers.values()), beat_interval(self.dead_after_s))

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
        self._peers[rank] = _Peer(sock, f"rank {rank}", self.dead_after_s, self._follower_lost)

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
        if self._beater is not None:
            self._beater.stop()
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
    ):
        what = f"rank {rank}: rank 0's liveness link at {host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.sendall(_HELLO.pack(rank, token))
            if _receive_exactly(sock, len(_WELCOME)) != _WELCOME:
                raise ConnectionError("refused")
        except (OSError, ConnectionError) as error:
            raise ConnectionError(f"{what} did not take this rank: {error}") from None
        self._peer = _Peer(sock, "rank 0", dead_after_s, lambda message: on_lost(f"rank {rank}: {message}"))
        self._beater = _Beater(lambda: [self._peer], beat_interval(dead_after_s))

    def close(self) -> None:
        """Say BYE to rank 0 (after Stop) and close."""
        self._beater.stop()
        self._peer.close()


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data

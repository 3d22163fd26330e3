"""The liveness link's beats, sent and read where a busy interpreter cannot starve them.

A call that holds the GIL stops every Python thread (a tokenizer on a 4 MiB prompt held it for
10-28 s), and beats sent and read by Python threads stopped with it: the follower took rank 0 for
dead and the pair went down. So a native thread (tpserve/kernels/native/beat.c) owns the link's socket,
beats every beat_s and reads the peer's beats with no GIL; Python only asks it whether the link
ended, in a call that blocks with the GIL released.

What a beat proves then: the process runs, the link carries, and its interpreter ran some Python
within `stall_after_s`, since the native thread beats only while Python checks in that often. That
bound is generous (the larger of STALL_FLOOR_S and 4 x dead_after_s): a long tokenizer or kernel
call is no loss, and an interpreter stuck for good (a call that never returns, GIL held) is still
found, stall_after_s + dead_after_s after it stuck. An engine loop stuck on a lock while the
interpreter runs was never the beats' to find, with Python threads either: the collectives'
timeouts find it.

Where no C compiler works, Python threads beat as before, which a long GIL hold can starve; the
first link says so in the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import threading
import time
from functools import cache
from typing import Protocol

from tpserve.kernels import native

__all__ = ["ENDED", "FAILED", "LIVE", "SILENT", "STALL_FLOOR_S", "Beats", "start_beats", "stall_after"]

log = logging.getLogger(__name__)

LIVE, ENDED, SILENT, FAILED = 0, 1, 2, 3  # as in beat.c
BEAT, BYE = b".", b"B"
STALL_FLOOR_S = 120.0


def stall_after(dead_after_s: float) -> float:
    """How long Python may not check in before the beats stop (see the module docstring)."""
    return max(STALL_FLOOR_S, 4 * dead_after_s)


class Beats(Protocol):
    """One end's beats on a connected socket, whichever runs them."""

    def wait(self, timeout_s: float) -> int:
        """Check in (the beats go on); wait up to timeout_s for the link to end; its state."""

    def silent_s(self) -> float:
        """Seconds since the peer's last bytes."""

    def error(self) -> int:
        """The errno that FAILED the link."""

    def leaving(self) -> bool:
        """The peer said BYE."""

    def close(self, bye: bool) -> None:
        """Say BYE (if `bye`), stop beating, close the socket. Idempotent."""

    def free(self) -> None:
        """Let go of what close() left readable; nothing may be called after."""


def start_beats(sock: socket.socket, beat_s: float, dead_after_s: float, stall_after_s: float) -> Beats:
    """Beats on `sock` (taken over: the beats close it) on a native thread, or Python's if none."""
    try:
        library = _library()
    except native.NativeUnavailable as err:
        _warn_python_beats(str(err))
        return PythonBeats(sock, beat_s, dead_after_s)
    return NativeBeats(library, sock, beat_s, dead_after_s, stall_after_s)


@cache
def _library() -> ctypes.CDLL:
    library = native.load("beat")
    handle, number = ctypes.c_void_p, ctypes.c_double
    for name, result, arguments in (
        ("beat_start", handle, [ctypes.c_int, number, number, number]),
        ("beat_wait", ctypes.c_int, [handle, number]),
        ("beat_silent_s", number, [handle]),
        ("beat_error", ctypes.c_int, [handle]),
        ("beat_leaving", ctypes.c_int, [handle]),
        ("beat_close", None, [handle, ctypes.c_int]),
        ("beat_free", None, [handle]),
    ):
        function = getattr(library, name)
        function.restype, function.argtypes = result, arguments
    return library


@cache
def _warn_python_beats(reason: str) -> None:
    log.warning(
        "liveness beats on Python threads (%s): a call holding the GIL for leader_dead_after_s "
        "would make the peer take this rank for lost",
        reason,
    )


class NativeBeats:
    """beat.c's link (ctypes.CDLL calls release the GIL, so wait() blocks no other thread)."""

    def __init__(self, library: ctypes.CDLL, sock: socket.socket, beat_s, dead_after_s, stall_after_s):
        self._library = library
        fd = sock.detach()
        self._link = library.beat_start(fd, beat_s, dead_after_s, stall_after_s)
        if not self._link:
            os.close(fd)
            raise ConnectionError("could not start the liveness link's beat thread")

    def wait(self, timeout_s: float) -> int:
        return self._library.beat_wait(self._link, timeout_s)

    def silent_s(self) -> float:
        return self._library.beat_silent_s(self._link)

    def error(self) -> int:
        return self._library.beat_error(self._link)

    def leaving(self) -> bool:
        return bool(self._library.beat_leaving(self._link))

    def close(self, bye: bool) -> None:
        self._library.beat_close(self._link, 1 if bye else 0)

    def free(self) -> None:
        link, self._link = self._link, None
        if link:
            self._library.beat_free(link)


class PythonBeats:
    """The same on two Python threads: a reader (silence is a socket timeout) and a beater."""

    def __init__(self, sock: socket.socket, beat_s: float, dead_after_s: float):
        sock.settimeout(dead_after_s)
        self._sock = sock
        self._state, self._error, self._leaving, self._closing = LIVE, 0, False, False
        self._heard = time.monotonic()
        self._ended = threading.Event()
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="liveness-read", daemon=True).start()
        threading.Thread(target=self._beat, args=(beat_s,), name="liveness-beat", daemon=True).start()

    def wait(self, timeout_s: float) -> int:
        self._ended.wait(timeout_s)
        return self._state

    def silent_s(self) -> float:
        return time.monotonic() - self._heard

    def error(self) -> int:
        return self._error

    def leaving(self) -> bool:
        return self._leaving

    def close(self, bye: bool) -> None:
        if self._closing:
            return
        self._closing = True
        if bye:
            self._send(BYE)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def free(self) -> None:
        pass

    def _send(self, what: bytes) -> None:
        # On failure the reader notices the loss (silence or end of file).
        with self._send_lock, contextlib.suppress(OSError):
            self._sock.sendall(what)

    def _beat(self, beat_s: float) -> None:
        while not (self._ended.wait(beat_s) or self._closing):
            self._send(BEAT)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(64)
            except TimeoutError:
                return self._end(SILENT)
            except ConnectionResetError:  # closed with our beats unread: it ended too
                data = b""
            except OSError as error:
                return self._end(ENDED if self._closing else FAILED, error.errno or 0)
            if not data:
                return self._end(ENDED)
            self._heard = time.monotonic()
            if BYE in data:
                self._leaving = True

    def _end(self, state: int, error: int = 0) -> None:
        self._state, self._error = state, error
        self._ended.set()

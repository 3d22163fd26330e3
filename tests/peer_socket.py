"""Another process's TCP socket, read as that process holds it: the daemon's end of a test's own
connection, found by its ports in /proc/net/tcp and copied into this process with pidfd_getfd(2), so
a test can read the options the daemon set on it (TCP_NODELAY) instead of timing what they cause.

pidfd_getfd needs Linux 5.6 and the right to ptrace the process (a test's daemon is its child).
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path

SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)
ESTABLISHED = "01"


def _inodes_by_ports(local_port: int, peer_port: int) -> set[str]:
    """Inodes of the established loopback sockets from local_port to peer_port (IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, peer, state, inode = fields[1], fields[2], fields[3], fields[9]
            ports = (int(local.rsplit(":", 1)[1], 16), int(peer.rsplit(":", 1)[1], 16))
            if state == ESTABLISHED and ports == (local_port, peer_port):
                found.add(inode)
    return found


def peer_socket(pids: list[int], local_port: int, peer_port: int) -> socket.socket:
    """A copy of the socket one of `pids` holds from its local_port to peer_port (close it after)."""
    inodes = _inodes_by_ports(local_port, peer_port)
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in pids:
        for entry in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(entry)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                pidfd = os.pidfd_open(pid)
                try:
                    fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(entry.name), 0)
                    if fd < 0:
                        raise OSError(
                            ctypes.get_errno(), f"pidfd_getfd on pid {pid}: {os.strerror(ctypes.get_errno())}"
                        )
                finally:
                    os.close(pidfd)
                return socket.socket(fileno=fd)
    raise LookupError(f"no process of {pids} holds a socket from port {local_port} to {peer_port}")

"""The network interface the ranks talk over: checked at start-up, then named to gloo and NCCL.

With `interface` set, a rank refuses to start unless that interface exists on this host, has an
IPv4 address, and the master address is reached through it (on rank 0: the master address is
that address; on a follower: the kernel's route to the master leaves from it). The check sends
nothing: it asks the kernel which source address a UDP socket connected to the master would use.
gloo and NCCL read the interface from their environment variables only, so the rank sets them
from the config before its process group starts (launch.sh exports them too).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from tpserve.ranks.errors import UserError

__all__ = ["NetworkError", "check_interface", "interface_address", "name_interface", "resolve_ipv4"]

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (first) IPv4 address


class NetworkError(UserError):
    """The named interface is missing, has no address, or does not lead to the master."""


def resolve_ipv4(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError) as error:
        raise NetworkError(
            f"the master address {host!r} does not resolve to an IPv4 address ({error})"
        ) from None


def interface_address(interface: str) -> str:
    """The interface's IPv4 address; NetworkError naming the interfaces there are when it has none."""
    names = [name for _, name in socket.if_nameindex()]
    if interface not in names:
        raise NetworkError(
            f"interface {interface!r} does not exist on this host (it has: {', '.join(names)})"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            raise NetworkError(f"interface {interface!r} has no IPv4 address") from None
    return socket.inet_ntoa(reply[20:24])


def check_interface(interface: str, master_host: str, master_port: int, rank: int) -> str:
    """Refuse unless `master_host` is reached through `interface` here; returns the interface's address."""
    address = interface_address(interface)
    master = resolve_ipv4(master_host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master, master_port))  # UDP: picks a route and a source, sends nothing
        except OSError as error:
            raise NetworkError(
                f"rank {rank}: the master {master_host}:{master_port} is not reachable from interface "
                f"{interface!r} ({address}): {error.strerror or error}"
            ) from None
        source = probe.getsockname()[0]
    if rank == 0 and master != address:
        raise NetworkError(
            f"rank 0: the master address {master_host} ({master}) is not interface {interface!r}'s "
            f"address ({address}); rank 0 serves the store there, so give --master {address}[:PORT]"
        )
    if source != address:
        raise NetworkError(
            f"rank {rank}: the master {master_host}:{master_port} is not reachable from interface "
            f"{interface!r} ({address}): the route to {master} leaves from {source} instead"
        )
    return address


def name_interface(interface: str) -> None:
    """Tell gloo and NCCL which interface to use; refuse an environment that names another one."""
    for variable in IFNAME_VARIABLES:
        already = os.environ.get(variable)
        if already and already != interface:
            raise NetworkError(
                f"{variable} is {already!r} in the environment but the config names interface "
                f"{interface!r}; unset it or make them agree"
            )
        os.environ[variable] = interface

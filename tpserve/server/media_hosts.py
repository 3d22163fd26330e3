"""Which hosts and addresses a media URL may reach: the operator's allowed_media_domains, checked at
start-up, and the public-addresses-only rule every resolved address must pass before a connection.

A host matches an entry exactly, as vLLM's --allowed-media-domains matches (no suffixes, no
wildcards). Unlike vLLM's, an empty list allows no host at all: remote URLs stay refused.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Why an address may not be fetched from, or None where it may.
AddressPolicy = Callable[[IPAddress], "str | None"]

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_MAX_NAME_CHARS = 253


def domain_problem(entry: str) -> str | None:
    """Why one allowed_media_domains entry is no host name, or None."""
    shown = f"allowed_media_domains: {entry!r}"
    if "://" in entry or "/" in entry:
        host = entry.split("://", 1)[-1].split("/", 1)[0]
        return f"{shown} is a URL; give the host name alone (such as {host!r})"
    if "*" in entry:
        return f"{shown} is a wildcard; hosts match exactly (as vLLM's), so name each host"
    if ":" in entry:
        return f"{shown} holds a port or is an IPv6 address; give a host name (any port of it is allowed)"
    name = entry.lower()
    if len(name) > _MAX_NAME_CHARS or not all(_LABEL.match(label) for label in name.split(".")):
        return f"{shown} is not a host name (letters, digits and hyphens between dots; xn-- for others)"
    return None


def allowed_hosts(entries: tuple[str, ...]) -> frozenset[str]:
    """The entries as the URLs' hosts are compared with them (host names are case-blind)."""
    return frozenset(entry.lower() for entry in entries)


def public_address_problem(address: IPAddress) -> str | None:
    """The rule for every fetch: a public unicast address only, so a request cannot make this server
    reach its own host or its network (request forgery). An IPv6 address carrying an IPv4 one
    (mapped, 6to4) is judged by the IPv4 address inside it."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour
        if inner is not None:
            return public_address_problem(inner)
    for kind, is_kind in (
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
    ):
        if is_kind:
            return f"a {kind} address"
    return None if address.is_global else "not a global address"

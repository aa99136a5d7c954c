"""Which address of this host the trainer advertises to the servers, and which local address reaches a host.

Every worker connects to the trainer's rendezvous store at ``master_address``,
and gloo then connects each pair of ranks at the address each one bound. So
the trainer must advertise an address every server reaches. When all servers
run on this host that is loopback (and the shm ring is worth offering). When
one runs elsewhere, loopback names *that* host's own loopback: the worker is
refused, and the round fails. The address to advertise is then the one this
host reaches the servers from, the source address the kernel picks for a
route to each of them, which is how ``servers: [url]`` alone is enough for a
trainer on another host.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


def _resolve(host: str) -> tuple[int, str]:
    """``(address family, IP)`` of ``host`` (an IP or a name); ``OSError`` if it has none."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)[0]
    return family, str(sockaddr[0])


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(_resolve(host)[1]).is_loopback
    except (OSError, ValueError):
        return False


def local_address_towards(host: str) -> str:
    """The local IP the OS would use to reach ``host`` (gloo binds to it);
    ``OSError`` when this host has no route to it."""
    family, ip = _resolve(host)
    if ipaddress.ip_address(ip).is_loopback:
        return ip
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP connect sends nothing; it only picks a route
        return str(s.getsockname()[0])


@dataclass(frozen=True)
class Route:
    """How this host reaches one server: ``server`` as given (a URL's host, an
    actor's node address), its ``ip`` and the ``source`` address of the route.
    ``source == ip``: the server names an address of this host."""

    server: str
    ip: str
    source: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip).is_loopback

    @property
    def remote(self) -> bool:
        """On another host (or another network namespace): this host's loopback does not reach it."""
        return not self.loopback and self.source != self.ip


def route_to(server: str) -> Route:
    try:
        ip = _resolve(server)[1]
        return Route(server, ip, local_address_towards(ip))
    except OSError as e:
        raise ValueError(
            f"cannot find a route from this host to the server host {server!r}: {e}. Check the server URL "
            "(or set init_info.master_address to an address of this host the servers reach)"
        ) from e


def advertised_address(server_hosts: Sequence[str] | None, master_address: str | None) -> str:
    """The ``master_address`` to advertise to servers on ``server_hosts``.

    ``master_address`` given: that one, unless it is loopback while a server
    runs on another host (``ValueError`` naming the server: its workers could
    never connect). Not given: loopback when every server is on this host
    and reached over loopback; else the address this host reaches the remote
    servers from, which must be one address for all of them (servers on
    this host reach any of its addresses); servers reached only at an
    address of this host get that address. Routes through different local
    addresses (servers on two networks) raise ``ValueError``: no address is
    known to reach all of them. ``server_hosts=None`` (a client that cannot
    say where its servers run): loopback, as for a server on this host.
    """
    routes = [route_to(h) for h in server_hosts or ()] if master_address is None or is_loopback(master_address) else []
    remote = [r for r in routes if r.remote]
    if master_address is not None:
        if remote:
            r = remote[0]
            raise ValueError(
                f"init_info.master_address={master_address!r} is this host's loopback, which the server at "
                f"{r.server} (another host) cannot reach: leave master_address out (the trainer then "
                f"advertises {r.source}, the address this host reaches it from) or set an address of this "
                "host every server reaches"
            )
        return master_address
    sources = sorted({r.source for r in remote})
    if len(sources) > 1:
        by_source = "; ".join(
            f"{s} for {', '.join(r.server for r in remote if r.source == s)}" for s in sources
        )
        raise ValueError(
            f"the servers are reached from different addresses of this host ({by_source}), and none is "
            "known to reach all of them: set init_info.master_address to an address of this host that "
            "every server reaches"
        )
    if sources:
        return sources[0]
    own = [r.ip for r in routes if not r.loopback]
    return own[0] if own else LOOPBACK

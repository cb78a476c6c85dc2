"""Which local interface and address a node's transports use.

On a real cluster every host name may resolve to a loopback address (``127.0.1.1`` under
Debian's ``/etc/hosts``), and gloo binds - and advertises to its peers - the address its
host name resolves to unless ``GLOO_SOCKET_IFNAME`` names an interface. So each node's
transports are bound to the interface that carries the node's own address (the node
agent's ``--address``), found from the address itself, the same in every round.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil


def interface_of(addr: str) -> str | None:
    """The local interface that carries ``addr`` (exactly, else by its network), or None."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(addr))
        except (OSError, ValueError):
            return None
    inside = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                mine = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if mine == ip:
                return name
            if inside is None and a.netmask and mine.version == ip.version:
                try:
                    net = ipaddress.ip_network(f"{mine}/{a.netmask}", strict=False)
                except ValueError:
                    continue
                if ip in net:
                    inside = name
    return inside


def source_address(host: str, port: int = 9) -> str:
    """The local address this machine uses to reach ``host`` (the route's source; no
    packet is sent: a UDP connect only picks the route). Loopback if there is no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"


def transport_env(addr: str, ifname: str | None = None) -> dict[str, str]:
    """The transports' interface variables for a node at ``addr`` (``ifname``: the
    operator's override); empty when no local interface carries ``addr``."""
    from pollux_launch.env import TRANSPORT_IFNAME

    name = ifname or interface_of(addr)
    return dict.fromkeys(TRANSPORT_IFNAME, name) if name else {}


def advertised_address(store: object) -> str:
    """The address a node advertises by default: the one its traffic to the store
    leaves from (on a multi-host cluster the host's address on the cluster network,
    whatever its host name resolves to); loopback for a store on this machine alone."""
    endpoints = getattr(store, "endpoints", None)
    if not endpoints:
        return "127.0.0.1"
    host, port = endpoints[0]
    return source_address(host, port)

"""Cutting this process's connections: to a host that is gone, or of a round left broken.

A host that dies or drops off the network sends nothing - no FIN, no RST - so a peer
blocked in a collective with it waits for the whole collective timeout (60 s by
default). The rendezvous learns sooner that the host is gone: every worker there lost its
lease while this worker could reach the store. Then it shuts down this process's TCP
connections to that address (gloo's pairs, the round's TCPStore): the blocked collective
fails at once with "connection closed", and the survivors re-form in a failure round, as
after any peer failure.

A survivor that leaves a broken round (:func:`~.process_group.destroy_group`) cuts that
round's own connections (:func:`sever_sockets`, the sockets :func:`tcp_sockets` found
made while the round's group formed). Destroying a gloo group closes them - unless
something still holds the group, as FSDP2's mesh and DTensors do - and until they close,
a peer blocked on this rank in a collective of that round waits out the timeout.

``shutdown`` acts on the connection, not on one descriptor, so shutting down a duplicate
of the descriptor ends the connection for the transport that owns it; nothing of the
transport's is closed or freed here.
"""

from __future__ import annotations

import logging
import os
import socket

import psutil

log = logging.getLogger(__name__)
ESTABLISHED = "01"  # a connection's state in /proc/net/tcp


def sever(address: str) -> int:
    """Shut down every established TCP connection of this process to ``address``;
    returns how many."""
    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if not conn.raddr or conn.raddr.ip != address or conn.fd < 0:
            continue
        if conn.status != psutil.CONN_ESTABLISHED:
            continue
        cut += _shutdown(conn.fd)
    return cut


def tcp_sockets() -> set[int]:
    """The inodes of this process's established TCP connections (Linux's /proc; empty
    elsewhere). Never a listening socket: gloo aborts the process when its listener's
    accept fails."""
    mine = set(_socket_fds().values())
    tcp = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)  # (the header)
                tcp.update(int(cols[9]) for cols in map(str.split, f)
                           if cols[3] == ESTABLISHED)
        except OSError:  # no IPv6 here, or no /proc
            continue
    return mine & tcp


def sever_sockets(inodes: set[int]) -> int:
    """Shut down this process's sockets of ``inodes`` (from :func:`tcp_sockets`); returns
    how many. Their owners keep their descriptors: nothing is closed or freed here."""
    if not inodes:
        return 0
    return sum(_shutdown(fd) for fd, inode in _socket_fds().items() if inode in inodes)


def _socket_fds() -> dict[int, int]:
    """This process's socket descriptors -> their inodes (empty without /proc)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    out = {}
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out[int(fd)] = int(link[8:-1])
    return out


def _shutdown(fd: int) -> int:
    try:
        dup = os.dup(fd)
    except OSError:  # closed meanwhile: nothing to cut
        return 0
    with socket.socket(fileno=dup) as sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
            return 1
        except OSError:  # already down
            return 0

"""Cutting this process's connections to a host that is gone.

A host that dies or drops off the network sends nothing - no FIN, no RST - so a peer
blocked in a collective with it waits for the whole collective timeout (60 s by
default). The rendezvous learns sooner that the host is gone: every worker there lost its
lease while this worker could reach the store. Then it shuts down this process's TCP
connections to that address (gloo's pairs, the round's TCPStore): the blocked collective
fails at once with "connection closed", and the survivors re-form in a failure round, as
after any peer failure.

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


def sever(address: str) -> int:
    """Shut down every established TCP connection of this process to ``address``;
    returns how many."""
    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if not conn.raddr or conn.raddr.ip != address or conn.fd < 0:
            continue
        if conn.status != psutil.CONN_ESTABLISHED:
            continue
        try:
            dup = os.dup(conn.fd)
        except OSError:  # closed meanwhile: nothing to cut
            continue
        with socket.socket(fileno=dup) as sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:  # already down
                continue
    return cut

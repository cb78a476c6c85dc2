"""Host lists in horovodrun's formats: ``-H host:slots,...`` and hostfiles.

A hostfile has one host per line, ``hostname slots=N`` (``slots`` optional), with
``#`` comments and blank lines ignored - the format horovodrun and mpirun read.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from pollux_launch.errors import UserError

from ..messages import MAX_SLOTS

# the names that mean this machine in a host list (local mode runs only on those)
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", socket.gethostname()})

_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


class HostsError(UserError, ValueError):
    """A malformed -H list or hostfile (the message says where and how to fix it)."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hosts(spec: str, default_slots: int = 1) -> tuple[Host, ...]:
    """Parse ``-H host1:2,host2:4`` (a host without ``:slots`` gets ``default_slots``)."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise HostsError(f"-H {spec!r}: empty host entry; use host:slots,host:slots")
        name, sep, slots = item.rpartition(":")
        if not sep or not slots.isdigit():
            name, slots_n = item, default_slots
        else:
            slots_n = int(slots)
        hosts.append(_host(name, slots_n, f"-H entry {item!r}"))
    return _unique(hosts, "-H")


def parse_hostfile(path: str | Path, default_slots: int = 1) -> tuple[Host, ...]:
    """Parse a hostfile of ``host slots=N`` lines."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise HostsError(f"--hostfile {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise HostsError(f"--hostfile {path}: not UTF-8 text; write 'hostname slots=N' "
                         "lines") from None
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = default_slots
        for field in rest:
            key, sep, value = field.partition("=")
            if key not in ("slots", "max_slots") or not sep or not value.isdigit():
                raise HostsError(
                    f"{path}:{lineno}: expected 'hostname slots=N', got {raw.strip()!r}"
                )
            if key == "slots":
                slots = int(value)
        hosts.append(_host(name, slots, f"{path}:{lineno}"))
    if not hosts:
        raise HostsError(f"{path}: no hosts in hostfile; add lines like 'node1 slots=4'")
    return _unique(hosts, str(path))


def _host(name: str, slots: int, where: str) -> Host:
    if not name or not _NAME.match(name):
        raise HostsError(f"{where}: {name!r} is not a valid host name")
    if not 1 <= slots <= MAX_SLOTS:
        raise HostsError(f"{where}: slots must be a whole number from 1 to {MAX_SLOTS}")
    return Host(name, slots)


def _unique(hosts: list[Host], where: str) -> tuple[Host, ...]:
    seen = set()
    for host in hosts:
        if host.name in seen:
            raise HostsError(f"{where}: host {host.name!r} is listed twice; list it once")
        seen.add(host.name)
    return tuple(hosts)

"""A worker's processes - itself and whatever it started - found, waited for and killed.

Protocol (Linux; elsewhere only the process group is known):

* Every worker starts in a session and process group of its own (``Popen(
  start_new_session=True)``: pgid == sid == its pid) with ``$POLLUX_WORKER_TOKEN``
  (``env.WORKER_TOKEN``) set to a random value of its own, which every process it starts
  inherits unless that process replaces its environment.
* Where cgroup v2 is mounted and writable (root, or a delegated subtree), its agent
  creates ``<the agent's own cgroup>/pollux-launch.<agent pid>/w<n>-<worker pid>`` and
  moves the worker in right after ``Popen`` returns (:meth:`WorkerCgroup.adopt`); every
  process it forks from then on is in that cgroup, whatever its session or environment.
  Not from ``preexec_fn`` (spawn.py says why), hence a window: ``Popen`` returns once
  the exec helper (spawn.py) has exec'd, and the move follows within microseconds, while
  that helper is still checking its parent - before the worker's own command runs, let
  alone forks. Only a process forked before the move (the agent's thread descheduled
  for that long) stays outside; the other two ways below still find it. Killed with
  ``cgroup.kill`` (Linux 5.14), else frozen (``cgroup.freeze``) and each process
  SIGKILLed. Where no cgroup can be made, that is said once (debug log) and the others
  are used alone.
* A worker's processes (:meth:`ProcTree.members`) are therefore: those of its cgroup;
  those of its process group or session; those whose environment holds its token
  (``/proc/<pid>/environ``: the block exec wrote, readable for one's own processes, or
  all as root). Zombies are not counted: they hold nothing, and a PID 1 that does not
  reap would keep them forever. The first two find a daemon that cleared its
  environment; the last, without a cgroup, one that left the session (``setsid``).
* A pid is a process's only name here: the kernel never reuses one while it is some
  process's pgid or sid, so the worker's group is signalled by its pid until the group
  has been seen empty once after the worker itself exited (:attr:`ProcTree.group_gone`),
  never after. A pid found by environment or cgroup is signalled right after it was
  read: a pid reused in between is the one race left.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import env as envvars

log = logging.getLogger(__name__)

PROC = Path("/proc")
SUBTREE = "pollux-launch"  # <agent's cgroup>/pollux-launch.<agent pid>/w<n>-<worker pid>

_lock = threading.Lock()
_parent: tuple[int, Path | None] | None = None  # (for which pid, its folder or None)
_names = itertools.count()


@dataclass(frozen=True)
class Proc:
    """One live process as a snapshot saw it."""

    pid: int
    pgrp: int
    session: int
    tags: frozenset[bytes] = frozenset()  # which of the asked-for tags its environment holds


def snapshot(tags: Collection[bytes] = ()) -> list[Proc]:
    """The live processes of this machine (less this one and zombies), each with which of
    ``tags`` (``NAME=value``) its environment holds; [] where there is no ``/proc``."""
    try:
        names = os.listdir(PROC)
    except OSError:
        return []
    me = os.getpid()
    out = []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        stat = _stat(pid)
        if stat is None:
            continue
        found: frozenset[bytes] = frozenset()
        if tags:
            env = _environ(pid)
            found = frozenset(t for t in tags if b"\0" + t + b"\0" in env)
        out.append(Proc(pid, stat[0], stat[1], found))
    return out


def _stat(pid: int) -> tuple[int, int] | None:
    """(pgrp, session) of a live process, None for one gone or a zombie."""
    try:
        with open(PROC / str(pid) / "stat", "rb") as f:
            text = f.read()
    except OSError:
        return None  # gone since the listing
    fields = text.rpartition(b")")[2].split()  # (after the command, which may hold spaces)
    if len(fields) < 4 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[2]), int(fields[3])


def _environ(pid: int) -> bytes:
    try:
        with open(PROC / str(pid) / "environ", "rb") as f:
            return b"\0" + f.read()
    except OSError:
        return b""  # gone, or not ours to read: it cannot be found by its tag


def command_of(pid: int, width: int = 80) -> str:
    """A process's command line, shortened, for a log line."""
    try:
        with open(PROC / str(pid) / "cmdline", "rb") as f:
            text = f.read(4096).replace(b"\0", b" ").decode("utf-8", "replace").strip()
        if not text:
            text = "[" + (PROC / str(pid) / "comm").read_text().strip() + "]"
    except OSError:
        return "?"
    return text if len(text) <= width else text[: width - 3] + "..."


def describe(pids: Iterable[int], most: int = 3) -> str:
    """``pid 12 (sleep 600), pid 14 (python -c ...) and 3 more``."""
    pids = sorted(pids)
    text = ", ".join(f"pid {p} ({command_of(p)})" for p in pids[:most])
    return text + (f" and {len(pids) - most} more" if len(pids) > most else "")


# -- cgroup v2 ---------------------------------------------------------------------------
def _cgroup2_mount() -> Path | None:
    try:
        with open(PROC / "self" / "mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    return Path(left.split()[4])
    except OSError:
        pass  # no /proc: no cgroup either
    return None


def _own_cgroup() -> str | None:
    try:
        with open(PROC / "self" / "cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    path = line[3:].strip()
                    return None if ".." in path.split("/") else path
    except OSError:
        pass  # (as above)
    return None


def cgroup_parent() -> Path | None:
    """This process's folder for its workers' cgroups (made at the first call), None
    where cgroup v2 is not mounted or not writable."""
    global _parent
    with _lock:
        if _parent is None or _parent[0] != os.getpid():
            _parent = (os.getpid(), _make_parent())
        return _parent[1]


def _make_parent() -> Path | None:
    mount, own = _cgroup2_mount(), _own_cgroup()
    if mount is None or own is None:
        log.debug("no cgroup v2 here: a worker's processes are found by session and "
                  "environment only")
        return None
    base = mount / own.lstrip("/")
    folder = base / f"{SUBTREE}.{os.getpid()}"
    try:
        folder.mkdir(exist_ok=True)
    except OSError as exc:
        log.debug("cannot make cgroup %s (%s): a worker's processes are found by session "
                  "and environment only", folder, exc.strerror or exc)
        return None
    _sweep(base)
    atexit.register(_remove_tree, folder)
    return folder


def _sweep(base: Path) -> None:
    """Remove the empty cgroups agents that are gone left (one killed, e.g.)."""
    for stale in base.glob(f"{SUBTREE}.*"):
        owner = stale.name.rpartition(".")[2]
        if owner.isdigit() and int(owner) != os.getpid() and not _pid_alive(int(owner)):
            _remove_tree(stale)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_tree(folder: Path) -> bool:
    """rmdir ``folder`` and its sub-cgroups, deepest first; False if some still hold
    processes (they stay, and so does the folder)."""
    try:
        walk = list(os.walk(folder, topdown=False))
    except OSError:
        return not folder.exists()
    gone = True
    for path, _, _ in walk:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue
        except OSError:
            gone = False  # busy: processes still in it
    return gone


class WorkerCgroup:
    """One worker's cgroup (see the module's protocol)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def adopt(cls, pid: int) -> WorkerCgroup | None:
        """Move process ``pid`` (just started) into a cgroup of its own; None where that
        cannot be done (no cgroup v2 here, or the process has already exited)."""
        global _parent
        parent = cgroup_parent()
        if parent is None:
            return None
        path = parent / f"w{next(_names)}-{pid}"
        try:
            path.mkdir()
            with open(path / "cgroup.procs", "w") as f:
                f.write(f"{pid}\n")
        except OSError as exc:
            _remove_tree(path)
            if not isinstance(exc, ProcessLookupError):  # (ESRCH: that worker is gone)
                log.debug("cannot use cgroup %s (%s): a worker's processes are found by "
                          "session and environment only", path, exc.strerror or exc)
                with _lock:
                    _parent = (os.getpid(), None)
            return None
        return cls(path)

    def pids(self) -> set[int]:
        """The processes in it and in any cgroup the worker made under it."""
        out: set[int] = set()
        for path, _, _ in os.walk(self.path):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    out.update(int(p) for p in f.read().split())
            except (OSError, ValueError):
                continue  # removed meanwhile: nothing is left in it
        return out

    def kill(self) -> None:
        """SIGKILL every process in it."""
        try:
            with open(self.path / "cgroup.kill", "w") as f:
                f.write("1")
            return
        except OSError:
            pass  # before Linux 5.14: one by one, below
        frozen = _write(self.path / "cgroup.freeze", "1")  # (none forks meanwhile)
        try:
            for pid in self.pids():
                _kill(pid, signal.SIGKILL)
        finally:
            if frozen:
                _write(self.path / "cgroup.freeze", "0")  # (a frozen process dies too)

    def remove(self) -> bool:
        return _remove_tree(self.path)


def _write(path: Path, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # gone already, or not ours: nothing of the worker's is left there


# -- one worker's processes --------------------------------------------------------------
class ProcTree:
    """Worker ``pid``'s processes (see the module's protocol)."""

    def __init__(self, pid: int, token: str, cgroup: WorkerCgroup | None = None) -> None:
        self.pid, self.cgroup = pid, cgroup
        self.tag = f"{envvars.WORKER_TOKEN}={token}".encode() if token else b""
        # its process group emptied after it exited: its pid no longer names the group
        self.group_gone = False

    def group(self, procs: Iterable[Proc], leader_exited: bool) -> set[int]:
        """The processes of its process group or session, less itself."""
        if self.group_gone:
            return set()
        out = {p.pid for p in procs if self.pid in (p.pgrp, p.session)}
        out.discard(self.pid)
        if leader_exited and not out:
            self.group_gone = True
        return out

    def members(self, procs: Iterable[Proc], leader_exited: bool) -> set[int]:
        """Every live process of the worker's (``procs``: a snapshot asked for its
        tag), less the worker itself."""
        procs = list(procs)
        out = self.group(procs, leader_exited)
        if self.tag:
            out.update(p.pid for p in procs if self.tag in p.tags)
        if self.cgroup is not None:
            out.update(p for p in self.cgroup.pids() if _stat(p) is not None)
        out.discard(self.pid)
        out.discard(os.getpid())
        return out

    def signal_group(self, sig: int) -> None:
        if not self.group_gone:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is empty (or not ours): nothing in it to signal

    def kill(self, members: Iterable[int]) -> None:
        """SIGKILL all of it: the group, the cgroup, and each of ``members`` (what
        :meth:`members` found just now)."""
        self.signal_group(signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        for pid in members:
            _kill(pid, signal.SIGKILL)

    def close(self) -> bool:
        """Remove its cgroup; False while processes are still in it."""
        return self.cgroup.remove() if self.cgroup is not None else True

"""Horovod host lists from the coordinator's allocation (what the elastic driver polls).

Horovod's elastic driver runs a *host-discovery script* about once a second and reads
``host:slots`` lines from its stdout. A Pollux job's hosts are its current
``Allocation`` (``jobs/<job>/allocation``: one node name per replica), so:

* :func:`hosts_from_allocation` turns an allocation into ``[(host, slots), ...]`` (pure);
* :func:`format_hosts` renders them as the driver expects;
* :class:`HostsFileMirror` follows the allocation in the store (one ``Store.wait`` watch,
  no polling) and keeps a local *hosts file* up to date with atomic renames, so that
  the discovery script the driver runs every second is just ``cat`` of that file
  (:func:`write_discovery_script`; ~3 ms per poll here, versus ~0.2-0.8 s for the
  Python entry point on this busy 2-core machine). Its optional gate holds back a list
  that adds slots until the job's newcomers are pre-started (:mod:`.warm`): Horovod
  interrupts the survivors as soon as discovery reports new slots, and they wait for the
  newcomers from then on, so they had better be ready.

``python -m pollux_launch.adapters.horovod.launch.discover`` reads the store directly instead
(no launcher-side mirror needed; light imports only) - see that module.
"""

from __future__ import annotations

import logging
import os
import shlex
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pollux_launch import keys
from pollux_launch.messages import Allocation, MessageError, ValueLog, decode
from pollux_launch.rendezvous.store.base import Store

log = logging.getLogger(__name__)
# How long stop() waits for a refresh in progress (a watch is not waited out: it lasts
# up to wait_timeout, 5 s, which every Horovod job's end used to wait).
STOP_WAIT = 0.5


def hosts_from_allocation(
    alloc: Allocation | None, addresses: Mapping[str, str] | None = None
) -> list[tuple[str, int]]:
    """``[(host, slots)]`` in order of first appearance; ``addresses`` maps a node name
    to the host name Horovod should use (default: the node name itself). Nodes that map
    to the same host are merged (Horovod needs each host once)."""
    if alloc is None:
        return []
    slots: dict[str, int] = {}
    for node in alloc.nodes:
        host = addresses.get(node, node) if addresses else node
        slots[host] = slots.get(host, 0) + 1
    return list(slots.items())


def format_hosts(hosts: Sequence[tuple[str, int]]) -> str:
    """The discovery script's output: one ``host:slots`` line per host."""
    for host, n in hosts:
        if not host or any(c.isspace() or c == ":" for c in host) or n < 1:
            raise ValueError(f"bad host entry {host!r}:{n}; need a host name and slots >= 1")
    return "".join(f"{host}:{n}\n" for host, n in hosts)


def read_allocation(store: Store, job: str, values: ValueLog | None = None) -> Allocation | None:
    """The job's current allocation, None if there is none; ``MessageError`` if it is
    malformed (callers keep the hosts they had: a bad value must not shrink the job),
    logged first through ``values`` (once per revision) when given."""
    kv = store.get(keys.job(job, "allocation"))
    if kv is None:
        return None
    try:
        return decode(Allocation, kv.value)
    except MessageError as exc:
        if values is not None:
            values.bad(kv.key, kv.mod_revision, str(exc))
        raise


def write_hosts_file(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` atomically (a reader sees the old or the new list, never half)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_discovery_script(
    path: str | os.PathLike[str], hosts_file: str | os.PathLike[str]
) -> Path:
    """An executable ``/bin/sh`` script printing ``hosts_file`` (for
    ``horovodrun --host-discovery-script``); returns its path."""
    path = Path(path)
    path.write_text(f"#!/bin/sh\nexec cat {shlex.quote(str(Path(hosts_file).resolve()))}\n")
    path.chmod(0o755)
    return path


class HostsFileMirror:
    """Keeps ``hosts_file`` equal to the job's allocation as ``host:slots`` lines.

    ``start()`` writes the file once (synchronously, so the driver's first poll sees it)
    and then follows the store from a daemon thread; ``stop()`` ends the thread. The file
    is rewritten only when the host list changes. ``addresses`` is as in
    :func:`hosts_from_allocation`, or a function returning it (called at every refresh,
    for node sets that change). Pass the store in; it is not closed here.

    ``newcomers_ready`` (optional) gates growth: when the allocation adds slots to the
    list last written, the file is rewritten only once it returns True (it is asked
    again every ``hold_poll`` seconds meanwhile, and may start the newcomers' preparation
    when asked); until then the file keeps the last list, so Horovod's workers go on at
    their size. Lists that only remove slots are written at once, as is the first one.
    """

    def __init__(
        self,
        store: Store,
        job: str,
        hosts_file: str | os.PathLike[str],
        addresses: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
        wait_timeout: float = 5.0,
        newcomers_ready: Callable[[], bool] | None = None,
        hold_poll: float = 0.1,
    ) -> None:
        self.store, self.job = store, job
        self.hosts_file = Path(hosts_file)
        self.addresses = addresses if callable(addresses) else dict(addresses or {})
        self.wait_timeout = wait_timeout
        self.newcomers_ready, self.hold_poll = newcomers_ready, hold_poll
        self.version: int | None = None  # allocation version last written
        self.error: BaseException | None = None
        self.holding = False  # a grown list waits for newcomers_ready()
        self._text: str | None = None
        self._hosts: dict[str, int] | None = None  # the list last written
        self._stop = threading.Event()
        self._refreshing = threading.Lock()  # held by the thread while it refreshes
        self._thread: threading.Thread | None = None
        self.values = ValueLog(log)  # a malformed allocation is said once per revision

    def refresh(self) -> bool:
        """Re-read the allocation and rewrite the file if it changed; True if rewritten."""
        try:
            alloc = read_allocation(self.store, self.job, self.values)
        except MessageError:  # logged by self.values; the hosts file stays as it was
            return False
        addresses = self.addresses() if callable(self.addresses) else self.addresses
        hosts = hosts_from_allocation(alloc, addresses)
        text = format_hosts(hosts)
        if text == self._text:
            self.holding = False
            self.version = alloc.version if alloc is not None else None
            return False
        grows = self._hosts is not None and any(
            n > self._hosts.get(host, 0) for host, n in hosts)
        self.holding = grows and self.newcomers_ready is not None and \
            not self.newcomers_ready()
        if self.holding:
            return False
        write_hosts_file(self.hosts_file, text)
        self._text, self._hosts = text, dict(hosts)
        self.version = alloc.version if alloc is not None else None
        return True

    def start(self) -> HostsFileMirror:
        self.refresh()
        self._thread = threading.Thread(
            target=self._run, name=f"pollux-hosts-{self.job}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        key = keys.job(self.job, "allocation")
        rev = self.store.revision()
        while not self._stop.is_set():
            try:
                events = self.store.wait(
                    key, rev, self.hold_poll if self.holding else self.wait_timeout)
                if events:
                    rev = events[-1].revision
                with self._refreshing:
                    if self._stop.is_set():  # (stopped during the watch: the folder may go)
                        return
                    self.refresh()  # also after a timeout: cheap, heals any missed event
            except Exception as exc:  # store briefly unreachable or compacted: re-read later
                self.error = exc
                if self._stop.wait(0.5):
                    return
                try:
                    rev = self.store.revision()
                except Exception:
                    continue

    def stop(self, wait: float = STOP_WAIT) -> None:
        """End the follower: at once, or once a refresh in progress is done (up to
        ``wait`` seconds). A watch in progress (up to ``wait_timeout``) is not waited
        out: the thread (a daemon) returns when it wakes, and writes nothing after this."""
        self._stop.set()
        if self._thread is not None:
            if self._refreshing.acquire(timeout=wait):
                self._refreshing.release()
            self._thread = None

    def __enter__(self) -> HostsFileMirror:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Horovod's elastic driver as ``pollux-run`` runs it: every replica is a Horovod host of
its own, so a dead worker costs one replica, not the job (nor its node).

Horovod blacklists a HOST when a worker on it fails (``WorkerStateRegistry.
_on_workers_recorded``) and ends the job when every recorded host is blacklisted. On one
machine every worker ran on one host (``127.0.0.1:N``), so ONE failure ended the job
(``blacklisted slots count == N -> stop running``), with or without
``--blacklist-cooldown-range`` (the driver stops at that barrier, before any cool-down
could end); across nodes, one failure took its whole node out. :func:`install` (called
before Horovod runs by the ``horovodrun`` entry point that pollux-run writes,
:func:`~.command.write_horovodrun_script`, and by :mod:`.elastic_launch`) changes that,
and what the user's terminal shows, through Horovod 0.28.1's module seams:

* :class:`ReplicaNames` (discovery): a host with N slots is reported as N hosts of one
  slot, named by names not used before in this run: loopback addresses for this
  machine (127.0.0.1, 127.0.0.2, ...: only names to Horovod, never bound: the workers'
  transports bind ``--network-interface``), ``NODE@N`` for a node agent's node in
  cluster mode (:mod:`.elastic_launch`; :class:`~.tasks.StoreExec` maps the name back
  to its node, whose agent gives each worker its own GPU first in its
  ``CUDA_VISIBLE_DEVICES``, so ``hvd.local_rank()`` - 0 for every worker - indexes it).
  A shrink drops the newest names (the oldest
  keep the lowest ranks: rank 0 survives), a grow adds fresh ones, and a name Horovod
  blacklisted is never reported again: its slot comes back under a fresh name, an added
  host to Horovod. So the survivors go on at once (Horovod's reset, without the failed
  host) and the replacement joins through Horovod's ordinary grow (the job's warm zygote
  where it has one, :mod:`.warm`); a job whose ``--min-np`` needs the slot waits in that
  reset for the replacement instead (discovery runs every second). That is for a worker
  :func:`lost` (killed by a signal, or its node gone); one that exits with an error code
  - the script's own failure, which a new worker would repeat - fails the job, as before.
* :func:`exec_command_fn`: Horovod's local execution of a worker, for these names
  (Horovod's own would ssh to them: they are not this machine's interface addresses);
  the output of a worker that a reset REMOVED - from that reset on, Horovod aborts it:
  ``terminate called ...``, ``Aborted``, exit 134 - and of workers ended by a cancel goes
  to the job's log only (lines marked :data:`LOG_ONLY`, routed by the launcher's
  :class:`~.driver.TerminalFilter`).
* :class:`PolluxElasticDriver`: says each change of size as it takes effect, in one line
  (``[pollux] JOB: replicas 2 -> 1 (live)``), and each failed replica.
* :func:`main`: a horovodrun stopped by SIGTERM/SIGINT (a cancel) exits 128+SIG without
  Horovod's "non-zero status" traceback for the workers it ended itself; any other
  failure is one line.

Horovod itself identifies a worker by (host, local rank) for its whole life and
blacklists hosts, so per-slot names are the one way to lose a single worker of a host
and keep the rest: ``hvd.local_size()`` is 1 under pollux-run (as with one slot per
host), and Horovod's hierarchical collectives see no two workers on one host.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

from pollux_launch import env as envvars

# A line of horovodrun's output that starts with this goes to the job's log only.
LOG_ONLY = "\x1epollux-log-only\x1e"
LOOPBACK_NAMES = ("localhost",)
FIRST_NAME = int(ipaddress.IPv4Address("127.0.0.1"))
LAST_NAME = int(ipaddress.IPv4Address("127.255.255.254"))
# Seconds before a lost replica's slot gets a new worker, from the second loss on:
# doubling from the first to the second (the native path's back-off for lost newcomers).
BACKOFF = (2.0, 60.0)


def is_loopback(host: str) -> bool:
    """Whether discovery's ``host`` is this machine's loopback (split into replicas)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: another machine's (or this one's network name)
        return False


class LocalRun:
    """What the patched pieces of one horovodrun process share."""

    def __init__(self, job: str, out: IO[str] | None = None, nodes: bool = False) -> None:
        self.job = job
        self.out = out or sys.stdout
        self.names = ReplicaNames(self, nodes)
        self.removed: set[tuple[str, int]] = set()  # (host, local rank) a reset removed
        self.exit_codes: dict[str, int] = {}  # replica name -> its worker's last exit code
        self.stopping: int | None = None  # the signal that stops horovodrun, once it came
        self._lock = threading.Lock()

    def say(self, line: str, log_only: bool = False) -> None:
        """One ``[pollux]`` line on horovodrun's stdout (the user's terminal and the job's
        log; the log only with ``log_only``)."""
        with self._lock:
            self.out.write(f"{LOG_ONLY if log_only else ''}[pollux] {self.job}: {line}\n")
            self.out.flush()

    def quiet(self, host: str, slot: int) -> bool:
        """Whether this worker's output is for the log only from now on."""
        return self.stopping is not None or (host, slot) in self.removed


class ReplicaNames:
    """Discovery that names each slot as a host of its own (module docstring).

    Wraps Horovod's discovery (``inner``, set by :class:`ReplicaHostManager`):
    ``find_available_hosts_and_slots()`` maps ``{"127.0.0.1": 3}`` to three names of one
    slot each, stable while the host keeps its slots; :meth:`retire` takes a name out for
    good (Horovod blacklisted it); :meth:`issued` says whether a name is one of these.
    Loopback hosts get loopback addresses as names; other hosts (node agents' nodes,
    ``nodes=True``) get ``NODE@N``, and :meth:`node_of` maps a name back to its host.
    Without ``nodes``, other hosts pass through unchanged (horovodrun's own hosts).
    """

    def __init__(self, run: LocalRun | None = None, nodes: bool = False) -> None:
        self.run, self.nodes = run, nodes
        self.inner: Any = None
        self.live: dict[str, list[str]] = {}  # discovered host -> its replicas, oldest first
        self.retired: set[str] = set()
        self._issued: dict[str, tuple[int, str]] = {}  # name -> (made, its host)
        self._next = FIRST_NAME  # the next loopback name
        self._made = 0
        self._losses = 0
        self._hold_until = 0.0  # (monotonic) no fresh name before, after a loss

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return self.split(self.inner.find_available_hosts_and_slots())

    def split(self, hosts: dict[str, int]) -> dict[str, int]:
        """``hosts`` (discovery's) with each slot of a host of ours named on its own."""
        out: dict[str, int] = {}
        for host, slots in hosts.items():
            if not (self.nodes or is_loopback(host)):
                out[host] = slots
                continue
            names = [n for n in self.live.get(host, []) if n not in self.retired][:slots]
            while len(names) < slots and time.monotonic() >= self._hold_until:
                names.append(self._fresh(host))
            self.live[host] = names
            out.update(dict.fromkeys(names, 1))
        for gone in set(self.live) - set(hosts):
            del self.live[gone]
        return out

    def retire(self, name: str) -> float:
        """Take ``name`` out for good; returns the back-off before its slot is named
        again (0 for the first loss, then :data:`BACKOFF`)."""
        if name not in self._issued:
            return 0.0
        self.retired.add(name)
        self._losses += 1
        delay = min(BACKOFF[1], BACKOFF[0] * 2 ** (self._losses - 2)) \
            if self._losses > 1 else 0.0
        self._hold_until = time.monotonic() + delay
        return delay

    def issued(self, name: str) -> bool:
        return name in self._issued

    def node_of(self, name: str) -> str:
        """The discovered host that ``name`` is a slot of (``name`` itself if not ours)."""
        return self._issued[name][1] if name in self._issued else name

    def order(self, available: set[str], previous: list[str]) -> list[str]:
        """Horovod's host order (lowest ranks first): the previous order, then new hosts
        - these names in the order they were made (Horovod's own takes a set's order:
        a shrink must drop the newest name, the highest rank)."""
        order = [h for h in previous if h in available]
        return order + sorted(set(available) - set(order),
                              key=lambda h: (not self.issued(h), self._number(h), h))

    def _number(self, name: str) -> int:
        return self._issued[name][0] if name in self._issued else 0

    def _fresh(self, host: str) -> str:
        self._made += 1
        if not is_loopback(host):
            name = f"{host}@{self._made}"
        elif self._next > LAST_NAME:  # (16 million replicas started in one run)
            raise RuntimeError("no loopback names left for new replicas")
        else:
            name = str(ipaddress.IPv4Address(self._next))
            self._next += 1
        self._issued[name] = (self._made, host)
        return name


def lost(exit_code: int) -> bool:
    """Whether a worker that exited ``exit_code`` (as a shell reports it) was lost - killed
    by a signal: its slot gets a new worker - rather than failed: the script's own error,
    which fails the job (as the native path classifies them: launcher/workers.py)."""
    return exit_code > 128


def replica_host_manager(run: LocalRun, base: type) -> type:
    """Horovod's ``HostManager`` (``base``) over :class:`ReplicaNames`. A blacklisted
    replica name whose worker was :func:`lost` is retired (its slot comes back under a
    fresh name, after :data:`BACKOFF` for repeated losses) and said once; a worker that
    failed by itself blacklists every replica, so Horovod's driver ends the job, as it
    did when they all were one host."""

    class ReplicaHostManager(base):  # type: ignore[misc, valid-type]
        def __init__(self, discovery: Any, cooldown_range: Any = None) -> None:
            run.names.inner = discovery
            super().__init__(run.names, cooldown_range)

        def blacklist(self, host: str) -> None:
            if run.names.issued(host) and host not in run.names.retired \
                    and run.stopping is None:  # (a cancel ended them all: nothing to say)
                code = run.exit_codes.get(host)
                if code is not None and not lost(code):  # the script's own failure
                    run.say(f"replica {host} failed (exit code {code}); the job fails")
                    for names in run.names.live.values():  # so Horovod's driver stops
                        for name in names:
                            super().blacklist(name)
                    return
                delay = run.names.retire(host)
                run.say(f"replica {host} lost (exit code {code}); the job goes on without it "
                        f"and starts a new worker in its slot"
                        + (f" in {delay:.0f} s" if delay else ""))
            super().blacklist(host)

    return ReplicaHostManager


def pollux_elastic_driver(run: LocalRun, base: type) -> type:
    """Horovod's ``ElasticDriver`` (``base``) that notes the slots each reset removes and
    says each change of the job's size when the new assignment is made."""

    class PolluxElasticDriver(base):  # type: ignore[misc, valid-type]
        def _update_host_assignments(self, current_hosts: Any) -> Any:
            before = _slots(self._host_assignments.items())
            size = self._world_size
            pending = super()._update_host_assignments(current_hosts)
            run.removed |= before - _slots(self._host_assignments.items())
            if size and self._world_size != size:
                run.say(f"replicas {size} -> {self._world_size} (live)")
            return pending

    return PolluxElasticDriver


def _slots(assignments: Iterable[tuple[str, list[Any]]]) -> set[tuple[str, int]]:
    return {(host, s.local_rank) for host, slots in assignments for s in slots}


class _Lines:
    """A worker's stream as Horovod forwards it (whole prefixed lines), marked for the
    log only once ``quiet()`` says so."""

    def __init__(self, stream: IO[str], quiet: Callable[[], bool]) -> None:
        self.stream, self.quiet = stream, quiet

    def write(self, text: str) -> int:
        self.stream.write(LOG_ONLY + text if self.quiet() and text else text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def exec_command_fn(run: LocalRun, original: Callable[[Any], Callable[..., Any]],
                    safe_shell_exec: Any) -> Callable[[Any], Callable[..., Any]]:
    """Horovod's ``_exec_command_fn`` for replica names: run the worker here (as Horovod
    does for a local host) with its output routed by :meth:`LocalRun.quiet`; other hosts
    go to Horovod's ``original``."""

    def make(settings: Any) -> Callable[..., Any]:
        elsewhere = original(settings)

        def execute(command: str, slot_info: Any, events: list[Any] | None) -> tuple[int, float]:
            host, slot, index = slot_info.hostname, slot_info.local_rank, slot_info.rank
            if not run.names.issued(host):
                return elsewhere(command, slot_info, events)
            quiet = lambda: run.quiet(host, slot)  # noqa: E731
            stdout, stderr = _Lines(sys.stdout, quiet), _Lines(sys.stderr, quiet)
            files: list[IO[str]] = []
            if settings.output_filename:  # as Horovod's: a copy per rank
                folder = os.path.join(settings.output_filename, f"rank.{index}")
                os.makedirs(folder, exist_ok=True)
                files = [open(os.path.join(folder, n), "w") for n in ("stdout", "stderr")]
                stdout, stderr = _Tee(stdout, files[0]), _Tee(stderr, files[1])
            try:
                code = safe_shell_exec.execute(
                    command, index=index, stdout=stdout, stderr=stderr, events=events or [],
                    prefix_output_with_timestamp=settings.prefix_output_with_timestamp)
            finally:
                for f in files:
                    f.close()
            run.exit_codes[host] = code
            if code != 0:
                line = f"Process {index} exit with status code {code}.\n"
                sys.stdout.write(LOG_ONLY + line if quiet() else line)
                sys.stdout.flush()
            return code, time.time()

        return execute

    return make


class _Tee:
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


class _StoppingFilter(logging.Filter):
    """Horovod's driver's log lines once horovodrun is stopping (its registry's
    ``failure count == N -> stop running`` for the workers it ended): to the job's log."""

    def __init__(self, run: LocalRun) -> None:
        super().__init__()
        self.run = run

    def filter(self, record: logging.LogRecord) -> bool:
        if self.run.stopping is None:
            return True
        self.run.say(f"horovod: {record.getMessage()}", log_only=True)
        return False


class QuietInfo(logging.Formatter):
    """Horovod's driver's progress (below WARNING: ``record state``, ``reset workers``,
    ``success count == N -> stop running``) for the job's log only, as horovodrun, whose
    default level hides it, would keep it out of the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno >= logging.WARNING else LOG_ONLY + text


def install(run: LocalRun) -> None:
    """Patch Horovod (this process's) as the module docstring says."""
    from horovod.runner import gloo_run
    from horovod.runner.common.util import safe_shell_exec
    from horovod.runner.elastic import discovery
    from horovod.runner.elastic import driver as elastic_driver
    from horovod.runner.http import http_server

    elastic_driver.HostManager = replica_host_manager(run, elastic_driver.HostManager)
    # (a static method that Horovod calls through its own class name)
    discovery.HostManager.order_available_hosts = staticmethod(run.names.order)
    gloo_run.ElasticDriver = pollux_elastic_driver(run, gloo_run.ElasticDriver)
    gloo_run._exec_command_fn = exec_command_fn(run, gloo_run._exec_command_fn,
                                                safe_shell_exec)
    shutdown_event = gloo_run.register_shutdown_event

    def register_shutdown_event() -> threading.Event:
        event = shutdown_event()

        def on_signal(signum: int, _frame: object) -> None:
            run.stopping = signum
            event.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        return event

    gloo_run.register_shutdown_event = register_shutdown_event
    logging.getLogger().addFilter(_StoppingFilter(run))
    server = http_server.RendezvousHTTPServer

    def handle_error(self: Any, request: Any, client_address: Any) -> None:
        # A worker that died (killed, or removed by a reset) while asking Horovod's
        # rendezvous: its connection is gone, nothing to answer; Horovod's registry
        # learns of the worker from its exit. Said in the log, not as a traceback.
        if isinstance(sys.exc_info()[1], ConnectionError):
            run.say(f"a worker's rendezvous request ended with it ({sys.exc_info()[1]})",
                    log_only=True)
        else:
            server_handle_error(self, request, client_address)

    server_handle_error = server.handle_error
    server.handle_error = handle_error


def main() -> int:
    """horovodrun (``run_commandline``) with :func:`install`'s changes; its exit code."""
    run = LocalRun(os.environ.get(envvars.JOB, "horovod"))
    install(run)
    from horovod.runner.launch import run_commandline

    try:
        run_commandline()
    except RuntimeError as exc:  # how Horovod's elastic launcher reports a failed job
        if run.stopping is not None:  # the workers it ended on our signal: no failure
            run.say(f"horovodrun stopped ({exc})".replace("\n", " "), log_only=True)
            return 128 + run.stopping
        run.say(f"horovodrun: {' '.join(str(exc).split())}")
        return 1
    return 0

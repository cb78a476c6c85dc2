"""horovodrun's ``--host-discovery-script`` in local mode: this machine's slots, polled.

The script is the user's executable; each run prints the hosts the job may use now, one
``host[:slots]`` per line (a host without ``:slots`` has ``--slots-per-host``), as for
horovodrun. pollux-run has no ssh: in local mode the hosts must be this machine's names
(``hosts.LOCAL_NAMES``) and their slots, summed, become the slots of this machine's node
record; the coordinator then grows or shrinks the job to them as to any change of a
node's size. (In a cluster the hosts are the node agents in the store: a host joins by
starting one, so the flag is refused there.)

Protocol, as horovodrun's discovery thread: the script runs once before the job is
submitted (a failure then is the user's one-line error), then every ``interval`` seconds
(horovodrun: 1 s). Its output is untrusted input: at most ``MAX_OUTPUT`` bytes, each line
validated as a host list entry. A run that fails (non-zero exit, ``TIMEOUT``, bad output)
is logged once per distinct problem and changes nothing - the slots stay as last seen -
so a flaky script never shrinks a job; hosts that are not this machine are logged once
and left out.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from pollux_launch.errors import PolluxError

from ..rendezvous.store import StoreError
from .hosts import LOCAL_NAMES, HostsError, parse_hosts

log = logging.getLogger(__name__)

INTERVAL = 1.0  # seconds between runs (horovodrun's discovery frequency)
TIMEOUT = 10.0  # seconds one run may take
MAX_OUTPUT = 64 * 1024  # bytes of output read from one run


class DiscoveryError(PolluxError):
    """One run of the script failed; the message says how, in one line."""


class HostDiscovery:
    """Runs the discovery script and reports this machine's slots when they change."""

    def __init__(self, script: str | Path, slots_per_host: int = 1, cwd: str | Path = ".",
                 interval: float = INTERVAL) -> None:
        self.script, self.slots_per_host = str(script), slots_per_host
        self.cwd, self.interval = cwd, interval
        self._said: set[str] = set()  # problems already logged

    def discover(self) -> tuple[int, list[str]]:
        """One run: (this machine's slots, the other hosts listed). Raises
        DiscoveryError."""
        try:
            proc = subprocess.run([self.script], cwd=self.cwd, capture_output=True,
                                  timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"--host-discovery-script {self.script}: no answer within "
                                 f"{TIMEOUT:.0f} s") from None
        except OSError as exc:
            raise DiscoveryError(f"--host-discovery-script {self.script}: cannot run it "
                                 f"({exc.strerror or exc})") from None
        if proc.returncode != 0:
            said = proc.stderr[-MAX_OUTPUT:].decode("utf-8", "replace").strip()
            last = said.splitlines()[-1][:200] if said else ""
            raise DiscoveryError(f"--host-discovery-script {self.script}: exited "
                                 f"{proc.returncode}" + (f": {last}" if last else ""))
        return self.parse(proc.stdout)

    def parse(self, output: bytes) -> tuple[int, list[str]]:
        if len(output) > MAX_OUTPUT:
            raise DiscoveryError(f"--host-discovery-script {self.script}: more than "
                                 f"{MAX_OUTPUT} bytes of output; print 'host:slots' lines")
        try:
            lines = [ln.strip() for ln in output.decode("utf-8").splitlines() if ln.strip()]
        except UnicodeDecodeError:
            raise DiscoveryError(f"--host-discovery-script {self.script}: output is not "
                                 "UTF-8; print 'host:slots' lines") from None
        if not lines:
            return 0, []  # no hosts now: the job waits for some, as under horovodrun
        try:
            hosts = parse_hosts(",".join(lines), self.slots_per_host)
        except HostsError as exc:
            raise DiscoveryError(f"--host-discovery-script {self.script}: "
                                 f"{str(exc).removeprefix('-H ')}") from None
        here = sum(h.slots for h in hosts if h.name in LOCAL_NAMES)
        return here, [h.name for h in hosts if h.name not in LOCAL_NAMES]

    def run(self, stop: threading.Event, slots: int, on_change: Callable[[int], None]) -> None:
        """Poll until ``stop``; ``on_change(n)`` when this machine's slots become n
        (``slots``: the last count seen)."""
        while not stop.wait(self.interval):
            try:
                found, others = self.discover()
            except DiscoveryError as exc:
                self._once(f"{exc}; keeping {slots} slot(s)")
                continue
            if others:
                self._once(f"--host-discovery-script {self.script}: host(s) "
                           f"{', '.join(sorted(others)[:3])} are not this machine: left out "
                           "(start `pollux-run agent` there and use --store etcd://...)")
            if found != slots:
                try:
                    on_change(found)
                except StoreError as exc:  # not recorded: the next run tries again
                    self._once(f"host discovery: cannot record {found} slot(s) ({exc})")
                    continue
                log.info("host discovery: this machine has %d slot(s) now (was %d)",
                         found, slots)
                slots = found

    def _once(self, problem: str) -> None:
        if problem not in self._said:
            self._said.add(problem)
            log.warning("%s", problem)

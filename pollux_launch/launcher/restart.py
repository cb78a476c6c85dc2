"""Restart-elastic (and fixed) jobs: torchrun's contract, driven by allocations.

A script that does not use the pollux API cannot re-form its group in place, so its
workers are a *generation*: the allocation they were started for (term, version) and
the job's restarts after failures (``JobGeneration.restarts``). Protocol, per node:

1. When the generation changes (a new allocation, or a restart after a failure), every
   worker of the old one gets SIGTERM; those still alive after the job's ``stop_grace``
   get SIGKILL (torchrun: SIGTERM, 30 s, SIGKILL).
2. Only once all of them exited (their slots are free) are the new generation's workers
   started, with torchrun's variables for it (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
   ``GROUP_RANK``, ``MASTER_PORT`` new per generation, ``TORCHELASTIC_RESTART_COUNT``...).
   The script resumes from its own checkpoint. Slots are never oversubscribed: a node
   starts no more workers than are free once the old ones are gone.
3. A worker of the current generation that fails (an error exit, or killed by a signal
   nobody sent) restarts the whole group while restarts remain (``--max-restarts``, as
   torchrun): the node agent that saw it raises ``JobGeneration.restarts`` by
   compare-and-swap from the generation the worker ran in, so a failure that every
   node sees counts once. With none left, the job fails with the worker's exit code.
   An exit of an old generation's worker is never a failure: it was being replaced.
4. The node of rank 0 measures the cost of a restart: how long its old workers took to
   exit, and from starting the new rank 0 until the group's rendezvous port accepted a
   connection. Both go to ``JobGeneration``; the coordinator charges their sum as the
   job's re-allocation penalty.
5. The same node measures the work a stopped group throws away: from its newest file
   under the job's ``--checkpoint-dir`` (from the group's start when there is none, or
   no such folder) until the group was stopped; ``JobGeneration.stops`` and ``lost_s``
   add it up and ``pollux-run status`` shows it (RESTARTS (LOST)).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

from .. import env as envvars
from .. import keys
from ..messages import Allocation, JobGeneration, JobSpec, encode
from ..rendezvous.store import Compare, Put, StoreError
from .drivers import DriverContext, ProcessExit, ReplicaDriver
from .workers import Worker

log = logging.getLogger(__name__)

Generation = tuple[int, int, int]  # (allocation term, allocation version, restarts)
STOP_WAIT = 1.0  # seconds a pass waits for SIGTERMed workers before going on
PROBE_TIMEOUT = 600.0  # give up measuring a start-up that never opens its port
SCAN_LIMIT = 10_000  # entries of a checkpoint folder looked at for its newest file


class RestartDriver(ReplicaDriver):
    """One worker per allocated replica; every change of generation restarts them all."""

    side = "node"

    def __init__(self, spec: JobSpec, ctx: DriverContext) -> None:
        super().__init__(spec, ctx)
        self._born: dict[str, Generation | None] = {}  # worker id -> its generation
        self._kill_at: dict[str, float] = {}  # worker id -> when SIGKILL follows SIGTERM
        self._stop_began: float | None = None
        self._stop_s: float | None = None  # this node's last measured stop of a generation
        self._probe_stop = threading.Event()
        self._early: list[tuple[Worker, int]] = []  # reaped while stopping, not reported
        self._generation: Generation | None = None  # the one reconcile starts workers of
        # the generation whose rank 0 started here, and when (wall clock: compared with
        # checkpoint files' times); when it was seen to end (its lost work is measured
        # once its workers are gone: one that saves on SIGTERM lost nothing)
        self._rank0: tuple[Generation | None, float] | None = None
        self._ended_at: float | None = None

    # -- the generation -----------------------------------------------------------------
    def _key(self) -> str:
        return keys.job(self.spec.name, "generation")

    def generation_record(self) -> tuple[JobGeneration, int]:
        """The job's ``JobGeneration`` and its mod revision (0: none yet; a malformed one
        is logged once and read as none: the next compare-and-swap replaces it)."""
        kv = self.ctx.store.get(self._key())
        if kv is None:
            return JobGeneration(), 0
        value = self.values.read(JobGeneration, kv.key, kv.value, kv.mod_revision)
        return (value or JobGeneration()), kv.mod_revision

    def _current(self, alloc: Allocation | None, restarts: int) -> Generation | None:
        return (alloc.term, alloc.version, restarts) if alloc is not None else None

    def _update(self, change: Callable[[JobGeneration], JobGeneration | None]) -> bool:
        """Compare-and-swap ``change`` of the record (None: leave it); retried on races."""
        for _ in range(8):
            old, rev = self.generation_record()
            new = change(old)
            if new is None:
                return False
            if self.ctx.store.txn([keys.job_exists(self.spec.name),
                                   Compare(self._key(), "mod_revision", "==", rev)],
                                  [Put(self._key(), encode(new))]):
                return True
        return False

    # -- JobDriver ----------------------------------------------------------------------
    def reconcile(self, alloc: Allocation | None, free_slots: int) -> int:
        record, _ = self.generation_record()
        current = self._current(alloc, record.restarts)
        if self._rank0 is not None and self._rank0[0] != current and self._ended_at is None:
            self._ended_at = time.time()
        old = [wid for wid in self.group.workers if self._born.get(wid) != current]
        if old:
            before = len(self.group.workers)
            self._stop(old)
            if any(wid in self.group.workers for wid in old):
                return 0  # they start once the old generation has left its slots
            free_slots += before - len(self.group.workers)  # (reaped just now: free)
        if self._stop_began is not None:  # the old generation has gone: how long it took
            self._stop_s = time.monotonic() - self._stop_began
            self._stop_began = None
        if self._rank0 is not None and self._ended_at is not None:
            self._record_loss(self._rank0[1], self._ended_at)
            self._rank0 = self._ended_at = None
        self._generation = current
        return self._start_missing(alloc, free_slots, record.restarts)

    def started(self, worker: Worker, alloc: Allocation | None) -> None:
        self._born[worker.worker_id] = self._generation
        if worker.label == "0" and alloc is not None and self._generation is not None:
            self._rank0, self._ended_at = (self._generation, time.time()), None
            self._measure_startup(alloc, self._generation[2])

    # -- the work a stopped group loses --------------------------------------------------
    def _record_loss(self, began: float, ended: float) -> None:
        """Count one stopped group and the training it lost: from its newest checkpoint
        file (or its start, ``began``) until ``ended`` - 0 when it saved one while being
        stopped."""
        folder = self.spec.env.get(envvars.CHECKPOINT_DIR)
        saved = newest_mtime(folder) if folder else None
        lost = max(0.0, ended - max(began, saved or 0.0))

        def add(old: JobGeneration) -> JobGeneration:
            return dataclasses.replace(old, stops=old.stops + 1,
                                       lost_s=round(old.lost_s + lost, 3), timestamp=time.time())

        try:
            self._update(add)
        except StoreError as exc:  # only a measurement: status shows less than was lost
            log.info("job %s: lost work not recorded (%s)", self.spec.name, exc)
        if folder:  # measured: said where the user sees it
            since = "its last checkpoint" if saved is not None and saved > began else \
                "it started (no checkpoint file since)"
            log.warning("job %s: its group was stopped %.1f s after %s: that training is "
                        "lost", self.spec.name, lost, since)
        else:
            log.info("job %s: its group was stopped %.1f s after it started (how much of that "
                     "it had saved is not seen without --checkpoint-dir)", self.spec.name, lost)

    def _stop(self, old: list[str]) -> None:
        """SIGTERM the old generation (once), SIGKILL it after the grace; wait up to
        STOP_WAIT for it here, so that a script that exits at once restarts at once."""
        now = time.monotonic()
        fresh = [wid for wid in old if wid not in self._kill_at]
        if fresh:
            self._probe_stop.set()  # (a start-up still being measured is moot now)
            if self._stop_began is None:
                self._stop_began = now
            log.info("job %s: stopping %d worker(s) of the previous generation",
                     self.spec.name, len(fresh))
            self.group.signal(signal.SIGTERM, fresh)
            for wid in fresh:
                self._kill_at[wid] = now + self.spec.stop_grace
        overdue = [wid for wid in old if self._kill_at.get(wid, now) <= now]
        if overdue:
            self.group.signal(signal.SIGKILL, overdue)
        deadline = now + min(STOP_WAIT, self.spec.stop_grace)
        while time.monotonic() < deadline and any(
                self.group.workers[w].poll() is None for w in old if w in self.group.workers):
            time.sleep(0.02)
        # reap what ended now, so that its slots are free for this pass (reported by reap)
        self._early.extend(self.group.reap())

    def reap(self, allocation: Callable[[], Allocation | None]) -> list[ProcessExit]:
        ended, self._early = [*self._early, *self.group.reap()], []
        if not ended:
            return []
        alloc = allocation()
        record, _ = self.generation_record()
        current = self._current(alloc, record.restarts)
        out = []
        for worker, code in self.first_failures_first(ended):
            born = self._born.pop(worker.worker_id, None)
            self._kill_at.pop(worker.worker_id, None)
            if born != current:  # replaced by a newer generation: never a failure
                out.append(ProcessExit(worker.worker_id, code, "departed"))
            elif code == 0:
                out.append(ProcessExit(worker.worker_id, code,
                                       "finished" if self._want(alloc) else "departed",
                                       generation=born))
            elif born is not None and self._restart(born[2], worker.worker_id, code):
                out.append(ProcessExit(worker.worker_id, code, "departed"))
            else:
                out.append(self.failed(worker, code))
        return out

    def _restart(self, restarts: int, worker_id: str, code: int) -> bool:
        """Restart the group after a failure in generation ``restarts``: True if it is
        (or another node already did), False when no restart is left."""
        def bump(old: JobGeneration) -> JobGeneration | None:
            if old.restarts != restarts or old.restarts >= self.spec.max_restarts:
                return None
            return dataclasses.replace(old, restarts=old.restarts + 1, timestamp=time.time())

        try:
            if self._update(bump):
                log.warning("job %s: worker %s exited %d; restarting the group (restart %d of "
                            "%d)", self.spec.name, worker_id, code, restarts + 1,
                            self.spec.max_restarts)
                return True
            record, _ = self.generation_record()
        except StoreError as exc:  # cannot count it: the job fails rather than loop
            log.error("job %s: cannot record a restart (%s)", self.spec.name, exc)
            return False
        return record.restarts != restarts  # someone else restarted it already

    def _measure_startup(self, alloc: Allocation, restarts: int) -> None:
        """Time from now until rank 0's rendezvous port accepts (from a thread), and
        record it with this node's last stop time."""
        self._probe_stop = stop = threading.Event()
        port, began, stop_s = self.master_port(alloc, restarts), time.monotonic(), self._stop_s
        address = self.ctx.node.address

        def probe() -> None:
            while not stop.is_set() and time.monotonic() - began < PROBE_TIMEOUT:
                try:
                    with socket.create_connection((address, port), timeout=0.5):
                        break
                except OSError:
                    stop.wait(0.02)
            else:
                return  # replaced, or a script that never opens it: nothing measured
            startup = time.monotonic() - began

            def measured(old: JobGeneration) -> JobGeneration:
                return dataclasses.replace(
                    old, startup_s=round(startup, 3),
                    stop_s=round(stop_s, 3) if stop_s is not None else old.stop_s,
                    timestamp=time.time())

            try:
                self._update(measured)
            except StoreError as exc:  # only a measurement: the next start measures again
                log.info("job %s: start-up time not recorded (%s)", self.spec.name, exc)
            log.info("job %s: group started in %.2f s (stopping the previous one took %s)",
                     self.spec.name, startup, "-" if stop_s is None else f"{stop_s:.2f} s")

        threading.Thread(target=probe, name=f"probe-{self.spec.name}", daemon=True).start()

    def stop(self, grace: float) -> None:
        self._probe_stop.set()
        super().stop(grace)


def newest_mtime(folder: str) -> float | None:
    """The newest modification time of a file under ``folder`` (at most SCAN_LIMIT
    entries looked at); None when it has none or cannot be read."""
    newest, seen, todo = None, 0, [folder]
    while todo and seen < SCAN_LIMIT:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:  # (missing, unreadable, or removed meanwhile: nothing in it counts)
            continue
        for entry in entries[:SCAN_LIMIT - seen]:
            seen += 1
            try:
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                    newest = mtime if newest is None else max(newest, mtime)
            except OSError:  # (removed while looked at, e.g. a rotated checkpoint: skipped)
                continue
    return newest

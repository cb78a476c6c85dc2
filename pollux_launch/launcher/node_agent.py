"""The node agent: runs, on one node, the workers that the allocations place there.

Protocol (keys in ``pollux_launch.keys``):

* Registers ``nodes/<node>`` (``NodeInfo``) under a lease kept alive from a thread; when
  the agent dies the lease lapses and, after its grace period, the coordinator moves the
  node's jobs elsewhere. A lease lost to a store outage is re-granted and the record
  put again. In local mode every ``pollux-run`` on the machine shares ONE record: the
  first creates it under its lease, the others re-create it when that one ends.
* Reconciles every ``poll`` seconds and on store changes: each unfinished job is run by
  the driver of its framework (:mod:`.drivers`), if that driver's side is one this agent
  plays: a node agent (``sides={"node"}``) keeps one worker per replica the allocation
  places on its node; the launching ``pollux-run`` (``"launcher"``, without registering
  a node in cluster mode) runs one framework driver per job, e.g. ``horovodrun``.
* Never runs more slot-holding processes than the node has slots, whatever allocations
  say: a worker placed on a slot that a leaving worker (of any job) still holds starts
  once that one exited. The record carries the agent's count of live workers per job,
  so that the coordinator does not hand out slots that are still held.
* Never goes back from an allocation to an older one (``Allocation.order``: leadership
  term, then version), e.g. one written by a deposed coordinator or restored from a
  backup.
* Runs a job only if admitted (:mod:`.admission`: signed with the cluster secret, for
  this job, unexpired, not a finished submission again); a refused job fails at once
  (exit ``REFUSED``), so that it holds no slots.
* Reports exits as the driver classifies them: a worker that ends with exit 0 while
  still allocated completed the script: it is recorded, no process of the job is
  started or replaced any more, and once every worker of the job's final group has
  completed the job is ``succeeded`` (:mod:`.completion`; the others run as long as
  they run); any other non-zero exit fails the job (its workers are stopped everywhere
  and its slots freed); a worker killed by a signal is lost and the job goes on with its
  survivors (the next allocation replaces it) - unless its group is completing, which
  fails it. A framework driver's own exit code is the job's.
* SIGTERM drains: workers get SIGTERM, the lease is revoked, the process exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from pollux_launch.errors import PolluxError

from .. import env as envvars
from .. import keys
from ..completion import completion, generation
from ..messages import (
    Allocation,
    JobGpus,
    JobSpec,
    JobStatus,
    NodeInfo,
    ValueLog,
    WorkerFinished,
    encode,
)
from ..rendezvous.store import Compare, Put, Store, StoreError, StoreUnavailable
from .admission import Admission
from .devices import DevicePool, default_lock_dir
from .drivers import (  # noqa: F401  (ENV_*: re-exported for callers of this module)
    ENV_ADDR,
    ENV_JOB,
    ENV_NODE,
    ENV_PREFIX,
    ENV_STORE,
    ENV_WORKER_ID,
    DriverContext,
    JobDriver,
    ProcessExit,
    Side,
    driver_classes,
)
from .epoch import Epoch
from .logs import serve_logs

if TYPE_CHECKING:
    from .launch_options import LaunchOptions

log = logging.getLogger(__name__)

REFUSED = 126  # the exit code of a job a node agent refused to run (admission.py)
# seconds a worker's completion is kept for a job whose spec is not in the store: removed
# (then it is dropped), or a new store its launcher resubmits it to within seconds
ABSENT_GRACE = 60.0


class _JobAbsent(PolluxError):
    """The job's spec is not in the store (its report is kept for a while: _reap)."""
_LEAVES = {"spec": JobSpec, "status": JobStatus, "allocation": Allocation, "signature": None}
# leaves kept as text for completion.py: its workers' records, its group, its rounds
_RAW = (keys.FINISHED, "generation", "rdzv/round")


@dataclass
class _JobView:
    """One job as one read of the store shows it to an agent."""

    spec: JobSpec | None = None
    status: JobStatus | None = None
    alloc: Allocation | None = None
    spec_text: str = ""
    signature: str | None = None
    values: dict[str, str] = field(default_factory=dict)  # the _RAW leaves: key -> value


class NodeAgent:
    def __init__(
        self,
        store: Store,
        node: NodeInfo,
        store_url: str,
        store_prefix: str = envvars.DEFAULT_PREFIX,
        secret: bytes | None = None,
        only_jobs: set[str] | None = None,
        output_dir: str | None = None,
        stdout: IO[str] | None = None,
        lease_ttl: float = 5.0,
        poll: float = 0.5,
        clock: Callable[[], float] = time.time,
        sides: Collection[Side] = ("node",),
        launch_options: LaunchOptions | None = None,
        local: bool = False,
        ifname: str | None = None,
        state_dir: str | None = None,
        log_dir: str | None = None,
        gpus: Sequence[str] = (),
    ) -> None:
        """``sides``: which drivers this agent runs (``"node"``: it registers the node and
        runs per-replica workers; ``"launcher"``: it runs the framework drivers of the
        jobs it launched, ``launch_options`` being their pollux-run flags); ``state_dir``:
        where the agent keeps what must outlive it (``admission.py``); ``log_dir``: where
        a registered node keeps and serves its jobs' output (``logs.py``; ``local``: kept,
        not served - ``pollux-run logs`` reads the file on this machine); ``gpus``: the
        node's GPUs, each worker holding one (``devices.py``; none: CPU slots)."""
        self.log_dir = log_dir
        node = dataclasses.replace(node, gpus=tuple(gpus))
        self.devices = DevicePool(gpus, default_lock_dir(node.name)) if gpus else None
        self._gpus_said: dict[str, tuple[str, ...]] = {}  # job -> its GPUs as published
        self.store, self.node = store, node  # (the secret lives in self.admission)
        self.store_url, self.store_prefix = store_url, store_prefix
        self.only_jobs, self.output_dir, self.stdout = only_jobs, output_dir, stdout
        self.lease_ttl, self.poll, self.clock = lease_ttl, poll, clock
        self.sides = frozenset(sides)
        self.local = local
        self.runtime_dir = tempfile.mkdtemp(prefix=f"pollux-agent-{node.name}-")
        self.context = DriverContext(store, store_url, store_prefix, node, output_dir, stdout,
                                     launch_options, local, ifname, self.runtime_dir,
                                     self._credentials, log_dir=log_dir,
                                     devices=self.devices)
        self._scoped: dict[str, dict[str, str]] = {}  # job -> its processes' store variables
        self.drivers: dict[tuple[str, Side], JobDriver] = {}  # (job, side) -> its driver
        self.exits: list[tuple[str, str, int]] = []  # (job, worker id, code), for callers
        self.admission = Admission(secret, state_dir, clock)
        self._refused: set[str] = set()
        self._incarnation: dict[str, str] = {}  # job -> its spec's submission id
        self._lease = 0
        self._owns_node = False
        self._node_lock = threading.Lock()  # (set_slots from the discovery thread)
        self.values = ValueLog(log)  # a bad value is logged once per key and revision
        self._workers: dict[str, int] = {}  # the live workers per job, as last published
        self._newest: dict[str, Allocation] = {}  # per job: the newest allocation seen
        self._logged: set[tuple[str, str, int, int]] = set()  # (what, job, *order), said once
        self._epoch = Epoch()
        # exits reaped but not reported yet (a store error): (job, side, driver, exit)
        self._unreported: list[tuple[str, Side, JobDriver, ProcessExit]] = []
        self._absent: dict[tuple[str, str], float] = {}  # (job, worker) -> first seen absent

    @property
    def registers(self) -> bool:
        return "node" in self.sides

    # -- registration ----------------------------------------------------------------
    def register(self) -> None:
        if self._lease:
            self._keeper.stop()
        self._lease = self.store.lease_grant(self.lease_ttl)
        self._keeper = self.store.keep_alive(self._lease, self.lease_ttl / 3)
        self._gpus_said = {}  # (put under the old lease: gone with it)
        self._put_node()
        if self._epoch.changed(self.store):
            self._store_lost()

    def _store_lost(self) -> None:
        """The store lost everything (``epoch.py``): what was fenced by its numbers starts
        afresh; the workers here run on (their launchers submit their jobs again, the
        coordinator adopts them where they run, the workers put their rounds back)."""
        running = sorted({name for (name, _), d in self.drivers.items() if d.alive()})
        log.warning("node %s: the store lost its state (wiped, or a new store); registered "
                    "again, and the %d job(s) running here (%s) go on", self.node.name,
                    len(running), ", ".join(running) or "none")
        self._newest.clear()
        self._logged.clear()

    def _put_node(self) -> None:
        with self._node_lock:  # (never an older size over set_slots' newer one)
            key = keys.node(self.node.name)
            value = encode(dataclasses.replace(self.node, workers=dict(self._workers)))
            if self.local:  # shared by the machine's launchers: whoever finds it missing
                self._owns_node = self.store.create(key, value, lease=self._lease)
            else:  # this agent is the node's one agent: its record replaces a stale one
                self.store.put(key, value, lease=self._lease)
                self._owns_node = True

    def set_slots(self, slots: int) -> None:
        """This node's size changed (``--host-discovery-script``): its record says so at
        once where the record is this agent's (a shared local record another launcher
        created keeps that launcher's size). Raises StoreError (the caller retries)."""
        with self._node_lock:
            self.node = dataclasses.replace(self.node, slots=slots)
            if self._owns_node and self._lease:
                self.store.put(keys.node(self.node.name), encode(dataclasses.replace(
                    self.node, workers=dict(self._workers))), lease=self._lease)
            elif self.local:
                log.warning("node %s: its record belongs to another pollux-run on this "
                            "machine, whose slots stay in force", self.node.name)

    def _ensure_registered(self) -> None:
        if not self.registers:
            return
        if not self._lease or self._keeper.expired.is_set():
            log.warning("node %s: lease lost; registering again", self.node.name)
            self.register()
        elif not self._owns_node and self.store.get(keys.node(self.node.name)) is None:
            self._put_node()  # the launcher that held the shared record has ended

    # -- reconciliation --------------------------------------------------------------
    def step(self) -> None:
        """One pass: reap ended processes (reporting the job's end), then start missing
        ones and stop those of finished jobs. Reaping first means a worker that just
        finished the job is never replaced."""
        self._reap()
        for name, view in self._read_jobs().items():
            spec, status = view.spec, view.status
            if spec is not None and self._incarnation.setdefault(name, spec.submission) \
                    != spec.submission:
                self._forget(name)  # a new job of a finished one's name
                self._incarnation[name] = spec.submission
            if status is not None and status.finished:
                if spec is not None:
                    self.admission.finished(spec)
                if name in self._scoped and not any(d.alive() for d in self._drivers_of(name)):
                    self._drop_credentials(name)
                mine = self._drivers_of(name)
                if any(d.alive() for d in mine):
                    log.info("job %s is %s: stopping its processes here", name, status.state)
                    for driver in mine:
                        driver.stop(grace=5.0)
                continue
            if spec is None:
                continue
            completing = completion(spec, view.alloc, view.values).begun
            for cls in driver_classes(spec.framework, spec.elasticity):
                if cls.side in self.sides:
                    self._drive(cls, spec, status, view.alloc, view.spec_text, view.signature,
                                completing)
        self._publish_workers()

    def _forget(self, name: str) -> None:
        """Drop what this agent holds of an earlier job of that name (it has finished:
        its processes were stopped when it did)."""
        for side in ("node", "launcher"):
            driver = self.drivers.pop((name, side), None)
            if driver is not None:
                driver.stop(grace=5.0)
        self._newest.pop(name, None)
        self._refused.discard(name)

    def _scoped_name(self, job: str) -> str:
        return f"job.{job}.{self.node.name}.{'+'.join(sorted(self.sides))}"

    def _credentials(self, job: str) -> dict[str, str]:
        """The store variables of ``job``'s own user, which reaches only the job's keys
        (and reads node records): made once per job, its password in a file only this
        user can read. {} where the store has no authentication."""
        if job in self._scoped:
            return self._scoped[job]
        try:
            made = self.store.scoped_credentials(self._scoped_name(job), [keys.job(job)],
                                                 [keys.NODES])
        except StoreUnavailable:
            raise  # the next pass tries again
        except StoreError as exc:  # e.g. this agent's user may not manage users: say so
            log.error("job %s: cannot make its store user (%s); its processes get none - "
                      "give node agents an etcd user with the root role", job, exc)
            made = None
        env: dict[str, str] = {}
        if made is not None:
            user, password = made
            path = os.path.join(self.runtime_dir, f"{job}.store-password")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(password)
            env = {envvars.STORE_USER: user, envvars.STORE_PASSWORD_FILE: path}
        self._scoped[job] = env
        return env

    def _drop_credentials(self, job: str) -> None:
        if self._scoped.pop(job, None):
            try:
                self.store.drop_scoped_credentials(self._scoped_name(job))
            except StoreError as exc:  # left behind: it can reach only that job's keys
                log.warning("job %s: could not remove its store user (%s)", job, exc)

    def _free_slots(self) -> int:
        free = self.node.slots - sum(d.slots_held() for (_, side), d in self.drivers.items()
                                     if side == "node")
        # (local mode: other pollux-run on this machine may hold GPUs this one does not)
        return min(free, self.devices.free()) if self.devices and free > 0 else free

    def _once(self, what: str, job: str, alloc: Allocation) -> bool:
        key = (what, job, *alloc.order)
        if key in self._logged:
            return False
        self._logged.add(key)
        return True

    def _publish_workers(self) -> None:
        """Put the record again when the count of live workers per job changed (a shared
        local record is not ours to rewrite: it stays as created)."""
        counts = {}
        for (name, side), driver in self.drivers.items():
            if side == "node" and driver.slots_held():
                counts[name] = counts.get(name, 0) + driver.slots_held()
        self._publish_gpus()
        if counts == self._workers or not self.registers:
            return
        before, self._workers = self._workers, counts
        if self._owns_node and not self.local:
            self._put_node()
        elif self.local:
            try:
                self._merge_workers(set(before) | set(counts))
            except StoreError:
                self._workers = before  # (so that the next pass tries again)
                raise

    def _merge_workers(self, mine: set[str]) -> None:
        """The machine's shared local record: this launcher's counts of its jobs
        (``mine``) replace theirs in it, by compare-and-swap under the record's own lease,
        so that status's RUNNING counts every launcher's workers; the other jobs' counts,
        the size and the owner stay as they are. Raises StoreError."""
        key = keys.node(self.node.name)
        for _ in range(8):
            kv = self.store.get(key)
            if kv is None:  # (its owner ended: _ensure_registered puts ours, counts and all)
                return
            record = self.values.read(NodeInfo, kv.key, kv.value, kv.mod_revision)
            if record is None:  # malformed (logged): whoever puts it next replaces it
                return
            workers = {job: n for job, n in record.workers.items() if job not in mine}
            workers.update(self._workers)
            if workers == record.workers:
                return
            value = encode(dataclasses.replace(record, workers=workers))
            if self.store.txn([Compare(key, "mod_revision", "==", kv.mod_revision)],
                              [Put(key, value, kv.lease)]):
                return

    def _publish_gpus(self) -> None:
        """Put ``jobs/<job>/gpus/<node>`` (under this agent's lease) where the GPUs a job's
        workers hold here changed; delete it where they hold none any more."""
        if self.devices is None or not self._lease:
            return
        held: dict[str, list[str]] = {}
        for gpu, job in self.devices.owners().items():
            held.setdefault(job, []).append(gpu)
        order = {gpu: i for i, gpu in enumerate(self.node.gpus)}
        now = {job: tuple(sorted(g, key=order.__getitem__)) for job, g in held.items()}
        for job in sorted(set(now) | set(self._gpus_said)):
            if now.get(job) == self._gpus_said.get(job):
                continue
            key = keys.job_gpus(job, self.node.name)
            if job in now:  # (said even if the job is gone: not tried again each pass)
                self.store.txn([keys.job_exists(job)], [Put(key, encode(JobGpus(
                    self.node.name, now[job], self.clock())), lease=self._lease)])
                self._gpus_said[job] = now[job]
            else:
                self.store.delete(key)
                del self._gpus_said[job]

    def _fenced(self, name: str, alloc: Allocation | None) -> Allocation | None:
        """``alloc``, unless it is older than one already seen for the job (then that)."""
        newest = self._newest.get(name)
        if alloc is None:  # the job's keys were removed: a job of that name starts afresh
            self._newest.pop(name, None)
            return None
        if newest is None or alloc.order >= newest.order:
            self._newest[name] = alloc
            return alloc
        if self._once("stale", name, alloc):
            log.warning("job %s: ignoring allocation v%d of term %d, older than v%d of term "
                        "%d already seen (a deposed coordinator's write?)", name,
                        alloc.version, alloc.term, newest.version, newest.term)
        return newest

    def _drive(self, cls: type[JobDriver], spec: JobSpec, status: JobStatus | None,
               alloc: Allocation | None, spec_text: str, signature: str | None,
               completing: bool = False) -> None:
        """Run what ``alloc`` asks of ``cls`` for the job, if the job is admitted here -
        nothing new once its script completed somewhere (``completing``)."""
        name = spec.name
        driver = self.drivers.get((name, cls.side))
        if driver is None and not cls.wanted(alloc, self.node.name):
            return
        refusal = self.admission.refusal(spec, spec_text, signature)
        if refusal is not None:
            if name not in self._refused:  # the job fails at once: its slots are freed
                self._refused.add(name)
                log.error("job %s: not run: %s", name, refusal)
                self._set_status(name, JobStatus(
                    "failed", REFUSED, f"node {self.node.name} refused it: {refusal}",
                    self.clock()))
            return
        if completing:
            return  # its script completed somewhere: nothing is started or replaced
        if driver is None:
            driver = self.drivers[(name, cls.side)] = cls(spec, self.context)
        try:
            deferred = driver.reconcile(alloc, self._free_slots())
        except OSError as exc:
            log.error("job %s: cannot start %r in %r: %s", name, spec.command[0],
                      spec.workdir, exc.strerror or exc)
            self._set_status(name, JobStatus(
                "failed", 127, f"cannot start {spec.command[0]!r} in {spec.workdir!r} on "
                f"node {self.node.name}: {exc.strerror or exc}; every node runs a job's "
                "command at the path and in the working directory it had where it was "
                "submitted", self.clock()))
            return
        if deferred and alloc is not None and self._once("wait", name, alloc):
            log.info("job %s: %d process(es) wait for a free slot on node %s (its %d slots "
                     "are held by running workers)", name, deferred, self.node.name,
                     self.node.slots)
        if driver.alive() and (status is None or status.state == "pending"):
            self._set_status(name, JobStatus("running", None, "", self.clock()))

    def _drivers_of(self, job: str) -> list[JobDriver]:
        return [d for (name, _), d in self.drivers.items() if name == job]

    def _reap(self) -> None:
        """Reap ended processes and report each exit (in order; an exit whose report hit a
        store error is reported again at the next pass, not lost with the process; so is a
        completion of a job whose spec is absent, for ``ABSENT_GRACE``)."""
        for (name, side), driver in list(self.drivers.items()):
            for ended in driver.reap(lambda name=name: self._allocation(name)):
                self.exits.append((name, ended.worker_id, ended.code))
                log.info("job %s process %s exited %d (%s)", name, ended.worker_id, ended.code,
                         ended.kind)
                self._unreported.append((name, side, driver, ended))
        pending, self._unreported = self._unreported, []
        for i, item in enumerate(pending):
            try:
                self._report(*item)
            except _JobAbsent:
                since = self._absent.setdefault((item[0], item[3].worker_id), time.monotonic())
                if time.monotonic() - since < ABSENT_GRACE:
                    self._unreported.append(item)  # (in order: reported at a later pass)
                else:
                    log.info("job %s is gone: the completion of %s is not recorded", item[0],
                             item[3].worker_id)
            except BaseException:  # a store error: this one and the rest at the next pass
                self._unreported += pending[i:]
                raise
            else:
                self._absent.pop((item[0], item[3].worker_id), None)

    def _report(self, name: str, side: Side, driver: JobDriver, ended: ProcessExit) -> None:
        if ended.kind == "finished" and side == "launcher":  # (e.g. horovodrun's)
            self._set_status(name, JobStatus("succeeded", 0, "", self.clock()))
        elif ended.kind == "finished":
            self._finished(name, ended)
        elif ended.kind == "failed" or (ended.kind == "lost" and self._completing(name)):
            who = f"{ended.detail.partition(':')[0]} ({ended.worker_id} on " \
                  f"{self.node.name})" if ended.detail else \
                  f"{ended.worker_id} on {self.node.name}"
            why = ended.detail.partition(":")[2].strip()
            if ended.kind == "lost":  # nothing replaces it once its group completes
                why = "killed while the rest of its group completed the script"
            self._set_status(name, JobStatus(
                "failed", ended.code, f"{who} exited {ended.code}"
                + (f": {why}" if why else ""), self.clock()))
            driver.stop(grace=5.0)

    def _finished(self, name: str, ended: ProcessExit) -> None:
        """A worker completed the script: record it; the job has succeeded once every
        worker of its final group has (``completion.py``)."""
        alloc = self._allocation(name)
        mark = WorkerFinished(self.node.name, ended.generation or generation(alloc, 0),
                              self.clock())
        if not self.store.txn([keys.job_exists(name)],
                              [Put(keys.job_finished(name, ended.worker_id), encode(mark))]):
            raise _JobAbsent(name)  # gone, or in a wiped store not yet resubmitted
        view = self._read_jobs(keys.job(name)).get(name)
        if view is None or view.spec is None:
            return
        done = completion(view.spec, view.alloc, view.values)
        if done.done:
            self._set_status(name, JobStatus("succeeded", 0, "", self.clock()))
        elif self._once("completing", name, view.alloc or Allocation(0, ())):
            log.info("job %s: %d of its %d worker(s) completed the script; waiting for the "
                     "others", name, done.finished, done.group)

    def _completing(self, job: str) -> bool:
        view = self._read_jobs(keys.job(job)).get(job)
        return bool(view and view.spec and completion(view.spec, view.alloc,
                                                      view.values).begun)

    def _allocation(self, job: str) -> Allocation | None:
        kv = self.store.get(keys.job(job, "allocation"))
        if kv is None:
            return self._fenced(job, None)
        alloc = self.values.read(Allocation, kv.key, kv.value, kv.mod_revision)
        # a malformed allocation changes nothing: the newest good one stands
        return self._fenced(job, alloc) if alloc is not None else self._newest.get(job)

    def _set_status(self, job: str, status: JobStatus) -> None:
        """Move the job's state forward; a finished state is final (the first report wins)."""
        key = keys.job(job, "status")
        current = self.store.get(key)
        # a malformed status (logged once) is replaced by this real one: nothing is lost
        old = (self.values.read(JobStatus, current.key, current.value, current.mod_revision)
               if current is not None else None)
        if old is not None and old.finished:
            return
        guard = [keys.job_exists(job),
                 Compare(key, "mod_revision", "==", current.mod_revision if current else 0)]
        self.store.txn(guard, [Put(key, encode(status))])

    def _read_jobs(self, prefix: str = keys.JOBS) -> dict[str, _JobView]:
        """Every job under ``prefix`` (one read), as this agent sees it."""
        out: dict[str, _JobView] = {}
        for kv in self.store.get_prefix(prefix):
            split = keys.split_job_key(kv.key)
            if split is None:
                continue
            name, leaf = split
            if self.only_jobs is not None and name not in self.only_jobs:
                continue
            view = out.setdefault(name, _JobView())
            if leaf not in _LEAVES:
                if leaf.startswith(_RAW):
                    view.values[kv.key] = kv.value
                continue
            if leaf == "signature":
                view.signature = kv.value.strip('"')[:256]
                continue
            value = self.values.read(_LEAVES[leaf], kv.key, kv.value, kv.mod_revision)
            if leaf == "spec" and value is not None and value.name != name:
                self.values.bad(kv.key, kv.mod_revision, f"is job {value.name!r}'s spec")
            elif leaf == "spec" and value is not None:
                view.spec, view.spec_text = value, kv.value
            elif leaf == "status":
                view.status = value
            elif leaf == "allocation":  # a malformed one changes nothing (see _allocation)
                view.alloc = (self._fenced(name, value) if value is not None
                              else self._newest.get(name))
        return out

    # -- the service -----------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        log_server = None
        if self.log_dir and self.registers and not self.local:  # (its port in the record)
            log_server, self.node = serve_logs(self.log_dir, self.node, self.admission.secret)
        if self.registers and not self._lease:  # (unless the caller registered it first)
            self.register()
        rev = 0
        try:
            while not stop.is_set():
                try:
                    self._ensure_registered()
                    rev = self.store.revision()
                    self.step()
                    self.store.wait(keys.JOBS, rev, timeout=self.poll)
                except StoreError as exc:
                    log.warning("node %s: store problem (%s); retrying", self.node.name, exc)
                    stop.wait(1.0)
                except Exception:  # a bug must not stop the node's running workers: say it
                    log.exception("node %s: unexpected error; retrying in 5 s", self.node.name)
                    stop.wait(5.0)
        finally:
            self.drain()
            if log_server is not None:
                log_server.stop()

    def drain(self) -> None:
        for driver in self.drivers.values():
            driver.stop(grace=10.0)
        if self.devices is not None:  # (the workers have exited)
            self.devices.close()
        for job in list(self._scoped):
            self._drop_credentials(job)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self._lease:
            self._keeper.stop()
            try:
                self.store.lease_revoke(self._lease)
            except StoreError:
                pass
            self._lease = 0

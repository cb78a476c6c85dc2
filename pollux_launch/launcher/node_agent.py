"""The node agent: runs, on one node, the workers that the allocations place there.

Protocol (keys in ``pollux_launch.keys``):

* Registers ``nodes/<node>`` (``NodeInfo``) under a lease kept alive from a thread; when
  the agent dies the lease lapses and the coordinator moves the node's jobs elsewhere.
* Reconciles every ``poll`` seconds and on store changes: for each unfinished job whose
  allocation names this node k times, it keeps k workers alive. A shrink is carried out
  by the rendezvous (the workers not in the new round exit 0 by themselves); a grow
  starts new workers, which join the job's next round and receive its state.
* Runs a job only if its spec is signed with the cluster secret (when one is set).
* Reports exits: a worker that ends with exit 0 while still allocated finished the job
  (``JobStatus`` succeeded); any other non-zero exit fails the job (its workers are
  stopped everywhere and its slots freed); a worker killed by a signal is lost and the
  job goes on with its survivors (the next allocation replaces it).
* SIGTERM drains: workers get SIGTERM, the lease is revoked, the process exits.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import IO

from .. import keys
from ..messages import Allocation, JobSpec, JobStatus, MessageError, NodeInfo, decode, encode
from ..rendezvous.store import Compare, Put, Store, StoreError
from . import security
from .workers import WorkerGroup, classify_exit

log = logging.getLogger(__name__)

# Environment a worker is started with (read by pollux_launch.adapters and the agent).
ENV_STORE = "POLLUX_STORE"
ENV_PREFIX = "POLLUX_STORE_PREFIX"
ENV_JOB = "POLLUX_JOB"
ENV_NODE = "POLLUX_NODE"
ENV_WORKER_ID = "POLLUX_WORKER_ID"
ENV_ADDR = "POLLUX_ADDR"


class NodeAgent:
    def __init__(
        self,
        store: Store,
        node: NodeInfo,
        store_url: str,
        store_prefix: str = "/pollux",
        secret: bytes | None = None,
        only_jobs: set[str] | None = None,
        output_dir: str | None = None,
        stdout: IO[str] | None = None,
        lease_ttl: float = 5.0,
        poll: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.node, self.secret = store, node, secret
        self.store_url, self.store_prefix = store_url, store_prefix
        self.only_jobs, self.output_dir, self.stdout = only_jobs, output_dir, stdout
        self.lease_ttl, self.poll, self.clock = lease_ttl, poll, clock
        self.groups: dict[str, WorkerGroup] = {}
        self.exits: list[tuple[str, str, int]] = []  # (job, worker id, code), for callers
        self._refused: set[str] = set()
        self._lease = 0

    # -- registration ----------------------------------------------------------------
    def register(self) -> None:
        self._lease = self.store.lease_grant(self.lease_ttl)
        self.store.put(keys.node(self.node.name), encode(self.node), lease=self._lease)
        self._keeper = self.store.keep_alive(self._lease, self.lease_ttl / 3)

    def _ensure_registered(self) -> None:
        if not self._lease or self._keeper.expired.is_set():
            log.warning("node %s: lease lost; registering again", self.node.name)
            self.register()

    # -- reconciliation --------------------------------------------------------------
    def step(self) -> None:
        """One pass: reap ended workers (reporting the job's end), then start missing
        workers and stop those of finished jobs. Reaping first means a worker that just
        finished the job is never replaced."""
        self._reap()
        jobs = self._read_jobs()
        for name, (spec, status, alloc, spec_text, signature) in jobs.items():
            want = alloc.nodes.count(self.node.name) if alloc else 0
            group = self.groups.get(name)
            if status is not None and status.finished:
                if group is not None and group.alive():
                    log.info("job %s is %s: stopping its workers here", name, status.state)
                    group.stop(grace=5.0)
                continue
            if spec is None or (want == 0 and group is None):
                continue
            if self.secret is not None and not security.verify(spec_text, signature, self.secret):
                if name not in self._refused:
                    log.error("job %s: spec not signed with this cluster's secret; not run", name)
                    self._refused.add(name)
                continue
            if group is None:
                group = self.groups[name] = self._group(spec)
            for _ in range(want - len(group.alive())):
                self._start_worker(spec, group)
            if group.alive() and (status is None or status.state == "pending"):
                self._set_status(name, JobStatus("running", None, "", self.clock()))

    def _reap(self) -> None:
        for name, group in list(self.groups.items()):
            ended = group.reap()
            if not ended:
                continue
            # read the allocation afresh: a worker that left because of a rescale exited
            # after the new allocation was written, perhaps after this pass's first read
            alloc = self._allocation(name)
            want = alloc.nodes.count(self.node.name) if alloc else 0
            for worker, code in ended:
                kind = classify_exit(code, still_allocated=want > len(group.alive()))
                self.exits.append((name, worker.worker_id, code))
                log.info("job %s worker %s exited %d (%s)", name, worker.worker_id, code, kind)
                if kind == "finished":
                    self._set_status(name, JobStatus("succeeded", 0, "", self.clock()))
                elif kind == "failed":
                    self._set_status(name, JobStatus(
                        "failed", code, f"worker on {self.node.name} exited {code}", self.clock()))
                    group.stop(grace=5.0)

    def _allocation(self, job: str) -> Allocation | None:
        kv = self.store.get(keys.job(job, "allocation"))
        try:
            return decode(Allocation, kv.value) if kv else None
        except MessageError:
            return None

    def _start_worker(self, spec: JobSpec, group: WorkerGroup) -> None:
        worker_id = f"{self.node.name}-{uuid.uuid4().hex[:8]}"
        env = {
            ENV_STORE: self.store_url, ENV_PREFIX: self.store_prefix, ENV_JOB: spec.name,
            ENV_NODE: self.node.name, ENV_WORKER_ID: worker_id, ENV_ADDR: self.node.address,
        }
        try:
            group.start(worker_id, env)
        except OSError as exc:
            self._set_status(spec.name, JobStatus(
                "failed", 127, f"cannot start {spec.command[0]!r}: {exc.strerror}", self.clock()))

    def _group(self, spec: JobSpec) -> WorkerGroup:
        return WorkerGroup(spec.name, spec.command, spec.env, cwd=spec.workdir or None,
                           output_dir=self.output_dir, stdout=self.stdout)

    def _set_status(self, job: str, status: JobStatus) -> None:
        """Move the job's state forward; a finished state is final (the first report wins)."""
        key = keys.job(job, "status")
        current = self.store.get(key)
        if current is not None:
            try:
                if decode(JobStatus, current.value).finished:
                    return
            except MessageError:
                pass
        guard = [Compare(key, "mod_revision", "==", current.mod_revision if current else 0)]
        self.store.txn(guard, [Put(key, encode(status))])

    def _read_jobs(self):
        out: dict[str, list] = {}
        for kv in self.store.get_prefix(keys.JOBS):
            split = keys.split_job_key(kv.key)
            if split is None:
                continue
            name, leaf = split
            if self.only_jobs is not None and name not in self.only_jobs:
                continue
            if leaf not in ("spec", "status", "allocation", "signature"):
                continue
            entry = out.setdefault(name, [None, None, None, "", None])
            try:
                if leaf == "spec":
                    entry[0], entry[3] = decode(JobSpec, kv.value), kv.value
                elif leaf == "status":
                    entry[1] = decode(JobStatus, kv.value)
                elif leaf == "allocation":
                    entry[2] = decode(Allocation, kv.value)
                else:
                    entry[4] = kv.value.strip('"')
            except MessageError as exc:
                log.warning("ignoring malformed %s: %s", kv.key, exc)
        return {k: tuple(v) for k, v in out.items()}

    # -- the service -----------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
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
        finally:
            self.drain()

    def drain(self) -> None:
        for group in self.groups.values():
            group.stop(grace=10.0)
        if self._lease:
            self._keeper.stop()
            try:
                self.store.lease_revoke(self._lease)
            except StoreError:
                pass
            self._lease = 0

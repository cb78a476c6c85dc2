"""The coordinator service: read the cluster from the store, run the policy, write allocations.

Protocol (keys in ``pollux_launch.keys``):

1. Leadership: candidates race to ``create`` ``coordinator/leader`` under a lease; the
   winner keeps the lease alive, the others wait for the key to vanish. Any number may
   run (active/standby); killing the active one hands over within the lease TTL. A
   leader value held by no lease (written by hand, or restored from a backup) would
   never vanish: a candidate deletes it, by compare-and-swap, and campaigns.
2. A round: read ``nodes/*`` and ``jobs/*/{spec,status,hints,allocation}`` (and, in the
   same read, each live job's rendezvous: ``rdzv/workers/*`` and its last formed round's
   ``state``); build one ``JobInfo`` per unfinished job; ``policy.optimize``, then
   ``policy.holders.keep_holders`` (a job the policy moves keeps a replica on a node
   whose worker holds its training state, if any can); for each job whose placement
   changed, write ``Allocation(version + 1, ..., term)``. ``term`` is the create revision
   of this leader's ``coordinator/leader`` key (a fencing token: it grows with every new
   leadership). The writes are transactions (one per ``TXN_OPS`` allocations, etcd's
   limit; jobs that shrink first) conditioned on the leader key still having that create
   revision and our value, so a deposed leader never writes; node agents never go back
   from an allocation of a newer term to an older one.
3. Rounds run every ``interval`` seconds and at once (after ``settle`` seconds, to batch
   bursts) when a job is submitted or finishes, or a node joins or leaves.
4. Slots are held by processes, not by decisions: each node record carries its agent's
   count of live workers per job, and slots still held by workers that an allocation
   no longer places there (leaving, or left over from before a coordinator restart) are
   not offered to other jobs until the agent says they exited.

Nodes are presumed dead only after a grace period (``node_grace``, like Kubernetes'
node monitor grace period): a node whose record vanished - its agent died, or its lease
lapsed in a store stall - keeps its running replicas (no new ones) until it has been
missing for ``node_grace`` seconds *of this coordinator reading the store*: time in
which the coordinator itself could not reach the store does not count, and a freshly
started coordinator gives the nodes its jobs are allocated on the same grace before it
moves anything.

Nothing durable lives here: a restarted coordinator re-reads everything, and running
jobs are not disturbed because unchanged placements are not rewritten.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import keys
from ..completion import completion
from ..messages import (
    REJECTED_EXIT,
    Allocation,
    AutoscaleStatus,
    JobGeneration,
    JobHints,
    JobSpec,
    JobStatus,
    MessageError,
    NodeDrain,
    NodeInfo,
    ValueLog,
    decode,
)
from ..messages import encode as encode_msg
from ..policy import JobInfo, Policy, PolicyNode
from ..policy.admission import AdmissionConfig, Candidate, decide_admission
from ..policy.gpu_types import typed_allocation
from ..policy.holders import keep_holders
from ..policy.placement import pinned_jobs
from ..policy.rescale_cost import RescaleCost
from ..rendezvous.rounds import JobKeys, RoundState, WorkerInfo
from ..rendezvous.store import Compare, Delete, Event, KeyValue, Put, Store, StoreError
from .autoscaler import Autoscaler
from .jobs import SpeedupFn, job_info, model_speedup, model_throughput

log = logging.getLogger(__name__)
_DEAD = -float("inf")  # the missing-since mark of a node presumed dead
# most allocations one transaction writes: etcd refuses a transaction of more operations
# than its --max-txn-ops (default 128); a round changing more jobs writes several, each
# guarded by this leader's term
TXN_OPS = 128
# a job's rendezvous keys, relative to jobs/<job>/ (rendezvous/rounds.py's JobKeys)
_RDZV_KEYS = JobKeys("job")
_RDZV = _RDZV_KEYS.rdzv[len(_RDZV_KEYS.prefix):]  # rdzv/
_WORKERS = _RDZV_KEYS.workers[len(_RDZV_KEYS.prefix):]  # rdzv/workers/<worker>
_ROUNDS = _RDZV_KEYS.round_prefix(0)[len(_RDZV_KEYS.prefix):-len("00000000/")]
_STATE = _RDZV_KEYS.state(0)[len(_RDZV_KEYS.round_prefix(0)) - 1:]  # rdzv/rounds/<r>/state


@dataclass
class _JobView:
    spec: JobSpec | None = None
    status: JobStatus | None = None
    hints: JobHints | None = None
    allocation: Allocation | None = None
    generation: JobGeneration | None = None
    hints_revision: int = 0
    status_revision: int = 0
    # its spec key's create and mod revisions as read (0: it has none - then nothing is
    # written for the job: keys.job_exists), and why its value was refused, if it was
    spec_created: int = 0
    spec_revision: int = 0
    refused: str | None = None
    # its rendezvous: the state of its latest formed round (the highest round number
    # with one) and its registered workers (each key lives under the worker's lease)
    round_state: KeyValue | None = None
    state_round: int = -1
    workers: dict[str, KeyValue] = field(default_factory=dict)
    # its workers' completion records and its generation, as text (completion.py)
    finished: dict[str, str] = field(default_factory=dict)


class Coordinator:
    """One coordinator candidate. ``serve`` runs until ``stop`` is set."""

    def __init__(
        self,
        store: Store,
        policy: Policy,
        interval: float = 60.0,
        lease_ttl: float = 10.0,
        settle: float = 0.5,
        clock: Callable[[], float] = time.time,
        name: str | None = None,
        node_grace: float = 40.0,
        cost: RescaleCost | None = None,
        live_delay: float | None = None,
        admission: AdmissionConfig | None = None,
        autoscaler: Autoscaler | None = None,
    ) -> None:
        self.store, self.policy, self.interval = store, policy, interval
        self.admission = admission or AdmissionConfig()
        self._admitted_now: set[str] = set()  # admitted in this round
        self.autoscaler = autoscaler
        self._autoscale_said: AutoscaleStatus | None = None
        # what a change costs each job (the penalty's delta, by kind): see jobs.job_info
        self.cost, self.live_delay = cost, live_delay
        self.node_grace = node_grace
        self._known: dict[str, NodeInfo] = {}  # every node seen, as last seen
        self._modelled: set[str] = set()  # jobs whose hints carried a goodput model
        # each job's last replica request seen (its adaptation policies'): a new one
        # starts a round
        self._wanted: dict[str, tuple[int | None, int | None]] = {}
        self._missing: dict[str, float] = {}  # node -> since when it is missing
        self._store_lost = False  # a store call failed since the last good read
        self._deposed = False  # a guarded write found another leader's value
        self.lease_ttl, self.settle, self.clock = lease_ttl, settle, clock
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.rounds = 0
        self._lease = 0
        self.term = 0  # the create revision of our leader key while we lead
        # per job: (hints timestamp, speedup, throughput) of its model
        self._memo: dict[str, tuple[float, SpeedupFn | None, SpeedupFn | None]] = {}
        self.values = ValueLog(log)  # a bad value is logged once per key and revision
        self._good: dict[str, Allocation] = {}  # per job: the last well-formed allocation
        self._resumed_term: int | None = None  # the term whose autoscaler state we read
        # per job: (state text, (worker, node) per member) of its latest formed round
        # (keyed by its text, not its revision: a new store's revisions start again)
        self._rounds: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {}
        self._typed: dict[str, Policy] = {}  # per GPU type: its engine (several types)

    # -- one round -------------------------------------------------------------------
    def schedule_once(self) -> dict[str, Allocation]:
        """Run one scheduling round; returns the allocations it wrote."""
        present = self._read_nodes()
        jobs = self._read_jobs()
        now = self.clock()
        if self.autoscaler is not None and self._resumed_term != self.term:
            self._resume_autoscaler(now)
        for name, view in sorted(jobs.items()):
            if view.refused is not None and not (view.status and view.status.finished):
                self._refuse(name, view, now)
        active = [n for n, v in sorted(jobs.items())
                  if v.spec is not None and not (v.status and v.status.finished)]
        adopted, deferred = self._adopt(active, jobs, present, now)
        active = [n for n in active if n not in deferred]
        nodes = self._with_grace(present, [jobs[n].allocation for n in active], now)
        self._admitted_now = set()
        if self.admission.enabled:
            capacity = sum(n.slots for n in nodes)
            if self.autoscaler is not None:  # the cluster grows for what it admits
                capacity = max(capacity, self.autoscaler.max_gpus(nodes))
            active = self._admit(active, jobs, capacity, now)
        names = [n.name for n in nodes]
        index = {name: i for i, name in enumerate(names)}
        current = np.zeros((len(active), len(nodes)), dtype=int)
        for j, name in enumerate(active):
            alloc = jobs[name].allocation
            for node in alloc.nodes if alloc else ():
                if node in index:
                    current[j, index[node]] += 1
        infos = [job_info(_as_scheduled(v, n in adopted), v.hints, v.allocation, now,
                          self._speedup(n, v), v.generation, self.cost, self.live_delay,
                          self._memo[n][2])
                 for n, v in ((n, jobs[n]) for n in active)]
        held = _held({name: jobs[name].allocation for name in active})
        drain = (self.autoscaler.round(infos, present, held, now) if self.autoscaler
                 else set())  # draining nodes take nothing: their jobs move off live
        drain |= self._read_drains()  # (and those an operator drains)
        free = [PolicyNode(n.name, 0 if n.name in drain else _capacity(n, held.get(n.name, {})))
                for n in nodes]
        target = current
        stranded = np.zeros(len(active), dtype=bool)
        if active and nodes:
            try:
                chosen = self._optimize(infos, free, current, [n.gpu_type for n in nodes],
                                        [jobs[n].spec for n in active])
                target, stranded = self._keep_holders(active, jobs, index, infos, free,
                                                      current, chosen)
            except (ArithmeticError, ValueError) as exc:  # keep what runs; say it each round
                log.error("policy %s failed (%s); allocations unchanged this round",
                          type(self.policy).__name__, exc)
        writes: dict[str, Allocation] = {}
        for j, name in enumerate(active):
            old = jobs[name].allocation
            placement = _placement(old.nodes if old else (), target[j], names)
            if stranded[j] and placement != (old.nodes if old else ()):
                log.warning("job %s: its new allocation (%s) leaves no slot to the workers "
                            "holding its training state (every node they are on is full "
                            "or has no slots): it goes on from its last checkpoint, or "
                            "from the start", name, ", ".join(sorted(set(placement))))
            # (no key for "not placed yet", unless admission control admitted it now)
            if placement != (old.nodes if old else ()) or name in adopted or (
                    old is None and name in self._admitted_now):
                writes[name] = Allocation(_next_version(old), placement, now, self.term)
        for name, view in jobs.items():  # finished jobs give their slots back
            if view.status and view.status.finished and view.allocation and \
                    view.allocation.nodes and view.spec_created:
                writes[name] = Allocation(view.allocation.version + 1, (), now, self.term)
        for name in set(self._memo) - set(active):
            del self._memo[name]
        for name in set(self._rounds) - set(active):
            del self._rounds[name]
        for name in set(self._good) - set(jobs):
            del self._good[name]
        # (the value too: a put over our key keeps its create revision)
        guard = ([Compare(keys.LEADER, "create_revision", "==", self.term),
                  Compare(keys.LEADER, "value", "==", json.dumps(self.name))]
                 if self._lease else [])
        if writes:
            # jobs that give slots back first, so agents free them before others grow
            order = sorted(writes, key=lambda n: (_replicas(writes[n]) - _replicas(
                jobs[n].allocation), n))
            writes, lost = self._put_allocations(order, writes, jobs, guard)
            for name, alloc in sorted(writes.items()):
                log.info("allocation %s v%d: %s", name, alloc.version, _describe(alloc))
            if lost:
                return writes
        self.rounds += 1
        status = self.autoscaler.status if self.autoscaler else None
        if status is not None and status != self._autoscale_said and not self._deposed:
            # guarded: a deposed leader must not overwrite its successor's decision
            if self.store.txn(guard, [Put(keys.AUTOSCALE, encode_msg(status))]):
                self._autoscale_said = status
        return writes

    def _put_allocations(self, order: list[str], writes: dict[str, Allocation],
                         jobs: dict[str, _JobView], guard: list[Compare]
                         ) -> tuple[dict[str, Allocation], bool]:
        """Write ``writes`` in ``order``, in transactions of at most ``TXN_OPS``
        comparisons and as many puts (etcd's limit applies to each), each guarded by our
        leadership and by every job's spec being the one this round read
        (``keys.job_exists``). A job removed meanwhile (its launcher deleted its keys)
        gets nothing and the rest are written again; a lost leadership ends the round
        (``_deposed``). Returns what was written, and whether the leadership was lost."""
        size = TXN_OPS - len(guard)  # (etcd: at most TXN_OPS comparisons, and puts)
        done: dict[str, Allocation] = {}
        pending = list(order)
        while pending:
            chunk = pending[:size]
            cond = [*guard, *(keys.job_exists(n, jobs[n].spec_created) for n in chunk)]
            ops = [Put(keys.job(n, "allocation"), encode_msg(writes[n])) for n in chunk]
            if self.store.txn(cond, ops):
                done.update((n, writes[n]) for n in chunk)
                self._good.update((n, writes[n]) for n in chunk)
                pending = pending[size:]
                continue
            gone = {n for n in chunk if _created(self.store.get(keys.job(n, "spec")))
                    != jobs[n].spec_created}
            if not gone:  # every spec is as read: the leader guard failed
                log.warning("coordinator %s lost leadership; round discarded%s", self.name,
                            f" after {len(done)} of {len(order)} allocations" if done else "")
                self._deposed = True
                return done, True
            log.info("job%s %s removed while this round ran: no allocation written for "
                     "%s", "s" if len(gone) > 1 else "", ", ".join(sorted(gone)),
                     "them" if len(gone) > 1 else "it")
            pending = [n for n in pending if n not in gone]
        return done, False

    def _refuse(self, name: str, view: _JobView, now: float) -> None:
        """Fail a job whose spec no reader accepts (``view.refused``: why), so that its
        launcher ends with that reason instead of waiting for slots forever. Written only
        if neither the spec nor the status changed since this round read them."""
        why = f"the coordinator refused its spec: {view.refused}"[:400]
        guard = [Compare(keys.job(name, "spec"), "mod_revision", "==", view.spec_revision)]
        if self._set_status(name, view, JobStatus("failed", 1, why, now), guard):
            log.warning("job %s failed: %s", name, why)

    def _adopt(self, active: list[str], jobs: dict[str, _JobView], present: list[NodeInfo],
               now: float) -> tuple[set[str], set[str]]:
        """Jobs that have no allocation but whose workers run (the store lost everything -
        wiped, or a new store - and their launchers submitted them again): their current
        allocation is where those workers run - a live job's last formed round, which its
        workers put back (all of its members, also those whose node has not registered
        again yet), else the workers the node agents report - written this round as
        version 1 and kept there for it. Otherwise the policy would take their own
        workers for slots that others hold and start them elsewhere, from scratch.
        Returns (adopted, deferred: live jobs whose round is not back yet - left alone
        this round, their workers train on)."""
        adopted: set[str] = set()
        deferred: set[str] = set()
        records = {**{n: info for n, info in self._known.items()},
                   **{n.name: n for n in present}}
        for name in active:
            view = jobs[name]
            if view.allocation is not None:
                continue
            reported = tuple(n for n, info in sorted(records.items())
                             for _ in range(info.workers.get(name, 0)))
            placed = reported
            if view.spec is not None and view.spec.elasticity == "live" and reported:
                placed = tuple(node for _, node in self._members(name, view))
                if not placed:
                    deferred.add(name)
                    continue
            if placed:
                view.allocation = Allocation(0, placed, now, self.term)
                adopted.add(name)
                log.warning("job %s: its allocation is gone but its %d worker(s) run (on %s): "
                            "adopting them where they are", name, len(placed),
                            ", ".join(sorted(set(placed))))
        return adopted, deferred

    def _keep_holders(self, active: list[str], jobs: dict[str, _JobView],
                      index: dict[str, int], infos: list[JobInfo], free: list[PolicyNode],
                      current: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``target`` repaired so that every live job keeps a replica where its training
        state is (``policy.holders.keep_holders``: the holders are the members of its
        latest formed round whose worker key is alive, per node), and the jobs it could
        not repair. Jobs without rounds (restart-elastic, fixed, not started) have no
        holders: nothing changes for them; nor for a non-preemptible running job. Only
        the jobs the policy moves need their holders: a job left where it is keeps what
        it has, and the repair swaps only replicas that are new on a node."""
        target = np.asarray(target)
        if target.shape != current.shape:
            raise ValueError(f"the policy's allocation has shape {target.shape}, expected "
                             f"{current.shape}")
        holders = np.zeros_like(current)
        for j in np.flatnonzero(np.any(target != current, axis=1)):
            view = jobs[active[j]]
            for worker, node in self._members(active[j], view):
                if worker in view.workers and node in index:
                    holders[j, index[node]] += 1
        none = np.zeros(len(active), dtype=bool)
        if not holders.any():
            return target, none
        repair = keep_holders(target, current, holders, np.array([n.slots for n in free]),
                              ~pinned_jobs(infos, current))
        moved = np.flatnonzero(repair.moved)
        if moved.size:  # (one line a round: a big cluster may repair many)
            names = list(index)
            said = [f"{active[j]} ({', '.join(names[n] for n in np.flatnonzero(holders[j]))})"
                    for j in moved[:5]]
            log.info("kept a replica where the training state is, instead of one with none, "
                     "for job%s %s%s", "s" if moved.size > 1 else "", "; ".join(said),
                     f" and {moved.size - 5} more" if moved.size > 5 else "")
        return repair.target, repair.stranded

    def _members(self, name: str, view: _JobView) -> tuple[tuple[str, str], ...]:
        """(worker, node) of each member of the job's latest formed round, distinct; ()
        when it has none or its state is malformed (logged once: then nothing is
        repaired for it, as before). Memoised per job and state revision."""
        kv = view.round_state
        if kv is None:
            return ()
        cached = self._rounds.get(name)
        if cached is not None and cached[0] == kv.value:
            return cached[1]
        state = self.values.read(RoundState, kv.key, kv.value, kv.mod_revision)
        members: dict[str, str] = {}
        if state is not None and len(state.nodes) == len(state.members):
            members = dict(zip(state.members, state.nodes, strict=True))
        elif state is not None:  # a state without nodes: each worker's own record says
            for worker in state.members:
                rec = view.workers.get(worker)
                info = (self.values.read(WorkerInfo, rec.key, rec.value, rec.mod_revision)
                        if rec is not None else None)
                if info is not None:
                    members[worker] = info.node
        pairs = tuple(members.items())
        if state is None or len(pairs) == len(set(state.members)):
            self._rounds[name] = (kv.value, pairs)  # (not while a record is missing)
        return pairs

    def _resume_autoscaler(self, now: float) -> None:
        """A new leader goes on from the last autoscale decision in the store (nodes
        asked for and still booting, drains under way) instead of asking for the booting
        nodes again or keeping a half-drained node."""
        assert self.autoscaler is not None
        self._resumed_term = self.term
        kv = self.store.get(keys.AUTOSCALE)
        last = (self.values.read(AutoscaleStatus, kv.key, kv.value, kv.mod_revision)
                if kv is not None else None)
        if last is not None:
            log.info("autoscale: resuming from the last decision (%d nodes, target %d, %d "
                     "booting, draining %s)", last.nodes, last.target, last.booting,
                     ", ".join(last.draining) or "none")
            self.autoscaler.resume(last, now)
            self._autoscale_said = last

    def _admit(self, active: list[str], jobs: dict[str, _JobView], capacity: int,
               now: float) -> list[str]:
        """Admission control (``pollux_launch.policy.admission``): the jobs that compete
        this round. A job is admitted once it has an allocation record (written in the
        round that admits it, empty if the policy gives it nothing yet); the others queue
        in arrival order (status ``queued``, with why) or are rejected (status
        ``rejected``, exit code REJECTED_EXIT: its launcher ends with one line)."""
        def candidate(name: str) -> Candidate:
            spec = jobs[name].spec
            assert spec is not None
            return Candidate(name, spec.submit_time, spec.min_replicas)

        held = [n for n in active if jobs[n].allocation is not None]
        waiting = [n for n in active if n not in held]
        got = decide_admission(self.admission, [candidate(n) for n in waiting],
                               [candidate(n) for n in held], capacity, now)
        for name in got.admit:
            if jobs[name].status is not None and jobs[name].status.state == "queued":
                self._set_status(name, jobs[name], JobStatus("pending", None, "admitted", now))
        for name, why in got.drop:
            log.info("job %s rejected: %s", name, why)
            self._set_status(name, jobs[name], JobStatus("rejected", REJECTED_EXIT, why, now))
        for name in got.wait:
            status = jobs[name].status
            if status is None or status.state != "queued":
                self._set_status(name, jobs[name], JobStatus(
                    "queued", None, "waiting for admission: the running jobs need every GPU"
                    if self.admission.max_running is None else
                    "waiting for admission (cluster full or --max-running reached)", now))
        self._admitted_now = set(got.admit)
        admitted = set(held) | self._admitted_now
        return [n for n in active if n in admitted]

    def _set_status(self, name: str, view: _JobView, status: JobStatus,
                    guard: list[Compare] | None = None) -> bool:
        """Write a job's status unless it changed since this round read it (a launcher's
        cancel, a node agent's start), the job is gone or we no longer lead (and
        ``guard``). True if written."""
        guard = [*(guard or ()), keys.job_exists(name, view.spec_created),
                 Compare(keys.job(name, "status"), "mod_revision", "==", view.status_revision)]
        if self._lease:
            guard += [Compare(keys.LEADER, "create_revision", "==", self.term)]
        if not self.store.txn(guard, [Put(keys.job(name, "status"), encode_msg(status))]):
            log.info("job %s: its status changed meanwhile (or it is gone); decided again "
                     "next round", name)
            return False
        return True

    def _speedup(self, name: str, view: _JobView) -> SpeedupFn | None:
        """Memoised per job and hints timestamp: each fitted model is built once and its
        goodput memo table reused across rounds (its throughput function beside it)."""
        stamp = view.hints.timestamp if view.hints else -1.0
        cached = self._memo.get(name)
        if cached is None or cached[0] != stamp:
            models = (self._checked_model(name, view.hints, view.hints_revision)
                      if view.hints else (None, None))
            cached = (stamp, *models)
            self._memo[name] = cached
        return cached[1]

    def _checked_model(self, name: str, hints: JobHints, revision: int
                       ) -> tuple[SpeedupFn | None, SpeedupFn | None]:
        """The job's speedup and throughput functions, if they give finite values where
        the policy will look; else None (the job is scheduled as if it had reported no
        model yet), said once. Hints come from the job's own rank 0: they must never stop
        the scheduler."""
        try:
            fns = (model_speedup(hints), model_throughput(hints))
            for fn in fns:
                if fn is not None:
                    probe = np.asarray(fn(np.array([1, 1, 2, 8]), np.array([1, 2, 4, 64])))
                    if probe.shape != (4,) or not np.all(np.isfinite(probe)):
                        raise ValueError("non-finite speedup")
            return fns
        except (ArithmeticError, ValueError) as exc:
            self.values.bad(keys.job(name, "hints"), revision,
                            f"its throughput model cannot be used ({exc})")
            return None, None

    def _with_grace(self, present: list[NodeInfo], allocs: list[Allocation | None],
                    now: float) -> list[NodeInfo]:
        """``present`` plus the missing nodes still within their grace period, offered
        with only the slots their jobs hold there (they keep them; nothing new goes
        there). Missing time counts only while this coordinator reads the store."""
        held: dict[str, int] = {}
        for alloc in allocs:
            for node in alloc.nodes if alloc else ():
                held[node] = held.get(node, 0) + 1
        if self._store_lost:  # we could not look: nobody was seen missing meanwhile
            self._missing = {n: now if t > _DEAD else t for n, t in self._missing.items()}
            self._store_lost = False
        names = {n.name for n in present}
        for node in present:
            self._known[node.name] = node
            if self._missing.pop(node.name, None) is not None:
                log.info("node %s is back", node.name)
        out = list(present)
        for name in sorted((set(self._known) | set(held)) - names):
            since = self._missing.setdefault(name, now)
            if since == now:
                log.warning("node %s is missing; its jobs keep it for %.0f s", name,
                            self.node_grace)
            if now - since < self.node_grace:
                if held.get(name):  # (its type too: a job's replicas there stay typed)
                    known = self._known.get(name, NodeInfo(name, 0))
                    out.append(NodeInfo(name, held[name], known.address, now,
                                        gpu_type=known.gpu_type))
                continue
            if since > _DEAD:
                log.warning("node %s missing for %.0f s: presumed dead", name, now - since)
            self._known.pop(name, None)
            self._missing[name] = _DEAD  # logged once; forgotten when it returns
        return sorted(out, key=lambda n: n.name)

    def _read_nodes(self) -> list[NodeInfo]:
        nodes = []
        for kv in self.store.get_prefix(keys.NODES):
            node = self.values.read(NodeInfo, kv.key, kv.value, kv.mod_revision)
            if node is not None and keys.node(node.name) != kv.key:
                self.values.bad(kv.key, kv.mod_revision, f"names another node, {node.name!r}")
            elif node is not None and node.slots > 0:
                nodes.append(node)
        return sorted(nodes, key=lambda n: n.name)

    def _optimize(self, infos: list[JobInfo], free: list[PolicyNode], current: np.ndarray,
                  types: list[str], specs: list[JobSpec | None]) -> np.ndarray:
        """The policy's allocation; on nodes of several GPU types, or for jobs that name
        the types they may use, one type per job (policy/gpu_types.py), each type's nodes
        allocated by an engine of its own (its warm start kept per type)."""
        allowed = [frozenset(s.gpu_types) if s is not None else frozenset() for s in specs]
        if len(set(types)) <= 1 and not any(allowed):
            return self.policy.optimize(infos, free, current)
        for t in set(types) - set(self._typed):  # (made once: a deep copy is no per-round work)
            self._typed[t] = copy.deepcopy(self.policy)
        engines = {t: self._typed[t].optimize for t in set(types)}
        return typed_allocation(engines, infos, free, current, types, allowed)

    def _read_drains(self) -> set[str]:
        """The nodes an operator drains (``pollux-run drain``)."""
        out = set()
        for kv in self.store.get_prefix(keys.DRAINS):
            drain = self.values.read(NodeDrain, kv.key, kv.value, kv.mod_revision)
            if drain is not None and keys.drain(drain.node) == kv.key:
                out.add(drain.node)
        return out

    def _read_jobs(self) -> dict[str, _JobView]:
        jobs: dict[str, _JobView] = {}
        kinds = {"spec": JobSpec, "status": JobStatus, "hints": JobHints, "allocation": Allocation,
                 "generation": JobGeneration}
        for kv in self.store.get_prefix(keys.JOBS):
            split = keys.split_job_key(kv.key)
            if split is not None and split[1].startswith(_RDZV):  # (most keys: inline)
                leaf = split[1]
                if leaf.startswith(_WORKERS):
                    jobs.setdefault(split[0], _JobView()).workers[leaf[len(_WORKERS):]] = kv
                elif leaf.endswith(_STATE):
                    _note_state(jobs.setdefault(split[0], _JobView()), leaf, kv)
                continue
            if split is not None and split[1].startswith(keys.FINISHED):
                jobs.setdefault(split[0], _JobView()).finished[kv.key] = kv.value
                continue
            if split is None or split[1] not in kinds:
                continue
            if split[1] == "spec":
                self._read_spec(jobs.setdefault(split[0], _JobView()), split[0], kv)
                continue
            if split[1] == "generation":  # (completion.py reads it as text)
                jobs.setdefault(split[0], _JobView()).finished[kv.key] = kv.value
            value = self.values.read(kinds[split[1]], kv.key, kv.value, kv.mod_revision)
            if value is None and split[1] == "allocation":
                # a malformed allocation: the last good one we know, else "placed nowhere
                # known" with a version above any it can have had (versions grow by one
                # per write of the key, revisions by one per write of any key), so that
                # the next allocation written supersedes it everywhere
                value = self._good.get(split[0]) or Allocation(kv.mod_revision, ())
            elif split[1] == "allocation":
                self._good[split[0]] = value
            if value is not None:
                view = jobs.setdefault(split[0], _JobView())
                setattr(view, split[1], value)
                if split[1] == "hints":
                    view.hints_revision = kv.mod_revision
                elif split[1] == "status":
                    view.status_revision = kv.mod_revision
        return jobs

    def _read_spec(self, view: _JobView, name: str, kv: KeyValue) -> None:
        """The job's spec into ``view``, with its key's revisions; a spec that cannot be
        decoded, or that names another job, is logged once and its reason kept."""
        view.spec_created, view.spec_revision = kv.create_revision, kv.mod_revision
        try:
            spec = decode(JobSpec, kv.value)
        except MessageError as exc:
            view.refused = str(exc)
        else:
            if spec.name == name:
                view.spec = spec
                return
            view.refused = f"it names another job, {spec.name!r}"
        self.values.bad(kv.key, kv.mod_revision, view.refused)

    # -- the service -----------------------------------------------------------------
    def serve(self, stop: threading.Event) -> None:
        """Campaign for leadership; while leader, schedule every interval and on events."""
        while not stop.is_set():
            try:
                if self._campaign():
                    self._lead(stop)
                else:
                    rev = self.store.revision()
                    self.store.wait(keys.LEADER, rev, timeout=min(1.0, self.lease_ttl / 3))
            except StoreError as exc:
                log.warning("coordinator: store problem (%s); retrying", exc)
                self._store_lost = True
                stop.wait(1.0)
            except Exception:  # a bug must not take the cluster's scheduler down: say it
                log.exception("coordinator: unexpected error; resigning and retrying in 5 s")
                self._resign()
                stop.wait(5.0)
        self._resign()

    def _campaign(self) -> bool:
        lease = self.store.lease_grant(self.lease_ttl)
        if self.store.create(keys.LEADER, json.dumps(self.name), lease=lease):
            held = self.store.get(keys.LEADER)
            if held is None or held.lease != lease:  # lost it at once (lease lapsed)
                self.store.lease_revoke(lease)
                return False
            self._lease, self.term = lease, held.create_revision
            log.info("coordinator %s is the leader (term %d)", self.name, self.term)
            return True
        self.store.lease_revoke(lease)
        held = self.store.get(keys.LEADER)
        if held is not None and held.lease == 0:  # nobody keeps it alive: it never ends
            log.warning("coordinator/leader holds %r under no lease; taking over",
                        held.value[:80])
            self.store.txn([Compare(keys.LEADER, "mod_revision", "==", held.mod_revision)],
                           [Delete(keys.LEADER)])
        return False

    def _lead(self, stop: threading.Event) -> None:
        keeper = self.store.keep_alive(self._lease, self.lease_ttl / 3)
        try:
            next_round = 0.0
            rev = self.store.revision()
            self._deposed = False
            while not stop.is_set() and not keeper.expired.is_set() and not self._deposed:
                if self.clock() >= next_round:
                    rev = self.store.revision()
                    self.schedule_once()
                    next_round = self.clock() + self.interval
                timeout = max(0.0, min(next_round - self.clock(), self.lease_ttl / 3))
                events = self.store.wait("", rev, timeout=timeout)
                if events:
                    rev = max(e.revision for e in events)
                if any(self._triggers_round(e) for e in events):
                    stop.wait(self.settle)  # batch a burst of arrivals into one round
                    next_round = 0.0
        finally:
            keeper.stop()
            if self._deposed:  # someone else's value holds the key: campaign again
                self._resign()

    def _resign(self) -> None:
        if self._lease:
            try:
                self.store.lease_revoke(self._lease)
            except StoreError:
                pass
            self._lease = 0

    def _triggers_round(self, event: Event) -> bool:
        """Jobs submitted or finished, a job's first hints with a goodput model (until
        then its speedup is a guess), a new replica request of a job's policies, nodes
        that join, leave or change size, or free a slot (a leaving worker exited); not a
        node's workers merely starting."""
        if event.key.startswith(keys.DRAINS):
            return True
        if event.key.startswith(keys.NODES):
            if event.kind == "delete":
                return True
            try:
                node = decode(NodeInfo, event.value)
            except MessageError:
                return False  # logged when the round reads it
            known = self._known.get(node.name)
            return (known is None or known.slots != node.slots
                    or sum(node.workers.values()) < sum(known.workers.values()))
        split = keys.split_job_key(event.key)
        if split is None:
            return False
        job, part = split
        if part == "hints" and event.kind == "put":
            try:
                hints = decode(JobHints, event.value)
            except MessageError:
                return False  # logged when the round reads it
            wanted = (hints.min_replicas_wanted, hints.max_replicas_wanted)
            if self._wanted.get(job, (None, None)) != wanted:  # a policy's new request
                self._wanted[job] = wanted
                return True
            if (job not in self._modelled and hints.perf_params is not None
                    and hints.grad_sqr is not None):
                self._modelled.add(job)
                return True
        if part == "spec" and event.kind == "delete":
            self._modelled.discard(job)
            self._wanted.pop(job, None)
        return part in ("spec", "status")


def _as_scheduled(view: _JobView, adopted: bool) -> JobSpec:
    """The job's spec as the policy must take it: kept where it is (not preemptible) in
    the round that adopts it, and while its script has completed on some worker but not
    on all (``completion.py``): a change then would restart or shrink the group that is
    finishing."""
    assert view.spec is not None
    if adopted or (view.finished
                   and completion(view.spec, view.allocation, view.finished).begun):
        return dataclasses.replace(view.spec, preemptible=False)
    return view.spec


def _note_state(view: _JobView, leaf: str, kv: KeyValue) -> None:
    """Keep ``kv`` if it is the state of the job's highest formed round so far (``leaf``:
    its key below ``jobs/<job>/``, ``rdzv/rounds/<r:08d>/state``); decoded only when
    used. (The last formed round: rank 0 writes a round's state when it forms, and the
    pointer ``rdzv/round`` is never behind it.)"""
    number = leaf[len(_ROUNDS):-len(_STATE)] if leaf.startswith(_ROUNDS) else ""
    if number.isascii() and number.isdigit() and len(number) < 19 and \
            int(number) > view.state_round:
        view.state_round, view.round_state = int(number), kv


def _held(placed: dict[str, Allocation | None]) -> dict[str, dict[str, int]]:
    """node -> job -> replicas the (unfinished) jobs' allocations place there (one pass
    over the allocations, not one per node)."""
    held: dict[str, dict[str, int]] = {}
    for name, alloc in placed.items():
        for node in alloc.nodes if alloc else ():
            per = held.setdefault(node, {})
            per[name] = per.get(name, 0) + 1
    return held


def _capacity(node: NodeInfo, allocated: dict[str, int]) -> int:
    """The slots of ``node`` the policy may hand out: its own, less those still held by
    workers its agent runs beyond what their (unfinished) job's allocation places there
    (``allocated``: job -> replicas there, ``_held``) - but never fewer than those
    allocations already hold there within its slots (they are the policy's starting
    point; a node that became smaller, e.g. by ``--host-discovery-script``, makes the
    policy shrink what it runs)."""
    leaving = sum(max(0, int(k) - allocated.get(job, 0)) for job, k in node.workers.items())
    return max(node.slots - leaving, min(sum(allocated.values()), node.slots))


def _created(kv: KeyValue | None) -> int:
    return kv.create_revision if kv is not None else 0


def _replicas(alloc: Allocation | None) -> int:
    return alloc.num_replicas if alloc else 0


def _next_version(old: Allocation | None) -> int:
    return old.version + 1 if old else 1


def _placement(old: tuple[str, ...], row: np.ndarray, names: list[str]) -> tuple[str, ...]:
    """Node names per replica for a matrix row, keeping surviving replicas in their old
    order (so the rendezvous keeps their ranks) and appending new ones."""
    row = np.asarray(row)
    if len(row) != len(names):
        raise ValueError(f"allocation row of {len(row)} nodes for {len(names)} nodes")
    # the nodes it uses, in node order (only those: a row is mostly zeros on a big cluster)
    left = {names[i]: int(row[i]) for i in np.flatnonzero(row > 0)}
    kept = []
    for node in old:
        if left.get(node, 0) > 0:
            kept.append(node)
            left[node] -= 1
    for name, k in left.items():
        kept.extend([name] * k)
    return tuple(kept)


def _describe(alloc: Allocation) -> str:
    if not alloc.nodes:
        return "none"
    counts: dict[str, int] = {}
    for node in alloc.nodes:
        counts[node] = counts.get(node, 0) + 1
    return ", ".join(f"{n}x{k}" for n, k in counts.items())

"""The live rendezvous: a job's workers move through numbered rounds and re-form their
``torch.distributed`` process group in place at each one.

A worker's life::

    rdzv = Rendezvous(store, "job1", worker="w0", node="node-a")   # or Rendezvous.from_env()
    info = rdzv.next_round()                     # first round: blocks until it forms
    state = sync_state(state, info) or state     # newcomers receive the survivors' state
    while training:
        if rdzv.should_rescale():                # every step; no store access
            info = rdzv.next_round()             # raises WorkerRemoved: exit 0
            ...
        try:
            step(); commit.commit()
        except RuntimeError:                     # a peer died in a collective
            info = rdzv.next_round(); commit.restore(); ...

Who moves a job to a new round (compare-and-swap on ``jobs/<job>/rdzv/round``, so of
everyone who sees the same reason exactly one bumps it and the rest join):

* a newer ``Allocation`` than the round serves - whoever sees it first (a survivor's
  watcher, a waiting newcomer);
* a member's failure - the first survivor that calls ``next_round`` while the job is
  still at the round it formed (after a collective raised, or after its watcher saw a
  member's lease vanish). Such a *failure round* keeps the allocation and waits only for
  the survivors that are still alive; a later allocation from the coordinator simply
  opens the round after it;
* a vacancy - a worker that is not in the formed round although the allocation has a
  free slot on its node (a replacement for a dead worker, or one wrongly presumed dead)
  opens a *membership round* to get in. A worker is removed (``WorkerRemoved``, exit 0)
  only when a newer round formed without it and the allocation has no room for it.

Each round's rank 0 (the first survivor in the old rank order, see
``rounds.plan_round``) closes it: when everyone it ranks has joined (or the join timeout
passes) it hosts a fresh TCPStore and writes the round's state; the others read it and
connect. Every worker holds one lease (TTL ``lease_ttl``) kept alive from a thread, so
a SIGKILLed worker's keys vanish within one TTL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pollux_launch import env as envvars
from pollux_launch.errors import PolluxError
from pollux_launch.messages import (
    Allocation,
    JobHints,
    JobRestarts,
    MessageError,
    ValueLog,
    decode,
    encode,
)
from pollux_launch.output_marks import announce_rank

from .network import transport_env
from .process_group import (
    Group,
    default_backend,
    destroy_group,
    form_group,
    host_store,
    vote_each,
)
from .rounds import (
    JobKeys,
    Member,
    RoundInfo,
    RoundState,
    WorkerInfo,
    check_name,
    plan_round,
)
from .sever import sever
from .store import (
    Compare,
    Delete,
    KeepAlive,
    KeyValue,
    LeaseExpired,
    Put,
    Store,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
)
from .store.environ import store_from_env

log = logging.getLogger(__name__)
M = TypeVar("M")

# Environment a launched worker finds (set by pollux-run's node agent; pollux_launch.env).
ENV_STORE, ENV_PREFIX, ENV_JOB = envvars.STORE, envvars.PREFIX, envvars.JOB
ENV_NODE, ENV_WORKER_ID, ENV_ADDR = envvars.NODE, envvars.WORKER_ID, envvars.ADDR


class RendezvousError(PolluxError, RuntimeError):
    """The rendezvous cannot go on; the message says what is wrong and how to fix it."""


class RendezvousTimeout(RendezvousError):
    """A round did not fill (or no round came) within the join timeout."""


class WorkerRemoved(PolluxError):
    """This worker is not part of the job's new round: it should exit with status 0.
    Its lease is already revoked and its process group destroyed."""


@dataclass(frozen=True)
class RendezvousConfig:
    """Knobs of the protocol.

    ``lease_ttl``: seconds after which a dead worker's keys vanish (failures are noticed
    within it); ``join_timeout``: how long a round may take to fill; ``min_workers``: the
    fewest members a round may form with once the timeout passed (None: an allocation
    round must fill completely, a failure round needs one); ``collective_timeout``: the
    process group's timeout, which bounds a collective stuck on a hung peer; ``backend``:
    None picks nccl with a GPU else gloo; ``addr``: the address peers reach this worker
    on (None: ``POLLUX_ADDR`` or the host name's address); ``watch_timeout``: how long one
    watch call blocks before the watcher re-checks its lease; ``grow_grace``: when an
    allocation grows, survivors keep training until the new workers have registered
    (started and imported their framework) or this many seconds passed, so that their
    pause covers forming the group, not starting processes.
    """

    lease_ttl: float = 5.0
    join_timeout: float = 300.0
    min_workers: int | None = None
    collective_timeout: float = 60.0
    backend: str | None = None
    addr: str | None = None
    watch_timeout: float = 1.0
    grow_grace: float = 60.0

    def __post_init__(self) -> None:
        for name in ("lease_ttl", "join_timeout", "collective_timeout", "watch_timeout",
                     "grow_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"rendezvous option {name} must be a positive number of "
                                 f"seconds, got {value!r}")
        if self.min_workers is not None and (
                isinstance(self.min_workers, bool) or not isinstance(self.min_workers, int)
                or self.min_workers < 1):
            raise ValueError(f"rendezvous option min_workers must be an int >= 1 or None, "
                             f"got {self.min_workers!r}")
        if self.backend not in (None, "gloo", "nccl", "mpi", "ucc"):
            raise ValueError(f"rendezvous option backend must be gloo, nccl or None (auto), "
                             f"got {self.backend!r}")


@dataclass(frozen=True)
class GroupInfo:
    """The round this worker is in and its place there."""

    round: int
    rank: int
    world_size: int
    members: tuple[str, ...]
    alloc_version: int
    reason: str
    newcomers: tuple[str, ...]
    backend: str
    master_addr: str
    master_port: int
    nodes: tuple[str, ...] = ()  # each member's node, rank order

    @property
    def local_rank(self) -> int:
        """This worker's index among the members on its node (e.g. its GPU index)."""
        return self.nodes[: self.rank].count(self.nodes[self.rank]) if self.nodes else 0

    @property
    def local_world_size(self) -> int:
        return self.nodes.count(self.nodes[self.rank]) if self.nodes else 1

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes)) or 1

    @property
    def needs_state_sync(self) -> bool:
        """True when rank 0 must broadcast the training state: newcomers joined (the
        first round included), or a failure may have left survivors one step apart."""
        return bool(self.newcomers) or self.reason == "failure"

    @property
    def holders(self) -> list[int]:
        """The ranks that carry the job's training state: the survivors of the last
        round (a newcomer receives it from one of them, ``share_state``)."""
        fresh = set(self.newcomers)
        return [r for r, w in enumerate(self.members) if w not in fresh]

    @property
    def fresh(self) -> bool:
        """No member carries training state: all are newcomers (the job's first round,
        or a restart after every worker died) - the state comes from a checkpoint or
        from scratch."""
        return set(self.members) <= set(self.newcomers)


_AGAIN, _WAIT, _IDLE = "again", "wait", "idle"

# next_round's hand-off: (old group's members, new round's members, this worker)
HandOff = Callable[[tuple[str, ...], tuple[str, ...], str], None]


class Rendezvous:
    """One worker's side of a job's rendezvous (see the module docstring).

    ``store`` is passed in (``owns_store`` closes it with the rendezvous). The constructor
    registers the worker under its lease and starts two daemon threads: the lease
    keep-alive and a watcher that raises the local rescale flag read by ``poll`` and
    ``should_rescale``.
    """

    def __init__(self, store: Store, job: str, worker: str | None = None,
                 node: str | None = None, config: RendezvousConfig | None = None,
                 owns_store: bool = False) -> None:
        self.store, self.config, self.owns_store = store, config or RendezvousConfig(), owns_store
        self.keys = JobKeys(job)
        self._values = ValueLog(log)
        self.job = job
        self.node = check_name("node name", node or socket.gethostname())
        self.worker = check_name(
            "worker id", worker or f"{self.node}-{os.getpid()}-{secrets.token_hex(3)}")
        self.addr = self.config.addr or os.environ.get(ENV_ADDR) or _default_addr()
        self.backend = self.config.backend or default_backend()
        # bind the transports to the interface carrying this worker's own address, for
        # every round alike (the node agent sets these already; a process started
        # otherwise derives them here); what the user set is kept
        for name, value in transport_env(self.addr).items():
            os.environ.setdefault(name, value)
        self.info: GroupInfo | None = None
        self.group: Group | None = None
        self._round, self._rank = 0, -1
        self._lock = threading.Lock()
        self._flag = threading.Event()
        self._stop = threading.Event()
        self._latest_alloc = self._latest_round = 0
        self._alloc_size, self._alloc_seen = 0, 0.0  # latest allocation's replicas, when seen
        self._live: set[str] = set()  # registered workers of the job
        self._dead: set[str] = set()
        # members whose lease lapsed around a store outage, and when they count as dead if
        # they have not registered again (see _gone)
        self._doubted: dict[str, float] = {}
        # lost hosts (sever.py): when the watcher's store calls last started succeeding,
        # each worker's address, and the (round, address) pairs already cut
        self._store_ok_since: float | None = time.monotonic()
        self._addr_of: dict[str, str] = {}
        self._lost: set[str] = set()  # workers whose lease lapsed while we saw the store
        self._severed: set[tuple[int, str]] = set()
        self._keeper: KeepAlive | None = None
        self._lease = 0
        self._lease_lock = threading.Lock()
        self._registered = threading.Event()  # a (new) lease was granted since the last look
        self._hosted: tuple[int, Any] | None = None  # (round, TCPStore) this worker hosts
        self._teardown: threading.Thread | None = None  # the old group being destroyed
        self._hand_off: HandOff | None = None  # next_round's, until the round is known
        self._closed = False
        wait = _StoreWait(job, self.config.join_timeout)
        while True:  # a store that stalls as a newcomer starts: wait, within the join timeout
            try:
                self._register()
                rev = store.revision()
                break
            except StoreUnavailable as exc:
                if wait.again(exc):
                    continue
                self._close_store()
                raise RendezvousError(f"cannot join job {job!r}: {_line(exc)}") from None
            except StoreError as exc:
                self._close_store()
                raise RendezvousError(f"cannot join job {job!r}: {_line(exc)}") from None
        self._watcher = threading.Thread(target=self._watch, args=(rev,), daemon=True,
                                         name=f"pollux-rdzv-watch-{self.worker}")
        self._watcher.start()

    @classmethod
    def from_env(cls, config: RendezvousConfig | None = None,
                 env: Mapping[str, str] | None = None, **store_options: Any) -> Rendezvous:
        """The rendezvous of a worker started by ``pollux-run`` (``POLLUX_STORE`` and the
        rest of ``pollux_launch.env``'s store contract, TLS and the job's credentials
        included; ``POLLUX_JOB``, ``POLLUX_NODE``, ``POLLUX_WORKER_ID``);
        ``store_options`` go to ``open_store`` too (e.g. ``timeout``)."""
        env = os.environ if env is None else env
        missing = [k for k in (ENV_STORE, ENV_JOB) if not env.get(k)]
        if missing:
            raise RendezvousError(
                f"{' and '.join(missing)} not set: start workers with pollux-run, or set "
                f"{ENV_STORE}=embedded:///path/store.db and {ENV_JOB}=<job name>")
        wait = _StoreWait(env[ENV_JOB], (config or RendezvousConfig()).join_timeout)
        while True:  # unreachable now (a stall, a restart) is not a reason to give up yet
            try:
                store = store_from_env(env, **store_options)
                break
            except StoreUnavailable as exc:
                if not wait.again(exc):
                    raise RendezvousError(
                        f"{ENV_STORE}={env[ENV_STORE]!r}: {_line(exc)}") from None
            except StoreError as exc:
                raise RendezvousError(f"{ENV_STORE}={env[ENV_STORE]!r}: {_line(exc)}") from None
        return cls(store, env[ENV_JOB], env.get(ENV_WORKER_ID), env.get(ENV_NODE), config,
                   owns_store=True)

    # -- the per-step check ----------------------------------------------------------------

    def poll(self) -> bool:
        """This worker's own view: a new allocation, a newer round or a dead member was
        seen. Costs a flag read; the store is watched from a thread."""
        return self._flag.is_set()

    def should_rescale(self) -> bool:
        """Collective: True on every rank iff any rank's ``poll()`` is True, so all ranks
        leave the step loop at the same step (one 4-byte gloo all-reduce; raises like any
        collective when a peer died)."""
        return self.vote(False)[0]

    def vote(self, ending: bool) -> tuple[bool, bool]:
        """Collective: ``should_rescale()`` and whether any rank is ``ending`` (e.g. it got
        SIGTERM), in the same all-reduce; raises like ``should_rescale``."""
        rescale, end = vote_each((self._flag.is_set(), ending), self.group)
        return rescale, end

    # -- rounds ----------------------------------------------------------------------------

    def next_round(self, hand_off: HandOff | None = None) -> GroupInfo:
        """Leave the current process group, enter the job's next round and form its group.

        Call it at start-up, when ``should_rescale()`` says so, or after a collective
        raised (a dead peer). Returns the new ``GroupInfo``; raises ``WorkerRemoved`` when
        this worker is not in the new round, ``RendezvousTimeout`` when the round does not
        fill in time, ``RendezvousError`` for a malformed store value or a store error.

        ``hand_off(old_members, new_members, worker)``: keep the current group until the
        new round is known and call this on it first - every member of the old group, in
        the new round or not, calls it with the same arguments (sharded state moves to
        the new round's survivors there, ``rendezvous.reshard``). Not called for a round
        formed after a failure (the old group is broken) nor on a worker without a group.
        """
        if self._closed:
            raise RendezvousError(f"worker {self.worker}: the rendezvous is closed")
        started = time.monotonic()
        self._hand_off = hand_off if self.group is not None and self.info is not None else None
        if self._hand_off is None:
            self._leave_group(background=True)
        cfg = self.config
        entered: dict[int, float] = {}
        while True:
            try:
                rev = self.store.revision()
                try:
                    step = self._attempt(entered)
                except LeaseExpired:  # our keys are gone: register again, then look again
                    self._ensure_lease(force=True)
                    self._full_check()  # (maybe a new store: what we knew of the old is void)
                    continue
            except StoreUnavailable as exc:
                if time.monotonic() - started > cfg.join_timeout:
                    raise RendezvousError(f"job {self.job!r}: store unreachable for "
                                          f"{cfg.join_timeout:g} s: {_line(exc)}") from None
                time.sleep(0.2)
                continue
            except StoreError as exc:
                raise RendezvousError(f"job {self.job!r}: {_line(exc)}") from None
            log.debug("worker %s: %s at %.3f s", self.worker,
                      f"round {step.round} formed" if isinstance(step, RoundState) else step,
                      time.monotonic() - started)
            if isinstance(step, RoundState):
                self._hand_off_to(step)
                info = self._form(step)
                if info is not None:
                    return info
            elif step in (_WAIT, _IDLE):
                if step == _IDLE and time.monotonic() - started > cfg.join_timeout:
                    raise RendezvousTimeout(
                        f"job {self.job!r}: worker {self.worker} found no round to join within "
                        f"{cfg.join_timeout:g} s (is the job allocated? does its allocation "
                        f"name node {self.node!r}?); raise join_timeout to wait longer")
                try:
                    self.store.wait(self.keys.prefix, rev, timeout=0.25)
                except StoreCompacted:
                    pass
                except StoreUnavailable:
                    time.sleep(0.2)

    def await_newcomers(self) -> None:
        """A newcomer's side of the grow wait (the survivors' is ``_awaiting_newcomers``):
        call before the first ``next_round``; waits, at most ``grow_grace``, until every
        worker the allocation asks for has registered, so that the running replicas pause
        once, briefly, for all newcomers together. Store trouble ends the wait: the round
        itself reports it properly."""
        deadline = time.monotonic() + self.config.grow_grace
        while time.monotonic() < deadline:
            try:
                rev = self.store.revision()
                kv = self.store.get(self.keys.allocation)
                want = self._decode(Allocation, kv).num_replicas if kv else 0
                if want and len(self.store.get_prefix(self.keys.workers)) >= want:
                    return
                self.store.wait(self.keys.prefix, rev,
                                timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except (StoreError, RendezvousError):
                return

    def _attempt(self, entered: dict[int, float]) -> RoundState | str:
        """One look at the store: bump, join or close a round. Returns the RoundState to
        form, _AGAIN (look again now), _WAIT (in an open round: wait for a change) or _IDLE
        (no round for this worker yet: wait for a change)."""
        cfg, k = self.config, self.keys
        snap = {kv.key: kv for kv in self.store.get_prefix(k.prefix)}  # one read per look
        ptr_kv = snap.get(k.round)
        alloc_kv = snap.get(k.allocation)
        # a malformed allocation is no news (said once): the round in force stands
        alloc = (self._values.read(Allocation, alloc_kv.key, alloc_kv.value,
                                   alloc_kv.mod_revision) if alloc_kv else None)
        if ptr_kv is None:
            if self._round > 0:  # we were in a round: the store lost the job's rendezvous
                self._reseed()
                return _AGAIN
            if alloc is None:
                return _IDLE
            self._bump(None, None, None, alloc.version, alloc.nodes, "allocation")
            return _AGAIN
        ptr = self._decode(RoundInfo, ptr_kv)
        r = ptr.round
        state_kv = snap.get(k.state(r))
        state = self._decode(RoundState, state_kv) if state_kv else None
        if r > self._round and state is not None and self.worker in state.members:
            # formed with this worker in it: its other members wait for us in the group's
            # init, so join it even if a newer allocation came meanwhile (bumping past it
            # would leave them blocked there for the collective timeout); the formed group
            # sees the allocation at once and moves on at its next step
            return state
        if alloc is not None and alloc.version > ptr.alloc_version:
            self._bump(ptr_kv, ptr, state, alloc.version, alloc.nodes, "allocation")
            return _AGAIN
        if r < self._round:
            raise RendezvousError(f"job {self.job!r}: the store's round {r} is older than this "
                                  f"worker's round {self._round}; was the store wiped?")
        if r == self._round:  # nobody moved on: re-form without the failed member(s)
            self._bump(ptr_kv, ptr, state, ptr.alloc_version, ptr.nodes, "failure")
            return _AGAIN
        if state is not None:
            if self.worker in state.members:
                return state
            if self._vacancy(ptr, state, snap):  # allocated but not in the group: get in
                self._bump(ptr_kv, ptr, state, ptr.alloc_version, ptr.nodes, "membership")
                return _AGAIN
            if self._round > 0:
                self._hand_off_to(state)
                self._leave_job(departed=True)
                raise WorkerRemoved(
                    f"worker {self.worker} is not in round {r} of job {self.job!r} "
                    f"(allocation version {state.alloc_version}, {len(state.members)} "
                    "workers): leaving")
            return _IDLE  # a newcomer not (yet) allocated: wait for a later round

        if not ptr.nodes:  # the job was allocated nothing: everyone leaves
            if self._round > 0:
                self._leave_job(departed=True)
                raise WorkerRemoved(f"job {self.job!r} has no replicas in allocation version "
                                    f"{ptr.alloc_version}: worker {self.worker} leaving")
            return _IDLE

        # round r is open: join it, then see whether it is ready to close
        members = [(self._decode(Member, kv), kv.create_revision)
                   for key, kv in snap.items() if key.startswith(k.members(r))]
        if self.worker not in {m.worker for m, _ in members}:
            rec = self._member()
            rev = self.store.put(k.member(r, self.worker), encode(rec), lease=self._lease)
            members.append((rec, rev))  # the put's revision is the key's create_revision
        entered.setdefault(r, time.monotonic())
        joined = [(m.worker, m.node, rev) for m, rev in members]
        alive = {w.worker: w.node for w in (self._decode(WorkerInfo, kv) for key, kv in
                                             snap.items() if key.startswith(k.workers))}
        if ptr.reason == "allocation" and any(
                w not in alive and w not in {j[0] for j in joined} for w in ptr.prev_members):
            # a survivor died before this round formed: it can never fill as planned, so
            # re-open it as a failure round (same allocation; late newcomers fill vacancies)
            self._bump(ptr_kv, ptr, None, ptr.alloc_version, ptr.nodes, "failure")
            return _AGAIN
        plan = plan_round(ptr, joined, alive)
        waited = time.monotonic() - entered[r]
        grace = cfg.join_timeout + cfg.lease_ttl + 1
        if plan.ready:
            ranked = plan.ranked
        elif waited > cfg.join_timeout:
            ranked = plan_round(ptr, joined, {}).ranked  # only those who did join
            need = cfg.min_workers or (len(ptr.nodes) if ptr.reason == "allocation" else 1)
            if len(ranked) < need:
                if not ranked or ranked[0] == self.worker or waited > grace:
                    raise RendezvousTimeout(self._timeout_message(ptr, joined, need))
                return _WAIT
        else:
            return _WAIT
        if ranked[0] != self.worker:  # rank 0 closes the round
            if waited > grace:
                raise RendezvousTimeout(
                    f"rendezvous round {r} of job {self.job!r}: its rank 0 ({ranked[0]}) did "
                    f"not close it within {grace:g} s; check that worker's log")
            return _WAIT
        if self._hosted is None or self._hosted[0] != r:
            self._hosted = (r, host_store(self.addr, len(ranked), self._store_timeout()))
        port = self._hosted[1].port
        prev = set(ptr.prev_members)
        node_of = {w: n for w, n, _ in joined}
        state = RoundState(r, ptr.alloc_version, ranked, self.addr, port, ptr.reason,
                           tuple(w for w in ranked if w not in prev), time.time(),
                           tuple(node_of[w] for w in ranked))
        ops: list[Put | Delete] = [Put(k.state(r), encode(state))]
        if ptr.prev_members and not set(ranked) & set(ptr.prev_members):
            ops.append(self._restarted(snap))  # nobody survived: training starts again
        if r > 2:  # keep the previous round for stragglers; drop the one before it
            ops.append(Delete(k.round_prefix(r - 2), prefix=True))
        ok = self.store.txn([Compare(k.round, "mod_revision", "==", ptr_kv.mod_revision),
                             Compare(k.state(r), "create_revision", "==", 0)], ops)
        return state if ok else _AGAIN

    def _restarted(self, snap: dict[str, KeyValue]) -> Put:
        """The job's restart record, one more restart and the progress it lost (the last
        progress its rank 0 reported)."""
        key, hints = self.keys.restarts, snap.get(self.keys.hints)
        old, lost = JobRestarts(0), 0.0
        try:
            if key in snap:
                old = decode(JobRestarts, snap[key].value)
            if hints is not None:
                lost = decode(JobHints, hints.value).progress
        except MessageError as exc:  # a bad record restarts the count, never the job
            log.warning("job %s: ignoring malformed restart record or hints: %s", self.job, exc)
        log.warning("job %s: every worker had died; training starts again (%.0f iterations "
                    "of progress lost)", self.job, lost)
        return Put(key, encode(JobRestarts(old.count + 1, old.lost_progress + lost, time.time(),
                                           old.resumed)))

    def credit_resumed(self, progress: float) -> None:
        """This job's latest restart resumed from a checkpoint at ``progress``: that much
        of what the restart record counts as lost was not lost (credited once per
        restart; a store problem leaves the record as it was, on the safe side)."""
        def credit(old: JobRestarts | None) -> JobRestarts | None:
            if old is None or old.resumed >= old.count:
                return None
            return JobRestarts(old.count, max(0.0, old.lost_progress - progress),
                               old.timestamp, old.count)
        self._edit_restarts(credit, "the resumed progress")

    def record_rollback(self, lost: float) -> None:
        """The job went back to a durable checkpoint in place (a failure took state no
        survivor held), losing ``lost`` progress: one more restart in the record, with
        that loss, already credited (a store problem leaves the record as it was)."""
        def rollback(old: JobRestarts | None) -> JobRestarts:
            old = old or JobRestarts(0)
            return JobRestarts(old.count + 1, old.lost_progress + max(0.0, lost), time.time(),
                               old.count + 1)
        self._edit_restarts(rollback, "the progress lost")

    def _edit_restarts(self, change: Callable[[JobRestarts | None], JobRestarts | None],
                       what: str) -> None:
        """One compare-and-swap of the job's restart record: ``change`` turns the current
        one (None: none yet) into the new one (None: leave it); a store problem or a
        concurrent write leaves the record as it was."""
        key = self.keys.restarts
        try:
            kv = self.store.get(key)
            new = change(decode(JobRestarts, kv.value) if kv else None)
            if new is not None:
                self.store.txn([Compare(key, "mod_revision", "==", kv.mod_revision if kv else 0)],
                               [Put(key, encode(new))])
        except (MessageError, StoreError) as exc:
            log.warning("job %s: could not record %s: %s", self.job, what, exc)

    def _form(self, state: RoundState) -> GroupInfo | None:
        """Join the round's process group; None if that failed (a member died meanwhile)."""
        rank = state.members.index(self.worker)
        ws = len(state.members)
        hosted = self._hosted[1] if self._hosted and self._hosted[0] == state.round else None
        self._hosted = None
        self._join_teardown()
        try:
            group = form_group(self.backend, state.master_addr, state.master_port, rank, ws,
                               self.config.collective_timeout, hosted if rank == 0 else None)
        except (RuntimeError, ValueError, OSError) as exc:
            log.warning("job %s round %d: forming the group failed (%s); re-forming",
                        self.job, state.round, _line(exc))
            destroy_group()
            self._round, self._rank = state.round, rank  # the next attempt bumps past it
            return None
        log.debug("worker %s: round %d group formed (rank %d of %d)", self.worker, state.round,
                  rank, ws)
        info = GroupInfo(state.round, rank, ws, state.members, state.alloc_version,
                         state.reason, state.newcomers, self.backend, state.master_addr,
                         state.master_port, state.nodes)
        if self.info is None:  # its first round: from now on its failures are the job's
            _tell_agent(envvars.EXIT_JOINED, self.worker)
        with self._lock:
            self.group, self.info = group, info
            self._round, self._rank = state.round, rank
            self._flag.clear()
            self._update_flag()
        # what it prints from here on is this rank's: a marker its node agent's output
        # pump reads (nothing without an agent)
        announce_rank(rank)
        return info

    def _bump(self, ptr_kv: KeyValue | None, ptr: RoundInfo | None, state: RoundState | None,
              alloc_version: int, nodes: tuple[str, ...], reason: str) -> bool:
        """Open the round after ``ptr`` if nobody else did since it was read."""
        if ptr is None:
            prev_round, prev_members, r = 0, (), 1
        elif state is not None:
            prev_round, prev_members, r = ptr.round, state.members, ptr.round + 1
        else:
            prev_round, prev_members, r = ptr.prev_round, ptr.prev_members, ptr.round + 1
        info = RoundInfo(r, alloc_version, tuple(nodes), reason, prev_round, prev_members,
                         time.time())
        rev = ptr_kv.mod_revision if ptr_kv else 0
        # join the new round in the same transaction: one store round trip less
        return self.store.txn([Compare(self.keys.round, "mod_revision", "==", rev)],
                              [Put(self.keys.round, encode(info)),
                               Put(self.keys.member(r, self.worker), encode(self._member()),
                                   lease=self._lease)])

    def _vacancy(self, ptr: RoundInfo, state: RoundState, snap: dict[str, KeyValue]) -> bool:
        """Whether formed round ``state`` leaves a replica slot free on this worker's node
        (after a failure, or when this worker was wrongly presumed dead). A member whose
        lease is gone holds no slot: its node agent starts a replacement only for a
        process that really ended."""
        used = 0
        for i, w in enumerate(state.members):
            if self.keys.worker(w) not in snap:
                continue  # dead (its lease lapsed): its slot is free, e.g. every worker died
            if state.nodes:
                used += state.nodes[i] == self.node
                continue
            kv = snap.get(self.keys.member(ptr.round, w))
            if kv is None or self._decode(Member, kv).node == self.node:
                used += 1  # unknown counts as used: never over-fill a node
        return ptr.nodes.count(self.node) > used

    def _member(self) -> Member:
        return Member(self.worker, self.node, self.addr, os.getpid(), self._round, self._rank)

    # -- store reads -------------------------------------------------------------------------

    def _decode(self, cls: type[M], kv: KeyValue) -> M:
        try:
            return decode(cls, kv.value)
        except MessageError as exc:
            raise RendezvousError(f"malformed value at store key {kv.key!r} ({exc}); fix or "
                                  "delete that key") from None

    def _timeout_message(self, ptr: RoundInfo, joined: list, need: int) -> str:
        nodes = sorted({n for _, n, _ in joined})
        return (f"rendezvous round {ptr.round} of job {self.job!r}: {len(joined)} worker(s) "
                f"joined (on nodes {nodes}) but {need} are needed for allocation version "
                f"{ptr.alloc_version} (nodes {sorted(set(ptr.nodes))}) within "
                f"{self.config.join_timeout:g} s; start the missing workers, or raise "
                "join_timeout / lower min_workers")

    def _store_timeout(self) -> float:
        # how long connecting to a round's TCPStore may take before the round is re-formed
        return min(self.config.collective_timeout, max(5.0, 2 * self.config.lease_ttl))

    # -- lease and watcher -------------------------------------------------------------------

    def _ensure_lease(self, force: bool = False) -> None:
        """Register again if the lease was lost (its keys are gone: others may already
        have re-formed without this worker, which then finds itself removed); the
        watcher then reads the store afresh (``_registered``)."""
        with self._lease_lock:
            if force or self._keeper is None or self._keeper.expired.is_set():
                log.warning("worker %s: lease lost; registering again", self.worker)
                self._register()

    def _register(self) -> None:
        """Grant a lease, publish the worker under it and keep it alive."""
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        self._lease = self.store.lease_grant(self.config.lease_ttl)
        rec = WorkerInfo(self.worker, self.node, self.addr, os.getpid(), time.time())
        self.store.put(self.keys.worker(self.worker), encode(rec), lease=self._lease)
        self._keeper = self.store.keep_alive(self._lease, self.config.lease_ttl / 3)
        self._registered.set()  # (the watcher looks afresh: see _watch)

    def _watch(self, rev: int) -> None:
        """Thread: follow the job's keys and raise the rescale flag; never dies on store
        trouble (the current group keeps training while the store is away)."""
        need_full = True
        while not self._stop.is_set():
            try:
                # a lost lease may mean a new, empty store, whose revisions start again:
                # look afresh rather than wait for a revision it may not reach for long
                self._ensure_lease()
                if self._registered.is_set():  # registered again (here or by the main thread)
                    self._registered.clear()
                    need_full = True
                if need_full:
                    rev = self._full_check()
                    need_full = False
                events = self.store.wait(self.keys.prefix, rev, self.config.watch_timeout)
                if self._store_ok_since is None:
                    self._store_ok_since = time.monotonic()
                with self._lock:
                    for ev in events:
                        rev = max(rev, ev.revision)
                        self._on_event(ev.kind, ev.key, ev.value)
                    self._update_flag()
                self._cut_lost_hosts()
            except StoreCompacted:
                need_full = True
            except StoreError:
                need_full = True
                self._store_ok_since = None  # leases lapsing now may be the store's doing
                self._stop.wait(min(1.0, self.config.watch_timeout))
            except Exception:  # keep the watcher alive whatever a backend throws
                log.exception("worker %s: rendezvous watcher error", self.worker)
                need_full = True
                self._stop.wait(1.0)

    def _reseed(self) -> None:
        """The store lost the job's rendezvous (wiped, or replaced by a new one) while this
        worker is in a formed round: put that round back as the job's last formed one, so
        that the job goes on from it - its members keep their ranks and their training
        state - with allocation version 0, so that the coordinator's next allocation,
        whatever its version in the new store, is newer. Whoever of the members comes
        first does it (create-if-absent); raises StoreError like any store call."""
        with self._lock:
            info = self.info
            if info is None:
                return
            self.info = dataclasses.replace(info, alloc_version=0)
            self._latest_alloc, self._alloc_size = 0, 0
        k, now = self.keys, time.time()
        ptr = RoundInfo(info.round, 0, info.nodes, info.reason, timestamp=now)
        state = RoundState(info.round, 0, info.members, info.master_addr, info.master_port,
                           info.reason, (), now, info.nodes)
        if self.store.txn([Compare(k.round, "create_revision", "==", 0)],
                          [Put(k.round, encode(ptr)), Put(k.state(info.round), encode(state))]):
            log.warning("job %s: the store lost the job's rendezvous (wiped, or a new store); "
                        "put back round %d of %d worker(s) from worker %s", self.job,
                        info.round, info.world_size, self.worker)

    def _full_check(self) -> int:
        rev = self.store.revision()
        found = {kv.key: kv.value for kv in
                 (self.store.get(self.keys.allocation), self.store.get(self.keys.round)) if kv}
        if self.info is not None and self.keys.round not in found:
            self._reseed()  # (the store lost it: the watcher sees it first when one trains)
            found = {kv.key: kv.value for kv in (self.store.get(self.keys.allocation),
                                                 self.store.get(self.keys.round)) if kv}
        workers = self.store.get_prefix(self.keys.workers)
        live = {kv.key for kv in workers}
        with self._lock:
            # what the store holds now is the truth: a new, empty store's allocation and
            # rounds count from 1 again, and a version remembered from the old one would
            # raise the rescale flag at every step until the new one caught up
            known, seen = self._latest_alloc, self._alloc_seen
            self._latest_alloc = self._latest_round = self._alloc_size = 0
            for key, value in found.items():
                self._on_event("put", key, value)
            if self._latest_alloc == known:
                self._alloc_seen = seen  # (the same allocation: its grow grace runs on)
            for kv in workers:
                self._on_event("put", kv.key, kv.value)
            members = self.info.members if self.info else ()
            self._dead = set()
            for w in members:
                if self.keys.worker(w) not in live:
                    self._gone(w)
            self._live = {key[len(self.keys.workers):] for key in live}
            self._update_flag()
        return rev

    def _on_event(self, kind: str, key: str, value: str) -> None:
        k = self.keys
        if key.startswith(k.workers):
            name = key[len(k.workers):]
            (self._live.discard if kind == "delete" else self._live.add)(name)
            if kind == "delete":
                self._gone(name)
                if self._store_ok_since is not None and (
                        time.monotonic() - self._store_ok_since > self.config.lease_ttl):
                    self._lost.add(name)  # it stopped refreshing while the store answered us
                return
            self._dead.discard(name)
            self._doubted.pop(name, None)
            self._lost.discard(name)
            try:
                self._addr_of[name] = decode(WorkerInfo, value).addr
            except MessageError as exc:
                log.warning("job %s: ignoring malformed worker record: %s", self.job, exc)
        elif kind != "put":
            return
        elif key == k.allocation:
            try:
                alloc = decode(Allocation, value)
                if alloc.version > self._latest_alloc:
                    self._latest_alloc, self._alloc_size = alloc.version, alloc.num_replicas
                    self._alloc_seen = time.monotonic()
            except MessageError as exc:
                log.warning("job %s: ignoring malformed allocation: %s", self.job, exc)
        elif key == k.round:
            try:
                self._latest_round = max(self._latest_round, decode(RoundInfo, value).round)
            except MessageError as exc:
                log.warning("job %s: ignoring malformed round record: %s", self.job, exc)

    def _gone(self, name: str) -> None:
        """Under the lock: worker ``name``'s key is gone (its lease lapsed or was revoked).
        While the store was out of reach or has just come back, a lapsed lease is likely the
        store's doing (keep-alives queued behind the stall land after the expiry): the
        worker counts as dead only if it has not registered again ``lease_ttl`` after the
        store answered again. Nothing is lost by waiting: a worker that really died breaks
        its group's next collective at once, which re-forms the round without the store."""
        since, now = self._store_ok_since, time.monotonic()
        if since is not None and now - since > self.config.lease_ttl:
            self._dead.add(name)
        else:
            self._doubted.setdefault(name, now + self.config.lease_ttl)

    def _cut_lost_hosts(self) -> None:
        """A host all of whose members lost their leases while this worker could reach the
        store is gone: cut this process's connections to it, so that a collective blocked
        on it fails now instead of after the collective timeout (``sever.py``)."""
        with self._lock:
            info = self.info
            # a newer round exists: the workers that left were removed by it (they revoke
            # their leases on leaving), not lost with their host
            if (info is None or self._latest_round > info.round
                    or not self._lost.intersection(info.members)):
                return
            by_addr: dict[str, list[str]] = {}
            for w in info.members:
                if w != self.worker and w in self._addr_of:
                    by_addr.setdefault(self._addr_of[w], []).append(w)
            gone = [a for a, ws in by_addr.items() if a != self.addr
                    and all(w in self._lost for w in ws) and (info.round, a) not in self._severed]
            self._severed.update((info.round, a) for a in gone)
        for addr in gone:
            log.warning("job %s: every worker at %s lost its lease; cutting %d connection(s) "
                        "to it", self.job, addr, sever(addr))

    def _update_flag(self) -> None:
        """Under the lock: raise the flag if the job has moved past our round."""
        now = time.monotonic()
        for name, deadline in list(self._doubted.items()):
            if now >= deadline:  # it did not register again: dead after all
                del self._doubted[name]
                self._dead.add(name)
        info = self.info
        if info is None:
            return
        if ((self._latest_alloc > info.alloc_version and not self._awaiting_newcomers(info))
                or self._latest_round > info.round or self._dead.intersection(info.members)):
            self._flag.set()

    def _awaiting_newcomers(self, info: GroupInfo) -> bool:
        """A grown allocation whose new workers have not all registered yet (the watcher
        re-checks every ``watch_timeout``, so the grace period ends on time)."""
        return (self._alloc_size > info.world_size and len(self._live) < self._alloc_size
                and time.monotonic() - self._alloc_seen < self.config.grow_grace)

    # -- leaving -----------------------------------------------------------------------------

    def _hand_off_to(self, state: RoundState) -> None:
        """``next_round``'s ``hand_off`` on the old group, once, then leave that group. A
        failure round skips it: a member of the old group is gone, the group broken."""
        fn, self._hand_off = self._hand_off, None
        if fn is None:
            return
        if state.reason != "failure":
            assert self.info is not None
            fn(self.info.members, state.members, self.worker)
        self._leave_group(background=True)

    def _leave_group(self, background: bool = False) -> None:
        """Destroy the process group; with ``background`` in a thread (tens of ms with
        gloo) while the store is consulted - ``_form`` joins it before the next group."""
        with self._lock:
            self.group = None
        self._join_teardown()
        if background:
            self._teardown = threading.Thread(target=destroy_group, daemon=True,
                                              name=f"pollux-rdzv-teardown-{self.worker}")
            self._teardown.start()
        else:
            destroy_group()

    def _join_teardown(self) -> None:
        if self._teardown is not None:
            self._teardown.join()
            self._teardown = None

    def _leave_job(self, departed: bool = False) -> None:
        """Stop the threads and revoke the lease (this worker's keys vanish now). With
        ``departed`` tell the node agent (``POLLUX_EXIT_FILE``) that this worker leaves
        because a round formed without it: its exit 0 is no completion of the job."""
        if departed:
            _tell_agent(envvars.EXIT_DEPARTED, self.worker)
        self._closed = True
        self._stop.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.config.watch_timeout + 2)
        if self._keeper is not None:
            try:
                self._keeper.stop(revoke=True)
            except StoreError as exc:  # the lease ends by itself after its TTL
                log.warning("worker %s: could not revoke its lease: %s", self.worker, _line(exc))
        self._leave_group()
        self._close_store()

    def _close_store(self) -> None:
        if self.owns_store:
            self.store.close()

    def close(self) -> None:
        """Leave the job: destroy the process group and revoke the lease. Idempotent."""
        if not self._closed:
            self._leave_job()

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tell_agent(word: str, worker: str) -> None:
    """Tell the node agent where this worker stands (``POLLUX_EXIT_FILE``, read when it
    exits): ``joined`` its job's group, or ``departed`` because a round formed without
    it (exit 0 is then no completion of the job)."""
    path = os.environ.get(envvars.EXIT_FILE)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(word + "\n")
    except OSError as exc:  # the agent then judges by the allocation, as before
        log.warning("worker %s: cannot write its exit file: %s", worker, exc)


class _StoreWait:
    """A starting worker's wait for an unreachable store (a stall, a restart), up to the
    join timeout: said once, then a retry every second."""

    def __init__(self, job: str, timeout: float) -> None:
        self.job, self.deadline, self.said = job, time.monotonic() + timeout, False

    def again(self, exc: BaseException) -> bool:
        """Whether to try again (after a pause); False once the timeout has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        if not self.said:
            self.said = True
            log.warning("job %s: store unreachable (%s); waiting for it up to %.0f s", self.job,
                        _line(exc), left)
        time.sleep(min(1.0, left))
        return True


def _line(exc: BaseException) -> str:
    """The first line of an exception's message (no traceback walls)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _default_addr() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


__all__ = [
    "GroupInfo", "Rendezvous", "RendezvousConfig", "RendezvousError", "RendezvousTimeout",
    "WorkerRemoved",
]

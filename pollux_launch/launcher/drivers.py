"""How a job's processes are run: one interface, one driver per kind of framework.

* ``replicas`` (:class:`ReplicaDriver`; live torch and DeepSpeed jobs): one worker
  process per allocated replica, started by the node agent of the node the allocation
  names; the workers re-form their group themselves (``pollux_launch.rendezvous``).
* ``restart`` (:class:`~.restart.RestartDriver`; restart-elastic and fixed torch and
  DeepSpeed jobs): the same workers, stopped and started again as a whole group on
  every new allocation or failure, torchrun's way.
* a framework's own drivers, registered by its adapter's launch side: Horovod's
  (``pollux_launch.adapters.horovod.launch``) run ONE Horovod Elastic driver per job
  where the job was launched (horovodrun's semantics), with a task driver on every node
  whose agent starts the workers that driver asks for.

A driver's ``side`` says who runs it: ``"node"`` drivers run in every node agent (for
the replicas placed on that node), ``"launcher"`` drivers in the ``pollux-run`` that
submitted the job (in local mode, its own node agent). :func:`driver_class` picks the
drivers a framework's :class:`~.frameworks.FrameworkLaunch` names from :data:`DRIVERS`
(one :class:`~pollux_launch.registry.Registry`; adapters plug in through the entry-point
group ``frameworks.PLUGINS``, so the launcher names none of them).

This module is the launcher's whole interface for a framework's driver (a plug-in such
as ``pollux_launch.adapters.horovod``): :class:`JobDriver` to subclass, the
:class:`DriverContext` it is given, :class:`ProcessExit` to report, :class:`WorkerGroup`
to run processes with (:class:`DevicesBusy` when no GPU is free for one),
:class:`OptionsError` for ``preflight`` and :func:`replica_limit`. A plug-in imports
these from here, nothing else of the launcher.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, ClassVar, Literal

from .. import env as envvars
from .. import keys
from ..arguments import OptionsError
from ..messages import MAX_REPLICAS, Allocation, JobSpec, MessageError, NodeInfo, ValueLog
from ..peer_failure import recorded_peer_failure
from ..registry import Registry
from ..rendezvous.network import transport_env
from ..rendezvous.rounds import JobKeys, last_formed
from ..rendezvous.store import Store, StoreError
from .devices import DevicePool, DevicesBusy
from .frameworks import PLUGINS, framework_launch, insert_local_rank
from .logs import job_log_file
from .workers import ExitKind, Worker, WorkerGroup, classify_exit

if TYPE_CHECKING:
    from .launch_options import LaunchOptions

__all__ = [
    "DRIVERS", "DevicesBusy", "DriverContext", "JobDriver", "OptionsError",
    "ProcessExit", "ReplicaDriver", "Side", "WorkerGroup", "driver_class", "driver_classes",
    "replica_limit",
]

Side = Literal["node", "launcher"]
# the longest back-off before a newcomer that failed before joining is started again
NEWCOMER_BACKOFF_MAX = 60.0

log = logging.getLogger(__name__)

# Environment a job's processes are started with (defined in pollux_launch.env).
ENV_STORE, ENV_PREFIX, ENV_JOB = envvars.STORE, envvars.PREFIX, envvars.JOB
ENV_NODE, ENV_WORKER_ID, ENV_ADDR = envvars.NODE, envvars.WORKER_ID, envvars.ADDR

#: driver name -> JobDriver subclass ("module:Class" strings are imported on first use, so
#: that the launcher never imports a framework it does not run). The launcher's own:
#: "replicas" and "restart" (below); a framework's adapter registers its own drivers and
#: names them in its ``frameworks.FrameworkLaunch`` (entry-point group ``PLUGINS``).
DRIVERS: Registry[type[JobDriver]] = Registry(
    "launcher driver", check=lambda e: isinstance(e, type) and issubclass(e, JobDriver),
    expects="a JobDriver subclass", lazy=True, plugins=PLUGINS)


@dataclass(frozen=True)
class DriverContext:
    """What a driver may use, passed in by the agent that runs it."""

    store: Store
    store_url: str
    store_prefix: str
    node: NodeInfo
    output_dir: str | None = None
    stdout: IO[str] | None = None
    options: LaunchOptions | None = None  # the launching pollux-run's flags (launcher side)
    local: bool = False  # single-machine mode: every host is this one
    ifname: str | None = None  # the operator's interface for this node (else: from address)
    runtime_dir: str | None = None  # the agent's private folder (workers' exit files)
    # job -> the store variables of the job's own scoped user ({} where none is needed)
    credentials: Callable[[str], dict[str, str]] | None = None
    log_dir: str | None = None  # where the node keeps its jobs' output (launcher/logs.py)
    devices: DevicePool | None = None  # the node's GPUs (None: it has none), devices.py

    def log_file(self, spec: JobSpec) -> str | None:
        """The file ``spec``'s output on this node goes to (for ``WorkerGroup``), if any."""
        return job_log_file(self.log_dir, spec)

    def worker_group(self, spec: JobSpec) -> WorkerGroup:
        """A group that runs ``spec``'s command as this node's workers of the job (its
        output to the node's log of the job, its GPUs from the node's pool)."""
        return WorkerGroup(spec.name, spec.command, spec.env, cwd=spec.workdir or None,
                           output_dir=self.output_dir, stdout=self.stdout,
                           log_file=self.log_file(spec), devices=self.devices)

    def job_env(self, spec: JobSpec) -> dict[str, str]:
        """The ``POLLUX_*`` variables every process of ``spec``'s job gets (with the
        job's own store user where the store has authentication); the
        transports bound to this node's interface (the agent's ``--network-interface``,
        else the job's, else the one carrying the node's address); and, as torchrun does,
        one node's share of OpenMP threads per slot unless the user set it."""
        env = {ENV_STORE: self.store_url, ENV_PREFIX: self.store_prefix, ENV_JOB: spec.name,
               ENV_NODE: self.node.name, ENV_ADDR: self.node.address}
        if self.credentials is not None:
            env.update(self.credentials(spec.name))
        if self.ifname or not any(k in spec.env or k in os.environ
                                  for k in envvars.TRANSPORT_IFNAME):
            env.update(transport_env(self.node.address, self.ifname))
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, self.node.slots)))
        return env


@dataclass(frozen=True)
class ProcessExit:
    """One of the job's processes ended: its id, exit code and what that means."""

    worker_id: str
    code: int
    kind: ExitKind
    detail: str = ""  # e.g. "rank 1: RuntimeError: ..." (from torchrun's error file)
    # the group it ran in, where the driver knows it (completion.generation; restart.py)
    generation: tuple[int, int, int] | None = None


class JobDriver(ABC):
    """Runs one job's processes on behalf of an agent (called from its loop only)."""

    side: ClassVar[Side]

    def __init__(self, spec: JobSpec, ctx: DriverContext) -> None:
        self.spec, self.ctx = spec, ctx

    @classmethod
    def preflight(cls) -> None:
        """Raise ``OptionsError`` (one line) if this driver cannot run here; called by
        ``pollux-run`` before anything starts."""
        return None

    @classmethod
    @abstractmethod
    def wanted(cls, alloc: Allocation | None, node: str) -> bool:
        """Whether an agent on ``node`` should create this driver for ``alloc``."""

    @abstractmethod
    def reconcile(self, alloc: Allocation | None, free_slots: int) -> int:
        """Start what the allocation asks for and is missing, but (a ``"node"`` driver) at
        most ``free_slots`` processes that hold a slot: the agent never runs more of them
        than the node has slots, whatever an allocation says. Returns how many it had to
        defer for want of a slot; OSError if one cannot start."""

    def slots_held(self) -> int:
        """How many of this node's slots the driver's live processes hold."""
        return 0

    @abstractmethod
    def reap(self, allocation: Callable[[], Allocation | None]) -> list[ProcessExit]:
        """Processes that ended since the last call (``allocation`` reads the current one)."""

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def stop(self, grace: float) -> None:
        """SIGTERM everything, SIGKILL what is left after ``grace`` seconds."""


class ReplicaDriver(JobDriver):
    """One worker per replica the allocation places on this node. A shrink is carried
    out by the rendezvous (removed workers exit 0 by themselves); a grow starts workers
    that join the job's next round."""

    side = "node"

    def __init__(self, spec: JobSpec, ctx: DriverContext) -> None:
        super().__init__(spec, ctx)
        self.group = ctx.worker_group(spec)
        self.values = ValueLog(log)  # a bad value is logged once per key and revision
        # newcomers that failed before joining, in a row, and when to start another
        self._strikes, self._retry_at = 0, -float("inf")

    @classmethod
    def wanted(cls, alloc: Allocation | None, node: str) -> bool:
        return alloc is not None and node in alloc.nodes

    def _want(self, alloc: Allocation | None) -> int:
        return alloc.nodes.count(self.ctx.node.name) if alloc else 0

    def reconcile(self, alloc: Allocation | None, free_slots: int) -> int:
        # every worker not reaped yet counts: one that ended since the agent reaped is
        # judged at the next reap (its job may have completed), never replaced blindly
        return self._start_missing(alloc, free_slots)

    def _start_missing(self, alloc: Allocation | None, free_slots: int,
                       restarts: int = 0) -> int:
        """Start the workers ``alloc`` places here beyond those running, as many as
        ``free_slots`` (and free GPUs) allow; returns how many wait for a slot."""
        running = len(self.group.workers)
        want = self._want(alloc)
        if time.monotonic() < self._retry_at:  # a newcomer failed before joining: back off
            return max(0, want - running)
        start = min(want, running + max(0, free_slots))
        # (their GPUs first, so that the workers started together see each other's; fewer
        # when another process of this machine holds some)
        start = running + self.group.reserve(start - running)
        try:
            for local_rank in range(running, start):
                self._start(alloc, local_rank, restarts)
        finally:
            self.group.unreserve()
        return max(0, want - start)

    def _start(self, alloc: Allocation | None, local_rank: int, restarts: int = 0):
        """Start the worker of ``local_rank`` in ``alloc`` (torchrun's variables for it)."""
        import uuid

        worker_id = f"{self.ctx.node.name}-{uuid.uuid4().hex[:8]}"
        extra = {**self.ctx.job_env(self.spec), **self._torch_env(alloc, local_rank, restarts),
                 ENV_WORKER_ID: worker_id}
        if self.ctx.runtime_dir:
            extra[envvars.EXIT_FILE] = self._exit_file(worker_id)
            extra["TORCHELASTIC_ERROR_FILE"] = self._error_file(worker_id)
        command = self.spec.command
        if self.spec.framework == "deepspeed":  # as the deepspeed launcher passes it
            command = insert_local_rank(command, local_rank)
        worker = self.group.start(worker_id, extra, label=extra.get("RANK"), command=command,
                                  local_rank=local_rank)
        self.started(worker, alloc)
        return worker

    def started(self, worker: Worker, alloc: Allocation | None) -> None:
        """Hook: ``worker`` of ``alloc`` has just started (RestartDriver notes its
        generation)."""

    def slots_held(self) -> int:
        return len(self.group.workers)  # (until reaped, an ended worker's slot is not free)

    def _exit_file(self, worker_id: str) -> str:
        return os.path.join(self.ctx.runtime_dir or "", f"{worker_id}.exit")

    def _error_file(self, worker_id: str) -> str:
        return self._exit_file(worker_id) + ".error.json"

    def failed(self, worker: Worker, code: int) -> ProcessExit:
        """A failed worker's exit: ``rank R`` and, if the script wrote torchrun's error file
        (``@record``), its error in one line. The file is the worker's: read as untrusted,
        bounded JSON. A worker whose file records an uncaught exception but that died by a
        signal ended in its interpreter's teardown (torch 2.13: gloo's threads abort a
        process that exits with its group still formed): its code is the exception's, 1,
        as the script's own ``python`` (and torchrun) would report it."""
        detail = f"rank {worker.label}"
        message = self._recorded_error(worker.worker_id)
        if message is not None:
            detail += ": " + message if message else ""
            if code < 0:
                code = 1
        return ProcessExit(worker.worker_id, code, "failed", detail)

    def _recorded_error(self, worker_id: str) -> str | None:
        """The error ``@record`` wrote for the worker (\"\" if it has no readable message),
        None when it wrote none."""
        if not self.ctx.runtime_dir:
            return None
        try:
            with open(self._error_file(worker_id), "rb") as f:
                body = json.loads(f.read(65536))
            message = body["message"]["message"] if isinstance(body["message"], dict) \
                else body["message"]
        except OSError:
            return None  # no error file: the exit code says what there is
        except (ValueError, KeyError, TypeError):
            return ""  # written, but not as torchrun writes it
        return " ".join(message.split())[:200] if isinstance(message, str) else ""

    def first_failures_first(self, ended: list[tuple[Worker, int]]) -> list[tuple[Worker, int]]:
        """``ended`` root causes first, as torchrun reports its first failure: a worker
        whose recorded error (``@record``) is a collective's failure caused by a peer
        comes after those whose is not, and within each the order they ended in (their
        output's end, or their error file if written earlier)."""
        def key(item: tuple[Worker, int]) -> tuple[bool, float]:
            worker = item[0]
            at = worker.ended_at if worker.ended_at is not None else float("inf")
            recorded = self._recorded_error(worker.worker_id)
            try:
                at = min(at, os.stat(self._error_file(worker.worker_id)).st_mtime)
            except OSError:
                pass  # no error file: its output's end says when it ended
            return bool(recorded) and recorded_peer_failure(recorded), at

        return sorted(ended, key=key) if self.ctx.runtime_dir else ended

    def _said(self, worker_id: str) -> str | None:
        """What the worker last told its agent through its exit file (read once, at its
        exit): ``EXIT_JOINED`` - it joined its job's group; ``EXIT_DEPARTED`` - it left
        because a new round formed without it, so exit 0 is a departure, never the job's
        success, whatever the allocation says by the time it is reaped; None: neither."""
        if not self.ctx.runtime_dir:
            return None
        path = self._exit_file(worker_id)
        try:
            with open(path) as f:
                said = f.read(64).strip()
            os.unlink(path)
        except OSError:
            return None
        return said

    def _survivors(self, worker_id: str) -> list[str]:
        """The live members of the job's last formed round other than ``worker_id``: those
        who carry the job on without it (one read of the job's rendezvous keys)."""
        k = JobKeys(self.spec.name)
        values = {kv.key: kv.value for kv in self.ctx.store.get_prefix(k.rdzv)}
        try:
            formed = last_formed(k, values)
        except MessageError:
            return []  # (the rendezvous says so in its workers' logs)
        return [w for w in formed.members if w != worker_id and k.worker(w) in values] \
            if formed is not None else []

    def _never_joined(self, worker: Worker, code: int) -> ProcessExit | None:
        """A live job's worker that failed before it ever joined the job's group (e.g. a
        newcomer that could not reach the store as it started) while others carry the job
        on: lost, not the job's failure - it is started again after a back-off that
        doubles with each such failure in a row. None where that is not the case."""
        try:
            survivors = self._survivors(worker.worker_id)
        except StoreError:
            survivors = []  # cannot tell: the failure is the job's, as before
        if not survivors:
            return None
        now = time.monotonic()
        self._strikes = self._strikes + 1 if now - self._retry_at < NEWCOMER_BACKOFF_MAX \
            else 1
        wait = min(NEWCOMER_BACKOFF_MAX, 2.0 ** self._strikes)
        self._retry_at = now + wait
        log.warning("job %s: worker %s exited %d before it joined the job, which goes on "
                    "with %d worker(s); starting another in %.0f s", self.spec.name,
                    worker.worker_id, code, len(survivors), wait)
        return ProcessExit(worker.worker_id, code, "lost",
                           f"rank {worker.label}: exited {code} before joining the job")

    def _torch_env(self, alloc: Allocation | None, local_rank: int,
                   restarts: int = 0) -> dict[str, str]:
        """torchrun's variables for the allocation a worker starts in (and the group's
        ``restarts`` after failures), so that a script using plain
        ``init_process_group("env://")``, ``@record`` or ``TORCHELASTIC_*`` runs as under
        torchrun. Adapted scripts re-read them from each rendezvous round
        (``adapters.torch.job``)."""
        if alloc is None:
            return {}
        me = self.ctx.node.name
        nodes = list(dict.fromkeys(alloc.nodes))  # in allocation order
        before = sum(alloc.nodes.count(n) for n in nodes[: nodes.index(me)])
        master = self.ctx.node.address
        if nodes[0] != me:
            kv = self.ctx.store.get(keys.node(nodes[0]))
            info = self.values.read(NodeInfo, kv.key, kv.value, kv.mod_revision) if kv else None
            if info is not None:  # else (gone, or malformed: logged) this node's address
                master = info.address
        rank, world = str(before + local_rank), str(alloc.num_replicas)
        return {
            "RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(alloc.nodes.count(me)),
            "GROUP_RANK": str(nodes.index(me)), "GROUP_WORLD_SIZE": str(len(nodes)),
            "ROLE_NAME": "default", "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world,
            "MASTER_ADDR": master, "MASTER_PORT": str(self.master_port(alloc, restarts)),
            "TORCHELASTIC_RESTART_COUNT": str(restarts),
            "TORCHELASTIC_MAX_RESTARTS": str(self.spec.max_restarts),
            "TORCHELASTIC_RUN_ID": self.spec.name,
            # rank 0 hosts the group's store itself (there is no torchrun agent store)
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }

    def master_port(self, alloc: Allocation, restarts: int = 0) -> int:
        """One port per job, allocation and restart, the same on every node (a group
        started again never meets its predecessor's store)."""
        text = f"{self.spec.name}/{alloc.term}/{alloc.version}/{restarts}"
        # below Linux's ephemeral ports (32768-60999): an outgoing connection never holds it
        return 20000 + zlib.crc32(text.encode()) % 12000

    def reap(self, allocation: Callable[[], Allocation | None]) -> list[ProcessExit]:
        ended = self.group.reap()
        if not ended:
            return []
        # read the allocation afresh: a worker that left because of a rescale exited
        # after the new allocation was written, perhaps after the caller's last read
        still_allocated = self._want(allocation()) > len(self.group.alive())
        said = {w.worker_id: self._said(w.worker_id) for w, _ in ended}
        out = []
        for w, code in self.first_failures_first(ended):
            departed = said[w.worker_id] == envvars.EXIT_DEPARTED
            kind = classify_exit(code, still_allocated and not departed)
            joined = said[w.worker_id] is not None
            lost = (self._never_joined(w, code) if kind in ("failed", "lost") and not joined
                    else None)
            out.append(lost if lost is not None else self.failed(w, code) if kind == "failed"
                       else ProcessExit(w.worker_id, code, kind))
        return out

    def alive(self) -> bool:
        return bool(self.group.alive())

    def stop(self, grace: float) -> None:
        self.group.stop(grace=grace)


def replica_limit(spec: JobSpec) -> int | None:
    """The most replicas ``spec``'s job may have, None when ``pollux-run`` was given no
    ``--max-np`` (then a framework's own launcher must not be capped either)."""
    return None if spec.max_replicas >= MAX_REPLICAS else spec.max_replicas


def driver_classes(framework: str, elasticity: str = "live") -> list[type[JobDriver]]:
    """The drivers that run ``framework``'s jobs of that kind of elasticity, the primary
    one first (frameworks nobody registered: one worker per replica)."""
    launch = framework_launch(framework)
    return [DRIVERS.get(name) for name in (launch.live if elasticity == "live"
                                           else launch.restart)]


def driver_class(framework: str, elasticity: str = "live") -> type[JobDriver]:
    """``framework``'s primary driver (the one ``pollux-run`` preflights)."""
    return driver_classes(framework, elasticity)[0]


DRIVERS.register("replicas", ReplicaDriver)
DRIVERS.register("restart", "pollux_launch.launcher.restart:RestartDriver")  # (imports us)

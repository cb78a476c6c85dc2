"""Horovod workers on other hosts, started by those hosts' node agents instead of ssh.

Horovod's elastic gloo launcher (``horovod.runner.gloo_run.launch_gloo_elastic``, 0.28.1)
takes the function that executes one worker's command on a host. Ours,
:class:`StoreExec`, runs in the job's launcher-side driver and hands the worker to the
node agent of that host through the store:

1. it writes ``jobs/<job>/tasks/<task>`` (``WorkerTask``: node, Horovod's variables, the
   job's command) and waits on ``jobs/<job>/exits/<task>``;
2. the node agent of that node (:class:`HorovodTaskDriver`) runs the task's command with
   the job's signed environment, Horovod's variables and its own interface, and writes
   ``TaskExit`` when the process ends;
3. when Horovod's driver stops a worker (a host removed, a reset, the job's end) it sets
   one of the worker's events: :class:`StoreExec` deletes the task and the agent stops
   the process (SIGTERM, then SIGKILL).

A node agent runs a task only for a job whose spec it trusts (signed, when the cluster
has a secret), only with that spec's command, and takes only Horovod's own variables
(``HOROVOD_*``) from the task: nothing a store writer adds can run anything else.

Horovod 0.28.1 binds ``HOROVOD_GLOO_IFACE`` for its global, local and cross contexts but
not for the process-set contexts it creates at every ``init`` (``InitializeForProcessSet``
builds its device from an interface it never set, so gloo falls back to the address the
host name resolves to). Across hosts, each host's name must therefore resolve to its
cluster address; the node agent says so once when it does not.
"""

from __future__ import annotations

import functools
import logging
import shlex
import signal
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from pollux_launch import keys
from pollux_launch.launcher.drivers import (
    DriverContext,
    JobDriver,
    ProcessExit,
)
from pollux_launch.messages import (
    Allocation,
    JobSpec,
    MessageError,
    TaskExit,
    ValueLog,
    WorkerTask,
    decode,
    encode,
)
from pollux_launch.rendezvous.store import Put, Store, StoreError

from .hosts import read_allocation
from .local_run import LocalRun

log = logging.getLogger(__name__)

# How long a stopped worker's node agent gets to report its exit before the worker is
# taken for lost (an agent that is up answers within a poll or two).
STOP_WAIT = 30.0
# A worker whose node is gone, as its exit code: lost with it (local_run.lost), not failed.
LOST = 128 + signal.SIGKILL


def task_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a node takes from a task: Horovod's own, nothing else."""
    return {k: v for k, v in env.items() if k.startswith("HOROVOD_")}


def split_command(text: str, command: Sequence[str]) -> dict[str, str]:
    """Horovod's worker command line (``env K=V ... <command>``) -> its variables.
    Raises ValueError if it does not end with ``command``."""
    tokens = shlex.split(text)
    if tokens[:1] == ["env"]:
        tokens = tokens[1:]
    n = len(command)
    if n == 0 or tokens[-n:] != list(command):
        raise ValueError(f"Horovod's worker command does not end with the job's: {text[:200]!r}")
    env = {}
    for token in tokens[:-n]:
        name, sep, value = token.partition("=")
        if not sep:
            raise ValueError(f"unexpected word {token!r} before the job's command")
        env[name] = value
    return env


class StoreExec:
    """Horovod's ``exec_command(command, slot_info, events) -> (exit_code, time)``.

    With ``run`` (:class:`~.local_run.LocalRun`), Horovod's hosts are its per-slot names:
    each is run on the node it names, and its worker's exit code is recorded there (lost
    or failed decides what its end costs the job)."""

    def __init__(self, store: Store, job: str, command: Sequence[str],
                 run: LocalRun | None = None, poll: float = 0.5) -> None:
        self.store, self.job, self.command, self.poll = store, job, tuple(command), poll
        self.run = run
        self.values = ValueLog(log)  # malformed allocations: said once per revision

    def __call__(self, text: str, slot_info, events) -> tuple[int, float]:
        code = self._run(text, slot_info, events)
        if self.run is not None:
            self.run.exit_codes[slot_info.hostname] = code
        return code, time.time()

    def _run(self, text: str, slot_info, events) -> int:
        name = slot_info.hostname
        node = self.run.names.node_of(name) if self.run is not None else name
        env = task_variables(split_command(text, self.command))
        task = f"{name}-{slot_info.local_rank}-{uuid.uuid4().hex[:8]}"
        msg = WorkerTask(node, self.command, env, slot_info.rank)
        self._retry(lambda: self.store.put(keys.job(self.job, f"tasks/{task}"), encode(msg)))
        stopped = 0.0
        while True:
            code = self._exit(task)
            if code is not None:
                break
            if self._host_lost(node):
                log.warning("worker %s: its node %s is gone; taken for lost", task,
                            node)
                code = LOST  # as ssh would report a dead host, then lost with it
                break
            if not stopped and any(e.is_set() for e in events or ()):
                stopped = time.monotonic()  # Horovod stops this worker: the agent ends it
                self._retry(lambda: self.store.delete(keys.job(self.job, f"tasks/{task}")))
            if stopped and (time.monotonic() - stopped > STOP_WAIT
                            or not self._node_alive(node)):
                # its host is gone (the coordinator's grace period has passed by the time
                # Horovod drops it) or its agent never answers: the worker is lost with it
                log.warning("worker %s on %s: no exit reported; taken for lost", task,
                            node)
                code = LOST
                break
            time.sleep(self.poll)
        self._retry(lambda: self.store.delete(keys.job(self.job, f"tasks/{task}")))
        self._retry(lambda: self.store.delete(keys.job(self.job, f"exits/{task}")))
        return code

    def _exit(self, task: str) -> int | None:
        try:
            kv = self.store.get(keys.job(self.job, f"exits/{task}"))
            return decode(TaskExit, kv.value).code if kv else None
        except MessageError as exc:
            log.warning("ignoring malformed exit of %s: %s", task, exc)
            return 1
        except StoreError:  # unreachable for now: the worker runs on
            return None

    def _node_alive(self, node: str) -> bool:
        try:
            return self.store.get(keys.node(node)) is not None
        except StoreError:
            return True  # we cannot tell: do not presume it dead

    def _host_lost(self, node: str) -> bool:
        """The node's agent is gone and the coordinator, after its grace period, took the
        node out of the job's allocation: nobody will ever report this worker's exit."""
        try:
            alloc = read_allocation(self.store, self.job, self.values)
        except (StoreError, MessageError):  # we cannot tell: do not presume it lost
            return False
        return alloc is not None and node not in alloc.nodes and not self._node_alive(node)

    def _retry(self, op: Callable[[], object]) -> None:
        while True:
            try:
                op()
                return
            except StoreError as exc:  # e.g. etcd restarting: the worker is not lost for it
                log.warning("store unavailable (%s); retrying", exc)
                time.sleep(1.0)


class HorovodTaskDriver(JobDriver):
    """Node side: run the Horovod workers that the job's launcher asks this node for."""

    side = "node"

    def __init__(self, spec: JobSpec, ctx: DriverContext) -> None:
        super().__init__(spec, ctx)
        self.group = ctx.worker_group(spec)
        self.values = ValueLog(log)
        _check_hostname(ctx.node.address)

    @classmethod
    def wanted(cls, alloc: Allocation | None, node: str) -> bool:
        return alloc is not None and node in alloc.nodes

    def _tasks(self) -> dict[str, WorkerTask]:
        out = {}
        prefix = keys.job(self.spec.name, "tasks/")
        for kv in self.ctx.store.get_prefix(prefix):
            task = self.values.read(WorkerTask, kv.key, kv.value, kv.mod_revision)
            task_id = kv.key[len(prefix):]
            if task is not None and not keys.NAME.fullmatch(task_id):
                self.values.bad(kv.key, kv.mod_revision, "its task id is not a valid name")
            elif task is not None and task.node == self.ctx.node.name:
                out[task_id] = task
        return out

    def reconcile(self, alloc: Allocation | None, free_slots: int) -> int:
        tasks = self._tasks()
        running = {w.worker_id for w in self.group.alive()}
        for task_id in running - set(tasks):  # its launcher stopped it
            self.group.stop(grace=5.0, only=[task_id])
        new = []
        for task_id, task in tasks.items():
            if task_id in self.group.workers or self._reported(task_id):
                continue
            if tuple(task.command) != tuple(self.spec.command):
                log.error("job %s: task %s asks for another command than the job's; refused",
                          self.spec.name, task_id)
                self._report(task_id, 126)
                continue
            node_env = self.ctx.job_env(self.spec)
            env = {**node_env, **task_variables(task.env)}
            if "HOROVOD_GLOO_IFACE" in node_env:  # this node's interface, not the launcher's
                env["HOROVOD_GLOO_IFACE"] = node_env["HOROVOD_GLOO_IFACE"]
            new.append((task.index, task_id, env))
        # Horovod's driver waits for those it cannot start now: they start once a slot (and
        # a GPU) is free, lowest ranks first. Each is a Horovod host of its own (local rank
        # 0: local_run's per-slot names), so its own GPU comes first in what it sees.
        new.sort(key=lambda t: (t[0], t[1]))
        start = self.group.reserve(min(len(new), max(0, free_slots)))
        try:
            for _, task_id, env in new[:start]:
                local = env.get("HOROVOD_LOCAL_RANK", "")
                self.group.start(task_id, env, label=env.get("HOROVOD_RANK"),
                                 local_rank=int(local) if local.isdigit() else None)
        finally:
            self.group.unreserve()
        return len(new) - start

    def slots_held(self) -> int:
        return len(self.group.workers)  # (until reaped, an ended worker's slot is not free)

    def _reported(self, task_id: str) -> bool:
        return self.ctx.store.get(keys.job(self.spec.name, f"exits/{task_id}")) is not None

    def _report(self, task_id: str, code: int) -> None:
        self.ctx.store.txn([keys.job_exists(self.spec.name)], [Put(  # (not for a job gone)
            keys.job(self.spec.name, f"exits/{task_id}"), encode(TaskExit(code)))])

    def reap(self, allocation: Callable[[], Allocation | None]) -> list[ProcessExit]:
        out = []
        for worker, code in self.group.reap():
            self._report(worker.worker_id, 128 - code if code < 0 else code)
            # the job's outcome is its launcher's (Horovod's driver reads this exit)
            out.append(ProcessExit(worker.worker_id, code, "departed"))
        return out

    def alive(self) -> bool:
        return bool(self.group.alive())

    def stop(self, grace: float) -> None:
        self.group.stop(grace=grace)


@functools.cache
def _check_hostname(address: str) -> None:
    """Warn once when this host's name resolves to loopback but its node does not."""
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        resolved = ""
    if resolved != address and (resolved.startswith("127.") or not resolved) and \
            not address.startswith("127."):
        log.warning("host name %s resolves to %r, not this node's address %s: Horovod 0.28.1 "
                    "binds that address for its process-set contexts, so Horovod workers "
                    "here cannot reach other hosts; make it resolve to %s (e.g. /etc/hosts)",
                    socket.gethostname(), resolved, address, address)


def env_for_tasks(base: Mapping[str, str]) -> dict[str, str]:
    """The environment Horovod copies into every worker's command line: none of the
    launcher's own (a node takes only ``HOROVOD_*`` from a task anyway)."""
    return {k: v for k, v in base.items() if k.startswith("HOROVOD_")}


__all__ = ["HorovodTaskDriver", "StoreExec", "env_for_tasks", "split_command",
           "task_variables"]

"""``pollux-run [flags] COMMAND...``: submit one job and drive it to completion.

Two modes, chosen by the store:

* **Local** (embedded store, the default): this process is the whole cluster for its
  job - it registers this machine as a node (its GPUs, each worker holding one, or CPU
  cores, or ``-H localhost:N`` slots), runs a coordinator candidate (several ``pollux-run`` on one
  machine share one leader through the store) and a node agent for its own job. The
  job's spec lives under this process's lease, so a killed launcher frees its slots.
  Its agent keeps the job's output in the user's local log folder (``logs.py``:
  ``local_log_dir``), where ``pollux-run logs`` reads it, during the run and after.
* **Cluster** (``--store etcd://...``): the spec is signed and submitted; node agents
  run the workers and the coordinator service schedules; this process follows the job
  and prints its status until it ends.

How the job's processes run is its framework's driver (:mod:`.drivers`): one worker per
replica started by the node agents (torch, DeepSpeed), or - for Horovod - one
``horovodrun`` per job run right here (in local mode by this process's node agent, in
cluster mode by a launcher-side agent that registers no node), as horovodrun itself
would; its host list follows the job's allocation and its exit code is the job's.

Either way it prints a compact status line whenever the job's state changes and exits
with the job's exit code.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import IO, TypeVar

from .. import env as envvars
from .. import keys
from ..calibration import load_rescale_cost
from ..coordinator.service import Coordinator
from ..messages import (
    MAX_REPLICAS,
    REJECTED_EXIT,
    Allocation,
    JobHints,
    JobSpec,
    JobStatus,
    MessageError,
    NodeInfo,
    ValueLog,
    checked,
    encode,
)
from ..policy import DEFAULT_POLICY, make_policy
from ..policy.rescale_cost import DEFAULT_STATE_BYTES
from ..rendezvous.network import advertised_address
from ..rendezvous.store import Compare, Delete, Put, Store, StoreError, open_store
from ..rendezvous.store.cli_args import DEFAULT_URL
from . import security
from .devices import detect_gpus, gpu_type, node_slots
from .discovery import DiscoveryError, HostDiscovery
from .drivers import driver_class
from .hosts import LOCAL_NAMES
from .logs import LogFollower, make_local_log_dir
from .node_agent import NodeAgent
from .options import SPEC_FLAGS, LaunchOptions, OptionsError
from .status import describe_allocation, describe_hints, describe_kind

log = logging.getLogger(__name__)
M = TypeVar("M")

# How long agents accept a submitted spec for starting workers: bounds the replay of a
# signed spec (admission.py); a job running longer gets no new workers after it.
SPEC_TTL = 30 * 24 * 3600.0
FIRST_REPORT = "waiting for the first report"
WAITING = frozenset({describe_allocation(None), FIRST_REPORT})
WAIT_SAID_AFTER = 5.0  # s: a job placed within this never says it waited


def local_gpus(opts: LaunchOptions) -> tuple[str, ...]:
    """This machine's GPUs for its workers: ``--gpus``, else those it has."""
    return opts.gpus if opts.gpus is not None else detect_gpus()


def local_slots(opts: LaunchOptions, gpus: tuple[str, ...] = ()) -> int:
    """This machine's slots: -H/--hostfile if given (local names only; at most one per
    GPU), else its GPUs, or its cores when it has none."""
    if opts.hosts is not None:
        remote = [h.name for h in opts.hosts if h.name not in LOCAL_NAMES]
        if remote:
            raise OptionsError(
                f"host {remote[0]!r} is not this machine: for several machines run "
                "`pollux-run agent --store etcd://...` on each and pass --store etcd://...")
        return node_slots(gpus, sum(h.slots for h in opts.hosts), "-H")
    return node_slots(gpus, None)


def slots_warning(spec: JobSpec, slots: int) -> str | None:
    """What a job's replica bounds mean on a machine of ``slots`` slots, where that is
    not what they say (e.g. torchrun's ``--nnodes 1:2 --nproc-per-node 2`` on 2 slots:
    2..4 replicas that can only ever be 2), or None."""
    if spec.elasticity == "fixed" or not slots < spec.max_replicas < MAX_REPLICAS:
        return None  # (MAX_REPLICAS: no maximum given, "as many as there are")
    said = f"up to {spec.max_replicas} replicas, but this machine has {slots} slot(s)"
    if spec.min_replicas < slots:
        return f"{said}: it runs at most {slots} here"
    return (f"{said}, and it never goes below {spec.min_replicas}: it runs at "
            f"{spec.min_replicas} and other jobs here wait until it ends (a smaller "
            "minimum lets it make room: --min-np, or --nnodes 1:N with fewer "
            "--nproc-per-node)")


def _discovery(opts: LaunchOptions, local: bool) -> HostDiscovery | None:
    """``--host-discovery-script``'s poller (local mode only: in a cluster the hosts are
    the node agents registered in the store)."""
    if opts.host_discovery_script is None:
        return None
    if not local:
        raise OptionsError("--host-discovery-script: in a cluster the hosts are the node "
                           "agents registered in the store; start `pollux-run agent` on a "
                           "host to add it (drop the flag)")
    return HostDiscovery(opts.host_discovery_script, opts.slots_per_host)


def discovered_slots(discovery: HostDiscovery) -> int:
    """This machine's slots by a first run of the discovery script (one-line errors)."""
    try:
        found, others = discovery.discover()
    except DiscoveryError as exc:
        raise OptionsError(str(exc)) from None
    if others:
        raise OptionsError(f"--host-discovery-script lists {others[0]!r}, which is not this "
                           "machine: for several machines run `pollux-run agent --store "
                           "etcd://...` on each and pass --store etcd://...")
    return found


def launch(opts: LaunchOptions, stdout: IO[str] | None = None,
           signals: list[int] | None = None) -> int:
    """Run the job; returns its exit code. Raises OptionsError / StoreError on bad input.
    ``signals``: where the caller's handlers put the SIGINT/SIGTERM it received (its
    job is cancelled at the first, whenever it came: see :func:`_follow`)."""
    stdout = stdout or sys.stdout
    driver = driver_class(opts.framework, opts.elasticity)
    driver.preflight()  # e.g. Horovod not installed: one line, before anything starts
    url = opts.store or DEFAULT_URL
    local = url.startswith("embedded")
    if not local and opts.gpus is not None:
        raise OptionsError("--gpus: in a cluster every node agent declares its own GPUs "
                           "(`pollux-run agent --gpus ...`); drop the flag here")
    discovery = _discovery(opts, local)
    gpus = local_gpus(opts) if local else ()
    slots = (discovered_slots(discovery) if discovery else local_slots(opts, gpus)) \
        if local else 0
    if local and opts.min_np > slots and not discovery:  # (discovered hosts may come)
        raise OptionsError(f"--min-np {opts.min_np} is more than this machine's {slots} slots")
    secret = security.load_secret(opts.secret_file)
    spec = _checked_spec(opts, local)  # (before the store: a refused spec leaves nothing)
    store = open_store(url, opts.store_prefix, **opts.store_options)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    lease = store.lease_grant(10.0) if local else 0
    keeper = store.keep_alive(lease, 3.0) if local else None
    submitted = False  # the job's keys are ours to remove only once we wrote them
    try:
        _submit(store, spec, secret, lease)
        submitted = True
        print(f"[pollux] job {spec.name}: {describe_kind(spec)} ({opts.elasticity_reason})",
              file=stdout, flush=True)
        if opts.elasticity_warning:
            print(f"[pollux] job {spec.name}: {opts.elasticity_warning}", file=stdout,
                  flush=True)
        if local and discovery is None and (warning := slots_warning(spec, slots)):
            print(f"[pollux] job {spec.name}: {warning}", file=stdout, flush=True)
        if local:
            node = NodeInfo(socket.gethostname(), slots, "127.0.0.1", time.time(),
                            gpu_type=gpu_type(gpus))
            cost = load_rescale_cost()
            delta = (cost.expected_stall("live", DEFAULT_STATE_BYTES, 4)
                     if opts.realloc_delay is None else opts.realloc_delay)
            policy = make_policy(opts.policy or DEFAULT_POLICY, p=opts.fairness, delta=delta)
            coordinator = Coordinator(store, policy, settle=0.2, cost=cost,
                                      interval=opts.interval or cost.round_interval("live"),
                                      live_delay=opts.realloc_delay)
            agent = NodeAgent(store, node, url, opts.store_prefix, secret=secret,
                              only_jobs={spec.name}, output_dir=opts.output_filename,
                              stdout=stdout, sides=("node", "launcher"), launch_options=opts,
                              local=True, gpus=gpus, log_dir=str(make_local_log_dir()))
            # the node's record first: the coordinator's first round then places the job
            # at once (a record put after that round costs a second, settled round)
            agent.register()
            services = [(coordinator.serve, "coordinator"), (agent.serve, "node-agent")]
            if discovery is not None:
                services.append((lambda stop, d=discovery, a=agent: d.run(
                    stop, slots, a.set_slots), "host-discovery"))
        elif driver.side == "launcher":  # this process runs the job's driver, no node
            here = NodeInfo(socket.gethostname(), 0, advertised_address(store), time.time())
            agent = NodeAgent(store, here, url, opts.store_prefix, secret=secret,
                              only_jobs={spec.name}, output_dir=opts.output_filename,
                              stdout=stdout, sides=("launcher",), launch_options=opts)
            services = [(agent.serve, "job-driver")]
        else:
            services = []
        # cluster mode: node agents run the workers; their output is followed here
        follower = None if local else LogFollower(store, spec.name, spec.submission, secret,
                                                  stdout)
        if follower is not None:
            services.append((follower.run, "log-follower"))
        for target, name in services:
            thread = threading.Thread(target=target, args=(stop,), name=name, daemon=True)
            thread.start()
            threads.append(thread)
        resubmit = None if local else (lambda: _resubmit(store, spec, secret))
        return _follow(store, spec.name, opts, stdout, follower.drain if follower else None,
                       resubmit, signals)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        if local and submitted:
            store.delete(keys.job(opts.job_name), prefix=True)
        if local:
            if keeper is not None:
                keeper.stop(revoke=True)
        store.close()


def _spec(opts: LaunchOptions, local: bool) -> JobSpec:
    env = {**opts.worker_env, **opts.horovod_env, "PYTHONUNBUFFERED": "1"}
    if opts.network_interface:
        env["GLOO_SOCKET_IFNAME"] = env["HOROVOD_GLOO_IFACE"] = opts.network_interface
    env[envvars.LOG_LEVEL] = opts.log_level
    # `python` in the command means the interpreter pollux-run runs in, as in a venv
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    command = opts.command if local else resolve_command(opts.command, env["PATH"])
    return JobSpec(
        name=opts.job_name, command=command, framework=opts.framework,
        initial_replicas=opts.np, min_replicas=opts.min_np, max_replicas=opts.max_np,
        submit_time=time.time(), workdir=os.getcwd(), env=env,
        submission=uuid.uuid4().hex, expires=time.time() + SPEC_TTL,
        elasticity=opts.elasticity, max_restarts=opts.max_restarts, stop_grace=opts.stop_grace,
        reports_goodput=opts.reports_goodput, min_batch_size=opts.min_batch_size,
        max_batch_size=opts.max_batch_size, gpu_types=opts.gpu_types,
    )


def _checked_spec(opts: LaunchOptions, local: bool) -> JobSpec:
    """The job's spec, proven to be one that every reader accepts (``messages.checked``:
    the readers' own decoding) - else one line naming the flag that set the wrong field.
    A spec the coordinator and the agents refused would wait for slots forever."""
    try:
        spec = _spec(opts, local)
        checked(spec)
    except MessageError as exc:
        what = SPEC_FLAGS.get(exc.field or "", "the job's spec")
        raise OptionsError(f"{what}: {exc}; every reader would refuse the job") from None
    return spec


def resolve_command(command: tuple[str, ...], path: str) -> tuple[str, ...]:
    """The command with its program as an absolute path, resolved here on the submitting
    host with the job's PATH, so that every node runs the same program (the node agents
    run it at that path, in the same working directory). Raises ``OptionsError`` (one
    line) for a program that cannot run here."""
    program = command[0]
    found = shutil.which(program, path=path) if os.sep not in program else (
        program if os.access(program, os.X_OK) and not os.path.isdir(program) else None)
    if found is None:
        raise OptionsError(f"command {program!r} is not an executable on this host's PATH; "
                           "give a program every node can run at the same path")
    return (os.path.abspath(found), *command[1:])


def _submit(store: Store, spec: JobSpec, secret: bytes | None, lease: int) -> None:
    """Create the job's keys atomically; a live job of the same name is a clash."""
    spec_key = keys.job(spec.name, "spec")
    status_key = keys.job(spec.name, "status")
    old_spec, old_status = store.get(spec_key), store.get(status_key)
    state = _read(store, status_key, JobStatus, ValueLog(log))
    if old_spec is not None and not (state is not None and state.finished):
        raise OptionsError(f"job {spec.name!r} already exists in the store and has not "
                           f"finished; choose another --job-name or run `pollux-run cancel "
                           f"{spec.name}` first")
    text = encode(spec)
    # a finished job of that name (or its leftovers) gives way: its keys go, atomically
    # with the check that nothing changed meanwhile
    guard = [Compare(spec_key, "mod_revision", "==", old_spec.mod_revision if old_spec else 0),
             Compare(status_key, "mod_revision", "==",
                     old_status.mod_revision if old_status else 0)]
    ops = [Delete(keys.job(spec.name), prefix=True)] if old_spec or old_status else []
    if not store.txn(guard, ops):
        raise OptionsError(f"job {spec.name!r} was just submitted by someone else")
    writes = [Put(spec_key, text, lease), Put(status_key, encode(JobStatus("pending")))]
    if secret is not None:
        writes.append(Put(keys.job(spec.name, "signature"), f'"{security.sign(text, secret)}"'))
    if not store.txn([Compare(spec_key, "create_revision", "==", 0)], writes):
        raise OptionsError(f"job {spec.name!r} was just submitted by someone else")


def _resubmit(store: Store, spec: JobSpec, secret: bytes | None) -> bool:
    """Put the job back where the store lost it (wiped, or a new, empty store): the same
    signed spec - the same submission, so no node agent takes it for a new job - and its
    state, running (its workers run on). False if someone put something there first."""
    spec_key, status_key = keys.job(spec.name, "spec"), keys.job(spec.name, "status")
    text = encode(spec)
    writes = [Put(spec_key, text), Put(status_key, encode(JobStatus(
        "running", None, "submitted again: the store had lost the job", time.time())))]
    if secret is not None:
        writes.append(Put(keys.job(spec.name, "signature"), f'"{security.sign(text, secret)}"'))
    return store.txn([Compare(spec_key, "create_revision", "==", 0),
                      Compare(status_key, "create_revision", "==", 0)], writes)


def _follow(store: Store, job: str, opts: LaunchOptions, stdout: IO[str],
            drain: Callable[[], None] | None = None,
            resubmit: Callable[[], bool] | None = None,
            signals: list[int] | None = None) -> int:
    """Print status changes until the job ends (then ``drain``: its last output lines);
    Ctrl-C / SIGTERM cancel it. ``resubmit`` puts the job back if the store lost it.
    ``signals``: the caller's record of those signals, shared - one that came before
    this took over their handling (e.g. while the job was being submitted) cancels the
    job at once."""
    interrupted: list[int] = signals if signals is not None else []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    last_line = ""
    unreachable = False
    values = ValueLog(log)  # a malformed status or hints: said once, read as none yet
    started = time.monotonic()
    try:
        while True:
            if interrupted:
                cancel_job(store, job, f"pollux-run got signal {interrupted[0]}")
                print(f"[pollux] {job}: cancelled", file=stdout, flush=True)
                return 128 + interrupted[0]
            try:
                status = _read(store, keys.job(job, "status"), JobStatus, values)
                hints = _read(store, keys.job(job, "hints"), JobHints, values)
                alloc = (_read(store, keys.job(job, "allocation"), Allocation, values)
                         if opts.elasticity != "live" else None)
                rev = store.revision()
                if status is None and resubmit is not None \
                        and store.get(keys.job(job, "spec")) is None and resubmit():
                    print(f"[pollux] {job}: the store had lost the job (wiped, or a new "
                          "store); submitted it again - its workers carry on",
                          file=stdout, flush=True)
                    continue
            except StoreError as exc:  # e.g. etcd restarting: keep following the job
                if not unreachable:
                    print(f"[pollux] {job}: store unreachable ({exc}); still following",
                          file=stdout, flush=True)
                unreachable = True
                time.sleep(1.0)
                continue
            if unreachable:
                print(f"[pollux] {job}: store reachable again", file=stdout, flush=True)
                unreachable = False
            if status is not None and status.state == "rejected":  # admission control
                print(f"[pollux] {job}: rejected: {status.message or 'by the coordinator'}",
                      file=stdout, flush=True)
                return REJECTED_EXIT
            if status is not None and status.finished:
                if drain is not None:
                    drain()
                code = status.exit_code if status.exit_code is not None else 1
                detail = f" ({status.message})" if status.message else ""
                print(f"[pollux] {job}: {status.state}, exit code {code}{detail}",
                      file=stdout, flush=True)
                return code if code >= 0 else 128 - code  # killed by signal N: 128+N
            line = (f"queued: {status.message}" if status is not None
                    and status.state == "queued"
                    else describe_hints(hints) if hints
                    else describe_allocation(alloc) if opts.elasticity != "live"
                    else FIRST_REPORT)
            # a wait said only once it is one: the first allocation and report take a
            # moment on an idle machine too, and "waiting" there would be a false alarm
            early = WAIT_SAID_AFTER - (time.monotonic() - started)
            if line != last_line and (early <= 0 or line not in WAITING):
                print(f"[pollux] {job}: {line}", file=stdout, flush=True)
                last_line = line
            try:
                store.wait(keys.job(job), rev, timeout=min(1.0, early) if early > 0 else 1.0)
            except StoreError:  # reported by the next read if it persists
                time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read(store: Store, key: str, cls: type[M], values: ValueLog) -> M | None:
    """The message at ``key``; None if there is none or it is malformed (``values``
    logs that once per revision)."""
    kv = store.get(key)
    return values.read(cls, kv.key, kv.value, kv.mod_revision) if kv is not None else None


def cancel_job(store: Store, job: str, message: str) -> None:
    """Mark the job cancelled - while it exists: a job whose keys are gone stays gone."""
    store.txn([keys.job_exists(job)],
              [Put(keys.job(job, "status"), encode(JobStatus("cancelled", 130, message,
                                                             time.time())))])

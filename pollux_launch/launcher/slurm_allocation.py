"""``pollux-run --slurm``: the Slurm allocation this runs in (an ``sbatch`` script, an
``salloc`` shell) as a pollux cluster for the allocation's lifetime, with no daemon of
pollux's on the nodes before or after.

1. The allocation: its job id and nodes (``SLURM_JOB_ID``, ``scontrol show hostnames
   $SLURM_JOB_NODELIST``), and the address of this (the batch) node as Slurm knows it
   (``scontrol show node``: its ``NodeAddr``).
2. The store: ``--store`` when given; else an ``etcd`` (Debian's ``etcd-server``) started
   here on that address, its data in a temporary folder, removed at the end.
3. The coordinator: ``pollux-run coordinator`` here, against that store.
4. A node agent on every node of the allocation: one ``srun --ntasks-per-node=1
   --overlap`` step running ``pollux-run agent`` (its node name is Slurm's, from
   ``SLURMD_NODENAME``; its slots the node's GPUs, else its CPUs); no ssh.
5. The job: submitted and followed as in any cluster, once every node's agent has
   registered; its exit code is ``pollux-run``'s. The cluster secret (the user's, else
   a random one for this run) signs the job's spec and lets this node read the workers'
   output on the others: the agents get it in srun's environment, never in a file
   other nodes must reach, an argument or a worker's environment.

Then the agents (SIGTERM to the srun step: they drain), the coordinator and the etcd
stop, in that order, whatever the job's end.

Preemption: SIGTERM (``scancel``, the time limit) cancels the job - every worker gets
SIGTERM, and one with ``--checkpoint-dir`` writes its final checkpoint before it ends;
the warning signal SIGUSR1 (``#SBATCH --signal=B:USR1@90`` with ``exec pollux-run``, or
``scancel --signal=USR1 --batch``) does the same, then requeues the batch job
(``scontrol requeue``: submit it with ``--requeue``) once everything has stopped; the
requeued run resumes the job from those checkpoints at whatever size it then has.

Outside an allocation, or without the Slurm commands or ``etcd``, one line says what is
missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from .. import env as envvars
from .. import keys
from ..errors import UserError
from ..messages import MessageError, NodeInfo, decode
from ..rendezvous.store import Store, StoreError, open_store
from . import security
from .launch_options import LaunchOptions

log = logging.getLogger(__name__)
# How long the allocation's services get to come up (etcd, every node's agent).
START_TIMEOUT = 120.0


class AllocationError(UserError):
    """Not in a Slurm allocation, or what running on one needs is missing."""


@dataclass(frozen=True)
class SlurmAllocation:
    job_id: str
    nodes: tuple[str, ...]
    address: str  # this (the batch) node's, as Slurm reaches it


def allocation_nodes(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(job id, node count) of the Slurm allocation of several nodes whose batch script
    or salloc shell ``env`` is (a task of an srun step is not); else None."""
    job_id, nodes = env.get(envvars.SLURM_JOB_ID), env.get(envvars.SLURM_JOB_NUM_NODES, "")
    if not job_id or not env.get(envvars.SLURM_JOB_NODELIST) or envvars.SLURM_STEP_ID in env:
        return None
    return (job_id, int(nodes)) if nodes.isdigit() and int(nodes) > 1 else None


def read_allocation(env: dict[str, str] | None = None) -> SlurmAllocation:
    """The allocation this process runs in. Raises AllocationError (one line)."""
    env = dict(os.environ if env is None else env)
    job_id, nodelist = env.get(envvars.SLURM_JOB_ID), env.get(envvars.SLURM_JOB_NODELIST)
    if not job_id or not nodelist:
        raise AllocationError("--slurm: not inside a Slurm allocation (no SLURM_JOB_ID / "
                              "SLURM_JOB_NODELIST): run it in an sbatch script or salloc")
    for tool in ("scontrol", "srun"):
        if shutil.which(tool) is None:
            raise AllocationError(f"--slurm: `{tool}` is not on PATH")
    nodes = tuple(scontrol("show", "hostnames", nodelist).split())
    here = env.get(envvars.SLURMD_NODENAME) or nodes[0]
    address = scontrol_fields("show", "node", here).get("NodeAddr") or here
    with suppress(OSError):  # a host name: the address it resolves to here
        address = socket.gethostbyname(address)
    return SlurmAllocation(job_id, nodes, address)


def scontrol_fields(*args: str) -> dict[str, str]:
    """``scontrol ARGS -o``'s ``Key=value`` fields (one record: ``show job ID``, ``show
    node NAME``). Raises AllocationError (one line)."""
    return dict(f.split("=", 1) for f in scontrol(*args, "-o").split() if "=" in f)


def scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise AllocationError(f"scontrol {' '.join(args)} failed: "
                              f"{(getattr(exc, 'stderr', '') or str(exc)).strip()[:200]}") from None


# The allocation's store, for `pollux-run status` on any of its nodes: its URL and key
# prefix, put in the Slurm job's Comment while the allocation is a pollux cluster (no
# file every node must reach). Read back as untrusted text: it must match STORE_COMMENT.
STORE_COMMENT_HEAD = "pollux-store="
STORE_COMMENT = re.compile(r"^pollux-store=(etcd://[A-Za-z0-9.\-:\[\],]{1,400})\|"
                           r"(/[A-Za-z0-9._\-/]{0,200})$")


def allocation_store(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(store URL, key prefix) of the pollux cluster that ``pollux-run --slurm`` made of
    the allocation ``env`` is in (its Slurm job's Comment); None if there is none or
    Slurm cannot say."""
    job_id = env.get(envvars.SLURM_JOB_ID)
    if not job_id or shutil.which("scontrol") is None:
        return None
    found = STORE_COMMENT.match(_job_comment(job_id) or "")
    return (found.group(1), found.group(2)) if found else None


def find_allocation_store(args: argparse.Namespace) -> None:
    """A tool's store flags without ``--store`` (``add_store_arguments``), inside the
    allocation of a ``pollux-run --slurm`` (or given its ``SLURM_JOB_ID``): set to its
    cluster's store, in place."""
    if args.store is not None:
        return
    found = allocation_store(os.environ)
    if found is not None:
        args.store = found[0]
        if args.store_prefix == envvars.DEFAULT_PREFIX:
            args.store_prefix = found[1]


def _publish_store(alloc: SlurmAllocation, url: str, prefix: str) -> bool:
    """Put the store in the job's Comment (module docstring) - unless the user's comment
    is there: that is not ours to replace. Whether it is there now."""
    value = f"{STORE_COMMENT_HEAD}{url}|{prefix}"
    if not STORE_COMMENT.match(value):  # (one that status would not read: none at all)
        return False
    comment = _job_comment(alloc.job_id)
    if comment is None or (comment and not comment.startswith(STORE_COMMENT_HEAD)):
        return False
    try:
        scontrol("update", f"JobId={alloc.job_id}", f"Comment={value}")
    except AllocationError as exc:
        log.warning("pollux-run status will not find this allocation's store: %s", exc)
        return False
    return True


def _unpublish_store(alloc: SlurmAllocation) -> None:
    with suppress(AllocationError):  # (a stale comment: status then finds no store there)
        scontrol("update", f"JobId={alloc.job_id}", "Comment=")


def _job_comment(job_id: str) -> str | None:
    """The Slurm job's Comment ("" if none); None if scontrol cannot say."""
    try:
        return scontrol_fields("show", "job", job_id).get("Comment", "")
    except AllocationError:
        return None


class _Stopped(Exception):
    """SIGTERM before the job was submitted (its follower then cancels it instead)."""


def launch_in_allocation(jobs: Sequence[LaunchOptions],
                         launch: Callable[[Sequence[LaunchOptions], list[int]], int]) -> int:
    """Run ``jobs`` (one, or a sweep's: sharing the allocation) on the allocation (module
    docstring) with ``launch`` (``sweep.launch_jobs``: all of them, given the
    allocation's store and the signals received since it started, then their exit
    code)."""
    alloc = read_allocation()
    if jobs[0].slurm_notice:
        print(f"[pollux] {jobs[0].slurm_notice}", flush=True)
    print(f"[pollux] Slurm job {alloc.job_id}: {len(alloc.nodes)} node(s) "
          f"({', '.join(alloc.nodes)[:200]})", flush=True)
    warned: list[int] = []
    starting = [True]  # (then the jobs' followers handle SIGTERM; the teardown must end)
    signals: list[int] = []  # SIGTERMs once started: the followers', whenever they came

    def on_warning(signum: int, _frame: object) -> None:
        warned.append(signum)
        signal.raise_signal(signal.SIGTERM)  # (the jobs' followers: cancel, i.e. SIGTERM)

    def on_term(signum: int, _frame: object) -> None:
        if starting[0]:
            raise _Stopped(signum)
        # else: before the jobs' followers took over SIGTERM (their handlers put it in the
        # same list) - they cancel the jobs as they start; in the teardown after them,
        # the stop goes on (Slurm kills what is left at its time)
        signals.append(signum)

    previous = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, on_warning),
                signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}
    try:
        code = _run(alloc, jobs, lambda here: launch(here, signals),
                    lambda: starting.__setitem__(0, False))
    except _Stopped:
        code = 128 + signal.SIGTERM
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if warned:
        _requeue(alloc)
    return code


def _run(alloc: SlurmAllocation, jobs: Sequence[LaunchOptions],
         launch: Callable[[Sequence[LaunchOptions]], int], started: Callable[[], None]) -> int:
    opts = jobs[0]  # (the cluster's flags: every job of a sweep has the same)
    with tempfile.TemporaryDirectory(prefix=f"pollux-slurm-{alloc.job_id}-") as tmp:
        secret_file = Path(tmp) / "secret"  # (this node's: the launcher's)
        secret = security.load_secret(opts.secret_file) or secrets.token_hex(32).encode()
        secret_file.touch(mode=0o600)
        secret_file.write_bytes(secret)
        with _services(alloc, opts, Path(tmp), secret) as (url, nodes):
            started()
            here = [dataclasses.replace(o, store=url, slurm=False, slurm_notice="",
                                        secret_file=str(secret_file)) for o in jobs]
            try:
                return launch(here)
            finally:  # (a cancelled job's workers end after it: their final checkpoints)
                _wait_for_workers(nodes, [o.job_name for o in jobs],
                                  max(o.stop_grace for o in jobs))


def _requeue(alloc: SlurmAllocation) -> None:
    """After the warning signal, once every worker ended (the job's final checkpoints
    written, what pollux started here stopped): put the batch job back in the queue, as
    Lightning's auto-requeue does; it resumes from those checkpoints at its new size."""
    try:
        scontrol("requeue", alloc.job_id)
    except AllocationError as exc:
        print(f"[pollux] Slurm job {alloc.job_id}: warned (SIGUSR1), but not requeued: "
              f"{exc}", flush=True)
        return
    print(f"[pollux] Slurm job {alloc.job_id}: warned (SIGUSR1): the workers wrote their "
          "final checkpoints; requeued", flush=True)


@contextmanager
def _services(alloc: SlurmAllocation, opts: LaunchOptions, tmp: Path,
              secret: bytes) -> Iterator[tuple[str, _Nodes]]:
    procs: list[subprocess.Popen] = []  # stopped in reverse order of start
    nodes: _Nodes | None = None
    published = False
    try:
        url = opts.store or _start_etcd(alloc.address, tmp, procs)
        pollux = _pollux_run()
        store_args = ["--store", url, "--store-prefix", opts.store_prefix]
        procs.append(_start([*pollux, "coordinator", *store_args], tmp / "coordinator.log"))
        procs.append(_start(["srun", f"--nodes={len(alloc.nodes)}",
                             f"--ntasks={len(alloc.nodes)}", "--ntasks-per-node=1",
                             "--overlap", "--kill-on-bad-exit=0", *pollux, "agent",
                             *store_args],  # (state: each node's own, by its name)
                            tmp / "agents.log",
                            # the cluster secret, for the agents only: srun passes its
                            # environment to its tasks (no file every node must reach;
                            # the agents give workers none of the SECRETS variables)
                            {**os.environ, envvars.SECRET: secret.decode()}))
        nodes = _Nodes(url, opts)
        _wait_for_agents(nodes, alloc, procs)
        published = _publish_store(alloc, url, opts.store_prefix)
        yield url, nodes
    finally:
        if published:
            _unpublish_store(alloc)
        if nodes is not None:
            nodes.close()
        for proc in reversed(procs):
            _stop(proc)


def _pollux_run() -> list[str]:
    exe = Path(sys.executable).with_name("pollux-run")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pollux_launch.cli"]


def _start(argv: list[str], log_file: Path,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_file, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _start_etcd(address: str, tmp: Path, procs: list[subprocess.Popen]) -> str:
    if shutil.which("etcd") is None:
        raise AllocationError("--slurm: no --store and no `etcd` here to start one: install "
                              "Debian's etcd-server (or pass --store etcd://HOST:PORT)")
    client, peer = _free_port(address), _free_port("127.0.0.1")
    url = f"http://{address}:{client}"
    procs.append(_start(["etcd", "--name", "pollux", "--data-dir", str(tmp / "etcd"),
                         "--listen-client-urls", url, "--advertise-client-urls", url,
                         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-cluster", f"pollux=http://127.0.0.1:{peer}"],
                        tmp / "etcd.log"))
    return f"etcd://{address}:{client}"


class _Nodes:
    """The node records of the allocation's store, read through one connection (made
    once the store answers)."""

    def __init__(self, url: str, opts: LaunchOptions) -> None:
        self.url, self.opts = url, opts
        self._store: Store | None = None

    def read(self) -> list[NodeInfo] | None:
        """Every well-formed record; None while the store does not answer."""
        try:
            if self._store is None:
                self._store = open_store(self.url, self.opts.store_prefix,
                                         **self.opts.store_options)
            kvs = self._store.get_prefix(keys.NODES)
        except StoreError:
            return None
        out = []
        for kv in kvs:
            with suppress(MessageError):  # (a malformed record: no node, no worker)
                out.append(decode(NodeInfo, kv.value))
        return out

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _wait_for_workers(nodes: _Nodes, jobs: Sequence[str], grace: float) -> None:
    """Until no node runs a worker of ``jobs`` (the agents count them in their records),
    at most their stop grace and a little more."""
    deadline = time.monotonic() + grace + 10
    while time.monotonic() < deadline:
        found = nodes.read()
        if found is not None and not any(n.workers.get(j) for n in found for j in jobs):
            return
        time.sleep(0.5)


def _wait_for_agents(nodes: _Nodes, alloc: SlurmAllocation,
                     procs: list[subprocess.Popen]) -> None:
    """Until every node of the allocation has registered (the store up first)."""
    deadline, said = time.monotonic() + START_TIMEOUT, 0.0
    want = set(alloc.nodes)
    while True:
        seen = {n.name for n in nodes.read() or ()}
        if want <= seen:
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            missing = ", ".join(sorted(want - seen))[:200]
            raise AllocationError(f"--slurm: no node agent registered on {missing} "
                                  + (f"({Path(str(dead[0].args[0])).name} exited "
                                     f"{dead[0].returncode})" if dead
                                     else f"within {START_TIMEOUT:.0f} s"))
        if time.monotonic() - said > 10:
            said = time.monotonic()
            print(f"[pollux] Slurm job {alloc.job_id}: waiting for the node agents "
                  f"({len(seen & want)}/{len(want)})", flush=True)
        time.sleep(0.5)

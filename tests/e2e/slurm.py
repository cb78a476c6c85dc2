"""A real Slurm on this machine for the tests: Debian's ``munge`` and ``slurm-wlm``
(22.05), one ``munged`` and one ``slurmctld`` in the root network namespace (at the
bridge's address) and one ``slurmd`` per host of ``hosts.HostNet`` (``slurmd -N nK``), so
batch jobs run on separate "machines" with their own addresses. Everything - key, socket,
``slurm.conf``, state, spool, logs - lives in a folder of the test's own; ``SLURM_CONF``
in :attr:`Slurm.env` points the Slurm commands at it. Nothing is left running.

Credentials expire after 10 s (``cred_expire``; Slurm's default 120 s), which is also how
long a requeued job waits before it may start again.

slurmd runs without cgroup confinement (``proctrack/linuxproc``, ``task/none``); its
cgroup plugin still starts, so ``cgroup.conf`` names cgroup v1 where this machine mounts
v1 hierarchies under a tmpfs (slurmd's autodetection fails there).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from hosts import Host

from pollux_launch.env import TRANSPORT_IFNAME

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo")


def slurm_available() -> str | None:
    """None where a real Slurm can run here, else why not (one line)."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"needs Debian's slurm-wlm and munge ({', '.join(missing)} missing)"
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their users)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Slurm:
    """``munged`` + ``slurmctld`` at ``address`` and one ``slurmd`` per ``hosts`` (nodes
    n1, n2, ... at the hosts' addresses) in ``folder``. ``env``: this environment with
    ``SLURM_CONF``. Use as a context manager; :meth:`wait_idle` after starting."""

    def __init__(self, folder: Path, address: str, hosts: Sequence[Host], cpus: int = 2) -> None:
        self.folder, self.address, self.hosts = folder, address, list(hosts)
        self.nodes = [f"n{i + 1}" for i in range(len(self.hosts))]
        folder.mkdir(parents=True, exist_ok=True)
        # (not the transports' interface an in-process Rendezvous of an earlier test put
        # into this process's environment - lo: the jobs span hosts)
        self.env = {**{k: v for k, v in os.environ.items() if k not in TRANSPORT_IFNAME},
                    "SLURM_CONF": str(folder / "slurm.conf")}
        self._procs: list[subprocess.Popen] = []
        self._munged_pid: int | None = None
        self._write_config(cpus)

    def _write_config(self, cpus: int) -> None:
        f = self.folder
        key = f / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        nodes = "\n".join(f"NodeName={n} NodeAddr={h.address} CPUs={cpus} State=UNKNOWN"
                          for n, h in zip(self.nodes, self.hosts, strict=True))
        (f / "slurm.conf").write_text(f"""\
ClusterName=pollux-test
SlurmctldHost={socket.gethostname()}({self.address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={f / 'munge.sock'},cred_expire=10
CredType=cred/munge
MailProg=/bin/true
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f}/spool-%n
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f / 'slurmctld.log'}
SlurmdLogFile={f}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
KillWait=5
{nodes}
PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (f / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n")

    def __enter__(self) -> Slurm:
        f = self.folder
        subprocess.run(["munged", "--force", f"--socket={f / 'munge.sock'}",
                        f"--key-file={f / 'munge.key'}", f"--pid-file={f / 'munged.pid'}",
                        f"--log-file={f / 'munged.log'}", f"--seed-file={f / 'munged.seed'}"],
                       check=True, timeout=30)
        self._munged_pid = int((f / "munged.pid").read_text())
        try:
            self._start(None, ["slurmctld", "-D", "-i"], "slurmctld.out")
            for node, host in zip(self.nodes, self.hosts, strict=True):
                self._start(host, ["slurmd", "-D", "-N", node], f"slurmd-{node}.out")
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, host: Host | None, argv: list[str], log: str) -> None:
        out = open(self.folder / log, "w")
        popen = host.popen if host is not None else subprocess.Popen
        self._procs.append(popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT))
        out.close()

    def run(self, *argv: str) -> str:
        """A Slurm command's output (raises CalledProcessError with its stderr)."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              check=True, timeout=30).stdout

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is idle (registered with slurmctld)."""
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            try:
                last = self.run("sinfo", "-h", "-N", "-o", "%N %t")
            except subprocess.CalledProcessError as exc:
                last = exc.stderr
            if sum(line.split()[1:] == ["idle"] for line in last.splitlines()) == len(self.nodes):
                return
            time.sleep(0.5)
        raise AssertionError(f"Slurm's nodes never became idle: {last.strip()}\n"
                             + self.log("slurmctld.log"))

    def jobs(self) -> list[tuple[str, str, str]]:
        """``squeue``: (job id, state, node list) of every job Slurm still knows."""
        out = self.run("squeue", "-h", "-o", "%i %T %N")
        return [tuple([*line.split(), "", ""][:3]) for line in out.splitlines()]

    def _jobs_left(self) -> bool:
        try:
            return bool(self.jobs())
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            return False  # (slurmctld gone: its jobs are HostNet's to end)

    def log(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def close(self) -> None:
        if self._procs:  # batch jobs outlive slurmd (slurmstepd): end them first
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env,
                           capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self._jobs_left():
                time.sleep(0.5)
        for proc in reversed(self._procs):
            proc.terminate()
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        if self._munged_pid is not None:
            try:
                os.kill(self._munged_pid, 15)
            except ProcessLookupError:
                pass
            self._munged_pid = None

    def __exit__(self, *exc: object) -> None:
        self.close()

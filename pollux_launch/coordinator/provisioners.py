"""Provisioners: how an autoscaled cluster gets and gives back nodes. One interface, chosen
by name (``make_provisioner``), as the store backends and policies are.

The contract. ``up(count)`` asks for ``count`` more nodes; each new node starts a
``pollux-run agent`` against the cluster's store (it joins when its agent registers, after
however long the machine takes to boot). ``down(nodes)`` gives back nodes the coordinator
has drained (no replica placed there, no worker running): the provisioner stops their
agents (SIGTERM) and releases the machines. Either may fail or hang: it raises
``ProvisionerError`` (one line) or is cut off at ``timeout``; the autoscaler logs it once
and tries again later. Backends:

* ``command``: runs the operator's executable, ``EXE up N`` and ``EXE down NODE...``
  (exit status 0 = done; anything it prints is logged). A node's name is its agent's
  ``--node-name``.
* ``slurm``: one batch job per node (``sbatch --parsable --job-name pollux-node
  --wrap "pollux-run agent --node-name pollux-$SLURM_JOB_ID ..."`` plus the operator's
  ``sbatch`` arguments); ``down`` runs ``scancel`` on the job ids the names carry.
"""

from __future__ import annotations

import abc
import logging
import os
import shlex
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence

from pollux_launch.arguments import OptionsError
from pollux_launch.errors import PolluxError
from pollux_launch.registry import Registry

log = logging.getLogger(__name__)

SLURM_PREFIX = "pollux-"  # a slurm node's name: pollux-<batch job id>


class ProvisionerError(PolluxError, RuntimeError):
    """A provisioner call failed (one line: what, and the command's last words)."""


class Provisioner(abc.ABC):
    """Gets and gives back nodes (module docstring)."""

    name = "abstract"

    @abc.abstractmethod
    def up(self, count: int) -> None:
        """Ask for ``count`` more nodes, each starting a ``pollux-run agent``."""

    @abc.abstractmethod
    def down(self, nodes: Sequence[str]) -> None:
        """Give back these drained nodes (their agents stop)."""


def _run(argv: list[str], timeout: float) -> str:
    """Run one provisioner call; its output, or ProvisionerError (one line).

    Output goes to files, not pipes: a call that starts a node's agent in the background
    (``pollux-run agent ... &``) leaves it holding them, and a pipe would then never reach
    end-of-file, so a finished call would look hung. The call runs in its own session:
    one that overruns ``timeout`` is killed with everything it started."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
        except OSError as exc:
            raise ProvisionerError(f"{shlex.join(argv)[:200]}: cannot run it "
                                   f"({exc.strerror or exc})") from None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile: nothing left to stop
                pass
            proc.wait()
            raise ProvisionerError(f"{shlex.join(argv)[:200]}: no answer within "
                                   f"{timeout:g} s (stopped)") from None
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if code != 0:
        last = (stderr.strip() or stdout.strip()).splitlines()[-1:] or [""]
        raise ProvisionerError(f"{shlex.join(argv)[:200]}: exit status {code}"
                               + (f": {last[0][:200]}" if last[0] else ""))
    return stdout


class CommandProvisioner(Provisioner):
    """``EXE up N`` / ``EXE down NODE...`` (module docstring)."""

    name = "command"

    def __init__(self, command: str, timeout: float = 300.0) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise OptionsError("--provisioner command needs --provisioner-command EXE")
        self.timeout = timeout

    def up(self, count: int) -> None:
        out = _run([*self.argv, "up", str(int(count))], self.timeout)
        if out.strip():
            log.info("provisioner: %s", out.strip()[:500])

    def down(self, nodes: Sequence[str]) -> None:
        out = _run([*self.argv, "down", *nodes], self.timeout)
        if out.strip():
            log.info("provisioner: %s", out.strip()[:500])


class SlurmProvisioner(Provisioner):
    """One ``sbatch`` job per node running ``pollux-run agent`` (module docstring).
    ``agent``: the agent's command line less ``--node-name`` (the store's URL, its
    credentials' file paths, the secret file...); ``sbatch_args``: the operator's own
    (partition, GPUs, time limit)."""

    name = "slurm"

    def __init__(self, agent: Sequence[str], sbatch_args: str = "", sbatch: str = "sbatch",
                 scancel: str = "scancel", timeout: float = 120.0) -> None:
        self.agent, self.sbatch_args = list(agent), shlex.split(sbatch_args)
        self.sbatch, self.scancel, self.timeout = sbatch, scancel, timeout

    def up(self, count: int) -> None:
        # $SLURM_JOB_ID is expanded by the batch job's shell, so each node names itself
        wrap = shlex.join(self.agent) + f" --node-name {SLURM_PREFIX}$SLURM_JOB_ID"
        for _ in range(int(count)):
            out = _run([self.sbatch, "--parsable", "--job-name", "pollux-node",
                        *self.sbatch_args, "--wrap", wrap], self.timeout)
            log.info("provisioner: submitted batch job %s", out.strip().split(";")[0][:40])

    def down(self, nodes: Sequence[str]) -> None:
        ids = [n[len(SLURM_PREFIX):] for n in nodes if n.startswith(SLURM_PREFIX)
               and n[len(SLURM_PREFIX):].isdigit()]
        others = [n for n in nodes if n[len(SLURM_PREFIX):] not in ids]
        if others:  # not ours: a node the operator started by hand stays
            log.warning("provisioner slurm: %s not started by it; left alone",
                        ", ".join(others)[:200])
        if ids:
            _run([self.scancel, *ids], self.timeout)


#: name -> factory(**options) of a Provisioner
PROVISIONERS: Registry[Callable[..., Provisioner]] = Registry("provisioner", check=callable)
PROVISIONERS.register("command", CommandProvisioner)
PROVISIONERS.register("slurm", SlurmProvisioner)


def make_provisioner(name: str, **options: object) -> Provisioner:
    """The provisioner called ``name`` (UnknownName, a one-line ValueError, for an
    unknown one)."""
    return PROVISIONERS.get(name)(**options)

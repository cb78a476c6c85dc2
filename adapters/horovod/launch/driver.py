"""``HorovodDriver``: the launcher's driver for a Horovod job - one ``horovodrun`` per job.

Horovod's own elastic driver starts, resets and ends the workers; this driver gives it
its host list and reads its exit code:

1. once the job has an allocation (an empty host list would make Horovod's driver wait
   up to ``--elastic-timeout``), a :class:`~.hosts.HostsFileMirror` writes the hosts
   file and keeps following the allocation in the store; Horovod polls it through a
   ``cat`` discovery script (cheap: it runs about once a second);
2. ONE ``horovodrun --gloo`` (elastic: ``--min-np``/``--max-np`` from the job's spec,
   the user's horovodrun flags from the launching ``pollux-run``) runs the user's command;
   its workers inherit its environment, so they get the ``POLLUX_*`` variables that let
   rank 0 report hints (:mod:`.control`);
3. horovodrun's exit code is the job's: 0 succeeded, anything else failed. Workers that
   a reset removed exit 134 inside horovodrun - expected, never a job failure: their
   output from the reset on goes to the job's log only (:class:`TerminalFilter`), and
   horovodrun says the change of size in one line (:mod:`.local_run`).

On one machine (local mode) the driver is ``horovodrun`` itself (its entry point, import
guarded, each replica a Horovod host of its own so that a dead worker costs one replica:
:func:`~.command.write_horovodrun_script`, :mod:`.local_run`), with
``--network-interface lo`` (without it Horovod waits for a second host), and a job that
may grow gets pre-started newcomers (:mod:`.warm`): horovodrun runs each worker through
a hand-off shim, the job's first grow starts a warm zygote, and the mirror reports the
grown hosts only once it is ready, so the survivors' reset waits for a fork, not for
Python importing torch. On a cluster it
is :mod:`.elastic_launch`: Horovod's elastic driver with its hosts read from the
allocation and each worker started by the node agent of its host (:mod:`.tasks`), so no
ssh is needed and every node binds its own interface.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from pollux_launch import keys
from pollux_launch.launcher.drivers import (
    DriverContext,
    JobDriver,
    OptionsError,
    ProcessExit,
    WorkerGroup,
    replica_limit,
)
from pollux_launch.launcher.logs import LogSink
from pollux_launch.messages import Allocation, JobSpec, NodeInfo, ValueLog

from ..available import HorovodMissing, require_horovod
from .command import horovodrun_command, write_horovodrun_script
from .hosts import HostsFileMirror, hosts_from_allocation, write_discovery_script
from .local_run import LOG_ONLY
from .warm import WarmStart

DRIVER_ID = "horovodrun"

log = logging.getLogger(__name__)


class HorovodDriver(JobDriver):
    side = "launcher"

    def __init__(self, spec: JobSpec, ctx: DriverContext) -> None:
        super().__init__(spec, ctx)
        log_file = ctx.log_file(spec)
        self.output = TerminalFilter(ctx.stdout or sys.stdout,
                                     LogSink(log_file) if log_file else None)
        self.group = WorkerGroup(spec.name, (), spec.env, cwd=spec.workdir or None,
                                 stdout=self.output, prefix_output=False)  # horovodrun prefixes
        self.mirror: HostsFileMirror | None = None
        self.warm: WarmStart | None = None
        self.folder: Path | None = None
        self.argv: list[str] = []
        self.started = self.done = False
        self.values = ValueLog(log)  # a malformed node record: said once per revision

    @classmethod
    def preflight(cls) -> None:
        try:
            require_horovod()
        except HorovodMissing as exc:
            raise OptionsError(str(exc)) from None

    @classmethod
    def wanted(cls, alloc: Allocation | None, node: str) -> bool:
        return alloc is not None and alloc.num_replicas > 0

    def addresses(self) -> dict[str, str]:
        """Node name -> the address its agent registered (local mode: this node's)."""
        if self.ctx.local:
            return {self.ctx.node.name: self.ctx.node.address}
        out = {}
        for kv in self.ctx.store.get_prefix(keys.NODES):
            info = self.values.read(NodeInfo, kv.key, kv.value, kv.mod_revision)
            if info is not None:  # (a malformed record is logged and skipped)
                out[info.name] = info.address
        return out

    def command(self, alloc: Allocation, discovery_script: str,
                worker: list[str] | None = None,
                horovodrun: list[str] | None = None) -> list[str]:
        """Local mode's ``horovodrun`` command line; ``worker``: the command it runs for
        each worker (default: the job's); ``horovodrun``: the argv that runs horovodrun
        (default: the ``horovodrun`` beside this Python)."""
        spec, opts = self.spec, self.ctx.options
        np = min(max(alloc.num_replicas, spec.min_replicas), spec.max_replicas)
        nic = opts.network_interface if opts is not None else None
        if nic is None and (self.ctx.local or all(
                host.startswith("127.") or host == "localhost"
                for host, _ in hosts_from_allocation(alloc, self.addresses()))):
            nic = "lo"
        extra: list[str] = []
        if opts is not None:
            if opts.output_filename:
                extra += ["--output-filename", opts.output_filename]
            if opts.blacklist_cooldown_range:
                extra += ["--blacklist-cooldown-range",
                          *(str(v) for v in opts.blacklist_cooldown_range)]
        return horovodrun_command(
            worker or list(spec.command), discovery_script=discovery_script, np=np,
            min_np=spec.min_replicas, max_np=replica_limit(spec), network_interface=nic,
            elastic_timeout=int(opts.elastic_timeout) if opts else None,
            reset_limit=opts.reset_limit if opts else None,
            start_timeout=int(opts.start_timeout) if opts else None,
            verbose=bool(opts and opts.verbose), extra_args=extra, horovodrun=horovodrun)

    def launch_command(self, alloc: Allocation) -> list[str]:
        """Cluster mode: Horovod's elastic driver with workers started by the node
        agents (:mod:`.elastic_launch`), the user's horovodrun options kept."""
        spec, opts = self.spec, self.ctx.options
        hi = replica_limit(spec)
        argv = [sys.executable, "-m", "pollux_launch.adapters.horovod.launch.elastic_launch",
                "--np", str(min(max(alloc.num_replicas, spec.min_replicas), spec.max_replicas)),
                "--min-np", str(spec.min_replicas)]
        if hi is not None:
            argv += ["--max-np", str(hi)]
        if opts is not None:
            argv += ["--elastic-timeout", str(int(opts.elastic_timeout)),
                     "--start-timeout", str(int(opts.start_timeout))]
            if opts.reset_limit is not None:
                argv += ["--reset-limit", str(opts.reset_limit)]
            if opts.blacklist_cooldown_range:
                argv += ["--cooldown-range", *(str(v) for v in opts.blacklist_cooldown_range)]
            if opts.verbose:
                argv.append("--verbose")
        return [*argv, "--", *spec.command]

    def reconcile(self, alloc: Allocation | None, free_slots: int) -> int:
        # (the driver process holds no slot: its workers do, started by the node agents)
        if self.started or self.done or alloc is None or not alloc.num_replicas:
            return 0  # started once; from then on Horovod follows the allocation
        self.started = True
        env = self.ctx.job_env(self.spec)
        # one machine: horovodrun itself, hosts from a discovery script - unless the machine
        # has GPUs: then its node agent starts each worker (as in a cluster), holding one
        if self.ctx.local and self.ctx.devices is None:
            self.folder = Path(tempfile.mkdtemp(prefix=f"pollux-hvd-{self.spec.name}-"))
            hosts = self.folder / "hosts"
            script = write_discovery_script(self.folder / "discover.sh", hosts)
            hi = replica_limit(self.spec)
            if hi is None or hi > self.spec.min_replicas:  # it may grow: newcomers pre-start
                self.warm = WarmStart(self.spec.name, self.spec.command,
                                      {**self.spec.env, **env}, cwd=self.spec.workdir or None,
                                      stdout=self.output)
                env = {**env, **self.warm.environment()}
            self.mirror = HostsFileMirror(
                self.ctx.store, self.spec.name, hosts, addresses=self.addresses,
                newcomers_ready=self.warm.ready if self.warm else None).start()
            self.argv = self.command(alloc, str(script),
                                     self.warm.command() if self.warm else None,
                                     write_horovodrun_script(self.folder / "horovodrun"))
        else:
            self.argv = self.launch_command(alloc)
        self.group.command = self.argv
        try:
            self.group.start(DRIVER_ID, env)
        except OSError:
            self._cleanup()
            self.done = True
            raise
        return 0

    def reap(self, allocation: Callable[[], Allocation | None]) -> list[ProcessExit]:
        out = []
        for _, code in self.group.reap():
            self._cleanup()
            self.done = True
            if code < 0:  # horovodrun itself was killed: the job is lost with it
                code = 128 - code
            out.append(ProcessExit(DRIVER_ID, code, "finished" if code == 0 else "failed"))
        return out

    def alive(self) -> bool:
        return bool(self.group.alive())

    def stop(self, grace: float) -> None:
        """SIGTERM makes horovodrun end its workers; SIGKILL after ``grace``."""
        self.group.stop(grace=grace)
        self._cleanup()

    def _cleanup(self) -> None:
        if self.mirror is not None:
            self.mirror.stop()
        if self.warm is not None:  # after horovodrun: its last workers may be the zygote's
            self.warm.stop()
            self.warm = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        self.output.close()


class TerminalFilter:
    """horovodrun's output as the launcher prints it: every line to the job's log
    (``sink``, where the node keeps one), and to the terminal (``terminal``) unless
    horovodrun marked it :data:`~.local_run.LOG_ONLY` (the expected ends of workers that a
    reset removed or a cancel stopped; without a log they are dropped: expected, and
    Horovod's own record of them is its exit code, which the job's status reports).
    ``write`` gets whole lines, or the pieces of one long line in turn."""

    def __init__(self, terminal: IO[str], sink: LogSink | None) -> None:
        self.terminal, self.sink = terminal, sink
        self._quiet = False  # the line being written is for the log only
        self._midline = False  # the last write ended inside a line
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            start = not self._midline
            if start:
                self._quiet = text.startswith(LOG_ONLY)
            shown = text.removeprefix(LOG_ONLY) if start else text
            if not self._quiet:
                self.terminal.write(shown)
            if self.sink is not None:
                self.sink.write(shown)
            self._midline = not text.endswith(("\n", "\r"))
        return len(text)

    def flush(self) -> None:
        self.terminal.flush()

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()

"""Worker processes of one job on one node: start, prefix their output, reap, stop.

Output is prefixed like horovodrun's (``[3]<stdout>:line``) with the worker's rank (the
``label`` its driver starts it with: the rank it starts in; its start order on this node
where a driver knows no rank), and optionally also written to
``<output_dir>/<job>/rank.<label>/``.

A worker's end is classified by :func:`classify_exit`: exit 0 while its replica is still
allocated means the training script finished; exit 0 after its replica was removed is a
clean departure from a rescale; death by a signal means the worker was lost (the job's
survivors go on); any other exit code means the script failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from .. import env as envvars
from .devices import DevicePool, DevicesBusy, worker_env
from .logs import LogSink
from .spawn import dying_with_parent

ExitKind = Literal["finished", "departed", "lost", "failed"]


def classify_exit(returncode: int, still_allocated: bool) -> ExitKind:
    if returncode < 0:
        return "lost"
    if returncode == 0:
        return "finished" if still_allocated else "departed"
    return "failed"


@dataclass
class Worker:
    index: int
    worker_id: str
    proc: subprocess.Popen
    label: str = ""  # what its output lines are prefixed with (its rank)
    gpus: tuple[str, ...] = ()  # the GPU(s) it holds until reaped (devices.py)
    ended_at: float | None = None  # when its output ended: (about) when it exited
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


class WorkerGroup:
    """The workers of one job on this node."""

    def __init__(
        self,
        job: str,
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        output_dir: str | None = None,
        stdout: IO[str] | None = None,
        prefix_output: bool = True,
        log_file: str | os.PathLike | None = None,
        devices: DevicePool | None = None,
    ) -> None:
        """``devices``: the node's GPUs, shared by every group of its agent (None: a node
        without GPUs): each worker holds one from its start until it is reaped."""
        self.job, self.command, self.env, self.cwd = job, list(command), dict(env), cwd
        self.devices = devices
        self._reserved: list[str] = []  # GPUs claimed for workers about to start
        # the node's copy of the job's output, as printed (served by launcher/logs.py)
        self.log_sink = LogSink(log_file) if log_file else None
        self.output_dir = Path(output_dir) if output_dir else None
        self.stdout = stdout or sys.stdout
        self.prefix_output = prefix_output
        self.workers: dict[str, Worker] = {}
        self._next_index = 0
        self._lock = threading.Lock()

    def start(self, worker_id: str, extra_env: Mapping[str, str], label: str | None = None,
              command: Sequence[str] | None = None, local_rank: int | None = None) -> Worker:
        """Start one worker (``command``: this worker's, if not the group's); ``label``
        prefixes its output (default: its start order). On a node with GPUs it holds one
        (``CUDA_VISIBLE_DEVICES``: the group's GPUs, its own at ``local_rank``). Raises
        OSError (one line) if the command cannot run, DevicesBusy if no GPU is free."""
        gpu = None
        if self.devices is not None:
            gpu = self._reserved.pop(0) if self._reserved else self.devices.claim(self.job)
        try:
            return self._start(worker_id, extra_env, label, command, local_rank, gpu)
        except BaseException:
            if gpu is not None:
                self.devices.release(gpu)
            raise

    def reserve(self, n: int) -> int:
        """Claim GPUs for the next ``n`` workers to start at once (a group that starts
        together sees all of them); returns how many could be claimed (``n`` on a node
        without GPUs). ``unreserve`` gives back what was not used."""
        if self.devices is None:
            return n
        while len(self._reserved) < n:
            try:
                self._reserved.append(self.devices.claim(self.job))
            except DevicesBusy:
                break
        return len(self._reserved)

    def unreserve(self) -> None:
        while self._reserved:
            self.devices.release(self._reserved.pop())

    def _start(self, worker_id: str, extra_env: Mapping[str, str], label: str | None,
               command: Sequence[str] | None, local_rank: int | None,
               gpu: str | None) -> Worker:
        index = self._next_index
        self._next_index += 1
        if gpu is not None:  # (after the job's env: the GPU a worker holds is not the user's)
            held = [g for w in self.workers.values() for g in w.gpus] + self._reserved
            extra_env = {**extra_env, **worker_env(gpu, held, local_rank)}
        env = envvars.without_secrets({**os.environ, **self.env, **extra_env})
        # Killed (SIGKILL) when this thread ends, so a killed node agent takes its workers
        # along, as a failed node would - set by an exec helper, never by Python code run
        # between fork and exec (preexec_fn): with the store's gRPC threads it aborted
        # the child now and then (spawn.py). Raises OSError if the program is missing.
        argv = dying_with_parent(list(command) if command is not None else self.command,
                                 env, self.cwd)
        proc = subprocess.Popen(
            argv, env=env, cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True,  # so that stop() can signal the worker's whole tree
        )
        worker = Worker(index, worker_id, proc, str(index) if label is None else label,
                        gpus=(gpu,) if gpu is not None else ())
        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            thread = threading.Thread(target=self._pump, args=(worker, name, pipe), daemon=True)
            thread.start()
            worker.threads.append(thread)
        self.workers[worker_id] = worker
        return worker

    def _pump(self, worker: Worker, name: str, pipe: IO[str]) -> None:
        log = None
        if self.output_dir is not None:
            folder = self.output_dir / self.job / f"rank.{worker.label}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                log = open(folder / name, "a", buffering=1)
            except OSError as exc:  # the output still reaches stdout: the pipe never stalls
                with self._lock:
                    self.stdout.write(f"[pollux] cannot write {folder / name}: "
                                      f"{exc.strerror or exc}; output to stdout only\n")
        prefix = f"[{worker.label}]<{name}>:" if self.prefix_output else ""
        try:
            for line in pipe:
                if log is not None:
                    log.write(line)
                if not line.endswith("\n"):  # a last line: never glued to another rank's
                    line += "\n"
                with self._lock:
                    self.stdout.write(prefix + line)
                    self.stdout.flush()
                    if self.log_sink is not None:
                        self.log_sink.write(prefix + line)
        finally:
            if name == "stdout":
                worker.ended_at = time.time()
            if log is not None:
                log.close()

    def reap(self) -> list[tuple[Worker, int]]:
        """Workers that ended since the last call, with their return codes."""
        ended = []
        for wid, worker in list(self.workers.items()):
            code = worker.poll()
            if code is not None:
                for thread in worker.threads:
                    thread.join(timeout=1.0)
                del self.workers[wid]
                for gpu in worker.gpus:  # free only now: its process has exited
                    self.devices.release(gpu)
                ended.append((worker, code))
        if ended and not self.workers and self.log_sink is not None:
            self.log_sink.close()  # (opened again by a later worker's first line)
        return ended

    def alive(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.poll() is None]

    def signal(self, sig: int, only: Collection[str]) -> None:
        """Send ``sig`` to the process groups of the live workers whose ids are in ``only``
        (without waiting for them)."""
        for worker in list(self.workers.values()):
            if worker.worker_id in only and worker.poll() is None:
                _signal_group(worker.proc, sig)

    def stop(self, grace: float = 10.0, only: Collection[str] | None = None) -> None:
        """SIGTERM every worker's process group (or those of the worker ids in ``only``),
        SIGKILL what is left after ``grace``."""
        chosen = [w for w in list(self.workers.values()) if only is None or w.worker_id in only]
        for worker in chosen:
            if worker.poll() is None:
                _signal_group(worker.proc, signal.SIGTERM)
        for worker in chosen:
            try:
                worker.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(worker.proc, signal.SIGKILL)
                worker.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

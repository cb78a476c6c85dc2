"""Worker processes of one job on one node: start, prefix their output, reap, stop.

Output is prefixed like horovodrun's (``[3]<stdout>:line``) with the worker's rank: the
``label`` its driver starts it with (the rank it starts in; its start order on this node
where a driver knows no rank), then the rank of each group it forms, which the worker
announces in-band at the point of its output where it changes (``pollux_launch/output_marks.py``);
the pump then says ``[pollux] worker W is now rank R (was Q)`` once. Optionally its
output is also written, as printed (unprefixed), to ``<output_dir>/<job>/rank.<label>/``
``stdout`` and ``stderr``: named by its *start* label for its whole life (one worker,
one folder: two workers whose ranks swap never write one file), with that same line
where its rank changed.

The pumps read each pipe in binary chunks of ``CHUNK`` bytes and split lines themselves
(``\\r\\n`` read as ``\\n``; UTF-8, undecodable bytes replaced): a run without a newline
is printed in pieces, each a line of its own that fits ``logs.MAX_LINE`` with its prefix
(so a follower never cuts it again), cut between characters. A lone ``\\r`` (a progress
bar redrawn in place, as tqdm does) is passed through as the terminal shows it: each
redraw is printed prefixed and ended with ``\\r``, not as a line of its own, so a bar
stays one line on the user's terminal and in the log (an empty redraw is dropped; each
is printed when the next begins). A pump holds at most about ``MAX_LINE + CHUNK`` bytes,
whatever a worker writes.

A worker's end is classified by :func:`classify_exit`: exit 0 while its replica is still
allocated means the training script finished; exit 0 after its replica was removed is a
clean departure from a rescale; death by a signal means the worker was lost (the job's
survivors go on); any other exit code means the script failed.

A worker's processes (``proctree.py``: its process group and session, its cgroup where
the machine allows one, and those carrying its ``WORKER_TOKEN``) are stopped together:
see :meth:`WorkerGroup.stop`, and :meth:`WorkerGroup.reap` for those that outlive it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from .. import env as envvars
from ..output_marks import MAX_MARK, find_mark
from .devices import DevicePool, DevicesBusy, worker_env
from .logs import MAX_LINE, LogSink
from .proctree import ProcTree, WorkerCgroup, describe, snapshot
from .security import without_secrets
from .spawn import dying_with_parent

log = logging.getLogger(__name__)

ExitKind = Literal["finished", "departed", "lost", "failed"]
CHUNK = 1 << 16  # bytes a pump reads from a pipe at once
POLL = 0.05  # seconds between looks while stop() waits
KILL_WAIT = 10.0  # seconds stop() waits for SIGKILLed processes to be gone
LINGER_EVERY = 5.0  # seconds between looks at what ended workers left running
# ... and how long after its end a worker's leftovers are said in the log (not those that
# end a moment after it: multiprocessing's resource tracker, say)
LINGER_FIRST = 2.0
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)


def classify_exit(returncode: int, still_allocated: bool) -> ExitKind:
    if returncode < 0:
        return "lost"
    if returncode == 0:
        return "finished" if still_allocated else "departed"
    return "failed"


@dataclass(eq=False)  # (one worker is one process: compared by identity)
class Worker:
    index: int
    worker_id: str
    proc: subprocess.Popen
    tree: ProcTree  # its processes (proctree.py)
    label: str = ""  # what its output lines are prefixed with: its rank, as last announced
    gpus: tuple[str, ...] = ()  # the GPU(s) it holds until reaped (devices.py)
    ended_at: float | None = None  # when its output ended: (about) when it exited
    threads: list[threading.Thread] = field(default_factory=list)
    token: str = ""  # its WORKER_TOKEN (output_marks.py, proctree.py)
    start_label: str = ""  # its label at start: names its output_dir folder
    mark_seq: int = 0  # the last rank announcement acted on (output_marks.py)
    stopping: bool = False  # signalled to end: ended only once its process group has
    reaped_at: float | None = None  # (monotonic) when it was reaped with processes left
    warned: bool = False  # those were named in the log

    def __post_init__(self) -> None:
        self.start_label = self.start_label or self.label

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


@dataclass
class _Stream:
    """One pump's state: which of the worker's streams, the label of its lines now, its
    copy under output_dir."""

    name: str
    label: str
    copy: IO[str] | None = None
    midline: bool = False  # the copy's last write ended without a newline


class _Lines:
    """One stream's bytes in, its lines out: ``(text, end, mark)`` - the text of a line
    (decoded, without its end) and how it ended: ``"\\n"``, ``"\\r"`` (a redraw in place:
    a lone carriage return) or ``""`` (a piece of a longer run, or the stream's end); or,
    for a line that is this worker's rank marker (``token``), ``mark`` = (seq, rank) and
    as text what the line held before it (printed without a newline: "" if nothing).
    ``\\r\\n`` ends a line as ``\\n`` does; a run without either is cut into pieces of at
    most ``limit`` bytes, never through a UTF-8 character nor through what may be a
    marker, so that at most ``limit + CHUNK`` bytes are ever held."""

    def __init__(self, limit: int, token: bytes) -> None:
        self.limit, self.token = limit, token
        self.buf = bytearray()
        self.cr = False  # the last chunk ended with \r: a \n first in the next is its own

    def feed(self, chunk: bytes) -> Iterator[tuple[str, str, tuple[int, int] | None]]:
        if self.cr:
            chunk = b"\r" + chunk
        self.cr = chunk.endswith(b"\r")  # (held: a \n first in the next chunk is its end)
        if self.cr:
            chunk = chunk[:-1]
        crs = b"\r" in chunk
        if crs:
            chunk = chunk.replace(b"\r\n", b"\n")
        buf = self.buf
        buf += chunk
        start = 0
        find = _ENDS.search if crs else None  # (the buffer holds no \r: each was an end)
        while True:
            if find is None:
                if (end := buf.find(b"\n", start)) < 0:
                    break
            elif (found_end := find(buf, start)) is None:
                break
            else:
                end = found_end.start()
            if buf[end] == 0x0D:  # a redraw in place (markers end with \n only)
                if end > start:  # (an empty one - tqdm's leading \r - draws nothing)
                    yield _decode(buf, start, end), "\r", None
                start = end + 1
                continue
            found = None
            if self.token and buf.find(b"\x1e", start, end) >= 0:
                found = find_mark(bytes(buf[start:end]), self.token)
            if found is None:
                yield _decode(buf, start, end), "\n", None
            else:
                at, seq, rank = found
                yield _decode(buf, start, start + at), "", (seq, rank)
            start = end + 1
        del buf[:start]  # (cheap: a bytearray drops its head in place)
        while len(buf) > self.limit:  # (self.limit may change with the label meanwhile)
            cut = _cut(buf, self.limit)
            yield _decode(buf, 0, cut), "", None
            del buf[:cut]

    def end(self) -> Iterator[tuple[str, str, tuple[int, int] | None]]:
        if self.cr:  # the stream ended on a redraw: its line is finished
            self.cr = False
            yield from self.feed(b"\n")
        if self.buf:
            yield _decode(self.buf, 0, len(self.buf)), "", None
            self.buf.clear()


_ENDS = re.compile(rb"[\r\n]")


def _decode(buf: bytearray, start: int, end: int) -> str:
    with memoryview(buf) as view:  # (no copy of the bytes first: a piece is 1 MiB)
        return str(view[start:end], "utf-8", "replace")


def _cut(buf: bytearray, limit: int) -> int:
    """Where to cut a piece of at most ``limit`` bytes off ``buf``'s head."""
    cut = limit
    if buf[cut] & 0xC0 == 0x80:  # inside a UTF-8 character: before its first byte
        for at in range(cut - 1, max(cut - 4, 0), -1):
            if buf[at] & 0xC0 == 0xC0:
                cut = at
                break
            if buf[at] & 0xC0 != 0x80:
                break  # not UTF-8 there: any cut will do
    mark = buf.rfind(b"\x1e", max(0, cut - MAX_MARK), cut)
    return mark if mark > 0 else cut  # (a marker then starts the next piece, whole)


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
        # reaped workers whose processes are not all gone: they keep their GPUs
        self.lingering: list[Worker] = []
        self._look_at = 0.0  # (monotonic) when to look at them again
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
        token = secrets.token_hex(8)
        env = without_secrets({**os.environ, **self.env, **extra_env,
                                       envvars.WORKER_TOKEN: token})
        # Killed (SIGKILL) when this thread ends, so a killed node agent takes its workers
        # along, as a failed node would - set by an exec helper, never by Python code run
        # between fork and exec (preexec_fn): with the store's gRPC threads it aborted
        # the child now and then (spawn.py). Raises OSError if the program is missing.
        argv = dying_with_parent(list(command) if command is not None else self.command,
                                 env, self.cwd)
        proc = subprocess.Popen(
            argv, env=env, cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,  # (bytes: _pump)
            start_new_session=True,  # so that stop() can signal the worker's whole tree
        )
        # at once: the exec helper is still running, the worker has forked nothing yet
        tree = ProcTree(proc.pid, token, WorkerCgroup.adopt(proc.pid))
        worker = Worker(index, worker_id, proc, tree, str(index) if label is None else label,
                        gpus=(gpu,) if gpu is not None else (), token=token)
        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            # each stream starts under the start label, made here and not read from
            # worker.label: stdout's pump, already running, may have switched that to the
            # worker's announced rank before stderr's stream is made
            stream = _Stream(name, worker.start_label, self._open_copy(worker, name))
            thread = threading.Thread(target=self._pump, args=(worker, stream, pipe),
                                      daemon=True)
            thread.start()
            worker.threads.append(thread)
        self.workers[worker_id] = worker
        return worker

    # -- output --------------------------------------------------------------------------
    def _pump(self, worker: Worker, stream: _Stream, pipe: IO[bytes]) -> None:
        lines = _Lines(self._limit(stream), worker.token.encode())
        try:
            fd = pipe.fileno()
            while chunk := os.read(fd, CHUNK):
                for text, end, mark in lines.feed(chunk):
                    self._line(worker, stream, lines, text, end, mark)
            for text, end, mark in lines.end():
                self._line(worker, stream, lines, text, end, mark)
        finally:
            if stream.name == "stdout":
                worker.ended_at = time.time()
            pipe.close()
            if stream.copy is not None:
                with contextlib.suppress(OSError):  # (only the copy loses its tail: printed)
                    stream.copy.close()

    def _open_copy(self, worker: Worker, name: str) -> IO[str] | None:
        if self.output_dir is None:
            return None
        folder = self.output_dir / self.job / f"rank.{worker.start_label}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return open(folder / name, "a", buffering=1, encoding="utf-8")
        except OSError as exc:  # the output still reaches stdout: the pipe never stalls
            self._say(f"[pollux] cannot write {folder / name}: {exc.strerror or exc}; "
                      "output to stdout only\n")
            return None

    def _limit(self, stream: _Stream) -> int:
        """The longest piece of a line without a newline: with its prefix and newline, it
        fits MAX_LINE."""
        prefix = f"[{stream.label}]<{stream.name}>:" if self.prefix_output else ""
        return max(4096, MAX_LINE - 1 - len(prefix.encode()))

    def _line(self, worker: Worker, stream: _Stream, lines: _Lines, text: str,
              end: str, mark: tuple[int, int] | None) -> None:
        if text or mark is None:  # (text before a marker: printed with no newline after)
            self._print(stream, text, end)
        if mark is not None:
            self._switch(worker, stream, mark[0], str(mark[1]))
            lines.limit = self._limit(stream)

    def _print(self, stream: _Stream, line: str, end: str) -> None:
        """``end``: as _Lines gives it; printed, a piece ends its line too."""
        if stream.copy is not None:
            self._copy(stream, line, end)
            stream.midline = end != "\n"
        prefix = f"[{stream.label}]<{stream.name}>:" if self.prefix_output else ""
        end = end or "\n"
        if len(line) < CHUNK:
            self._say(f"{prefix}{line}{end}")
        else:  # (no prefixed copy of a long one: a piece is up to 1 MiB)
            self._say(prefix, line, end)

    def _copy(self, stream: _Stream, *parts: str) -> None:
        try:
            for part in parts:
                stream.copy.write(part)
        except OSError as exc:  # (a full disk): said once; the pipe must never stall
            path = getattr(stream.copy, "name", "?")
            stream.copy = None
            self._say(f"[pollux] cannot write {path}: {exc.strerror or exc}; output to "
                      "stdout only\n")

    def _say(self, *parts: str) -> None:
        """Print one line (given in ``parts``) to stdout and the job's log."""
        with self._lock:
            self._write(*parts)

    def _write(self, *parts: str) -> None:
        """``_say`` with ``self._lock`` held already."""
        for part in parts:
            self.stdout.write(part)
        self.stdout.flush()
        if self.log_sink is not None:
            for part in parts:
                self.log_sink.write(part)

    def _switch(self, worker: Worker, stream: _Stream, seq: int, rank: str) -> None:
        """The worker announced (``seq``) that its next lines are rank ``rank``'s: said
        once per change, at the first of its streams that shows it."""
        with self._lock:
            if seq > worker.mark_seq:
                worker.mark_seq = seq
                if rank != worker.label:
                    self._write(f"[pollux] worker {worker.worker_id} is now rank {rank} "
                                f"(was {worker.label})\n")
                worker.label = rank
        if rank != stream.label and stream.copy is not None:
            self._copy(stream, ("\n" if stream.midline else "") + f"[pollux] worker "
                       f"{worker.worker_id} is now rank {rank} (was {stream.label})\n")
            stream.midline = False
        stream.label = rank

    # -- ends ----------------------------------------------------------------------------
    def reap(self) -> list[tuple[Worker, int]]:
        """Workers that ended since the last call, with their return codes.

        A worker signalled to end (:meth:`signal`, :meth:`stop`) has ended once its process
        group and session are gone too: its driver's SIGKILL still reaches what is left.
        A worker that ended with processes of its own still running (a child that outlived
        it, a daemon it started: ``proctree.py``) is reported as ended, and if they are
        still running ``LINGER_FIRST`` seconds later, one warning in the agent's log names
        them. They keep its GPU, released only once they are gone (looked at every
        ``LINGER_EVERY`` seconds) or :meth:`stop` killed them - at the job's end, or
        the agent's; until then they live on."""
        exited = [(w, code) for w in self.workers.values() if (code := w.poll()) is not None]
        now = time.monotonic()
        look = bool(self.lingering) and now >= self._look_at
        if not exited and not look:
            return []
        before = list(self.lingering)
        procs = snapshot([w.tree.tag for w, _ in exited] + [w.tree.tag for w in before])
        ended = []
        for worker, code in exited:
            if worker.stopping and worker.tree.group(procs, leader_exited=True):
                continue  # still stopping
            del self.workers[worker.worker_id]
            ended.append((worker, code))
            left = worker.tree.members(procs, leader_exited=True)
            if not left:
                for thread in worker.threads:  # (its last lines first)
                    thread.join(timeout=1.0)
                self._free(worker)
                continue
            # (not waiting for its pumps: what it left running may hold its pipes for good)
            worker.reaped_at = now
            self.lingering.append(worker)
            self._look_at = min(self._look_at if before else now + LINGER_FIRST,
                                now + LINGER_FIRST)
        if look:
            for worker in before:
                left = worker.tree.members(procs, leader_exited=True)
                if not left:
                    if worker.warned:
                        log.info("job %s: the processes worker %s left running have ended",
                                 self.job, worker.worker_id)
                    self._settled(worker)
                elif not worker.warned and now - worker.reaped_at >= LINGER_FIRST:
                    worker.warned = True
                    log.warning("job %s: worker %s (rank %s) exited %s but left %d "
                                "process(es) running: %s%s; they are killed when the job's "
                                "processes here are stopped", self.job, worker.worker_id,
                                worker.label, worker.poll(), len(left), describe(left),
                                f"; they keep its GPU {','.join(worker.gpus)} until they "
                                "end" if worker.gpus else "")
            soon = any(not w.warned for w in self.lingering)
            self._look_at = now + (LINGER_FIRST if soon else LINGER_EVERY)
        if ended and not self.workers and self.log_sink is not None:
            self.log_sink.close()  # (opened again by a later worker's first line)
        return ended

    def _free(self, worker: Worker) -> None:
        """Its processes are gone: its GPU is free (and its cgroup removed)."""
        if self.devices is not None:
            for gpu in worker.gpus:
                self.devices.release(gpu)
        worker.tree.close()

    def _settled(self, worker: Worker) -> None:
        self.lingering.remove(worker)
        self._free(worker)

    def alive(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.poll() is None]

    def signal(self, sig: int, only: Collection[str]) -> None:
        """Send ``sig`` to the process groups of the workers whose ids are in ``only``
        (without waiting for them); SIGKILL goes to all of each one's processes
        (``proctree.py``). After SIGTERM, SIGINT or SIGKILL a worker has ended only once
        its process group has (:meth:`reap`)."""
        chosen = [w for w in self.workers.values() if w.worker_id in only]
        if sig == signal.SIGKILL:
            self._kill_once(chosen, [w for w in chosen if w.poll() is None])
            return
        for worker in chosen:
            worker.stopping = worker.stopping or sig in STOPPING
            worker.tree.signal_group(sig)

    def stop(self, grace: float = 10.0, only: Collection[str] | None = None) -> None:
        """Stop every worker (or those whose ids are in ``only``), with the processes left
        by those already reaped: SIGTERM each one's process group; wait up to ``grace``
        for the worker and every process of its group and session to be gone; then
        SIGKILL all of it - its group (even where the worker itself has exited), its
        cgroup, and its other processes found (``proctree.py``: a daemon that left its
        session is found by its cgroup where the machine allows one, else by the worker's
        token in its environment; one that also replaced its environment escapes without
        a cgroup) - and wait until they are gone (at most ``KILL_WAIT`` seconds more;
        what is left then is named in the log). Returns after that: the caller's reap
        then frees the workers' slots and GPUs; those of workers reaped before are freed
        here."""
        chosen = [w for w in self.workers.values() if only is None or w.worker_id in only]
        chosen += [w for w in self.lingering if only is None or w.worker_id in only]
        if not chosen:
            return
        exited = {w: w.poll() is not None for w in chosen}
        procs = snapshot()
        for worker in chosen:
            if exited[worker]:
                worker.tree.group(procs, leader_exited=True)  # (an empty one is not signalled)
            worker.stopping = True
            worker.tree.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if all(w.poll() is not None for w in chosen):
                procs = snapshot()
                if not any(w.tree.group(procs, leader_exited=True) for w in chosen):
                    break
            time.sleep(POLL)
        reaped = [w for w in self.lingering if w in chosen]
        procs = snapshot([w.tree.tag for w in reaped]) if reaped else []
        for worker in reaped:
            left = worker.tree.members(procs, leader_exited=True)
            if left:  # (the job's end: what its workers left running is said, then killed)
                log.warning("job %s: killing %d process(es) worker %s (exited %s) left "
                            "running: %s", self.job, len(left), worker.worker_id,
                            worker.poll(), describe(left))
        survivors = self._kill(chosen)
        for worker in [w for w in self.lingering if w in chosen and w not in survivors]:
            self._settled(worker)

    def _kill(self, chosen: list[Worker]) -> list[Worker]:
        """SIGKILL all of each worker's processes, again until they are gone (at most
        KILL_WAIT seconds); returns the workers some of whose processes are not (named in
        the log: a process stuck in the kernel, say)."""
        deadline = time.monotonic() + KILL_WAIT
        while True:
            running = [w for w in chosen if w.poll() is None]
            procs = snapshot([w.tree.tag for w in chosen])
            left = {w: w.tree.members(procs, leader_exited=w not in running) for w in chosen}
            survivors = [w for w in chosen if w in running or left[w]]
            if not survivors:
                return []
            if time.monotonic() >= deadline:
                for w in survivors:
                    log.warning("job %s: worker %s: %s still alive %.0f s after SIGKILL",
                                self.job, w.worker_id,
                                describe(left[w] | ({w.pid} if w in running else set())),
                                KILL_WAIT)
                return survivors
            self._kill_once(chosen, running, left)
            time.sleep(POLL)

    @staticmethod
    def _kill_once(chosen: list[Worker], running: list[Worker],
                   left: dict[Worker, set[int]] | None = None) -> None:
        """SIGKILL the workers' processes (``left``: found just now, else looked for)."""
        if left is None:
            procs = snapshot([w.tree.tag for w in chosen])
            left = {w: w.tree.members(procs, leader_exited=w not in running) for w in chosen}
        for w in chosen:
            w.stopping = True
            if w in running:
                w.proc.kill()
            w.tree.kill(left[w])

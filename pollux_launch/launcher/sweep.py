"""``pollux-run --sweep FILE [flags]``: several jobs from one command line, sharing one
cluster's GPUs under its policy (the allocation of ``--slurm``, or ``--store``'s).

FILE has one job per line: a command, optionally preceded by ``pollux-run``'s job flags
(``-np 2 --max-np 8 python train.py --lr 0.1``); blank lines and ``#`` comments are
skipped. Each line is parsed as ``pollux-run [the command line's flags] [the line]``: the
command line's flags are every job's defaults, a line's own flags win. A line's job is
named by its own ``--job-name`` (or ``--rdzv-id``), else ``BASE-N``: N its number among
the file's jobs (from 1), BASE the command line's ``--job-name``, else the Slurm job's
id, else the file's name - so a requeued allocation resumes the same jobs. A
``--checkpoint-dir`` on the command line is the parent of every job's folder (job
``BASE-N`` writes to ``DIR/BASE-N``): two jobs never share one.

All jobs are submitted at once and followed together (:func:`run_jobs`); each job's
worker output comes prefixed with its name. The exit code is 0 when every job
succeeded, else the first failed job's (in file order); SIGINT/SIGTERM cancel every job.
"""

from __future__ import annotations

import io
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from .. import env as envvars
from ..arguments import OptionsError
from ..errors import UserError
from .launch_options import LaunchOptions
from .options import build_parser, parse_launch_args

SWEEP_FLAG = "--sweep"
# run.launch: (options, output stream or None, the caller's received signals or None)
Launch = Callable[..., int]
MAX_JOBS = 256  # a longer file is a mistake (a data file given by accident)


def parse_jobs(argv: Sequence[str], cwd: str | Path = ".",
               environ: dict[str, str] | None = None) -> list[LaunchOptions]:
    """The jobs of ``pollux-run [flags] COMMAND...`` (one) or of ``pollux-run --sweep
    FILE [flags]`` (module docstring), every one validated before any starts. Raises
    OptionsError (one line; for a sweep, naming the file's line)."""
    argv = list(argv)
    path = build_parser().parse_args(argv).sweep
    if path is None:
        return [parse_launch_args(argv, cwd)]
    return _parse_sweep(path, _without_sweep(argv), Path(cwd),
                        dict(os.environ if environ is None else environ))


def _without_sweep(argv: list[str]) -> list[str]:
    """``argv`` less its ``--sweep FILE`` / ``--sweep=FILE`` (every word of a sweep's
    command line is a flag: the commands are the file's)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == SWEEP_FLAG:
            i += 2
        elif argv[i].startswith(SWEEP_FLAG + "="):
            i += 1
        else:
            out.append(argv[i])
            i += 1
    return out


def _parse_sweep(path: str, argv: list[str], cwd: Path,
                 environ: dict[str, str]) -> list[LaunchOptions]:
    outer = build_parser().parse_args(argv)
    if outer.command:
        raise OptionsError(f"{SWEEP_FLAG} {path}: the commands come from the file; drop "
                           f"{shlex.join(outer.command)[:80]!r} from the command line")
    file = cwd / path
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionsError(f"{SWEEP_FLAG} {path}: cannot read it ({exc})") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise OptionsError(f"{path}:{number}: {exc}") from None
        if words:
            lines.append((number, words))
    if not lines:
        raise OptionsError(f"{SWEEP_FLAG} {path}: no job in it (one command per line)")
    if len(lines) > MAX_JOBS:
        raise OptionsError(f"{SWEEP_FLAG} {path}: {len(lines)} jobs; at most {MAX_JOBS}")
    base = outer.job_name or outer.rdzv_id or environ.get(envvars.SLURM_JOB_ID) \
        or _name_part(file.stem)
    jobs: list[LaunchOptions] = []
    for n, (number, words) in enumerate(lines, 1):
        try:
            own = build_parser().parse_args(words)
            name = own.job_name or own.rdzv_id or f"{base}-{n}"
            extra = ["--job-name", name]
            if outer.checkpoint_dir and not own.checkpoint_dir:
                extra += ["--checkpoint-dir", str(Path(outer.checkpoint_dir) / name)]
            jobs.append(parse_launch_args([*argv, *extra, *words], cwd))
        except UserError as exc:
            raise OptionsError(f"{path}:{number}: {exc}") from None
    names = [j.job_name for j in jobs]
    if len(set(names)) < len(names):
        twice = sorted({x for x in names if names.count(x) > 1})
        raise OptionsError(f"{SWEEP_FLAG} {path}: job name {twice[0]!r} on two lines; give "
                           "each line its own --job-name")
    if len({(j.slurm, j.store, j.store_prefix, j.secret_file) for j in jobs}) > 1:
        raise OptionsError(f"{SWEEP_FLAG} {path}: the jobs share one cluster: give --slurm, "
                           "--store, --store-prefix and --secret-file on the command line, "
                           "not on a line")
    if not jobs[0].slurm and (jobs[0].store or "embedded").startswith("embedded"):
        raise OptionsError(f"{SWEEP_FLAG}: the jobs share a cluster: add --slurm (inside a "
                           "Slurm allocation) or --store etcd://HOST:PORT")
    return jobs


def _name_part(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in text.lower())
    return cleaned.strip("-_.")[:40] or "sweep"


class _Prefixed(io.TextIOBase):
    """A text stream that writes whole lines to ``out`` (under ``lock``), each worker
    line prefixed with ``name``; pollux's own lines name their job already."""

    def __init__(self, out: IO[str], name: str, lock: threading.Lock) -> None:
        self.out, self.prefix, self.lock = out, f"{name} | ", lock
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            with self.lock:
                for line in lines:
                    head = "" if line.startswith("[pollux] ") else self.prefix
                    self.out.write(f"{head}{line}\n")
                self.out.flush()
        return len(text)

    def flush(self) -> None:
        with self.lock:
            self.out.flush()


def launch_jobs(jobs: Sequence[LaunchOptions], launch: Launch,
                signals: list[int] | None = None) -> int:
    """One job: ``launch`` it here (it follows the job and handles its signals); several:
    :func:`run_jobs`. ``signals``: the SIGINT/SIGTERM the caller received (shared)."""
    return launch(jobs[0], None, signals) if len(jobs) == 1 \
        else run_jobs(jobs, launch, signals=signals)


def run_jobs(jobs: Sequence[LaunchOptions], launch: Launch, stdout: IO[str] | None = None,
             signals: list[int] | None = None) -> int:
    """Launch every job of ``jobs`` at once (each ``launch(opts, stdout)`` in a thread
    of its own) and wait for all; SIGINT/SIGTERM (in the main thread; or already in
    ``signals``, the caller's record of them) cancel them all. Returns 0 if all
    succeeded, else the first failure's exit code (in order)."""
    stdout = stdout or sys.stdout
    lock = threading.Lock()
    codes: dict[int, int] = {}
    errors: dict[int, BaseException] = {}

    interrupted: list[int] = signals if signals is not None else []

    def one(i: int, opts: LaunchOptions) -> None:
        try:  # (each follower cancels its job once a signal is in `interrupted`)
            codes[i] = launch(opts, _Prefixed(stdout, opts.job_name, lock), interrupted)
        except BaseException as exc:  # (re-raised below, in the main thread)
            errors[i] = exc
            codes[i] = 1

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda signum, _f: interrupted.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    threads = [threading.Thread(target=one, args=(i, o), name=f"job-{o.job_name}",
                                daemon=True) for i, o in enumerate(jobs)]
    try:
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            for thread in threads:
                thread.join(timeout=0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for i in sorted(errors):
        if isinstance(errors[i], UserError):
            print(f"[pollux] {jobs[i].job_name}: not run: {errors[i]}", file=stdout,
                  flush=True)
        else:
            raise errors[i]
    failed = [(o.job_name, codes[i]) for i, o in enumerate(jobs) if codes.get(i, 1) != 0]
    print(f"[pollux] sweep: {len(jobs) - len(failed)} of {len(jobs)} job(s) succeeded"
          + (": failed " + ", ".join(f"{n} (exit code {c})" for n, c in failed)
             if failed else ""), file=stdout, flush=True)
    if interrupted:
        return 128 + interrupted[0]
    return failed[0][1] if failed else 0

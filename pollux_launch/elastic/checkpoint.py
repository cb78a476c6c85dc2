"""Durable checkpoints of a job's elastic state.

A checkpoint is what a job needs to go on after every one of its workers died (a node
lost, a preemption, a batch system's SIGTERM): the training state that the replicas
otherwise keep identical among themselves (model, optimizer, scheduler, loader position,
agent statistics, progress). Replicas hold the same state, so one copy - rank 0's - is
enough and the layout does not depend on the number of replicas: a job resumes at
whatever size it is given next.

Layout of a job's checkpoint directory::

    DIR/latest                  {"name": "ckpt-00000042"}: the newest complete checkpoint
    DIR/ckpt-00000042/meta.json {"step", "progress", "time", "replicas"}
    DIR/ckpt-00000042/state.pt  the state: tensors, numbers, strings, lists and dicts only
    DIR/ckpt-00000042/shards/   a sharded job's model and optimizer shards, written by
                                every rank (``torch.distributed.checkpoint``); its
                                ``state.pt`` holds the rest, with ``"shards": True``

A sharded job's ranks write their shards into ``DIR/shards-<step>`` in the background
(each rank its own; the checkpoint directory is then shared by the job's nodes), and
rank 0's writer waits for that write (``pending``) before it moves the folder into the
checkpoint it commits; ``latest_checkpoint`` gives its path as the state's ``"shards"``.

Protocol: ``save`` snapshots the state on the caller's thread (tensors copied to CPU, so
that training may go on mutating its own) and hands it to one background thread, which
writes ``ckpt-N.tmp/``, fsyncs the files and the folder, renames it to ``ckpt-N``, then
replaces ``latest`` the same way (write, fsync, rename). A crash at any point leaves the
previous checkpoint intact and named by ``latest``. A save asked for while one is being
written is skipped (the next one is due soon), so the training thread never waits.

Nothing read back is unpickled into code: ``state.pt`` is loaded with
``torch.load(weights_only=True)`` and ``meta.json`` is JSON; a malformed checkpoint is
refused with :class:`CheckpointError` and the caller starts afresh, logging why.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pollux_launch.errors import UserError

log = logging.getLogger(__name__)

LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{8})$")
# a write that failed for want of room: the file system is full, or the user's quota is
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read back (missing, truncated, not ours)."""


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint read back: its state and what it was taken at."""

    path: Path
    step: int
    progress: float
    time: float
    replicas: int
    state: dict[str, Any]


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that later training cannot change: tensors cloned to CPU,
    containers copied, other leaves (numbers, strings) shared."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _Sink:
    """``torch.save``'s file, remembering the ``OSError`` a write raised: torch reports a
    failed write as a ``RuntimeError`` of its own (``unexpected pos ...``), which says
    neither that nor why; the remembered error does (its errno)."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def _save(state: dict[str, Any], file: Any) -> None:
    """``torch.save`` into ``file``; a write that failed raises its own ``OSError``."""
    sink = _Sink(file)
    try:
        torch.save(state, sink)
    except RuntimeError:
        if sink.error is not None:
            raise sink.error from None
        raise


def _wait_for(pending: Any) -> None:
    """The ranks' shard writes (a future): done, or a RuntimeError saying why not (DCP
    raises a ``BaseException`` of its own for a rank's failed write)."""
    try:
        pending.result()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is one
        raise RuntimeError(f"the ranks' shards were not all written: "
                           f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                           ) from None


def _megabytes(obj: Any) -> str:
    """The size of ``obj``'s tensors, e.g. ``35.9 MB``."""
    def size(o: Any) -> int:
        if isinstance(o, torch.Tensor):
            return o.element_size() * o.nelement()
        if isinstance(o, dict):
            return sum(size(v) for v in o.values())
        if isinstance(o, list | tuple):
            return sum(size(v) for v in o)
        return 0

    mb = size(obj) / 1e6
    return f"{mb:.1f} MB" if mb < 10 else f"{mb:.0f} MB"


def latest_checkpoint(directory: str | os.PathLike) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory``, or None if there is none.
    Raises :class:`CheckpointError` when ``latest`` names one that cannot be read."""
    root = Path(directory)
    try:
        pointer = json.loads((root / LATEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{root / LATEST}: unreadable ({exc})") from None
    name = pointer.get("name") if isinstance(pointer, dict) else None
    if not isinstance(name, str) or not _NAME.match(name):
        raise CheckpointError(f"{root / LATEST}: names no checkpoint of this layout")
    path = root / name
    try:
        meta = json.loads((path / "meta.json").read_text())
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        if isinstance(state, dict) and state.get("shards") is True:
            state["shards"] = str(path / "shards")  # (where every rank reads its part)
        return Checkpoint(path, int(meta["step"]), float(meta["progress"]),
                          float(meta["time"]), int(meta["replicas"]), state)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError,
            pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{path}: cannot be read back ({exc})") from None


class CheckpointWriter:
    """Writes a job's checkpoints into ``directory`` from one background thread.

    ``every`` seconds between checkpoints (``due``); ``keep`` complete checkpoints kept.
    """

    def __init__(self, directory: str | os.PathLike, every: float = 60.0, keep: int = 2,
                 clock=time.monotonic) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every, self.keep, self.clock = every, max(1, keep), clock
        self._last = clock()
        self._busy = threading.Lock()
        self._thread: threading.Thread | None = None
        self.saved = 0  # checkpoints completed
        self.write_s = 0.0  # time the last one took to write (background)
        self.error: BaseException | None = None  # the last write's failure, if any
        self.snapshot_s = 0.0  # the training thread's part of the last save (the copy)
        self._seq = 0

    def due(self) -> bool:
        return self.clock() - self._last >= self.every

    def save(self, state: dict[str, Any], *, step: int, progress: float, replicas: int,
             wait: bool = False, pending: Any = None, shards: str | None = None) -> bool:
        """Snapshot ``state`` now and write it in the background (``wait``: before
        returning). False if a write was still in progress (nothing is taken then).
        ``shards``: the folder (in the directory) the ranks' shards are being written to,
        moved into this checkpoint once ``pending.result()`` returned (module docstring)."""
        if not self._busy.acquire(blocking=wait):
            return False
        self._last = self.clock()
        t0 = time.perf_counter()
        try:
            frozen = snapshot(state)
            self.snapshot_s = time.perf_counter() - t0
        except BaseException:
            self._busy.release()
            raise
        meta = {"step": int(step), "progress": float(progress), "time": time.time(),
                "replicas": int(replicas)}
        if shards is not None:
            frozen["shards"] = True
        self._thread = threading.Thread(target=self._write, args=(frozen, meta, pending, shards),
                                        name="pollux-checkpoint", daemon=True)
        self._thread.start()
        if wait:
            self.flush()
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the write in progress, if any."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _write(self, state: dict[str, Any], meta: dict[str, Any], pending: Any = None,
               shards: str | None = None) -> None:
        t0 = time.perf_counter()
        tmp = done = None  # the folder being written; the complete one, not yet `latest`
        try:
            # rank 0 may be another process than the one that wrote the last checkpoint
            names = [int(m.group(1)) for p in self.directory.iterdir()
                     if (m := _NAME.match(p.name))]
            self._seq = max([self._seq, *names]) + 1
            name = f"ckpt-{self._seq:08d}"
            tmp = self.directory / f"{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            with open(tmp / "state.pt", "wb") as f:
                _save(state, f)
                f.flush()
                os.fsync(f.fileno())
            _write_file(tmp / "meta.json", json.dumps(meta).encode())
            if shards is not None:  # every rank's shards, once all of them are written
                _wait_for(pending)
                os.replace(self.directory / shards, tmp / "shards")
            _fsync_dir(tmp)
            os.replace(tmp, self.directory / name)
            tmp, done = None, self.directory / name
            _write_file(self.directory / f"{LATEST}.tmp", json.dumps({"name": name}).encode())
            os.replace(self.directory / f"{LATEST}.tmp", self.directory / LATEST)
            done = None
            _fsync_dir(self.directory)
            self._prune(name)
            self.saved += 1
            self.write_s = time.perf_counter() - t0
            self.error = None
        except (OSError, RuntimeError) as exc:  # a full disk must not stop training
            # what this write left goes (on a full disk, room for the next one): the
            # partial folder, the pointer's temporary file, a complete folder that
            # `latest` does not name; the last good checkpoint stays as it was
            for path in (tmp, done):
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
            (self.directory / f"{LATEST}.tmp").unlink(missing_ok=True)
            if self.error is None:  # (said once while the failures last)
                log.error("%s", self._failure(exc, state))
            self.error = exc
        finally:
            self._busy.release()

    def _failure(self, exc: BaseException, state: dict[str, Any]) -> str:
        """One line saying why a checkpoint was not written."""
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            kept = ("the last good checkpoint is kept" if (self.directory / LATEST).exists()
                    else "there is no earlier one")
            return (f"no space left on {self.directory} (checkpoint of {_megabytes(state)} "
                    f"not written; {kept})")
        return f"checkpoint to {self.directory} failed: {exc} (training goes on)"

    def _prune(self, newest: str) -> None:
        done = sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))
        for path in done[:-self.keep]:
            if path.name != newest:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.directory.glob("shards-*"):  # of saves that never committed
            shutil.rmtree(path, ignore_errors=True)

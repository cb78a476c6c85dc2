"""Pre-started Horovod newcomers: a job's survivors need not wait for Python to import
torch at a scale-up.

Horovod's elastic driver starts a newcomer only after the survivors have reset (at the
end of their ``hvd.init()`` barrier), so the survivors' pause on a grow is the newcomer's
start-up: Python, ``import torch, horovod``, the first optimizer (seconds). The native
pollux path pre-starts newcomers and lets them wait; this module does the same for a
Horovod job without touching Horovod's protocol (real ``horovodrun``, real resets):

* the job's command, as horovodrun runs it, is wrapped in :mod:`.handoff`
  (:meth:`WarmStart.command`), a stdlib-only shim that hands each worker to the job's
  warm *zygote* (:mod:`.zygote`) - a Python that has already imported everything - or
  starts it cold when there is none;
* the zygote is started on the job's first grow (:meth:`WarmStart.ready`, the
  :class:`~.hosts.HostsFileMirror`'s gate), and the mirror reports the grown host list
  to Horovod's discovery only once the zygote is listening, so the survivors train on,
  at the old size, while it imports; later grows find it ready.

A worker forked by the zygote runs the command from its first line with the stdio,
environment and directory Horovod gave the shim, and its exit code is the shim's: to
Horovod it is the process it started (``ps`` shows it with the zygote's command line;
its shim shows the job's). Only ``python [-u -B -O -q -X.. -W..] SCRIPT|-m MODULE|-c
CODE`` commands are pre-started; others start as before. ``POLLUX_HVD_WARM=0`` in the
launcher's environment turns it off. Measured (benchmarks/horovod_rescale.py, 2 -> 4 on a
busy 2-core machine): the survivors' pause went from 8-12 s to 0.9-1.3 s; what is left
is Horovod's own reset (its per-worker launch, the gloo rendezvous, ``state.sync()``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pollux_launch import env as envvars

log = logging.getLogger(__name__)

ENV_SOCKET = envvars.HVD_ZYGOTE  # the shim's: where the job's zygote listens
ENV_COMMAND = envvars.HVD_WARM_COMMAND  # the zygote's: the job's command, as JSON
ENV_SWITCH = envvars.HVD_WARM  # "0" in the launcher's environment: newcomers start cold
HANDOFF = Path(__file__).with_name("handoff.py")
# How long the survivors' grow may wait for the zygote's first start before the new
# hosts are reported anyway (newcomers then start cold, as without it).
READY_WAIT = 120.0

_PYTHON = re.compile(r"python[0-9.]*")
_FLAGS = set("uBOq")  # interpreter flags that mean the same to the zygote and a worker


@dataclass(frozen=True)
class PythonCommand:
    """``python [flags] (script | -m module | -c code) args...``, split."""

    interpreter: tuple[str, ...]  # the executable and its flags
    script: str | None
    module: str | None
    code: str | None
    args: tuple[str, ...]


def python_command(command: Sequence[str]) -> PythonCommand | None:
    """``command`` split as Python would read it; None when it is not a plain Python
    command (another program, or flags whose effect a zygote could not share)."""
    if not command or not _PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    i = 1
    while i < len(command):
        word = command[i]
        if word in ("-m", "-c"):
            if i + 1 >= len(command):
                return None
            value, rest = command[i + 1], tuple(command[i + 2:])
            return PythonCommand(tuple(command[:i]), None, *(
                (value, None) if word == "-m" else (None, value)), rest)
        if word in ("-X", "-W") and i + 1 < len(command):
            i += 2
        elif word.startswith(("-X", "-W")) and len(word) > 2:
            i += 1
        elif word.startswith("-") and len(word) > 1 and set(word[1:]) <= _FLAGS:
            i += 1
        elif word.startswith("-"):
            return None
        else:
            return PythonCommand(tuple(command[:i]), word, None, None, tuple(command[i + 1:]))
    return None


class WarmStart:
    """The warm start of one Horovod job's newcomers (see the module docstring).

    ``env`` is the job's environment (what horovodrun gets, beyond this process's),
    ``stdout`` where the zygote's own messages go. The zygote's socket lives in a
    private (0700) folder of its own, short enough for a socket path. ``stop()`` ends
    the zygote and removes that folder (call it after horovodrun has ended).
    """

    def __init__(self, job: str, command: Sequence[str], env: Mapping[str, str],
                 cwd: str | None = None, stdout: IO[str] | None = None,
                 ready_wait: float = READY_WAIT) -> None:
        self.job, self.user_command = job, list(command)
        self.target = python_command(command)
        self.enabled = self.target is not None and os.environ.get(ENV_SWITCH, "1") != "0"
        self.env, self.cwd, self.stdout = dict(env), cwd, stdout
        self.folder = Path(tempfile.mkdtemp(prefix="pollux-z-")) if self.enabled else None
        self.socket = (self.folder or Path(os.devnull)) / "zygote.sock"
        self.ready_wait = ready_wait
        self.group = None  # the zygote's WorkerGroup, once started
        self.served = False  # the current zygote was ready (its death: start another)
        self.given_up = False
        self._since: float | None = None  # when the current wait for it began
        self.ready_at: float | None = None  # wall time it was first seen ready

    def command(self) -> list[str]:
        """What horovodrun should run for each worker."""
        if not self.enabled:
            return list(self.user_command)
        return [sys.executable, "-I", "-S", str(HANDOFF), *self.user_command]

    def environment(self) -> dict[str, str]:
        """What horovodrun's environment needs beyond the job's."""
        return {ENV_SOCKET: str(self.socket)} if self.enabled else {}

    def ready(self) -> bool:
        """The mirror's gate before reporting more slots: True once newcomers can be
        handed to a listening zygote, or when there will be none (disabled, failed,
        waited ``ready_wait``); else starts the zygote if needed and returns False."""
        if not self.enabled or self.given_up:
            return True
        alive = self._alive()
        if alive and self.socket.exists():
            if not self.served:
                log.info("job %s: newcomers pre-started (warm zygote ready)", self.job)
            self.served, self._since = True, None
            self.ready_at = self.ready_at or time.time()
            return True
        if not alive:
            if self.group is not None and not self.served:
                return self._give_up("the warm zygote ended before it was ready")
            self._start()  # the first time, or again after a zygote that served died
            if self.given_up:
                return True
        if self._since is None:
            self._since = time.monotonic()
        elif time.monotonic() - self._since > self.ready_wait:
            return self._give_up(f"the warm zygote was not ready in {self.ready_wait:.0f} s")
        return False

    def stop(self) -> None:
        self.enabled = False  # (a late ready() starts nothing: newcomers start cold)
        if self.group is not None:
            self.group.stop(grace=5.0)
            self.group.reap()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _alive(self) -> bool:
        return self.group is not None and bool(self.group.alive())

    def _start(self) -> None:
        from pollux_launch.launcher.workers import WorkerGroup

        assert self.target is not None
        if self.group is not None:
            self.group.reap()
        self.served = False
        self.socket.unlink(missing_ok=True)
        argv = [*self.target.interpreter, "-m", "pollux_launch.adapters.horovod.launch.zygote",
                str(self.socket)]
        self.group = WorkerGroup(self.job, argv, self.env, cwd=self.cwd, stdout=self.stdout)
        try:  # (Horovod starts every worker with PYTHONUNBUFFERED=1: the zygote's stdio is
            # theirs)
            self.group.start("zygote", {ENV_COMMAND: json.dumps(self.user_command),
                                        "PYTHONUNBUFFERED": "1"}, label="warm")
        except OSError as exc:
            self._give_up(f"cannot start the warm zygote ({exc})")

    def _give_up(self, why: str) -> bool:
        self.given_up = True
        log.warning("job %s: %s; newcomers start cold", self.job, why)
        return True

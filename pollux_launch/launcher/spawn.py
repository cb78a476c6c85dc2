"""Starting a worker that dies with the thread that started it, with no Python code run
between fork and exec.

A node agent holds gRPC threads (the etcd store's keep-alive and watch streams). Running
Python in a fork child before exec (``subprocess.Popen(preexec_fn=...)``) makes CPython
use ``fork()`` and run the at-fork handlers gRPC registers; in the child these sometimes
abort it before exec - ``_posixsubprocess`` then closes every descriptor, the epoll one
under a poller thread the handlers restarted (``ev_epoll1_linux.cc ... epoll_wait error:
Bad file descriptor``, exit -6: 19 of 1,000 starts here, 3 of 24 on cluster agents; issue
27). Without ``preexec_fn`` CPython starts the child with ``vfork()``: no handler runs.

The parent-death signal (``PR_SET_PDEATHSIG`` SIGKILL: a killed node agent takes its
workers along, as a failed node would) is therefore set by a small exec helper, which
execs the worker's command in the same process (same pid, so its session and
``os.killpg`` are the worker's):

* util-linux's ``setpriv --pdeathsig KILL`` then ``/bin/sh``, which checks that the
  parent is still the one that started it (if it died before the ``prctl``, no signal
  would ever come: the worker kills itself instead) and execs the command: about 1.5 ms
  per start;
* where ``setpriv`` lacks ``--pdeathsig`` (util-linux < 2.33): ``python -S -I`` running
  :mod:`.pdeathsig_exec`, which does the same with ``ctypes``: about 10 ms per start.

Which one is found once per process, by starting it (``/bin/sh -c :``). Elsewhere than
Linux the command starts as it is (there is no parent-death signal to set).

A helper would turn a command that cannot run into an exit code; :func:`dying_with_parent`
therefore looks for the program first, as ``execvpe`` would (in ``cwd``, along the
worker's ``PATH``), and raises the ``OSError`` that ``Popen`` would have raised.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

HELPER = str(Path(__file__).with_name("pdeathsig_exec.py"))
SHELL = "/bin/sh"
# $1: the pid of the process that started it; then the command. $PPID is read at the
# shell's start, after setpriv's prctl: a parent that died before it is not ours any more.
_CHECK_PARENT = 'p=$1; shift; [ "$PPID" = "$p" ] || kill -9 $$; exec "$@"'

_lock = threading.Lock()
_chosen: list[str] | None = None  # "setpriv" / "python" / "none" and its program


def dying_with_parent(command: Sequence[str], env: Mapping[str, str],
                      cwd: str | os.PathLike | None = None) -> list[str]:
    """The argv to ``Popen`` (with this ``env`` and ``cwd``, no ``preexec_fn``) that runs
    ``command`` as a process killed (SIGKILL) when the calling thread ends. Raises the
    ``OSError`` Popen would (one line: ``[Errno 2] No such file or directory: 'x'``) if
    the program cannot be found or run."""
    command = list(command)
    if not command:
        return command  # (Popen says what is wrong with it, as before)
    check_runnable(command[0], env, cwd)
    return [*_prefix(os.getpid()), *command]


def check_runnable(program: str, env: Mapping[str, str],
                   cwd: str | os.PathLike | None = None) -> None:
    """Raise the OSError exec would give ``program`` (looked up as ``subprocess`` does:
    a name with a slash from ``cwd``, another along ``env``'s PATH, whose relative entries
    are relative to ``cwd``). A ``cwd`` that is not a folder is left to ``Popen``."""
    base = os.fspath(cwd) if cwd is not None else os.getcwd()
    if not os.path.isdir(base):
        return  # Popen fails on it, naming the folder
    if os.sep in program:
        candidates = [os.path.join(base, program)]
    else:
        candidates = [os.path.join(base, folder, program) for folder in os.get_exec_path(env)]
    denied = False
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return
        # (exec's EACCES - not executable, a folder - wins over "not found", as in Popen)
        denied = denied or os.path.exists(path)
    code = errno.EACCES if denied else errno.ENOENT
    raise (PermissionError if denied else FileNotFoundError)(code, os.strerror(code), program)


def method() -> str:
    """How workers are tied to their parent here: "setpriv", "python" or "none"."""
    return _choose()[0]


def _prefix(parent: int) -> list[str]:
    how, program = _choose()
    if how == "setpriv":
        return [program, "--pdeathsig", "KILL", "--", SHELL, "-c", _CHECK_PARENT, "sh",
                str(parent)]
    if how == "python":
        return [program, "-S", "-I", HELPER, str(parent)]
    return []


def _choose() -> list[str]:
    global _chosen
    with _lock:
        if _chosen is None:
            _chosen = _probe()
        return _chosen


def _probe() -> list[str]:
    if not sys.platform.startswith("linux"):
        return ["none", ""]
    setpriv = shutil.which("setpriv")
    if setpriv and os.access(SHELL, os.X_OK):
        argv = [setpriv, "--pdeathsig", "KILL", "--", SHELL, "-c", _CHECK_PARENT, "sh",
                str(os.getpid()), SHELL, "-c", ":"]
        if _works(argv):
            return ["setpriv", setpriv]
    if sys.executable and _works([sys.executable, "-S", "-I", HELPER, str(os.getpid()),
                                  sys.executable, "-S", "-I", "-c", ""]):
        return ["python", sys.executable]
    log.warning("neither setpriv --pdeathsig nor %s can start a worker tied to this "
                "process: its workers will outlive it if it is killed", HELPER)
    return ["none", ""]


def _works(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False

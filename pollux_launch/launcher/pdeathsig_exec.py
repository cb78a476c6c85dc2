"""Exec a command as a process that gets SIGKILL when its parent (thread) ends (Linux).

    python -S -I pdeathsig_exec.py PARENT_PID COMMAND [ARG...]

:mod:`.spawn`'s fallback where util-linux's ``setpriv --pdeathsig`` is missing: sets
``PR_SET_PDEATHSIG``, kills itself if its parent is no longer ``PARENT_PID`` (it died
before the ``prctl``: no signal would come), then execs COMMAND (same pid) along its
``PATH``, with the environment this process was started with - not Python's, which may
have added ``LC_CTYPE`` (PEP 538) - and with SIGPIPE and SIGXFSZ back to their default,
as ``subprocess`` starts a child. Run by its path with the standard library only; a
command that cannot run exits 127 with one line on stderr.
"""

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _environment() -> dict:
    """The environment given to this process (``/proc/self/environ``: the block exec
    wrote, which ``setenv`` never changes)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except OSError:
        return dict(os.environ)
    env = {}
    for entry in block.split(b"\0"):
        key, eq, value = entry.partition(b"=")
        if eq and key:
            env[key] = value
    return env


def main(argv: list) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.stderr.write("usage: pdeathsig_exec.py PARENT_PID COMMAND [ARG...]\n")
        return 2
    parent, command = int(argv[0]), argv[1:]
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9)  # SIGKILL
    except (ImportError, OSError, AttributeError):
        pass  # no prctl here: the command runs, untied to its parent
    if os.getppid() != parent:
        os.kill(os.getpid(), 9)
    for name in ("SIGPIPE", "SIGXFSZ"):  # ignored by Python at start, as subprocess resets
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvpe(command[0], command, _environment())
    except OSError as exc:
        sys.stderr.write(f"cannot run {command[0]!r}: {exc.strerror or exc}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

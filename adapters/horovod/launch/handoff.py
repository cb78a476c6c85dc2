"""The command Horovod's driver runs for each worker of a pre-started job: hand the worker
to the job's warm zygote (:mod:`.zygote`), or run it as usual.

    python -I -S .../handoff.py COMMAND...

Run BY PATH, standard library only (``-I -S``: no site-packages, ~40 ms), because it sits
on the survivors' critical path: Horovod starts a newcomer only once the survivors have
reset. With ``$POLLUX_HVD_ZYGOTE`` naming a listening zygote, it

1. connects and sends its fds 0-2 (``SCM_RIGHTS``) with ``{argv, env, cwd}`` (a 4-byte
   big-endian length, then JSON);
2. reads the zygote's lines: ``pid N`` (the worker it forked, now running COMMAND with
   this process's stdio, environment and directory), then ``exit N`` (its
   ``waitstatus_to_exitcode``: a signal as -SIG), or ``refuse REASON`` before any fork;
3. meanwhile forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to the worker, which
   in turn dies when this process does (its connection closes);
4. exits with the worker's code (a signal as 128+SIG, as a shell reports it).

Anything else (no zygote, refused, the zygote gone before forking) execs COMMAND here:
the worker starts cold, exactly as without pollux-run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time

ENV_SOCKET = "POLLUX_HVD_ZYGOTE"  # (warm.ENV_SOCKET: this file imports nothing of ours)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)


class Cold(Exception):
    """No warm worker for this command: start it here."""


def handoff(path: str, argv: list[str]) -> int:
    """Run ``argv`` in a worker forked by the zygote at ``path``; its exit code."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:  # no zygote (yet, or any more)
        sock.close()
        raise Cold(str(exc)) from None
    payload = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(sock, [struct.pack(">I", len(payload))], [0, 1, 2])
        sock.sendall(payload)
    except OSError as exc:
        raise Cold(str(exc)) from None
    reader = sock.makefile("rb")
    pid = 0
    pending: list[int] = []  # signals that arrived before the worker's pid

    def forward(sig: int, _frame: object) -> None:
        if pid:
            _kill(pid, sig)
        else:
            pending.append(sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for raw in reader:
        word, _, value = raw.decode().strip().partition(" ")
        if word == "refuse":
            print(f"[pollux] warm start refused ({value}); starting cold", file=sys.stderr)
            raise Cold(value)
        if word == "pid":
            pid = int(value)
            for sig in pending:
                _kill(pid, sig)
        elif word == "exit":
            code = int(value)
            return code if code >= 0 else 128 - code
    if not pid:
        raise Cold("the zygote ended before starting the worker")
    # The zygote died with the worker running: its code is lost; wait for it to end.
    print(f"[pollux] warm zygote gone; waiting for worker {pid}", file=sys.stderr)
    while _kill(pid, 0):
        time.sleep(0.2)
    return 1


def _kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: handoff.py COMMAND...")
    path = os.environ.get(ENV_SOCKET)
    if path:
        try:
            os._exit(handoff(path, argv))
        except Cold:
            for sig in FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()

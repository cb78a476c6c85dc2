"""In-band rank announcements: a worker tells its node agent's output pump which rank the
lines it prints next come from.

A worker's output is labelled with its rank (``[1]<stdout>:...``, launcher/workers.py),
but a live job's ranks change at every rescale, and only the worker knows when: its
agent starts it with the rank of the allocation it starts in. So, each time its group
forms (``Rendezvous._form``), the worker writes one marker line to its own fd 1 and fd 2,
after flushing ``sys.stdout`` and ``sys.stderr`` so that it follows everything printed
before it, in order::

    \\x1epollux-rank <token> <seq> <rank>\\n

* ``<token>``: ``$POLLUX_WORKER_TOKEN``, a random value its agent gave that worker only
  (``env.WORKER_TOKEN``): a line the user's script prints cannot pass for a marker by
  accident, and a marker another worker's process prints is not this one's;
* ``<seq>``: 1, 2, ... per worker process: the pumps of its two streams each see every
  marker, and the agent says a rank changed once, at the first stream that shows it;
* ``<rank>``: its rank in the group just formed.

A process without that variable (not started by a node agent) writes nothing, and
neither does one to an fd that is not a pipe (the script's output redirected to a file:
the agent reads none of it). Nothing that goes wrong here reaches the rendezvous. The pump
(:func:`find_mark`) swallows marker lines - they are never printed or logged - and
labels the lines after one with its rank; text of a line the marker was glued to (the
script printed no newline before it) stays a line of its own, under the old label.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
from collections.abc import Mapping

from . import env as envvars

MARK = b"\x1epollux-rank "
MAX_MARK = 200  # bytes: a marker line is never longer (the token is the agent's hex)

_lock = threading.Lock()
_seq = 0


def mark_line(token: str, seq: int, rank: int) -> bytes:
    return MARK + f"{token} {seq} {rank}\n".encode()


def announce_rank(rank: int, environ: Mapping[str, str] | None = None) -> None:
    """Tell this worker's node agent that what it prints from now on is rank ``rank``'s
    (a no-op for a process its agent gave no token)."""
    global _seq
    environ = os.environ if environ is None else environ
    token = environ.get(envvars.WORKER_TOKEN)
    if not token:
        return
    with _lock:  # (one sequence per process, whichever thread forms the group)
        _seq += 1
        line = mark_line(token, _seq, rank)
        for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
            try:
                if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                    continue  # redirected (to a file, say): the agent reads none of it
            except OSError:
                continue  # closed: nothing printed there can be mislabelled
            try:
                if stream is not None:
                    stream.flush()
            except Exception:  # (a user's odd stream must never break the rendezvous)
                pass  # (its unflushed text may then come after the marker: labelled anew)
            try:
                os.write(fd, line)  # one write below PIPE_BUF: never interleaved
            except OSError:
                pass  # the pipe is gone: nobody reads what comes after either


def find_mark(line: bytes, token: bytes) -> tuple[int, int, int] | None:
    """In one line of a worker's output (without its newline), the marker of the worker
    whose token is ``token``: (where it begins, its seq, its rank); None when it has none
    (or only something like one: that line is the worker's output, as printed)."""
    at = line.find(MARK + token + b" ")
    if at < 0 or len(line) - at > MAX_MARK:
        return None
    fields = line[at + len(MARK) + len(token) + 1:].split(b" ")
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        return None
    return at, int(fields[0]), int(fields[1])

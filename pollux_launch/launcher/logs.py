"""Job output where the user is: node agents keep it, serve it, and ``pollux-run`` follows it.

**On disk.** A node agent (``pollux-run agent --log-dir DIR``, default ``<state-dir>/logs``,
i.e. ``~/.local/state/pollux-launch/agent-NODE/logs``) appends every line its workers of a
job print to ``DIR/<job>/<submission>.log``, exactly as it prints them (``[rank]<stdout>:``
prefixed, horovodrun's format) and from the same pump under the same lock, so the order
across the node's ranks is kept. One file per submission: a new job of a finished one's
name starts a new file. Files are the agent user's only (0600 in 0700 folders); one file
stops growing at ``MAX_LOG_BYTES`` (a last line says so).

**Served.** The agent serves that folder over HTTP on its node's address (``NodeInfo.address``)
at a random free port, advertised as ``NodeInfo.log_port`` in its node record::

    GET /logs/<job>/<submission>?offset=N      ->  200, at most MAX_CHUNK bytes from N;
                                                   X-Pollux-Offset: N + len(body),
                                                   X-Pollux-Size: the file's size now

400 for a bad name or offset, 401 for a missing or wrong signature (with an
``X-Pollux-Clock-Skew`` header when only the clocks differ, see below), 403 when refused
(see below), 404 when the node has no such log, 414 for a long target or request line, 431
for long headers, 429 when the client's address has too many requests open, 503 when busy
(429 and 503 with ``Retry-After``). Everything received is untrusted: names must be one
key level (``keys.NAME``, not ``.`` or ``..``), the resolved path must lie inside the log
folder, a request carries at most one query field; an error is answered with a status,
never raised.

**Hostile clients.** Anyone who can connect may try to starve the server, so every resource
a connection holds is bounded. One request per connection (HTTP/1.0). The request line and
headers must all have come within ``CLIENT_TIMEOUT`` seconds of the connection's accept -
one deadline, not restarted by each byte, so trickling a byte at a time buys nothing - and
within ``MAX_HEADER_BYTES`` bytes (past that: 414 if the request line is not complete yet,
else 431, then the connection is closed); a late request is closed without an answer (it has
not said what it asks). The answer must be taken within ``REPLY_TIMEOUT`` seconds of its
first byte, and the client's end of the connection is awaited ``LINGER`` seconds at most. At
most ``MAX_CLIENTS`` connections are served at once and ``MAX_PER_PEER`` of them from one
address; any other is answered at once from the accepting thread, 503 or 429 with
``Retry-After``, with a ``REFUSE_TIMEOUT`` to send it (it fits a fresh socket's buffer) -
never closed without a word. So one host holds at most ``MAX_PER_PEER`` slots, each for
``CLIENT_TIMEOUT`` (reading) + ``REPLY_TIMEOUT`` (writing) + ``LINGER`` seconds at most, the
others still get theirs, and a server thread is never held for ever. That is why the
standard library's threaded server is enough here: the requests are few, small and
read-only, a thread per admitted connection is bounded by ``MAX_CLIENTS``, and everything a
client controls (time, bytes, connections) has a limit. It does not stand against a flood
from many addresses at once (``MAX_CLIENTS / MAX_PER_PEER`` hosts can keep it busy, answered
503): that needs the network kept to those trusted, as below.

**Authentication.** With a cluster secret (``--secret-file`` or ``$POLLUX_SECRET``) every
request carries ``X-Pollux-Auth: <unix time>:<hex HMAC-SHA256>`` over ``pollux-logs/1``, the
method, the node's advertised ``address:port``, the request target (path and query) and that
time; the agent accepts it within ``CLOCK_WINDOW`` seconds of its own clock and compares in
constant time. A signature whose MAC is right for its time but whose time lies outside that
window gets a 401 that says so - the clocks differ, the node's time and the request's, and
``X-Pollux-Clock-Skew: <the node's time - the request's, whole seconds>`` - as the right MAC
proves the secret and the node's time is no secret; a wrong MAC gets the same 401 as no
signature. The follower names the difference ("sync the clocks"). Binding the node's address
and port means a signature sent to a node record someone forged in the store cannot be
replayed to a real node. The secret never appears in a URL, a log line, an argument or the
store; replies are not encrypted (plain HTTP: run it on a network you trust, as the workers'
own gloo and NCCL traffic already must be).
*Without a cluster secret* an agent serves its logs to clients on its own machine
(loopback) only, and refuses others with 403: such a cluster runs whatever is in the
store, but the logs would otherwise be open to anyone who can reach the port, not just
to those with store access. Set a secret to read logs across machines.

**Followed.** :class:`LogFollower` reads the job's nodes from the store (``nodes/``
records with a ``log_port``), polls each for the bytes past what it has printed and prints
whole lines as they come, optionally only one rank's (``[R]<`` prefix). The submitting
``pollux-run`` runs one in a thread in cluster mode (local mode prints its in-process
workers' output itself) and drains it - until no node reports live workers of the job and
a round brought nothing new - before it prints the job's end. ``pollux-run logs JOB
[--follow] [--rank R]`` is the same client on its own.

**On one machine.** A local ``pollux-run`` (embedded store) is its own node agent, and
keeps its job's output the same way, in the user's :func:`local_log_dir`
(``$XDG_STATE_HOME/pollux-launch/local/logs``, default
``~/.local/state/pollux-launch/local/logs``; every local ``pollux-run`` of the user
shares it, one file per submission). It serves nothing over the network: the machine's
launchers share ONE node record, so no launcher's port could be advertised in it, and the
reader is on the same machine anyway. ``pollux-run logs`` against an embedded store adds
that file to the follower's sources (:class:`LogFollower` ``files``: read at an offset in
``MAX_CHUNK`` pieces, as a node is asked) besides any nodes that serve logs. A finished
local job's keys are gone with its launcher; its name then finds the newest file of that
job in the folder, printed as a past run's output. Printing nothing - no such job, no
output anywhere, none of ``--rank R`` - is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import hmac
import http.client
import io
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, urlsplit

from pollux_launch.errors import PolluxError

from .. import env as envvars
from .. import keys
from ..arguments import OptionsError, name
from ..messages import MAX_INT, MAX_REPLICAS, JobSpec, JobStatus, NodeInfo, ValueLog
from ..rendezvous.store import Store, StoreError

log = logging.getLogger(__name__)

MAX_CHUNK = 1 << 20  # bytes per reply
MAX_LOG_BYTES = 1 << 30  # per job and submission on one node: a runaway job fills no disk
MAX_TARGET = 1024  # characters of a request target (two names, an offset)
MAX_CLIENTS = 32  # requests served at once
MAX_PER_PEER = 8  # of them from one address: one flooding host cannot take every slot
CLIENT_TIMEOUT = 10.0  # seconds from the accept for the whole request line and headers
MAX_HEADER_BYTES = 8 << 10  # the request line and headers together
REPLY_TIMEOUT = 30.0  # seconds a client may take to receive its answer (MAX_CHUNK bytes)
LINGER = 1.0  # seconds to wait for the client's end after the answer (see _close)
REFUSE_TIMEOUT = 0.5  # seconds to send a 503/429 (from the accepting thread)
RETRY_AFTER = 1  # seconds, said with a 503/429
BACKLOG = 128  # connections the kernel queues for accept: a burst waits, is not dropped
CLOCK_WINDOW = 60.0  # seconds a signature's time may differ from the agent's clock
AUTH_HEADER, OFFSET_HEADER, SIZE_HEADER = "X-Pollux-Auth", "X-Pollux-Offset", "X-Pollux-Size"
SKEW_HEADER = "X-Pollux-Clock-Skew"  # with a 401: node's time - request's stamp, seconds
MAX_LINE = 1 << 20  # a longer run without a newline is printed as a line of its own
FETCH_TIMEOUT = 5.0  # seconds per request to a node
NODES_EVERY = 2.0  # seconds between reads of the node records
ABSENT_EVERY = 2.0  # seconds between asks of a node that has no log of the job (yet)
LOCAL_LOGS = ("pollux-launch", "local", "logs")  # under the user's state folder
FILE_SETTLE = 0.5  # seconds a file must not grow before a drain ends (its writer is mute)


def _safe(text: str) -> bool:
    """One key level that is also a safe file name (``keys.NAME`` allows ``..``)."""
    return bool(keys.NAME.fullmatch(text)) and text.strip(".") != ""


def log_path(log_dir: str | os.PathLike, job: str, submission: str) -> Path:
    """Where a node keeps ``job``'s output of one submission (``JobSpec.submission``)."""
    return Path(log_dir) / job / f"{submission or 'output'}.log"


def local_log_dir() -> Path:
    """Where this user's local (embedded-store) ``pollux-run`` keep their jobs' output:
    ``$XDG_STATE_HOME`` (when absolute, as XDG says), else ``~/.local/state`` - the root of
    the agents' default state folders too - then ``pollux-launch/local/logs``."""
    return Path(state_home(), *LOCAL_LOGS)


def state_home() -> Path:
    """``$XDG_STATE_HOME`` when absolute (as XDG says), else ``~/.local/state``."""
    base = os.environ.get(envvars.STATE_HOME, "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base)


def make_local_log_dir() -> Path:
    """:func:`local_log_dir`, created where missing: each folder from ``pollux-launch``
    down only its user's (0700), as the state folder itself (XDG). Best effort: a folder
    that cannot be made is said by the job's ``LogSink`` at its first line."""
    path = local_log_dir()
    folder = path.parents[len(LOCAL_LOGS) - 1]  # the state folder
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for part in LOCAL_LOGS:  # (parents=True would make these with the umask's mode)
            folder /= part
            folder.mkdir(mode=0o700, exist_ok=True)
    except OSError:  # (nothing lost: the job's LogSink tries again and says why it cannot)
        pass
    return path


def last_log(log_dir: str | os.PathLike, job: str) -> Path | None:
    """The most recently written log of ``job`` in ``log_dir`` (its newest submission's),
    None if there is none. ``job`` must be a safe name (``_safe``)."""
    if not _safe(job):
        return None
    newest: tuple[float, str] | None = None
    try:
        with os.scandir(Path(log_dir) / job) as entries:
            for entry in entries:
                if not (entry.name.endswith(".log") and _safe(entry.name[:-4])):
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    when = entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:  # (removed since the listing: not a candidate)
                    continue
                if newest is None or (when, entry.name) > newest:
                    newest = (when, entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise OptionsError(f"cannot read the logs in {Path(log_dir) / job}: "
                           f"{exc.strerror or exc}") from None
    return None if newest is None else Path(log_dir) / job / newest[1]


def job_log_file(log_dir: str | os.PathLike | None, spec: JobSpec) -> str | None:
    """The file a node writes ``spec``'s output to; None without a log folder, or for
    names that are no safe file name (a spec read from the store is untrusted)."""
    if not log_dir or not _safe(spec.name) or not (spec.submission == ""
                                                   or _safe(spec.submission)):
        return None
    return str(log_path(log_dir, spec.name, spec.submission))


# -- on disk ---------------------------------------------------------------------------
class LogSink:
    """Appends a job's output lines to its log file: opened at the first line (and again
    after :meth:`close`), flushed per write so that the server sees each line at once.
    A file that cannot be written is said once and dropped: the output still reaches the
    agent's stdout, and the workers' pipes never stall."""

    def __init__(self, path: str | os.PathLike, limit: int = MAX_LOG_BYTES) -> None:
        self.path, self.limit = Path(path), limit
        self._file: IO[bytes] | None = None
        self._size = 0
        self._broken = False
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")  # (lone surrogates from odd bytes)
        with self._lock:
            if self._broken:
                return
            try:
                if self._file is None:
                    self._open()
                assert self._file is not None
                if self._size + len(data) > self.limit:
                    self._file.write(f"[pollux] log full at {self.limit} bytes; the rest of "
                                     "the job's output on this node is not kept\n".encode())
                    self._file.flush()
                    self._broken = True
                    return
                self._file.write(data)
                self._file.flush()
                self._size += len(data)
            except OSError as exc:
                log.error("cannot write the job log %s: %s; its output goes to stdout only",
                          self.path, exc.strerror or exc)
                self._broken = True

    def _open(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "ab")
        self._size = os.fstat(fd).st_size

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError):  # (each write was flushed already)
                    self._file.close()
                self._file = None


# -- authentication --------------------------------------------------------------------
def _mac(secret: bytes, method: str, where: str, target: str, stamp: str) -> str:
    text = f"pollux-logs/1\n{method}\n{where}\n{target}\n{stamp}"
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def sign_request(secret: bytes, method: str, address: str, port: int, target: str,
                 now: float) -> str:
    """The ``X-Pollux-Auth`` value for a request to the node at ``address:port``."""
    stamp = str(int(now))
    return f"{stamp}:{_mac(secret, method, f'{address}:{port}', target, stamp)}"


def verify_request(secret: bytes, header: str | None, method: str, address: str, port: int,
                   target: str, now: float) -> tuple[bool, int | None]:
    """(valid, skew): ``skew`` (``now`` - the stamp, whole seconds) only when the MAC is
    right for its stamp but the stamp lies outside ``CLOCK_WINDOW``: the sender holds the
    secret and its clock is off, which may then be said."""
    if not header or len(header) > 100:
        return False, None
    stamp, _, mac = header.partition(":")
    if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 12 and mac.isascii()):
        return False, None  # (compare_digest refuses non-ASCII text)
    if not hmac.compare_digest(_mac(secret, method, f"{address}:{port}", target, stamp), mac):
        return False, None
    skew = now - int(stamp)
    if abs(skew) > CLOCK_WINDOW:
        return False, round(skew)
    return True, None


# -- the server ------------------------------------------------------------------------
class _Reply(PolluxError):
    """An answer other than the log's bytes."""

    def __init__(self, status: int, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class _TooLarge(PolluxError):
    """The request line and headers passed ``MAX_HEADER_BYTES``."""


class _DeadlineReader(io.RawIOBase):
    """A connection's reading side with one deadline for the whole request: each receive
    waits only for the time left (a plain socket timeout restarts with every byte, so a
    client trickling one byte at a time would hold its slot for ever), and at most
    ``limit`` bytes are read."""

    def __init__(self, sock: socket.socket, deadline: float, limit: int) -> None:
        self.sock, self.deadline, self.left = sock, deadline, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        wait = self.deadline - time.monotonic()
        if wait <= 0:
            raise TimeoutError("the request did not come in time")
        if self.left <= 0:
            raise _TooLarge
        self.sock.settimeout(wait)
        n = self.sock.recv_into(buffer, min(len(buffer), self.left))
        self.left -= n
        return n


class _DeadlineWriter(io.RawIOBase):
    """A connection's writing side: the whole answer must be taken within ``seconds`` of
    its first byte, so a client that never reads holds its slot that long at most."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.sock, self.seconds = sock, seconds
        self.deadline: float | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.seconds
        if now >= self.deadline:
            raise TimeoutError("the answer was not taken in time")
        self.sock.settimeout(self.deadline - now)
        self.sock.sendall(data)
        return len(data)


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0: no keep-alive), read under a deadline from
    the connection's accept and a size cap, answered under a deadline."""

    server: _HTTPServer
    server_version = "pollux-logs"
    sys_version = ""

    def __init__(self, request: socket.socket, client_address: Any, server: _HTTPServer,
                 accepted: float) -> None:
        self.accepted = accepted
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BufferedReader(_DeadlineReader(
            self.request, self.accepted + CLIENT_TIMEOUT, MAX_HEADER_BYTES))
        self.wfile = _DeadlineWriter(self.request, REPLY_TIMEOUT)

    def handle_one_request(self) -> None:
        # (what log_request and send_response need, should the request line never come)
        self.raw_requestline, self.requestline, self.command = b"", "", ""
        self.request_version = "HTTP/1.0"
        try:
            super().handle_one_request()  # (a deadline passed: TimeoutError, closed there)
        except _TooLarge:
            self.close_connection = True
            self.request_version = "HTTP/1.0"  # (never 0.9: the status line must go out)
            status, what = (431, "request header fields") if self.raw_requestline \
                else (414, "request line")
            with contextlib.suppress(OSError):
                self._send(status, f"{what} too long: at most {MAX_HEADER_BYTES} bytes in "
                           "all\n".encode(), {})

    def do_GET(self) -> None:
        try:
            offset, data, size = self.server.logs.read(self)
        except _Reply as reply:
            self._send(reply.status, (reply.message + "\n").encode(), reply.headers)
            return
        except Exception:  # a bug must answer this request only, never stop the agent
            log.warning("log request %r failed", self.path[:200], exc_info=True)
            self._send(500, b"internal error\n", {})
            return
        self._send(200, data, {OFFSET_HEADER: str(offset + len(data)), SIZE_HEADER: str(size)})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("log request from %s: " + format, self.client_address[0], *args)


class _HTTPServer(ThreadingHTTPServer):
    """Accepts in one thread and serves each admitted connection in a thread of its own:
    at most ``MAX_CLIENTS`` at once, ``MAX_PER_PEER`` of them from one address. Others
    are answered 503 (busy) or 429 (that address has too many) at once, from the
    accepting thread, never silently closed."""

    daemon_threads = True
    request_queue_size = BACKLOG
    logs: LogServer

    def __init__(self, address: tuple[str, int], logs: LogServer) -> None:
        self.logs = logs
        self._lock = threading.Lock()  # (admitted in the accepting thread, released in each)
        self._busy = 0
        self._peers: dict[str, int] = {}
        self._refused, self._refused_said = 0, 0.0
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)  # type: ignore[arg-type]

    def process_request(self, request, client_address) -> None:  # type: ignore[override]
        accepted, peer = time.monotonic(), client_address[0]
        with self._lock:
            if self._peers.get(peer, 0) >= MAX_PER_PEER:
                refusal = (429, f"too many requests from {peer} at once (at most "
                                f"{MAX_PER_PEER}); try again in {RETRY_AFTER} s")
            elif self._busy >= MAX_CLIENTS:
                refusal = (503, f"busy ({MAX_CLIENTS} requests at once); try again in "
                                f"{RETRY_AFTER} s")
            else:
                refusal = None
                self._busy += 1
                self._peers[peer] = self._peers.get(peer, 0) + 1
        if refusal is None:
            try:
                threading.Thread(target=self._serve, args=(request, client_address, accepted),
                                 name="log-request", daemon=True).start()
                return
            except RuntimeError:  # no thread to be had
                self._release(peer)
                refusal = (503, f"busy; try again in {RETRY_AFTER} s")
        self._refuse(request, peer, *refusal)

    def _serve(self, request: socket.socket, client_address: Any, accepted: float) -> None:
        try:
            _Handler(request, client_address, self, accepted)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._close(request)
            self._release(client_address[0])

    def _release(self, peer: str) -> None:
        with self._lock:
            self._busy -= 1
            left = self._peers.pop(peer) - 1
            if left:
                self._peers[peer] = left

    def _refuse(self, request: socket.socket, peer: str, status: int, message: str) -> None:
        body = (message + "\n").encode()
        head = (f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\n"
                "Content-Type: text/plain; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER}\r\n"
                "Connection: close\r\n\r\n").encode()
        try:
            request.settimeout(REFUSE_TIMEOUT)  # (a few bytes: a fresh socket's buffer takes them)
            _discard(request)
            request.sendall(head + body)
            request.shutdown(socket.SHUT_WR)
            _discard(request)
        except OSError:
            pass
        finally:
            request.close()
        now = time.monotonic()
        self._refused += 1
        if now - self._refused_said >= 60:  # said once a minute at most, however many
            log.warning("job log server: %d request(s) refused as busy or too many from "
                        "one address since the last such line (the latest from %s: %d)",
                        self._refused, peer, status)
            self._refused, self._refused_said = 0, now

    @staticmethod
    def _close(request: socket.socket) -> None:
        """End a served connection: the answer's end (FIN), then what the client still
        sends is read and dropped for up to ``LINGER`` seconds, until it hangs up: closing
        on unread bytes resets the connection, and a reset may discard the answer before
        the client reads it (e.g. after a 431)."""
        try:
            request.shutdown(socket.SHUT_WR)
            end = time.monotonic() + LINGER
            while (wait := end - time.monotonic()) > 0:
                request.settimeout(wait)
                if not request.recv(1 << 16):
                    break
        except OSError:
            pass
        finally:
            request.close()

    def handle_error(self, request, client_address) -> None:  # type: ignore[override]
        # a client that went away mid-reply, or a bug in one request: never the agent's end
        log.debug("log request from %s failed", client_address[0], exc_info=True)


def _discard(sock: socket.socket, most: int = 1 << 16) -> None:
    """Read and drop what has come on ``sock`` (up to ``most`` bytes) without waiting."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # (with a timeout set, recv waits for data first, even DONTWAIT)
    try:
        while most > 0 and (data := sock.recv(min(most, 1 << 14))):
            most -= len(data)
    except OSError:  # (BlockingIOError: nothing more has come)
        pass
    finally:
        sock.settimeout(timeout)


class LogServer:
    """Serves the job logs under ``log_dir`` (see the module docstring) from a daemon
    thread, at ``address`` (the node's advertised one) and a random free port."""

    def __init__(self, log_dir: str | os.PathLike, address: str, secret: bytes | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(log_dir).resolve()
        self.address, self.secret, self.clock = address, secret, clock
        self._httpd: _HTTPServer | None = None
        self.port = 0

    def start(self) -> int:
        """Bind and serve; returns the port. OSError if the address cannot be bound."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._httpd = _HTTPServer((self.address, 0), self)
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                         name="log-server", daemon=True).start()
        return self.port

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def read(self, request: BaseHTTPRequestHandler) -> tuple[int, bytes, int]:
        """(offset, bytes from it, file size) for ``request``; raises ``_Reply``."""
        target = request.path
        if len(target) > MAX_TARGET:
            raise _Reply(414, "request target too long")
        self._authorise(request, target)
        parts = urlsplit(target)
        segments = parts.path.split("/")
        if len(segments) != 4 or segments[:2] != ["", "logs"]:
            raise _Reply(404, "not found; GET /logs/<job>/<submission>?offset=N")
        job, submission = segments[2], segments[3]
        if not (_safe(job) and _safe(submission)):
            raise _Reply(400, "bad job or submission name")
        offset = self._offset(parts.query)
        path = log_path(self.root, job, submission).resolve()
        if not path.is_relative_to(self.root):  # e.g. a symbolic link out of the folder
            raise _Reply(404, "no such log")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(min(offset, size))
                data = f.read(MAX_CHUNK) if offset < size else b""
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise _Reply(404, "no such log on this node") from None
        except OSError as exc:
            log.warning("cannot read the job log %s: %s", path, exc.strerror or exc)
            raise _Reply(500, "cannot read that log") from None
        return offset, data, size

    def _authorise(self, request: BaseHTTPRequestHandler, target: str) -> None:
        if self.secret is None:
            try:
                loopback = ipaddress.ip_address(request.client_address[0]).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise _Reply(403, "this cluster has no secret: logs are served to this "
                             "machine only")
            return
        header = request.headers.get(AUTH_HEADER)
        now = self.clock()
        valid, skew = verify_request(self.secret, header, request.command, self.address,
                                     self.port, target, now)
        if skew is not None:  # the MAC proves the secret: saying the skew leaks nothing
            stamp = (header or "").partition(":")[0]
            raise _Reply(401, f"the clocks differ: this node's time is {int(now)}, the "
                         f"request's stamp {stamp} ({abs(skew)} s apart, more than "
                         f"{CLOCK_WINDOW:g}); sync them (NTP)", {SKEW_HEADER: str(skew)})
        if not valid:
            raise _Reply(401, "missing, wrong or stale signature")

    @staticmethod
    def _offset(query: str) -> int:
        try:
            fields = parse_qs(query, strict_parsing=bool(query), max_num_fields=1)
        except ValueError:
            raise _Reply(400, "bad query; the only field is offset=N") from None
        if set(fields) - {"offset"} or any(len(v) != 1 for v in fields.values()):
            raise _Reply(400, "bad query; the only field is offset=N")
        text = fields.get("offset", ["0"])[0]
        if not (text.isascii() and text.isdigit() and len(text) <= 16 and int(text) <= MAX_INT):
            raise _Reply(400, "offset must be a whole number of bytes")
        return int(text)


def serve_logs(log_dir: str | os.PathLike, node: NodeInfo,
               secret: bytes | None) -> tuple[LogServer | None, NodeInfo]:
    """Start serving ``log_dir`` at ``node``'s address; returns the server and the node
    record with its ``log_port`` (unchanged, with no server, if it cannot start: the
    agent runs on, its logs kept on disk)."""
    server = LogServer(log_dir, node.address, secret)
    try:
        port = server.start()
    except OSError as exc:
        log.error("node %s: cannot serve job logs at %s (%s); they are kept in %s only",
                  node.name, node.address, exc.strerror or exc, log_dir)
        return None, node
    log.info("node %s: job logs in %s, served at %s:%d%s", node.name, log_dir, node.address,
             port, "" if secret else " to this machine only (no cluster secret)")
    return server, replace(node, log_port=port)


# -- the client ------------------------------------------------------------------------
def _skew(value: str | None) -> int | None:
    """A ``SKEW_HEADER`` value (untrusted: None unless a plain whole number)."""
    if value is None:
        return None
    digits = value.strip().removeprefix("-")
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 12):
        return None
    return int(value)


@dataclass
class _Source:
    """One place the job's log is read from (a node's server, a file on this machine), as
    far as it was printed."""

    offset: int = 0
    pending: bytes = b""  # the start of a line whose end has not come yet
    next_ask: float = 0.0  # (monotonic) a node without the log is asked less often
    said: str = ""  # the problem last reported (each is said once); "" while none


class LogFollower:
    """Prints ``job``'s output (submission ``submission``) as it comes, from every node
    that serves some and from ``files`` on this machine (a local ``pollux-run``'s log);
    only rank ``rank``'s lines if given. Every source is read alike: from the offset
    printed so far, at most ``MAX_CHUNK`` bytes a read, whole lines printed. Problems
    with a source go to ``err`` once each."""

    def __init__(self, store: Store, job: str, submission: str, secret: bytes | None,
                 out: IO[str], rank: int | None = None, err: IO[str] | None = None,
                 interval: float = 0.5, files: Sequence[str | os.PathLike] = ()) -> None:
        self.store, self.job, self.secret = store, job, secret
        self.target = f"/logs/{job}/{submission or 'output'}"
        self.files = [Path(f) for f in files]
        self.out, self.err = out, err or out
        self.prefix = None if rank is None else f"[{rank}]<".encode()
        self.interval = interval
        # per node name, or per file (its path): what was printed of it
        self.sources: dict[str, _Source] = {}
        # the nodes serving logs at the last read (one that went away keeps its offset
        # in ``sources``: its log may come back with its agent)
        self.nodes: dict[str, NodeInfo] = {}
        self.lines = 0  # lines printed
        self.values = ValueLog(log)
        self._nodes_read = -NODES_EVERY
        self._store_trouble = False
        self._behind = False  # a source had more than one round's worth at the last poll
        self._lock = threading.RLock()  # one poller at a time: nothing printed twice
        self._finishing = threading.Event()  # drain() asks the running thread to end
        self._done = threading.Event()
        self._running = False

    # one round ------------------------------------------------------------------------
    def poll(self, force: bool = False) -> int:
        """Read every source past our offset (ask every node serving logs); print the
        whole lines. Returns the bytes received. ``force``: ask nodes that had no log
        too (not those that failed: an unreachable one would stall every round)."""
        with self._lock:
            self._read_nodes()
            got, self._behind = 0, False
            for key, read in self._places():
                src = self.sources.setdefault(key, _Source())
                if time.monotonic() < src.next_ask and (src.said or not force):
                    continue
                for _ in range(16):  # a source far behind gets a few chunks, then the next
                    data = read(src)
                    got += len(data)
                    self._emit(src, data)
                    if len(data) < MAX_CHUNK:
                        break
                else:
                    self._behind = True
            return got

    def _places(self) -> list[tuple[str, Callable[[_Source], bytes]]]:
        """(key in ``sources``, reader of the next bytes) of every source now."""
        places: list[tuple[str, Callable[[_Source], bytes]]] = [
            (str(path), functools.partial(self._read_file, path)) for path in self.files]
        places += [(node.name, functools.partial(self._fetch, node))
                   for node in self.nodes.values()]
        return places

    def _read_nodes(self) -> None:
        if time.monotonic() - self._nodes_read < NODES_EVERY:
            return
        try:
            kvs = self.store.get_prefix(keys.NODES)
        except StoreError as exc:  # the last nodes known serve on
            if not self._store_trouble:
                self._say(f"cannot read the nodes from the store ({exc}); still following")
            self._store_trouble = True
            return
        self._nodes_read, self._store_trouble = time.monotonic(), False
        self.nodes = {}
        for kv in kvs:
            info = self.values.read(NodeInfo, kv.key, kv.value, kv.mod_revision)
            if info is not None and info.log_port:
                self.nodes[info.name] = info

    def _read_file(self, path: Path, src: _Source) -> bytes:
        """At most ``MAX_CHUNK`` bytes of the file ``path`` from ``src.offset`` on."""
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(min(src.offset, size))
                data = f.read(MAX_CHUNK) if src.offset < size else b""
        except FileNotFoundError:  # none (yet): read again next round (it costs nothing)
            src.said = ""
            return b""
        except OSError as exc:
            self._problem(str(path), src, f"cannot read it ({exc.strerror or exc})")
            return b""
        src.next_ask, src.said = 0.0, ""
        src.offset += len(data)
        return data

    def _fetch(self, node: NodeInfo, src: _Source) -> bytes:
        target, where = f"{self.target}?offset={src.offset}", f"node {node.name}"
        headers = {}
        if self.secret is not None:
            headers[AUTH_HEADER] = sign_request(self.secret, "GET", node.address,
                                                node.log_port, target, time.time())
        conn = http.client.HTTPConnection(node.address, node.log_port, timeout=FETCH_TIMEOUT)
        try:
            conn.request("GET", target, headers=headers)
            reply = conn.getresponse()
            body = reply.read(MAX_CHUNK + 1)
            status, skew = reply.status, _skew(reply.getheader(SKEW_HEADER))
            reason = "".join(c for c in body[:200].decode("utf-8", "replace")
                             if c.isprintable()).strip()  # (what a node says is untrusted)
        except (OSError, http.client.HTTPException) as exc:
            self._problem(where, src, f"unreachable ({exc})")
            return b""
        finally:
            conn.close()
        if status == 404:  # none there (yet)
            src.next_ask, src.said = time.monotonic() + ABSENT_EVERY, ""
            return b""
        if status == 401 and skew is not None:  # the right secret, a clock off
            ahead = "the node's is ahead" if skew > 0 else "this machine's is ahead"
            self._problem(where, src, f"refused the log (401: this machine's clock and the "
                          f"node's differ by {abs(skew)} s ({ahead}); sync them (NTP))",
                          said="401 clock skew")  # (said once, however the skew wobbles)
            return b""
        if status != 200:
            why = {401: "the cluster secret is needed and must match the node's "
                        "(--secret-file or $POLLUX_SECRET)",
                   403: "the cluster has no secret, so its logs are served to its own "
                        "machine only"}.get(status, reason)
            self._problem(where, src, f"refused the log ({status}: {why})")
            return b""
        if len(body) > MAX_CHUNK:  # not our server's answer
            self._problem(where, src, "answered more than it may")
            return b""
        src.next_ask, src.said = 0.0, ""
        src.offset += len(body)
        return body

    def _problem(self, where: str, src: _Source, what: str, said: str = "") -> None:
        """Say ``what`` of the source ``where`` unless the last problem said was the same
        (``said``: what counts as the same, default ``what``)."""
        src.next_ask = time.monotonic() + ABSENT_EVERY
        if src.said != (said or what):
            src.said = said or what
            self._say(f"{where}: {what}")

    def _say(self, what: str) -> None:
        self.err.write(f"[pollux] logs of {self.job}: {what}\n")
        self.err.flush()

    def _emit(self, src: _Source, data: bytes, final: bool = False) -> None:
        if not data and not (final and src.pending):
            return
        buf = src.pending + data
        # whole lines and whole redraws (a progress bar's "...\r", workers.py): a bar
        # updates as it comes, and --rank keeps each redraw by its own prefix
        cut = max(buf.rfind(b"\n"), buf.rfind(b"\r")) + 1
        if final and cut < len(buf):
            buf, cut = buf + b"\n", len(buf) + 1
        elif cut == 0 and len(buf) > MAX_LINE:  # never hold an endless line
            buf, cut = buf + b"\n", len(buf) + 1
        src.pending = buf[cut:]
        lines = buf[:cut].splitlines(keepends=True)
        if self.prefix is not None:
            lines = [line for line in lines if line.startswith(self.prefix)]
        if lines:
            self.lines += len(lines)
            self.out.write(b"".join(lines).decode("utf-8", "replace"))
            self.out.flush()

    # following ------------------------------------------------------------------------
    def run(self, stop: threading.Event, until: Callable[[], bool] | None = None) -> None:
        """Follow until ``stop`` is set (then end at once), or until ``until()`` is true
        or :meth:`drain` is called (then drain)."""
        self._running = True
        try:
            while not stop.is_set() and not self._finishing.is_set():
                if until is not None and until():
                    break
                if not self.poll():
                    self._finishing.wait(self.interval)
            if not stop.is_set():
                self._drain()
        finally:
            self._done.set()

    def drain(self, timeout: float = 15.0) -> None:
        """Print what is left of the finished job: from the following thread if one
        runs, else here."""
        self._finishing.set()
        if self._running:
            self._done.wait(timeout + 2 * FETCH_TIMEOUT)
        else:
            self._drain(timeout)

    def _drain(self, timeout: float = 15.0) -> None:
        """Poll until a round brings nothing new and no node record lists live workers
        of the job (their last lines may still be on the way), for at most ``timeout``
        seconds; then print any unfinished last line. A file says nothing of its
        writer: with files, nothing new for ``FILE_SETTLE`` seconds is needed too."""
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        while (now := time.monotonic()) < deadline:
            self._nodes_read = -NODES_EVERY  # (worker counts afresh)
            if self.poll(force=True):
                quiet_since = None
                continue
            quiet_since = now if quiet_since is None else quiet_since
            if (not self.files or now - quiet_since >= FILE_SETTLE) and not any(
                    n.workers.get(self.job, 0) > 0 for n in self.nodes.values()):
                break
            time.sleep(min(self.interval, 0.25))
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            for src in self.sources.values():
                self._emit(src, b"", final=True)

    def print_all(self) -> bool:
        """Print what the sources have now, no following (one with more than one
        round's worth is read again); whether any source had some (``lines``: how many
        lines were printed, after the ``rank`` filter)."""
        self.poll(force=True)
        while self._behind:
            self.poll(force=True)
        self._flush()
        return any(src.offset for src in self.sources.values())


# -- pollux-run logs -------------------------------------------------------------------
def rank_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank") from None
    if not 0 <= value < MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"{text} must be a rank from 0 to {MAX_REPLICAS - 1}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..rendezvous.store.cli_args import add_store_arguments

    add_store_arguments(parser)
    parser.add_argument("job", type=name, help="name of the job")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="print output as it comes, until the job has finished")
    parser.add_argument("--rank", type=rank_number, default=None,
                        help="only this rank's lines")
    parser.add_argument("--secret-file", help="cluster secret (or $POLLUX_SECRET)")


def run(args: argparse.Namespace, stdout: IO[str] | None = None) -> int:
    """``pollux-run logs``: the job's output from its nodes (and, against an embedded
    store, from this machine's local log); 0 once some was printed, else one line
    (``OptionsError``: exit code 2)."""
    from ..messages import MessageError, decode
    from ..rendezvous.store.cli_args import open_from_args
    from . import security
    from .slurm_allocation import find_allocation_store

    out = stdout or sys.stdout
    secret = security.load_secret(args.secret_file)
    find_allocation_store(args)  # (inside a `pollux-run --slurm` allocation: its store)
    store, url = open_from_args(args)
    local = url.startswith("embedded")  # (a local pollux-run's log is on this machine)
    with store:
        kv = store.get(keys.job(args.job, "spec"))
        if kv is None:
            if not local:
                raise OptionsError(f"no job named {args.job!r} in the store; see "
                                   "`pollux-run status`")
            _past_run(store, args, secret, out)
            return 0
        try:
            spec = decode(JobSpec, kv.value)
        except MessageError as exc:
            raise OptionsError(f"job {args.job!r} has a malformed spec ({exc})") from None
        if job_log_file("logs", spec) is None:
            raise OptionsError(f"job {args.job!r}: its spec's submission id is not a name")
        here = job_log_file(local_log_dir(), spec) if local else None
        follower = LogFollower(store, args.job, spec.submission, secret, out, args.rank,
                               err=sys.stderr, files=[here] if here else [])
        if args.follow:
            follower.run(threading.Event(), until=_finished(store, spec, local))
        else:
            follower.print_all()
        _printed(follower, args.rank, here)
    return 0


def _finished(store: Store, spec: JobSpec, local: bool) -> Callable[[], bool]:
    """A check of whether ``spec``'s job has finished: its status says so or is gone;
    in local mode also its spec gone or another's (its launcher ended: the spec lived
    under the launcher's lease)."""
    values = ValueLog(log)

    def finished() -> bool:
        try:
            kv = store.get(keys.job(spec.name, "status"))
            now = store.get(keys.job(spec.name, "spec")) if local else None
        except StoreError:
            return False  # (said by the follower's own reads if it persists)
        if local:
            current = values.read(JobSpec, now.key, now.value, now.mod_revision) \
                if now is not None else None
            if now is None or (current is not None and current.submission != spec.submission):
                return True
        status = values.read(JobStatus, kv.key, kv.value, kv.mod_revision) \
            if kv is not None else None
        return kv is None or (status is not None and status.finished)

    return finished


def _past_run(store: Store, args: argparse.Namespace, secret: bytes | None,
              out: IO[str]) -> None:
    """A job not in the (embedded) store: print the output of its last local run, kept
    on this machine after its launcher ended and removed its keys."""
    folder = local_log_dir()
    path = last_log(folder, args.job)
    if path is None:
        raise OptionsError(f"no job named {args.job!r} in the store, and no log of a "
                           f"past local run of it in {folder}; see `pollux-run status`")
    try:
        when = time.strftime(" (last written %Y-%m-%d %H:%M:%S)",
                             time.localtime(path.stat().st_mtime))
    except OSError:  # (removed meanwhile: the read below says so)
        when = ""
    print(f"[pollux] job {args.job!r} has finished: the output of its last run here, "
          f"from {path}{when}", file=sys.stderr, flush=True)
    follower = LogFollower(store, args.job, path.stem, secret, out, args.rank,
                           err=sys.stderr, files=[path])
    follower.print_all()
    _printed(follower, args.rank, str(path))


def _printed(follower: LogFollower, rank: int | None, here: str | None) -> None:
    """Raise ``OptionsError`` (one line) unless ``follower`` printed something."""
    if follower.lines:
        return
    job = follower.job
    if rank is not None and any(src.offset for src in follower.sources.values()):
        raise OptionsError(f"job {job!r} has output, but no line of rank {rank}")
    where = f"on the {len(follower.nodes)} node(s) serving logs"
    if here is not None:
        where = f"in {here} or {where}"
    raise OptionsError(f"no output of job {job!r} {where}")

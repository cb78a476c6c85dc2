"""Job logs on the node (launcher/logs.py): the worker pump's copy on disk, the agent's
HTTP server (authentication, hostile requests, offset reads), the follower and
``pollux-run logs``. Real sockets, real processes, a real (embedded) store."""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pollux_launch import keys
from pollux_launch.cli import main
from pollux_launch.launcher import logs as logs_module
from pollux_launch.launcher.logs import (
    AUTH_HEADER,
    MAX_CHUNK,
    MAX_HEADER_BYTES,
    OFFSET_HEADER,
    SIZE_HEADER,
    SKEW_HEADER,
    LogFollower,
    LogServer,
    LogSink,
    job_log_file,
    log_path,
    sign_request,
)
from pollux_launch.launcher.workers import WorkerGroup
from pollux_launch.messages import JobSpec, JobStatus, MessageError, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store

SECRET = b"unit-test-secret"
JOB, SUB = "job-a", "0123abcd"


def _write(root: Path, text: str, job: str = JOB, sub: str = SUB) -> Path:
    sink = LogSink(log_path(root, job, sub))
    sink.write(text)
    sink.close()
    return log_path(root, job, sub)


@pytest.fixture
def server(tmp_path):
    logs = LogServer(tmp_path / "logs", "127.0.0.1", SECRET)
    logs.start()
    yield logs
    logs.stop()


def get(server: LogServer, target: str, secret: bytes | None = SECRET, *, now: float | None = None,
        port: int | None = None, method: str = "GET", header: str | None = None,
        source: str | None = None):
    """(status, headers, body) of one request; signed with ``secret`` unless None
    (``port``: the port the signature names, default the server's; ``source``: the
    address to send from)."""
    headers = {}
    if header is not None:
        headers[AUTH_HEADER] = header
    elif secret is not None:
        headers[AUTH_HEADER] = sign_request(secret, method, "127.0.0.1", port or server.port,
                                            target, time.time() if now is None else now)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, target, headers=headers)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def test_signed_reads_from_an_offset_in_bounded_chunks(server):
    text = "".join(f"[{i % 2}]<stdout>:line {i}\n" for i in range(100))
    _write(server.root, text)
    status, headers, body = get(server, f"/logs/{JOB}/{SUB}")
    assert status == 200 and body.decode() == text
    assert headers[OFFSET_HEADER] == str(len(text)) == headers[SIZE_HEADER]
    status, headers, body = get(server, f"/logs/{JOB}/{SUB}?offset=10")
    assert status == 200 and body.decode() == text[10:]
    assert headers[OFFSET_HEADER] == str(len(text))
    status, headers, body = get(server, f"/logs/{JOB}/{SUB}?offset={len(text) + 50}")
    assert status == 200 and body == b""  # past the end: nothing yet

    big = _write(server.root, "x" * (MAX_CHUNK + 1000), sub="big")
    status, headers, body = get(server, f"/logs/{JOB}/big")
    assert status == 200 and len(body) == MAX_CHUNK
    assert headers[OFFSET_HEADER] == str(MAX_CHUNK)
    assert headers[SIZE_HEADER] == str(big.stat().st_size)
    status, _, body = get(server, f"/logs/{JOB}/big?offset={MAX_CHUNK}")
    assert status == 200 and len(body) == 1000


def test_requests_without_a_valid_signature_are_refused(server):
    _write(server.root, "secret output\n")
    target = f"/logs/{JOB}/{SUB}"
    assert get(server, target, secret=None)[0] == 401  # no header
    assert get(server, target, secret=b"another secret")[0] == 401
    assert get(server, target, now=time.time() - 600)[0] == 401  # stale
    assert get(server, target, now=time.time() + 600)[0] == 401  # from the future
    assert get(server, target, port=server.port + 1)[0] == 401  # meant for another node
    for header in ("", "garbage", "123:abc", "\u00b2:" + "0" * 64, "x" * 5000):
        assert get(server, target, header=header.encode("latin-1", "replace").decode(
            "latin-1"))[0] == 401, header
    # a signature is for one target: replayed for another offset or log it is refused
    stamp_sig = sign_request(SECRET, "GET", "127.0.0.1", server.port, target, time.time())
    assert get(server, target + "?offset=1", header=stamp_sig)[0] == 401
    assert get(server, f"/logs/{JOB}/other", header=stamp_sig)[0] == 401
    status, _, body = get(server, target)
    assert status == 200 and body == b"secret output\n"
    # the refusal says nothing of the log, and the secret is nowhere in a reply
    status, headers, body = get(server, target, secret=None)
    assert b"secret output" not in body and SECRET not in body
    assert SECRET.decode() not in str(headers)


@pytest.mark.parametrize("target, code", [
    ("/logs/../etc", 400),
    ("/logs/job-a/..", 400),
    ("/logs/./job-a", 400),
    ("/logs/%2e%2e/passwd", 400),
    ("/logs/job-a/..%2f..%2fetc%2fpasswd", 400),
    ("/logs/job%20a/x", 400),
    ("/logs/" + "j" * 129 + "/x", 400),
    ("/logs/job$/x", 400),
    ("/logs/job-a", 404),
    ("/logs/job-a/0123abcd/more", 404),
    ("/etc/passwd", 404),
    ("/", 404),
    ("/logs/job-a/0123abcd?offset=-1", 400),
    ("/logs/job-a/0123abcd?offset=abc", 400),
    ("/logs/job-a/0123abcd?offset=1e3", 400),
    ("/logs/job-a/0123abcd?offset=%C2%B2", 400),
    ("/logs/job-a/0123abcd?offset=99999999999999999999", 400),
    ("/logs/job-a/0123abcd?offset=1&offset=2", 400),
    ("/logs/job-a/0123abcd?offset=1&x=2", 400),
    ("/logs/job-a/0123abcd?x", 400),
    ("/logs/nojob/0123abcd", 404),
    ("/logs/job-a/nosub", 404),
    ("/logs/job-a/0123abcd?" + "a" * 2000, 414),
])
def test_hostile_targets_are_answered_with_a_status(server, target, code):
    _write(server.root, "line\n")
    (server.root.parent / "outside.log").write_text("not for you\n")
    status, _, body = get(server, target)
    assert status == code, (target, body)
    assert b"not for you" not in body


def test_no_escape_through_a_symbolic_link(server):
    _write(server.root, "mine\n")
    outside = server.root.parent / "private"
    outside.mkdir()
    (outside / "x.log").write_text("not for you\n")
    (server.root / "linked").symlink_to(outside)
    status, _, body = get(server, "/logs/linked/x")
    assert status == 404 and b"not for you" not in body


def test_the_server_survives_garbage_and_other_methods(server):
    _write(server.root, "still here\n")
    for junk in (b"\x00\xff\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                 b"GET /logs/" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n", b""):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.recv(1000)  # whatever it answers, then it hangs up
    for method in ("POST", "PUT", "DELETE"):
        assert get(server, f"/logs/{JOB}/{SUB}", method=method)[0] == 501
    assert get(server, f"/logs/{JOB}/{SUB}")[:1] == (200,)


def _non_loopback_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_without_a_secret_logs_are_served_to_this_machine_only(tmp_path):
    local = LogServer(tmp_path / "logs", "127.0.0.1", None)
    local.start()
    try:
        _write(local.root, "hello\n")
        assert get(local, f"/logs/{JOB}/{SUB}", secret=None)[::2] == (200, b"hello\n")
    finally:
        local.stop()
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    remote = LogServer(tmp_path / "logs", address, None)
    remote.start()
    try:
        conn = http.client.HTTPConnection(address, remote.port, timeout=10)
        conn.request("GET", f"/logs/{JOB}/{SUB}")
        reply = conn.getresponse()
        assert reply.status == 403 and b"hello" not in reply.read()
        conn.close()
    finally:
        remote.stop()


def test_worker_output_is_kept_on_disk_exactly_as_printed(tmp_path):
    script = ("import sys\n"
              "for i in range(50):\n"
              "    print(f'out {i}', flush=True)\n"
              "    print(f'err {i}', file=sys.stderr, flush=True)\n")
    printed = io.StringIO()
    path = log_path(tmp_path / "logs", JOB, SUB)
    group = WorkerGroup(JOB, [sys.executable, "-c", script], {}, stdout=printed, log_file=path)
    for rank in ("0", "1"):
        group.start(f"w{rank}", {}, label=rank)
    deadline = time.monotonic() + 30
    ended = []
    while len(ended) < 2 and time.monotonic() < deadline:
        ended += group.reap()
        time.sleep(0.05)
    assert [code for _, code in ended] == [0, 0]
    assert path.read_text() == printed.getvalue()  # same lines, same order across ranks
    lines = path.read_text().splitlines()
    assert len(lines) == 200 and "[1]<stderr>:err 49" in lines
    assert path.stat().st_mode & 0o777 == 0o600


def test_hostile_names_in_a_spec_get_no_log_file(tmp_path):
    ok = job_log_file(tmp_path, JobSpec(JOB, ("true",), submission=SUB))
    assert ok == str(tmp_path / JOB / f"{SUB}.log")
    assert job_log_file(None, JobSpec(JOB, ("true",), submission=SUB)) is None
    for name, sub in (("..", SUB), (".", SUB), (JOB, ".."), (JOB, "../../x"), (JOB, "a/b"),
                      (JOB, "x" * 200)):
        spec = JobSpec(name, ("true",), submission=sub)
        assert job_log_file(tmp_path, spec) is None, (name, sub)


def test_a_full_log_stops_growing_and_says_so(tmp_path):
    sink = LogSink(tmp_path / "j" / "s.log", limit=100)
    for i in range(20):
        sink.write(f"line {i}\n")
    sink.close()
    text = (tmp_path / "j" / "s.log").read_text()
    assert len(text) < 200 and text.endswith("is not kept\n")


def test_node_info_validates_its_log_port():
    info = NodeInfo("n1", 2, "127.0.0.1", log_port=4321)
    assert decode(NodeInfo, encode(info)).log_port == 4321
    assert decode(NodeInfo, encode(NodeInfo("n1", 2))).log_port == 0
    for bad in ('70000', '-1', '"80"', '1.5', 'true'):
        raw = encode(info).replace('"log_port":4321', f'"log_port":{bad}')
        with pytest.raises(MessageError):
            decode(NodeInfo, raw)


@pytest.fixture
def cluster_store(tmp_path):
    url = f"embedded://{tmp_path / 'store.db'}"
    store = open_store(url)
    yield url, store
    store.close()


def _register(store, name: str, server: LogServer, workers: dict[str, int] | None = None):
    store.put(keys.node(name), encode(NodeInfo(name, 1, "127.0.0.1", log_port=server.port,
                                               workers=workers or {})))


def test_follower_prints_whole_lines_of_every_node_and_filters_ranks(tmp_path, cluster_store):
    _, store = cluster_store
    servers = [LogServer(tmp_path / f"logs{i}", "127.0.0.1", SECRET) for i in range(2)]
    for i, s in enumerate(servers):
        s.start()
        _register(store, f"n{i}", s)
    try:
        _write(servers[0].root, "[0]<stdout>:a0\n[0]<stdout>:a1\n[0]<stdout>:part")
        _write(servers[1].root, "[1]<stdout>:b0\n[1]<stderr>:b1\n")
        out, err = io.StringIO(), io.StringIO()
        everything = LogFollower(store, JOB, SUB, SECRET, out, err=err)
        everything.poll(force=True)
        assert sorted(out.getvalue().splitlines()) == [
            "[0]<stdout>:a0", "[0]<stdout>:a1", "[1]<stderr>:b1", "[1]<stdout>:b0"]
        _write(servers[0].root, "ial\n[0]<stdout>:a2\n")  # the rest of the line comes
        everything.poll(force=True)
        assert out.getvalue().splitlines()[-2:] == ["[0]<stdout>:partial", "[0]<stdout>:a2"]

        ones = io.StringIO()
        assert LogFollower(store, JOB, SUB, SECRET, ones, rank=1, err=err).print_all()
        assert ones.getvalue() == "[1]<stdout>:b0\n[1]<stderr>:b1\n"

        wrong, said = io.StringIO(), io.StringIO()
        assert not LogFollower(store, JOB, SUB, b"wrong", wrong, err=said).print_all()
        assert wrong.getvalue() == "" and said.getvalue().count("cluster secret") == 2
        assert "wrong" not in said.getvalue() and SECRET.decode() not in said.getvalue()
    finally:
        for s in servers:
            s.stop()


def test_following_thread_drains_the_last_lines(tmp_path, cluster_store):
    _, store = cluster_store
    server = LogServer(tmp_path / "logs", "127.0.0.1", SECRET)
    server.start()
    _register(store, "n0", server, workers={JOB: 1})  # a worker still runs
    try:
        out = io.StringIO()
        follower = LogFollower(store, JOB, SUB, SECRET, out, interval=0.1)
        stop = threading.Event()
        thread = threading.Thread(target=follower.run, args=(stop,), daemon=True)
        thread.start()
        _write(server.root, "[0]<stdout>:first\n")
        deadline = time.monotonic() + 10
        while "first" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "first" in out.getvalue()

        def worker_ends() -> None:
            time.sleep(0.5)
            _write(server.root, "[0]<stdout>:last words")  # (no newline)
            _register(store, "n0", server)  # its agent reaped it
        threading.Thread(target=worker_ends, daemon=True).start()
        follower.drain()  # the job finished: waits for the worker's last line
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert out.getvalue() == "[0]<stdout>:first\n[0]<stdout>:last words\n"
    finally:
        server.stop()


def test_pollux_run_logs(tmp_path, cluster_store, capsys, monkeypatch):
    url, store = cluster_store
    monkeypatch.setenv("POLLUX_SECRET", SECRET.decode())
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert main(["logs", "nope", "--store", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no job named 'nope'" in err

    server = LogServer(tmp_path / "logs", "127.0.0.1", SECRET)
    server.start()
    try:
        spec = JobSpec(JOB, ("true",), submission=SUB)
        store.put(keys.job(JOB, "spec"), encode(spec))
        store.put(keys.job(JOB, "status"), encode(JobStatus("running")))
        _register(store, "n0", server)
        assert main(["logs", JOB, "--store", url]) == 2  # none yet: an error, one line
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert "no output of job 'job-a' in " in captured.err  # (this machine's folder)
        assert "on the 1 node(s) serving logs" in captured.err

        _write(server.root, "[0]<stdout>:zero\n[1]<stdout>:one\n[0]<stderr>:zero again\n")
        assert main(["logs", JOB, "--store", url, "--rank", "0"]) == 0
        assert capsys.readouterr().out == "[0]<stdout>:zero\n[0]<stderr>:zero again\n"

        # --follow ends once the job has finished and its output was printed
        def finish() -> None:
            time.sleep(1.0)
            _write(server.root, "[1]<stdout>:done\n")
            store.put(keys.job(JOB, "status"), encode(JobStatus("succeeded", 0)))
        threading.Thread(target=finish, daemon=True).start()
        assert main(["logs", JOB, "--store", url, "--follow", "--rank", "1"]) == 0
        assert capsys.readouterr().out == "[1]<stdout>:one\n[1]<stdout>:done\n"

        assert main(["logs", JOB, "--store", url, "--rank", "x"]) == 2
        assert "--rank" in capsys.readouterr().err
        assert main(["logs", "../etc", "--store", url]) == 2
        capsys.readouterr()
    finally:
        server.stop()


# -- a local pollux-run's log: a file on this machine ------------------------------------
def test_follower_reads_a_file_in_bounded_chunks_whole_lines_and_ranks(
        tmp_path, cluster_store, monkeypatch):
    _, store = cluster_store
    monkeypatch.setattr(logs_module, "MAX_CHUNK", 64)
    text = "".join(f"[{i % 2}]<stdout>:line {i}\n" for i in range(200))
    path = _write(tmp_path / "logs", text + "[0]<stdout>:part")
    out, err = io.StringIO(), io.StringIO()
    follower = LogFollower(store, JOB, SUB, None, out, err=err, files=[path])
    assert follower.poll() == 16 * 64  # a round reads a few chunks, never the whole file
    assert follower._behind
    assert out.getvalue() and text.startswith(out.getvalue())  # whole lines only
    assert follower.print_all()
    assert out.getvalue() == text + "[0]<stdout>:part\n"  # the partial line, ended
    assert follower.lines == 201 and err.getvalue() == ""

    ones = io.StringIO()
    assert LogFollower(store, JOB, SUB, None, ones, rank=1, files=[path]).print_all()
    assert ones.getvalue().splitlines() == [f"[1]<stdout>:line {i}" for i in range(1, 200, 2)]

    # no file (yet): nothing printed, nothing said; one that cannot be read: said once
    said = io.StringIO()
    absent = LogFollower(store, JOB, SUB, None, io.StringIO(), err=said,
                         files=[tmp_path / "none.log"])
    assert not absent.print_all() and absent.lines == 0 and said.getvalue() == ""
    (tmp_path / "dir.log").mkdir()
    broken = LogFollower(store, JOB, SUB, None, io.StringIO(), err=said,
                         files=[tmp_path / "dir.log"])
    broken.print_all()
    broken.print_all()
    assert said.getvalue().count("cannot read it") == 1 and "dir.log" in said.getvalue()


def test_follower_passes_a_progress_bars_redraws_as_they_come(tmp_path, cluster_store):
    """A bar's redraws (``...\\r``, as the pump prints them) are printed before its line
    ends, and ``--rank`` keeps each redraw by its own prefix."""
    _, store = cluster_store
    path = _write(tmp_path / "logs", "[0]<stderr>: 10%|#\r[1]<stdout>:hi\n[0]<stderr>: 20%|##\r")
    out = io.StringIO()
    follower = LogFollower(store, JOB, SUB, None, out, files=[path])
    follower.poll()
    assert out.getvalue() == "[0]<stderr>: 10%|#\r[1]<stdout>:hi\n[0]<stderr>: 20%|##\r"
    zero = io.StringIO()
    LogFollower(store, JOB, SUB, None, zero, rank=0, files=[path]).print_all()
    assert zero.getvalue() == "[0]<stderr>: 10%|#\r[0]<stderr>: 20%|##\r"


def test_following_a_file_drains_its_writers_last_lines(tmp_path, cluster_store):
    """A file says nothing of its writer: the drain waits a quiet round more."""
    _, store = cluster_store
    path = _write(tmp_path / "logs", "[0]<stdout>:first\n")
    out = io.StringIO()
    follower = LogFollower(store, JOB, SUB, None, out, interval=0.1, files=[path])
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while "first" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)

    def writer_ends() -> None:
        time.sleep(0.1)
        _write(tmp_path / "logs", "[0]<stdout>:last words")
    threading.Thread(target=writer_ends, daemon=True).start()
    follower.drain()
    thread.join(timeout=10)
    assert out.getvalue() == "[0]<stdout>:first\n[0]<stdout>:last words\n"


def test_the_newest_log_of_a_job_is_its_last_run(tmp_path):
    root = tmp_path / "logs"
    assert logs_module.last_log(root, JOB) is None  # no folder
    old, new = _write(root, "[0]<stdout>:old\n", sub="aaaa"), _write(root, "x\n", sub="bbbb")
    os.utime(old, (2_000_000_000, 2_000_000_000))
    os.utime(new, (1_000_000_000, 1_000_000_000))
    (root / JOB / "notes.txt").write_text("not a log")
    (root / JOB / "cccc.log").mkdir()  # not a file
    (root / JOB / "dddd.log").symlink_to(tmp_path / "elsewhere.log")
    assert logs_module.last_log(root, JOB) == old
    assert logs_module.last_log(root, "..") is None and logs_module.last_log(root, ".") is None


# -- hostile clients: slow, large, many, a clock off -------------------------------------
FLOODER = "127.0.0.2"  # a loopback address of its own: another peer to the server


def _connect(server: LogServer, source: str = FLOODER, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    try:
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((source, 0))
    except OSError:
        sock.close()
        pytest.skip(f"this machine cannot send from {source}")
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    return sock


def _answer(sock: socket.socket) -> bytes:
    """All the server sends until it hangs up."""
    chunks = []
    while data := sock.recv(1 << 16):
        chunks.append(data)
    return b"".join(chunks)


def _raw(server: LogServer, data: bytes, source: str = "127.0.0.1") -> bytes:
    with _connect(server, source) as sock:
        sock.sendall(data)
        return _answer(sock)


def _until_admitted(server: LogServer, target: str, source: str | None = None) -> int:
    """Ask until the answer is other than 503 or 429 (slots come back asynchronously);
    the last status."""
    deadline = time.monotonic() + 60
    while (status := get(server, target, source=source)[0]) in (503, 429) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return status


def test_slow_clients_are_cut_off_and_starve_no_one(server, monkeypatch):
    monkeypatch.setattr(logs_module, "CLIENT_TIMEOUT", 2.0)
    _write(server.root, "still served\n")
    target = f"/logs/{JOB}/{SUB}"
    request = f"GET {target} HTTP/1.0\r\nX-Slow: ".encode() + b"a" * 100  # never ends
    slow, opened = [], []
    for _ in range(40):
        slow.append(_connect(server))
        opened.append(time.monotonic())
    ended: dict[int, tuple[float, bytes]] = {}  # slow client -> (seconds it lasted, answer)

    def trickle() -> None:  # one byte each every 0.5 s, as long as the server listens
        for sock in slow:
            sock.setblocking(False)  # (a recv only looks)
        for i in range(len(request)):
            for n, sock in enumerate(slow):
                if n in ended:
                    continue
                try:
                    data: bytes | None = sock.recv(1 << 16)
                except BlockingIOError:
                    data = None
                except OSError:
                    data = b""
                if data is None:
                    with contextlib.suppress(OSError):
                        sock.send(request[i:i + 1])
                        continue
                    data = b""
                ended[n] = (time.monotonic() - opened[n], data)  # the server let go
            if len(ended) == len(slow):
                return
            time.sleep(0.5)

    flood = threading.Thread(target=trickle, daemon=True)
    flood.start()
    try:
        probes = []
        while flood.is_alive() and len(probes) < 20:  # from another address, meanwhile
            probes.append(get(server, target)[::2])
            time.sleep(0.2)
        flood.join(timeout=120)
    finally:
        for sock in slow:
            sock.close()
    assert len(probes) >= 3 and set(probes) == {(200, b"still served\n")}
    # every slow client was let go while it still sent: those over the per-peer limit at
    # once with a 429, the others (at most MAX_PER_PEER) with no answer at the deadline
    assert len(ended) == len(slow), "slow clients kept their connections"
    refused = [d for _, d in ended.values() if d.startswith(b"HTTP/1.0 429 ")]
    cut = [t for t, d in ended.values() if d == b""]
    assert len(refused) + len(cut) == len(slow)
    assert 1 <= len(cut) <= logs_module.MAX_PER_PEER
    assert min(cut) >= 0.9 * logs_module.CLIENT_TIMEOUT  # the deadline, not something else


def test_oversized_requests_are_refused(server):
    _write(server.root, "line\n")
    target = f"/logs/{JOB}/{SUB}"
    signed = (f"GET {target} HTTP/1.0\r\n{AUTH_HEADER}: "
              f"{sign_request(SECRET, 'GET', '127.0.0.1', server.port, target, time.time())}"
              "\r\n").encode()
    one_long = signed + b"X-Big: " + b"a" * (2 * MAX_HEADER_BYTES) + b"\r\n\r\n"
    assert _raw(server, one_long).startswith(b"HTTP/1.0 431 ")
    many_short = signed + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 200) for i in range(60)) \
        + b"\r\n"  # (each line short, fewer than the standard library's 100 headers)
    assert _raw(server, many_short).startswith(b"HTTP/1.0 431 ")
    long_line = b"GET /logs/" + b"a" * (2 * MAX_HEADER_BYTES) + b" HTTP/1.0\r\n\r\n"
    assert _raw(server, long_line).startswith(b"HTTP/1.0 414 ")
    padded = signed + b"X-Pad: " + b"a" * (MAX_HEADER_BYTES // 2) + b"\r\n\r\n"
    answer = _raw(server, padded)  # under the cap, padding and all
    assert answer.startswith(b"HTTP/1.0 200 ") and answer.endswith(b"\r\n\r\nline\n")


def test_a_busy_server_answers_503_and_frees_its_slots(server, monkeypatch):
    monkeypatch.setattr(logs_module, "MAX_CLIENTS", 2)
    monkeypatch.setattr(logs_module, "CLIENT_TIMEOUT", 3.0)
    _write(server.root, "line\n")
    target = f"/logs/{JOB}/{SUB}"
    # two idle connections from two addresses (the per-peer limit is not what answers)
    idle = [_connect(server, "127.0.0.2"), _connect(server, "127.0.0.3")]
    try:
        status, headers, body = get(server, target)  # (accepted after them)
        assert status == 503 and headers["Retry-After"].isdigit() and b"busy" in body
        for sock in idle:  # not a byte sent: cut off at the deadline, without an answer
            assert _answer(sock) == b""
    finally:
        for sock in idle:
            sock.close()
    assert _until_admitted(server, target) == 200


def test_one_address_gets_at_most_max_per_peer_connections(server, monkeypatch):
    monkeypatch.setattr(logs_module, "CLIENT_TIMEOUT", 60.0)  # (held for the whole test)
    _write(server.root, "line\n")
    target = f"/logs/{JOB}/{SUB}"
    held = [_connect(server) for _ in range(logs_module.MAX_PER_PEER)]
    try:
        status, headers, body = get(server, target, source=FLOODER)
        assert status == 429 and headers["Retry-After"].isdigit() and FLOODER.encode() in body
        assert get(server, target)[::2] == (200, b"line\n")  # others are served meanwhile
    finally:
        for sock in held:
            sock.close()
    assert _until_admitted(server, target, source=FLOODER) == 200  # hung up: slots back


def test_a_client_that_never_reads_does_not_keep_its_slot(server, monkeypatch):
    try:  # an answer larger than the kernel buffers the sending side at most
        buffered = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        buffered = 4 << 20
    monkeypatch.setattr(logs_module, "MAX_CHUNK", 2 * buffered + (1 << 20))
    monkeypatch.setattr(logs_module, "MAX_CLIENTS", 1)
    monkeypatch.setattr(logs_module, "REPLY_TIMEOUT", 1.0)
    _write(server.root, "x" * logs_module.MAX_CHUNK, sub="big")
    target = f"/logs/{JOB}/big"
    stamp = sign_request(SECRET, "GET", "127.0.0.1", server.port, target, time.time())
    with _connect(server, rcvbuf=4096) as sock:  # (and a small window)
        sock.sendall(f"GET {target} HTTP/1.0\r\n{AUTH_HEADER}: {stamp}\r\n\r\n".encode())
        assert _until_admitted(server, f"/logs/{JOB}/{SUB}") == 404  # (no such log: answered)


def test_a_clock_off_by_more_than_the_window_is_said(server):
    _write(server.root, "line\n")
    target = f"/logs/{JOB}/{SUB}"
    for off in (-120, 120):
        status, headers, body = get(server, target, now=time.time() + off)
        assert status == 401 and b"clocks differ" in body and b"line" not in body
        assert abs(int(headers[SKEW_HEADER]) + off) <= 1  # the node's time - the stamp
    # a wrong secret proves nothing: the same 401 as ever, whatever its clock
    for off in (0, -120):
        status, headers, body = get(server, target, secret=b"another secret",
                                    now=time.time() + off)
        assert status == 401 and SKEW_HEADER not in headers and b"clock" not in body


def test_the_follower_names_the_clock_difference(tmp_path, cluster_store):
    _, store = cluster_store
    ahead = LogServer(tmp_path / "logs", "127.0.0.1", SECRET, clock=lambda: time.time() + 95)
    ahead.start()
    try:
        _register(store, "n1", ahead)
        _write(ahead.root, "[0]<stdout>:not yet\n")
        out, err = io.StringIO(), io.StringIO()
        follower = LogFollower(store, JOB, SUB, SECRET, out, err=err)
        for _ in range(2):
            follower.poll(force=True)
            follower.sources["n1"].next_ask = 0.0  # (ask again at once)
        assert out.getvalue() == ""
        said = err.getvalue()
        assert said.count("\n") == 1, said  # said once
        assert re.search(r"node n1: refused the log \(401: this machine's clock and the node's "
                         r"differ by 9[56] s \(the node's is ahead\); sync them \(NTP\)\)$",
                         said.strip()), said
        wrong = io.StringIO()
        LogFollower(store, JOB, SUB, b"wrong", io.StringIO(), err=wrong).poll(force=True)
        assert "cluster secret is needed" in wrong.getvalue()
        assert "clock" not in wrong.getvalue()
    finally:
        ahead.stop()

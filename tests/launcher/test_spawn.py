"""Workers start with no Python code run between fork and exec (issue 27 item 6), and
still die with the process that started them.

A node agent holds gRPC threads (the etcd store's keep-alive and watch streams). With
``preexec_fn`` CPython forked and ran gRPC's at-fork handlers in the child, which now and
then aborted it before exec (``epoll_wait error: Bad file descriptor``, exit -6: 19 of
1,000 starts here). ``launcher/spawn.py`` sets the parent-death signal with an
exec helper instead (``setpriv``, else a ``python -S -I`` fallback); both are tested here.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from waiting import wait_for  # tests/waiting.py

from pollux_launch import env as envvars
from pollux_launch.launcher import spawn
from pollux_launch.launcher.workers import WorkerGroup
from pollux_launch.rendezvous.store import open_store

STARTS = 400  # (the old preexec_fn path failed this test on every try: 10 of 400 aborted)
THREADS = 4

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="PR_SET_PDEATHSIG is Linux's")


@pytest.fixture(params=["setpriv", "python"])
def method(request, monkeypatch):
    """Each way spawn.py can tie a worker to its parent, forced in this process."""
    if request.param == "setpriv":
        if spawn.method() != "setpriv":
            pytest.skip("no setpriv --pdeathsig here (util-linux >= 2.33)")
        return request.param
    monkeypatch.setattr(spawn, "_chosen", ["python", sys.executable])
    return request.param


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # (init reaps late)
    except psutil.NoSuchProcess:
        return True


def _run_all(group: WorkerGroup, count: int, command: list[str]) -> list[int]:
    codes: list[int] = []
    for i in range(count):
        worker = group.start(f"w{i}", {}, command=command)
        worker.proc.wait(timeout=30)
        while worker.worker_id in group.workers:
            codes += [code for _, code in group.reap()]
    return codes


@needs_linux
def test_hundreds_of_workers_start_beside_live_grpc_threads(etcd_server, store_prefix):
    """Every start succeeds while this process's gRPC threads are busy: a keep-alive, two
    watches and a writer on a real etcd, all running while the workers start."""
    store = open_store(etcd_server.url, store_prefix, timeout=10)
    stop = threading.Event()
    seen = {"events": 0, "puts": 0}

    def watch() -> None:
        rev = store.revision()
        while not stop.is_set():
            events = store.wait("/traffic/", rev, 0.5)
            if events:
                seen["events"] += len(events)
                rev = max(e.revision for e in events)

    def write() -> None:
        while not stop.is_set():
            store.put(f"/traffic/k{seen['puts'] % 8}", str(seen["puts"]))
            seen["puts"] += 1
            time.sleep(0.002)

    keep = store.keep_alive(store.lease_grant(3), 0.2)
    traffic = [threading.Thread(target=f, daemon=True) for f in (watch, watch, write)]
    try:
        for thread in traffic:
            thread.start()
        wait_for(lambda: seen["events"] > 0, 10, "the watches to see the writes")
        before = dict(seen)
        groups = [WorkerGroup("spawn", ["true"], {}, stdout=io.StringIO())
                  for _ in range(THREADS)]
        results: list[list[int]] = [[] for _ in groups]
        starters = [threading.Thread(target=lambda i=i: results[i].extend(
            _run_all(groups[i], STARTS // THREADS, ["true"]))) for i in range(THREADS)]
        t0 = time.monotonic()
        for thread in starters:
            thread.start()
        for thread in starters:
            thread.join(timeout=120)
        took = time.monotonic() - t0
        assert seen["puts"] > before["puts"] and seen["events"] > before["events"], \
            "no gRPC traffic while the workers started"
        assert not keep.expired.is_set()
    finally:
        stop.set()
        for thread in traffic:
            thread.join(timeout=10)
        keep.stop()
        store.close()
    codes = [code for result in results for code in result]
    assert len(codes) == STARTS
    assert codes == [0] * STARTS, {code: codes.count(code) for code in set(codes)}
    print(f"{STARTS} starts in {took:.1f} s through {spawn.method()}")


# The starting process: a node agent's situation (gRPC threads from an etcd store) with a
# long-running worker; it prints the worker's pid and waits to be killed.
STARTER = textwrap.dedent("""
    import io, sys, time
    from pollux_launch.launcher import spawn
    from pollux_launch.launcher.workers import WorkerGroup
    from pollux_launch.rendezvous.store import open_store

    url, prefix, how = sys.argv[1:4]
    if how == "python":
        spawn._chosen = ["python", sys.executable]
    store = open_store(url, prefix, timeout=10)
    keep = store.keep_alive(store.lease_grant(3), 0.2)
    group = WorkerGroup("spawn", ["sleep", "60"], {}, stdout=io.StringIO())
    worker = group.start("w0", {})
    print(worker.pid, spawn.method(), flush=True)
    time.sleep(120)
""")


@needs_linux
def test_a_killed_starter_takes_its_worker_along(etcd_server, store_prefix, method):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, etcd_server.url, store_prefix,
                                method], stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        line = starter.stdout.readline().split()
        assert len(line) == 2 and line[1] == method, line
        pid = int(line[0])
        worker = psutil.Process(pid)
        assert worker.ppid() == starter.pid
        # (the same process: the helper execs the command once the signal is set)
        wait_for(lambda: worker.cmdline() == ["sleep", "60"], 10, "the helper's exec")
        assert os.getsid(worker.pid) == worker.pid  # its own session: stop() signals it
        time.sleep(0.3)
        assert not _gone(worker.pid)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        wait_for(lambda: _gone(worker.pid), 10, "the worker to die with its starter")
    finally:
        starter.kill()
        starter.wait()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


@needs_linux
def test_a_worker_whose_starter_died_before_the_prctl_kills_itself(method):
    """The helper finds its parent is not the one that started it (here: claims pid 1)."""
    argv = [*spawn._prefix(os.getpid()), "sh", "-c", "exit 7"]
    assert subprocess.run(argv, timeout=30).returncode == 7
    orphan = [*spawn._prefix(1), "sh", "-c", "exit 7"]
    assert subprocess.run(orphan, timeout=30).returncode == -signal.SIGKILL


@needs_linux
def test_the_worker_gets_its_environment_and_signals_as_given(method, monkeypatch):
    """No helper leaves a trace: not Python's LC_CTYPE (PEP 538 coerces a C locale), not
    its ignored SIGPIPE; the secrets are still stripped."""
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.setenv(envvars.SECRET, "hush")
    script = f'echo "ctype=$LC_CTYPE secret=${{{envvars.SECRET}:-none}}"; ' \
             "grep -E '^Sig(Ign|Blk)' /proc/self/status"
    out = io.StringIO()
    group = WorkerGroup("spawn", ["sh", "-c", script], {"LC_CTYPE": "C"}, stdout=out,
                        prefix_output=False)
    worker = group.start("w0", {})
    worker.proc.wait(timeout=30)
    wait_for(lambda: group.reap(), 10, "the worker to be reaped")
    plain = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                           env={"LC_CTYPE": "C", "PATH": os.environ["PATH"]}).stdout
    assert out.getvalue() == plain
    assert out.getvalue().startswith("ctype=C secret=none\n")


def test_a_program_that_cannot_run_is_one_oserror_at_start(tmp_path, method):
    group = WorkerGroup("spawn", ["no-such-program-pollux"], {}, cwd=str(tmp_path),
                        stdout=io.StringIO())
    with pytest.raises(FileNotFoundError, match="No such file or directory: "
                                                "'no-such-program-pollux'"):
        group.start("w0", {})
    (tmp_path / "data.txt").write_text("not a program\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho ran \"$@\"\n")
    (tmp_path / "run.sh").chmod(0o755)
    for command, error in ((["./data.txt"], PermissionError), ([str(tmp_path)], PermissionError),
                           (["./missing.sh"], FileNotFoundError)):
        with pytest.raises(error, match=re.escape(repr(command[0]))):
            group.start("w1", {}, command=command)
    assert not group.workers
    # a name is looked up along the worker's PATH, relative to its cwd; a path from its cwd
    out = io.StringIO()
    group = WorkerGroup("spawn", ["run.sh", "a"], {"PATH": f"/nowhere:.:{os.defpath}"},
                        cwd=str(tmp_path), stdout=out, prefix_output=False)
    group.start("w0", {})
    group.start("w1", {}, command=["./run.sh", "b"])
    ended: list = []
    wait_for(lambda: ended.extend(group.reap()) or len(ended) == 2, 30, "the workers to end")
    assert [code for _, code in ended] == [0, 0]
    assert sorted(out.getvalue().splitlines()) == ["ran a", "ran b"]
    with pytest.raises(FileNotFoundError, match="'/nonexistent-pollux'"):  # as Popen says
        WorkerGroup("spawn", ["true"], {}, cwd="/nonexistent-pollux").start("w0", {})

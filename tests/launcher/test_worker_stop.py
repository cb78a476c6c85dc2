"""Stopping a worker stops all of its processes, and the slot and GPU it held are freed
only once they are gone (issue items 4 and 8).

Real processes throughout: a child that ignores SIGTERM in the worker's process group
(it once outlived a cancel, and its GPU was handed to the next worker), and a daemon that
left the worker's session (``setsid``), found by its cgroup where this machine allows
one and by the worker's token in its environment where not.
"""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import sys
import textwrap

import psutil
import pytest
from waiting import wait_for  # tests/waiting.py

from pollux_launch.launcher import proctree
from pollux_launch.launcher.devices import DevicePool
from pollux_launch.launcher.workers import WorkerGroup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")

# The worker: starts a child that ignores SIGTERM, in its own process group; says so, and
# then waits (or, with "exit", exits 0 at once).
STUBBORN_CHILD = textwrap.dedent("""
    import signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time\\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        "print('child ready', flush=True)\\n"
        "time.sleep(600)\\n"])
    print(f"child {child.pid}", flush=True)
    if sys.argv[1:] != ["exit"]:
        time.sleep(600)
""")

# The worker: starts a daemon the usual way (fork, setsid, fork: a grandchild in a session
# of its own, whose parent has exited), says its pid, then waits (or exits, as above).
DAEMONISER = textwrap.dedent("""
    import os, sys, time
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            print(f"daemon {os.getpid()}", flush=True)
            time.sleep(600)
        os._exit(0)
    os.waitpid(pid, 0)
    if sys.argv[1:] != ["exit"]:
        time.sleep(600)
""")


@pytest.fixture(params=["cgroup", "environment"])
def finding(request, monkeypatch):
    """How a worker's processes outside its session are found: by its cgroup (where this
    machine allows one), or by its token in their environment (cgroups turned off)."""
    if request.param == "cgroup":
        if proctree.cgroup_parent() is None:
            pytest.skip("no writable cgroup v2 here")
    else:
        monkeypatch.setattr(proctree, "_parent", (os.getpid(), None))
    return request.param


@pytest.fixture
def pids():
    """Pids the test learns of, SIGKILLed afterwards if they are still alive."""
    found: list[int] = []
    yield found
    for pid in found:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: this machine's PID 1 may never reap an orphan)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _said(out: io.StringIO, what: str) -> int:
    """The pid the worker printed as ``<what> <pid>``."""
    found = wait_for(lambda: re.search(rf"<stdout>:{what} (\d+)\n", out.getvalue()), 60,
                     f"the worker to say its {what}'s pid")
    return int(found.group(1))


def _warned(group: WorkerGroup, caplog) -> list[str]:
    """The warnings naming what an ended worker left running, once its reaps said so
    (not at once: what ends a moment after a worker is not worth one)."""
    def said() -> list[str]:
        group.reap()
        return [r.getMessage() for r in caplog.records if "left 1 process(es) running" in
                r.getMessage()]

    wait_for(said, 60, "the warning")
    return said()


def _in_group(pid: int) -> list[int]:
    return [p.pid for p in proctree.snapshot() if pid in (p.pgrp, p.session)]


def _group(tmp_path, script: str, *args: str) -> tuple[WorkerGroup, io.StringIO]:
    out = io.StringIO()
    group = WorkerGroup("stop", [sys.executable, "-c", script, *args], {}, stdout=out,
                        devices=DevicePool(("0",), str(tmp_path / "gpus")))
    return group, out


def test_stop_kills_a_child_that_ignores_sigterm_then_frees_the_gpu(tmp_path, finding, pids):
    group, out = _group(tmp_path, STUBBORN_CHILD)
    worker = group.start("w0", {})
    pids.append(_said(out, "child"))
    wait_for(lambda: "child ready" in out.getvalue(), 60, "the child to ignore SIGTERM")
    group.stop(grace=1.0)
    assert _gone(pids[0]) and _gone(worker.pid)
    assert _in_group(worker.pid) == []  # nothing of its process group or session is left
    assert group.devices.owners() == {"0": "stop"}  # (freed by the reap, as a slot is)
    assert [(w.worker_id, code) for w, code in group.reap()] == [("w0", -signal.SIGTERM)]
    assert group.devices.owners() == {} and not group.lingering


def test_a_child_that_outlives_its_worker_keeps_the_gpu_until_stopped(tmp_path, finding, pids,
                                                                      caplog):
    group, out = _group(tmp_path, STUBBORN_CHILD, "exit")
    worker = group.start("w0", {})
    pids.append(_said(out, "child"))
    wait_for(lambda: "child ready" in out.getvalue(), 60, "the child to ignore SIGTERM")
    with caplog.at_level(logging.WARNING, logger="pollux_launch.launcher.workers"):
        ended = wait_for(group.reap, 60, "the worker to be reaped")
        assert [(w.worker_id, code) for w, code in ended] == [("w0", 0)]
        warned = _warned(group, caplog)
    assert len(warned) == 1 and f"pid {pids[0]} (" in warned[0] and "GPU 0" in warned[0]
    assert not group.workers and group.lingering == [worker]
    assert group.devices.owners() == {"0": "stop"}  # (its child may be using it)
    group.stop(grace=1.0)
    assert _gone(pids[0]) and _in_group(worker.pid) == []
    assert group.devices.owners() == {} and not group.lingering


@pytest.mark.parametrize("exits", [False, True], ids=["running", "exited"])
def test_a_daemon_that_left_the_session_is_reported_and_killed_at_stop(tmp_path, finding,
                                                                       pids, caplog, exits):
    group, out = _group(tmp_path, DAEMONISER, *(["exit"] if exits else []))
    worker = group.start("w0", {})
    daemon = _said(out, "daemon")
    pids.append(daemon)
    assert worker.pid not in (os.getsid(daemon), os.getpgid(daemon))  # (out of its session)
    if exits:
        with caplog.at_level(logging.WARNING, logger="pollux_launch.launcher.workers"):
            ended = wait_for(group.reap, 60, "the worker to be reaped")
            assert [code for _, code in ended] == [0]
            warned = _warned(group, caplog)
        assert len(warned) == 1 and f"pid {daemon} (" in warned[0], caplog.text
        assert group.devices.owners() == {"0": "stop"}
        assert not _gone(daemon)  # (reported, not killed: the job may still need it)
    with caplog.at_level(logging.WARNING, logger="pollux_launch.launcher.workers"):
        group.stop(grace=1.0)
    assert _gone(daemon) and _gone(worker.pid)
    assert ("killing 1 process(es) worker w0 (exited 0) left running" in caplog.text) == exits
    group.reap()
    assert group.devices.owners() == {} and not group.lingering and not group.workers
    if finding == "cgroup":
        assert worker.tree.cgroup is not None and not worker.tree.cgroup.path.exists()


def test_a_child_that_ends_just_after_its_worker_is_not_worth_a_warning(tmp_path, caplog):
    """(multiprocessing's resource tracker, say: it ends once its users have)"""
    done = tmp_path / "done"
    child = f"while [ ! -e {done} ]; do sleep 0.02; done"
    group, _ = _group(tmp_path, f"import subprocess; subprocess.Popen(['sh', '-c', {child!r}])")
    group.start("w0", {})
    with caplog.at_level(logging.INFO, logger="pollux_launch.launcher.workers"):
        ended = wait_for(group.reap, 60, "the worker to be reaped")
        assert [code for _, code in ended] == [0]
        assert group.devices.owners() == {"0": "stop"} and len(group.lingering) == 1
        done.touch()
        wait_for(lambda: group.reap() == [] and not group.devices.owners(), 60,
                 "its GPU to be freed once its child has ended")
    assert not group.lingering and "left" not in caplog.text


def test_sigterm_then_sigkill_ends_a_worker_only_with_its_group(tmp_path, finding, pids):
    """RestartDriver's way (signal, reap, SIGKILL when overdue): a worker whose child
    ignored the SIGTERM is not reaped - its slot and GPU not freed - until the SIGKILL."""
    group, out = _group(tmp_path, STUBBORN_CHILD)
    worker = group.start("w0", {})
    pids.append(_said(out, "child"))
    wait_for(lambda: "child ready" in out.getvalue(), 60, "the child to ignore SIGTERM")
    group.signal(signal.SIGTERM, ["w0"])
    wait_for(lambda: worker.poll() is not None, 60, "the worker to exit")
    assert group.reap() == [] and "w0" in group.workers and not _gone(pids[0])
    group.signal(signal.SIGKILL, ["w0"])
    ended = wait_for(group.reap, 60, "the worker to be reaped")
    assert [(w.worker_id, code) for w, code in ended] == [("w0", -signal.SIGTERM)]
    assert _gone(pids[0]) and group.devices.owners() == {}


def test_a_workers_processes_carry_its_token(tmp_path, pids):
    """The tag found without a cgroup: every process a worker starts inherits it."""
    group, out = _group(tmp_path, DAEMONISER)
    worker = group.start("w0", {})
    daemon = _said(out, "daemon")
    pids.append(daemon)
    tagged = {p.pid for p in proctree.snapshot([worker.tree.tag]) if p.tags}
    assert {worker.pid, daemon} <= tagged
    assert daemon in worker.tree.members(proctree.snapshot([worker.tree.tag]), False)
    group.stop(grace=1.0)
    assert _gone(daemon)

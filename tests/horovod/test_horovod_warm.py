"""Pre-started Horovod newcomers (adapters/horovod/launch/warm.py, zygote.py, handoff.py), with
real processes: the hand-off shim, the warm zygote and its forked workers; then real
``horovodrun`` growing a job whose newcomers come from the zygote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")

from pollux_launch import keys
from pollux_launch.adapters.horovod.launch.command import (
    horovodrun_command,
    write_horovodrun_script,
)
from pollux_launch.adapters.horovod.launch.hosts import HostsFileMirror, write_discovery_script
from pollux_launch.adapters.horovod.launch.warm import ENV_SOCKET, WarmStart, python_command
from pollux_launch.messages import Allocation, encode
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("warm_worker.py")

# What a worker handed off reports: warm or not, its argv, directory, one variable and
# parent; then it does what $HANDOFF_MODE says (the command itself is fixed: a zygote
# serves its job's command only).
SCRIPT = """\
import json, os, sys, time
print(json.dumps({"warm": "torch" in sys.modules, "argv": sys.argv, "cwd": os.getcwd(),
                  "var": os.environ.get("HANDOFF_VAR"), "pid": os.getpid(),
                  "ppid": os.getppid(), "name": __name__}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = os.environ.get("HANDOFF_MODE", "exit")
if mode == "exit":
    sys.exit(int(os.environ.get("HANDOFF_CODE", "0")))
if mode == "abort":
    os.abort()
if mode == "raise":
    raise RuntimeError("boom")
if mode == "sleep":
    time.sleep(600)
"""


def wait_until(pred, what: str, timeout: float = 300.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            assert proc.poll() is None, f"exited early with {proc.returncode}"
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not {what} within {timeout} s")


def test_python_command_is_split_as_python_reads_it():
    c = python_command(["python3", "-u", "-X", "dev", "train.py", "--lr", "1"])
    assert c is not None and c.interpreter == ("python3", "-u", "-X", "dev")
    assert (c.script, c.module, c.args) == ("train.py", None, ("--lr", "1"))
    c = python_command(["/v/bin/python3.11", "-Bu", "-m", "pkg.train", "-x"])
    assert c is not None and (c.module, c.args) == ("pkg.train", ("-x",))
    assert python_command(["python", "-c", "print(1)", "a"]).code == "print(1)"
    # not a plain python command, or a flag a zygote could not share: no warm start
    for cmd in (["bash", "run.sh"], ["python", "-E", "t.py"], ["python"], ["python", "-m"],
                ["./train.py"]):
        assert python_command(cmd) is None, cmd
    assert WarmStart("j", ["bash", "run.sh"], {}).command() == ["bash", "run.sh"]


def test_a_zygote_that_cannot_start_gives_way_to_cold_newcomers(tmp_path, caplog):
    fake = tmp_path / "python3"  # "the job's interpreter": exits at once
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    warm = WarmStart("broken", [str(fake), "train.py"], {})
    try:
        assert not warm.ready()  # started; not listening yet
        wait_until(warm.ready, "given up")
        assert warm.given_up and not warm.served
        assert "newcomers start cold" in caplog.text
        assert warm.ready()  # from now on the gate never holds
    finally:
        warm.stop()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """One warm zygote for the hand-off tests (its warm-up imports torch: seconds)."""
    folder = tmp_path_factory.mktemp("handoff")
    script = folder / "job.py"
    script.write_text(SCRIPT)
    warm = WarmStart("handoff", [sys.executable, str(script)], {"OMP_NUM_THREADS": "1"},
                     cwd=str(folder))
    try:
        wait_until(warm.ready, "ready")
        assert warm.served and not warm.given_up
        yield warm
    finally:
        warm.stop()


def handoff(warm: WarmStart, cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        warm.command(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **warm.environment(), **env})


def report(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=120)
    return json.loads(out.splitlines()[0]), err


def test_handoff_runs_the_command_in_a_warm_fork_with_the_senders_context(zygote, tmp_path):
    proc = handoff(zygote, tmp_path, HANDOFF_VAR="from the sender", HANDOFF_CODE="3")
    got, err = report(proc)
    assert proc.returncode == 3  # the worker's exit code is the shim's
    assert got["warm"] is True, "torch was imported before the script's first line"
    assert got["ppid"] == zygote.group.workers["zygote"].pid
    assert got["pid"] != proc.pid
    script = zygote.user_command[1]
    assert got["argv"] == [script] and got["name"] == "__main__"
    assert got["cwd"] == str(tmp_path) and got["var"] == "from the sender"
    assert "to stderr" in err


def test_a_worker_killed_by_a_signal_is_reported_as_a_shell_would(zygote, tmp_path):
    proc = handoff(zygote, tmp_path, HANDOFF_MODE="abort")
    got, _ = report(proc)
    assert got["warm"] is True
    assert proc.returncode == 128 + signal.SIGABRT  # 134: how Horovod ends removed workers
    proc = handoff(zygote, tmp_path, HANDOFF_MODE="raise")
    _, err = report(proc)
    assert proc.returncode == 1 and "RuntimeError: boom" in err


def test_signals_reach_the_worker_and_it_dies_with_its_shim(zygote, tmp_path):
    proc = handoff(zygote, tmp_path, HANDOFF_MODE="sleep")
    first = json.loads(proc.stdout.readline())
    assert first["warm"] is True
    proc.send_signal(signal.SIGTERM)  # forwarded: the worker ends as SIGTERM ends it
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not psutil.pid_exists(first["pid"]) or \
        psutil.Process(first["pid"]).status() == psutil.STATUS_ZOMBIE
    proc = handoff(zygote, tmp_path, HANDOFF_MODE="sleep")
    second = json.loads(proc.stdout.readline())
    worker = psutil.Process(second["pid"])
    proc.kill()  # the shim cannot forward SIGKILL: its closed connection ends the worker
    proc.wait(timeout=60)
    worker.wait(timeout=60)


def test_without_a_zygote_or_for_another_command_the_worker_starts_cold(zygote, tmp_path):
    env = {**os.environ, ENV_SOCKET: str(tmp_path / "none.sock"), "HANDOFF_CODE": "5"}
    proc = subprocess.Popen(zygote.command(), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    got, _ = report(proc)
    assert proc.returncode == 5 and got["warm"] is False
    assert got["pid"] == proc.pid  # the shim exec'd the command itself
    other = [*zygote.command(), "--another-argument"]
    proc = subprocess.Popen(other, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **zygote.environment()})
    got, err = report(proc)
    assert proc.returncode == 0 and got["warm"] is False
    assert got["argv"][1:] == ["--another-argument"] and "refused" in err


# ------------------------------------------------------------------ real horovodrun
def records(log_dir: Path) -> list[dict]:
    out = []
    for path in log_dir.glob("w-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return sorted(out, key=lambda r: r["t"])


def steps_at(log_dir: Path, size: int, after: float, n: int) -> bool:
    per_rank: dict[int, int] = defaultdict(int)
    for r in records(log_dir):
        if r["event"] == "step" and r["size"] == size and r["t"] > after:
            per_rank[r["rank"]] += 1
    return len(per_rank) == size and min(per_rank.values()) >= n


def test_horovod_grows_onto_newcomers_prestarted_before_the_survivors_reset(tmp_path):
    store = open_store(f"embedded://{tmp_path / 'store.db'}")
    job, key = "hvd-warm", keys.job("hvd-warm", "allocation")
    store.put(key, encode(Allocation(1, ("localhost",) * 2)))
    hosts, log_dir, stop = tmp_path / "hosts", tmp_path / "logs", tmp_path / "stop"
    log_dir.mkdir()
    script = write_discovery_script(tmp_path / "discover.sh", hosts)
    warm = WarmStart(job, [sys.executable, str(WORKER), str(log_dir), str(stop)],
                     {"OMP_NUM_THREADS": "1"})
    argv = horovodrun_command(warm.command(), discovery_script=str(script), np=2, min_np=1,
                              max_np=3, horovodrun=write_horovodrun_script(tmp_path / "horovodrun"))
    env = {**os.environ, **warm.environment()}
    grows: list[float] = []
    with open(tmp_path / "out.txt", "w") as out, \
            HostsFileMirror(store, job, hosts, newcomers_ready=warm.ready) as mirror:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until(lambda: steps_at(log_dir, 2, 0, 5), "training at 2", proc=proc)
            for version, size in ((2, 3), (3, 2), (4, 3)):
                t = time.time()
                if size == 3:
                    grows.append(t)
                store.put(key, encode(Allocation(version, ("localhost",) * size)))
                wait_until(lambda s=size, t=t: steps_at(log_dir, s, t, 5), f"training at {size}",
                           proc=proc)
            assert not mirror.holding
            stop.touch()
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            zygote_pid = warm.group.workers["zygote"].pid if warm.group else None
            warm.stop()
    store.close()
    assert rc == 0, (tmp_path / "out.txt").read_text()[-4000:]
    recs = records(log_dir)
    inits = [r for r in recs if r["event"] == "init"]
    first, newcomers = inits[:2], inits[2:]
    assert not any(r["warm"] for r in first), "the first workers start cold (no zygote yet)"
    assert len(newcomers) == 2, inits
    assert warm.ready_at is not None and zygote_pid is not None
    survivors = {r["pid"] for r in first}
    for grow, newcomer in zip(grows, newcomers, strict=True):
        assert newcomer["warm"] and newcomer["ppid"] == zygote_pid, newcomer
        interrupts = [r for r in recs if r["event"] == "interrupt" and r["t"] > grow
                      and r["pid"] in survivors]
        assert {r["pid"] for r in interrupts} == survivors
        interrupted = min(r["t"] for r in interrupts)
        # Horovod's own protocol: its driver started the newcomer in the survivors' reset
        assert newcomer["t_top"] > interrupted
    # The first grow waited for the zygote (the hosts were reported once it was ready),
    # and the survivors trained on at 2 meanwhile.
    interrupted = min(r["t"] for r in recs if r["event"] == "interrupt" and r["t"] > grows[0])
    assert grows[0] < warm.ready_at < interrupted
    for pid in survivors:
        assert any(r["event"] == "step" and r["pid"] == pid and r["size"] == 2
                   and grows[0] < r["t"] < warm.ready_at for r in recs), pid
    # every (re)start at size 3 began from identical parameters on every rank
    starts: dict[int, set[str]] = defaultdict(set)
    for r in recs:
        if r["event"] == "start" and r["size"] == 3:
            starts[r["step"]].add(r["digest"])
    assert starts and all(len(d) == 1 for d in starts.values()), starts

"""Horovod jobs under ``pollux-run`` on one machine, with real processes and real Horovod:
a SIGKILLed worker costs one replica, not the job (its slot gets a new worker, the job
finishes with every epoch and horovodrun's result); a live shrink says one ``[pollux]``
line and keeps the removed worker's abort out of the terminal (the job's log keeps it);
a cancel ends without Horovod's traceback. Plus the pure parts of
``adapters/horovod/launch/local_run.py`` and the launcher's output filter.

The training script is tests/compat/horovod_elastic.py (plain Horovod Elastic): its
result does not depend on the number of workers nor on resets, so a run that lost a
worker must end with the weights of an undisturbed ``horovodrun -np 2``.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from waiting import jsonl_records as records  # tests/waiting.py

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")

from pollux_launch.adapters.horovod.launch.driver import TerminalFilter
from pollux_launch.adapters.horovod.launch.local_run import LOG_ONLY, ReplicaNames

PYTHON = sys.executable
BIN = Path(PYTHON).parent
POLLUX_RUN, HOROVODRUN = str(BIN / "pollux-run"), str(BIN / "horovodrun")
HVD = str(Path(__file__).parents[1] / "compat" / "horovod_elastic.py")
EPOCHS = 12
# What Horovod prints for a worker that a reset removed (it aborts it): never shown.
REMOVED_NOISE = ("terminate called", "Aborted", "has been removed from elastic job",
                 "status code 134")


def env() -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
         "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    for name in ("POLLUX_STORE", "POLLUX_STORE_PREFIX", "POLLUX_JOB"):
        e.pop(name, None)
    return e


def wait_for(proc: subprocess.Popen, pred, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in [psutil.Process(proc.pid), *family] if proc.poll() is None else family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def workers(marker: str) -> list[psutil.Process]:
    """The training processes of one test (the script itself, not its launchers or the
    hand-off shim; the shim's worker where the warm path forked it)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) > 1 and Path(cmd[0]).name.startswith("python") and cmd[1] == HVD \
                and any(marker in c for c in cmd):
            out.append(p)
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    """``horovodrun -np 2``, undisturbed: the result every run here must end with."""
    d = tmp_path_factory.mktemp("hvd-baseline")
    r = subprocess.run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", PYTHON, HVD,
                        "--epochs", str(EPOCHS), "--result", str(d / "result.json")],
                       cwd=d, env=env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((d / "result.json").read_text())


def assert_same_result(got: dict, want: dict) -> None:
    assert got["epochs_run"] == want["epochs_run"] == EPOCHS
    assert np.allclose(got["weights"], want["weights"], rtol=1e-4, atol=1e-4)
    assert got["final_loss"] == pytest.approx(want["final_loss"], rel=1e-4, abs=1e-6)


class Job:
    """``pollux-run`` running the script paced (``pace`` file), output to a file."""

    def __init__(self, tmp: Path, name: str, flags: list[str]) -> None:
        self.tmp, self.name = tmp, name
        self.events, self.pace = tmp / "events.jsonl", tmp / "pace"
        self.result, self.out = tmp / "result.json", tmp / "out.txt"
        self.pace.touch()
        self.argv = [POLLUX_RUN, "--store", f"embedded://{tmp / 'store.db'}",
                     "--job-name", name, *flags, "python", HVD, "--epochs", str(EPOCHS),
                     "--step-sleep", "0.05", "--pace-file", str(self.pace),
                     "--result", str(self.result), "--events", str(self.events)]
        self._out = open(self.out, "w")
        self.proc = subprocess.Popen(self.argv, cwd=tmp, stdout=self._out,
                                     stderr=subprocess.STDOUT, env=env(),
                                     start_new_session=True)

    def starts(self) -> list[dict]:
        return [r for r in records(self.events) if r["event"] == "start"]

    def text(self) -> str:
        return self.out.read_text()

    def finish(self, timeout: float = 180) -> int:
        self.pace.unlink(missing_ok=True)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)
        self._out.close()


def job_log(name: str) -> str:
    """The job's log as the node keeps it (``pollux-run logs`` serves these files)."""
    root = Path(os.environ["XDG_STATE_HOME"])
    return "".join(p.read_text(errors="replace") for p in root.rglob(f"logs/{name}/*.log"))


def status_of(job: Job) -> str:
    r = subprocess.run([POLLUX_RUN, "status", "--store", f"embedded://{job.tmp / 'store.db'}"],
                       capture_output=True, text=True, timeout=60, env=env())
    return r.stdout + r.stderr


# ------------------------------------------------------------------- real processes
@pytest.mark.parametrize("victim,lowest,gpus", [
    ("rank1", 1, 0), ("rank0", 1, 0), ("rank1", 2, 0), ("rank0", 1, 2), ("rank1", 2, 2)])
def test_killed_worker_is_replaced_and_the_job_finishes_whole(tmp_path, baseline, victim,
                                                              lowest, gpus):
    """SIGKILL one of a live job's two workers mid-training: the survivor goes on (no
    ``blacklisted ... stop running``) - at 1 replica meanwhile, or waiting in Horovod's
    reset where ``--min-np`` is 2 - the dead worker's slot gets a new worker (the job is
    back at 2), status stays ``running`` meanwhile and says ``succeeded, exit code 0`` at
    the end, and the result is horovodrun's, every epoch trained. With ``--gpus`` the
    workers run through the machine's node agent (Horovod's cluster mode: both on one
    node, which a lost worker no longer takes out)."""
    name = f"hvd-kill-{victim}-{lowest}" + (f"-gpus{gpus}" if gpus else "")
    job = Job(tmp_path, name, ["-np", "2", "--min-np", str(lowest), "--max-np", "2"]
              + (["--gpus", str(gpus)] if gpus else []))
    try:
        wait_for(job.proc, lambda: any(r["event"] == "epoch" for r in records(job.events)),
                 "the first epoch", 180)
        rank0 = job.starts()[0]["pid"]
        procs = workers(str(tmp_path))
        assert len(procs) == 2, procs
        [target] = [p for p in procs if (p.pid == rank0) == (victim == "rank0")]
        before = len(job.starts())
        target.send_signal(signal.SIGKILL)
        wait_for(job.proc, lambda: [r["size"] for r in job.starts()[before:]][-1:] == [2],
                 "the job back at 2 replicas", 120)
        assert "running" in status_of(job)
        assert target.pid not in {p.pid for p in workers(str(tmp_path))}
        rc = job.finish()
    finally:
        job.close()
    text = job.text()
    assert rc == 0, text[-4000:]
    assert "blacklisted" not in text and "stop running" not in text, text[-4000:]
    assert re.search(rf"\[pollux\] {name}: replica \S+ lost \(exit code 137\); the job "
                     "goes on", text), text
    # with --min-np 1 the survivor goes on alone and the new worker joins by a grow -
    # unless Horovod's discovery (every second) already named the slot again when the
    # reset was assigned (no back-off on a first loss): then it is 2 -> 2 in one reset
    shrunk = f"[pollux] {name}: replicas 2 -> 1 (live)" in text
    assert shrunk == (f"[pollux] {name}: replicas 1 -> 2 (live)" in text), text
    assert not shrunk or lowest == 1, text
    assert f"[pollux] {name}: succeeded, exit code 0" in text
    got = json.loads(job.result.read_text())
    assert got["world_sizes"][-1] == 2
    assert_same_result(got, baseline)


FAILING = """\
import os, sys, time
import horovod.torch as hvd
import torch

hvd.init()
state = hvd.elastic.TorchState(step=0)


@hvd.elastic.run
def train(state):
    while state.step < 100000:
        hvd.allreduce(torch.zeros(1))
        state.step += 1
        if hvd.rank() == 1 and os.path.exists(sys.argv[1]):
            sys.exit(3)  # the script's own failure, on one rank
        time.sleep(0.02)
        state.commit()


train(state)
"""


def test_a_worker_that_fails_by_itself_fails_the_job(tmp_path):
    """A worker that exits with an error code (not killed) is the script's failure, as
    the native path classifies it: the job fails (no endless replacements of a rank
    that fails every time), said in one line, with a non-zero exit."""
    script, trigger = tmp_path / "failing.py", tmp_path / "fail-now"
    script.write_text(FAILING)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [POLLUX_RUN, "--store", f"embedded://{tmp_path / 'store.db'}", "--job-name",
             "hvd-fails", "-np", "2", "--min-np", "1", "--max-np", "2", "python",
             str(script), str(trigger)], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT,
            env=env(), start_new_session=True)
        try:
            time.sleep(8)  # (training: the trigger is read every step)
            trigger.touch()
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
    text = out.read_text()
    assert rc != 0, text[-4000:]
    assert re.search(r"\[pollux\] hvd-fails: replica \S+ failed \(exit code 3\); the job "
                     "fails", text), text[-4000:]
    assert "[pollux] hvd-fails: failed, exit code" in text, text[-4000:]
    assert "Traceback" not in text.split("exit code 3")[-1], text[-4000:]


def test_live_shrink_says_one_line_and_hides_the_removed_worker(tmp_path, baseline):
    """A live shrink 2 -> 1 (horovodrun's discovery-script form): one
    ``[pollux] JOB: replicas 2 -> 1 (live)`` line; Horovod's abort of the removed worker
    (``terminate called``, ``Aborted``, exit 134) only in the job's log."""
    hosts, discover = tmp_path / "hosts", tmp_path / "discover.sh"
    hosts.write_text("localhost:2\n")
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    name = "hvd-shrink"
    job = Job(tmp_path, name, ["--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
                               "--host-discovery-script", str(discover),
                               "--network-interface", "lo"])
    try:
        wait_for(job.proc, lambda: any(r["event"] == "epoch" for r in records(job.events)),
                 "the first epoch", 180)
        hosts.write_text("localhost:1\n")
        wait_for(job.proc, lambda: [r["size"] for r in job.starts()][-1:] == [1],
                 "the shrink to 1", 120)
        wait_for(job.proc, lambda: len(workers(str(tmp_path))) == 1, "the removed worker's end")
        rc = job.finish()
    finally:
        job.close()
    text = job.text()
    assert rc == 0, text[-4000:]
    assert text.count(f"[pollux] {name}: replicas 2 -> 1 (live)") == 1, text
    for noise in REMOVED_NOISE:
        assert noise not in text, f"{noise!r} shown:\n{text[-4000:]}"
    assert "has been removed from elastic job" in job_log(name)  # kept where it belongs
    got = json.loads(job.result.read_text())
    assert got["world_sizes"] == [2, 1]
    assert len({r["pid"] for r in job.starts()}) == 1, "rank 0 keeps its process"
    assert_same_result(got, baseline)


def test_cancel_ends_without_a_horovod_traceback(tmp_path):
    """Ctrl-C / SIGTERM to ``pollux-run``: ``[pollux] JOB: cancelled`` and nothing of
    Horovod's failure report for the workers it ended (``RuntimeError ... Exit code:
    143``)."""
    name = "hvd-cancel"
    job = Job(tmp_path, name, ["-np", "2", "--min-np", "1", "--max-np", "2"])
    try:
        wait_for(job.proc, lambda: any(r["event"] == "epoch" for r in records(job.events)),
                 "the first epoch", 180)
        job.proc.send_signal(signal.SIGTERM)
        rc = job.proc.wait(timeout=60)
    finally:
        job.close()
    text = job.text()
    assert rc == 128 + signal.SIGTERM, text[-4000:]
    assert f"[pollux] {name}: cancelled" in text
    for noise in ("Traceback", "RuntimeError", "Exit code: 143", "status code 143",
                  "stop running"):
        assert noise not in text, f"{noise!r} shown:\n{text[-4000:]}"
    assert not workers(str(tmp_path))


# ---------------------------------------------------------------------- pure parts
def test_replica_names_split_retire_and_order():
    names = ReplicaNames()
    assert names.split({"127.0.0.1": 2}) == {"127.0.0.1": 1, "127.0.0.2": 1}
    assert names.split({"127.0.0.1": 2}) == {"127.0.0.1": 1, "127.0.0.2": 1}  # stable
    names.retire("127.0.0.1")  # Horovod blacklisted it: the slot comes back renamed
    assert names.split({"127.0.0.1": 2}) == {"127.0.0.2": 1, "127.0.0.3": 1}
    assert names.split({"127.0.0.1": 1}) == {"127.0.0.2": 1}  # a shrink drops the newest
    assert names.split({"localhost": 1, "node7": 4}) == {"127.0.0.4": 1, "node7": 4}
    names.retire("node7")  # not ours: Horovod's own blacklist decides
    assert names.split({"node7": 4}) == {"node7": 4}
    assert not names.issued("node7") and names.issued("127.0.0.4")


def test_replica_names_of_nodes_map_back_to_their_node():
    """Cluster mode: each slot of a node agent's node is a host of its own (``NODE@N``),
    mapped back to its node; a lost one comes back under a fresh name on the same node."""
    names = ReplicaNames(nodes=True)
    assert names.split({"n1": 2, "n2": 1}) == {"n1@1": 1, "n1@2": 1, "n2@3": 1}
    assert [names.node_of(n) for n in ("n1@1", "n1@2", "n2@3")] == ["n1", "n1", "n2"]
    names.retire("n1@1")
    assert names.split({"n1": 2, "n2": 1}) == {"n1@2": 1, "n1@4": 1, "n2@3": 1}
    assert names.node_of("n1@4") == "n1" and names.node_of("elsewhere") == "elsewhere"
    assert names.split({"n2": 1}) == {"n2@3": 1}  # a node dropped: its names with it
    assert names.order({"n1@2", "n1@4", "n2@3"}, ["n2@3"]) == ["n2@3", "n1@2", "n1@4"]


def test_replica_names_order_follows_naming():
    """Horovod's order of new hosts (lowest ranks first) is the order they were named in
    (127.0.0.10 after 127.0.0.9), after the hosts it had."""
    names = ReplicaNames()
    made = list(names.split({"127.0.0.1": 12}))
    assert names.order(set(made), []) == made
    assert names.order(set(made), [made[5]]) == [made[5], *made[:5], *made[6:]]


def test_terminal_filter_routes_log_only_lines(tmp_path):
    from pollux_launch.launcher.logs import LogSink

    terminal = io.StringIO()
    out = TerminalFilter(terminal, LogSink(tmp_path / "job.log"))
    out.write("[0]<stdout>:epoch 1\n")
    out.write(f"{LOG_ONLY}[1]<stderr>:Aborted\n")
    out.write(f"{LOG_ONLY}[1]<stderr>:a long ")  # a long line in pieces: all log-only
    out.write("line\n")
    out.write("[0]<stdout>:epoch 2\n")
    out.close()
    assert terminal.getvalue() == "[0]<stdout>:epoch 1\n[0]<stdout>:epoch 2\n"
    assert (tmp_path / "job.log").read_text() == (
        "[0]<stdout>:epoch 1\n[1]<stderr>:Aborted\n[1]<stderr>:a long line\n"
        "[0]<stdout>:epoch 2\n")

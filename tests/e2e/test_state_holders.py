"""A restarted node agent must not cost a live job its training progress (issue 27).

Two nodes of one slot, a live job "train" on both with rank 0 (worker A) on n1. n2's
agent gets SIGTERM (its worker B drains; A re-forms alone) and is restarted as systemd
would: it starts a fresh replica B2 for the job's slot on n2. Before B2 has formed a
round with A, a second job arrives and takes one of the two slots, so the coordinator
shrinks "train" to one replica. Only A holds the job's state: the coordinator must keep
it (and move the newcomer onto n2), not keep the empty B2 on n2 and remove A - which
would start training again from scratch ("every worker had died; training starts
again").

Deterministic, not a race: the job's command is a small gate in front of the worker, so
the replica started by the restarted agent waits - as a slow start-up (importing torch on
a busy node) would - until the test saw the coordinator's decision. The second job is
named "blocker", before "train": pollux-dp packs the newcomer first onto the first node
of the tie (n1), so without the holder rule the shrink keeps n2 every time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from cluster import POLLUX_RUN, WORKER, Cluster

from pollux_launch import keys
from pollux_launch.messages import NodeInfo, decode

EPOCHS = 10
SLOTS = {"n1": 1, "n2": 1}
# waits while GATE exists and RELEASE does not, then runs the worker logging into LOGS
GATE = """import os, sys, time
gate, release, logs = sys.argv[1:4]
while os.path.exists(gate) and not os.path.exists(release):
    time.sleep(0.05)
os.makedirs(logs, exist_ok=True)
os.environ["LOG_DIR"] = logs
os.execv(sys.executable, [sys.executable, *sys.argv[4:]])
"""


@pytest.fixture
def cluster(etcd_private, tmp_path):
    c = Cluster(etcd_private.url, tmp_path)
    yield c
    c.close()


def _job(cluster: Cluster, job: str, gate: str, logs: str, epochs: int,
         *flags: str) -> subprocess.Popen:
    """A job of ``digits_worker.py`` behind the gate (``gate``: the file that closes it),
    its workers' step records in ``logs``. The gate reads no pollux API: a live job's
    kind is named."""
    script = cluster.tmp / "gate.py"
    script.write_text(GATE)
    return cluster.start(job, "--store", cluster.url, "--job-name", job, *flags,
                         sys.executable, str(script), str(cluster.tmp / gate),
                         str(cluster.tmp / "open"), str(cluster.tmp / logs), WORKER,
                         "--stop-file", str(cluster.tmp / f"{job}.stop"), "--target", "0.0",
                         "--step-delay", "0.1", "--epochs", str(epochs))


def _status_row(cluster: Cluster, job: str) -> list[str]:
    out = subprocess.run([POLLUX_RUN, "status", "--store", cluster.url], capture_output=True,
                         text=True, timeout=60)
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] == [job]]
    assert len(rows) == 1, out.stdout + out.stderr
    return rows[0]


def test_a_restarted_agent_never_costs_the_job_its_progress(cluster):
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.wait(lambda: cluster.store.get(keys.node("n1")), 60, "n1 registered")
    # train's steps in logs/ (cluster.steps()), the blocker's apart; only train is gated
    proc = _job(cluster, "train", "closed", "logs", EPOCHS, "-np", "2", "--min-np", "1",
                "--max-np", "2", "--elasticity", "live")  # A starts alone on n1: rank 0
    cluster.wait(lambda: any(s["world"] == 1 for s in cluster.steps()), 120, "A training")
    cluster.agent("n2", 1)
    cluster.wait(lambda: sum(s["world"] == 2 for s in cluster.steps()) >= 20, 120,
                 "the job training on both nodes", SLOTS)
    first = [s for s in cluster.steps() if s["world"] == 2]
    assert {s["node"] for s in first if s["rank"] == 0} == {"n1"}
    a_pid = next(s["pid"] for s in first if s["rank"] == 0)
    # progress worth losing: rank 0 past its second epoch
    cluster.wait(lambda: any(s["rank"] == 0 and s["epoch"] >= 2 for s in cluster.steps()),
                 120, "two epochs trained", SLOTS)

    cluster.procs["agent-n2"].send_signal(signal.SIGTERM)  # drains B
    assert cluster.procs["agent-n2"].wait(timeout=60) == 0
    t_term = time.time()
    cluster.wait(lambda: any(s["world"] == 1 and s["t"] > t_term for s in cluster.steps()),
                 60, "A training alone", SLOTS)
    (cluster.tmp / "closed").touch()  # the next replica to start waits at the gate
    cluster.agent("n2", 1)  # as systemd would restart it: it starts B2 for n2's slot

    def b2_started() -> bool:
        kv = cluster.store.get(keys.node("n2"))
        return kv is not None and decode(NodeInfo, kv.value).workers.get("train") == 1

    cluster.wait(b2_started, 60, "the restarted agent's fresh replica", SLOTS)
    registered = [kv.key for kv in cluster.store.get_prefix(keys.job("train", "rdzv/workers/"))]
    assert len(registered) == 1, registered  # A only: B2 holds nothing yet

    blocker = _job(cluster, "blocker", "never", "logs/blocker", 2, "-np", "1")
    cluster.wait(lambda: cluster.allocation("blocker"), 60, "the shrink", SLOTS)
    shrunk = (cluster.allocation("train"), cluster.allocation("blocker"))
    (cluster.tmp / "open").touch()  # B2 goes on (if it is still wanted)
    t_shrink = time.time()
    cluster.wait(lambda: any(s["rank"] == 0 and s["t"] > t_shrink + 2 for s in cluster.steps()),
                 120, "training after the shrink", SLOTS)
    running = _status_row(cluster, "train")

    assert blocker.wait(timeout=240) == 0, cluster.log("blocker")[-3000:]
    assert proc.wait(timeout=300) == 0, cluster.log("train")[-3000:]
    assert "train: succeeded, exit code 0" in cluster.log("train")
    status = cluster.status("train")
    assert status is not None and status.state == "succeeded" and status.exit_code == 0
    logs = cluster.log("train") + cluster.log("agent-n1") + cluster.log("agent-n2")
    assert "training starts again" not in logs
    assert cluster.store.get(keys.job("train", "restarts")) is None
    assert cluster.epochs_lost() == 0
    # A was rank 0 throughout, and ended the job once, having trained every epoch
    assert {s["pid"] for s in cluster.steps() if s["rank"] == 0} == {a_pid}
    finals = [line for line in cluster.log("train").splitlines() if "final val_acc" in line]
    assert len(finals) == 1 and float(finals[0].rsplit(" ", 1)[1]) >= EPOCHS, finals
    for name in ("coordinator", "agent-n1", "agent-n2"):
        assert cluster.procs[name].poll() is None, f"{name} died:\n{cluster.log(name)[-2000:]}"
    cluster.wait(lambda: not cluster.workers_left(), 30, "no worker left behind")
    # the shrink kept A's node and moved the newcomer to n2; status said so, and that
    # nothing was lost
    assert shrunk == (("n1",), ("n2",)), shrunk
    assert running[1:4] == ["running", "live", "n1:1"] and running[-2] == "0", running
    row = _status_row(cluster, "train")
    assert row[1:3] == ["succeeded", "live"] and row[-2] == "0", row

"""Faults injected for real into a two-node cluster on a real etcd: the store stalls
(SIGSTOP) or restarts, the leader key is overwritten. Each test asserts that the services
lived through it, that the job trained all its epochs without starting over, that its
status and exit code told the truth, and that no process was left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from cluster import POLLUX_RUN, WORKER, Cluster

from pollux_launch import keys
from pollux_launch.messages import Allocation, JobHints, JobRestarts, NodeInfo, decode

EPOCHS = 12


@pytest.fixture
def cluster(etcd_private, tmp_path):
    c = Cluster(etcd_private.url, tmp_path)
    c.etcd = etcd_private
    yield c
    c.close()


def _start(cluster: Cluster, job: str) -> subprocess.Popen:
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.agent("n2", 1)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")
    proc = cluster.submit(job, "-np", "2", "--min-np", "2", "--max-np", "2", target=0.0,
                          epochs=EPOCHS)
    cluster.wait(lambda: sum(s["world"] == 2 for s in cluster.steps()) >= 20, 120,
                 "the job training on both nodes")
    return proc


def _assert_finished_whole(cluster: Cluster, job: str, proc: subprocess.Popen) -> None:
    assert proc.wait(timeout=240) == 0, cluster.log(job)[-3000:]
    assert f"{job}: succeeded, exit code 0" in cluster.log(job)
    status = cluster.status(job)
    assert status is not None and status.state == "succeeded" and status.exit_code == 0
    agents = cluster.log("agent-n1") + cluster.log("agent-n2")
    finals = [line for line in agents.splitlines() if "final val_acc" in line]
    assert len(finals) == 1, finals  # rank 0 ended the job once, having trained every epoch
    assert float(finals[0].rsplit(" ", 1)[1]) >= EPOCHS
    assert cluster.epochs_lost() == 0
    for name in ("coordinator", "agent-n1", "agent-n2"):
        assert cluster.procs[name].poll() is None, f"{name} died:\n{cluster.log(name)[-2000:]}"
    cluster.wait(lambda: not cluster.workers_left(), 30, "no worker left behind")
    out = subprocess.run([POLLUX_RUN, "status", "--store", cluster.url], capture_output=True,
                         text=True, timeout=60)
    assert job in out.stdout and "succeeded" in out.stdout, out.stdout


@pytest.mark.parametrize("stall", [20, 40])
def test_etcd_stall_is_ridden_out(cluster, stall):
    """SIGSTOP etcd longer than every lease: leases lapse on SIGCONT, but no node is
    presumed dead for it, no worker leaves, and the job is not reported done early."""
    job = f"stall{stall}"
    proc = _start(cluster, job)
    cluster.etcd.pause()
    time.sleep(stall)
    cluster.etcd.resume()
    t_back = time.time()
    cluster.wait(lambda: any(s["t"] > t_back + 2 for s in cluster.steps()), 60,
                 "training after the stall")
    assert proc.poll() is None, cluster.log(job)[-3000:]  # not "succeeded" half-way
    _assert_finished_whole(cluster, job, proc)
    pids = {s["pid"] for s in cluster.steps()}
    assert len(pids) == 2, "workers were replaced: training restarted"


def test_etcd_kill_and_restart(cluster):
    """etcd SIGKILLed and restarted on its data dir: the launcher keeps following."""
    job = "restart"
    proc = _start(cluster, job)
    cluster.etcd.kill()
    time.sleep(8)
    cluster.etcd.start()
    _assert_finished_whole(cluster, job, proc)
    assert "store unreachable" in cluster.log(job)


def test_leader_key_overwritten_without_a_lease(cluster):
    """A leader value no lease keeps alive is taken over; scheduling goes on."""
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.agent("n2", 1)
    cluster.wait(lambda: cluster.store.get(keys.LEADER), 30, "a leader")
    cluster.store.put(keys.LEADER, json.dumps("somebody-else"))  # no lease
    time.sleep(3)
    proc = cluster.submit("after", "-np", "2", "--min-np", "1", "--max-np", "2", target=0.0,
                          epochs=2)
    cluster.wait(lambda: len(cluster.allocation("after")) == 2, 60, "the job allocated")
    assert proc.wait(timeout=180) == 0, cluster.log("after")[-3000:]
    assert "taking over" in cluster.log("coordinator")
    assert json.loads(cluster.store.get(keys.LEADER).value) != "somebody-else"


def test_only_node_agent_killed_and_restarted(cluster):
    """Every worker of the job dies with the only node's agent. The restarted agent starts
    the job again (it no longer waits forever for a slot its dead worker held); without a
    durable checkpoint its progress is lost, and status says how much."""
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.wait(lambda: cluster.store.get(keys.NODES + "n1"), 60, "n1 registered")
    proc = cluster.submit("lonely", "-np", "1", target=0.0, epochs=4)
    cluster.wait(lambda: any(s["epoch"] >= 1 for s in cluster.steps()), 120, "an epoch trained")
    cluster.procs["agent-n1"].kill()
    cluster.procs["agent-n1"].wait()
    cluster.agent("n1", 1)  # as systemd would restart it
    assert proc.wait(timeout=240) == 0, cluster.log("lonely")[-3000:]
    assert "lonely: succeeded, exit code 0" in cluster.log("lonely")
    assert cluster.epochs_lost() >= 1 and len({s["pid"] for s in cluster.steps()}) == 2
    restarts = decode(JobRestarts, cluster.store.get(keys.job("lonely", "restarts")).value)
    assert restarts.count == 1 and restarts.lost_progress > 0
    out = subprocess.run([POLLUX_RUN, "status", "--store", cluster.url], capture_output=True,
                         text=True, timeout=60)
    assert "RESTARTS" in out.stdout and f"1 ({restarts.lost_progress:.0f} it)" in out.stdout


def test_coordinator_killed_as_it_grows_a_job(cluster):
    """The coordinator dies right after writing a change of allocation: the change is
    carried out, the restarted coordinator (a new leadership term) moves nothing, and
    the node records report exactly the workers that run."""
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.wait(lambda: cluster.store.get(keys.NODES + "n1"), 60, "n1 registered")
    proc = cluster.submit("grow", "-np", "1", "--min-np", "1", "--max-np", "2", target=0.0,
                          epochs=EPOCHS)
    cluster.wait(lambda: len(cluster.steps()) >= 10, 120, "the job training")
    cluster.agent("n2", 1)
    cluster.wait(lambda: len(cluster.allocation("grow")) == 2, 120, "the grow allocation")
    cluster.procs["coordinator"].kill()
    cluster.procs["coordinator"].wait()
    grown = decode(Allocation, cluster.store.get(keys.job("grow", "allocation")).value)
    cluster.coordinator()
    cluster.wait(lambda: sum(s["world"] == 2 for s in cluster.steps()) >= 20, 120,
                 "the job training on both nodes")

    def reported() -> dict[str, dict[str, int]]:
        return {kv.key: decode(NodeInfo, kv.value).workers
                for kv in cluster.store.get_prefix(keys.NODES)}

    cluster.wait(lambda: reported() == {keys.node("n1"): {"grow": 1},
                                        keys.node("n2"): {"grow": 1}}, 30, "the agents' view")
    assert decode(Allocation, cluster.store.get(keys.job("grow", "allocation")).value) == grown
    _assert_finished_whole(cluster, "grow", proc)
    cluster.wait(lambda: cluster.allocation("grow") == (), 30, "the slots given back")
    final = decode(Allocation, cluster.store.get(keys.job("grow", "allocation")).value)
    assert final.term > grown.term  # written by the new leader


def _checkpointing_job(cluster: Cluster, job: str, interval: float,
                       epochs: int) -> subprocess.Popen:
    """A coordinator, one node with one slot, and a one-replica job checkpointing into
    ``cluster.tmp / "checkpoints"`` every ``interval`` seconds."""
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.wait(lambda: cluster.store.get(keys.NODES + "n1"), 60, "n1 registered")
    return cluster.submit(job, "-np", "1", "--checkpoint-dir", str(cluster.tmp / "checkpoints"),
                          "--checkpoint-interval", str(interval), target=0.0, epochs=epochs)


def test_only_node_lost_resumes_from_the_last_checkpoint(cluster):
    """The same loss with ``--checkpoint-dir``: the job resumes from its newest durable
    checkpoint (at most one interval lost), and status counts only that as lost."""
    proc = _checkpointing_job(cluster, "durable", interval=2, epochs=4)
    cluster.wait(lambda: any(s["epoch"] >= 2 for s in cluster.steps()), 120, "two epochs")
    before = decode(JobHints, cluster.store.get(keys.job("durable", "hints")).value).progress
    cluster.procs["agent-n1"].kill()
    cluster.procs["agent-n1"].wait()
    cluster.agent("n1", 1)
    assert proc.wait(timeout=240) == 0, cluster.log("durable")[-3000:]
    pids = [s["pid"] for s in sorted(cluster.steps(), key=lambda s: s["t"])]
    assert len(set(pids)) == 2
    resumed = min((s for s in cluster.steps() if s["pid"] == pids[-1]), key=lambda s: s["t"])
    assert resumed["step"] > 1 and resumed["epoch"] >= 1  # not from scratch
    # 2 s of 0.1 s steps between checkpoints, the last one written in the background
    assert 0 <= cluster.steps_lost() <= 40 and cluster.epochs_lost() <= 1
    restarts = decode(JobRestarts, cluster.store.get(keys.job("durable", "restarts")).value)
    assert restarts.count == 1 and restarts.resumed == 1
    assert restarts.lost_progress < before / 2, (restarts, before)


def test_sigterm_writes_a_final_checkpoint_that_the_job_resumes_from(cluster):
    """SIGTERM to the only worker (a drained node, a batch system's preemption): rank 0
    writes a final checkpoint at its step boundary and ends by the signal; the job's
    replacement worker resumes from exactly there."""
    proc = _checkpointing_job(cluster, "term", interval=600, epochs=3)
    folder = cluster.tmp / "checkpoints"
    cluster.wait(lambda: any(s["epoch"] >= 1 for s in cluster.steps()), 120, "an epoch trained")
    assert not (folder / "latest").exists()  # no periodic checkpoint yet
    victim = cluster.steps()[-1]["pid"]
    os.kill(victim, signal.SIGTERM)
    cluster.wait(lambda: not psutil.pid_exists(victim) or
                 psutil.Process(victim).status() == psutil.STATUS_ZOMBIE, 30, "the worker to end")
    assert (folder / "latest").exists()
    assert proc.wait(timeout=240) == 0, cluster.log("term")[-3000:]
    assert len({s["pid"] for s in cluster.steps()}) == 2
    assert cluster.steps_lost() == 0 and cluster.epochs_lost() == 0


def test_worker_sigkill_is_replaced_and_the_job_goes_on(cluster):
    """A worker SIGKILLed: the survivor re-forms, its node agent starts a replacement that
    joins with the survivor's state, and the job trains on to the end."""
    proc = _start(cluster, "killed")
    victim = max((s for s in cluster.steps() if s["node"] == "n2"), key=lambda s: s["t"])
    os.kill(victim["pid"], signal.SIGKILL)
    t_kill = time.time()
    cluster.wait(lambda: any(s["world"] == 2 and s["t"] > t_kill + 5 and s["pid"] != victim["pid"]
                             and s["node"] == "n2" for s in cluster.steps()), 120,
                 "the replacement training with the survivor")
    _assert_finished_whole(cluster, "killed", proc)
    assert len({s["pid"] for s in cluster.steps()}) == 3  # two first workers, one replacement


def test_etcd_stall_while_a_newcomer_starts(cluster):
    """etcd stalls for 20 s just as a grow's newcomer starts (it cannot even open the
    store): the newcomer waits for the store instead of failing, joins once it is back,
    and the job - whose survivor trained on - loses nothing."""
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.wait(lambda: cluster.store.get(keys.NODES + "n1"), 60, "n1 registered")
    proc = cluster.submit("newcomer", "-np", "1", "--min-np", "1", "--max-np", "2",
                          target=0.0, epochs=EPOCHS)
    cluster.wait(lambda: len(cluster.steps()) >= 10, 120, "the job training")
    cluster.agent("n2", 1)
    cluster.wait(lambda: len(cluster.allocation("newcomer")) == 2, 120, "the grow")

    def workers() -> int:  # (not the launcher, whose command line names the script too)
        return sum(p.cmdline()[1:2] == [WORKER] for p in cluster.workers_left())

    cluster.wait(lambda: workers() == 2, 60, "the newcomer's process")
    cluster.etcd.pause()
    time.sleep(20)
    cluster.etcd.resume()
    cluster.wait(lambda: sum(s["world"] == 2 for s in cluster.steps()) >= 10, 120,
                 "the newcomer training with the survivor")
    _assert_finished_whole(cluster, "newcomer", proc)
    assert len({s["pid"] for s in cluster.steps()}) == 2  # nobody replaced, nothing restarted


def test_etcd_wiped_the_job_goes_on(cluster):
    """etcd's data is wiped and an empty etcd takes its place: the launcher submits its
    job again (it holds the signed spec), the agents register again and keep their
    workers, the coordinator adopts the job where it runs, and the workers put their
    round back: training goes on within seconds, from where it was, and says so."""
    proc = _start(cluster, "wiped")
    cluster.etcd.wipe()
    t_back = time.time()
    cluster.wait(lambda: sum(s["world"] == 2 and s["t"] > t_back + 1 for s in cluster.steps())
                 >= 10, 60, "training on both nodes again")
    resumed = min(s["t"] for s in cluster.steps() if s["t"] > t_back)
    assert resumed - t_back < 20, resumed - t_back  # seconds, not a 300 s time-out
    assert "submitted it again" in cluster.log("wiped")
    _assert_finished_whole(cluster, "wiped", proc)
    # the round put back, a repair, the adopting allocation's round - not a re-form at every
    # step while the new store's allocation version is below the one the workers knew
    assert max(s["round"] for s in cluster.steps()) <= 5, sorted({s["round"] for s in
                                                                   cluster.steps()})
    assert len({s["pid"] for s in cluster.steps()}) == 2  # the same processes throughout
    assert "the store lost its state" in cluster.log("agent-n1")

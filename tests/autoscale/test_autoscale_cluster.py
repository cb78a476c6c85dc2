"""The coordinator's autoscaler on a real local cluster: node agents as machines, started
and stopped by the ``command`` provisioner (the ``slurm`` one meets a real Slurm in
tests/e2e/test_slurm.py).

A job runs on the one node there is; the cluster grows to two through the provisioner
while it runs (it is never stopped), and back to one when it ends; ``pollux-run status``
tells the target and why; a failing provisioner is logged once and retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from waiting import end_processes, wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.messages import AutoscaleStatus, JobStatus, NodeInfo, decode
from pollux_launch.rendezvous.store import open_store

HERE = Path(__file__).parent
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))




def nodes(store) -> list[str]:
    """Nodes with slots (a launcher's own record, for its job's driver, has none)."""
    found = [decode(NodeInfo, kv.value) for kv in store.get_prefix(keys.NODES)]
    return sorted(n.name for n in found if n.slots > 0)


@contextlib.contextmanager
def steady_job(url: str, prefix: str, env: dict, tmp: Path):
    """``pollux-run`` of a 1-GPU job named steady that runs until :func:`end_steady`
    (killed if the test fails first)."""
    (tmp / "job.py").write_text(
        "import os, time\n"
        "while not os.path.exists('stop'):\n"
        "    time.sleep(0.2)\n"
        "print('job done', flush=True)\n")
    job = subprocess.Popen([POLLUX_RUN, "--store", url, "--store-prefix", prefix,
                            "--job-name", "steady", "-np", "1", sys.executable, "job.py"],
                           env=env, cwd=tmp,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield job
    finally:
        if job.poll() is None:
            job.kill()


def end_steady(job: subprocess.Popen, tmp: Path) -> None:
    """Let the steady job finish; it must succeed."""
    (tmp / "stop").touch()
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0 and "steady: succeeded" in out, out


def shown_status(url: str, prefix: str, env: dict) -> str:
    return subprocess.run([POLLUX_RUN, "status", "--store", url, "--store-prefix", prefix],
                          env=env, capture_output=True, text=True, timeout=60).stdout


@pytest.fixture
def cluster(tmp_path, etcd_server):
    """A store (the session's real etcd, under a prefix of this test's own), a
    fake-machine folder with the provisioners on PATH, and a way to start services;
    everything started is stopped afterwards."""
    url, prefix = etcd_server.url, f"/autoscale-{uuid.uuid4().hex[:12]}"
    fake = tmp_path / "fake"
    fake.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    target = bin_dir / "fake_nodes.py"
    target.write_text(f"#!{sys.executable}\n" + (HERE / "fake_nodes.py").read_text())
    target.chmod(0o755)
    env = {**os.environ, "FAKE_NODES_DIR": str(fake), "FAKE_NODES_STORE": url,
           "FAKE_NODES_PREFIX": prefix, "POLLUX_STORE_PREFIX": prefix,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []

    def start(*argv: str, log: str) -> subprocess.Popen:
        out = open(tmp_path / log, "w")
        proc = subprocess.Popen([POLLUX_RUN, *argv, "--store", url, "--store-prefix", prefix],
                                env=env, stdout=out, stderr=out, cwd=tmp_path)
        procs.append(proc)
        return proc

    yield url, prefix, fake, env, start, tmp_path
    end_processes(procs)
    for pid_file in fake.glob("*.pid"):  # machines the test left running
        try:
            os.kill(int(pid_file.read_text()), 15)
        except ProcessLookupError:
            pass


def test_the_cluster_grows_while_a_job_runs_and_shrinks_when_it_ends(cluster):
    url, prefix, fake, env, start, tmp = cluster
    start("agent", "--node-name", "base", "--slots", "1",
          "--state-dir", str(tmp / "state-base"), log="base.log")
    start("coordinator", "--interval", "1", "--autoscale", "1:2", "--scale-interval", "1",
          "--min-node-lifetime", "0", "--provisioner-command", "fake_nodes.py",
          log="coordinator.log")
    with open_store(url, prefix) as store:
        wait_for(lambda: nodes(store) == ["base"], 60, "the first node")
        with steady_job(url, prefix, env, tmp) as job:
            two = wait_for(lambda: len(nodes(store)) == 2 and nodes(store), 90,
                           "a second node from the provisioner")
            grown = wait_for(lambda: (a := decode(AutoscaleStatus, store.get(
                keys.AUTOSCALE).value)).nodes == 2 and a, 30, "the autoscaler to see both")
            # one 1-GPU job on one node: utility 1 > 2/3, so grow; on two nodes 1/2 >= 1/2
            # (the decision, or a later one that stays in the band)
            assert grown.target == 2 and grown.utility in (1.0, 0.5), grown
            status = decode(JobStatus, store.get(keys.job("steady", "status")).value)
            assert status.state == "running"  # the job ran on through the growth
            shown = shown_status(url, prefix, env)
            assert "autoscale: 2 nodes, target 2" in shown and "goodput rule" in shown
            end_steady(job, tmp)
        wait_for(lambda: len(nodes(store)) == 1, 90, "the cluster back to one node")
        left = nodes(store)
        assert left[0] in two
        shrunk = decode(AutoscaleStatus, store.get(keys.AUTOSCALE).value)
        assert shrunk.target == 1 and "no work" in shrunk.reason
    calls = [json.loads(line) for line in (fake / "calls.jsonl").read_text().splitlines()]
    assert calls[0] == ["fake_nodes.py", "up", "1"]
    assert calls[-1][:2] == ["fake_nodes.py", "down"]


def test_a_failing_provisioner_is_logged_once_and_scheduling_goes_on(cluster):
    url, prefix, _fake, env, start, tmp = cluster
    start("agent", "--node-name", "base", "--slots", "1",
          "--state-dir", str(tmp / "state-base"), log="base.log")
    start("coordinator", "--interval", "1", "--autoscale", "1:3",
          "--scale-interval", "1", "--provisioner-command", "false",
          log="coordinator.log")
    (tmp / "job.py").write_text("import time\ntime.sleep(20)\n")
    out = subprocess.run([POLLUX_RUN, "--store", url, "--store-prefix", prefix, "--job-name",
                          "goes-on", "-np", "1", sys.executable, "job.py"], env=env, cwd=tmp,
                         capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "goes-on: succeeded" in out.stdout  # scheduled anyway
    log = (tmp / "coordinator.log").read_text()
    assert log.count("provisioner up") == 1, log[-3000:]  # said once, retried quietly
    assert "exit status 1" in log


def test_a_killed_coordinator_s_successor_neither_asks_again_nor_forgets(cluster):
    """The coordinator asks for a node and is killed (SIGKILL) while the node boots (20 s
    here, longer than its successor's start); the successor goes on from the decision in
    the store: it does not ask for a second node, the booted one joins, the job runs on
    and succeeds, status tells 2 nodes, and the cluster shrinks back when the job ends."""
    url, prefix, fake, env, start, tmp = cluster
    env["FAKE_NODES_BOOT_S"] = "20"
    start("agent", "--node-name", "base", "--slots", "1",
          "--state-dir", str(tmp / "state-base"), log="base.log")
    args = ("coordinator", "--interval", "1", "--lease-ttl", "3", "--autoscale", "1:2",
            "--scale-interval", "1", "--min-node-lifetime", "0",
            "--provisioner-command", "fake_nodes.py")
    first = start(*args, log="coordinator-1.log")
    calls = fake / "calls.jsonl"

    def ups() -> int:
        lines = calls.read_text().splitlines() if calls.exists() else []
        return sum(json.loads(line)[1] == "up" for line in lines)

    with open_store(url, prefix) as store:
        wait_for(lambda: nodes(store) == ["base"], 60, "the first node")
        with steady_job(url, prefix, env, tmp) as job:
            wait_for(lambda: ups() == 1, 90, "the provisioner asked for a node")
            wait_for(lambda: (kv := store.get(keys.AUTOSCALE)) is not None and decode(
                AutoscaleStatus, kv.value).booting == 1, 30, "the decision in the store")
            first.kill()  # SIGKILL: no goodbye, its lease lapses
            first.wait(timeout=30)
            killed = time.time()
            start(*args, log="coordinator-2.log")
            wait_for(lambda: len(nodes(store)) == 2, 90, "the booted node to join")
            status = wait_for(lambda: (a := decode(AutoscaleStatus, store.get(
                keys.AUTOSCALE).value)).timestamp > killed and a.nodes == 2 and a, 60,
                "the successor's decision")
            assert status.target == 2 and status.booting == 0, status
            assert ups() == 1, calls.read_text()  # it did not ask again
            state = decode(JobStatus, store.get(keys.job("steady", "status")).value)
            assert state.state == "running"
            shown = shown_status(url, prefix, env)
            assert "autoscale: 2 nodes, target 2 (0 booting)" in shown, shown
            end_steady(job, tmp)
        wait_for(lambda: len(nodes(store)) == 1, 90, "the cluster back to one node")
    assert ups() == 1
    assert "resum" in (tmp / "coordinator-2.log").read_text()

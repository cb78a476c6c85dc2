"""Jobs across real hosts: node agents in separate network namespaces (distinct addresses
on a bridge; one etcd and the coordinator in the root namespace), sharing the machine's
host name, which resolves to a loopback address on every host - as on many real clusters.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from cluster import Cluster, read_jsonl
from hosts import HostNet, netns_available

from pollux_launch import keys
from pollux_launch.messages import NodeInfo, decode

EXAMPLE = Path(__file__).parents[2] / "examples" / "horovod_elastic.py"
DS_WORKER = Path(__file__).parents[1] / "deepspeed" / "pollux_worker.py"

pytestmark = pytest.mark.skipif(not netns_available(), reason="needs root and network namespaces")


@pytest.fixture
def net():
    with HostNet() as net:
        yield net


@pytest.fixture
def cluster(net, etcd_factory, tmp_path):
    etcd = etcd_factory(host=net.gateway)
    c = Cluster(etcd.url, tmp_path)
    c.etcd = etcd
    yield c
    c.close()


def test_torch_job_spans_hosts_grows_onto_a_joining_host_and_survives_losing_it(net, cluster):
    h1, h2 = net.add_host("h1"), net.add_host("h2")
    cluster.coordinator("--node-grace", "10")
    cluster.agent("n1", 1, host=h1)
    kv = cluster.wait(lambda: cluster.store.get(keys.node("n1")), 60, "n1 registered")
    assert decode(NodeInfo, kv.value).address == h1.address  # found from its route, not DNS

    job = cluster.submit("span", "-np", "2", "--min-np", "1", "--max-np", "2", target=0.0)
    cluster.wait(lambda: sum(s["world"] == 1 for s in cluster.steps()) >= 10, 120,
                 "the job training on n1 alone")
    first = next(s for s in cluster.steps() if s["rank"] == 0)

    cluster.agent("n2", 1, host=h2)  # a host joins: the job grows onto it, live
    cluster.wait(lambda: {s["node"] for s in cluster.steps() if s["world"] == 2} == {"n1", "n2"}
                 and sum(s["world"] == 2 for s in cluster.steps()) >= 30, 180,
                 "the job training across both hosts")

    cluster.procs["agent-n2"].kill()  # the host is lost: its worker dies with its agent
    t_kill = time.time()
    cluster.wait(lambda: sum(s["world"] == 1 and s["t"] > t_kill for s in cluster.steps()) >= 5,
                 55, "the survivor training alone (before any collective timeout)")
    cluster.wait(lambda: cluster.allocation("span") == ("n1",), 60, "span re-allocated to n1")

    cluster.stop_job("span")
    assert job.wait(timeout=120) == 0, cluster.log("span")[-3000:]
    assert "span: succeeded, exit code 0" in cluster.log("span")
    mine = [s for s in cluster.steps() if s["worker"] == first["worker"]]
    assert len({s["pid"] for s in mine}) == 1  # rank 0 kept its process throughout
    worlds = [s["world"] for s in sorted(mine, key=lambda s: s["t"])]
    assert [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w] == [1, 2, 1]
    assert cluster.epochs_lost() == 0
    cluster.wait(lambda: not cluster.workers_left(), 30, "no worker left behind")


def test_etcd_stall_across_hosts_is_ridden_out(net, cluster):
    """The store stalls (SIGSTOP) for longer than every lease while a job trains across
    two hosts: nobody is presumed dead, no worker leaves, the job ends whole."""
    hosts = {"n1": net.add_host("h1"), "n2": net.add_host("h2")}
    cluster.coordinator()
    for node, host in hosts.items():
        cluster.agent(node, 1, host=host)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")
    job = cluster.submit("stalled", "-np", "2", "--min-np", "1", "--max-np", "2", target=0.0,
                         epochs=10)
    cluster.wait(lambda: sum(s["world"] == 2 for s in cluster.steps()) >= 20, 120,
                 "the job training across both hosts")
    before = {s["pid"] for s in cluster.steps() if s["world"] == 2}
    t_stall = time.time()  # (the job may have started on one node and grown before this)
    cluster.etcd.pause()
    time.sleep(20)
    cluster.etcd.resume()
    assert job.wait(timeout=240) == 0, cluster.log("stalled")[-3000:]
    assert "stalled: succeeded, exit code 0" in cluster.log("stalled")
    after = [s for s in cluster.steps() if s["t"] > t_stall]
    assert {s["pid"] for s in after} == before  # no worker was replaced
    assert {s["world"] for s in after} == {2}  # nor removed
    assert cluster.epochs_lost() == 0
    for name in ("coordinator", "agent-n1", "agent-n2"):
        assert cluster.procs[name].poll() is None, cluster.log(name)[-2000:]


def _hvd_steps(log_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(log_dir, "worker-*.jsonl") if r["event"] == "step"]


def test_horovod_job_spans_hosts_without_ssh(net, cluster, tmp_path):
    """Horovod workers on every host are started by that host's node agent (no ssh): the
    job grows onto a host that joins and goes on when that host's agent is killed."""
    pytest.importorskip("horovod.torch", reason="Horovod is not installed")
    h1, h2 = net.add_host("h1"), net.add_host("h2")
    for host in (h1, h2):  # Horovod 0.28.1 binds the host name's address (see tasks.py)
        host.resolve_hostname_here()
    cluster.coordinator("--node-grace", "10")
    cluster.agent("n1", 1, host=h1)
    cluster.wait(lambda: cluster.store.get(keys.node("n1")), 60, "n1 registered")
    logs, stop = tmp_path / "hvd", tmp_path / "hvd.stop"
    job = cluster.start("hvd", "--store", cluster.url, "--job-name", "hvd", "--framework",
                        "horovod", "-np", "2", "--min-np", "1", "--max-np", "2",
                        sys.executable, str(EXAMPLE), "--epochs", "1000", "--step-sleep",
                        "0.05", "--log-dir", str(logs), "--stop-file", str(stop))
    cluster.wait(lambda: sum(s["size"] == 1 for s in _hvd_steps(logs)) >= 10, 180,
                 "Horovod training on n1")
    assert {s["pid"] for s in _hvd_steps(logs)} <= set(h1.pids())

    cluster.agent("n2", 1, host=h2)
    cluster.wait(lambda: sum(s["size"] == 2 for s in _hvd_steps(logs)) >= 20, 180,
                 "Horovod training across both hosts")
    pids = {s["pid"] for s in _hvd_steps(logs) if s["size"] == 2}
    assert pids & set(h1.pids()) and pids & set(h2.pids())  # one worker on each host

    # rank 0's worker is killed: the job goes on at n2 and n1's slot gets a new worker
    # (before, Horovod blacklisted n1 for good: the job stayed at one replica)
    [first] = pids & set(h1.pids())
    os.kill(first, signal.SIGKILL)
    t_kill = time.time()
    cluster.wait(lambda: sum(s["size"] == 2 and s["t"] > t_kill and s["pid"] in h1.pids()
                             for s in _hvd_steps(logs)) >= 10, 120,
                 "Horovod training across both hosts again, a new worker on n1")
    assert re.search(r"\[pollux\] hvd: replica n1@\d+ lost \(exit code 137\); the job "
                     "goes on", cluster.log("hvd")), cluster.log("hvd")[-3000:]
    pids = {s["pid"] for s in _hvd_steps(logs) if s["size"] == 2}

    cluster.procs["agent-n2"].kill()  # its worker dies with it
    t_kill = time.time()
    cluster.wait(lambda: sum(s["size"] == 1 and s["t"] > t_kill for s in _hvd_steps(logs))
                 >= 10, 120, "Horovod training on n1 again")
    stop.touch()
    assert job.wait(timeout=120) == 0, cluster.log("hvd")[-3000:]
    assert "hvd: succeeded, exit code 0" in cluster.log("hvd")
    cluster.wait(lambda: not [p for p in h1.pids() + h2.pids() if p in pids], 30,
                 "no Horovod worker left behind")


def test_host_dropping_off_the_network_is_noticed_within_the_lease(net, cluster):
    """A host that vanishes sends nothing (no FIN, no RST): the survivor, blocked in a
    collective with it, learns from the store that every worker there lost its lease,
    cuts its connections to that host and re-forms - long before the 60 s collective
    timeout. When the host comes back, its worker finds itself replaced and leaves."""
    hosts = {"n1": net.add_host("h1"), "n2": net.add_host("h2")}
    cluster.coordinator("--node-grace", "10")
    for node, host in hosts.items():
        cluster.agent(node, 1, host=host)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")
    job = cluster.submit("cut", "-np", "2", "--min-np", "1", "--max-np", "2", target=0.0)
    cluster.wait(lambda: sum(s["world"] == 2 for s in cluster.steps()) >= 20, 120,
                 "the job training across both hosts")
    h2 = hosts["n2"]
    h2.run(["ip", "link", "set", h2.ifname, "down"], check=True)  # gone without a word
    t_cut = time.time()
    cluster.wait(lambda: any(s["world"] == 1 and s["node"] == "n1" and s["t"] > t_cut
                             for s in cluster.steps()), 40, "n1 training alone")
    assert "lost its lease; cutting" in cluster.log("agent-n1")
    cluster.wait(lambda: cluster.allocation("cut") == ("n1",), 60, "cut re-allocated to n1")
    h2.run(["ip", "link", "set", h2.ifname, "up"], check=True)
    cluster.stop_job("cut")
    assert job.wait(timeout=180) == 0, cluster.log("cut")[-3000:]
    assert "cut: succeeded, exit code 0" in cluster.log("cut")
    cluster.wait(lambda: not cluster.workers_left(), 60, "no worker left behind")


def test_deepspeed_job_spans_hosts_grows_and_survives_losing_one(net, cluster, tmp_path):
    """The same for a DeepSpeed job (ZeRO-0: a lost peer's ZeRO-1/2 partition is lost with it,
    see adapters/deepspeed/README.md): grows live onto a host that joins, with
    identical parameters on every rank after the rebuild, and goes on when it is lost."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    logs = tmp_path / "ds"
    logs.mkdir()
    cluster.env.update(LOG_DIR=str(logs), ZERO_STAGE="0", STEP_SLEEP="0.02")
    h1, h2 = net.add_host("h1"), net.add_host("h2")
    cluster.coordinator("--node-grace", "10")
    cluster.agent("n1", 1, host=h1)
    cluster.wait(lambda: cluster.store.get(keys.node("n1")), 60, "n1 registered")

    def records(kind: str) -> list[dict]:
        return [r for r in read_jsonl(logs) if r["kind"] == kind]

    job = cluster.start("ds", "--store", cluster.url, "--job-name", "ds", "--framework",
                        "deepspeed", "-np", "2", "--min-np", "1", "--max-np", "2",
                        sys.executable, str(DS_WORKER))
    cluster.wait(lambda: sum(r["world"] == 1 for r in records("step")) >= 10, 240,
                 "DeepSpeed training on n1")
    cluster.agent("n2", 1, host=h2)
    cluster.wait(lambda: sum(r["world"] == 2 for r in records("step")) >= 20, 240,
                 "DeepSpeed training across both hosts")
    assert all(c["params_identical"] and not c["state_diffs"] for c in records("check")
               if c["world"] == 2)
    cluster.procs["agent-n2"].kill()
    t_kill = time.time()
    cluster.wait(lambda: sum(r["world"] == 1 and r["t"] > t_kill for r in records("step"))
                 >= 10, 120, "DeepSpeed training on n1 again")
    (logs / "stop").touch()
    assert job.wait(timeout=180) == 0, cluster.log("ds")[-3000:]
    assert "ds: succeeded, exit code 0" in cluster.log("ds")
    first = min(records("start"), key=lambda r: r["t"])
    assert {r["pid"] for r in records("step") if r["rank"] == 0} == {first["pid"]}


RESTART_WORKER = Path(__file__).with_name("restart_worker.py")


def test_restart_elastic_job_spans_hosts_grows_and_restarts_after_losing_one(net, cluster):
    """A torchrun-style script (no pollux API) under pollux-run's torchrun form: it grows
    onto a joining host by a restart (GROUP_RANK, MASTER_ADDR of the other host), and
    when that host is lost its survivor's failure restarts the group (counted against
    --max-restarts), which goes on alone once the coordinator moved it."""
    h1, h2 = net.add_host("h1"), net.add_host("h2")
    cluster.coordinator("--node-grace", "10")
    cluster.agent("n1", 1, host=h1)
    cluster.wait(lambda: cluster.store.get(keys.node("n1")), 60, "n1 registered")
    snap, stop = cluster.tmp / "snap.pt", cluster.tmp / "rs.stop"
    job = cluster.start("rs", "--store", cluster.url, "--job-name", "rs", "--nnodes", "1:2",
                        "--nproc-per-node", "1", "--max-restarts", "3", str(RESTART_WORKER),
                        "--snapshot", str(snap), "--stop-file", str(stop))
    cluster.wait(lambda: sum(s["world"] == 1 for s in cluster.steps()) >= 10, 120,
                 "the job training on n1 alone")
    assert "job rs: restart-elastic 1..2 replicas" in cluster.log("rs")

    cluster.agent("n2", 1, host=h2)
    cluster.wait(lambda: {s["node"] for s in cluster.steps() if s["world"] == 2} == {"n1", "n2"}
                 and sum(s["world"] == 2 for s in cluster.steps()) >= 20, 180,
                 "the job restarted across both hosts")
    two = [s for s in cluster.steps() if s["world"] == 2]
    assert {(s["node"], s["group_rank"]) for s in two} == {("n1", 0), ("n2", 1)}
    assert {s["master"] for s in two} == {h1.address}  # rank 0's host, reached from h2
    assert min(s["first"] for s in two) > 0  # resumed from the snapshot, not from scratch

    cluster.procs["agent-n2"].kill()  # the host is lost with its worker
    t_kill = time.time()
    cluster.wait(lambda: sum(s["world"] == 1 and s["t"] > t_kill for s in cluster.steps()) >= 5,
                 120, "the survivor restarted alone")
    cluster.wait(lambda: cluster.allocation("rs") == ("n1",), 60, "rs re-allocated to n1")
    after = [s for s in cluster.steps() if s["t"] > t_kill]
    assert max(s["restarts"] for s in after) >= 1  # the lost peer was a failure: counted

    stop.touch()
    assert job.wait(timeout=120) == 0, cluster.log("rs")[-3000:]
    assert "rs: succeeded, exit code 0" in cluster.log("rs")
    rank0 = sorted((s for s in cluster.steps() if s["rank"] == 0), key=lambda s: s["t"])
    worlds = [s["world"] for s in rank0]
    assert [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w] == [1, 2, 1]
    # each restart fell back at most to the last snapshot (every 5 steps)
    assert all(b["step"] > a["step"] - 6 for a, b in itertools.pairwise(rank0))

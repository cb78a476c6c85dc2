"""Jobs across real hosts: node agents in separate network namespaces (distinct addresses
on a bridge; one etcd and the coordinator in the root namespace), sharing the machine's
host name, which resolves to a loopback address on every host - as on many real clusters.
"""

from __future__ import annotations

import time

import pytest
from cluster import Cluster
from hosts import HostNet, netns_available

from pollux_launch import keys
from pollux_launch.messages import NodeInfo, decode

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
    cluster.etcd.pause()
    time.sleep(20)
    cluster.etcd.resume()
    assert job.wait(timeout=240) == 0, cluster.log("stalled")[-3000:]
    assert "stalled: succeeded, exit code 0" in cluster.log("stalled")
    assert len({s["pid"] for s in cluster.steps()}) == 2  # no worker was replaced
    assert {s["world"] for s in cluster.steps()} == {2}  # nor removed
    assert cluster.epochs_lost() == 0
    for name in ("coordinator", "agent-n1", "agent-n2"):
        assert cluster.procs[name].poll() is None, cluster.log(name)[-2000:]

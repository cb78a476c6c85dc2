"""Logs where the user is: a two-node cluster (real etcd, real node agents, a real
coordinator) runs a two-replica job whose workers print; the submitting ``pollux-run``
shows every rank's lines, prefixed, and ``pollux-run logs JOB --rank 1`` prints rank 1's
afterwards - from the node agents' HTTP log servers, signed with the cluster secret."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from cluster import POLLUX_RUN, SECRET, Cluster

from pollux_launch import keys
from pollux_launch.messages import NodeInfo, decode

SCRIPT = """\
import os, sys, time
rank = os.environ["RANK"]
for i in range(3):
    print(f"rank {rank} line {i}", flush=True)
print(f"rank {rank} says goodbye", file=sys.stderr)
print(f"rank {rank} last words", end="")
"""


@pytest.fixture
def cluster(etcd_private, tmp_path):
    c = Cluster(etcd_private.url, tmp_path)
    yield c
    c.close()


def test_output_of_every_node_reaches_the_submitting_pollux_run(cluster, tmp_path):
    cluster.coordinator()
    for node in ("n1", "n2"):
        cluster.agent(node, 1)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")
    ports = {decode(NodeInfo, kv.value).log_port for kv in cluster.store.get_prefix(keys.NODES)}
    assert 0 not in ports and len(ports) == 2

    (tmp_path / "hello.py").write_text(SCRIPT)
    proc = cluster.start("job-logs", "--store", cluster.url, "--job-name", "job-logs",
                         "--framework", "torch", "-np", "2", "--min-np", "2", "--max-np", "2",
                         sys.executable, "hello.py")
    assert proc.wait(timeout=120) == 0, cluster.log("job-logs")[-3000:]
    out = cluster.log("job-logs")
    for rank in (0, 1):
        for i in range(3):
            assert f"[{rank}]<stdout>:rank {rank} line {i}\n" in out, out
        assert f"[{rank}]<stderr>:rank {rank} says goodbye\n" in out
        assert f"[{rank}]<stdout>:rank {rank} last words\n" in out  # drained, line ended
    # every worker line comes before the job's end, and no line twice
    assert out.rindex("last words") < out.index("succeeded, exit code 0"), out
    assert all(out.count(f"rank {r} line {i}") == 1 for r in (0, 1) for i in range(3)), out
    # each node kept its own rank's lines on disk
    on_disk = {n: "".join(p.read_text() for p in (tmp_path / f"state-{n}" / "logs" /
                                                   "job-logs").glob("*.log"))
               for n in ("n1", "n2")}
    assert sorted(len(re.findall(r"^\[(\d)\]<", t, re.M)) for t in on_disk.values()) == [5, 5]

    logs = subprocess.run([POLLUX_RUN, "logs", "job-logs", "--rank", "1", "--store", cluster.url],
                          env=cluster.env, capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == [
        "[1]<stdout>:rank 1 line 0", "[1]<stdout>:rank 1 line 1", "[1]<stdout>:rank 1 line 2",
        "[1]<stderr>:rank 1 says goodbye", "[1]<stdout>:rank 1 last words",
    ] or sorted(logs.stdout.splitlines()) == sorted([  # (stdout and stderr pumps race)
        "[1]<stdout>:rank 1 line 0", "[1]<stdout>:rank 1 line 1", "[1]<stdout>:rank 1 line 2",
        "[1]<stderr>:rank 1 says goodbye", "[1]<stdout>:rank 1 last words",
    ]), logs.stdout

    # without the secret the agents refuse, and say nothing of the job's output
    env = {k: v for k, v in cluster.env.items() if k != "POLLUX_SECRET"}
    refused = subprocess.run([POLLUX_RUN, "logs", "job-logs", "--store", cluster.url],
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stdout == ""  # nothing printed: an error
    assert "cluster secret" in refused.stderr and SECRET not in refused.stderr
    assert refused.stderr.splitlines()[-1] == ("pollux-run: error: no output of job "
                                               "'job-logs' on the 2 node(s) serving logs")

    unknown = subprocess.run([POLLUX_RUN, "logs", "no-such-job", "--store", cluster.url],
                             env=cluster.env, capture_output=True, text=True, timeout=60)
    assert unknown.returncode != 0 and unknown.stderr.count("\n") == 1
    assert "no job named 'no-such-job'" in unknown.stderr
    agents = cluster.log("agent-n1") + cluster.log("agent-n2")
    assert SECRET not in agents and "Traceback" not in agents

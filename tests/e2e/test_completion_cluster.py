"""A rank that finishes early on one node ends nothing on another: the job succeeds when
every worker of its final group has exited 0 (torchrun's rule), with a real etcd, a
coordinator and two node agents."""

from __future__ import annotations

from cluster import Cluster

from pollux_launch import keys
from pollux_launch.messages import Allocation, decode

# torchrun-style: rank 1 is done at once, rank 0 "saves its model" for 20 s
SCRIPT = r'''
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(20)
    with open(sys.argv[1], "w") as f:
        f.write("saved")
print(f"rank {rank} done on", os.environ["POLLUX_NODE"], flush=True)
'''


def test_an_early_rank_on_another_node_waits_for_rank_0(etcd_private, tmp_path):
    cluster = Cluster(etcd_private.url, tmp_path)
    try:
        (tmp_path / "save.py").write_text(SCRIPT)
        cluster.coordinator()
        cluster.agent("n1", 1)
        cluster.agent("n2", 1)
        cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")
        model = tmp_path / "model.pt"
        proc = cluster.start("c04", "--store", cluster.url, "--job-name", "c04",
                             "--nproc-per-node", "1", "--nnodes", "2", "save.py", str(model))
        cluster.wait(lambda: "rank 1 done" in cluster.log("c04"), 90, "rank 1 to finish")
        alloc = decode(Allocation, cluster.store.get(keys.job("c04", "allocation")).value)
        assert proc.wait(timeout=120) == 0, cluster.log("c04")[-3000:]
        assert model.read_text() == "saved"
        log = cluster.log("c04")
        assert "c04: succeeded, exit code 0" in log
        assert log.index("rank 1 done") < log.index("rank 0 done") < log.index("succeeded")
        agents = cluster.log("agent-n1") + cluster.log("agent-n2")
        assert "stopping its processes" not in agents and "exited -15" not in agents
        # nothing moved it while it completed: the next allocation gives its slots back
        cluster.wait(lambda: cluster.allocation("c04") == (), 30, "the slots given back")
        final = decode(Allocation, cluster.store.get(keys.job("c04", "allocation")).value)
        assert final.version == alloc.version + 1, (alloc, final)
        assert len(cluster.store.get_prefix(keys.job("c04", keys.FINISHED))) == 2
    finally:
        cluster.close()



"""A two-node logical cluster on this machine: real etcd, real node agents, a real
coordinator, jobs submitted with pollux-run, workers training with the native adapter.

Node agents are named n1 and n2 (2 slots each); every process talks over loopback.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from cluster import POLLUX_RUN, SECRET, WORKER, Cluster

from pollux_launch import keys
from pollux_launch.messages import NodeInfo, decode


@pytest.fixture
def cluster(etcd_private, tmp_path):
    c = Cluster(etcd_private.url, tmp_path)
    yield c
    c.close()


def test_two_jobs_share_a_two_node_cluster_live(cluster):
    slots = {"n1": 2, "n2": 2}
    cluster.coordinator()
    for node, k in slots.items():
        cluster.agent(node, k)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")

    a = cluster.submit("job-a", "-np", "2", "--min-np", "1", "--max-np", "4")
    # A alone grows to the whole cluster once its agent has a throughput model
    # (long enough at 4 for its throughput model to learn what 4 replicas are worth)
    cluster.wait(lambda: sum(s["world"] == 4 and s["rank"] == 0 for s in cluster.steps()) >= 40,
                 180, "job A training on 4 replicas", slots)
    first = min((s for s in cluster.steps() if s["rank"] == 0), key=lambda s: s["t"])  # A's

    b = cluster.submit("job-b", "-np", "2", "--min-np", "1", "--max-np", "2")
    cluster.wait(lambda: len(cluster.allocation("job-b")) >= 1
                 and len(cluster.allocation("job-a")) < 4, 120, "slots moving to B", slots)
    status = subprocess.run([POLLUX_RUN, "status", "--store", cluster.url],
                            capture_output=True, text=True, timeout=60)
    assert "job-a" in status.stdout and "job-b" in status.stdout, status.stdout
    assert "n1" in status.stdout and "n2" in status.stdout

    # the coordinator dies and comes back: jobs keep training, scheduling resumes
    cluster.procs["coordinator"].kill()
    cluster.procs["coordinator"].wait()
    before = len(cluster.steps())
    cluster.wait(lambda: len(cluster.steps()) > before + 20, 60, "training without a coordinator")
    cluster.coordinator()

    cluster.stop_job("job-b")
    assert b.wait(timeout=180) == 0, (cluster.tmp / "job-b.log").read_text()[-3000:]
    t_b_done = time.time()
    cluster.wait(lambda: any(s["world"] == 4 and s["t"] > t_b_done for s in cluster.steps()),
                 180, "job A growing back to 4 replicas", slots)
    cluster.stop_job("job-a")
    assert a.wait(timeout=180) == 0, (cluster.tmp / "job-a.log").read_text()[-3000:]

    for job in ("job-a", "job-b"):
        out = (cluster.tmp / f"{job}.log").read_text()
        assert "succeeded, exit code 0" in out, out[-2000:]
    # each job's rank 0 reached the validation target (worker output is in the agents' logs)
    agents = "".join((cluster.tmp / f"agent-{n}.log").read_text() for n in slots)
    finals = [float(v) for v in re.findall(r"final val_acc ([0-9.]+)", agents)]
    assert len(finals) == 2 and min(finals) >= 0.85, finals
    # A's first rank 0 kept its process through every change
    mine = [s for s in cluster.steps() if s["worker"] == first["worker"]]
    assert len({s["pid"] for s in mine}) == 1
    assert len({s["world"] for s in mine}) >= 2 and mine[-1]["t"] > t_b_done


def _on_both_nodes(cluster: Cluster, name: str):
    """Nodes n1 and n2 of one slot each, and job ``name`` (1..2 replicas) training on both."""
    cluster.coordinator()
    cluster.agent("n1", 1)
    cluster.agent("n2", 1)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 2, 60, "two nodes")
    job = cluster.submit(name, "-np", "2", "--min-np", "1", "--max-np", "2")
    cluster.wait(lambda: sorted(cluster.allocation(name)) == ["n1", "n2"]
                 and any(s["world"] == 2 for s in cluster.steps()), 120, f"{name} on both")
    return job


def test_node_agent_killed_job_continues_on_the_other_node(cluster):
    job = _on_both_nodes(cluster, "job-c")
    cluster.procs["agent-n2"].kill()  # its worker dies with it, as with a failed node
    t_kill = time.time()
    cluster.wait(lambda: any(s["world"] == 1 and s["t"] > t_kill for s in cluster.steps()),
                 60, "C training on n1 alone")
    # the coordinator moves C off n2 once n2 has been missing for its grace period (40 s)
    cluster.wait(lambda: cluster.allocation("job-c") == ("n1",), 90, "C re-allocated to n1")
    cluster.stop_job("job-c")
    assert job.wait(timeout=120) == 0
    survivor = [s for s in cluster.steps() if s["node"] == "n1"]
    assert len({s["pid"] for s in survivor}) == 1


def test_drain_moves_the_job_off_the_node_live_and_undo_brings_it_back(cluster):
    """``pollux-run drain n2 --wait``: the coordinator offers n2 no slots, the job re-forms
    on n1 alone (n2's worker leaves; the survivor keeps its process), status marks n2,
    and the command returns once n2 runs nothing; ``--undo``: the job grows back."""
    job = _on_both_nodes(cluster, "job-d")
    store = ("--store", cluster.url)
    out = subprocess.run([POLLUX_RUN, "drain", "n2", "--wait", *store], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out
    assert out.stdout.splitlines()[-1] == "n2: drained, no worker left", out.stdout
    assert cluster.allocation("job-d") == ("n1",)
    table = subprocess.run([POLLUX_RUN, "status", *store], capture_output=True, text=True,
                           timeout=60).stdout
    assert "n2 (draining)" in table, table
    t_drained = time.time()
    cluster.wait(lambda: any(s["world"] == 1 and s["t"] > t_drained for s in cluster.steps()),
                 60, "D training on n1 alone")
    out = subprocess.run([POLLUX_RUN, "drain", "n2", "--undo", *store], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "drain of n2 ended\n", out
    cluster.wait(lambda: sorted(cluster.allocation("job-d")) == ["n1", "n2"], 120,
                 "D back on both nodes")
    cluster.stop_job("job-d")
    assert job.wait(timeout=120) == 0, cluster.log("job-d")[-3000:]
    survivor = [s for s in cluster.steps() if s["node"] == "n1"]
    assert len({s["pid"] for s in survivor}) == 1  # it kept its process throughout
    assert cluster.epochs_lost() == 0 and cluster.steps_lost() == 0


def test_a_sweep_file_runs_its_jobs_together_on_the_cluster(cluster, tmp_path):
    """``pollux-run --store ... --sweep jobs.txt``: both lines' jobs run at once, each
    worker line prefixed with its job's name; the exit code is the failed job's."""
    cluster.coordinator()
    cluster.agent("n1", 2)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 1, 60, "the node")
    work = f"{sys.executable} {WORKER} --target 0 --epochs 1 --step-delay 0.02 --stop-file"
    (tmp_path / "jobs.txt").write_text(
        f"{work} {tmp_path / 'a.stop'}\n"
        f"--job-name bad {sys.executable} -c 'import sys; print(\"oops\"); sys.exit(3)'\n")
    sweep = cluster.start("sweep", "--store", cluster.url, "--sweep", str(tmp_path / "jobs.txt"),
                          "--job-name", "sw", "-np", "1")
    assert sweep.wait(timeout=240) == 3, cluster.log("sweep")[-3000:]
    lines = cluster.log("sweep").splitlines()
    assert "[pollux] sw-1: succeeded, exit code 0" in lines, lines[-20:]
    assert "bad | [0]<stdout>:oops" in lines, lines[-20:]
    assert any(x.startswith("sw-1 | ") and "final val_acc" in x for x in lines), lines[-20:]
    assert lines[-1] == "[pollux] sweep: 1 of 2 job(s) succeeded: failed bad (exit code 3)"


def test_agents_of_two_gpu_types_a_job_never_spans_them(cluster):
    """Nodes of two GPU types (their agents' --gpu-type): a job of 2 replicas that would
    span both runs at 1 on one type; a second job takes the other type; a job that
    allows only one type gets that one; ``pollux-run status`` shows each node's type."""
    cluster.coordinator()
    cluster.agent("n1", 1, "--gpu-type", "V100")
    cluster.agent("n2", 1, "--gpu-type", "H100")
    cluster.agent("n3", 1, "--gpu-type", "H100")
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 3, 60, "three nodes")
    slow = cluster.submit("on-v100", "-np", "2", "--min-np", "1", "--max-np", "2",
                          "--gpu-types", "V100")
    wide = cluster.submit("wide", "-np", "3", "--min-np", "1", "--max-np", "3")
    cluster.wait(lambda: cluster.allocation("on-v100") == ("n1",)
                 and sorted(cluster.allocation("wide")) == ["n2", "n3"], 120,
                 "each job on one type")
    cluster.wait(lambda: sum(s["world"] == 2 for s in cluster.steps()) >= 10, 120,
                 "wide training on both H100 nodes")
    table = subprocess.run([POLLUX_RUN, "status", "--store", cluster.url],
                           capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"^n1\s.*\sV100$", table, re.M) and re.search(r"^n3\s.*\sH100$", table,
                                                                    re.M), table
    for job in ("on-v100", "wide"):
        cluster.stop_job(job)
    assert slow.wait(timeout=120) == 0 and wide.wait(timeout=120) == 0
    worlds = {(s["node"], s["world"]) for s in cluster.steps()}
    assert ("n1", 2) not in worlds and ("n1", 3) not in worlds, worlds  # never spanned


def test_failing_worker_sets_exit_code_and_frees_slots(cluster, tmp_path):
    cluster.coordinator()
    cluster.agent("n1", 2)
    cluster.wait(lambda: len(cluster.store.get_prefix(keys.NODES)) == 1, 60, "a node")
    (tmp_path / "crash.py").write_text("import time, sys\ntime.sleep(1)\nsys.exit(3)\n")
    proc = cluster.start("job-d", "--store", cluster.url, "--job-name", "job-d", "-np", "2",
                         sys.executable, "crash.py")
    assert proc.wait(timeout=120) == 3
    assert "failed, exit code 3" in (tmp_path / "job-d.log").read_text()
    cluster.wait(lambda: cluster.allocation("job-d") == (), 30, "D's slots freed")


def test_unsigned_spec_is_not_run(cluster, tmp_path):
    """An agent with a cluster secret refuses a job submitted without it: the job fails
    at once with one line saying why, and its slots are freed."""
    cluster.agent("n1", 1)
    cluster.coordinator()
    env = {k: v for k, v in cluster.env.items() if k != "POLLUX_SECRET"}
    marker = tmp_path / "ran"
    proc = subprocess.Popen([POLLUX_RUN, "--store", cluster.url, "--job-name", "rogue",
                             sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 126, out
    assert "refused it: its spec is not signed with this cluster's secret" in out
    assert not marker.exists()
    cluster.wait(lambda: cluster.allocation("rogue") == (), 30, "its slots freed")
    log = (tmp_path / "agent-n1.log").read_text()
    assert "not signed" in log and SECRET not in log


def test_nodes_register_with_their_slots(cluster):
    cluster.agent("n1", 3)
    kv = cluster.wait(lambda: cluster.store.get(keys.node("n1")), 60, "registration")
    assert decode(NodeInfo, kv.value).slots == 3
    cluster.procs["agent-n1"].send_signal(signal.SIGTERM)  # drains: the lease is revoked
    assert cluster.procs["agent-n1"].wait(timeout=30) == 0
    assert cluster.store.get(keys.node("n1")) is None

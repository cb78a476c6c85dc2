"""The autoscaler's ``slurm`` provisioner against a real Slurm (``slurm.py``): slurmctld
and two slurmd "machines" in network namespaces. The cluster grows by a real batch job
that runs ``pollux-run agent`` on a Slurm node (registered with that node's address) and
shrinks, once the job that needed it ended, by ``scancel`` of that batch job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from cluster import read_jsonl
from hosts import HostNet, netns_available
from slurm import Slurm, slurm_available
from waiting import end_processes, wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.coordinator.provisioners import SLURM_PREFIX
from pollux_launch.messages import AutoscaleStatus, JobStatus, NodeInfo, decode
from pollux_launch.rendezvous.store import open_store

POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))
pytestmark = [
    pytest.mark.skipif(not netns_available(), reason="needs root and network namespaces"),
    pytest.mark.skipif(slurm_available() is not None, reason=str(slurm_available())),
]


@pytest.fixture
def net():
    with HostNet() as net:
        yield net


@pytest.fixture
def slurm(net, tmp_path):
    hosts = [net.add_host("s1"), net.add_host("s2")]
    with Slurm(tmp_path / "slurm", str(net.gateway), hosts) as s:
        s.wait_idle()
        yield s


def _nodes(store) -> dict[str, NodeInfo]:
    found = [decode(NodeInfo, kv.value) for kv in store.get_prefix(keys.NODES)]
    return {n.name: n for n in found if n.slots > 0}


def test_slurm_provisioner_grows_by_a_real_batch_job_and_shrinks_by_scancel(
        net, slurm, etcd_factory, tmp_path):
    etcd = etcd_factory(host=net.gateway)
    prefix = "/slurm-autoscale"
    env = {**slurm.env, "OMP_NUM_THREADS": "1", "POLLUX_STORE_PREFIX": prefix,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    procs = []

    def start(*argv: str, log: str, command: tuple[str, ...] = ()) -> subprocess.Popen:
        with open(tmp_path / log, "w") as out:
            procs.append(subprocess.Popen([POLLUX_RUN, *argv, "--store", etcd.url,
                                           "--store-prefix", prefix, *command], env=env,
                                          stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path))
        return procs[-1]

    (tmp_path / "job.py").write_text("import os, time\nwhile not os.path.exists('stop'):\n"
                                     "    time.sleep(0.2)\n")
    try:
        start("agent", "--node-name", "base", "--slots", "1",
              "--state-dir", str(tmp_path / "state-base"), log="base.log")
        start("coordinator", "--interval", "1", "--autoscale", "1:2", "--scale-interval", "1",
              "--min-node-lifetime", "0", "--provisioner", "slurm", "--agent-args",
              f"--slots 1 --state-dir {tmp_path / 'state-slurm'}", log="coordinator.log")
        with open_store(etcd.url, prefix) as store:
            wait_for(lambda: list(_nodes(store)) == ["base"], 60, "the first node")
            job = start("--job-name", "steady", "-np", "1", log="job.log",
                        command=(sys.executable, "job.py"))
            grown = wait_for(lambda: len(n := _nodes(store)) == 2 and n, 120,
                             "a second node from a Slurm batch job")
            [name] = set(grown) - {"base"}
            [(job_id, state, node)] = slurm.jobs()
            assert name == f"{SLURM_PREFIX}{job_id}" and state == "RUNNING", (name, slurm.jobs())
            host = slurm.hosts[slurm.nodes.index(node)]
            assert grown[name].address == host.address  # the agent runs on that machine
            status = wait_for(lambda: (a := decode(AutoscaleStatus, store.get(
                keys.AUTOSCALE).value)).nodes == 2 and a, 30, "the autoscaler to see both")
            assert status.target == 2, status
            (tmp_path / "stop").touch()
            assert job.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-3000:]
            assert decode(JobStatus, store.get(keys.job("steady", "status")).value).state \
                == "succeeded"
            wait_for(lambda: list(_nodes(store)) == ["base"], 120, "the cluster back to one")
            wait_for(lambda: not slurm.jobs(), 60, "the batch job cancelled")
        log = (tmp_path / "coordinator.log").read_text()
        assert "submitted batch job" in log, log[-3000:]
        wait_for(lambda: not [p for p in host.pids() if "agent" in _cmdline(p)[1:3]], 30,
                 "the agent to end on its machine")
    finally:
        end_processes(procs)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


WORKER = """
import json, os, subprocess, sys, time
import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
slurm = {k: v for k, v in os.environ.items() if k.startswith("SLURM")}
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
               "node": os.environ.get("POLLUX_NODE"), "slurm": slurm}, f)
if dist.get_rank() == 0:  # both jobs at once on the allocation, then its status
    deadline = time.time() + 120
    while time.time() < deadline and len([f for d in ("a", "b") for f in os.listdir(
            os.path.join(out, "..", d)) if f.startswith("rank")]) < 4:
        time.sleep(0.2)
    status = subprocess.run(["pollux-run", "status"], capture_output=True, text=True)
    with open(os.path.join(out, "status.txt"), "w") as f:
        f.write(status.stdout + status.stderr)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_sweep_of_two_jobs_shares_the_allocation_found_without_a_flag(slurm, tmp_path):
    """``pollux-run --sweep jobs.txt -np 2`` in a 2-node batch script, no ``--slurm``: the
    allocation is found (one line says so); an etcd and the coordinator on the batch node,
    a node agent on each node through srun; the file's two torchrun-style jobs run at the
    same time across both nodes' 4 CPUs (an --exclusive allocation: each node's 2 cores
    are its slots), each worker with the ``SLURM_*`` variables that ``srun torchrun``
    gives; ``pollux-run status`` on a node of the allocation shows its nodes and jobs;
    both succeed, named by Slurm's job id or their own ``--job-name``; nothing of
    pollux's is left on the nodes."""
    (tmp_path / "worker.py").write_text(WORKER)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    (tmp_path / "jobs.txt").write_text(
        "# one job per line\n"
        f"{sys.executable} worker.py a\n\n"
        f"--job-name named {sys.executable} worker.py b   # its own name\n")
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexec pollux-run --sweep jobs.txt -np 2\n")
    env = {**slurm.env, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    batch = subprocess.run(["sbatch", "--parsable", "-N", "2", "--exclusive", "--chdir",
                            str(tmp_path), "--output", str(tmp_path / "batch.out"),
                            str(script)], env=env,
                           capture_output=True, text=True, check=True, timeout=30)
    job_id = batch.stdout.strip()
    wait_for(lambda: not slurm.jobs(), 240, "the batch job to end")
    text = (tmp_path / "batch.out").read_text()
    assert f"[pollux] in Slurm job {job_id}'s allocation of 2 nodes: running the job on all " \
           "of them" in text, text[-3000:]
    assert f"[pollux] Slurm job {job_id}: 2 node(s) (n1, n2)" in text, text[-3000:]
    for name in (f"{job_id}-1", "named"):
        assert f"[pollux] {name}: succeeded, exit code 0" in text, text[-3000:]
    assert "[pollux] sweep: 2 of 2 job(s) succeeded" in text, text[-3000:]
    nodes = set()
    for d in ("a", "b"):
        ranks = [json.loads(p.read_text()) for p in (tmp_path / d).glob("rank*.json")]
        assert sorted(r["rank"] for r in ranks) == [0, 1], ranks
        assert {r["sum"] for r in ranks} == {2.0} and {r["world"] for r in ranks} == {2}
        for r in ranks:  # what srun torchrun gives: one task per node, the node's index
            env_ = r["slurm"]
            assert env_["SLURM_JOB_ID"] == job_id and env_["SLURMD_NODENAME"] == r["node"]
            assert env_["SLURM_NODEID"] == env_["SLURM_PROCID"] == str(
                slurm.nodes.index(r["node"]))
            assert env_["SLURM_NTASKS"] == "2" and env_["SLURM_LOCALID"] == "0"
            assert env_["SLURM_JOB_NUM_NODES"] == "2"
            nodes.add(r["node"])
        status = (tmp_path / d / "status.txt").read_text()
        for word in ("n1", "n2", f"{job_id}-1", "named"):
            assert word in status, status
    assert nodes == {"n1", "n2"}  # across the allocation
    for host in slurm.hosts:
        left = [p for p in host.pids() if any(w in " ".join(_cmdline(p))
                                              for w in ("pollux-run", "etcd", "worker.py"))]
        assert not left, [_cmdline(p) for p in left]
    # the allocation's store was named in its Slurm job while it ran, and is no longer
    assert "pollux-store=" not in slurm.run("scontrol", "show", "job", job_id)


ELASTIC = Path(__file__).parents[1] / "adapters" / "elastic_worker.py"


def test_the_warning_signal_checkpoints_requeues_and_both_jobs_resume_where_they_were(
        slurm, tmp_path):
    """``scancel --signal=USR1 --batch`` (what ``#SBATCH --signal=B:USR1@90`` sends before
    the time limit) to a ``pollux-run --slurm --sweep`` batch job of two jobs: every
    worker writes its final checkpoint (each job in its own folder under
    ``--checkpoint-dir``) and ends, everything stops, the batch job is requeued, and its
    next run resumes both jobs from their checkpoints - no step trained twice, every
    sample of every epoch seen exactly once - and both finish."""
    logs = {n: tmp_path / f"logs-{n}" for n in ("a", "b")}
    for folder in logs.values():
        folder.mkdir()
    (tmp_path / "jobs.txt").write_text("".join(f"{sys.executable} {ELASTIC} {logs[n]}\n"
                                               for n in ("a", "b")))
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexec pollux-run --slurm --sweep jobs.txt -np 2 "
                      "--checkpoint-dir ckpt --checkpoint-interval 600\n")
    env = {**slurm.env, "OMP_NUM_THREADS": "1", "N": "960",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    job_id = subprocess.run(
        ["sbatch", "--parsable", "-N", "2", "--exclusive", "--requeue", "--chdir",
         str(tmp_path),
         "--output", str(tmp_path / "batch-%j-%t.out"), "--open-mode", "append",
         str(script)], env=env, capture_output=True, text=True, check=True,
        timeout=30).stdout.strip()

    def steps(name: str) -> list[dict]:
        return [r for r in read_jsonl(logs[name]) if r.get("kind") == "step"]

    wait_for(lambda: all(len(steps(n)) >= 20 for n in logs), 180, "both jobs training")
    first = {r["pid"] for n in logs for r in steps(n)}
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True,
                   timeout=30)
    wait_for(lambda: all(any(r["pid"] not in first for r in steps(n)) for n in logs), 240,
             "both jobs training in the requeued run")
    for folder in logs.values():
        (folder / "stop").touch()
    wait_for(lambda: not slurm.jobs(), 240, "the batch job to end")
    text = "".join(p.read_text() for p in tmp_path.glob("batch-*.out"))
    assert f"[pollux] Slurm job {job_id}: warned (SIGUSR1): the workers wrote their final " \
           "checkpoints; requeued" in text, text[-4000:]
    assert "[pollux] sweep: 2 of 2 job(s) succeeded" in text, text[-4000:]
    for n, i in (("a", 1), ("b", 2)):
        assert f"{job_id}-{i}: succeeded, exit code 0" in text, text[-4000:]
        assert (tmp_path / "ckpt" / f"{job_id}-{i}").is_dir()  # each job its own folder
        ordered = sorted(steps(n), key=lambda r: r["t"])
        before = [r["step"] for r in ordered if r["pid"] in first and r["rank"] == 0]
        after = [r["step"] for r in ordered if r["pid"] not in first and r["rank"] == 0]
        assert after[0] == before[-1] + 1, (n, before[-3:], after[:3])  # where it was
        seen: dict[int, Counter] = defaultdict(Counter)
        for r in ordered:
            seen[r["epoch"]].update(r["indices"])
        for epoch, counts in seen.items():
            assert max(counts.values()) == 1, f"{n}: epoch {epoch} saw a sample twice"
            if epoch < max(seen):  # (the last: cut short by the stop)
                assert len(counts) == 960, f"{n}: epoch {epoch} missed samples"


class _SpanningJob:
    """An elastic 1..2-replica job (``elastic_worker.py``) under ``pollux-run --slurm`` in
    a 2-node batch job (one core, one slot, per node), started and waited for until it
    trains with a replica on each node."""

    def __init__(self, slurm, tmp_path: Path, name: str, *sbatch: str) -> None:
        self.slurm, self.tmp = slurm, tmp_path
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        script = tmp_path / "job.sh"
        script.write_text(f"#!/bin/sh\nexec pollux-run --slurm --job-name {name} -np 2 "
                          f"--min-np 1 --max-np 2 {sys.executable} {ELASTIC} {self.logs}\n")
        self.env = {**slurm.env, "OMP_NUM_THREADS": "1", "N": "960",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.id = subprocess.run(
            ["sbatch", "--parsable", "-N", "2", *sbatch, "--chdir", str(tmp_path),
             "--output", str(tmp_path / "batch.out"), str(script)], env=self.env,
            capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        wait_for(lambda: len({r["node"] for r in self.steps() if r["world"] == 2}) == 2, 180,
                 "the job on both nodes")
        self.batch_node = self.fields()["BatchHost"]
        [self.other] = [n for n in slurm.nodes if n != self.batch_node]

    def fields(self) -> dict[str, str]:
        """``scontrol show job``'s fields."""
        return dict(f.split("=", 1) for f in self.slurm.run(
            "scontrol", "show", "job", self.id, "-o").split() if "=" in f)

    def steps(self) -> list[dict]:
        return sorted((r for r in read_jsonl(self.logs) if r.get("kind") == "step"),
                      key=lambda r: r["t"])

    def pollux_run(self, *args: str) -> subprocess.CompletedProcess:
        """``pollux-run ARGS`` as on a node of the allocation (its SLURM_JOB_ID)."""
        return subprocess.run([POLLUX_RUN, *args], env={**self.env, "SLURM_JOB_ID": self.id},
                              capture_output=True, text=True, timeout=240)

    def output(self) -> str:
        return (self.tmp / "batch.out").read_text()

    def assert_exactly_once(self) -> None:
        """No sample of an epoch seen twice; every sample of every finished epoch seen."""
        seen: dict[int, Counter] = defaultdict(Counter)
        for r in self.steps():
            seen[r["epoch"]].update(r["indices"])
        for epoch, counts in seen.items():
            assert max(counts.values()) == 1, f"epoch {epoch} saw a sample twice"
            if epoch < max(seen):  # (the last: cut short by the stop)
                assert len(counts) == 960, f"epoch {epoch} missed samples"


def test_a_failed_node_of_the_allocation_is_a_lost_node_the_job_goes_on_without(
        slurm, tmp_path):
    """A node of a ``--no-kill`` allocation fails - every process on it killed, its slurmd
    included: its node agent's record lapses, the job's survivor re-forms alone and
    trains on live, ``pollux-run status`` (from the allocation's job id) no longer lists
    the node, and the job finishes with every sample of an epoch seen exactly once."""
    job = _SpanningJob(slurm, tmp_path, "lose", "--no-kill")
    t_kill = time.time()
    slurm.hosts[slurm.nodes.index(job.other)].kill_all()  # the machine is gone
    wait_for(lambda: sum(r["world"] == 1 and r["t"] > t_kill for r in job.steps()) >= 10,
             120, "the survivor training alone")
    # (once the lost node's record lapsed - its lease - and the coordinator's next round)
    told = wait_for(lambda: job.other not in (text := job.pollux_run("status").stdout)
                    and text, 60, f"pollux-run status without {job.other}")
    assert f"{job.batch_node}:1" in told and "lose  running" in told, told
    (job.logs / "stop").touch()
    # (the batch script ends; Slurm's job stays COMPLETING until the dead node is DOWN)
    wait_for(lambda: all(j[1] != "RUNNING" for j in slurm.jobs()), 240,
             "the batch script to end")
    assert "lose: succeeded, exit code 0" in job.output(), job.output()[-4000:]
    slurm.run("scontrol", "update", f"NodeName={job.other}", "State=DOWN", "Reason=failed")
    job.assert_exactly_once()


def test_shrinking_the_allocation_drains_the_released_node_first(slurm, tmp_path):
    """``pollux-run drain --num-nodes 1`` (what ``scontrol update JobId=... NumNodes=1``
    would do, were it not to kill what runs on the released node at once): the non-batch
    node is drained - the job re-forms live without its worker there, which leaves after
    handing over (no failure, no sample seen twice or missed) - and only then released
    (the Slurm job's node list is the batch node alone); the job goes on and finishes."""
    job = _SpanningJob(slurm, tmp_path, "shrink")
    drain = job.pollux_run("drain", "--num-nodes", "1")
    assert drain.returncode == 0, drain
    assert drain.stdout.splitlines()[-1] == (
        f"[pollux] Slurm job {job.id}: released {job.other} after draining them; 1 node(s) "
        f"left ({job.batch_node})"), drain.stdout
    fields = job.fields()
    assert fields["NodeList"] == job.batch_node and fields["JobState"] == "RUNNING"
    leaver = [r for r in job.steps() if r["node"] == job.other]
    t_drained = time.time()
    wait_for(lambda: sum(r["t"] > t_drained for r in job.steps()) >= 10, 120,
             "the job training on after the release")
    (job.logs / "stop").touch()
    wait_for(lambda: not slurm.jobs(), 240, "the batch job to end")
    text = job.output()
    assert "shrink: succeeded, exit code 0" in text, text[-4000:]
    assert "lost" not in text and "failed" not in text, text[-4000:]  # a leave, no loss
    ends = [r for r in read_jsonl(job.logs) if r.get("kind") == "end"]
    assert len(ends) == 1 and leaver, (ends, len(leaver))
    job.assert_exactly_once()

"""The autoscaler's ``slurm`` provisioner against a real Slurm (``slurm.py``): slurmctld
and two slurmd "machines" in network namespaces. The cluster grows by a real batch job
that runs ``pollux-run agent`` on a Slurm node (registered with that node's address) and
shrinks, once the job that needed it ended, by ``scancel`` of that batch job."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
               "node": os.environ.get("POLLUX_NODE"), "pid": os.getpid()}, f)
dist.destroy_process_group()
"""


def test_pollux_run_in_an_sbatch_script_runs_the_job_on_every_node_of_the_allocation(
        slurm, tmp_path):
    """``pollux-run --slurm`` in a 2-node batch script: an etcd and the coordinator on the
    batch node, a node agent on each node through srun; a 4-rank torchrun-style job runs
    across both nodes' 2 CPUs and succeeds; nothing of pollux's is left on the nodes."""
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "out").mkdir()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexec pollux-run --slurm --job-name span -np 4 "
                      f"{sys.executable} worker.py out\n")
    env = {**slurm.env, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    batch = subprocess.run(["sbatch", "--parsable", "-N", "2", "--chdir", str(tmp_path),
                            "--output", str(tmp_path / "batch.out"), str(script)], env=env,
                           capture_output=True, text=True, check=True, timeout=30)
    job_id = batch.stdout.strip()
    wait_for(lambda: not slurm.jobs(), 240, "the batch job to end")
    text = (tmp_path / "batch.out").read_text()
    assert f"[pollux] Slurm job {job_id}: 2 node(s) (n1, n2)" in text, text[-3000:]
    assert "span: succeeded, exit code 0" in text, text[-3000:]
    ranks = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("rank*.json")]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], ranks
    assert {r["sum"] for r in ranks} == {4.0} and {r["world"] for r in ranks} == {4}
    assert {r["node"] for r in ranks} == {"n1", "n2"}  # across the allocation
    for host in slurm.hosts:
        left = [p for p in host.pids() if any(w in " ".join(_cmdline(p))
                                              for w in ("pollux-run", "etcd", "worker.py"))]
        assert not left, [_cmdline(p) for p in left]


DIGITS = Path(__file__).with_name("digits_worker.py")


def test_the_warning_signal_checkpoints_requeues_and_the_job_resumes_where_it_was(
        slurm, tmp_path):
    """``scancel --signal=USR1 --batch`` (what ``#SBATCH --signal=B:USR1@90`` sends before
    the time limit) to a ``pollux-run --slurm`` batch job: every worker writes its final
    checkpoint and ends, everything stops, the batch job is requeued, and its next run
    resumes the pollux job from that checkpoint - no optimiser step trained twice - and
    finishes."""
    logs, stop = tmp_path / "logs", tmp_path / "stop"
    logs.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\nexec pollux-run --slurm --job-name pre -np 2 --checkpoint-dir ckpt "
        f"--checkpoint-interval 600 {sys.executable} {DIGITS} --stop-file {stop} "
        "--target 0 --epochs 2 --step-delay 0.1\n")
    env = {**slurm.env, "OMP_NUM_THREADS": "1", "LOG_DIR": str(logs),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    job_id = subprocess.run(
        ["sbatch", "--parsable", "-N", "2", "--requeue", "--chdir", str(tmp_path),
         "--output", str(tmp_path / "batch-%j-%t.out"), "--open-mode", "append",
         str(script)], env=env, capture_output=True, text=True, check=True,
        timeout=30).stdout.strip()

    def steps() -> list[dict]:
        return [r for r in read_records(logs) if r["rank"] == 0]

    wait_for(lambda: len(steps()) >= 10, 180, "10 steps of the first run")
    first = {r["pid"] for r in steps()}
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True,
                   timeout=30)
    wait_for(lambda: any(r["pid"] not in first for r in steps()), 240,
             "the requeued run training")
    stop.touch()
    wait_for(lambda: not slurm.jobs(), 240, "the batch job to end")
    text = "".join(p.read_text() for p in tmp_path.glob("batch-*.out"))
    assert f"[pollux] Slurm job {job_id}: warned (SIGUSR1): the workers wrote their final " \
           "checkpoints; requeued" in text, text[-4000:]
    assert "pre: succeeded, exit code 0" in text, text[-4000:]
    ordered = sorted(steps(), key=lambda r: r["t"])
    before = [r["step"] for r in ordered if r["pid"] in first]
    after = [r["step"] for r in ordered if r["pid"] not in first]
    assert after[0] == before[-1] + 1, (before[-3:], after[:3])  # resumed where it was


def read_records(folder: Path) -> list[dict]:
    out = []
    for f in folder.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out

"""A node's GPUs are its slots: each worker holds exactly one, from its start until it has
exited, never one that another job's worker (or a leaver still running) holds, and sees
its job's GPUs on the node with its own at LOCAL_RANK. GPUs are declared (``--gpus``) on
this GPU-less machine, as an operator may; real worker processes record what they got."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest
from waiting import wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.arguments import OptionsError
from pollux_launch.launcher.devices import (
    DevicePool,
    DevicesBusy,
    inherited_gpus,
    node_slots,
    parse_gpus,
    worker_env,
)
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.launcher.status import render
from pollux_launch.messages import Allocation, JobGpus, JobSpec, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store

# Records its GPU variables (one JSON file per process), then sleeps until killed.
RECORDER = """
import json, os, sys, time
keep = ("CUDA_VISIBLE_DEVICES", "POLLUX_GPUS", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK",
        "POLLUX_JOB")
flags = [a for a in sys.argv[1:] if a.startswith("--")]  # (--local_rank, for DeepSpeed)
folder = [a for a in sys.argv[1:] if a not in flags][0]
with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keep} | {"argv": flags}, f)
while True:
    time.sleep(1)
"""


def test_parse_gpus_counts_ids_and_none():
    assert parse_gpus("4", {}) == ("0", "1", "2", "3")
    assert parse_gpus("2", {"CUDA_VISIBLE_DEVICES": "3,5,7"}) == ("3", "5")
    assert parse_gpus("0,2,GPU-8f2a-11", {}) == ("0", "2", "GPU-8f2a-11")
    assert parse_gpus("none", {}) == () and parse_gpus("0", {}) == ()
    for bad in ("0,,1", "a b", "1,1"):
        with pytest.raises(OptionsError):
            parse_gpus(bad, {})
    with pytest.raises(OptionsError, match="given only 1"):
        parse_gpus("2", {"CUDA_VISIBLE_DEVICES": "6"})


def test_inherited_gpus_stop_where_cuda_stops():
    assert inherited_gpus({}) is None
    assert inherited_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert inherited_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,3"}) == ("2",)


def test_node_slots_one_per_gpu():
    assert node_slots(("0", "1"), None) == 2
    assert node_slots(("0", "1"), 1) == 1
    assert node_slots((), 3) == 3
    with pytest.raises(OptionsError, match="has 2 GPU"):
        node_slots(("0", "1"), 4)


def test_worker_env_puts_its_own_gpu_at_its_local_rank():
    assert worker_env("5", ["3"], 1) == {"CUDA_VISIBLE_DEVICES": "3,5", "POLLUX_GPUS": "5"}
    assert worker_env("5", ["3", "4"], 0)["CUDA_VISIBLE_DEVICES"] == "5,3,4"
    assert worker_env("5", [], 3)["CUDA_VISIBLE_DEVICES"] == "5"  # (ranks before it wait)


def test_claims_are_exclusive_across_processes(tmp_path):
    """Two pollux-run on one machine share its GPUs: a claim held by another process is
    not free here, and is free again once that process ends (the kernel drops it)."""
    pool = DevicePool(("0", "1"), str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pollux_launch.launcher.devices import DevicePool\n"
         f"DevicePool(('0', '1'), {str(tmp_path)!r}).claim('other')\n"
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert pool.free() == 1
        assert pool.claim("mine") == "1"
        with pytest.raises(DevicesBusy):
            pool.claim("mine-too")
    finally:
        holder.kill()
        holder.wait()
    assert pool.free() == 1 and pool.claim("mine-too") == "0"
    assert pool.owners() == {"1": "mine", "0": "mine-too"}
    pool.release("1")
    assert pool.free() == 1


@pytest.fixture
def gpu_node(tmp_path, monkeypatch):
    """A real store and a node agent ``n1`` with 4 declared GPUs (claims under tmp_path)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the claims: this test's own)
    url = f"embedded://{tmp_path / 'store.db'}"
    store = open_store(url)
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    out = tmp_path / "seen"
    out.mkdir()
    agent = NodeAgent(store, NodeInfo("n1", 4), url, poll=0.1, gpus=("0", "1", "2", "3"))
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()

    def submit(name: str, elasticity: str = "live", framework: str = "torch") -> None:
        spec = JobSpec(name, (sys.executable, str(script), str(out)), workdir=str(tmp_path),
                       elasticity=elasticity, framework=framework)
        store.put(keys.job(name, "spec"), encode(spec))

    def allocate(name: str, version: int, replicas: int) -> None:
        store.put(keys.job(name, "allocation"), encode(Allocation(version, ("n1",) * replicas)))

    def running(name: str) -> list:
        driver = agent.drivers.get((name, "node"))
        return driver.group.alive() if driver else []

    def seen(name: str) -> dict[int, dict]:
        """pid -> the GPU variables the job's live workers recorded."""
        pids = {w.pid for w in running(name)}
        out_ = {}
        for pid in pids:
            path = out / f"{pid}.json"
            if path.exists() and path.stat().st_size:
                out_[pid] = json.loads(path.read_text())
        return out_ if len(out_) == len(pids) else {}

    def published(name: str) -> tuple[str, ...] | None:
        kv = store.get(keys.job_gpus(name, "n1"))
        return decode(JobGpus, kv.value).gpus if kv else None

    yield SimpleNamespace(store=store, agent=agent, submit=submit, allocate=allocate,
                          running=running, seen=seen, published=published)
    stop.set()
    thread.join(timeout=30)
    store.close()


def _check_job(records: dict[int, dict]) -> set[str]:
    """Each worker sees its job's GPUs, its own at LOCAL_RANK; returns the job's GPUs."""
    own = {r["POLLUX_GPUS"] for r in records.values()}
    assert len(own) == len(records)  # one GPU each
    for r in records.values():
        visible = r["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(r["LOCAL_RANK"])] == r["POLLUX_GPUS"]
        assert set(visible) <= own  # never another job's
    return own


def test_two_jobs_on_one_node_get_disjoint_gpus(gpu_node):
    """Two 2-replica jobs on a 4-GPU node: GPUs 0-1 and 2-3, not both on 0-1."""
    for job in ("a", "b"):
        gpu_node.submit(job)
        gpu_node.allocate(job, 1, 2)
    a = wait_for(lambda: gpu_node.seen("a") if len(gpu_node.running("a")) == 2 else {}, 30,
                 "a's workers")
    b = wait_for(lambda: gpu_node.seen("b") if len(gpu_node.running("b")) == 2 else {}, 30,
                 "b's workers")
    got_a, got_b = _check_job(a), _check_job(b)
    assert not got_a & got_b and got_a | got_b == {"0", "1", "2", "3"}
    for job, got in (("a", got_a), ("b", got_b)):
        wait_for(lambda job=job, got=got: set(gpu_node.published(job) or ()) == got, 10,
                 f"{job}'s GPUs in the store")
    text = render(gpu_node.store)
    assert "GPUS (JOB)" in text and "=a" in text and "=b" in text
    assert f"n1:2[{','.join(sorted(got_a))}]" in text


def test_a_leaver_keeps_its_gpu_until_it_exits(gpu_node):
    """A shrunk job's removed worker still runs (a live worker leaves at a step boundary):
    its GPU goes to another job's newcomer only once it has exited."""
    gpu_node.submit("a")
    gpu_node.allocate("a", 1, 4)
    a = wait_for(lambda: gpu_node.seen("a") if len(gpu_node.running("a")) == 4 else {}, 30,
                 "a's workers")
    gpu_node.allocate("a", 2, 3)
    gpu_node.submit("b")
    gpu_node.allocate("b", 1, 1)
    time.sleep(1.5)
    assert not gpu_node.running("b")
    leaver = max(a, key=lambda pid: int(a[pid]["LOCAL_RANK"]))
    os.kill(leaver, signal.SIGKILL)
    b = wait_for(lambda: gpu_node.seen("b") if gpu_node.running("b") else {}, 30, "b's worker")
    (got,) = b.values()
    assert got["POLLUX_GPUS"] == a[leaver]["POLLUX_GPUS"]  # the one that became free
    assert got["CUDA_VISIBLE_DEVICES"] == got["POLLUX_GPUS"] and got["LOCAL_RANK"] == "0"


def test_a_grown_job_sees_its_gpus_and_a_restarted_group_gets_free_ones(gpu_node):
    """A live newcomer sees the job's running GPU and its own at its LOCAL_RANK; a
    restart-elastic group started again holds only GPUs free at its start."""
    gpu_node.submit("live")
    gpu_node.allocate("live", 1, 1)
    first = wait_for(lambda: gpu_node.seen("live"), 30, "the first worker")
    gpu_node.allocate("live", 2, 2)
    both = wait_for(lambda: gpu_node.seen("live") if len(gpu_node.running("live")) == 2
                    else {}, 30, "the newcomer")
    (newcomer,) = (r for pid, r in both.items() if pid not in first)
    (old,) = first.values()
    assert newcomer["CUDA_VISIBLE_DEVICES"] == f"{old['POLLUX_GPUS']},{newcomer['POLLUX_GPUS']}"
    assert newcomer["LOCAL_RANK"] == "1"

    gpu_node.submit("rs", elasticity="restart", framework="deepspeed")
    gpu_node.allocate("rs", 1, 1)
    one = wait_for(lambda: gpu_node.seen("rs"), 30, "the restart job's worker")
    assert next(iter(one.values()))["argv"] == ["--local_rank=0"]  # (as deepspeed passes it)
    gpu_node.allocate("rs", 2, 2)  # a new generation: every worker stopped, then started
    two = wait_for(lambda: gpu_node.seen("rs") if len(gpu_node.running("rs")) == 2
                   and not set(gpu_node.seen("rs")) & set(one) else {}, 60, "the new group")
    got = _check_job(two)
    assert not got & {r["POLLUX_GPUS"] for r in both.values()}
    assert sorted(r["argv"][0] for r in two.values()) == ["--local_rank=0", "--local_rank=1"]
    assert {r["CUDA_VISIBLE_DEVICES"] for r in two.values()} == {",".join(sorted(got))}

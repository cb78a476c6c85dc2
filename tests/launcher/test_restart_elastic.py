"""Restart-elastic jobs (scripts that do not use the pollux API), torchrun's way, with
real processes on one machine: a new allocation or a failure stops every worker and
starts the group again with torchrun's variables; failures are counted once against
--max-restarts; slots are never oversubscribed; status tells the kind and the cost."""

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pollux_launch import keys
from pollux_launch.launcher.status import render
from pollux_launch.messages import JobGeneration, decode
from pollux_launch.rendezvous.store import open_store

PYTHON = sys.executable
POLLUX_RUN = str(Path(PYTHON).with_name("pollux-run"))

# A torchrun-style script: env:// group, its own snapshot, @record, TORCHELASTIC_*.
SCRIPT = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    snap, steps = sys.argv[1], int(sys.argv[2])
    start = json.load(open(snap))["step"] if os.path.exists(snap) else 0
    env = {k: os.environ[k] for k in ("GROUP_RANK", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                     "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS")}
    print(json.dumps({"rank": rank, "world": world, "restarts": restarts, "start": start,
                      "pid": os.getpid(), **env}), flush=True)
    if "--fail" in sys.argv and rank == 1 and restarts == 0:
        time.sleep(0.5)
        raise ValueError("bad batch on rank 1")
    for step in range(start, steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
        time.sleep(0.1)
        if rank == 0 and step % 5 == 4:
            with open(snap + ".tmp", "w") as f:
                json.dump({"step": step + 1}, f)
            os.replace(snap + ".tmp", snap)
    dist.barrier()
    print("done", flush=True)
    dist.destroy_process_group()  # (torch 2.13's gloo may abort a teardown that does it)

main()
'''


@pytest.fixture
def job_dir(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path


def records(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        body = line.partition(">:")[2]
        if body.startswith("{"):
            out.append(json.loads(body))
    return out


def test_failure_restarts_the_group_once_per_failure(job_dir):
    url = f"embedded://{job_dir}/store.db"
    out = subprocess.run([POLLUX_RUN, "--store", url, "--job-name", "flaky",
                          "--nproc-per-node", "2", "--max-restarts", "1", "train.py",
                          str(job_dir / "snap.json"), "10", "--fail"],
                         cwd=job_dir, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "job flaky: fixed at 2 replica(s) (script does not use the pollux API)" in out.stdout
    recs = records(out.stdout)
    # rank 1's failure (and rank 0's broken collective that followed) count once
    assert sorted((r["rank"], r["restarts"]) for r in recs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["GROUP_RANK"] for r in recs} == {"0"}
    assert {r["ROLE_WORLD_SIZE"] for r in recs} == {"2"}
    assert {r["TORCHELASTIC_RUN_ID"] for r in recs} == {"flaky"}
    assert {r["TORCHELASTIC_MAX_RESTARTS"] for r in recs} == {"1"}
    assert "restarting the group (restart 1 of 1)" in out.stderr


def test_failure_without_restarts_reports_the_first_failure(job_dir):
    url = f"embedded://{job_dir}/store.db"
    out = subprocess.run([POLLUX_RUN, "--store", url, "--job-name", "fails",
                          "--nproc-per-node", "2", "train.py", str(job_dir / "snap.json"), "10",
                          "--fail"], cwd=job_dir, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stdout[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    # the root cause (torchrun's error file), not rank 0's broken connection
    assert "fails: failed, exit code 1 (rank 1 (" in last, last
    assert "ValueError: bad batch on rank 1" in last


def test_shrink_and_grow_by_restarts_without_oversubscribing(job_dir):
    url = f"embedded://{job_dir}/store.db"
    (job_dir / "short.py").write_text("import time\ntime.sleep(12)\nprint('short done')\n")
    logs = {name: open(job_dir / f"{name}.out", "w") for name in ("long", "short")}
    long = subprocess.Popen([POLLUX_RUN, "--store", url, "--job-name", "long", "-np", "1",
                             "--max-np", "2", "-H", "localhost:2", "--interval", "2",
                             "--restart-grace", "5", PYTHON, "train.py",
                             str(job_dir / "snap.json"), "400"],
                            cwd=job_dir, stdout=logs["long"], stderr=subprocess.STDOUT)
    store = open_store(url)
    most = 0

    def workers() -> int:
        """Live worker processes of both jobs (the scripts, not their launchers)."""
        n = 0
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if any(c.endswith(("train.py", "short.py")) for c in cmd) and \
                    not any(c.endswith("pollux-run") for c in cmd):
                n += 1
        return n

    def wait(pred, what, timeout=120):
        nonlocal most
        end = time.time() + timeout
        while time.time() < end:
            most = max(most, workers())
            if pred():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}: "
                             + (job_dir / "long.out").read_text()[-3000:])

    try:
        wait(lambda: {r["world"] for r in records((job_dir / "long.out").read_text())} == {2},
             "long training on both slots")
        wait(lambda: (job_dir / "snap.json").exists(), "long's first snapshot")
        short = subprocess.Popen([POLLUX_RUN, "--store", url, "--job-name", "short", "-np", "1",
                                  "-H", "localhost:2", PYTHON, "short.py"],
                                 cwd=job_dir, stdout=logs["short"], stderr=subprocess.STDOUT)
        wait(lambda: "short" in render(store) and "restart" in render(store), "status")
        table = render(store)
        assert any(line.split()[:3] == ["long", "running", "restart"]
                   for line in table.splitlines()), table
        # rank 0's node measured a restart: its cost is what the coordinator charges
        gen = decode(JobGeneration, store.get(keys.job("long", "generation")).value)
        assert gen.startup_s is not None and 0 < gen.startup_s < 60 and gen.restarts == 0
        wait(lambda: "s each)" in render(store), "the cost shown")
        wait(lambda: short.poll() is not None, "short to end", timeout=180)
        assert short.returncode == 0
        wait(lambda: [r["world"] for r in records((job_dir / "long.out").read_text())
                      if r["rank"] == 0][-1:] == [2] and len(records(
                          (job_dir / "long.out").read_text())) >= 5, "long to grow back")
        (job_dir / "snap.json").write_text('{"step": 399}')  # finish now
        assert long.wait(timeout=120) == 0, (job_dir / "long.out").read_text()[-3000:]
    finally:
        for proc in (long,):
            if proc.poll() is None:
                proc.kill()
        store.close()
    recs = records((job_dir / "long.out").read_text())
    worlds = [r["world"] for r in recs if r["rank"] == 0]
    assert worlds[:3] == [2, 1, 2], worlds  # shrunk for the short job, grown back
    starts = [r["start"] for r in recs if r["rank"] == 0]
    assert starts[1] > 0 and starts[2] >= starts[1]  # each restart resumed its snapshot
    assert most <= 2  # never more workers than the machine's two slots
    assert all(r["restarts"] == 0 for r in recs)  # re-allocations are not failures

"""Restart-elastic jobs (scripts that do not use the pollux API), torchrun's way, with
real processes on one machine: a new allocation or a failure stops every worker and
starts the group again with torchrun's variables; failures are counted once against
--max-restarts; slots are never oversubscribed; status tells the kind and the cost."""

import json
import os
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


# -- the work a stopped group loses; scripts that do not save; --elasticity fixed ---------
REPO = Path(__file__).resolve().parents[2]

# Saves a checkpoint after 6 s, then rank 1 fails 1.5 s later: the restart loses those
# 1.5 s (plus the time to notice), not the 7.5 s the group ran. The second group waits
# for the test's "finish" file.
LOSSY = r'''
import json, os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
rank, restarts = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ckpt = sys.argv[1]
state = json.load(open(os.path.join(ckpt, "state.json"))) if restarts else None
print(json.dumps({"rank": rank, "restarts": restarts, "state": state}), flush=True)
if restarts == 0:
    time.sleep(6)
    if rank == 0:
        with open(os.path.join(ckpt, "state.json"), "w") as f:
            json.dump({"step": 6}, f)
    time.sleep(1.5)
    if rank == 1:
        sys.exit(3)
while not os.path.exists("finish"):
    time.sleep(0.1)
dist.barrier()
'''


def test_stopped_group_lost_work_is_measured_from_its_checkpoint(tmp_path):
    (tmp_path / "lossy.py").write_text(LOSSY)
    url, ckpt, log = f"embedded://{tmp_path}/store.db", tmp_path / "ckpt", tmp_path / "out"
    with open(log, "w") as f:
        job = subprocess.Popen([POLLUX_RUN, "--store", url, "--job-name", "lossy", "-np", "2",
                                "--min-np", "1", "--max-np", "2", "-H", "localhost:2",
                                "--max-restarts", "1", "--restart-grace", "5",
                                "--checkpoint-dir", str(ckpt), PYTHON, "lossy.py", str(ckpt)],
                               cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT)
    store = open_store(url)
    try:
        end = time.time() + 120
        while time.time() < end and len([r for r in records(log.read_text())
                                         if r["restarts"] == 1]) < 2:
            time.sleep(0.1)
        assert [r["state"] for r in records(log.read_text()) if r["restarts"] == 1] == \
            [{"step": 6}] * 2, log.read_text()[-3000:]
        gen = decode(JobGeneration, store.get(keys.job("lossy", "generation")).value)
        assert (gen.restarts, gen.stops) == (1, 1), gen
        assert 1.5 <= gen.lost_s < 5.5, gen  # since the checkpoint, not the group's start
        table = render(store)
        row = next(line for line in table.splitlines() if line.startswith("lossy"))
        assert "1/1" in row and "1 stopped: lost 0m0" in row and "<=" not in row, table
        node = table.splitlines()[1].split()  # NODE SLOTS USED RUNNING FREE
        assert node[3] == "2", table  # the two live workers (local mode too)
        (tmp_path / "finish").touch()
        assert job.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
        store.close()
    text = log.read_text()
    assert "restart-elastic 1..2 replicas (script does not use the pollux API)" in text
    assert "shows no sign of saving" not in text  # json.dump / json.load: it resumes
    assert "its group was stopped" in text and "after its last checkpoint" in text


def test_status_without_checkpoint_dir_shows_a_bound():
    from pollux_launch.launcher.status import _restarts
    from pollux_launch.messages import JobSpec

    gen = JobGeneration(restarts=0, stops=2, lost_s=95.0)
    spec = JobSpec(name="j", command=("x",), elasticity="restart", max_replicas=2)
    assert _restarts(None, gen, spec) == "0/0, 2 stopped: lost <=1m35s"
    spec = JobSpec(name="j", command=("x",), elasticity="restart", max_replicas=2,
                   env={"POLLUX_CHECKPOINT_DIR": "/c"})
    assert _restarts(None, gen, spec) == "0/0, 2 stopped: lost 1m35s"
    assert _restarts(None, JobGeneration(), spec) == "0/0"


NO_SAVE = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"


@pytest.mark.parametrize("script", [
    "tests/compat/torchrun_ddp.py", "tests/compat/deepspeed_cifar.py",
    "tests/compat/hf_trainer_clm.py"])
def test_scripts_that_save_and_resume_get_no_warning(script):
    from pollux_launch.launcher.frameworks import saves_state, state_warning

    assert saves_state(["python", script], REPO)
    assert state_warning(["python", script], REPO, "restart") == ""
    # (elastic_record.py only records what it saw, and saves no training state)
    assert not saves_state(["python", "tests/compat/elastic_record.py"], REPO)


def test_restart_elastic_script_without_saves_is_warned_and_can_run_fixed(tmp_path):
    from pollux_launch.launcher.frameworks import state_warning
    from pollux_launch.launcher.options import parse_launch_args

    (tmp_path / "train.py").write_text(NO_SAVE)
    (tmp_path / "saves.py").write_text(NO_SAVE + "import torch\ntorch.save({}, 'x')\n")
    warn = state_warning(["python", "train.py"], tmp_path, "restart")
    assert warn.startswith("warning: train.py shows no sign of saving") and "\n" not in warn
    assert state_warning(["python", "train.py"], tmp_path, "fixed") == ""
    assert state_warning(["python", "train.py"], tmp_path, "live") == ""
    assert state_warning(["python", "saves.py"], tmp_path, "restart") != ""  # saves only
    o = parse_launch_args(["-np", "2", "--max-np", "4", "python", "train.py"], cwd=tmp_path)
    assert o.elasticity == "restart" and o.elasticity_warning == warn
    assert o.worker_env["POLLUX_REFERENCE_WORLD_SIZE"] == "2"
    o = parse_launch_args(["--elasticity", "fixed", "-np", "2", "--min-np", "1", "--max-np",
                           "4", "python", "train.py"], cwd=tmp_path)
    assert (o.elasticity, o.np, o.min_np, o.max_np) == ("fixed", 2, 2, 2)
    assert o.elasticity_reason == ("as asked by --elasticity fixed; the --min-np/--max-np "
                                   "range is ignored")
    assert o.elasticity_warning == ""
    # the lines a user sees, from a real launcher
    url = f"embedded://{tmp_path}/store.db"
    for argv, first, warned in (
            (["-np", "1", "--max-np", "2"], "restart-elastic 1..2 replicas (script does not "
             "use the pollux API)", True),
            (["--elasticity", "fixed", "-np", "1", "--max-np", "2"], "fixed at 1 replica(s) "
             "(as asked by --elasticity fixed; the --min-np/--max-np range is ignored)", False)):
        r = subprocess.run([POLLUX_RUN, "--store", url, "--job-name", "nosave", "-H",
                            "localhost:2", *argv, PYTHON, "train.py"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        lines = r.stdout.splitlines()
        assert lines[0] == f"[pollux] job nosave: {first}", lines
        assert (lines[1] == f"[pollux] job nosave: {warn}") is warned, lines


def test_constant_batch_accumulation(monkeypatch, capsys):
    from pollux_launch.constant_batch import accumulation_steps

    monkeypatch.delenv("POLLUX_REFERENCE_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert accumulation_steps(3) == 3  # outside pollux-run: unchanged
    monkeypatch.setenv("POLLUX_REFERENCE_WORLD_SIZE", "4")
    assert accumulation_steps(1) == 4
    assert accumulation_steps(2, world_size=8) == 1
    assert accumulation_steps(1, world_size=2) == 2
    assert capsys.readouterr().err == ""
    assert accumulation_steps(1, world_size=3) == 1  # 4 cannot be split over 3
    assert "cannot be split over 3 workers" in capsys.readouterr().err
    monkeypatch.setenv("POLLUX_REFERENCE_WORLD_SIZE", "zero")
    with pytest.raises(ValueError, match="POLLUX_REFERENCE_WORLD_SIZE"):
        accumulation_steps(1)
    with pytest.raises(ValueError, match="at least 1"):
        accumulation_steps(0)


def test_status_help_documents_every():
    out = subprocess.run([POLLUX_RUN, "status", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert "--every SECONDS" in out.stdout and "seconds between redraws" in out.stdout


def test_newest_checkpoint_file(tmp_path):
    from pollux_launch.launcher.restart import newest_mtime

    assert newest_mtime(str(tmp_path)) is None and newest_mtime(str(tmp_path / "no")) is None
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name, when in (("old", 1000.0), ("a/b/new", 5000.0), ("a/mid", 3000.0)):
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, (when, when))
    assert newest_mtime(str(tmp_path)) == 5000.0

"""pollux-run on one machine with the embedded store: real processes end to end."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pollux_launch import keys
from pollux_launch.messages import JobSpec, JobStatus, encode
from pollux_launch.rendezvous.store import open_store

PYTHON = sys.executable
POLLUX_RUN = str(Path(PYTHON).with_name("pollux-run"))


def run(args, cwd, timeout=120):
    return subprocess.run([POLLUX_RUN, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def store_url(tmp_path):
    return f"embedded://{tmp_path}/store.db"


def test_plain_job_runs_with_prefixed_output_and_exit_code(tmp_path, store_url):
    (tmp_path / "job.py").write_text(
        "import os\nprint('hello from', os.environ['POLLUX_JOB'], flush=True)\n")
    out = run(["--store", store_url, "--job-name", "hello", "-np", "2", PYTHON, "job.py"],
              tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum(line.endswith("<stdout>:hello from hello") for line in lines) == 2
    assert {line[:3] for line in lines if "<stdout>" in line} == {"[0]", "[1]"}
    assert "hello: succeeded, exit code 0" in out.stdout
    with open_store(store_url) as store:  # a local job leaves nothing behind
        assert store.get_prefix(keys.job("hello")) == []


def test_failing_worker_sets_the_exit_code(tmp_path, store_url):
    (tmp_path / "bad.py").write_text("import sys\nsys.exit(7)\n")
    out = run(["--store", store_url, "-np", "1", PYTHON, "bad.py"], tmp_path)
    assert out.returncode == 7
    assert "failed, exit code 7" in out.stdout


def test_bad_input_is_one_line_before_anything_starts(tmp_path, store_url):
    for args, needle in [
        (["-np", "99", PYTHON, "x.py"], "more than this machine"),
        (["-np", "1", "no-such-program-xyz"], "not found"),
        (["--store", "etcd://127.0.0.1:1", "-np", "1", PYTHON, "-c", "pass"], "etcd"),
        (["--store", "bogus://x", "-np", "1", PYTHON, "-c", "pass"], "unknown store URL scheme"),
        (["-H", "otherhost:2", "-np", "1", PYTHON, "-c", "pass"], "not this machine"),
    ]:
        out = run(["--store", store_url, *args] if "--store" not in args else args, tmp_path)
        assert out.returncode == 2, (args, out)
        assert out.stderr.strip().count("\n") == 0 and needle in out.stderr, (args, out.stderr)


def test_duplicate_job_name_is_refused(tmp_path, store_url):
    spec = JobSpec(name="taken", command=("true",))
    with open_store(store_url) as store:
        store.put(keys.job("taken", "spec"), encode(spec))
    out = run(["--store", store_url, "--job-name", "taken", PYTHON, "-c", "pass"], tmp_path)
    assert out.returncode == 2 and "already exists" in out.stderr


def test_a_finished_jobs_name_can_be_used_again(tmp_path, store_url):
    """After `pollux-run cancel` (or any end) the name is free, as the message says; a job
    of that name that has not finished keeps it."""
    with open_store(store_url) as store:
        store.put(keys.job("again", "spec"), encode(JobSpec(name="again", command=("true",))))
        store.put(keys.job("again", "status"), encode(JobStatus("running")))
    out = run(["--store", store_url, "--job-name", "again", PYTHON, "-c", "pass"], tmp_path)
    assert out.returncode == 2 and "has not finished" in out.stderr
    cancel = run(["cancel", "--store", store_url, "again"], tmp_path)
    assert cancel.returncode == 0 and "can be used again" in cancel.stdout
    out = run(["--store", store_url, "--job-name", "again", PYTHON, "-c", "pass"], tmp_path)
    assert out.returncode == 0 and "again: succeeded" in out.stdout, out.stderr


def test_status_shows_nodes_and_jobs(tmp_path, store_url):
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(6)\n")
    proc = subprocess.Popen([POLLUX_RUN, "--store", store_url, "--job-name", "slowjob",
                             "-np", "1", PYTHON, "slow.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = 30
        text = ""
        import time

        start = time.time()
        while time.time() - start < deadline:
            text = run(["status", "--store", store_url], tmp_path).stdout
            if "slowjob" in text and "running" in text:
                break
            time.sleep(0.5)
        assert "slowjob" in text and "running" in text, text
        assert os.uname().nodename in text
    finally:
        assert proc.wait(timeout=60) == 0


def test_plain_torch_script_gets_torchrun_environment(tmp_path, store_url):
    """An unadapted script using init_process_group("env://") runs as under torchrun."""
    (tmp_path / "static.py").write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t)\n"
        "print('rank', os.environ['RANK'], os.environ['LOCAL_RANK'], 'sum', t.item(),\n"
        "      flush=True)\n"
        # (torch 2.13's gloo may abort an interpreter teardown that destroys the group)
        "dist.destroy_process_group()\n")
    out = run(["--store", store_url, "-np", "2", PYTHON, "static.py"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(line.split(":", 1)[1] for line in out.stdout.splitlines()
                  if "<stdout>:rank" in line) == ["rank 0 0 sum 3.0", "rank 1 1 sum 3.0"]


def test_two_local_jobs_share_the_machine_and_the_second_ends_first(tmp_path, store_url):
    """Both launchers serve one node record for this machine: when the second job ends
    (its launcher, lease and agent gone), the first keeps its node and finishes."""
    import time

    (tmp_path / "wait.py").write_text(
        "import os, sys, time\n"
        "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.1)\n"
        "print('done', os.environ['POLLUX_JOB'], flush=True)\n")
    first = subprocess.Popen([POLLUX_RUN, "--store", store_url, "--job-name", "first", "-np",
                              "1", PYTHON, "wait.py", str(tmp_path / "first.go")],
                             cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        with open_store(store_url) as store:
            deadline = time.time() + 60
            while time.time() < deadline and not store.get(keys.job("first", "allocation")):
                time.sleep(0.2)
            second = run(["--store", store_url, "--job-name", "second", "-np", "1", PYTHON,
                          "-c", "print('quick')"], tmp_path)
            assert second.returncode == 0, second.stdout + second.stderr
            time.sleep(3)  # rounds run without the second launcher's agent and lease
            assert store.get(keys.node(os.uname().nodename)) is not None
            (tmp_path / "first.go").touch()
            out, _ = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 0, out
    assert "<stdout>:done first" in out and "first: succeeded, exit code 0" in out

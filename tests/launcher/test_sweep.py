"""``pollux-run --sweep FILE``: a file of jobs, parsed and validated before any starts;
the Slurm allocation found without ``--slurm``; a signal that came before a job's
follower took over; the nodes a shrink releases. (The jobs themselves run in
tests/e2e/test_slurm.py, on a real Slurm.)"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pollux_launch import keys
from pollux_launch.arguments import OptionsError
from pollux_launch.launcher.devices import cpu_slots
from pollux_launch.launcher.drain import pick_release
from pollux_launch.launcher.options import parse_launch_args
from pollux_launch.launcher.run import _follow
from pollux_launch.launcher.slurm_allocation import STORE_COMMENT, allocation_nodes
from pollux_launch.launcher.sweep import parse_jobs, run_jobs
from pollux_launch.messages import JobSpec, JobStatus, decode, encode
from pollux_launch.rendezvous.store import open_store

POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))
ALLOCATION = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    (tmp_path / "train.py").write_text("import torch.distributed\n")
    return tmp_path


def test_each_line_is_a_job_with_the_command_line_s_flags_as_defaults(folder):
    (folder / "jobs.txt").write_text(
        "# a sweep\n"
        "python train.py --lr 0.1\n"
        "\n"
        "-np 4 --job-name big python train.py --lr 0.2  # its own size and name\n"
        "python train.py --lr '0.3 0.4'\n")
    jobs = parse_jobs(["--store", "etcd://127.0.0.1:1", "--sweep", "jobs.txt", "-np", "2",
                       "--checkpoint-dir", "ckpt"], folder)
    assert [j.job_name for j in jobs] == ["jobs-1", "big", "jobs-3"]
    assert [j.np for j in jobs] == [2, 4, 2]
    assert jobs[2].command[-2:] == ("--lr", "0.3 0.4")
    assert {j.store for j in jobs} == {"etcd://127.0.0.1:1"}
    dirs = [j.worker_env["POLLUX_CHECKPOINT_DIR"] for j in jobs]
    assert dirs == [str(folder / "ckpt" / n) for n in ("jobs-1", "big", "jobs-3")]


def test_in_an_allocation_the_jobs_are_named_by_its_id_and_run_on_it(folder, monkeypatch):
    for key, value in ALLOCATION.items():
        monkeypatch.setenv(key, value)
    (folder / "jobs.txt").write_text("python train.py\npython train.py --x 1\n")
    jobs = parse_jobs(["--sweep=jobs.txt"], folder)
    assert [j.job_name for j in jobs] == ["77-1", "77-2"]
    assert all(j.slurm for j in jobs) and "Slurm job 77's allocation of 2 nodes" \
        in jobs[0].slurm_notice


@pytest.mark.parametrize("text, argv, message", [
    ("python train.py\n-np 0 python train.py\n", [],
     "jobs.txt:2: argument -np/--num-proc: 0 must be a whole number from 1 to 1000000 (see "
     "pollux-run --help)"),
    ("python train.py\npython train.py 'open\n", [],
     "jobs.txt:2: No closing quotation"),
    ("# nothing\n\n", [], "--sweep jobs.txt: no job in it (one command per line)"),
    ("--job-name x python train.py\n--job-name x python train.py\n", [],
     "--sweep jobs.txt: job name 'x' on two lines; give each line its own --job-name"),
    ("python train.py\n--store etcd://127.0.0.1:2 python train.py\n", [],
     "--sweep jobs.txt: the jobs share one cluster: give --slurm, --store, --store-prefix "
     "and --secret-file on the command line, not on a line"),
    ("python train.py\n", ["python", "train.py"],
     "--sweep jobs.txt: the commands come from the file; drop 'python train.py' from the "
     "command line"),
    ("--sweep other.txt python train.py\n", [],
     "jobs.txt:1: --sweep: a job of a sweep file cannot name another sweep"),
])
def test_a_bad_sweep_is_one_line_naming_the_line(folder, text, argv, message):
    (folder / "jobs.txt").write_text(text)
    with pytest.raises(OptionsError) as info:
        parse_jobs(["--store", "etcd://127.0.0.1:1", "--sweep", "jobs.txt", *argv], folder)
    assert str(info.value) == message


def test_a_sweep_needs_a_cluster_one_line_exit_2(folder):
    (folder / "jobs.txt").write_text("python train.py\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = subprocess.run([POLLUX_RUN, "--sweep", "jobs.txt"], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.splitlines() == [
        "pollux-run: error: --sweep: the jobs share a cluster: add --slurm (inside a Slurm "
        "allocation) or --store etcd://HOST:PORT"]


def test_run_jobs_prefixes_worker_lines_and_returns_the_first_failure(folder):
    (folder / "jobs.txt").write_text("python train.py\npython train.py\npython train.py\n")
    jobs = parse_jobs(["--store", "etcd://127.0.0.1:1", "--sweep", "jobs.txt"], folder)
    codes = {"jobs-1": 0, "jobs-2": 3, "jobs-3": 5}
    threads = set()

    def launch(opts, stdout, signals=None):
        threads.add(threading.current_thread().name)
        stdout.write(f"[pollux] {opts.job_name}: running\nloss 0.5\npartial ")
        stdout.write("line\n")
        return codes[opts.job_name]

    out = io.StringIO()
    assert run_jobs(jobs, launch, out) == 3
    lines = out.getvalue().splitlines()
    assert "jobs-2 | loss 0.5" in lines and "jobs-3 | partial line" in lines
    assert "[pollux] jobs-1: running" in lines
    assert lines[-1] == ("[pollux] sweep: 1 of 3 job(s) succeeded: failed jobs-2 (exit code "
                         "3), jobs-3 (exit code 5)")
    assert len(threads) == 3  # at once, each in its own thread


def test_the_allocation_is_found_in_a_batch_script_not_in_a_step(folder, monkeypatch):
    assert allocation_nodes(ALLOCATION) == ("77", 2)
    assert allocation_nodes({**ALLOCATION, "SLURM_STEP_ID": "0"}) is None  # srun's task
    assert allocation_nodes({**ALLOCATION, "SLURM_JOB_NUM_NODES": "1"}) is None  # one node
    assert allocation_nodes({}) is None
    for key, value in ALLOCATION.items():
        monkeypatch.setenv(key, value)
    found = parse_launch_args(["python", "train.py"], folder)
    assert found.slurm and found.job_name == "77"  # (torchrun's --rdzv-id: the job id)
    for argv in (["--no-slurm"], ["--store", "etcd://127.0.0.1:1"], ["-H", "a:1,b:1"]):
        opts = parse_launch_args([*argv, "python", "train.py"], folder)
        assert not opts.slurm and not opts.slurm_notice and opts.job_name != "77", argv
    assert parse_launch_args(["--rdzv-id", "mine", "train.py"], folder).job_name \
        == "mine"


def test_cpu_slots_are_the_allocation_s_cores_on_the_node():
    assert cpu_slots({"SLURM_CPUS_ON_NODE": "3"}) == 3
    assert cpu_slots({}) == len(os.sched_getaffinity(0))
    assert cpu_slots({"SLURM_CPUS_ON_NODE": "x"}) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("comment, found", [
    ("pollux-store=etcd://10.0.0.1:2379|/pollux", ("etcd://10.0.0.1:2379", "/pollux")),
    ("pollux-store=etcd://a:1,b:2|/p/q", ("etcd://a:1,b:2", "/p/q")),
    ("pollux-store=embedded:///tmp/x|/pollux", None),  # (only a network store)
    ("pollux-store=etcd://10.0.0.1:2379|/pollux;touch /tmp/x", None),
    ("the user's own comment", None),
])
def test_the_store_named_in_the_slurm_job_is_read_as_untrusted_text(comment, found):
    match = STORE_COMMENT.match(comment)
    assert (match.groups() if match else None) == found


def test_a_signal_that_came_before_a_follower_took_over_cancels_its_job(folder):
    """A SIGTERM that reached ``pollux-run --slurm`` after the allocation's services
    started but before the job's follower installed its own handler is not lost: the
    caller's record of it, shared with the follower, cancels the job as soon as it is
    followed (the window in which it was dropped before)."""
    with open_store(f"embedded://{folder / 'store.db'}") as store:
        opts = parse_launch_args(["--job-name", "late", "python", "train.py"], folder)
        spec = JobSpec("late", ("python", "train.py"))
        store.put(keys.job("late", "spec"), encode(spec))
        store.put(keys.job("late", "status"), encode(JobStatus("pending")))
        out = io.StringIO()
        assert _follow(store, "late", opts, out, signals=[signal.SIGTERM]) == 143
        status = decode(JobStatus, store.get(keys.job("late", "status")).value)
    assert status.state == "cancelled" and "signal 15" in status.message
    assert out.getvalue().splitlines()[-1] == "[pollux] late: cancelled"


def test_run_jobs_hands_the_callers_signals_to_every_follower(folder):
    (folder / "jobs.txt").write_text("python train.py\npython train.py\n")
    jobs = parse_jobs(["--store", "etcd://127.0.0.1:1", "--sweep", "jobs.txt"], folder)
    got = []

    def launch(opts, stdout, signals=None):
        got.append(signals)
        return 128 + signals[0] if signals else 0

    assert run_jobs(jobs, launch, io.StringIO(), signals=[signal.SIGTERM]) == 143
    assert got == [[signal.SIGTERM], [signal.SIGTERM]]


def test_a_shrink_releases_the_least_busy_nodes_never_the_batch_node():
    nodes = ["n1", "n2", "n3", "n4"]
    assert pick_release(nodes, "n1", {}, 2) == ["n4", "n3"]  # the last listed first
    assert pick_release(nodes, "n1", {"n4": 2, "n3": 1}, 2) == ["n2", "n3"]
    assert pick_release(nodes, "n4", {"n1": 0}, 3) == ["n3", "n2", "n1"]

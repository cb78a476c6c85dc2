"""``pollux-run logs`` on one machine: a real local ``pollux-run -np 2`` (embedded store)
keeps its job's output in the user's local log folder, and ``pollux-run logs`` reads it
there - while the job runs, followed to its end, and after its launcher ended and its
keys were gone. Printing nothing is one line and exit code 2. Real processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pollux_launch import keys
from pollux_launch.rendezvous.store import open_store

PYTHON = sys.executable
POLLUX_RUN = str(Path(PYTHON).with_name("pollux-run"))

# each rank prints three lines and one to stderr, waits for the file "go", then says
# goodbye without a newline (a partial last line) and ends
TALKER = """\
import os, sys, time
rank = os.environ["RANK"]
for i in range(3):
    print(f"rank {rank} line {i}", flush=True)
print(f"rank {rank} says hi", file=sys.stderr, flush=True)
while not os.path.exists("go"):
    time.sleep(0.1)
print(f"rank {rank} bye", end="", flush=True)
"""
SILENT = """\
import os, time
while not os.path.exists("go"):
    time.sleep(0.1)
"""


def early(rank: int) -> list[str]:
    return [f"[{rank}]<stdout>:rank {rank} line {i}" for i in range(3)] + [
        f"[{rank}]<stderr>:rank {rank} says hi"]


def everything(rank: int) -> list[str]:
    return [*early(rank), f"[{rank}]<stdout>:rank {rank} bye"]


@pytest.fixture
def local(tmp_path):
    """(store URL, environment with a private state folder, the local log folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLLUX_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    return (f"embedded://{tmp_path}/store.db", env,
            tmp_path / "state" / "pollux-launch" / "local" / "logs")


def logs(local, *args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    url, env, _ = local
    return subprocess.run([POLLUX_RUN, "logs", *args, "--store", url], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def launch(local, job: str, script: str, cwd: Path) -> subprocess.Popen:
    url, env, _ = local
    (cwd / f"{job}.py").write_text(script)
    return subprocess.Popen([POLLUX_RUN, "--store", url, "--job-name", job, "-np", "2",
                             PYTHON, f"{job}.py"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_running(local, job: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with open_store(local[0]) as store:
        while time.monotonic() < deadline and proc.poll() is None:
            if store.get(keys.job(job, "allocation")) is not None:
                return
            time.sleep(0.2)
    raise AssertionError(f"job {job} did not start: {proc.poll()}")


def test_logs_of_a_local_job_while_it_runs_followed_and_after_it_ended(tmp_path, local):
    proc = launch(local, "talk", TALKER, tmp_path)
    try:
        wait_running(local, "talk", proc)
        deadline = time.monotonic() + 60  # (the workers start and print)
        while True:
            now = logs(local, "talk", cwd=tmp_path)
            if (now.returncode == 0 and len(now.stdout.splitlines()) == 8) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        # both ranks' lines, each once (the stdout and stderr pumps of a rank race)
        assert now.returncode == 0, now.stderr
        assert sorted(now.stdout.splitlines()) == sorted(early(0) + early(1)), now.stdout
        assert now.stderr == ""

        one = logs(local, "talk", "--rank", "1", cwd=tmp_path)
        assert one.returncode == 0, one.stderr
        assert sorted(one.stdout.splitlines()) == sorted(early(1)), one.stdout

        none = logs(local, "talk", "--rank", "5", cwd=tmp_path)
        assert none.returncode == 2 and none.stdout == ""
        assert none.stderr.count("\n") == 1 and "no line of rank 5" in none.stderr

        # --follow prints what comes until the job ends, then exits 0
        url, env, _ = local
        follow = subprocess.Popen([POLLUX_RUN, "logs", "talk", "--follow", "--store", url],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(2.0)
            assert follow.poll() is None, follow.communicate()  # the job runs: it follows
            (tmp_path / "go").touch()
            out, err = follow.communicate(timeout=60)
        finally:
            follow.kill()
        assert follow.returncode == 0, err
        assert sorted(out.splitlines()) == sorted(everything(0) + everything(1)), out
        assert out.count("bye") == 2
        launched, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, launched
    assert "talk: succeeded, exit code 0" in launched

    with open_store(local[0]) as store:  # the launcher removed the job's keys
        assert store.get_prefix(keys.job("talk")) == []
    after = logs(local, "talk", "--rank", "0", cwd=tmp_path)
    assert after.returncode == 0, after.stderr
    assert sorted(after.stdout.splitlines()) == sorted(everything(0)), after.stdout
    files = list((local[2] / "talk").glob("*.log"))
    assert len(files) == 1
    assert "has finished" in after.stderr and str(files[0]) in after.stderr

    # the log is its user's only, as a node agent's
    folder = local[2]
    for path in (folder.parent.parent, folder.parent, folder, folder / "talk"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600

    unknown = logs(local, "nope", cwd=tmp_path)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.count("\n") == 1 and "no job named 'nope'" in unknown.stderr
    assert str(folder) in unknown.stderr


def test_a_local_job_without_output_is_an_error_that_says_where_it_looked(tmp_path, local):
    proc = launch(local, "quiet", SILENT, tmp_path)
    try:
        wait_running(local, "quiet", proc)
        time.sleep(1.0)  # (its workers run)
        now = logs(local, "quiet", cwd=tmp_path)
        assert now.returncode == 2 and now.stdout == ""
        assert now.stderr.count("\n") == 1, now.stderr
        assert "no output of job 'quiet' in " in now.stderr
        assert str(local[2] / "quiet") in now.stderr  # where it looked

        url, env, _ = local
        follow = subprocess.Popen([POLLUX_RUN, "logs", "quiet", "-f", "--store", url],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)
            (tmp_path / "go").touch()
            out, err = follow.communicate(timeout=60)
        finally:
            follow.kill()
        assert follow.returncode == 2 and out == "" and "no output of job" in err, err
        launched, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, launched

    gone = logs(local, "quiet", cwd=tmp_path)  # no keys, no file: nothing anywhere
    assert gone.returncode == 2 and gone.stdout == ""
    assert gone.stderr.count("\n") == 1 and "no log of a past local run" in gone.stderr

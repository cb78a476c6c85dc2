"""A Horovod Elastic script under ``pollux-run``, end to end with real Horovod.

``pollux-run`` (local mode: embedded store in tmp, its own coordinator and node agent)
runs examples/horovod_elastic.py through ONE ``horovodrun`` whose host list follows the
job's allocation. The test plays the coordinator after the real one placed the job
(``--interval`` is long, so it does not interfere): it writes allocations 2 -> 3 -> 1
while the job trains and checks that survivors keep their processes, that every rank
holds identical parameters after each reset and applies the same Pollux decisions, that
rank 0 reports throughput-model and gradient-noise hints to the store, and that the job
succeeds with exit code 0 although Horovod aborted the removed workers (exit 134: in the
job's log, not on the terminal, which says ``replicas 3 -> 1 (live)``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from waiting import jsonl_records  # tests/waiting.py

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")
pytest.importorskip("sklearn", reason="the example needs scikit-learn (pollux-launch[examples])")

from pollux_launch import keys
from pollux_launch.adapters.horovod.launch.command import REMOVED_WORKER_EXIT_CODE
from pollux_launch.messages import (
    Allocation,
    JobHints,
    JobStatus,
    MessageError,
    decode,
    encode,
)
from pollux_launch.rendezvous.store import open_store

EXAMPLE = Path(__file__).parents[2] / "examples" / "horovod_elastic.py"
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))
JOB = "hvd-pollux"


def read_logs(log_dir: Path) -> list[dict]:
    return [r for f in sorted(log_dir.glob("worker-*.jsonl")) for r in jsonl_records(f)]


def wait_for(proc, what: str, predicate, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"pollux-run exited early with {proc.returncode}"
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def steps_at(log_dir: Path, size: int, steps: int, after: float = 0.0):
    """The step records at world size ``size`` once every rank logged ``steps`` of them."""
    recs = [r for r in read_logs(log_dir)
            if r["event"] == "step" and r["size"] == size and r["t"] > after]
    per_rank: dict[int, int] = defaultdict(int)
    for r in recs:
        per_rank[r["rank"]] += 1
    return recs if len(per_rank) == size and min(per_rank.values()) >= steps else None


def read(store, leaf: str, cls):
    kv = store.get(keys.job(JOB, leaf))
    try:
        return decode(cls, kv.value) if kv else None
    except MessageError:
        return None


def test_pollux_run_drives_horovod_elastic_2_3_1(tmp_path):
    url = f"embedded://{tmp_path / 'store.db'}"
    log_dir, stop, out = tmp_path / "logs", tmp_path / "stop", tmp_path / "pollux-run.out"
    node = socket.gethostname()
    argv = [POLLUX_RUN, "--store", url, "--job-name", JOB, "-np", "2", "--min-np", "1",
            "--max-np", "3", "-H", "localhost:3", "--interval", "3600",
            sys.executable, str(EXAMPLE), "--epochs", "1000", "--step-sleep", "0.02",
            "--report-interval", "1", "--log-dir", str(log_dir), "--stop-file", str(stop)]
    store = open_store(url)
    with open(out, "w") as out_f:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=out_f, stderr=subprocess.STDOUT)
        try:
            first = wait_for(proc, "the coordinator's first allocation",
                             lambda: (a := read(store, "allocation", Allocation))
                             and a.num_replicas and a)
            wait_for(proc, "training", lambda: steps_at(log_dir, first.num_replicas, 3))
            phases = {}
            for version, size in enumerate((2, 3, 1), start=first.version + 1):
                t = time.time()
                store.put(keys.job(JOB, "allocation"), encode(Allocation(version, (node,) * size)))
                phases[size] = wait_for(proc, f"5 steps on {size} ranks",
                                        lambda s=size, t=t: steps_at(log_dir, s, 5, t))
            hints = wait_for(proc, "hints with a throughput model and gradient statistics",
                             lambda: (h := read(store, "hints", JobHints)) and h.perf_params
                             and h.grad_sqr is not None and h.num_replicas == 1 and h)
            running = read(store, "status", JobStatus)
            stop.touch()
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    output = out.read_text()
    assert rc == 0, output[-4000:]
    assert f"{JOB}: succeeded, exit code 0" in output
    assert running is not None and running.state == "running"
    with open_store(url) as after:  # a local job leaves nothing behind
        assert after.get_prefix(keys.job(JOB)) == []
    store.close()

    # Survivors kept their processes through 2 -> 3 -> 1.
    pids = {size: {r["pid"] for r in recs} for size, recs in phases.items()}
    assert [len(pids[s]) for s in (2, 3, 1)] == [2, 3, 1]
    assert pids[2] < pids[3], "the two workers must survive the scale-up in place"
    assert pids[1] < pids[3], "the last worker must be one that was already running"
    # The removed workers were aborted by Horovod (134): expected, not a job failure, so
    # the job's log keeps it and the terminal says the change of size instead.
    job_log = "".join(p.read_text(errors="replace") for p in
                      Path(os.environ["XDG_STATE_HOME"]).rglob(f"logs/{JOB}/*.log"))
    assert job_log.count(f"exit with status code {REMOVED_WORKER_EXIT_CODE}") == 2, job_log[-4000:]
    assert f"exit with status code {REMOVED_WORKER_EXIT_CODE}" not in output, output[-4000:]
    assert f"[pollux] {JOB}: replicas 2 -> 3 (live)" in output, output[-4000:]
    assert f"[pollux] {JOB}: replicas 3 -> 1 (live)" in output, output[-4000:]

    recs = read_logs(log_dir)
    # After each (re)start every rank logs digests of its first steps: identical per step.
    by_step: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)
    for r in recs:
        if r["event"] == "step" and "digest" in r:
            by_step[(r["size"], r["step"])][r["rank"]] = r["digest"]
    for size in (2, 3, 1):
        complete = [d for (s, _), d in by_step.items() if s == size and len(d) == size]
        assert complete, f"no step at size {size} where every rank logged a digest"
        for digests in complete:
            assert len(set(digests.values())) == 1, f"ranks diverged at size {size}: {digests}"

    # Pollux decided after every reset, identically on every rank, and every batch the
    # loop saw has a decided shape (loader batch = local_bsz x backward passes; the first
    # step after a removal still runs with the shape decided before it).
    decisions: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    shapes: dict[int, set] = defaultdict(set)
    for r in recs:
        if r["event"] == "decision":
            decisions[r["size"]][r["pid"]].append(
                (r["local_bsz"], r["accum"], round(r["lr_factor"], 12)))
            shapes[r["pid"]].add((r["local_bsz"] * r["accum"], r["accum"]))
    for size in (2, 3, 1):
        per_pid = decisions[size]
        assert len(per_pid) == size, f"not every rank decided at size {size}: {per_pid}"
        assert len({tuple(d) for d in per_pid.values()}) == 1, per_pid
        for r in phases[size]:
            assert (r["batch"], r["accum"]) in shapes[r["pid"]], (r, shapes[r["pid"]])

    # Rank 0's hints: a fitted throughput model and the gradient noise statistics.
    assert set(hints.perf_params) >= {"alpha_grad", "beta_grad", "alpha_local"}
    assert hints.grad_sqr > 0 and hints.grad_var is not None and hints.grad_var >= 0
    assert hints.max_profiled_replicas == 3 and hints.restarts >= 2
    assert hints.progress > 0


def test_missing_horovod_is_one_line_with_the_install_step(tmp_path):
    # The one place Horovod is hidden rather than absent: a fresh interpreter where
    # `import horovod` fails, running pollux-run's real entry point.
    code = ("import sys; sys.modules['horovod'] = None; from pollux_launch.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    script = tmp_path / "train.py"
    script.write_text("import horovod.torch as hvd\nhvd.init()\n")
    for flags in (["--framework", "horovod"], []):  # given, and detected from the import
        out = subprocess.run(
            [sys.executable, "-c", code, "--store", f"embedded://{tmp_path / 's.db'}", *flags,
             "-np", "1", sys.executable, str(script)],
            cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out
        assert out.stderr.strip().count("\n") == 0, out.stderr
        assert "scripts/install-horovod.sh" in out.stderr and out.stdout == ""
    assert not (tmp_path / "s.db").exists(), "nothing may start before the check"

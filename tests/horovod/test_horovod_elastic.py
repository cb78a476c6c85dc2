"""End to end with real Horovod Elastic: the store's allocation drives live resets.

``horovodrun --gloo`` runs examples/horovod_elastic.py with a discovery script that reads
a hosts file mirrored from a real embedded store; the test rewrites the job's allocation
2 -> 3 -> 1 during training and checks that survivors keep their processes, that all
ranks hold identical parameters after each reset, that removed workers exit 134 (as
Horovod ends them) and that the job completes with exit code 0.
"""

from __future__ import annotations

import os
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
from pollux_launch.adapters.horovod.launch.command import (
    REMOVED_WORKER_EXIT_CODE,
    horovodrun_command,
)
from pollux_launch.adapters.horovod.launch.hosts import (
    HostsFileMirror,
    write_discovery_script,
)
from pollux_launch.messages import Allocation, encode
from pollux_launch.rendezvous.store import open_store

EXAMPLE = Path(__file__).parents[2] / "examples" / "horovod_elastic.py"


def read_logs(log_dir: Path) -> list[dict]:
    return [r for f in sorted(log_dir.glob("worker-*.jsonl")) for r in jsonl_records(f)]


def wait_steps(proc, log_dir: Path, size: int, steps: int, timeout: float = 90.0) -> list[dict]:
    """Wait until ``size`` distinct ranks each logged ``steps`` steps at world size ``size``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"horovodrun exited early with {proc.returncode}"
        recs = [r for r in read_logs(log_dir) if r["event"] == "step" and r["size"] == size]
        per_rank = defaultdict(int)
        for r in recs:
            per_rank[r["rank"]] += 1
        if len(per_rank) == size and min(per_rank.values()) >= steps:
            return recs
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps at size {size} within {timeout} s")


def test_allocation_changes_become_live_horovod_resets(tmp_path):
    store = open_store(f"embedded://{tmp_path / 'store.db'}")
    job, key = "hvd-e2e", keys.job("hvd-e2e", "allocation")
    store.put(key, encode(Allocation(1, ("localhost",) * 2)))
    hosts, script = tmp_path / "hosts", tmp_path / "discover.sh"
    write_discovery_script(script, hosts)
    log_dir, stop, out = tmp_path / "logs", tmp_path / "stop", tmp_path / "horovodrun.out"
    argv = horovodrun_command(
        [sys.executable, str(EXAMPLE), "--epochs", "1000", "--step-sleep", "0.02",
         "--log-dir", str(log_dir), "--stop-file", str(stop)],
        discovery_script=str(script), np=2, min_np=1, max_np=3)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with HostsFileMirror(store, job, hosts), open(out, "w") as out_f:
        proc = subprocess.Popen(argv, stdout=out_f, stderr=subprocess.STDOUT, env=env)
        try:
            at2 = wait_steps(proc, log_dir, 2, 5)
            store.put(key, encode(Allocation(2, ("localhost",) * 3)))
            at3 = wait_steps(proc, log_dir, 3, 5)
            store.put(key, encode(Allocation(3, ("localhost",))))
            at1 = wait_steps(proc, log_dir, 1, 5)
            stop.touch()
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    store.close()
    output = out.read_text()
    assert rc == 0, output[-4000:]

    pids2 = {r["pid"] for r in at2}
    pids3 = {r["pid"] for r in at3}
    pids1 = {r["pid"] for r in at1}
    assert len(pids2) == 2 and len(pids3) == 3 and len(pids1) == 1
    assert pids2 < pids3, "the two workers must survive the scale-up in place"
    assert pids1 < pids3, "the last worker must be one that was already running"

    # After every (re)start each rank logs digests of its first steps: at each such step
    # every rank of that world size holds identical parameters.
    recs = read_logs(log_dir)
    by_step: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)
    for r in recs:
        if r["event"] == "step" and "digest" in r:
            by_step[(r["size"], r["step"])][r["rank"]] = r["digest"]
    for size in (2, 3, 1):
        complete = [d for (s, _), d in by_step.items() if s == size and len(d) == size]
        assert complete, f"no step at size {size} where every rank logged a digest"
        for digests in complete:
            assert len(set(digests.values())) == 1, f"ranks diverged at size {size}: {digests}"

    # Survivors went through Horovod's reset path (the reset callback ran in place).
    resets = {r["pid"] for r in recs if r["event"] == "reset"}
    assert pids2 <= resets

    # Workers removed by the scale-down were aborted by Horovod (exit 134): expected.
    removed = pids3 - pids1
    assert len(removed) == 2
    assert output.count(f"exit with status code {REMOVED_WORKER_EXIT_CODE}") == 2, output[-4000:]
    for pid in removed:
        assert not Path(f"/proc/{pid}").exists()

    # The survivor measured its gradient noise scale and step times for every size it ran.
    [done] = [r for r in recs if r["event"] == "done"]
    assert done["pid"] in pids1 and done["noise_scale"] is not None and done["noise_scale"] > 0
    assert {row[1] for row in done["profile"]} >= {2, 3, 1}

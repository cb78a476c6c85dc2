"""A DeepSpeed job with the ``"pollux"`` section grows from one replica to two, live.

``pollux-run -np 1 --min-np 1 --max-np 2`` on this machine (embedded store, the
coordinator in the launcher), the worker of ``test_deepspeed_pollux``. It used to stay on
one replica: with one replica and no accumulation a step has one gradient, so
``DeepSpeedGradStats`` never estimated the gradient noise, the job's hints carried none,
and the coordinator had no model to prefer two replicas. Now consecutive steps stand for
two samples (as in the torch adapter), the hints carry statistics and the job grows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from pollux_launch import keys
from pollux_launch.messages import JobHints, decode
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("pollux_worker.py")
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))


def _steps(log_dir: Path) -> list[dict]:
    out = []
    for f in log_dir.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # being written
            if record.get("kind") == "step":
                out.append(record)
    return out


def test_a_one_replica_deepspeed_job_reports_gradient_noise_and_grows_to_two(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    url = f"embedded://{tmp_path}/store.db"
    env = {**os.environ, "LOG_DIR": str(logs), "ZERO_STAGE": "0", "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "STEP_SLEEP": "0.02"}
    out = open(tmp_path / "run.log", "w")
    run = subprocess.Popen([POLLUX_RUN, "--store", url, "--job-name", "grow", "-np", "1",
                            "--min-np", "1", "--max-np", "2", "--interval", "3",
                            "--framework", "deepspeed", sys.executable, str(WORKER)],
                           cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    store = open_store(url)
    try:
        deadline, hints, grown = time.monotonic() + 240, None, False
        while time.monotonic() < deadline and run.poll() is None:
            kv = store.get(keys.job("grow", "hints"))
            if kv is not None:
                hints = decode(JobHints, kv.value)
            steps = _steps(logs)
            grown = sum(s["world"] == 2 and s["rank"] == 0 for s in steps) >= 10
            if grown:
                break
            time.sleep(0.5)
        log = (tmp_path / "run.log").read_text()[-4000:]
        assert hints is not None and hints.grad_sqr is not None, (hints, log)
        assert grown, f"never trained on two replicas\n{log}"
        first = min((s for s in _steps(logs) if s["rank"] == 0), key=lambda s: s["t"])
        assert first["world"] == 1  # it started on one replica and grew live
        (logs / "stop").touch()
        assert run.wait(timeout=120) == 0, (tmp_path / "run.log").read_text()[-4000:]
        survivor = {s["pid"] for s in _steps(logs) if s["world"] == 1}
        assert len(survivor) == 1 and survivor <= {s["pid"] for s in _steps(logs)
                                                   if s["world"] == 2}  # kept its process
    finally:
        if run.poll() is None:
            run.kill()
        store.close()
        out.close()

"""A Horovod Elastic job's durable state: every worker SIGKILLed, the job relaunched with
the same ``--checkpoint-dir`` resumes from its last checkpoint.

``examples/horovod_elastic.py`` (pollux's ``TorchState``) under ``pollux-run`` with real
Horovod, two workers, a checkpoint due every half second (written at ``commit()``). All
workers are SIGKILLed mid-epoch; Horovod's driver cannot go on without any, so the
launcher fails. Launched again on one worker, the job starts at the checkpoint's step
and epoch (the ``TorchState`` values, the sampler's position, the model and optimizer,
pollux's statistics) - not at step 0 - and finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")
pytest.importorskip("sklearn", reason="the example needs scikit-learn (pollux-launch[examples])")

from test_horovod_pollux import EXAMPLE, POLLUX_RUN, read_logs, wait_for

from pollux_launch.elastic.checkpoint import latest_checkpoint


def _launch(tmp_path: Path, name: str, replicas: int, epochs: int) -> subprocess.Popen:
    out = open(tmp_path / f"{name}.out", "w")
    return subprocess.Popen(
        [POLLUX_RUN, "--store", f"embedded://{tmp_path / name}.db", "--job-name", name,
         "-np", str(replicas), "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--checkpoint-interval", "0.5", sys.executable, str(EXAMPLE), "--epochs", str(epochs),
         "--step-sleep", "0.02", "--commit-every", "5", "--log-dir", str(tmp_path / name)],
        cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)


def test_all_workers_killed_a_relaunch_resumes_from_the_checkpoint(tmp_path):
    first = _launch(tmp_path, "first", 2, 1000)
    try:
        wait_for(first, "training with a checkpoint written", lambda: (
            (tmp_path / "ckpt" / "latest").exists()
            and sum(r["event"] == "step" and r["rank"] == 0
                    for r in read_logs(tmp_path / "first")) >= 60), timeout=180)
        steps = [r for r in read_logs(tmp_path / "first") if r["event"] == "step"]
        for pid in {r["pid"] for r in steps}:
            os.kill(pid, signal.SIGKILL)
        assert first.wait(timeout=120) != 0  # nothing left to train: the launcher fails
    finally:
        if first.poll() is None:
            first.kill()
    saved = latest_checkpoint(tmp_path / "ckpt")
    assert saved is not None and saved.replicas == 2
    values = saved.state["values"]
    assert values["step"] >= 5 and "pollux" in saved.state

    second = _launch(tmp_path, "second", 1, values["epoch"] + 1)
    assert second.wait(timeout=240) == 0, (tmp_path / "second.out").read_text()[-3000:]
    start = next(r for r in read_logs(tmp_path / "second") if r["event"] == "start")
    assert (start["epoch"], start["step"]) == (values["epoch"], values["step"])  # resumed
    assert "resumed from" in (tmp_path / "second.out").read_text()
    last_before = max(r["step"] for r in steps if r["rank"] == 0)
    assert last_before - start["step"] <= 40  # at most one interval's work (+ a commit)

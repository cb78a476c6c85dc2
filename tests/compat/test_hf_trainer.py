"""A Hugging Face ``Trainer`` script (``hf_trainer_clm.py``: tiny random GPT-2, synthetic
tokens, no download) under ``torchrun`` and under ``pollux-run``, real processes:

* fixed at 2 replicas: the same optimizer steps, samples and eval loss as torchrun;
* restart-elastic 2 -> 1 -> 2 (a second job takes a slot, then ends): with
  ``pollux_launch.constant_batch`` the group restarted at 1 worker accumulates 2
  micro-batches, so ``max_steps``, the optimizer steps and the samples trained on are the
  fixed run's; each group resumes from the newest checkpoint; ``status`` counts the
  stopped groups and the training they lost, measured against ``--checkpoint-dir``;
* a killed worker: the group restarts (``--max-restarts 1``), resumes, and finishes.

The script imports ``pollux_launch.constant_batch`` (its one change), unlike the other
scripts of this folder; it stays restart-elastic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pollux_launch import keys
from pollux_launch.launcher.status import render
from pollux_launch.messages import JobGeneration, decode
from pollux_launch.rendezvous.store import open_store

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent
POLLUX_RUN, TORCHRUN = str(BIN / "pollux-run"), str(BIN / "torchrun")
HF = str(HERE / "hf_trainer_clm.py")
SAMPLES, PER_DEVICE = 768, 4  # 96 optimizer steps of a global batch of 8 (2 x 4 x 1)
ARGS = ["--samples", str(SAMPLES), "--per-device", str(PER_DEVICE), "--save-steps", "4"]


def starts(text: str) -> list[dict]:
    """The script's start records in a launcher's output (``[rank]<stdout>:{...}``)."""
    out = []
    for line in text.splitlines():
        body = line[line.find("{"):] if '{"event": "start"' in line else ""
        if body:
            out.append(json.loads(body))
    return out


def wait(pred, what: str, log: Path, timeout: float = 120.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: " + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def fixed(tmp_path_factory) -> dict:
    """The torchrun baseline: 2 processes, fixed."""
    d = tmp_path_factory.mktemp("torchrun")
    r = subprocess.run([TORCHRUN, "--nproc-per-node", "2", HF, "--output-dir", str(d / "out"),
                        "--result", str(d / "r.json"), *ARGS], cwd=d, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads((d / "r.json").read_text())
    assert result["global_step"] == result["max_steps"] == SAMPLES // (2 * PER_DEVICE)
    assert result["samples"] == SAMPLES
    return result


def test_fixed_matches_torchrun(fixed, tmp_path):
    r = subprocess.run([POLLUX_RUN, "--store", f"embedded://{tmp_path}/s.db", "--job-name",
                        "hf", "-np", "2", "python", HF, "--output-dir", str(tmp_path / "out"),
                        "--result", str(tmp_path / "r.json"), *ARGS], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "job hf: fixed at 2 replica(s) (script does not use the pollux API)" in r.stdout
    assert "shows no sign of saving" not in r.stdout  # it saves and resumes: no warning
    got = json.loads((tmp_path / "r.json").read_text())
    assert (got["global_step"], got["samples"]) == (fixed["global_step"], fixed["samples"])
    assert got["eval_loss"] == pytest.approx(fixed["eval_loss"], rel=1e-4)


@pytest.mark.restart_elastic
@pytest.mark.slow
def test_restart_elastic_keeps_the_global_batch_across_a_shrink(fixed, tmp_path):
    url = f"embedded://{tmp_path}/s.db"
    out, pace, log = tmp_path / "out", tmp_path / "pace", tmp_path / "hf.out"
    pace.touch()
    with open(log, "w") as f:
        job = subprocess.Popen(
            [POLLUX_RUN, "--store", url, "--job-name", "hf", "-np", "2", "--min-np", "1",
             "--max-np", "2", "-H", "localhost:2", "--interval", "2", "--restart-grace", "5",
             "--checkpoint-dir", str(out), "python", HF, "--output-dir", str(out),
             "--result", str(tmp_path / "r.json"), "--step-sleep", "0.4",
             "--pace-file", str(pace), *ARGS], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT)
    store = open_store(url)
    short = None
    try:
        wait(lambda: len(starts(log.read_text())) == 2 and (out / "checkpoint-4").is_dir(),
             "both workers and a first checkpoint", log)
        table = render(store)
        node = table.splitlines()[1].split()  # NODE SLOTS USED RUNNING FREE
        assert node[1:5] == ["2", "2", "2", "0"], table  # RUNNING: the 2 live workers
        short = subprocess.Popen([POLLUX_RUN, "--store", url, "--job-name", "short", "-np",
                                  "1", "-H", "localhost:2", "python", "-c",
                                  "import time; time.sleep(8)"], cwd=tmp_path,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait(lambda: any(s["world"] == 1 for s in starts(log.read_text())), "the shrink", log)
        wait(lambda: short.poll() is not None, "the second job to end", log)
        assert short.returncode == 0
        wait(lambda: [s["world"] for s in starts(log.read_text())][-1:] == [2]
             and len(starts(log.read_text())) >= 5, "the grow back", log)
        gen = decode(JobGeneration, store.get(keys.job("hf", "generation")).value)
        assert gen.stops == 2 and gen.restarts == 0, gen  # stopped twice, never failed
        # measured from the newest checkpoint (--checkpoint-dir): at most the time between
        # two checkpoints (4 paced steps of >= 0.4 s...) and the stop, never whole runs
        assert 0 < gen.lost_s < 30, gen
        assert "2 stopped: lost 0m" in render(store) and "<=" not in render(store)
        pace.unlink()
        assert job.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        for proc in (job, short):
            if proc is not None and proc.poll() is None:
                proc.kill()
        store.close()
    text = log.read_text()
    assert "shows no sign of saving" not in text
    recs = [s for s in starts(text) if s["rank"] == 0]
    assert [s["world"] for s in recs] == [2, 1, 2], recs
    assert [s["accum"] for s in recs] == [1, 2, 1], recs  # 2 x 4 x 1 == 1 x 4 x 2
    assert {s["max_steps"] for s in recs} == {fixed["max_steps"]}, recs  # LR schedule kept
    assert 0 < recs[1]["resumed_at"] < recs[2]["resumed_at"], recs  # each resumed
    got = json.loads((tmp_path / "r.json").read_text())
    assert (got["global_step"], got["samples"]) == (fixed["global_step"], fixed["samples"])
    assert got["eval_loss"] == pytest.approx(fixed["eval_loss"], rel=0.05)


@pytest.mark.restart_elastic
def test_killed_worker_restarts_the_group_which_resumes(fixed, tmp_path):
    out, pace, log = tmp_path / "out", tmp_path / "pace", tmp_path / "hf.out"
    pace.touch()
    with open(log, "w") as f:
        job = subprocess.Popen(
            [POLLUX_RUN, "--store", f"embedded://{tmp_path}/s.db", "--job-name", "hf",
             "-np", "2", "--max-restarts", "1", "--restart-grace", "5", "python", HF,
             "--output-dir", str(out), "--result", str(tmp_path / "r.json"),
             "--step-sleep", "0.2", "--pace-file", str(pace), *ARGS],
            cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait(lambda: len(starts(log.read_text())) == 2 and (out / "checkpoint-8").is_dir(),
             "a checkpoint", log)
        victim = next(s["pid"] for s in starts(log.read_text()) if s["rank"] == 1)
        os.kill(victim, signal.SIGKILL)
        wait(lambda: any(s["restarts"] == 1 for s in starts(log.read_text())),
             "the restarted group", log)
        pace.unlink()
        assert job.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert "restarting the group (restart 1 of 1)" in text
    again = [s for s in starts(text) if s["restarts"] == 1]
    assert len(again) == 2 and all(s["resumed_at"] >= 8 for s in again), again
    got = json.loads((tmp_path / "r.json").read_text())
    assert (got["global_step"], got["samples"]) == (fixed["global_step"], fixed["samples"])

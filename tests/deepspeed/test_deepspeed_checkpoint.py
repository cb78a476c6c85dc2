"""A DeepSpeed job's durable state: every worker SIGKILLed, the job resumes from its last
checkpoint at another size.

A real ZeRO-2 job (``pollux_worker.py``) on two replicas, under a real ``NodeAgent``
thread and an embedded store, checkpoints every half second (``POLLUX_CHECKPOINT_DIR``,
what ``pollux-run --checkpoint-dir`` sets). Both workers are SIGKILLed together and the
allocation shrinks to one replica: the agent starts a fresh worker, which resumes from the
newest checkpoint (the consolidated state is the same for every world size), so the
job's step count goes on from the checkpoint instead of from zero, the restored state
equals what the worker holds (its ``check``), and the job succeeds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from test_deepspeed_pollux import records

from pollux_launch import keys
from pollux_launch.elastic.checkpoint import latest_checkpoint
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import (
    Allocation,
    JobSpec,
    JobStatus,
    NodeInfo,
    decode,
    encode,
)
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("pollux_worker.py")


def _wait(predicate, timeout: float, what: str, agent: NodeAgent) -> object:
    """Until ``predicate()``; a worker exiting non-zero fails at once (but by the
    SIGKILLs this test sends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        bad = [e for e in agent.exits if e[2] not in (0, -signal.SIGKILL, -signal.SIGTERM)]
        if bad:  # (but by the signals these tests send)
            raise AssertionError(f"a worker failed while waiting for {what}: {bad}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(log_dir: Path) -> list[dict]:
    return [r for rs in records(log_dir).values() for r in rs if r["kind"] == "step"]


@contextmanager
def _ds_job(tmp_path: Path, name: str, interval: float) -> Iterator[tuple]:
    """A ZeRO-2 job ``name`` checkpointing every ``interval`` s under a node agent of two
    slots: (store, agent, log folder, checkpoint folder)."""
    url = f"embedded://{tmp_path}/store.db"
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    logs.mkdir()
    store = open_store(url)
    spec = JobSpec(name=name, command=(sys.executable, str(WORKER)), framework="deepspeed",
                   env={"LOG_DIR": str(logs), "ZERO_STAGE": "2", "DS_ACCELERATOR": "cpu",
                        "OMP_NUM_THREADS": "1", "POLLUX_CHECKPOINT_DIR": str(ckpt),
                        "POLLUX_CHECKPOINT_INTERVAL": str(interval)})
    store.put(keys.job(name, "spec"), encode(spec))
    out = open(tmp_path / "workers.log", "w")
    agent = NodeAgent(store, NodeInfo("n1", 2), url, only_jobs={name}, poll=0.2, stdout=out)
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield store, agent, logs, ckpt
    finally:
        stop.set()
        thread.join(timeout=60)
        store.close()
        out.close()


def _finish(store, agent: NodeAgent, name: str, logs: Path) -> None:
    """Stop the job's loop; it must succeed with rank 0 at the end of its loop."""
    (logs / "stop").touch()
    status = _wait(lambda: (kv := store.get(keys.job(name, "status")))
                   and decode(JobStatus, kv.value).finished
                   and decode(JobStatus, kv.value), 180, "the job to finish", agent)
    assert status.state == "succeeded", (status, (logs.parent / "workers.log").read_text()
                                         [-3000:])
    ends = [r for rs in records(logs).values() for r in rs if r["kind"] == "end"]
    assert ends and json.dumps(ends[-1])  # rank 0 finished its loop


def test_every_worker_killed_the_job_resumes_from_its_checkpoint_on_fewer_replicas(tmp_path):
    with _ds_job(tmp_path, "dsck", 0.5) as (store, agent, logs, ckpt):
        store.put(keys.job("dsck", "allocation"), encode(Allocation(1, ("n1", "n1"))))
        _wait(lambda: sum(s["world"] == 2 and s["rank"] == 0 for s in _steps(logs)) >= 40
              and (ckpt / "latest").exists(), 240, "training on two replicas, checkpointed",
              agent)
        before = _steps(logs)
        pids = {s["pid"] for s in before}
        store.put(keys.job("dsck", "allocation"), encode(Allocation(2, ("n1",))))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        saved = latest_checkpoint(ckpt)  # (the newest one written before the kill)
        assert saved is not None and saved.replicas == 2
        _wait(lambda: sum(s["pid"] not in pids for s in _steps(logs)) >= 10, 240,
              "a fresh worker training again", agent)
        after = [s for s in _steps(logs) if s["pid"] not in pids]
        assert {s["world"] for s in after} == {1}
        first = min(after, key=lambda s: s["t"])
        last_before = max(s["steps"] for s in before)
        # resumed: the step count goes on from a checkpoint, not from zero
        assert saved.step <= first["steps"] <= last_before + 40, (first, saved.step)
        assert first["steps"] > 20
        checks = [r for rs in records(logs).values() for r in rs
                  if r["kind"] == "check" and r["pid"] not in pids]
        assert checks and not checks[0]["state_diffs"], checks[:1]  # restored == held
        _finish(store, agent, "dsck", logs)


def test_sigterm_to_every_worker_writes_a_final_checkpoint_of_the_partitions(tmp_path):
    """SIGTERM to both workers of a ZeRO-2 job before any periodic checkpoint: its
    optimizer partitions are spread over the ranks, so they agree at the next vote,
    gather them into one final checkpoint together and end by the signal at the same
    step; their replacements resume from exactly that step with the state it holds."""
    with _ds_job(tmp_path, "dsterm", 1e6) as (store, agent, logs, ckpt):
        store.put(keys.job("dsterm", "allocation"), encode(Allocation(1, ("n1", "n1"))))
        _wait(lambda: sum(s["world"] == 2 and s["rank"] == 0 for s in _steps(logs)) >= 20,
              240, "training on two replicas", agent)
        assert latest_checkpoint(ckpt) is None
        pids = {s["pid"] for s in _steps(logs)}
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        _wait(lambda: sum(s["pid"] not in pids for s in _steps(logs)) >= 5, 240,
              "the replacements training", agent)
        saved = latest_checkpoint(ckpt)
        # both ended inside the same engine.step() (the boundary runs in it): the one after
        # the last they logged, whose state the checkpoint holds
        last = {max(s["steps"] for s in _steps(logs) if s["pid"] == pid) for pid in pids}
        assert saved is not None and last == {saved.step - 1}, (last, saved.step)
        first = min((s for s in _steps(logs) if s["pid"] not in pids), key=lambda s: s["t"])
        assert first["steps"] == saved.step + 1, (first, saved.step)
        checks = [r for rs in records(logs).values() for r in rs
                  if r["kind"] == "check" and r["pid"] not in pids]
        assert checks and not checks[0]["state_diffs"], checks[:1]  # restored == held
        assert sorted(e[2] for e in agent.exits)[:2] == [-signal.SIGTERM] * 2, agent.exits
        _finish(store, agent, "dsterm", logs)

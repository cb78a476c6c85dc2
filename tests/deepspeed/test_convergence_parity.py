"""DeepSpeed convergence parity on digits: the same job with the ``"pollux"`` section
(adaptive batch from 32 up to 256, AdaScale LR, the adapter's statistical epochs) reaches
the fixed-batch run's validation accuracy within one point, for the same number of
statistical epochs, and its batch really grew.

The worker (``parity_worker.py``) is one script for both runs; only its ds_config differs.
The fixed run is a plain one-process DeepSpeed job at a total batch of 32. The pollux run
is a two-replica job started by a real ``NodeAgent`` thread on an embedded store (as in
``test_deepspeed_pollux``; the test writes the allocation, as the coordinator would), so
that ``initialize`` joins the job's rendezvous and returns a PolluxEngine, rank 0's agent
picks the batch, and the loop runs ``engine.epochs(n)``. CPU, gloo, real DeepSpeed.

Two replicas, so that the pollux run also exercises the gradient all-reduce beside the
batch and LR adaptation (one replica grows too: ``test_deepspeed_growth``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from itertools import groupby
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from pollux_launch import keys
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("parity_worker.py")
EPOCHS = 20
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PARITY_EPOCHS": str(EPOCHS)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fixed(tmp_path: Path) -> dict:
    """No "pollux" section: a plain one-process DeepSpeed job at a total batch of 32."""
    out = tmp_path / "fixed"
    env = {**os.environ, **ENV, "PARITY_POLLUX": "0", "PARITY_OUT": str(out), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    env.pop("POLLUX_JOB", None)
    proc = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=WORKER.parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "fixed.json").read_text())


def run_pollux(tmp_path: Path, replicas: int = 2) -> list[dict]:
    """The "pollux" section, ``replicas`` workers under a real node agent; their results
    by rank."""
    url = f"embedded://{tmp_path}/store.db"
    out = tmp_path / "pollux"
    store = open_store(url)
    spec = JobSpec(name="parity", command=(sys.executable, str(WORKER)), framework="deepspeed",
                   env={**ENV, "PARITY_POLLUX": "1", "PARITY_OUT": str(out)})
    store.put(keys.job("parity", "spec"), encode(spec))
    store.put(keys.job("parity", "allocation"), encode(Allocation(1, ("n1",) * replicas)))
    log = open(tmp_path / "worker.log", "w")
    agent = NodeAgent(store, NodeInfo("n1", replicas), url, only_jobs={"parity"}, poll=0.2,
                      stdout=log)
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        status = None
        while time.monotonic() < deadline:
            kv = store.get(keys.job("parity", "status"))
            status = decode(JobStatus, kv.value) if kv is not None else None
            if status is not None and status.finished:
                break
            time.sleep(0.2)
        tail = (tmp_path / "worker.log").read_text()[-3000:]
        assert status is not None and status.finished, f"the job did not finish\n{tail}"
        assert status.state == "succeeded", (status, agent.exits, tail)
    finally:
        stop.set()
        thread.join(timeout=60)
        store.close()
        log.close()
    results = [json.loads(f.read_text()) for f in out.glob("*.json")]
    return sorted(results, key=lambda r: r["rank"])


def test_pollux_section_matches_fixed_batch_accuracy(tmp_path):
    t0 = time.monotonic()
    fixed = run_fixed(tmp_path)
    t_fixed = time.monotonic() - t0
    ranks = run_pollux(tmp_path)
    t_pollux = time.monotonic() - t0 - t_fixed
    adaptive = ranks[0]
    summary = {"fixed_acc": fixed["acc"], "pollux_acc": adaptive["acc"],
               "fixed_steps": len(fixed["batches"]), "pollux_steps": len(adaptive["batches"]),
               "pollux_data_epochs": adaptive["data_epochs"],
               "pollux_batches": [(b, len(list(run))) for b, run in groupby(adaptive["batches"])],
               "fixed_s": round(t_fixed, 1), "pollux_s": round(t_pollux, 1)}
    print(summary)

    # the baseline is plain DeepSpeed at the initial batch and learned the task
    assert fixed["engine"] == "DeepSpeedEngine" and set(fixed["batches"]) == {32}, fixed
    assert fixed["data_epochs"] == EPOCHS and fixed["acc"] > 0.9, fixed

    # the pollux run went through the adapter (PolluxEngine, engine.epochs) on 2 replicas
    # that stayed identical
    assert [(r["engine"], r["rank"], r["world"]) for r in ranks] == [
        ("PolluxEngine", 0, 2), ("PolluxEngine", 1, 2)], ranks
    assert ranks[0]["params"] == ranks[1]["params"], "the replicas diverged"
    assert ranks[0]["batches"] == ranks[1]["batches"]
    batches = adaptive["batches"]
    assert batches[0] == 32, batches[:5]  # it started at initial_batch_size
    # ... and its agent grew it: beyond 2x, and to at least 2x for most of the steps
    assert max(batches) > 2 * 32, summary
    assert sum(b >= 2 * 32 for b in batches) > len(batches) // 2, summary
    # bigger batches: more data epochs and fewer optimizer steps for the same progress
    assert adaptive["data_epochs"] > EPOCHS and len(batches) < len(fixed["batches"]), summary

    # the same validation accuracy within one point
    assert adaptive["acc"] >= fixed["acc"] - 0.01, (summary, adaptive["accs"], fixed["accs"])

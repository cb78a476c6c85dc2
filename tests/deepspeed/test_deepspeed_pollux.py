"""A real DeepSpeed job under a real node agent, rescaled 2 -> 3 -> 2 live (ZeRO-0, ZeRO-2).

Real worker processes (``pollux_worker.py``, a user-style script calling
``pollux_launch.adapters.deepspeed.initialize``) started by a real ``NodeAgent`` thread, an
embedded store, gloo on CPU. The test plays the coordinator: it writes each allocation once
the job has trained a few steps in the previous one, then asks the job to stop. Checked:
survivors keep their PIDs and leavers exit 0; after every rescale all ranks hold identical
parameters and the consolidated engine state (parameters, fp32 master weights, optimizer
state, scheduler, counters) equals the one captured before it; the job succeeds and
reaches the validation target; the rank-0 agent reported throughput and gradient-noise
hints to the store.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from pollux_launch import keys
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import (
    Allocation,
    JobHints,
    JobSpec,
    JobStatus,
    NodeInfo,
    decode,
    encode,
)
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("pollux_worker.py")
STEPS_PER_PHASE = 8


def records(log_dir: Path) -> dict[str, list[dict]]:
    return {f.stem: [json.loads(line) for line in f.read_text().splitlines() if line]
            for f in log_dir.glob("*.jsonl")}


def wait_for(predicate, timeout: float, what: str, agent: NodeAgent):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if any(code != 0 for _, _, code in agent.exits):
            raise AssertionError(f"a worker failed while waiting for {what}: {agent.exits}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def run_job(tmp_path: Path, stage: int) -> tuple[dict[str, list[dict]], NodeAgent, JobHints]:
    url = f"embedded://{tmp_path}/store.db"
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    name = f"ds{stage}"
    store = open_store(url)
    spec = JobSpec(name=name, command=(sys.executable, str(WORKER)), framework="deepspeed",
                   env={"LOG_DIR": str(log_dir), "ZERO_STAGE": str(stage),
                        "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    store.put(keys.job(name, "spec"), encode(spec))
    out = open(tmp_path / "workers.log", "w")
    agent = NodeAgent(store, NodeInfo("n1", 4), url, only_jobs={name}, poll=0.2, stdout=out)
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        def steps_in(world: int, after_round: int = 0) -> int:
            return sum(1 for rs in records(log_dir).values() for r in rs
                       if r["kind"] == "step" and r["world"] == world and r["rank"] == 0
                       and r["round"] > after_round)

        last_round = 0
        for version, replicas in enumerate([2, 3, 2], start=1):
            store.put(keys.job(name, "allocation"),
                      encode(Allocation(version, ("n1",) * replicas)))
            wait_for(lambda r=replicas, a=last_round: steps_in(r, a) >= STEPS_PER_PHASE, 150,
                     f"{STEPS_PER_PHASE} steps on {replicas} replicas", agent)
            last_round = max(r["round"] for rs in records(log_dir).values() for r in rs)
        (log_dir / "stop").touch()
        status = wait_for(lambda: (kv := store.get(keys.job(name, "status")))
                          and decode(JobStatus, kv.value).finished
                          and decode(JobStatus, kv.value), 120, "the job to finish", agent)
        assert status.state == "succeeded", status
        hints_kv = store.get(keys.job(name, "hints"))
        assert hints_kv is not None, "no hints reported"
        hints = decode(JobHints, hints_kv.value)
    finally:
        stop.set()
        thread.join(timeout=60)
        store.close()
        out.close()
    return records(log_dir), agent, hints


@pytest.mark.parametrize("stage", [0, 2])
def test_live_rescale_2_3_2(tmp_path, stage):
    logs, agent, hints = run_job(tmp_path, stage)
    tail = (tmp_path / "workers.log").read_text()[-3000:]

    # the job ran at 2, then 3, then 2 replicas, through three rounds
    rounds = sorted({(r["round"], r["world"]) for rs in logs.values() for r in rs
                     if r["kind"] == "step"})
    assert [w for _, w in rounds] == [2, 3, 2], (rounds, tail)

    # survivors kept their process: one pid per worker across all its rounds
    for worker, rs in logs.items():
        assert len({r["pid"] for r in rs}) == 1, worker
    first = [w for w, rs in logs.items() if rs[0]["kind"] == "start" and rs[0]["round"] == 1]
    assert len(first) == 2
    for w in first:  # both original workers went through every round
        assert {r["world"] for r in logs[w] if r["kind"] == "step"} == {2, 3}, w
    assert len(logs) == 3  # exactly one newcomer
    # every removed worker left cleanly, the finished ones exited 0 too
    assert all(code in (0, -15) for _, _, code in agent.exits), agent.exits
    assert sum(code == 0 for _, _, code in agent.exits) >= 2, agent.exits

    # after each rescale: identical parameters, and the state the rescale started from
    checks = [r for rs in logs.values() for r in rs if r["kind"] == "check"]
    assert sorted((c["world"]) for c in checks) == [2, 2, 3, 3, 3], checks
    for c in checks:
        assert c["zero_stage"] == stage
        assert c["params_identical"], c
        assert c["state_diffs"] == [], c
        assert c["optimizer_tensors"] == 12, c  # Adam: step, exp_avg, exp_avg_sq x 4 params
        assert c["global_steps"] > 0, c
    # a ZeRO-2 newcomer received only its own optimizer partitions, a ZeRO-0 one all
    assert [c["partial"] for c in checks].count(True) == (1 if stage == 2 else 0), checks

    # the job reached its validation target on identical final replicas
    ends = [r for rs in logs.values() for r in rs if r["kind"] == "end"]
    assert len(ends) == 2 and len({e["params"] for e in ends}) == 1, ends
    assert all(e["acc"] >= 0.8 for e in ends), ends
    # the agent's decisions were applied: the LR factor follows the batch size (sqrt rule)
    steps = [r for rs in logs.values() for r in rs if r["kind"] == "step"]
    for r in steps:
        m, gas = r["batch"]
        total = r["world"] * m * gas
        assert r["lr_factor"] == pytest.approx((total / 32) ** 0.5, rel=1e-6), r

    # the rank-0 agent reported its fitted throughput model and gradient noise
    assert hints.perf_params is not None and hints.perf_params["alpha_grad"] >= 0
    assert hints.grad_sqr is not None and hints.grad_sqr > 0
    assert hints.grad_var is not None and hints.grad_var >= 0
    assert hints.max_profiled_replicas == 3
    assert hints.init_batch_size == 32 and hints.local_bsz_bounds == (4, 64)
    assert hints.progress > 0


def test_initialize_handle_needs_an_enabled_section():
    import torch

    from pollux_launch.adapters.deepspeed import PolluxConfigError, initialize_handle

    model = torch.nn.Linear(2, 2)
    with pytest.raises(PolluxConfigError, match='needs a "pollux" section'):
        initialize_handle(model=model, config={"train_batch_size": 8})
    with pytest.raises(PolluxConfigError, match='needs a "pollux" section'):
        initialize_handle(model=model, config={"pollux": {"enabled": False}})

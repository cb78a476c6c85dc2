"""A real job rescaled 1 -> 2 -> 3 -> 2 while training with the native adapter.

Real worker processes started by a real node agent, an embedded store, gloo. The test
plays the coordinator: it writes each new allocation once the job has trained a few
steps in the previous one. Afterwards: every epoch saw each sample exactly once across
all replicas (departed ones included), all final replicas hold bit-identical
parameters, and the surviving workers kept their processes.
"""

import json
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path

from waiting import wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store

WORKER = Path(__file__).with_name("elastic_worker.py")
N = 480


def records(log_dir: Path) -> dict[str, list[dict]]:
    out = {}
    for f in log_dir.glob("*.jsonl"):
        out[f.stem] = [json.loads(line) for line in f.read_text().splitlines() if line]
    return out




def test_rescale_1_2_3_2_exactly_once_and_identical(tmp_path):
    url = f"embedded://{tmp_path}/store.db"
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    store = open_store(url)
    spec = JobSpec(name="el", command=(sys.executable, str(WORKER)),
                   env={"LOG_DIR": str(log_dir), "N": str(N)})
    store.put(keys.job("el", "spec"), encode(spec))
    agent = NodeAgent(store, NodeInfo("n1", 4), url, only_jobs={"el"}, poll=0.2)
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        def steps_in(world: int) -> int:
            return sum(1 for rs in records(log_dir).values() for r in rs
                       if r["kind"] == "step" and r["world"] == world and r["rank"] == 0)

        for version, replicas in enumerate([1, 2, 3, 2], start=1):
            store.put(keys.job("el", "allocation"),
                      encode(Allocation(version, ("n1",) * replicas)))
            wait_for(lambda r=replicas: steps_in(r) >= 8, 120, f"8 steps on {replicas} replicas")
        (log_dir / "stop").touch()

        status = wait_for(lambda: (kv := store.get(keys.job("el", "status")))
                          and decode(JobStatus, kv.value).finished
                          and decode(JobStatus, kv.value), 240, "the job to finish")
        assert status.state == "succeeded", status
    finally:
        stop.set()
        thread.join(timeout=60)
        store.close()

    logs = records(log_dir)
    # every epoch: each sample exactly once across all workers, departed ones included
    seen: dict[int, Counter] = defaultdict(Counter)
    for rs in logs.values():
        for r in rs:
            if r["kind"] == "step":
                seen[r["epoch"]].update(r["indices"])
    assert sorted(seen) == list(range(len(seen)))
    for epoch, counts in seen.items():
        assert set(counts) == set(range(N)), f"epoch {epoch} missed samples"
        assert max(counts.values()) == 1, f"epoch {epoch} saw a sample twice"
    # the job really ran at every size
    worlds = {r["world"] for rs in logs.values() for r in rs if r["kind"] == "step"}
    assert worlds == {1, 2, 3}
    # final replicas: identical parameters
    ends = [r for rs in logs.values() for r in rs if r["kind"] == "end"]
    assert len(ends) == 2 and len({e["params"] for e in ends}) == 1
    # survivors kept their process: one pid per worker log, across all its rounds
    for worker, rs in logs.items():
        assert len({r["pid"] for r in rs}) == 1, worker
    first = next(w for w, rs in logs.items() if rs[0]["round"] == 1)
    assert any(r["kind"] == "end" for r in logs[first]), "the first worker (rank 0) survived"
    # removed workers left cleanly: every exit code is 0
    assert all(code == 0 for _, _, code in agent.exits), agent.exits

"""A real job rescaled 1 -> 2 -> 3 -> 2 while training with the native adapter.

Real worker processes started by a real node agent, an embedded store, gloo. The test
plays the coordinator: it writes each new allocation once the job has trained a few
steps in the previous one. Afterwards: every epoch saw each sample exactly once across
all replicas (departed ones included), all final replicas hold bit-identical
parameters, and the surviving workers kept their processes.
"""

from collections import Counter, defaultdict
from pathlib import Path

from agent_job import agent_job  # tests/adapters/agent_job.py
from waiting import wait_for  # tests/waiting.py

WORKER = Path(__file__).with_name("elastic_worker.py")
N = 480


def test_rescale_1_2_3_2_exactly_once_and_identical(tmp_path):
    with agent_job(tmp_path, "el", WORKER, {"N": str(N)}) as job:
        def steps_in(world: int) -> int:
            return sum(1 for rs in job.records().values() for r in rs
                       if r["kind"] == "step" and r["world"] == world and r["rank"] == 0)

        for replicas in [1, 2, 3, 2]:
            job.allocate(replicas)
            wait_for(lambda r=replicas: steps_in(r) >= 8, 120, f"8 steps on {replicas} replicas")
        (job.log_dir / "stop").touch()
        status = job.finished()
        assert status.state == "succeeded", status
        logs, agent = job.records(), job.agent

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

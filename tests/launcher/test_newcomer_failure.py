"""A live job's worker that fails before it ever joined the job's group - while others
carry the job on - is lost, not the job's failure: its agent starts another after a
back-off that doubles. Without anyone carrying the job, the same failure fails it.
A real node agent, real worker processes, the job's rendezvous keys written as its
running members would have left them."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from waiting import wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
from pollux_launch.rendezvous.rounds import JobKeys, RoundInfo, RoundState, WorkerInfo
from pollux_launch.rendezvous.store import open_store

# a newcomer that dies as it starts (e.g. it could not import its framework)
FAILS = "import sys\nsys.exit(1)\n"


@pytest.fixture
def agent(tmp_path):
    """A store with job j (live, 1-2 replicas) and an agent for node n2, not started."""
    url = f"embedded://{tmp_path / 'store.db'}"
    store = open_store(url)
    (tmp_path / "fails.py").write_text(FAILS)
    node = NodeAgent(store, NodeInfo("n2", 1), url, poll=0.1)
    spec = JobSpec("j", (sys.executable, str(tmp_path / "fails.py")), workdir=str(tmp_path),
                   min_replicas=1, max_replicas=2)
    store.put(keys.job("j", "spec"), encode(spec))
    store.put(keys.job("j", "status"), encode(JobStatus("running")))
    stop = threading.Event()
    thread = threading.Thread(target=node.serve, args=(stop,), daemon=True)
    yield store, node, thread.start
    stop.set()
    thread.join(timeout=30)
    store.close()


def _survivor(store, alive: bool) -> None:
    """Round 1 of job j formed with worker w0 on n1 (alive: its worker key exists), and
    the job grown to a newcomer on n2."""
    k = JobKeys("j")
    store.put(k.round, encode(RoundInfo(1, 1, ("n1",))))
    store.put(k.state(1), encode(RoundState(1, 1, ("w0",), nodes=("n1",))))
    if alive:
        store.put(k.worker("w0"), encode(WorkerInfo("w0", "n1")))
    store.put(keys.job("j", "allocation"), encode(Allocation(2, ("n1", "n2"))))


def _status(store) -> JobStatus:
    return decode(JobStatus, store.get(keys.job("j", "status")).value)


def test_a_newcomer_that_fails_before_joining_is_lost_not_the_jobs_failure(agent):
    store, node, start = agent
    _survivor(store, alive=True)
    start()
    seen: list[float] = []  # when each failed newcomer was reaped
    deadline = time.monotonic() + 60
    while len(seen) < 3 and time.monotonic() < deadline:
        if len(node.exits) > len(seen):
            seen.append(time.monotonic())
        time.sleep(0.02)
    assert len(seen) == 3, node.exits
    assert {code for _, _, code in node.exits} == {1}
    assert _status(store).state == "running"  # the job goes on with w0
    # the agent waited before each next start, twice as long the second time
    assert seen[1] - seen[0] >= 1.5 and seen[2] - seen[1] >= 3.5, seen


def test_without_anyone_carrying_the_job_the_failure_is_the_jobs(agent):
    store, _, start = agent
    _survivor(store, alive=False)  # w0's lease is gone: nobody carries the job
    start()
    wait_for(lambda: _status(store).finished, 60, "the job to fail")
    status = _status(store)
    assert status.state == "failed" and status.exit_code == 1, status

"""A node agent's own view of its workers fences what it runs: never more slot-holding
processes than the node has slots (whatever an allocation says), never an allocation
older than one already seen; and its record tells the coordinator what still runs."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from waiting import wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import Allocation, JobSpec, NodeInfo, decode, encode
from pollux_launch.rendezvous.store import open_store

SLEEPER = "import time\nwhile True: time.sleep(1)\n"




@pytest.fixture
def node(tmp_path):
    """A real store and a real node agent ``n1`` with 2 slots."""
    url = f"embedded://{tmp_path / 'store.db'}"
    store = open_store(url)
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    agent = NodeAgent(store, NodeInfo("n1", 2), url, poll=0.1)
    stop = threading.Event()
    thread = threading.Thread(target=agent.serve, args=(stop,), daemon=True)
    thread.start()

    def submit(name: str) -> None:
        spec = JobSpec(name, (sys.executable, str(script)), workdir=str(tmp_path))
        store.put(keys.job(name, "spec"), encode(spec))

    def allocate(name: str, version: int, replicas: int, term: int = 0) -> None:
        store.put(keys.job(name, "allocation"),
                  encode(Allocation(version, ("n1",) * replicas, term=term)))

    def running(name: str) -> list:
        driver = agent.drivers.get((name, "node"))
        return driver.group.alive() if driver else []

    def reported() -> dict[str, int]:
        kv = store.get(keys.node("n1"))
        return decode(NodeInfo, kv.value).workers if kv else {}

    yield SimpleNamespace(store=store, agent=agent, submit=submit, allocate=allocate,
                          running=running, reported=reported)
    stop.set()
    thread.join(timeout=30)
    store.close()


def test_an_allocation_beyond_the_slots_starts_only_as_many_workers(node):
    node.submit("j")
    node.allocate("j", 1, 6)  # 6 replicas on a 2-slot node
    wait_for(lambda: len(node.running("j")) == 2, 20, "two workers")
    time.sleep(1.0)  # several reconciliations later: still two
    assert len(node.running("j")) == 2
    wait_for(lambda: node.reported() == {"j": 2}, 10, "the record to report them")


def test_a_worker_waits_for_the_slot_a_leaving_worker_still_holds(node):
    node.submit("a")
    node.allocate("a", 1, 2)
    wait_for(lambda: len(node.running("a")) == 2, 20, "a's two workers")
    # the coordinator shrinks a to one replica and gives the other slot to b; a's removed
    # worker has not left yet (a live job's worker leaves at its next step boundary)
    node.allocate("a", 2, 1)
    node.submit("b")
    node.allocate("b", 1, 1)
    time.sleep(1.5)
    assert not node.running("b") and len(node.running("a")) == 2
    assert node.reported() == {"a": 2}
    os.kill(node.running("a")[-1].pid, signal.SIGKILL)  # a's leaving worker is gone
    wait_for(lambda: len(node.running("b")) == 1, 20, "b's worker")
    assert len(node.running("a")) == 1  # a's lost worker is not replaced: a has 1 replica
    wait_for(lambda: node.reported() == {"a": 1, "b": 1}, 10, "the record to follow")


def test_an_older_allocation_is_never_gone_back_to(node):
    node.submit("j")
    node.allocate("j", 4, 1, term=9)
    wait_for(lambda: len(node.running("j")) == 1, 20, "one worker")
    node.allocate("j", 5, 2, term=7)  # a deposed coordinator's (older term) write
    time.sleep(1.5)
    assert len(node.running("j")) == 1
    node.allocate("j", 5, 2, term=9)  # the leader's next decision is carried out
    wait_for(lambda: len(node.running("j")) == 2, 20, "the second worker")

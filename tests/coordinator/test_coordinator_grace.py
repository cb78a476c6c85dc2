"""The coordinator's node grace period and leadership take-over, on a real store."""

from __future__ import annotations

import json

import pytest

from pollux_launch import keys
from pollux_launch.coordinator.service import Coordinator
from pollux_launch.messages import Allocation, JobSpec, NodeInfo, decode, encode
from pollux_launch.policy import make_policy
from pollux_launch.rendezvous.store import open_store


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path):
    with open_store(f"embedded://{tmp_path / 'store.db'}") as s:
        yield s


def _setup(store, clock, grace=30.0) -> Coordinator:
    for name in ("n1", "n2"):
        store.put(keys.node(name), encode(NodeInfo(name, 2, "127.0.0.1")))
    spec = JobSpec("j", ("python",), initial_replicas=4, min_replicas=1, max_replicas=4,
                   submit_time=clock())
    store.put(keys.job("j", "spec"), encode(spec))
    policy = make_policy("pollux-dp", p=-1.0, delta=1.0)
    return Coordinator(store, policy, clock=clock, node_grace=grace)


def _alloc(store) -> tuple[str, ...]:
    kv = store.get(keys.job("j", "allocation"))
    return decode(Allocation, kv.value).nodes if kv else ()


def test_missing_node_keeps_its_replicas_for_the_grace_period(store):
    clock = Clock()
    coord = _setup(store, clock)
    coord.schedule_once()
    assert sorted(_alloc(store)) == ["n1", "n1", "n2", "n2"]
    store.delete(keys.node("n2"))  # its lease lapsed (a store stall, or the agent died)
    for _ in range(3):  # first seen missing, then 9 and 18 s later
        clock.t += 9.0
        assert coord.schedule_once() == {}  # nothing moves within 30 s
    clock.t += 13.0  # 31 s missing: presumed dead
    coord.schedule_once()
    assert _alloc(store) == ("n1", "n1")
    store.put(keys.node("n2"), encode(NodeInfo("n2", 2, "127.0.0.1")))
    clock.t += 1.0
    coord.schedule_once()
    assert sorted(_alloc(store)) == ["n1", "n1", "n2", "n2"]


def test_time_the_coordinator_could_not_read_the_store_does_not_count(store):
    clock = Clock()
    coord = _setup(store, clock)
    coord.schedule_once()
    store.delete(keys.node("n2"))
    clock.t += 20.0
    coord.schedule_once()  # missing since now
    clock.t += 25.0
    coord._store_lost = True  # what serve() records when a store call failed
    coord.schedule_once()  # the clock restarts: 45 s since first seen missing, 0 counted
    clock.t += 25.0
    coord.schedule_once()
    assert sorted(_alloc(store)) == ["n1", "n1", "n2", "n2"]
    clock.t += 6.0
    coord.schedule_once()
    assert _alloc(store) == ("n1", "n1")


def test_restarted_coordinator_does_not_move_jobs_off_unregistered_nodes(store):
    """After a restart, nodes re-register one by one: a job on a node not yet back is
    left where it runs for the grace period."""
    clock = Clock()
    _setup(store, clock).schedule_once()
    store.delete(keys.node("n2"))
    fresh = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), clock=clock,
                        node_grace=30.0)
    assert fresh.schedule_once() == {}
    assert sorted(_alloc(store)) == ["n1", "n1", "n2", "n2"]


def test_leader_value_without_a_lease_is_taken_over(store):
    store.put(keys.LEADER, json.dumps("stale-leader"))  # no lease: it would never vanish
    coord = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), lease_ttl=2.0)
    assert coord._campaign() is False  # deletes the stale value by compare-and-swap
    assert coord._campaign() is True
    assert json.loads(store.get(keys.LEADER).value) == coord.name
    coord._resign()
    assert store.get(keys.LEADER) is None


def test_live_leader_is_not_taken_over(store):
    first = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), lease_ttl=5.0,
                        name="first")
    assert first._campaign()
    second = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), lease_ttl=5.0,
                         name="second")
    assert not second._campaign() and not second._campaign()
    assert json.loads(store.get(keys.LEADER).value) == "first"
    first._resign()

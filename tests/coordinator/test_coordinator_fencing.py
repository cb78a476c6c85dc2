"""The coordinator fences its decisions: by leadership term (a deposed leader writes
nothing; every allocation names the term that wrote it) and by the agents' view of their
own workers (slots still held by leaving workers are not handed to another job)."""

from __future__ import annotations

import pytest

from pollux_launch import keys
from pollux_launch.coordinator.service import Coordinator
from pollux_launch.messages import (
    Allocation,
    JobHints,
    JobSpec,
    JobStatus,
    NodeInfo,
    decode,
    encode,
)
from pollux_launch.policy import make_policy
from pollux_launch.rendezvous.store import Event, open_store


@pytest.fixture
def store(tmp_path):
    with open_store(f"embedded://{tmp_path / 'store.db'}") as s:
        yield s


def _coordinator(store, name: str = "c") -> Coordinator:
    return Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), lease_ttl=5.0,
                       name=name)


def _submit(store, name: str, replicas: int) -> None:
    spec = JobSpec(name, ("python",), initial_replicas=replicas, min_replicas=1,
                   max_replicas=replicas, submit_time=1.0)
    store.put(keys.job(name, "spec"), encode(spec))


def _alloc(store, name: str) -> Allocation | None:
    kv = store.get(keys.job(name, "allocation"))
    return decode(Allocation, kv.value) if kv else None


def test_slots_held_by_leaving_workers_are_not_handed_out(store):
    # n1's agent still runs two workers of a job that finished (they are being stopped)
    store.put(keys.job("old", "status"), encode(JobStatus("succeeded", 0)))
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2, workers={"old": 2})))
    store.put(keys.node("n2"), encode(NodeInfo("n2", 2)))
    _submit(store, "j", 4)
    coord = _coordinator(store)
    coord.schedule_once()
    assert _alloc(store, "j").nodes == ("n2", "n2")
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))  # they exited
    coord.schedule_once()
    assert sorted(_alloc(store, "j").nodes) == ["n1", "n1", "n2", "n2"]


def test_a_jobs_own_allocated_workers_do_not_shrink_the_node(store):
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2, workers={"j": 2})))
    store.put(keys.job("j", "allocation"), encode(Allocation(1, ("n1", "n1"))))
    _submit(store, "j", 2)
    assert _coordinator(store).schedule_once() == {}  # nothing moves
    assert _alloc(store, "j").nodes == ("n1", "n1")


def test_allocations_carry_the_term_and_a_deposed_leader_writes_nothing(store):
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))
    first = _coordinator(store, "first")
    assert first._campaign()
    _submit(store, "a", 1)
    first.schedule_once()
    assert _alloc(store, "a").term == first.term > 0
    # first is deposed (its lease lapsed) and a second leader is elected meanwhile
    store.lease_revoke(first._lease)
    second = _coordinator(store, "second")
    assert second._campaign() and second.term > first.term
    _submit(store, "b", 1)
    assert first.schedule_once() == {} and first._deposed
    assert _alloc(store, "b") is None
    second.schedule_once()
    assert _alloc(store, "b").term == second.term
    second._resign()


def test_workers_starting_do_not_trigger_a_round_but_a_freed_slot_does(store):
    coord = _coordinator(store)
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2, workers={"j": 1})))
    coord.schedule_once()  # n1 known with one worker

    def put(workers: dict[str, int]) -> Event:
        return Event("put", keys.node("n1"), encode(NodeInfo("n1", 2, workers=workers)), 0)

    assert not coord._triggers_round(put({"j": 2}))
    assert coord._triggers_round(put({}))
    assert coord._triggers_round(Event("delete", keys.node("n1"), "", 0))
    assert coord._triggers_round(Event("put", keys.node("n3"),
                                       encode(NodeInfo("n3", 4)), 0))


def test_a_jobs_first_hints_with_a_model_trigger_a_round_once():
    """Until its hints carry a fitted model and gradient statistics a job's speedup is a
    guess: the first such hints are worth a round now, not at the next interval."""
    coord = Coordinator(None, make_policy("pollux-dp", p=-1.0, delta=1.0), lease_ttl=5.0)

    def hints(model: bool) -> Event:
        perf = dict(alpha_grad=0.01, beta_grad=0.001, alpha_local=0.01, beta_local=0.0,
                    alpha_node=0.02, beta_node=0.0, gamma=2.0)
        value = JobHints(32, 256, (4, 64), perf_params=perf if model else None,
                         grad_sqr=1.0 if model else None, grad_var=2.0 if model else None)
        return Event("put", keys.job("j", "hints"), encode(value), 0)

    assert not coord._triggers_round(hints(model=False))
    assert not coord._triggers_round(Event("put", keys.job("j", "hints"), "not json", 0))
    assert coord._triggers_round(hints(model=True))
    assert not coord._triggers_round(hints(model=True))  # only the first

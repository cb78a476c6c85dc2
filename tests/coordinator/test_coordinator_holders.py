"""The coordinator keeps a live job's state: a shrink never removes every worker that
holds it (the members of its latest formed round whose worker key is alive) while an
empty replica stays. The rendezvous keys are written by hand into a real store."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pollux_launch import keys
from pollux_launch.coordinator.service import Coordinator
from pollux_launch.messages import Allocation, JobSpec, NodeInfo, decode, encode
from pollux_launch.policy import POLICIES, make_policy
from pollux_launch.rendezvous.rounds import JobKeys, RoundInfo, RoundState, WorkerInfo
from pollux_launch.rendezvous.store import open_store

NOW = 1000.0


@pytest.fixture
def store(tmp_path):
    with open_store(f"embedded://{tmp_path / 'store.db'}") as s:
        yield s


def job(store, name: str, lo: int, hi: int, np_: int, nodes: tuple[str, ...] = (),
        elasticity: str = "live") -> None:
    store.put(keys.job(name, "spec"), encode(JobSpec(
        name, ("python", "t.py"), initial_replicas=np_, min_replicas=lo, max_replicas=hi,
        submit_time=NOW - 500, elasticity=elasticity)))
    if nodes:
        store.put(keys.job(name, "allocation"), encode(Allocation(3, nodes, NOW - 100)))


def node(store, name: str, slots: int, **workers: int) -> None:
    store.put(keys.node(name), encode(NodeInfo(name, slots, "127.0.0.1", NOW, workers)))


def rdzv(store, name: str, rounds: dict[int, dict[str, str]], alive: dict[str, str]) -> None:
    """Formed rounds (round -> {worker: node} in rank order) and the live workers
    (worker -> node, each key under a lease as a worker keeps it)."""
    k = JobKeys(name)
    last = max(rounds)
    store.put(k.round, encode(RoundInfo(last, 3, ("n1", "n2"), "failure", last - 1,
                                        tuple(rounds.get(last - 1, {})))))
    for r, members in rounds.items():
        store.put(k.state(r), encode(RoundState(r, 3, tuple(members), "127.0.0.1", 29500,
                                                "failure", (), NOW, tuple(members.values()))))
    lease = store.lease_grant(600)
    for w, n in alive.items():
        store.put(k.worker(w), encode(WorkerInfo(w, n, "127.0.0.1", 4242)), lease=lease)


def scheduled(store, policy: str = "pollux-dp") -> dict[str, tuple[str, ...]]:
    Coordinator(store, make_policy(policy, p=-1.0, delta=1.0), clock=lambda: NOW).schedule_once()
    return {n: decode(Allocation, store.get(keys.job(n, "allocation")).value).nodes
            for n in ("blocker", "train") if store.get(keys.job(n, "allocation"))}


def two_nodes(store) -> None:
    """n1 and n2, one slot each; "train" runs on both ([n1, n2], min 1); "blocker" (one
    replica) arrives. Every engine must give each job one node; pollux-dp packs the
    newcomer, first by name, onto n1, so "train" would keep n2."""
    node(store, "n1", 1, train=1)
    node(store, "n2", 1, train=1)
    job(store, "train", 1, 2, 2, ("n1", "n2"))
    job(store, "blocker", 1, 1, 1)


def test_without_holders_the_policy_keeps_the_second_node(store):
    """The premise of the next tests: nothing known of the rounds, pollux-dp keeps "train"
    on n2 and gives n1 to the newcomer."""
    two_nodes(store)
    assert scheduled(store) == {"blocker": ("n1",), "train": ("n2",)}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_shrink_keeps_the_only_holder_not_the_fresh_replica(store, policy, caplog):
    """n2's worker B died and its replacement B2 registered but has not formed a round
    with A (round 5: A alone): A on n1 is the only holder. Every policy's shrink keeps n1."""
    two_nodes(store)
    rdzv(store, "train", {4: {"A": "n1", "B": "n2"}, 5: {"A": "n1"}},
         alive={"A": "n1", "B2": "n2"})
    with caplog.at_level(logging.INFO, "pollux_launch.coordinator.service"):
        got = scheduled(store, policy)
    assert got == {"blocker": ("n2",), "train": ("n1",)}, got
    if policy == "pollux-dp":  # (the others may choose n1 themselves)
        assert "kept a replica where the training state is, instead of one with none, " \
               "for job train (n1)" in caplog.text


def test_both_holders_leave_the_policy_its_choice(store):
    """B2 formed round 6 with A: both hold the state; keeping n2 loses nothing."""
    two_nodes(store)
    rdzv(store, "train", {5: {"A": "n1"}, 6: {"A": "n1", "B2": "n2"}},
         alive={"A": "n1", "B2": "n2"})
    assert scheduled(store) == {"blocker": ("n1",), "train": ("n2",)}


def test_a_dead_holder_holds_nothing(store):
    """A's worker key vanished (its lease lapsed): nobody holds state; nothing to keep."""
    two_nodes(store)
    rdzv(store, "train", {5: {"A": "n1"}}, alive={"B2": "n2"})
    assert scheduled(store) == {"blocker": ("n1",), "train": ("n2",)}


def test_the_latest_formed_round_counts_not_an_older_one(store):
    """Round 9 (A alone, after B left) is the latest formed: an older state naming B2 on
    n2 (a round that B2 was in, then it was presumed dead, re-registered and is waiting)
    does not make it a holder."""
    two_nodes(store)
    rdzv(store, "train", {8: {"A": "n1", "B2": "n2"}, 9: {"A": "n1"}},
         alive={"A": "n1", "B2": "n2"})
    assert scheduled(store)["train"] == ("n1",)


@pytest.mark.parametrize("bad", ["{not json", '{"v": 1, "round": "x"}', "[]",
                                 '{"v": 1, "round": 5, "alloc_version": 3, "members": ["../x"]}'])
def test_a_malformed_round_state_never_stops_scheduling(store, bad, caplog):
    """A state that does not decode is logged once and ignored: the job is scheduled as
    if it had no rounds (the policy's choice stands)."""
    two_nodes(store)
    rdzv(store, "train", {5: {"A": "n1"}}, alive={"A": "n1", "B2": "n2"})
    store.put(JobKeys("train").state(5), bad)
    store.put(keys.job("train", "rdzv/rounds/junk/state"), "{}")  # not a round number
    store.put(keys.job("train", "rdzv/rounds/0000000x/state"), "{}")
    coord = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), clock=lambda: NOW)
    with caplog.at_level(logging.WARNING, "pollux_launch.coordinator.service"):
        coord.schedule_once()
        coord.schedule_once()
    assert caplog.text.count("ignoring malformed jobs/train/rdzv/rounds/00000005/state") == 1
    got = decode(Allocation, store.get(keys.job("train", "allocation")).value).nodes
    assert got == ("n2",)


def test_no_slot_for_the_holder_is_said_and_capacity_holds(store, caplog):
    """The holder's node n1 shrank to one slot (e.g. --host-discovery-script), held by a
    fixed job that ran there already: "train" cannot keep A there. Nothing exceeds a
    node's slots, and the coordinator says that the job's state is lost."""
    node(store, "n1", 1, train=1, old=1)
    node(store, "n2", 1, train=1)
    job(store, "old", 1, 1, 1, ("n1",), elasticity="fixed")
    job(store, "train", 1, 2, 2, ("n1", "n2"))
    rdzv(store, "train", {5: {"A": "n1"}}, alive={"A": "n1", "B2": "n2"})
    with caplog.at_level(logging.WARNING, "pollux_launch.coordinator.service"):
        Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0),
                    clock=lambda: NOW).schedule_once()
    got = {n: decode(Allocation, store.get(keys.job(n, "allocation")).value).nodes
           for n in ("old", "train")}
    assert got == {"old": ("n1",), "train": ("n2",)}
    assert "job train: its new allocation (n2) leaves no slot to the workers holding its " \
           "training state" in caplog.text


def test_restart_elastic_and_fixed_jobs_are_untouched(store):
    """Jobs without rounds: the policy's choice, whatever it is, stands."""
    node(store, "n1", 1, train=1)
    node(store, "n2", 1, train=1)
    job(store, "train", 1, 2, 2, ("n1", "n2"), elasticity="restart")
    job(store, "blocker", 1, 1, 1, elasticity="fixed")
    assert scheduled(store) == {"blocker": ("n1",), "train": ("n2",)}


def test_holders_read_once_per_round_state(store, monkeypatch):
    """The holders come from the round's one read of jobs/ (no store call per job), and a
    state is decoded once per revision, not every round."""
    two_nodes(store)
    rdzv(store, "train", {5: {"A": "n1"}}, alive={"A": "n1", "B2": "n2"})
    coord = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), clock=lambda: NOW)
    calls: list[str] = []
    for name in ("get", "get_prefix"):
        real = getattr(store, name)
        monkeypatch.setattr(store, name, lambda key, real=real, name=name: (
            calls.append(f"{name} {key}"), real(key))[1])
    decoded: list[str] = []
    real_read = coord.values.read
    monkeypatch.setattr(coord.values, "read", lambda cls, *a: (
        decoded.append(cls.__name__), real_read(cls, *a))[1])
    coord.schedule_once()
    coord.schedule_once()
    # (and drains/: the nodes an operator drains, an empty range read in most rounds)
    assert sorted(set(calls)) == ["get_prefix drains/", "get_prefix jobs/",
                                  "get_prefix nodes/"], calls
    assert decoded.count("RoundState") == 1
    assert np.array_equal(decoded.count("WorkerInfo"), 0)  # nodes come from the state


def test_a_state_without_nodes_takes_them_from_the_workers_records(store, caplog):
    """A RoundState written without ``nodes`` (an older worker): each live member's own
    WorkerInfo says where it runs; a malformed one is logged and that member counts for
    nothing (no holders known: the policy's choice stands)."""
    two_nodes(store)
    k = JobKeys("train")
    rdzv(store, "train", {5: {"A": "n1"}}, alive={"A": "n1", "B2": "n2"})
    store.put(k.state(5), encode(RoundState(5, 3, ("A",), "127.0.0.1", 29500, "failure")))
    assert scheduled(store)["train"] == ("n1",)

    two_nodes(store)  # again, from the same start
    store.delete(keys.job("train", "rdzv/"), prefix=True)
    store.delete(keys.job("blocker", "allocation"))
    rdzv(store, "train", {5: {"A": "n1"}}, alive={"A": "n1", "B2": "n2"})
    store.put(k.state(5), encode(RoundState(5, 3, ("A",), "127.0.0.1", 29500, "failure")))
    lease = store.lease_grant(600)
    store.put(k.worker("A"), '{"v": 1, "worker": "A", "node": "../n1"}', lease=lease)
    with caplog.at_level(logging.WARNING, "pollux_launch.coordinator.service"):
        assert scheduled(store)["train"] == ("n2",)
    assert "ignoring malformed jobs/train/rdzv/workers/A" in caplog.text

"""The pure rank-assignment rule and the key schema."""

from __future__ import annotations

import pytest

from pollux_launch.messages import MessageError, decode, encode
from pollux_launch.rendezvous.rounds import JobKeys, RoundInfo, RoundState, plan_round


def info(nodes, prev=(), reason="allocation"):
    return RoundInfo(round=5, alloc_version=3, nodes=tuple(nodes), reason=reason,
                     prev_round=4 if prev else 0, prev_members=tuple(prev))


def test_survivors_keep_their_order_and_newcomers_follow_in_join_order():
    joined = [("new-b", "n1", 20), ("w2", "n1", 11), ("new-a", "n1", 15), ("w0", "n1", 12)]
    plan = plan_round(info(["n1"] * 4, prev=("w0", "w1", "w2")), joined, {})
    # w1 is dead (neither joined nor alive): survivors w0, w2 first, then newcomers
    assert plan.ranked == ("w0", "w2", "new-a", "new-b")
    assert plan.ready and plan.closer == "w0"


def test_shrink_keeps_the_lowest_old_ranks_without_waiting_for_the_others():
    prev = ("w0", "w1", "w2", "w3")
    alive = dict.fromkeys(prev, "n1")
    plan = plan_round(info(["n1"] * 2, prev), [("w1", "n1", 9), ("w0", "n1", 10)], alive)
    assert plan.ranked == ("w0", "w1") and plan.ready
    # w0 (old rank 0) is alive but has not joined yet: the round waits for it
    plan = plan_round(info(["n1"] * 2, prev), [("w1", "n1", 9), ("w3", "n1", 8)], alive)
    assert plan.ranked == ("w0", "w1") and not plan.ready


def test_node_slots_decide_who_stays():
    joined = [("a0", "a", 1), ("a1", "a", 2), ("b0", "b", 3)]
    plan = plan_round(info(["b", "a"], prev=("a0", "a1", "b0")), joined, {})
    assert plan.ranked == ("a0", "b0") and plan.ready
    assert plan_round(info(["c"]), joined, {}).ranked == ()  # nobody on the allocated node


def test_allocation_round_waits_to_fill_but_failure_round_does_not():
    joined = [("w0", "n1", 1), ("w2", "n1", 2)]
    alive = {"w0": "n1", "w2": "n1", "w1": "n1"}
    # w1's lease is still live: both kinds of round wait for it
    assert not plan_round(info(["n1"] * 3, ("w0", "w1", "w2"), "failure"), joined, alive).ready
    del alive["w1"]  # its lease expired
    assert plan_round(info(["n1"] * 3, ("w0", "w1", "w2"), "failure"), joined, alive).ready
    assert not plan_round(info(["n1"] * 3, ("w0", "w1", "w2")), joined, alive).ready


def test_rank_order_is_deterministic_whatever_the_input_order():
    joined = [(f"w{i}", "n1", 100 - i) for i in range(6)]
    a = plan_round(info(["n1"] * 4, ("w4", "w1")), joined, {})
    b = plan_round(info(["n1"] * 4, ("w4", "w1")), list(reversed(joined)), {})
    assert a == b and a.ranked == ("w4", "w1", "w5", "w3")


def test_messages_round_trip_and_reject_malformed():
    state = RoundState(3, 2, ("w0", "w1"), "127.0.0.1", 4242, "failure", ("w1",), 1.5)
    assert decode(RoundState, encode(state)) == state
    with pytest.raises(MessageError):
        decode(RoundState, '{"v":1,"round":"3"}')


def test_key_schema_and_bad_names():
    k = JobKeys("job-1")
    assert k.allocation == "jobs/job-1/allocation"
    assert k.member(7, "w0") == "jobs/job-1/rdzv/rounds/00000007/members/w0"
    assert k.state(7).startswith(k.round_prefix(7)) and k.worker("w0").startswith(k.workers)
    for bad in ("", "a/b", "x" * 200, "spa ce"):
        with pytest.raises(ValueError, match="job name"):
            JobKeys(bad)

"""Every value read from the store is untrusted input: hostile values in every key family
never crash, loop or block the coordinator or a node agent, are logged once per key and
revision, and leave the healthy jobs scheduled and running."""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
import time

import pytest
from hostile import HOSTILE
from hypothesis import given, settings
from hypothesis import strategies as st

from pollux_launch import keys
from pollux_launch.coordinator.service import Coordinator
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.messages import (
    Allocation,
    JobHints,
    JobRestarts,
    JobSpec,
    JobStatus,
    MessageError,
    NodeInfo,
    TaskExit,
    WorkerTask,
    decode,
    encode,
)
from pollux_launch.policy import make_policy
from pollux_launch.rendezvous.rounds import Member, RoundInfo, RoundState, WorkerInfo
from pollux_launch.rendezvous.store import open_store

MESSAGES = [JobSpec, JobHints, Allocation, NodeInfo, WorkerTask, TaskExit, JobRestarts,
            JobStatus, RoundInfo, RoundState, WorkerInfo, Member]
@pytest.fixture
def store(tmp_path):
    with open_store(f"embedded://{tmp_path / 'store.db'}") as s:
        yield s


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200),
                 st.recursive(st.none() | st.booleans() | st.floats() | st.integers()
                              | st.text(max_size=20),
                              lambda c: st.lists(c, max_size=4)
                              | st.dictionaries(st.text(max_size=12), c, max_size=6),
                              max_leaves=30).map(json.dumps)),
       st.sampled_from(MESSAGES))
def test_decode_raises_only_message_error(raw, cls):
    try:
        decode(cls, raw)
    except MessageError:
        pass


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", "{\"v\":1,\"code\":\udcff}", "[" * 10**6,
                                 '{"v":1,"code":1e400}', '{"v":1,"code":Infinity}',
                                 '{"v":1,"code":' + "1" * 5000 + "}"])
def test_decode_refuses_what_json_alone_lets_through(raw):
    with pytest.raises(MessageError):
        decode(TaskExit, raw)


def _healthy(store) -> None:
    store.put(keys.node("n1"), encode(NodeInfo("n1", 8)))
    store.put(keys.job("ok", "spec"), encode(JobSpec("ok", ("python",), initial_replicas=2,
                                                     max_replicas=2)))


def _hostile(store) -> None:
    for key, value in HOSTILE:
        store.put(key, value)


def _bad_lines(caplog) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in caplog.records:
        if "ignoring malformed" in rec.getMessage():
            key = rec.getMessage().split("ignoring malformed ", 1)[1].split(" ", 1)[0]
            out[key] = out.get(key, 0) + 1
    return out


def test_the_coordinator_schedules_on_among_hostile_values(store, caplog):
    _healthy(store)
    _hostile(store)
    coord = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0))
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        coord.schedule_once()
    alloc = decode(Allocation, store.get(keys.job("ok", "allocation")).value)
    assert alloc.nodes == ("n1", "n1")  # only the real node
    placed = [decode(Allocation, kv.value).nodes for kv in store.get_prefix(keys.JOBS)
              if kv.key.endswith("/allocation") and kv.key != "jobs/h5/allocation"]
    assert sum(len(p) for p in placed) <= 8  # never beyond its slots
    said = _bad_lines(caplog)
    expected = {k for k, _ in HOSTILE if k.startswith(("nodes/", "jobs/"))
                and not k.endswith(("h1/spec", "h2/spec", "h3/spec", "h4/spec", "h5/spec"))}
    assert set(said) == expected, set(said) ^ expected
    assert all(n == 1 for n in said.values()), said  # once per key and revision
    store.put("nodes/neg", '{"v":1,"name":"neg","slots":-5}')  # a new revision: said again
    coord.schedule_once()
    assert _bad_lines(caplog)["nodes/neg"] == 2


def test_a_node_agent_runs_its_jobs_among_hostile_values(store, tmp_path, caplog):
    _healthy(store)
    _hostile(store)
    store.put(keys.job("ok", "spec"), encode(JobSpec(
        "ok", (sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')"),
        workdir=str(tmp_path))))
    store.put(keys.job("ok", "allocation"), encode(Allocation(1, ("n1",))))
    agent = NodeAgent(store, NodeInfo("n1", 2), f"embedded://{tmp_path / 'store.db'}")
    caplog.set_level(logging.WARNING)
    try:
        deadline = time.monotonic() + 60  # (its quick worker may be reaped at any pass)
        while not (tmp_path / "ran").exists() and time.monotonic() < deadline:
            agent.step()
            time.sleep(0.05)
    finally:
        agent.drain()
    assert (tmp_path / "ran").exists()
    said = _bad_lines(caplog)
    assert said and all(n == 1 for n in said.values()), said
    assert ("victim", "node") not in agent.drivers and ("other", "node") not in agent.drivers


def test_bytes_that_are_not_utf8_in_the_embedded_store_are_refused_not_fatal(store, tmp_path):
    _healthy(store)
    with sqlite3.connect(tmp_path / "store.db") as conn:  # written by other means
        conn.execute("UPDATE kv SET value = CAST(? AS TEXT) WHERE key = ?",
                     (b'{"v":1,"name":"n1","slots":\xff}', "/pollux/" + keys.node("n1")))
    coord = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0))
    assert coord.schedule_once() == {}  # no usable node: nothing placed, nothing raised

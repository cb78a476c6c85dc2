"""Malformed store values met by the launcher side: never fatal, never silent."""

from __future__ import annotations

import logging

import pytest

from pollux_launch import keys
from pollux_launch.launcher.drivers import DriverContext, ReplicaDriver, replica_limit
from pollux_launch.launcher.status import render
from pollux_launch.messages import Allocation, JobSpec, NodeInfo, encode
from pollux_launch.rendezvous.store import open_store


@pytest.fixture
def store(tmp_path):
    with open_store(f"embedded://{tmp_path / 'store.db'}") as store:
        yield store


def test_a_malformed_master_record_falls_back_to_this_node_and_is_said_once(store, caplog):
    me = NodeInfo("n2", 2, "10.0.0.2")
    store.put(keys.node("n1"), '{"v": 1, "name": "n1", "slots": "many"}')
    ctx = DriverContext(store, "embedded://", "/pollux", me)
    driver = ReplicaDriver(JobSpec("j", ("python",)), ctx)
    alloc = Allocation(3, ("n1", "n2"))
    with caplog.at_level(logging.WARNING):
        envs = [driver._torch_env(alloc, 0) for _ in range(3)]
    assert all(env["MASTER_ADDR"] == "10.0.0.2" and env["RANK"] == "1" for env in envs)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("ignoring malformed nodes/n1"), said
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2, "10.0.0.1")))
    assert driver._torch_env(alloc, 0)["MASTER_ADDR"] == "10.0.0.1"


def test_status_names_the_values_it_could_not_read(store):
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))
    store.put(keys.job("j", "spec"), encode(JobSpec("j", ("python",))))
    store.put(keys.job("j", "allocation"), '{"v": 1, "version": "x"}')
    text = render(store, now=0.0)
    assert text.splitlines()[-1] == "ignored 1 malformed store value(s): jobs/j/allocation"
    store.put(keys.job("j", "allocation"), encode(Allocation(1, ("n1",))))
    assert "malformed" not in render(store, now=0.0)


def test_replica_limit():
    assert replica_limit(JobSpec("j", ("python",))) is None  # no --max-np
    assert replica_limit(JobSpec("j", ("python",), initial_replicas=2, max_replicas=4)) == 4


def test_status_shows_what_a_jobs_policies_ask_for(store):
    from pollux_launch.messages import JobHints

    store.put(keys.job("j", "spec"), encode(JobSpec("j", ("python",))))
    hints = dict(init_batch_size=8, max_batch_size=8, local_bsz_bounds=(8, 8))
    store.put(keys.job("j", "hints"), encode(JobHints(**hints, min_replicas_wanted=2)))
    assert "j wants 2 or more replicas" in render(store, now=0.0)
    store.put(keys.job("j", "hints"), encode(JobHints(**hints, min_replicas_wanted=2,
                                                      max_replicas_wanted=2)))
    assert "j wants 2 replicas" in render(store, now=0.0)
    store.put(keys.job("j", "hints"), encode(JobHints(**hints)))
    assert "wants" not in render(store, now=0.0)

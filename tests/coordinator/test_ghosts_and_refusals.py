"""A job's keys are written only while the job exists, and a job is listed only while it
has a spec (no "ghost" job after its launcher removed it); a spec that no reader accepts
fails its job with the reason, so that its launcher says so and exits. On a real etcd."""

from __future__ import annotations

import io
import threading

import pytest

from pollux_launch import keys
from pollux_launch.coordinator.service import Coordinator
from pollux_launch.launcher.node_agent import NodeAgent
from pollux_launch.launcher.options import parse_launch_args
from pollux_launch.launcher.run import _follow, cancel_job
from pollux_launch.launcher.status import render
from pollux_launch.messages import Allocation, JobSpec, JobStatus, NodeInfo, decode, encode
from pollux_launch.policy import make_policy
from pollux_launch.rendezvous.store import open_store


@pytest.fixture
def store(etcd_server, store_prefix):
    with open_store(etcd_server.url, store_prefix, timeout=10) as s:
        yield s


def _job(store, name: str, state: str = "pending", alloc: Allocation | None = None,
         **spec) -> None:
    store.put(keys.job(name, "spec"), encode(JobSpec(name, ("python", "t.py"),
                                                     submit_time=1000.0, **spec)))
    store.put(keys.job(name, "status"), encode(JobStatus(state, 0 if state == "succeeded"
                                                         else None)))
    if alloc is not None:
        store.put(keys.job(name, "allocation"), encode(alloc))


def _listed(text: str) -> set[str]:
    """The job names in the status text's job table."""
    table = text[text.index("\nJOB ") + 1:].split("\n\n")[0].splitlines()[1:]
    return {line.split()[0] for line in table if line.strip()}


def test_a_job_removed_while_the_coordinator_gives_its_slots_back_leaves_no_key(store):
    """The race of two local launchers exiting together: the leader reads job "done" as
    finished, then its launcher deletes jobs/done/, then the leader writes the allocation
    that gives its slots back. That write - in one transaction with another job's - must
    not bring jobs/done/ back; the other job's is written, and the leader stays leader."""
    store.put(keys.node("n1"), encode(NodeInfo("n1", 4)))
    _job(store, "done", "succeeded", Allocation(3, ("n1", "n1")))
    _job(store, "next", max_replicas=2, initial_replicas=1)
    coord = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0), lease_ttl=10.0,
                        clock=lambda: 1000.0, name="leader")
    assert coord._campaign()  # (its writes are guarded by leadership too)
    read = coord._read_jobs

    def read_then_the_launcher_exits():
        jobs = read()
        assert jobs["done"].status.finished and jobs["done"].allocation.nodes
        store.delete(keys.job("done"), prefix=True)  # (run.launch's finally)
        return jobs

    coord._read_jobs = read_then_the_launcher_exits
    try:
        writes = coord.schedule_once()
    finally:
        coord._resign()
    assert "done" not in writes and writes["next"].num_replicas >= 1
    assert store.get_prefix(keys.job("done")) == []
    assert decode(Allocation, store.get(keys.job("next", "allocation")).value).nodes
    assert not coord._deposed and coord.rounds == 1
    assert _listed(render(store, now=1000.0)) == {"next"}


def test_status_lists_no_job_without_a_spec_and_removes_nothing(store):
    """Keys left of a removed job are no job: status does not list them (and, read-only,
    leaves them); a job whose spec is malformed still has one, and is listed."""
    _job(store, "real")
    store.put(keys.job("ghost", "allocation"), encode(Allocation(4, ())))
    store.put(keys.job("ghost", "status"), encode(JobStatus("succeeded", 0)))
    store.put(keys.job("broken", "spec"), '{"v": 1, "name": "broken"}')
    text = render(store)
    assert _listed(text) == {"real", "broken"}
    assert len(store.get_prefix(keys.job("ghost"))) == 2


def test_the_services_write_nothing_for_a_job_that_is_gone(store, etcd_server, store_prefix):
    """A node agent's status report, a launcher's cancel and the coordinator's status
    write for a job whose keys were removed create no key of it."""
    agent = NodeAgent(store, NodeInfo("n1", 1), etcd_server.url, store_prefix, poll=0.1)
    agent._set_status("gone", JobStatus("succeeded", 0))
    cancel_job(store, "gone", "pollux-run got signal 2")
    coord = Coordinator(store, make_policy("pollux-dp"))
    _job(store, "gone")
    view = coord._read_jobs()["gone"]
    store.delete(keys.job("gone"), prefix=True)
    assert not coord._set_status("gone", view, JobStatus("queued", None, "waiting"))
    assert store.get_prefix(keys.job("gone")) == []
    _job(store, "here")  # (and write for one that exists)
    agent._set_status("here", JobStatus("running"))
    assert decode(JobStatus, store.get(keys.job("here", "status")).value).state == "running"


def test_a_spec_the_coordinator_refuses_ends_its_launcher_with_the_reason(store):
    """A spec that the old command line let through but no reader accepts (a restart
    grace above JobSpec's bound): the coordinator, serving, fails the job with the reason
    instead of ignoring it, and the launcher following it prints that in one line and
    exits 1 - not "waiting for free slots" forever."""
    store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))
    _job(store, "slow-stop", elasticity="restart", max_replicas=2, stop_grace=4000.0)
    coord = Coordinator(store, make_policy("pollux-dp"), interval=0.5, lease_ttl=3.0,
                        settle=0.05, name="c")
    stop = threading.Event()
    thread = threading.Thread(target=coord.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        opts = parse_launch_args(["--job-name", "slow-stop", "-np", "1", "--max-np", "2",
                                  "--elasticity", "restart", "python", "t.py"])
        out = io.StringIO()
        assert _follow(store, "slow-stop", opts, out) == 1
    finally:
        stop.set()
        thread.join(timeout=30)
    last = out.getvalue().strip().splitlines()[-1]
    assert last == ("[pollux] slow-stop: failed, exit code 1 (the coordinator refused its "
                    "spec: JobSpec.stop_grace: 4000.0 is outside [0, 3600])")
    assert store.get(keys.job("slow-stop", "allocation")) is None  # never placed
    status = decode(JobStatus, store.get(keys.job("slow-stop", "status")).value)
    assert status.finished and _listed(render(store)) == {"slow-stop"}


def test_a_completion_waits_for_a_spec_a_wiped_store_gets_back(store, etcd_server,
                                                             store_prefix, monkeypatch):
    """A worker completes while its job's spec is absent - the store was wiped and the
    launcher has not submitted it again yet: its completion is kept and recorded once the
    spec is back; for a job that stays gone it is dropped after the grace, writing nothing."""
    from pollux_launch.launcher import node_agent
    from pollux_launch.launcher.drivers import ProcessExit

    agent = NodeAgent(store, NodeInfo("n1", 1), etcd_server.url, store_prefix, poll=0.1)
    agent._unreported.append(("back", "node", None, ProcessExit("w1", 0, "finished")))
    agent._reap()
    assert store.get_prefix(keys.job("back")) == [] and len(agent._unreported) == 1
    _job(store, "back", "running", Allocation(1, ("n1",)))  # the launcher's resubmission
    agent._reap()
    assert store.get(keys.job_finished("back", "w1")) is not None and not agent._unreported

    monkeypatch.setattr(node_agent, "ABSENT_GRACE", 0.0)
    agent._unreported.append(("gone", "node", None, ProcessExit("w2", 0, "finished")))
    agent._reap()
    assert not agent._unreported and store.get_prefix(keys.job("gone")) == []

"""Admission control: the pure decision, and the coordinator applying it on a real store
(queued and rejected jobs, their statuses and reasons, what status shows, and the
launcher's one line and exit code for a rejected job)."""

from __future__ import annotations

import io

import pytest

from pollux_launch import keys
from pollux_launch.coordinator.service import Coordinator
from pollux_launch.launcher.options import parse_launch_args
from pollux_launch.launcher.run import _follow
from pollux_launch.launcher.status import render
from pollux_launch.messages import (
    REJECTED_EXIT,
    Allocation,
    JobSpec,
    JobStatus,
    NodeInfo,
    decode,
    encode,
)
from pollux_launch.policy import make_policy
from pollux_launch.policy.admission import (
    AdmissionConfig,
    Candidate,
    decide_admission,
)
from pollux_launch.rendezvous.store import open_store


def test_queue_admits_in_arrival_order_while_everyone_fits():
    cfg = AdmissionConfig("queue")
    waiting = [Candidate("c", 3.0), Candidate("a", 1.0, 2), Candidate("b", 2.0)]
    got = decide_admission(cfg, waiting, [Candidate("old", 0.0)], capacity=4, now=10.0)
    assert got.admit == ("a", "b") and got.wait == ("c",) and got.drop == ()
    # a small job does not overtake a big one that waits
    got = decide_admission(cfg, [Candidate("big", 1.0, 4), Candidate("small", 2.0)],
                           [Candidate("old", 0.0)], capacity=4, now=10.0)
    assert got.admit == () and got.wait == ("big", "small")


def test_drop_rejects_at_once_and_max_wait_and_max_running_bound_the_queue():
    got = decide_admission(AdmissionConfig("drop"), [Candidate("a", 1.0), Candidate("b", 2.0)],
                           [Candidate("x", 0.0)], capacity=2, now=2.0)
    assert got.admit == ("a",) and [n for n, _ in got.drop] == ["b"]
    assert "needs 1 GPU(s) and the running jobs need 2 of 2" in got.drop[0][1]
    got = decide_admission(AdmissionConfig("queue", max_wait=60.0),
                           [Candidate("a", 0.0), Candidate("b", 50.0)], [Candidate("x", 0)],
                           capacity=1, now=70.0)
    assert [n for n, _ in got.drop] == ["a"] and got.wait == ("b",)
    assert "--max-wait 60 s" in got.drop[0][1]
    got = decide_admission(AdmissionConfig("queue", max_running=1), [Candidate("a", 1.0)],
                           [Candidate("x", 0.0)], capacity=8, now=2.0)
    assert got.wait == ("a",)
    everyone = decide_admission(AdmissionConfig(), [Candidate("a", 1.0)] * 1,
                                [Candidate("x", 0.0, 9)], capacity=1, now=0.0)
    assert everyone.admit == ("a",)  # none: Pollux's, everyone competes


@pytest.mark.parametrize("bad", [dict(mode="maybe"), dict(mode="none", max_wait=5.0),
                                 dict(mode="drop", max_wait=5.0),
                                 dict(mode="queue", max_running=0)])
def test_bad_admission_settings_are_one_line(bad):
    with pytest.raises(ValueError) as info:
        AdmissionConfig(**bad)
    assert "\n" not in str(info.value)


def test_the_admission_flags_are_checked_where_they_are_read():
    from pollux_launch.arguments import (
        OneLineParser,
        OptionsError,
        add_admission_arguments,
        admission_from_args,
    )

    p = OneLineParser(prog="pollux-run coordinator")
    add_admission_arguments(p)
    ns = p.parse_args(["--admission", "queue", "--max-wait", "30", "--max-running", "4"])
    assert admission_from_args(ns) == AdmissionConfig("queue", 30.0, 4)
    with pytest.raises(OptionsError, match="need --admission queue or drop"):
        admission_from_args(p.parse_args(["--max-running", "4"]))
    with pytest.raises(OptionsError):
        p.parse_args(["--admission", "sometimes"])


def _submit(store, name: str, t: float, np_: int = 1) -> None:
    spec = JobSpec(name=name, command=("python", "t.py"), initial_replicas=np_,
                   min_replicas=np_, max_replicas=np_, submit_time=t, elasticity="fixed")
    store.put(keys.job(name, "spec"), encode(spec))
    store.put(keys.job(name, "status"), encode(JobStatus("pending")))


def _status(store, name: str) -> JobStatus:
    return decode(JobStatus, store.get(keys.job(name, "status")).value)


@pytest.mark.parametrize("mode", ["queue", "drop"])
def test_the_coordinator_queues_or_rejects_what_does_not_fit(tmp_path, mode):
    clock = [1000.0]
    with open_store(f"embedded://{tmp_path}/store.db") as store:
        store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))
        for i, name in enumerate(["a", "b", "c"]):
            _submit(store, name, 900.0 + i)
        coord = Coordinator(store, make_policy("pollux-dp"), clock=lambda: clock[0],
                            admission=AdmissionConfig(mode, max_wait=200.0 if mode == "queue"
                                                      else None))
        writes = coord.schedule_once()
        assert sorted(writes) == ["a", "b"] and all(w.num_replicas == 1 for w in writes.values())
        c = _status(store, "c")
        if mode == "drop":
            assert c.state == "rejected" and c.exit_code == REJECTED_EXIT and c.finished
            assert "cannot take it now" in c.message
        else:
            assert c.state == "queued" and "waiting for admission" in c.message
        assert f"c {c.state}: " in render(store, now=clock[0])
        if mode == "queue":
            # a job ends: the queued one is admitted and placed, and back to pending
            store.put(keys.job("a", "status"), encode(JobStatus("succeeded", 0)))
            writes = coord.schedule_once()
            assert writes["c"].num_replicas == 1 and _status(store, "c").state == "pending"
            _submit(store, "d", 950.0)
            coord.schedule_once()
            assert _status(store, "d").state == "queued"
            clock[0] = 1200.0  # past --max-wait since its arrival
            coord.schedule_once()
            d = _status(store, "d")
            assert d.state == "rejected" and "--max-wait 200 s" in d.message
        else:  # the rejected job's launcher ends at once, with its one line and code
            out = io.StringIO()
            opts = parse_launch_args(["--job-name", "c", "-np", "1", "python", "t.py"])
            assert _follow(store, "c", opts, out, None) == REJECTED_EXIT
            assert out.getvalue().strip().endswith(f"c: rejected: {c.message}")


def test_an_admitted_job_that_the_policy_gives_nothing_yet_stays_admitted(tmp_path):
    """Admission is recorded by an allocation (empty if need be): a running job that a
    later round shrinks to nothing is never rejected as if it were new."""
    with open_store(f"embedded://{tmp_path}/store.db") as store:
        store.put(keys.node("n1"), encode(NodeInfo("n1", 1)))
        _submit(store, "a", 900.0)
        store.put(keys.job("a", "allocation"), encode(Allocation(3, ())))  # admitted earlier
        _submit(store, "b", 901.0)
        coord = Coordinator(store, make_policy("pollux-dp"), admission=AdmissionConfig("drop"))
        coord.schedule_once()
        assert _status(store, "a").state == "pending"  # not rejected: it was admitted
        assert _status(store, "b").state == "rejected"


def test_saxena_dp_in_the_coordinator_gives_every_admitted_job_a_gpu(tmp_path):
    """The coordinator builds each job's throughput function from its hints (within its
    batch-size range) for saxena-dp; with queueing, every admitted job runs."""
    from pollux_launch.messages import JobHints

    perf = dict(alpha_grad=0.01, beta_grad=0.001, alpha_local=0.01, beta_local=0.001,
                alpha_node=0.02, beta_node=0.001, gamma=1.5)
    with open_store(f"embedded://{tmp_path}/store.db") as store:
        store.put(keys.node("n1"), encode(NodeInfo("n1", 4)))
        for i, name in enumerate(["a", "b", "c", "d", "e"]):
            spec = JobSpec(name=name, command=("python", "t.py"), initial_replicas=1,
                           min_replicas=1, max_replicas=4, submit_time=900.0 + i)
            store.put(keys.job(name, "spec"), encode(spec))
            store.put(keys.job(name, "status"), encode(JobStatus("pending")))
            store.put(keys.job(name, "hints"), encode(JobHints(
                init_batch_size=32, max_batch_size=512, min_batch_size=64,
                local_bsz_bounds=(8, 128), perf_params=perf, grad_sqr=1.0, grad_var=1.0,
                max_profiled_replicas=4, max_profiled_nodes=1, timestamp=1.0 + i)))
        coord = Coordinator(store, make_policy("saxena-dp"), admission=AdmissionConfig("queue"))
        writes = coord.schedule_once()
        assert sorted(writes) == ["a", "b", "c", "d"]  # 4 GPUs: 4 jobs admitted
        assert all(w.num_replicas == 1 for w in writes.values())
        assert _status(store, "e").state == "queued"
        assert coord._memo["a"][2] is not None  # its throughput function, from the hints


def test_under_autoscaling_admission_counts_the_cluster_at_its_largest(tmp_path):
    """A queued job the current nodes cannot hold is admitted when the cluster may grow
    to hold it, and the autoscaler asks for the nodes (else it would wait on a cluster
    that never grows, since the autoscaler sees only admitted work)."""
    import threading

    import numpy as np

    from pollux_launch.coordinator.autoscaler import Autoscaler
    from pollux_launch.coordinator.provisioners import Provisioner
    from pollux_launch.policy.autoscale import AutoscaleConfig

    class Recorder(Provisioner):
        name = "recorder"

        def __init__(self) -> None:
            self.calls, self.done = [], threading.Event()

        def up(self, count: int) -> None:
            self.calls.append(("up", count))
            self.done.set()

        def down(self, nodes) -> None:
            self.calls.append(("down", list(nodes)))
            self.done.set()

    clock, prov = [1000.0], Recorder()
    whatif = make_policy("pollux-dp", delta=0.0)
    scaler = Autoscaler(AutoscaleConfig(1, 2, interval=10.0), prov, lambda jobs, nodes:
                        whatif.optimize(jobs, nodes, np.zeros((len(jobs), len(nodes)), int)),
                        lambda: clock[0], settle=0.0)
    with open_store(f"embedded://{tmp_path}/store.db") as store:
        store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))
        for i, name in enumerate(["a", "b", "c"]):
            _submit(store, name, 900.0 + i)
        coord = Coordinator(store, make_policy("pollux-dp"), clock=lambda: clock[0],
                            admission=AdmissionConfig("drop"), autoscaler=scaler)
        coord.schedule_once()
        assert [_status(store, n).state for n in "abc"] == ["pending"] * 3  # none rejected
        assert prov.done.wait(5) and prov.calls == [("up", 1)]
        _submit(store, "d", 950.0)
        _submit(store, "e", 951.0)
        coord.schedule_once()  # 2 nodes x 2 GPUs: d fits the largest cluster, e does not
        assert _status(store, "d").state == "pending"
        assert _status(store, "e").state == "rejected"

"""The coordinator's autoscaler on its own: decisions over what-if solves, draining
before release, the minimum node lifetime, booting nodes, and a provisioner that fails."""

from __future__ import annotations

import threading
import time

import numpy as np

from pollux_launch.coordinator.autoscaler import Autoscaler
from pollux_launch.coordinator.provisioners import Provisioner, ProvisionerError
from pollux_launch.messages import NodeInfo
from pollux_launch.policy import JobInfo, make_policy
from pollux_launch.policy.autoscale import AutoscaleConfig, RuleView


class Recorder(Provisioner):
    """A provisioner that only records (or fails, while ``failing``)."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.failing = False
        self.done = threading.Event()

    def up(self, count: int) -> None:
        self._do("up", count)

    def down(self, nodes) -> None:
        self._do("down", list(nodes))

    def _do(self, op: str, arg: object) -> None:
        self.calls.append((op, arg))
        self.done.set()
        if self.failing:
            raise ProvisionerError(f"{op}: no capacity in the zone")


def linear(n, k):
    return np.asarray(k, dtype=float)


def settle(scaler: Autoscaler | None, prov: Recorder) -> None:
    prov.done.wait(5)
    prov.done.clear()
    for _ in range(100):  # the call returned and the autoscaler saw it
        if scaler is None or not scaler._busy.is_set():
            return
        time.sleep(0.01)


def make(cfg: AutoscaleConfig, prov: Recorder, clock: list[float]) -> Autoscaler:
    policy = make_policy("pollux-dp", delta=0.0)
    return Autoscaler(cfg, prov, lambda jobs, nodes: policy.optimize(
        jobs, nodes, np.zeros((len(jobs), len(nodes)), dtype=int)), lambda: clock[0],
        settle=0.0)


def test_it_grows_for_scalable_work_and_drains_before_it_releases():
    clock, prov = [1000.0], Recorder()
    cfg = AutoscaleConfig(1, 4, interval=10.0, min_lifetime=15.0)
    scaler = make(cfg, prov, clock)
    job = JobInfo("a", linear, age=10.0, max_replicas=8)
    nodes = [NodeInfo("n1", 2)]
    assert scaler.round([job], nodes, {}, clock[0]) == set()
    settle(scaler, prov)
    assert prov.calls == [("up", 3)]  # linear: every size keeps utility 1 -> the maximum
    assert scaler.status.target == 4 and scaler.status.booting == 3
    nodes += [NodeInfo("n2", 2), NodeInfo("n3", 2), NodeInfo("n4", 2)]
    clock[0] += 10
    scaler.round([job], nodes, {"n1": {"a": 2}}, clock[0])
    assert scaler.status.booting == 0 and scaler.status.nodes == 4
    # the work ends: shrink to the minimum, but no node younger than 15 s goes
    clock[0] += 10
    assert scaler.round([], nodes, {}, clock[0]) == {"n1"}  # the others are 10 s old
    clock[0] += 10  # now all are old enough; n2 still holds a replica
    assert scaler.round([], nodes, {"n2": {"b": 1}}, clock[0]) == {"n1", "n3", "n4"}
    settle(scaler, prov)
    assert prov.calls[-1] == ("down", ["n1"])  # drained since the last round: released
    clock[0] += 1
    scaler.round([], nodes, {"n2": {"b": 1}}, clock[0])
    settle(scaler, prov)
    assert prov.calls[-1] == ("down", ["n3", "n4"])  # and n2 stays while it holds work


def test_a_failing_provisioner_backs_off_and_is_asked_again():
    clock, prov = [1000.0], Recorder()
    prov.failing = True
    scaler = make(AutoscaleConfig(1, 2, interval=1.0), prov, clock)
    job = JobInfo("a", linear, age=10.0, max_replicas=8)
    nodes = [NodeInfo("n1", 1)]
    for t in (1000.0, 1001.0):  # fails twice: back-off 1 s, then 2 s
        clock[0] = t
        scaler.round([job], nodes, {}, t)
        settle(scaler, prov)
    assert prov.calls == [("up", 1), ("up", 1)] and scaler._booting == []
    clock[0] = 1002.0
    scaler.round([job], nodes, {}, clock[0])  # within the back-off: no call
    assert len(prov.calls) == 2
    prov.failing = False
    clock[0] = 1003.0
    scaler.round([job], nodes, {}, clock[0])
    settle(scaler, prov)
    assert prov.calls[-1] == ("up", 1) and len(prov.calls) == 3 and len(scaler._booting) == 1


def saturating(n, k):
    """Goodput that stops growing past 2 GPUs (a small batch's statistical efficiency)."""
    return np.minimum(np.asarray(k, dtype=float), 2.0)


def test_the_throughput_rule_decides_by_system_throughput():
    """The same job under both rules: its goodput saturates at 2 GPUs, its system
    throughput scales linearly (``throughput_fn``: samples/s, 50 per GPU). The goodput
    rule keeps the cluster at one 2-GPU node (utility 2/2 = 1 there, 2/4 at two nodes: it
    would grow only to sizes that keep >= L = 0.5, and one more node is 0.5, so exactly
    2); the throughput rule sees utility 1 at every size and grows to the maximum."""
    job = JobInfo("a", saturating, age=10.0, max_replicas=16,
                  throughput_fn=lambda n, k: 50.0 * np.asarray(k, dtype=float))
    nodes = [NodeInfo("n1", 2)]
    asked = {}
    for rule in ("goodput", "throughput"):
        clock, prov = [1000.0], Recorder()
        scaler = make(AutoscaleConfig(1, 6, rule=rule, interval=10.0), prov, clock)
        scaler.round([job], nodes, {"n1": {"a": 2}}, clock[0])
        settle(scaler, prov)
        asked[rule] = (scaler.status.target, prov.calls, scaler.status.rule)
    assert asked["goodput"] == (2, [("up", 1)], "goodput")
    assert asked["throughput"] == (6, [("up", 5)], "throughput")


def test_a_job_without_a_throughput_model_keeps_its_speedup_under_the_throughput_rule():
    view = RuleView("throughput")
    bare = JobInfo("a", saturating, age=1.0)
    modelled = JobInfo("b", saturating, age=1.0,
                       throughput_fn=lambda n, k: 10.0 * np.asarray(k, dtype=float))
    seen = view([bare, modelled])
    assert seen[0] is bare
    assert list(seen[1].speedup_fn(np.array([1, 1]), np.array([4, 8]))) == [4.0, 8.0]
    assert RuleView("goodput")([bare, modelled]) == [bare, modelled]


def test_a_new_coordinator_goes_on_from_the_last_decision(tmp_path, caplog):
    """Coordinator A asks for 3 nodes and dies; B, on the same store, neither asks for
    them again nor forgets them (one has joined meanwhile), and a malformed record is
    logged once and survived: that coordinator decides afresh."""
    from pollux_launch import keys
    from pollux_launch.coordinator.service import Coordinator
    from pollux_launch.messages import JobSpec, JobStatus, encode
    from pollux_launch.rendezvous.store import open_store

    cfg = AutoscaleConfig(1, 4, interval=10.0)
    clock = [1000.0]
    with open_store(f"embedded://{tmp_path}/store.db") as store:
        store.put(keys.node("n1"), encode(NodeInfo("n1", 2)))
        spec = JobSpec(name="a", command=("python", "t.py"), initial_replicas=8,
                       min_replicas=1, max_replicas=8, submit_time=900.0)
        store.put(keys.job("a", "spec"), encode(spec))
        store.put(keys.job("a", "status"), encode(JobStatus("pending")))

        def coordinator(prov: Recorder) -> Coordinator:
            return Coordinator(store, make_policy("pollux-dp"), clock=lambda: clock[0],
                               autoscaler=make(cfg, prov, clock))

        first = Recorder()
        coordinator(first).schedule_once()
        settle(None, first)
        assert first.calls == [("up", 3)]
        clock[0] += 30
        store.put(keys.node("n2"), encode(NodeInfo("n2", 2)))  # one of them joined
        second = Recorder()
        b = coordinator(second)
        b.schedule_once()
        assert b.autoscaler.status.booting == 2 and b.autoscaler.status.target == 4
        assert second.calls == [] and not second.done.wait(0.5)
        # a record that does not decode: logged once, and the next leader starts afresh
        store.put(keys.AUTOSCALE, '{"v": 1, "nodes": -3}')
        third = Recorder()
        c = coordinator(third)
        caplog.set_level("WARNING")
        c.schedule_once()
        c.schedule_once()
        settle(None, third)
        assert caplog.text.count("ignoring malformed coordinator/autoscale") == 1
        assert third.calls == [("up", 2)]  # n1 and n2 are here: 2 more


def test_the_record_tells_the_truth_between_decisions():
    """Decisions are minutes apart; the record (status, and what a successor resumes
    from) follows joins and failed requests meanwhile."""
    clock, prov = [1000.0], Recorder()
    scaler = make(AutoscaleConfig(1, 3, interval=300.0), prov, clock)
    job = JobInfo("a", linear, age=10.0, max_replicas=8)
    scaler.round([job], [NodeInfo("n1", 2)], {}, clock[0])
    settle(scaler, prov)
    assert prov.calls == [("up", 2)] and scaler.status.booting == 2
    clock[0] += 30  # one of the two joins; no decision is due
    scaler.round([job], [NodeInfo("n1", 2), NodeInfo("n2", 2)], {}, clock[0])
    assert (scaler.status.nodes, scaler.status.booting, scaler.status.target) == (2, 1, 3)
    assert scaler.status.timestamp == 1000.0  # still the decision's
    failing = Recorder()
    failing.failing = True
    scaler = make(AutoscaleConfig(1, 3, interval=300.0), failing, clock)
    scaler.round([job], [NodeInfo("n1", 2)], {}, clock[0])
    settle(scaler, failing)
    assert failing.calls == [("up", 2)] and scaler.status.booting == 0  # none will come

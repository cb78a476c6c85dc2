"""Cloud autoscaling in the simulator (``SimConfig.autoscale``, ``--autoscale MIN:MAX``):
real small simulations over the bundled Pollux traces, and the node pool on its own."""

import json

import numpy as np
import pytest

from pollux_launch.cli import main
from pollux_launch.policy import JobInfo, Policy, PolicyNode
from pollux_launch.policy.autoscale import AutoscaleConfig
from pollux_launch.sim.autoscale import NodePool
from pollux_launch.sim.run import config_for, run_specs
from pollux_launch.sim.simulator import SimConfig, simulate
from pollux_launch.sim.traces import load_model
from pollux_launch.sim.workload import TraceJob

CR = "checkpoint-restart"  # 60 s rounds, 30 s per change: few rounds, fast tests

MIXED = [TraceJob("cifar10-0", 0.0, "cifar10"), TraceJob("ncf-1", 30.0, "ncf"),
         TraceJob("bert-2", 100.0, "bert"), TraceJob("deepspeech2-3", 200.0, "deepspeech2")]


def _run(specs, scale=None, nodes=1, boot=60.0, policy=None, **fields):
    cfg = config_for(CR, nodes=nodes, gpus_per_node=4, autoscale=scale, boot_time=boot,
                     **fields)
    return run_specs(specs, policy, cfg)


def _check_leases(res, lifetime: float) -> None:
    """Billing from the request, joining after boot, never released young."""
    for requested, joined, released in res.leases:
        assert joined >= requested
        if released is not None:
            assert released - joined >= lifetime - 1e-6, (requested, joined, released)


# --- nothing changes without autoscaling ---------------------------------------------------
class _Alternating(Policy):
    """A stateful policy: each call gives every job 1 or 2 GPUs, alternating. A what-if
    solve on the live instance would shift its phase and change the results."""

    name = "alternating"

    def __init__(self):
        self.calls = 0

    def optimize(self, jobs, nodes, current):
        self.calls += 1
        want = 1 + self.calls % 2
        free = np.array([n.slots for n in nodes], dtype=int)
        out = np.zeros((len(jobs), len(nodes)), dtype=int)
        for j, job in enumerate(jobs):
            need = min(want, job.max_replicas)
            for n in np.argsort(-free, kind="stable"):
                take = min(need, free[n])
                out[j, n] += take
                free[n] -= take
                need -= take
        return out


def test_a_pinned_autoscaler_changes_nothing_and_never_disturbs_the_live_policy():
    traces = {s.application: load_model(s.application) for s in MIXED}
    runs = {}
    for label, scale in (("fixed", None), ("pinned", AutoscaleConfig(2, 2, min_lifetime=0))):
        policy = _Alternating()
        cfg = SimConfig(nodes=2, gpus_per_node=4, autoscale=scale, boot_time=0.0)
        runs[label] = simulate(MIXED, traces, policy, cfg)
        assert policy.calls == len(runs[label].solve_ms)  # what-ifs ran on a copy
    fixed, pinned = runs["fixed"], runs["pinned"]
    assert pinned.whatif_solves > 0 and pinned.autoscale_decisions > 0
    assert pinned.jcts == fixed.jcts and pinned.restarts == fixed.restarts
    assert pinned.allocated_gpus == fixed.allocated_gpus
    assert pinned.node_hours == pytest.approx(fixed.node_hours)
    assert fixed.node_hours == pytest.approx(2 * fixed.end_time / 3600)
    assert fixed.summary()["autoscale"] is None and pinned.cluster["held"] == [2] * len(
        pinned.cluster["held"])


def test_default_policy_fixed_cluster_matches_a_pinned_autoscaler():
    fixed = _run(MIXED, nodes=2)
    pinned = _run(MIXED, AutoscaleConfig(2, 2), nodes=2)
    assert pinned.jcts == fixed.jcts and pinned.allocated_gpus == fixed.allocated_gpus
    summary = fixed.summary()
    assert summary["node_hours"] == pytest.approx(2 * fixed.end_time / 3600)
    assert summary["avg_nodes"] == pytest.approx(2.0) and summary["peak_nodes"] == 2


# --- growing and shrinking -----------------------------------------------------------------
def test_grows_while_utility_is_high_and_shrinks_to_min_without_work():
    specs = [TraceJob("a", 0.0, "cifar10"), TraceJob("b", 8000.0, "cifar10")]
    scale = AutoscaleConfig(1, 4, min_lifetime=300)
    res = _run(specs, scale)
    held, times = np.array(res.cluster["held"]), np.array(res.cluster["time"])
    assert held.min() >= 1 and held.max() <= 4
    assert max(res.cluster["target"]) <= 4 and min(res.cluster["target"]) >= 1
    assert held.max() > 1  # a young cifar10 job scales well: the cluster grew
    end_a = res.completion["a"]
    idle = (times > end_a) & (times < 8000)
    assert idle.any() and held[idle][-1] == 1  # no work: back to MIN (then skips ahead)
    assert np.all(np.diff(held[idle]) <= 0) and np.all(
        np.array(res.cluster["active_jobs"])[idle] == 0)
    at = end_a + 300 + 3 * 60  # nodes are held (billed) for 1 node only in the gap
    assert sum(q <= at and (r is None or r > at) for q, _, r in res.leases) == 1
    after = times > 8000
    assert held[after].max() > 1  # and grows again for the next job
    _check_leases(res, 300)
    assert set(res.jcts) == {"a", "b"}


def test_shrinks_when_utility_is_low_while_a_job_runs():
    # one job capped at 1 GPU on 4 nodes: utility 1/16, below L; lifetime 300 s
    specs = [TraceJob("solo", 0.0, "cifar10", max_replicas=1)]
    res = _run(specs, AutoscaleConfig(1, 4, min_lifetime=300), nodes=4)
    held, times = np.array(res.cluster["held"]), np.array(res.cluster["time"])
    active = np.array(res.cluster["active_jobs"])
    assert held[0] == 4
    assert np.all(held[times < 300] == 4)  # the nodes are too young before 300 s
    assert np.any((held == 1) & (active == 1))  # shrunk while the job ran
    _check_leases(res, 300)
    assert res.node_hours < 4 * res.end_time / 3600


def test_never_releases_a_node_younger_than_min_lifetime_on_a_busy_workload():
    specs = [TraceJob(f"j{i}", 400.0 * i, app)
             for i, app in enumerate(["cifar10", "bert", "ncf", "cifar10", "deepspeech2",
                                      "cifar10", "ncf", "bert"])]
    for lifetime in (0.0, 900.0):
        res = _run(specs, AutoscaleConfig(1, 6, min_lifetime=lifetime), boot=120.0)
        assert len(res.jcts) == len(specs)
        assert any(r is not None for _, _, r in res.leases)  # it did release nodes
        _check_leases(res, lifetime)
        assert max(res.cluster["held"]) <= 6 and min(res.cluster["held"]) >= 1
        # no allocation ever used more GPUs than the joined nodes had
        assert all(a <= c for a, c in zip(res.allocated_gpus, res.capacity_gpus, strict=True))


def test_booting_delays_capacity_and_is_billed():
    specs = [TraceJob("a", 0.0, "cifar10")]
    scale = AutoscaleConfig(1, 4)
    fast, slow = _run(specs, scale, boot=0.0), _run(specs, scale, boot=600.0)
    for res, boot in ((fast, 0.0), (slow, 600.0)):
        grown = [(q, j) for q, j, _ in res.leases if q > 0]
        assert grown and all(j - q == pytest.approx(boot) for q, j in grown)
    first = min(q for q, _, _ in slow.leases if q > 0)
    # until the first requested node joins, the job has one node's GPUs
    early = [c for t, c in zip(slow.times, slow.capacity_gpus, strict=True) if t < first + 600]
    assert early and max(early) == 4
    held, ready = np.array(slow.cluster["held"]), np.array(slow.cluster["ready"])
    assert np.any(held > ready)  # booting nodes are held (billed) before they join
    assert slow.jcts["a"] > fast.jcts["a"]


def test_node_hours_integrate_the_held_nodes():
    res = _run(MIXED, AutoscaleConfig(1, 4, min_lifetime=120))
    by_leases = sum(((res.end_time if r is None else r) - q) for q, _, r in res.leases) / 3600
    assert res.node_hours == pytest.approx(by_leases)
    # the per-round timeline integrates to the same, within a round of the largest cluster
    times = np.array(res.cluster["time"])
    held = np.array(res.cluster["held"])
    steps = np.diff(np.append(times, res.end_time))
    approx = float((held * steps).sum() + held[0] * times[0]) / 3600
    assert abs(approx - res.node_hours) <= 4 * 60 / 3600 * 2
    summary = res.summary()
    assert summary["node_hours"] == pytest.approx(res.node_hours)
    assert summary["autoscale"]["min_nodes"] == 1 and summary["autoscale"]["rule"] == "goodput"
    assert summary["peak_nodes"] == max(held)


def test_throughput_rule_grows_at_least_as_far_as_goodput_early_on():
    specs = [TraceJob("imagenet-0", 0.0, "imagenet")]
    runs = {rule: _run(specs, AutoscaleConfig(1, 8, rule=rule), horizon=3600.0)
            for rule in ("goodput", "throughput")}
    held = {rule: np.array(r.cluster["held"]) for rule, r in runs.items()}
    n = min(len(h) for h in held.values())
    # blind to statistical efficiency, the throughput rule takes the whole cluster at once
    assert np.all(held["throughput"][:n] >= held["goodput"][:n])
    assert held["throughput"].max() == 8
    assert held["goodput"].max() < held["throughput"].max()
    assert runs["throughput"].node_hours > runs["goodput"].node_hours


# --- the node pool -------------------------------------------------------------------------
def test_node_pool_drains_the_emptiest_youngest_old_nodes_and_grows_by_undraining():
    pool = NodePool(size=6, gpus_per_node=4, initial=3, boot_time=100.0)
    assert pool.grow(2, now=50.0) == 2  # slots 3, 4 boot until 150
    assert [lease.slot for lease in pool.visible(100.0)] == [0, 1, 2]
    assert [lease.slot for lease in pool.visible(150.0)] == [0, 1, 2, 3, 4]
    load = np.array([4, 1, 0, 0, 0, 0])
    # at 200: slots 3, 4 joined 50 s ago; lifetime 60: only 0, 1, 2 may go
    assert pool.shrink(2, 200.0, load, min_lifetime=60.0) == 2
    assert 2 not in [lease.slot for lease in pool.held()]  # empty: released at once
    assert [lease.slot for lease in pool.held() if lease.draining] == [1]  # busy: drains
    slots, nodes = pool.policy_nodes(200.0)
    assert dict(zip(slots, [n.slots for n in nodes], strict=True)) == {0: 4, 1: 0, 3: 4, 4: 4}
    pool.release_drained(260.0, np.array([4, 0, 0, 2, 0, 0]))
    assert [lease.slot for lease in pool.held()] == [0, 3, 4]
    # growing cancels drains before requesting new nodes
    assert pool.shrink(1, 300.0, np.array([4, 0, 0, 2, 1, 0]), min_lifetime=60.0) == 1
    assert [lease.slot for lease in pool.held() if lease.draining] == [4]
    assert pool.grow(2, 320.0) == 2
    assert not pool.draining() and len(pool.committed()) == 4 and pool.booting(320.0) == 1
    released = {lease.slot: lease.released for lease in pool.leases if lease.released}
    assert released == {2: 200.0, 1: 260.0}


def test_node_pool_rejects_a_bad_start():
    with pytest.raises(ValueError, match="initial nodes"):
        NodePool(size=2, gpus_per_node=4, initial=3)


# --- the command line -----------------------------------------------------------------------
def _workload(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\n" + "\n".join(
        f"{s.name},{s.submit_time:g},{s.application}" for s in MIXED) + "\n")
    return path


def test_cli_autoscale_reports_node_hours_and_plots_nodes(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["simulate", "--workload", str(_workload(tmp_path)), "--autoscale", "1:4",
               "--boot-time", "30", "--min-node-lifetime", "120", "--rescale-model", CR,
               "--no-progress", "--output", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    last = json.loads(cap.out.strip().splitlines()[-1])
    assert last["node_hours"] > 0 and last["nodes"] == 1 and last["peak_nodes"] <= 4
    assert last["autoscale"] == {**last["autoscale"], "min_nodes": 1, "max_nodes": 4,
                                 "boot_time": 30.0, "min_node_lifetime": 120.0,
                                 "rule": "goodput"}
    assert "node-hours" in cap.out
    full = json.loads((out / "summary.json").read_text())
    assert len(full["cluster_timeline"]["held"]) == len(full["cluster_timeline"]["time"]) > 0
    assert (out / "nodes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "expected"), [
    (["--autoscale", "4:1"], "MIN:MAX"),
    (["--autoscale", "x"], "MIN:MAX"),
    (["--autoscale", "1:4", "--nodes", "8"], "--nodes 8"),
    (["--boot-time", "30"], "--boot-time needs --autoscale"),
    (["--autoscale", "1:4", "--boot-time", "-5"], "--boot-time"),
    (["--autoscale", "1:4", "--utility-low", "0.9"], "--utility-low"),
    (["--autoscale", "1:4", "--utility-high", "nan"], "--utility-high"),
    (["--autoscale", "1:4", "--autoscale-rule", "cpu"], "--autoscale-rule"),
    (["--autoscale", "1:4", "--scale-interval", "0"], "--scale-interval"),
])
def test_cli_bad_autoscale_input_is_one_line(tmp_path, capsys, args, expected):
    rc = main(["simulate", "--workload", str(_workload(tmp_path)), "--no-progress", *args])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], cap.err
    assert "Traceback" not in cap.err


def test_sim_config_checks_the_starting_size():
    with pytest.raises(ValueError, match="starts within"):
        SimConfig(nodes=16, autoscale=AutoscaleConfig(1, 8))
    with pytest.raises(ValueError, match="boot time"):
        SimConfig(boot_time=-1.0)
    assert SimConfig(nodes=0, autoscale=AutoscaleConfig(0, 2)).total_gpus == 8


def test_an_empty_start_grows_for_the_first_job():
    res = _run([TraceJob("a", 0.0, "cifar10")], AutoscaleConfig(0, 2, min_lifetime=0), nodes=0,
               boot=60.0)
    assert res.jcts["a"] > 60.0  # waited for a node to boot
    assert res.leases[0][0] > 0 and max(res.cluster["held"]) >= 1


def test_policy_infos_keep_their_limits(tmp_path):
    # what-ifs honour each job's max_replicas (its exploration cap), as the policy does
    infos_seen: list[list[JobInfo]] = []

    class Spy(_Alternating):
        def optimize(self, jobs, nodes, current):
            if nodes and nodes[0].name.startswith("whatif"):
                infos_seen.append(list(jobs))
                assert all(isinstance(n, PolicyNode) and n.slots == 4 for n in nodes)
            return super().optimize(jobs, nodes, current)

    traces = {"cifar10": load_model("cifar10")}
    cfg = SimConfig(nodes=1, gpus_per_node=4, autoscale=AutoscaleConfig(1, 3), boot_time=0.0)
    res = simulate([TraceJob("a", 0.0, "cifar10")], traces, Spy(), cfg)
    assert infos_seen and all(i[0].max_replicas <= 12 for i in infos_seen)
    assert res.jcts


def test_a_gang_larger_than_the_cluster_makes_it_grow():
    # TunedJobs: 8 GPUs or nothing, on a cluster starting with 4 GPUs
    spec = TraceJob("big", 0.0, "cifar10", num_replicas=8, batch_size=2048)
    res = _run([spec], AutoscaleConfig(1, 4), policy="tuned-fifo")
    assert res.jcts["big"] < 3600 and max(res.cluster["held"]) >= 2
    assert res.max_gpus["big"] == 8

"""Admission control, batch-size ranges, GPU caps, max-bs and saxena-dp in the simulator.

Real (small) simulations. The toy model is the one of test_sim_simulator, with longer
epochs: a job needs 1200 M0-iterations, i.e. 600 s on one GPU (m = 10, 0.5 s steps).
"""

import json
from pathlib import Path

import numpy as np
import pytest
from test_sim_simulator import PLACEMENTS, SCALABILITY  # the toy model's step times

from pollux_launch.policy import make_policy
from pollux_launch.policy.admission import AdmissionConfig
from pollux_launch.sim import simulator as sim_mod
from pollux_launch.sim.run import build_policy, run_specs, run_workload
from pollux_launch.sim.simulator import ProfileConfig, SimConfig, simulate
from pollux_launch.sim.traces import load_model
from pollux_launch.sim.workload import TraceJob, load_workload

VALIDATION = """progress,iteration,metric,grad_sqr,grad_var
600,600,0.5,1.0,0.0
1200,1200,0.9,1.0,0.0
"""


def _toy(tmp_path: Path):
    model = tmp_path / "models" / "toy"
    model.mkdir(parents=True)
    (model / "placements.csv").write_text(PLACEMENTS)
    (model / "scalability.csv").write_text(SCALABILITY)
    (model / "validation-10.csv").write_text(VALIDATION)
    return {"toy": load_model("toy", tmp_path / "models")}


class OneGPUEach:
    """Each job, in order, gets one GPU while any is free (a deterministic toy policy)."""

    name = "one-each"

    def optimize(self, jobs, nodes, current):
        free = np.array([n.slots for n in nodes])
        out = np.zeros((len(jobs), len(nodes)), dtype=int)
        for j, _ in enumerate(jobs):
            if free.sum():
                n = int(np.argmax(free))
                out[j, n], free[n] = 1, free[n] - 1
        return out


def _specs(*rows):
    return [TraceJob(name, float(t), "toy") for name, t in rows]


# --- admission none: today's behaviour ------------------------------------------------------

SMALL_REAL = """name,time,application,num_replicas,batch_size
cifar10-0,0,cifar10,2,2048
ncf-1,30,ncf,1,32768
bert-2,100,bert,4,384
deepspeech2-3,200,deepspeech2,2,320
"""
# avg JCTs of SMALL_REAL on 2 nodes x 4 GPUs before admission control existed (the
# simulator at the commit before it, same goodput core): admission none must not move them
BEFORE = {
    "pollux-dp": {"ncf-1": 105.93535232720876, "cifar10-0": 1409.364467507136,
                  "bert-2": 3945.0335573733028, "deepspeech2-3": 4827.642547178242},
    "tuned-fifo": {"ncf-1": 105.93535232720876, "cifar10-0": 2891.4648525642388,
                   "bert-2": 3927.8854794502213, "deepspeech2-3": 11608.90326367615},
}


@pytest.mark.parametrize("policy", sorted(BEFORE))
def test_admission_none_reproduces_todays_results(tmp_path, policy):
    path = tmp_path / "small.csv"
    path.write_text(SMALL_REAL)
    explicit = SimConfig(nodes=2, gpus_per_node=4, admission=AdmissionConfig("none"))
    res = run_workload(path, policy, explicit)
    assert res.jcts == pytest.approx(BEFORE[policy], rel=1e-9)
    assert run_workload(path, policy, SimConfig(nodes=2, gpus_per_node=4)).jcts == res.jcts
    s = res.summary()
    assert s["admission"] == "none" and s["dropped"] == 0 and s["drop_ratio"] == 0.0
    assert s["completed"] == s["admitted"] == s["arrived"] == 4
    # admitted at the first round at or after arrival (60 s grid)
    assert res.admitted == {"cifar10-0": 60.0, "ncf-1": 60.0, "bert-2": 120.0,
                            "deepspeech2-3": 240.0}
    assert s["avg_queue_delay"] == pytest.approx((60 + 30 + 20 + 40) / 4)
    assert s["avg_jct_completed"] == pytest.approx(s["avg_jct"])
    json.dumps(s, allow_nan=False)


# --- queue ------------------------------------------------------------------------------------

def test_queue_runs_no_more_than_fits_and_serves_fifo(tmp_path, monkeypatch):
    """1 node x 2 GPUs, five 1-GPU jobs: at most 2 admitted at once, admitted in arrival
    order (e waits behind d even when it arrived in the same round); the policy sees
    admitted jobs only, each as min_replicas 1."""
    traces = _toy(tmp_path)
    specs = _specs(("a", 0), ("b", 5), ("c", 10), ("e", 12), ("d", 11))
    seen = []

    class Spy(OneGPUEach):
        def optimize(self, jobs, nodes, current):
            seen.append([(j.name, j.min_replicas) for j in jobs])
            return super().optimize(jobs, nodes, current)

    cfg = SimConfig(nodes=1, gpus_per_node=2, admission=AdmissionConfig("queue"))
    res = simulate(specs, traces, Spy(), cfg)
    assert max(res.active_jobs) == 2 and max(len(r) for r in seen) == 2
    assert all(m == 1 for r in seen for _, m in r)
    order = sorted(res.admitted, key=lambda k: (res.admitted[k], res.submit[k]))
    assert order == ["a", "b", "c", "d", "e"]
    assert res.admitted["a"] == res.admitted["b"] == 60.0
    assert res.admitted["c"] > 60.0 and res.admitted["d"] >= res.admitted["c"]
    assert res.admitted["e"] >= res.admitted["d"]
    assert set(res.completion) == {"a", "b", "c", "d", "e"} and not res.dropped
    s = res.summary()
    assert s["avg_queue_delay"] > 60 and s["completed"] == 5
    assert max(res.waiting_jobs) >= 1


def test_queue_max_running_caps_admitted_jobs(tmp_path):
    traces = _toy(tmp_path)
    cfg = SimConfig(nodes=1, gpus_per_node=2,
                    admission=AdmissionConfig("queue", max_running=1))
    res = simulate(_specs(("a", 0), ("b", 0), ("c", 0)), traces, OneGPUEach(), cfg)
    assert max(res.active_jobs) == 1 and max(res.allocated_gpus) == 1
    assert sorted(res.admitted, key=res.admitted.get) == ["a", "b", "c"]


def test_max_wait_drops_a_job_that_waited_too_long(tmp_path):
    traces = _toy(tmp_path)
    cfg = SimConfig(nodes=1, gpus_per_node=1,
                    admission=AdmissionConfig("queue", max_wait=100.0))
    res = simulate(_specs(("a", 0), ("b", 30)), traces, OneGPUEach(), cfg)
    # a holds the only GPU for > 600 s; b is dropped at the first round >= 30 + 100 s
    assert res.dropped == {"b": 180.0}
    assert "--max-wait 100" in res.drop_reasons["b"]
    assert "b" not in res.completion and "b" not in res.admitted and "b" not in res.max_gpus
    s = res.summary()
    assert s["dropped"] == 1 and s["drop_ratio"] == 0.5 and s["completed"] == 1


# --- drop -------------------------------------------------------------------------------------

def test_drop_drops_at_arrival_with_a_reason(tmp_path):
    traces = _toy(tmp_path)
    cfg = SimConfig(nodes=1, gpus_per_node=1, admission=AdmissionConfig("drop"))
    res = simulate(_specs(("a", 0), ("b", 10), ("c", 2000)), traces, OneGPUEach(), cfg)
    assert res.dropped == {"b": 60.0}  # decided in the round it arrived
    assert "cannot take it now" in res.drop_reasons["b"]
    assert "needs 1 GPU(s)" in res.drop_reasons["b"]
    assert set(res.completion) == {"a", "c"}  # c came when the GPU was free again
    assert "b" not in res.max_gpus
    s = res.summary()
    assert s["drop_ratio"] == pytest.approx(1 / 3) and s["unfinished"] == 0


def test_horizon_stops_the_run_and_counts_completions_by_then(tmp_path):
    traces = _toy(tmp_path)
    cfg = SimConfig(nodes=1, gpus_per_node=1, horizon=1000.0)
    res = simulate(_specs(("a", 0), ("b", 0)), traces, OneGPUEach(), cfg)
    s = res.summary()
    # a: start 60, 30 s restart, 600 s of work -> done at 690; b starts only after it
    assert res.completion == {"a": pytest.approx(690.0)}
    assert s["completed"] == 1 and s["unfinished"] == 1 and res.end_time >= 1000.0
    assert res.summary(horizon=600.0)["completed"] == 0


# --- batch-size ranges and GPU caps from the workload ---------------------------------------

RANGED = """name,time,application,min_batch_size,max_batch_size,max_replicas
c0,0,cifar10,256,1024,2
c1,0,cifar10,,,
d2,60,deepspeech2,40,160,3
b3,120,bert,24,96,4
"""


def _record_batches(monkeypatch):
    seen: dict[str, list[tuple[int, int]]] = {}
    advance = sim_mod.SimJob.advance

    def spy(self, start, seconds, interference=0.0):
        if self.placement and self.completion_time is None:
            seen.setdefault(self.name, []).append((sum(self.placement), self.batch_size))
        return advance(self, start, seconds, interference)

    monkeypatch.setattr(sim_mod.SimJob, "advance", spy)
    return seen


def test_workload_ranges_and_caps_are_honoured(tmp_path, monkeypatch):
    path = tmp_path / "ranged.csv"
    path.write_text(RANGED)
    specs = load_workload(path, ["cifar10", "deepspeech2", "bert"])
    assert specs[0].min_batch_size == 256 and specs[0].max_replicas == 2
    assert specs[1].min_batch_size is None and specs[1].max_replicas is None
    seen = _record_batches(monkeypatch)
    res = run_specs(specs, "pollux-dp", SimConfig(nodes=2, gpus_per_node=4))
    assert set(res.completion) == {"c0", "c1", "d2", "b3"}
    limits = {"c0": (256, 1024, 2), "c1": (128, 4096, 8), "d2": (40, 160, 3),
              "b3": (24, 96, 4)}
    for name, (lo, hi, cap) in limits.items():
        gpus = [g for g, _ in seen[name]]
        batches = [b for _, b in seen[name]]
        assert max(gpus) <= cap and res.max_gpus[name] <= cap, name
        assert lo <= min(batches) and max(batches) <= hi, (name, min(batches), max(batches))
    # the range bites: the same model without one starts below 256 (at M0 = 128)
    assert min(b for _, b in seen["c1"]) < 256


def test_a_range_outside_the_traces_is_one_line(tmp_path):
    spec = TraceJob("x", 0.0, "cifar10", min_batch_size=64, max_batch_size=512)
    with pytest.raises(ValueError) as info:
        run_specs([spec], "pollux-dp", SimConfig(nodes=1, gpus_per_node=4))
    assert str(info.value) == ("job x: batch-size range [64, 512] must lie within [128, "
                               "4096], the batch sizes the cifar10 traces measured")


# --- max-bs and saxena-dp -----------------------------------------------------------------------

def test_max_bs_keeps_each_jobs_batch_at_its_max(tmp_path, monkeypatch):
    specs = [TraceJob("c0", 0.0, "cifar10", min_batch_size=128, max_batch_size=1024,
                     max_replicas=4),
             TraceJob("b1", 30.0, "bert", min_batch_size=12, max_batch_size=96,
                     max_replicas=4)]
    name, policy, cfg = build_policy("max-bs", SimConfig(nodes=1, gpus_per_node=4))
    assert name == "max-bs" and policy.name == "saxena-dp" and cfg.fixed_max_batch
    infos = []

    class Spy:
        name = "spy"

        def optimize(self, jobs, nodes, current):
            infos.extend(jobs)
            return policy.optimize(jobs, nodes, current)

    seen = _record_batches(monkeypatch)
    res = simulate(specs, {m: load_model(m) for m in ("cifar10", "bert")}, Spy(), cfg)
    assert set(res.completion) == {"c0", "b1"}
    for job, top in (("c0", 1024), ("b1", 96)):
        for gpus, batch in seen[job]:
            assert top - gpus < batch <= top, (job, gpus, batch)  # an even split of the max
    fns = [i.throughput_fn for i in infos if i.throughput_fn is not None]
    assert fns and all(f.fixed_batch_size in (1024, 96) for f in fns)
    # saxena-dp on the same jobs lets the batch move within the range
    seen.clear()
    run_specs(specs, "saxena-dp", SimConfig(nodes=1, gpus_per_node=4))
    assert len({b for _, b in seen["c0"]} | {b for _, b in seen["b1"]}) > 2


def test_saxena_dp_gives_every_admitted_job_a_gpu(tmp_path):
    specs = [TraceJob(f"j{i}-{m}", 40.0 * i, m, max_replicas=8)
             for i, m in enumerate(["cifar10", "bert", "deepspeech2", "cifar10", "yolov3",
                                    "bert", "cifar10", "deepspeech2", "bert"])]
    engine = make_policy("saxena-dp")
    rows = []

    class Spy:
        name = "saxena-dp"

        def optimize(self, jobs, nodes, current):
            out = engine.optimize(jobs, nodes, current)
            rows.append((len(jobs), out.sum(axis=1).tolist()))
            return out

    cfg = SimConfig(nodes=2, gpus_per_node=4, admission=AdmissionConfig("queue"),
                    horizon=3 * 3600.0)
    res = simulate(specs, {s.application: load_model(s.application) for s in specs}, Spy(),
                   cfg)
    assert rows and max(n for n, _ in rows) == 8  # 9 jobs, 8 GPUs: one queued at times
    assert all(min(counts) >= 1 for _, counts in rows)
    assert res.summary()["avg_queue_delay"] > 0


# --- profile on arrival ---------------------------------------------------------------------

def test_profile_on_arrival_runs_each_count_then_competes(tmp_path, monkeypatch):
    counts: list[tuple[int, list[int]]] = []
    realloc = sim_mod.SimJob.reallocate

    def spy(self, row):
        counts.append((int(row.sum()), list(self.profile_plan)))
        return realloc(self, row)

    monkeypatch.setattr(sim_mod.SimJob, "reallocate", spy)
    profile = ProfileConfig(seconds=30.0, max_replicas=4)
    assert profile.counts(8) == [1, 2, 4] and profile.counts(3) == [1, 2, 3]
    assert ProfileConfig(ladder="ends").counts(16) == [1, 8]
    cfg = SimConfig(nodes=1, gpus_per_node=4, profile=profile)
    _, policy, cfg = build_policy("pollux-dp", cfg)
    res = simulate([TraceJob("c", 0.0, "cifar10")], {"cifar10": load_model("cifar10")},
                   policy, cfg)
    # each count: one 60 s round (30 s restart, 30 s of training), then the job competes
    # (on the whole 4-GPU cluster, where the last count left it)
    assert counts == [(1, [1, 2, 4]), (2, [2, 4]), (4, [4])]
    assert res.summary()["profile_on_arrival"] is True and "c" in res.completion


def test_profile_config_rejects_bad_values():
    with pytest.raises(ValueError, match="profile seconds must be > 0"):
        ProfileConfig(seconds=0)
    with pytest.raises(ValueError, match="profile ladder must be one of"):
        ProfileConfig(ladder="all")

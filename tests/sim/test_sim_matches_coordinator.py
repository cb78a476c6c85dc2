"""The simulator schedules a job exactly as the live coordinator would in the same state.

A simulated job's state is written as the store's messages (``JobSpec``, ``JobHints``,
``Allocation``, ``JobGeneration``) and its ``JobInfo`` must be the coordinator's
:func:`pollux_launch.coordinator.jobs.job_info` of them: every field, and the speedup and
throughput functions' values on a grid of allocations. Each state below is reached by
running a real job (bundled traces) through the simulator's own steps. The last tests
change the coordinator's rules and check that the simulator follows: a private copy of
the translation in ``sim/`` (an exploration cap, a prior, an age) would not.
"""

import dataclasses

import numpy as np
import pytest

import pollux_launch.coordinator.jobs as coordinator_jobs
from pollux_launch.coordinator.jobs import job_info, model_speedup, model_throughput
from pollux_launch.messages import Allocation, JobHints, JobSpec
from pollux_launch.policy import JobInfo, Policy
from pollux_launch.policy.admission import AdmissionConfig
from pollux_launch.sim.simulator import ProfileConfig, SimConfig, SimJob, simulate
from pollux_launch.sim.traces import load_model
from pollux_launch.sim.workload import TraceJob

NODES, GPUS = 4, 4
# (nodes, replicas) of every allocation the policy may ask about, 0 replicas included
GRID_K = np.array([0] + [k for k in range(1, NODES * GPUS + 1)
                         for n in range(1, min(k, NODES) + 1)])
GRID_N = np.array([0] + [n for k in range(1, NODES * GPUS + 1)
                         for n in range(1, min(k, NODES) + 1)])


def _job(app="cifar10", cfg=None, **limits) -> SimJob:
    cfg = cfg or SimConfig(nodes=NODES, gpus_per_node=GPUS)
    return SimJob(TraceJob(f"{app}-0", 100.0, app, **limits), load_model(app), cfg, 0)


def _run(job: SimJob, per_node: list[int], start: float, seconds: float) -> float:
    """Place ``job`` on ``per_node`` GPUs and train ``seconds``; returns the time after."""
    row = np.zeros(job.cfg.pool_nodes, dtype=int)
    row[:len(per_node)] = per_node
    job.reallocate(row)
    job.advance(start, seconds)
    return start + seconds


def _coordinators(job: SimJob, now: float) -> JobInfo:
    """What the coordinator makes of the job's messages (its functions built afresh)."""
    spec, hints = job.spec_message(), job.hints_message()
    cfg = job.cfg
    return job_info(
        spec, hints, job.allocation_message(), now,
        speedup_fn=model_speedup(
            hints, single_replica_accumulation=cfg.single_replica_accumulation),
        generation=job.generation_message(), cost=cfg.rescale_cost,
        throughput_fn=model_throughput(hints), cap_unmodelled=cfg.cap_unmodelled)


def _assert_same(sim: JobInfo, coord: JobInfo) -> None:
    """Every field equal; callables equal on the grid (or both None)."""
    for f in dataclasses.fields(JobInfo):
        a, b = getattr(sim, f.name), getattr(coord, f.name)
        if callable(a) or callable(b):
            assert (a is None) == (b is None), f.name
            np.testing.assert_allclose(a(GRID_N, GRID_K), b(GRID_N, GRID_K), rtol=1e-12,
                                       err_msg=f.name)
        else:
            assert a == b, f"{f.name}: simulator {a!r}, coordinator {b!r}"


def _check(job: SimJob, now: float) -> JobInfo:
    """The round's report (refit included), compared with the coordinator's view."""
    info = job.job_info(now)
    _assert_same(info, _coordinators(job, now))
    return info


@pytest.mark.parametrize("rescale_model", ["checkpoint-restart", "live", "restart"])
def test_an_adaptive_job_through_its_life(rescale_model):
    cfg = SimConfig(nodes=NODES, gpus_per_node=GPUS, rescale_model=rescale_model)
    job = _job(cfg=cfg)
    # before it ever ran: no hints of a model, no allocation, not even a second old
    first = _check(job, 100.0)
    assert first.max_replicas == 1 and first.restarts == 0 and first.age >= 0.5
    assert job.hints_message().perf_params is None and job.allocation_message() is None
    now = _run(job, [1], 100.0, 600.0)
    fitted = _check(job, now)  # fitted on 1 GPU: the exploration cap lets it try 2
    assert job.hints_message().perf_params is not None and fitted.max_replicas == 2
    assert fitted.throughput_fn is not None
    now = _run(job, [2], now, 300.0)
    grown = _check(job, now)
    assert grown.max_replicas == 4 and grown.restarts == 1
    now = _run(job, [2, 2], now, 300.0)  # two nodes, a third placement
    spread = _check(job, now)
    assert spread.restarts == 2 and spread.max_replicas == 8
    assert job.allocation_message().num_nodes == 2
    _run(job, [0], now, 0.0)  # preempted: held nothing, still counted
    _check(job, now + 1.0)
    _check(job, now + 86400.0)  # a day older


def test_near_and_at_the_exploration_cap():
    job = _job(max_replicas=6)  # the workload's GPU cap (--max-np 6)
    assert job.limit() == 6
    now = _run(job, [1], 100.0, 300.0)
    assert _check(job, now).max_replicas == 2
    now = _run(job, [2, 1], now, 300.0)  # 3 seen: 2 x 3 = 6, the cap meets the limit
    assert _check(job, now).max_replicas == 6
    now = _run(job, [2, 2], now, 300.0)  # 4 seen: 8 > 6, the limit holds
    assert _check(job, now).max_replicas == 6


def test_a_batch_range_a_pinned_job_and_max_bs():
    ranged = _job(min_batch_size=256, max_batch_size=1024)  # a range above M0
    _check(ranged, _run(ranged, [1], 100.0, 300.0))
    assert ranged.hints_message().min_batch_size == 256
    ncf = _job("ncf")  # the authors' pinning: 32768 on one GPU, a fixed batch
    _check(ncf, 100.0)
    now = _run(ncf, [1], 100.0, 300.0)
    assert _check(ncf, now).max_replicas == 1
    hints = ncf.hints_message()
    assert not hints.adaptive_batch_size and hints.init_batch_size == 32768
    cfg = SimConfig(nodes=NODES, gpus_per_node=GPUS, fixed_max_batch=True)
    top = _job(cfg=cfg)
    now = _run(top, [1], 100.0, 300.0)
    _check(top, now)
    _check(top, _run(top, [2, 2], now, 300.0))


def test_a_profiling_job_and_a_tuned_jobs_one():
    cfg = SimConfig(nodes=NODES, gpus_per_node=GPUS,
                    profile=ProfileConfig(seconds=60.0, max_replicas=4))
    job = _job(cfg=cfg)
    job.start_profile(cfg.profile)
    assert _check(job, 100.0).max_replicas == 1
    now = _run(job, [1], 100.0, 120.0)  # 1 GPU profiled: on to 2
    assert _check(job, now).max_replicas == 2 and job.hints_message().perf_params is None
    now = _run(job, [2], now, 120.0)
    assert _check(job, now).max_replicas == 4
    now = _run(job, [4], now, 120.0)  # done profiling: its model, the cap 2 x 4
    info = _check(job, now)
    assert not job.profile_plan and info.max_replicas == 8 and info.throughput_fn
    tuned_cfg = SimConfig(nodes=NODES, gpus_per_node=GPUS, adaptive=False,
                          admission=AdmissionConfig("queue"))
    tuned = SimJob(TraceJob("t", 0.0, "bert", num_replicas=4, batch_size=384),
                   load_model("bert"), tuned_cfg, 0)
    tuned.min_replicas = tuned.need  # admitted: the gang admission promised
    gang = _check(tuned, 60.0)
    assert gang.min_replicas == gang.max_replicas == 4
    _check(tuned, _run(tuned, [4], 60.0, 600.0))


def test_without_pollux_exploration_the_prior_decides_as_in_the_live_coordinator():
    cfg = SimConfig(nodes=NODES, gpus_per_node=GPUS, cap_unmodelled=False)
    job = _job(cfg=cfg)
    assert _check(job, 100.0).max_replicas == job.limit()
    _check(job, _run(job, [1], 100.0, 300.0))


def test_the_messages_say_what_the_job_did():
    job = _job()
    now = _run(job, [2, 1], 100.0, 600.0)
    job.job_info(now)
    spec, hints, alloc = job.spec_message(), job.hints_message(), job.allocation_message()
    assert isinstance(spec, JobSpec) and isinstance(hints, JobHints)
    assert (spec.initial_replicas, spec.min_replicas, spec.max_replicas) == (1, 1, 16)
    assert spec.submit_time == 100.0 and spec.reports_goodput
    assert hints.max_profiled_replicas == 3 and hints.max_profiled_nodes == 2
    assert hints.perf_params == job.perf_params.to_dict()
    assert (hints.num_nodes, hints.num_replicas) == (2, 3)
    assert alloc == Allocation(version=1, nodes=("node-0", "node-0", "node-1"))


# --- the simulator follows the coordinator's rules, whatever they are ----------------------

def test_a_changed_exploration_cap_prior_or_age_floor_reaches_the_simulator(monkeypatch):
    job = _job()
    now = _run(job, [1], 100.0, 300.0)
    assert job.job_info(now).max_replicas == 2
    monkeypatch.setattr(coordinator_jobs, "exploration_cap", lambda seen: 3 * max(seen, 1))
    assert job.job_info(now).max_replicas == 3
    fresh = _job()
    monkeypatch.setattr(coordinator_jobs, "MIN_AGE_S", 42.0)
    assert fresh.job_info(100.0).age == 42.0
    assert fresh.job_info(100.0).max_replicas == 3
    monkeypatch.setattr(coordinator_jobs, "prior_speedup",
                        lambda initial, up_to=None: lambda n, k: 7.0 * np.asarray(k))
    assert fresh.job_info(100.0).speedup_fn(np.array([1]), np.array([1]))[0] == 7.0


def test_the_model_functions_are_the_coordinators(monkeypatch):
    built = []

    def tagged(make):
        def build(hints, **kwargs):
            fn = make(hints, **kwargs)
            built.append(fn)
            return fn
        return build

    monkeypatch.setattr(coordinator_jobs, "model_speedup", tagged(model_speedup))
    monkeypatch.setattr(coordinator_jobs, "model_throughput", tagged(model_throughput))
    job = _job()
    info = job.job_info(_run(job, [1], 100.0, 300.0))
    assert len(built) == 2
    assert info.speedup_fn is built[0] and info.throughput_fn is built[1]
    again = job.job_info(400.0)  # the same model: built once, kept across rounds
    assert len(built) == 2 and again.speedup_fn is built[0]


def test_every_job_info_the_policy_sees_is_the_coordinators(monkeypatch):
    made: set[int] = set()

    def spy(*args, **kwargs):
        info = job_info(*args, **kwargs)
        made.add(id(info))
        return info

    class Check(Policy):
        name = "check"

        def optimize(self, jobs, nodes, current):
            assert jobs and all(id(j) in made for j in jobs)
            out = np.zeros((len(jobs), len(nodes)), dtype=int)
            for j in range(min(len(jobs), len(nodes))):
                out[j, j] = 1
            return out

    monkeypatch.setattr(coordinator_jobs, "job_info", spy)
    specs = [TraceJob("a", 0.0, "cifar10"), TraceJob("b", 30.0, "ncf")]
    res = simulate(specs, {"cifar10": load_model("cifar10"), "ncf": load_model("ncf")},
                   Check(), SimConfig(nodes=2, gpus_per_node=1, horizon=600.0))
    assert res.solve_ms and made

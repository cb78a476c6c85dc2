"""What the coordinator tells the policy about each kind of elasticity: a restart-elastic
job's measured restart cost is its re-allocation penalty, it takes what is free without
a model, and a fixed job is never resized or moved."""

import numpy as np

from pollux_launch.coordinator.jobs import job_info
from pollux_launch.messages import Allocation, JobGeneration, JobHints, JobSpec
from pollux_launch.policy import PolicyNode, make_policy
from pollux_launch.policy.objective import Objective
from pollux_launch.policy.rescale_cost import DEFAULT_STATE_BYTES, RescaleCost


def spec(name, kind, lo, hi, np_=None):
    return JobSpec(name=name, command=("python", "t.py"), initial_replicas=np_ or lo,
                   min_replicas=lo, max_replicas=hi, submit_time=1000.0, elasticity=kind,
                   reports_goodput=kind == "live")


def test_restart_job_cost_is_measured_and_its_prior_grows_to_max():
    s = spec("r", "restart", 1, 4)
    cost = RescaleCost(restart_s=3.0, checkpoint_bps=DEFAULT_STATE_BYTES)
    info = job_info(s, None, None, 1100.0, cost=cost)
    assert info.realloc_delay == 4.0  # nothing measured yet: the calibrated restart + reload
    k = np.array([1, 2, 4, 8])
    # 1 where the user asked (-np 1), as every job without a model, growing on to --max-np
    assert list(info.speedup_fn(np.ones(4, int), k)) == [1.0, 2.0, 4.0, 4.0]
    measured = JobGeneration(restarts=0, stop_s=0.5, startup_s=2.0)
    assert job_info(s, None, None, 1100.0, generation=measured).realloc_delay == 2.5
    live = job_info(spec("l", "live", 1, 4), None, None, 1100.0)
    assert live.realloc_delay == RescaleCost().expected_stall("live", DEFAULT_STATE_BYTES, 1)
    assert job_info(spec("l", "live", 1, 4), None, None, 1100.0,
                    live_delay=7.0).realloc_delay == 7.0  # the operator's --realloc-delay
    # a live job of the pollux API grows to -np until its model says more...
    assert list(live.speedup_fn(np.ones(4, int), k)) == [1.0, 1.0, 1.0, 1.0]
    # ...one that will never report one (plain Horovod Elastic) takes what is free
    hvd = JobSpec(name="h", command=("python", "t.py"), min_replicas=1, max_replicas=4,
                  framework="horovod", reports_goodput=False)
    assert list(job_info(hvd, None, None, 1100.0).speedup_fn(np.ones(4, int), k)) == \
        [1.0, 2.0, 4.0, 4.0]


def test_a_job_without_a_model_takes_free_slots_but_is_not_favoured():
    """A restart-elastic job at its -np is as well off as any job at its -np before a
    model: it grows into free slots (bounded or not), never at another's expense - a
    newcomer gets the free slot, not the live job's second one."""
    nodes = [PolicyNode("n", 4)]
    for hi in (4, 1_000_000):
        r = job_info(spec("r", "restart", 1, hi), None, Allocation(1, ("n",)), 1100.0)
        alone = make_policy("pollux-dp").optimize([r], nodes, np.array([[1]]))
        assert alone.sum() == 4, hi
        live = job_info(spec("l", "live", 1, 4, 2), None, Allocation(1, ("n", "n")), 1100.0)
        new = job_info(spec("m", "live", 1, 4), None, None, 1100.0)
        for name in ("pollux-dp", "pollux-ga"):
            out = make_policy(name).optimize([r, live, new], nodes, np.array([[1], [2], [0]]))
            assert list(out.sum(axis=1)) == [1, 2, 1], (name, hi)


def test_penalty_uses_each_jobs_own_delay():
    a = job_info(spec("a", "restart", 1, 2), None, Allocation(3, ("n",)), 1100.0,
                 generation=JobGeneration(startup_s=50.0))
    b = job_info(spec("b", "live", 1, 2), None, Allocation(3, ("n",)), 1100.0, live_delay=1.0)
    obj = Objective([a, b], [PolicyNode("n", 4)], np.array([[1], [1]]), delta=1.0)
    # (T - R*delta) / (T + delta) with T = 100 s, R = 2
    assert np.allclose(obj.penalty, [(100 - 2 * 50) / 150, (100 - 2 * 1) / 101])


def test_fixed_job_is_never_resized_or_moved():
    fixed = spec("f", "fixed", 2, 2)
    running = job_info(fixed, None, Allocation(1, ("n1", "n1")), 1100.0)
    assert not running.preemptible and running.min_replicas == running.max_replicas == 2
    newcomer = job_info(spec("l", "live", 1, 8, 4), None, None, 1100.0)
    nodes = [PolicyNode("n1", 4), PolicyNode("n2", 4)]
    current = np.array([[2, 0], [0, 0]])
    for name in ("pollux-dp", "pollux-ga"):
        out = make_policy(name).optimize([running, newcomer], nodes, current)
        assert list(out[0]) == [2, 0], name  # kept exactly where it runs
        assert out.sum(axis=1)[1] >= 1 and out.sum(axis=0).max() <= 4


def test_live_job_delta_is_its_measured_pause_else_the_calibrated_one():
    """A live job's penalty delta: the pause it reported (rescale_s), before that the
    calibrated model's for a typical state, and the operator's --realloc-delay over both."""
    cost = RescaleCost(grow_s=0.1, per_replica_s=0.0, broadcast_bps=1e9)
    hints = JobHints(init_batch_size=32, max_batch_size=256, local_bsz_bounds=(8, 64),
                     rescale_s=2.1)
    alloc = Allocation(version=2, nodes=("a", "a"))
    modelled = job_info(spec("l", "live", 1, 4), None, alloc, 1100.0, cost=cost)
    measured = job_info(spec("l", "live", 1, 4), hints, alloc, 1100.0, cost=cost)
    assert modelled.realloc_delay == 0.1 + DEFAULT_STATE_BYTES / 1e9
    assert measured.realloc_delay == 2.1
    assert job_info(spec("l", "live", 1, 4), hints, alloc, 1100.0, cost=cost,
                    live_delay=5.0).realloc_delay == 5.0


def test_a_policys_replica_request_is_the_jobs_range_within_its_limits():
    """An adaptation policy's request narrows (or lifts past the exploration cap) the
    replica range the policy sees, never beyond the spec's --min-np/--max-np; the DP
    then allocates inside it."""
    base = dict(init_batch_size=32, max_batch_size=256, local_bsz_bounds=(8, 64))
    s = spec("w", "live", 1, 6)
    alloc = Allocation(version=1, nodes=("a",))
    plain = job_info(s, JobHints(**base), alloc, 1100.0)
    assert (plain.min_replicas, plain.max_replicas) == (1, 6)
    for wanted, expect in [((3, 3), (3, 3)), ((2, None), (2, 6)), ((1, 2), (1, 2)),
                           ((9, 9), (6, 6))]:
        hints = JobHints(**base, min_replicas_wanted=wanted[0], max_replicas_wanted=wanted[1])
        info = job_info(s, hints, alloc, 1100.0)
        assert (info.min_replicas, info.max_replicas) == expect, wanted
    hints = JobHints(**base, min_replicas_wanted=3, max_replicas_wanted=3)
    policy = make_policy("pollux-dp")
    got = policy.optimize([job_info(s, hints, alloc, 1100.0)], [PolicyNode("a", 4)],
                          np.array([[1]]))
    assert got.sum() == 3  # grown from 1 to the 3 asked for (its prior alone keeps 1)

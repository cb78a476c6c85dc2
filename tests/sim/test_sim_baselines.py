"""TunedJobs baselines: gang scheduling at the tuned size, FIFO vs two-level LAS."""

import numpy as np
import pytest

from pollux_launch.policy import JobInfo, PolicyNode
from pollux_launch.sim.baselines import BASELINES, TunedJobsPolicy


def _job(name, replicas, age):
    return JobInfo(name=name, speedup_fn=lambda n, r: np.asarray(r, float), age=age,
                   max_replicas=replicas)


NODES = [PolicyNode("n0", 4), PolicyNode("n1", 4)]


def test_gang_sizes_packing_and_capacity():
    policy = TunedJobsPolicy("fifo")
    jobs = [_job("a", 6, 100.0), _job("b", 4, 50.0), _job("c", 2, 10.0)]
    out = policy.optimize(jobs, NODES, np.zeros((3, 2), int))
    # a (oldest) gets 6 GPUs packed 4 + 2; b (4) does not fit; c (2) fills the gap.
    assert out.sum(axis=1).tolist() == [6, 0, 2]
    assert sorted(out[0].tolist()) == [2, 4]
    assert (out.sum(axis=0) <= 4).all()


def test_running_jobs_keep_their_gpus():
    policy = TunedJobsPolicy("fifo")
    current = np.array([[1, 1], [0, 0]])
    out = policy.optimize([_job("a", 2, 100.0), _job("b", 2, 10.0)], NODES, current)
    assert out[0].tolist() == [1, 1]
    assert out[1].sum() == 2 and (out.sum(axis=0) <= 4).all()


def test_las_demotes_a_job_past_the_threshold_fifo_does_not():
    for discipline, winner in (("las", "b"), ("fifo", "a")):
        policy = TunedJobsPolicy(discipline, queue_threshold=8 * 100.0)
        nodes = [PolicyNode("n0", 8)]
        out = policy.optimize([_job("a", 8, 0.0)], nodes, np.zeros((1, 1), int))
        assert out.tolist() == [[8]]
        # 150 s later a has attained 8 GPUs x 150 s > threshold; b has just arrived.
        jobs = [_job("a", 8, 150.0), _job("b", 8, 0.0)]
        out = policy.optimize(jobs, nodes, np.array([[8], [0]]))
        assert out[[j.name for j in jobs].index(winner)].sum() == 8, discipline


def test_registry_and_bad_discipline():
    assert set(BASELINES) == {"tuned-las", "tuned-fifo"}
    assert BASELINES["tuned-las"]().name == "tuned-las"
    with pytest.raises(ValueError, match="unknown TunedJobs discipline"):
        TunedJobsPolicy("srtf")

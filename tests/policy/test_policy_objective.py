"""The objective's pure helpers: Eqn 14 fitness, Eqn 15 fair share, re-allocation penalty."""

import numpy as np
import pytest

from pollux_launch.policy import evaluate_fitness, fair_share, fitness, reallocation_penalty
from pollux_launch.policy.objective import packed_nodes

from .synthetic import make_jobs, make_nodes


def test_fitness_is_the_power_mean():
    s = np.array([1.0, 2.0, 4.0])
    assert fitness(s, 1.0, eps=0) == pytest.approx(7 / 3)
    assert fitness(s, -1.0, eps=0) == pytest.approx(3 / (1 + 0.5 + 0.25))
    # vectorised over a population axis
    both = fitness(np.stack([s, s * 2]), -1.0, eps=0)
    assert both.shape == (2,) and both[1] == pytest.approx(2 * both[0])


def test_fitness_tends_to_the_minimum_for_very_negative_p():
    s = np.array([0.5, 3.0, 9.0])
    assert fitness(s, -400.0, eps=0) == pytest.approx(0.5, rel=1e-2)
    assert np.isfinite(fitness(np.array([0.0, 1.0]), -400.0))


@pytest.mark.parametrize("p", [0, 0.0, float("nan"), float("-inf")])
def test_fitness_rejects_bad_p(p):
    with pytest.raises(ValueError, match="p="):
        fitness(np.ones(2), p)


def test_reallocation_penalty():
    assert reallocation_penalty(270.0, 0, 30.0) == pytest.approx(0.9)
    assert reallocation_penalty(270.0, 2, 30.0) == pytest.approx(210 / 300)
    assert reallocation_penalty(30.0, 5, 30.0) == 0.0  # clipped at 0
    # continuous at T = 0 (the Pollux artifact's 0, not a jump to 1 for brand-new jobs)
    assert reallocation_penalty(0.0, 0, 30.0) == 0.0
    assert reallocation_penalty(1e-6, 0, 30.0) == pytest.approx(0.0, abs=1e-6)
    assert reallocation_penalty(5.0, 3, 0.0) == 1.0  # free changes are not penalised
    out = reallocation_penalty(np.array([0.0, 90.0, 9.0]), np.array([0, 1, 0]),
                               np.array([30.0, 30.0, 1.0]))  # per-job delta
    np.testing.assert_allclose(out, [0.0, 0.5, 0.9])


def test_fair_share_and_packed_nodes():
    nodes = make_nodes(4, 4)
    jobs = make_jobs([(0.1, 0.1)] * 3 + [{"min_replicas": 8}])
    np.testing.assert_array_equal(fair_share(jobs, nodes), [4, 4, 4, 8])
    np.testing.assert_array_equal(packed_nodes([0, 1, 4, 5, 16, 99], [4] * 4), [0, 1, 1, 2, 4, 4])
    np.testing.assert_array_equal(packed_nodes([3, 6, 7], [2, 4, 1]), [1, 2, 3])


def test_speedups_are_normalised_to_the_fair_share():
    nodes = make_nodes(2, 4)
    jobs = make_jobs([(0.0, 0.0), (0.0, 0.0)])
    # fair share is 4 GPUs each: exactly the fair share scores 1 per job
    alloc = np.array([[4, 0], [0, 4]])
    assert evaluate_fitness(jobs, nodes, alloc, alloc) == pytest.approx(1.0, rel=1e-2)

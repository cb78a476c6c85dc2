"""The NSGA-II loop of ``pollux-ga``: duplicate elimination, survival, warm start."""

import numpy as np

from pollux_launch.policy import make_policy
from pollux_launch.policy.ga import _survive, _unique

from .synthetic import random_round


def test_unique_keeps_first_occurrences_and_skips_seen_states():
    states = np.array([[[1, 0]], [[0, 1]], [[1, 0]], [[2, 0]]])
    seen = {np.array([2, 0]).tobytes()}
    np.testing.assert_array_equal(_unique(states, seen), [0, 1])
    assert len(seen) == 3


def test_survival_keeps_whole_fronts_in_rank_order():
    # minimisation: (0,0) dominates everything; (1,2) and (2,1) form front 1; (3,3) last.
    F = np.array([[3.0, 3.0], [1.0, 2.0], [0.0, 0.0], [2.0, 1.0]])
    keep, ranks, _ = _survive(F, 3, np.random.default_rng(0))
    assert sorted(keep.tolist()) == [1, 2, 3]
    assert dict(zip(keep.tolist(), ranks.tolist(), strict=True)) == {2: 0, 1: 1, 3: 1}


def test_survival_cuts_the_last_front_to_the_population_size():
    # front 0 holds two points and front 1 two more: three survivors, not four.
    F = np.array([[0.0, 1.0], [1.0, 0.0], [2.0, 2.0], [3.0, 1.5]])
    keep, ranks, _ = _survive(F, 3, np.random.default_rng(0))
    assert len(keep) == 3 and {0, 1} <= set(keep.tolist())
    assert sorted(ranks.tolist()) == [0, 0, 1]


def test_final_population_has_no_duplicates_and_warm_starts_the_next_round():
    jobs, nodes, current = random_round(np.random.default_rng(3), 6, 8, 4)
    pol = make_policy("pollux-ga", pop_size=30, n_gen=15, seed=1)
    pol.optimize(jobs, nodes, current)
    pop, job_names, node_names = pol._prev
    flat = pop.reshape(len(pop), -1)
    assert len(np.unique(flat, axis=0)) == len(flat) == 30
    assert sorted(job_names) == sorted(j.name for j in jobs)
    assert node_names == [n.name for n in nodes]
    # the next round starts from that population (plus the current allocation)
    sampling = pol._warm_start(pop[0], job_names, node_names)
    assert sampling.shape == (31, *pop.shape[1:])
    np.testing.assert_array_equal(sampling[1:], pop)

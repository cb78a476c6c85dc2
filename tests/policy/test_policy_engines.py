"""Both engines on small hand-checkable clusters, random instances, and bad input."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pollux_launch.policy import (
    DEFAULT_POLICY,
    POLICIES,
    check_allocation,
    evaluate_fitness,
    job_speedups,
    make_policy,
    register_policy,
    unregister_policy,
)
from pollux_launch.policy.placement import allocation_violations

from .synthetic import make_jobs, make_nodes, random_round

# A small GA budget keeps tests fast; the benchmark runs the paper's (100 x 100).
GA_SMALL = {"pop_size": 40, "n_gen": 40}
ENGINES = [("pollux-dp", {}), ("pollux-ga", GA_SMALL)]


def solve(name, jobs, nodes, current=None, **options):
    opts = dict(dict(ENGINES)[name], **options)
    current = np.zeros((len(jobs), len(nodes)), dtype=np.int64) if current is None else current
    alloc = make_policy(name, **opts).optimize(jobs, nodes, current)
    check_allocation(alloc, nodes, jobs, current, opts.get("interference_avoidance", True))
    return alloc


def brute_force_single_node(jobs, slots, p):
    """Best FITNESS_p over every split of one node among the jobs (known optimum)."""
    nodes = make_nodes(1, slots)
    zero = np.zeros((len(jobs), 1), dtype=np.int64)
    best = -1.0
    for ks in itertools.product(range(slots + 1), repeat=len(jobs)):
        if sum(ks) <= slots:
            alloc = np.array(ks).reshape(-1, 1)
            best = max(best, evaluate_fitness(jobs, nodes, alloc, zero, p))
    return best


@pytest.mark.parametrize("name", [n for n, _ in ENGINES])
def test_identical_linear_jobs_split_a_node_evenly(name):
    jobs = make_jobs([(0.0, 0.0), (0.0, 0.0)])
    alloc = solve(name, jobs, make_nodes(1, 4))
    np.testing.assert_array_equal(alloc.sum(axis=1), [2, 2])


@pytest.mark.parametrize("name", [n for n, _ in ENGINES])
def test_plain_sum_gives_gpus_to_the_job_that_scales(name):
    # job0 scales perfectly even across nodes; job1 gains nothing beyond 1 GPU.
    jobs = make_jobs([(0.0, 0.0), (1.0, 0.0)])
    alloc = solve(name, jobs, make_nodes(2, 4), p=1.0)
    np.testing.assert_array_equal(alloc.sum(axis=1), [7, 1])


@pytest.mark.parametrize("p", [-1.0, -4.0, 0.5, 1.0])
@pytest.mark.parametrize("name", [n for n, _ in ENGINES])
def test_matches_brute_force_optimum_on_one_node(name, p):
    jobs = make_jobs([(0.02, 0.2), (0.3, 0.2), (0.7, 0.2)])
    best = brute_force_single_node(jobs, 6, p)
    alloc = solve(name, jobs, make_nodes(1, 6), p=p)
    got = evaluate_fitness(jobs, make_nodes(1, 6), alloc, np.zeros_like(alloc), p)
    if name == "pollux-dp":
        assert got == pytest.approx(best, rel=1e-9)
    else:
        assert got >= 0.99 * best


def test_very_negative_p_approaches_max_min_fairness():
    jobs = make_jobs([(0.0, 0.2), (0.2, 0.2), (0.6, 0.2), (0.9, 0.2)])
    nodes = make_nodes(1, 12)
    zero = np.zeros((4, 1), dtype=np.int64)
    best_min = 0.0
    for ks in itertools.product(range(13), repeat=4):
        if sum(ks) <= 12:
            s = job_speedups(jobs, nodes, np.array(ks).reshape(-1, 1), zero)
            best_min = max(best_min, float(s.min()))
    mins = []
    for p in [1.0, -1.0, -10.0, -60.0]:
        alloc = solve("pollux-dp", jobs, nodes, p=p)
        mins.append(float(job_speedups(jobs, nodes, alloc, zero).min()))
    assert mins[-1] == pytest.approx(best_min, rel=1e-6)
    assert mins == sorted(mins)  # fairer with every step of p
    assert mins[0] < best_min


@pytest.mark.parametrize("name", [n for n, _ in ENGINES])
def test_interference_avoidance_keeps_distributed_jobs_apart(name):
    # Two jobs that scale perfectly across nodes, 3 nodes: with avoidance they cannot
    # share a node while both span nodes.
    jobs = make_jobs([(0.0, 0.0), (0.0, 0.0)])
    nodes = make_nodes(3, 4)
    alloc = solve(name, jobs, nodes)
    assert not allocation_violations(alloc, nodes, interference_avoidance=True)
    assert alloc.sum() <= 12
    free = solve(name, jobs, nodes, interference_avoidance=False)
    assert free.sum() >= alloc.sum()


@pytest.mark.parametrize("name", [n for n, _ in ENGINES])
def test_penalty_keeps_a_young_job_in_place_when_gains_are_small(name):
    nodes = make_nodes(1, 4)
    current = np.array([[3], [1]])
    young = make_jobs([{"serial": 0.0, "age": 60.0, "restarts": 1}] * 2)
    np.testing.assert_array_equal(solve(name, young, nodes, current), current)
    old = make_jobs([{"serial": 0.0, "age": 1e6, "restarts": 1}] * 2)
    np.testing.assert_array_equal(solve(name, old, nodes, current).sum(axis=1), [2, 2])


@pytest.mark.parametrize("name", [n for n, _ in ENGINES])
def test_limits_and_non_preemptible_jobs(name):
    nodes = make_nodes(2, 4)
    jobs = make_jobs(
        [
            {"serial": 0.0, "max_replicas": 1},
            {"serial": 0.0, "min_replicas": 3},
            {"serial": 0.9, "preemptible": False},  # hogs a node while gaining little
            {"serial": 0.0, "preemptible": False},  # not running yet: free to place
        ]
    )
    current = np.array([[0, 0], [0, 0], [4, 0], [0, 0]])
    alloc = solve(name, jobs, nodes, current)
    k = alloc.sum(axis=1)
    assert k[0] <= 1 and (k[1] == 0 or k[1] >= 3)
    np.testing.assert_array_equal(alloc[2], [4, 0])
    assert k[3] >= 1


@pytest.mark.parametrize("name", [n for n, _ in ENGINES])
def test_deterministic_under_a_fixed_seed(name):
    jobs, nodes, current = random_round(np.random.default_rng(5), 6, 9)
    a = [make_policy(name, seed=3, **dict(ENGINES)[name]) for _ in range(2)]
    r1 = [a[0].optimize(jobs, nodes, current) for _ in range(2)]  # second call warm-starts
    r2 = [a[1].optimize(jobs, nodes, current) for _ in range(2)]
    for x, y in zip(r1, r2, strict=True):
        np.testing.assert_array_equal(x, y)


def test_default_is_at_least_as_fit_as_the_ga():
    rng = np.random.default_rng(11)
    for _ in range(3):
        jobs, nodes, current = random_round(rng, 8, 12)
        f = {
            n: evaluate_fitness(jobs, nodes, solve(n, jobs, nodes, current), current)
            for n, _ in ENGINES
        }
        assert f[DEFAULT_POLICY] >= 0.99 * f["pollux-ga"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_nodes=st.integers(1, 6),
    n_jobs=st.integers(1, 10),
    slots=st.sampled_from([1, 2, 4, 8]),
    ia=st.booleans(),
    p=st.sampled_from([-2.0, -1.0, 1.0]),
)
def test_random_rounds_never_break_constraints(seed, n_nodes, n_jobs, slots, ia, p):
    jobs, nodes, current = random_round(np.random.default_rng(seed), n_nodes, n_jobs, slots)
    for name, opts in [("pollux-dp", {}), ("pollux-ga", {"pop_size": 10, "n_gen": 3})]:
        pol = make_policy(name, p=p, interference_avoidance=ia, seed=seed, **opts)
        alloc = pol.optimize(jobs, nodes, current)
        assert alloc.shape == current.shape
        check_allocation(alloc, nodes, jobs, current, ia)


def test_empty_rounds():
    for name, opts in ENGINES:
        pol = make_policy(name, **opts)
        assert pol.optimize([], make_nodes(2), np.zeros((0, 2))).shape == (0, 2)
        jobs = make_jobs([(0.1, 0.1)])
        assert pol.optimize(jobs, [], np.zeros((1, 0))).shape == (1, 0)


def test_bad_options_and_inputs_are_clear_value_errors():
    with pytest.raises(ValueError, match=r"unknown policy 'nope'.*pollux-dp"):
        make_policy("nope")
    for name, _ in ENGINES:
        with pytest.raises(ValueError, match="p=0"):
            make_policy(name, p=0)
        with pytest.raises(ValueError, match="bad option"):
            make_policy(name, colour="red")
        with pytest.raises(ValueError, match="delta"):
            make_policy(name, delta=-1)
    pol = make_policy(DEFAULT_POLICY)
    jobs = make_jobs([(0.1, 0.1)])
    with pytest.raises(ValueError, match="shape"):
        pol.optimize(jobs, make_nodes(2), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="min_replicas"):
        pol.optimize(make_jobs([{"min_replicas": 4, "max_replicas": 2}]), make_nodes(1), None)


def test_registering_an_engine_never_replaces_one_silently():
    from pollux_launch.policy.dp import DPPolicy

    built = POLICIES["pollux-dp"]
    register_policy("test-dp", lambda **o: DPPolicy(**o))
    try:
        assert isinstance(make_policy("test-dp", p=-1), DPPolicy)
        with pytest.raises(ValueError, match="'pollux-dp' is already registered"):
            register_policy("pollux-dp", lambda **o: DPPolicy(**o))
        assert POLICIES["pollux-dp"] is built
        register_policy("test-dp", built, replace=True)
        assert POLICIES["test-dp"] is built
        with pytest.raises(ValueError, match="callable"):
            register_policy("x", "pollux_launch.policy.dp:DPPolicy")
    finally:
        unregister_policy("test-dp")  # tests never leak registrations
    assert "test-dp" not in POLICIES

"""saxena-dp: Saxena et al.'s throughput-maximising DP, its placement, limits and inputs."""

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from pollux_launch.goodput import PerfParams, ThroughputFunction
from pollux_launch.policy import JobInfo, check_allocation, make_policy
from pollux_launch.policy.placement import allocation_violations
from pollux_launch.policy.saxena import SaxenaDPPolicy, max_throughput_counts

from .synthetic import Amdahl, make_jobs, make_nodes, random_round


@dataclass(frozen=True)
class Rate:
    """samples/s = rate * k / (1 + serial * (k - 1)) * (1 - cross_node * [n > 1])."""

    rate: float = 100.0
    serial: float = 0.0
    cross_node: float = 0.0

    def __call__(self, num_nodes, num_replicas):
        return self.rate * Amdahl(self.serial, self.cross_node)(num_nodes, num_replicas)


@dataclass(frozen=True)
class Flat:
    """The same samples/s on any number of GPUs (0 on none)."""

    rate: float

    def __call__(self, num_nodes, num_replicas):
        return np.where(np.asarray(num_replicas) > 0, self.rate, 0.0)


def job(name, fn, **kw):
    return JobInfo(name, Amdahl(), 3600.0, throughput_fn=fn, **kw)


def solve(jobs, nodes, current=None, **options):
    current = np.zeros((len(jobs), len(nodes)), dtype=np.int64) if current is None else current
    alloc = make_policy("saxena-dp", **options).optimize(jobs, nodes, current)
    check_allocation(alloc, nodes, jobs, current, options.get("interference_avoidance", True))
    return alloc


def total_rate(jobs, alloc):
    rows = zip(jobs, alloc, strict=True)
    return sum(float(j.throughput_fn(np.count_nonzero(r), r.sum())) for j, r in rows)


# ---------------------------------------------------------------- the DP alone
def brute_force_counts(rates, lo, budget):
    best = -np.inf
    for ks in itertools.product(*[range(a, len(r)) for a, r in zip(lo, rates, strict=True)]):
        if sum(ks) <= budget:
            best = max(best, sum(r[k] for r, k in zip(rates, ks, strict=True)))
    return best


def test_dp_equals_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    for _ in range(300):
        J = int(rng.integers(1, 5))
        rates = [np.append(0.0, rng.uniform(0, 10, int(rng.integers(1, 6)))) for _ in range(J)]
        if rng.random() < 0.5:  # concave, increasing tables too (the usual case)
            rates = [np.append(0.0, np.cumsum(np.sort(r[1:])[::-1])) for r in rates]
        lo = np.array([int(rng.integers(0, min(3, len(r)))) for r in rates])
        budget = int(lo.sum() + rng.integers(0, 8))
        counts = max_throughput_counts(rates, lo, budget)
        assert counts.sum() <= budget
        assert all(lo[j] <= counts[j] < len(rates[j]) for j in range(J))
        got = sum(r[k] for r, k in zip(rates, counts, strict=True))
        assert got == pytest.approx(brute_force_counts(rates, lo, budget), abs=1e-9)


def test_dp_every_job_at_least_one_even_when_zero_would_sum_higher():
    # A gains 100 per GPU, B 50 on any number: without the floor A would take all 4
    rates = [100.0 * np.arange(5), np.array([0, 50, 50, 50, 50.0])]
    np.testing.assert_array_equal(max_throughput_counts(rates, [1, 1], 4), [3, 1])
    np.testing.assert_array_equal(max_throughput_counts(rates, [0, 0], 4), [4, 0])


def test_dp_leaves_gpus_idle_where_throughput_falls():
    rates = [np.array([0, 10, 12, 11, 9.0])]
    np.testing.assert_array_equal(max_throughput_counts(rates, [1], 4), [2])


def test_dp_bad_input_is_one_line():
    for args, match in [
        (([np.arange(3.0)], [3], 5), "allowed count"),
        (([np.arange(3.0)] * 2, [2, 2], 3), "need 4 GPUs at least but 3 are free"),
        (([np.arange(3.0)], [1, 1], 3), "2 lower bounds"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            max_throughput_counts(*args)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the engine
def test_hand_checked_split_of_one_node():
    # A scales linearly (100/GPU), B does not scale (50): A 3, B 1 (Saxena's floor)
    jobs = [job("a", Rate(100.0)), job("b", Flat(50.0))]
    np.testing.assert_array_equal(solve(jobs, make_nodes(1, 4)).sum(axis=1), [3, 1])


def test_raw_samples_per_second_not_speedups():
    # same scaling, A processes 10x the samples: A takes every GPU beyond B's one;
    # normalize=True counts each job in its own per-GPU units: an even split
    jobs = [job("a", Rate(1000.0, serial=0.1)), job("b", Rate(100.0, serial=0.1))]
    nodes = make_nodes(1, 8)
    np.testing.assert_array_equal(solve(jobs, nodes).sum(axis=1), [7, 1])
    np.testing.assert_array_equal(solve(jobs, nodes, normalize=True).sum(axis=1), [4, 4])


@pytest.mark.parametrize("seed", range(6))
def test_one_node_matches_brute_force_over_allocations(seed):
    rng = np.random.default_rng(seed)
    slots = 6
    jobs = [
        job(f"j{i}", Rate(float(rng.uniform(10, 1000)), float(rng.uniform(0, 1))),
            max_replicas=int(rng.integers(1, 7)))
        for i in range(3)
    ]
    best = max(
        sum(float(j.throughput_fn(1, k)) for j, k in zip(jobs, ks, strict=True))
        for ks in itertools.product(*[range(1, j.max_replicas + 1) for j in jobs])
        if sum(ks) <= slots
    )
    alloc = solve(jobs, make_nodes(1, slots))
    assert total_rate(jobs, alloc) == pytest.approx(best, rel=1e-12)


def test_fragmented_nodes_prefer_compact_rows():
    # five jobs on 4 nodes of 4: the DP's counts (4, 3, 3, 3, 3) leave holes of 1; the
    # engine compares a spread row with a compact one plus growing the others
    jobs = [job(f"j{i}", Rate(100.0, serial=0.05, cross_node=0.6)) for i in range(5)]
    nodes = make_nodes(4, 4)
    alloc = solve(jobs, nodes)
    assert np.all(alloc.sum(axis=1) >= 1)
    assert np.all(np.count_nonzero(alloc, axis=1) == 1)  # nobody pays the cross-node cost
    assert alloc.sum() == 16


@pytest.mark.parametrize("ia", [True, False])
def test_every_job_gets_a_gpu_when_there_are_enough(ia):
    rng = np.random.default_rng(3)
    for _ in range(40):
        n_nodes, slots = int(rng.integers(1, 6)), int(rng.choice([1, 2, 4, 8]))
        n_jobs = int(rng.integers(1, n_nodes * slots + 1))
        jobs = [
            job(f"j{i}", Rate(float(rng.uniform(1, 100)), float(rng.uniform(0, 1)),
                              float(rng.uniform(0, 0.9))),
                max_replicas=int(rng.integers(1, 3 * slots + 1)))
            for i in range(n_jobs)
        ]
        alloc = solve(jobs, make_nodes(n_nodes, slots), interference_avoidance=ia)
        assert np.all(alloc.sum(axis=1) >= 1)
        caps = np.array([j.max_replicas for j in jobs])
        assert np.all(alloc.sum(axis=1) <= caps)


def test_more_jobs_than_gpus_are_admitted_in_input_order():
    jobs = [job(f"j{i}", Rate(100.0)) for i in range(6)]
    np.testing.assert_array_equal(solve(jobs, make_nodes(2, 2)).sum(axis=1), [1, 1, 1, 1, 0, 0])
    # a minimum that no longer fits is skipped; a later, smaller one still runs
    jobs = [job("big", Rate(100.0), min_replicas=3), job("too-big", Rate(100.0), min_replicas=2),
            job("small", Rate(1.0))]
    np.testing.assert_array_equal(solve(jobs, make_nodes(1, 4)).sum(axis=1), [3, 0, 1])


def test_limits_and_non_preemptible_jobs():
    nodes = make_nodes(2, 4)
    jobs = [
        job("capped", Rate(100.0), max_replicas=1),
        job("min3", Rate(10.0), min_replicas=3),
        job("pinned", Rate(1.0), preemptible=False),  # running: keeps its node
        job("not-yet", Rate(100.0), preemptible=False),  # not running: free to place
        job("never", Rate(100.0), max_replicas=0),
    ]
    current = np.array([[0, 0], [0, 0], [4, 0], [0, 0], [0, 0]])
    alloc = solve(jobs, nodes, current)
    k = alloc.sum(axis=1)
    np.testing.assert_array_equal(alloc[2], [4, 0])
    assert k[0] == 1 and k[1] == 3 and k[4] == 0
    # 4 free GPUs: "capped" and "min3" (input order) take them all, "not-yet" waits
    assert k[3] == 0


def test_unknown_throughput_scales_the_speedup_shape_to_a_typical_job():
    # b has no throughput_fn: its speedup (linear) is scaled to a's rate on one GPU
    # (100/s), so it scales better than a and takes the GPUs; unscaled (1/s per GPU)
    # it would have got one
    a = job("a", Rate(100.0, serial=0.5))
    b = JobInfo("b", Amdahl(0.0, 0.0), 3600.0)
    np.testing.assert_array_equal(solve([a, b], make_nodes(1, 8)).sum(axis=1), [1, 7])
    # with no throughput_fn at all, the speedups are summed as they are
    jobs = make_jobs([(0.0, 0.0), (0.9, 0.0)])
    np.testing.assert_array_equal(solve(jobs, make_nodes(1, 8)).sum(axis=1), [7, 1])


def test_goodput_core_throughput_functions_run_at_their_best_batch():
    perf = PerfParams(0.02, 0.0004, 0.01, 0.002, 0.08, 0.004, 1.5)
    fns = [
        ThroughputFunction(perf, min_batch_size=128, max_batch_size=hi, local_bsz_bounds=(16, 256))
        for hi in (256, 8192)
    ]
    jobs = [job(f"j{i}", fn) for i, fn in enumerate(fns)]
    alloc = solve(jobs, make_nodes(2, 4))
    k = alloc.sum(axis=1)
    assert k[1] > k[0] >= 1  # a job limited to small batches gains little from more GPUs
    m, s = fns[1].best_batch(np.count_nonzero(alloc[1]), k[1])
    assert 128 <= k[1] * m * (s + 1) <= 8192


def test_random_rounds_never_break_constraints():
    rng = np.random.default_rng(7)
    for _ in range(60):
        jobs, nodes, current = random_round(
            rng, int(rng.integers(1, 6)), int(rng.integers(1, 10)), int(rng.choice([1, 2, 4]))
        )
        ia = bool(rng.random() < 0.5)
        alloc = make_policy("saxena-dp", interference_avoidance=ia).optimize(jobs, nodes, current)
        assert not allocation_violations(alloc, nodes, jobs, current, ia)


def test_common_options_and_bad_input():
    pol = make_policy("saxena-dp", p=-1, delta=30.0, interference_avoidance=False, seed=3)
    assert isinstance(pol, SaxenaDPPolicy) and pol.name == "saxena-dp"
    for bad, match in [({"p": 0}, "p=0"), ({"delta": -1}, "delta"), ({"colour": 1}, "bad option")]:
        with pytest.raises(ValueError, match=match):
            make_policy("saxena-dp", **bad)
    jobs = [job("a", Rate())]
    with pytest.raises(ValueError, match="shape"):
        pol.optimize(jobs, make_nodes(2), np.zeros((2, 2)))
    assert pol.optimize([], make_nodes(2), np.zeros((0, 2))).shape == (0, 2)
    assert pol.optimize(jobs, [], np.zeros((1, 0))).shape == (1, 0)

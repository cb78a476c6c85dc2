"""ThroughputFunction: samples/s at the best batch size in a range (Eqn 7-11, no Eqn 6)."""

import numpy as np
import pytest

from pollux_launch.goodput import (
    GoodputFunction,
    GradParams,
    PerfParams,
    ThroughputFunction,
    predict_step_time,
)

PERF = PerfParams(alpha_grad=0.02, beta_grad=0.0004, alpha_local=0.01, beta_local=0.002,
                  alpha_node=0.08, beta_node=0.004, gamma=1.5, grad_exponent=1.1,
                  node_contention=0.05)
LO, HI, BOUNDS = 128, 4096, (16, 256)


def make(**kw):
    args = {"min_batch_size": LO, "max_batch_size": HI, "local_bsz_bounds": BOUNDS, **kw}
    return ThroughputFunction(PERF, **args)


def brute_force(n, k, lo=LO, hi=HI, bounds=BOUNDS, accumulation=True):
    """Best M / T_iter over every integer m in bounds and s, with lo <= M <= hi."""
    best = 0.0
    m = np.arange(bounds[0], bounds[1] + 1)
    for s in range(40 if accumulation else 1):
        total = k * m * (s + 1)
        ok = (total >= lo) & (total <= hi)
        if ok.any():
            rate = total[ok] / predict_step_time(PERF, n, k, m[ok], s)
            best = max(best, float(rate.max()))
    return best


ALLOCS = [(1, 1), (1, 2), (1, 4), (2, 5), (2, 8), (4, 16), (8, 32), (3, 30)]


@pytest.mark.parametrize("accumulation", [True, False])
def test_close_to_brute_force_over_every_batch_in_the_range(accumulation):
    fn = make(accumulation=accumulation)
    for n, k in ALLOCS:
        want = brute_force(n, k, accumulation=accumulation)
        got = float(fn(n, k))
        assert got <= want * (1 + 1e-9)
        assert got >= 0.99 * want  # a 48-point geometric grid of total batches


def test_best_batch_lies_in_the_range_and_the_bounds_and_reaches_the_rate():
    fn = make()
    n = np.array([a for a, _ in ALLOCS])
    k = np.array([b for _, b in ALLOCS])
    m, s = fn.best_batch(n, k)
    total = k * m * (s + 1)
    assert np.all((m >= BOUNDS[0]) & (m <= BOUNDS[1]) & (s >= 0))
    assert np.all((total >= LO) & (total <= HI))
    np.testing.assert_allclose(fn(n, k), total / predict_step_time(PERF, n, k, m, s))
    # the same number as Pollux's goodput function reports as throughput at (m, s)
    pollux = GoodputFunction(PERF, GradParams(0.01, 0.5), LO)
    np.testing.assert_allclose(fn(n, k), pollux.throughput(n, k, m, s))


def test_no_statistical_efficiency_so_the_largest_batch_wins_on_one_gpu():
    # compute dominates and grows linearly: the rate rises with M, so M goes to the top
    fn = make()
    m, s = fn.best_batch(1, 1)
    assert int(m) * (int(s) + 1) == HI


def test_monotone_in_the_range_and_zero_at_zero_replicas():
    k = np.arange(0, 33)
    n = np.where(k > 0, (k + 3) // 4, 0)
    narrow, wide = make(max_batch_size=1024)(n, k), make()(n, k)
    assert np.all(wide >= narrow * (1 - 1e-12))  # a wider range never lowers the rate
    assert wide[0] == 0 and np.all(wide[1:] > 0)
    # cheap synchronisation on one node: more GPUs, more samples per second
    cheap = ThroughputFunction(
        PerfParams(0.02, 0.0004, 0.001, 0.0, 0.001, 0.0, 1.0),
        min_batch_size=LO, max_batch_size=HI, local_bsz_bounds=BOUNDS,
    )
    rates = cheap(np.ones(8, dtype=int), np.arange(1, 9))
    assert np.all(np.diff(rates) > 0)


def test_fixed_batch_size_pins_the_total_batch():
    fn = make(fixed_batch_size=512)
    for n, k in [(1, 1), (1, 4), (2, 8)]:
        m, s = fn.best_batch(n, k)
        assert k * int(m) * (int(s) + 1) == 512
        assert float(fn(n, k)) == pytest.approx(512 / float(predict_step_time(PERF, n, k, m, s)))


def test_no_fit_is_zero():
    # without accumulation, 1 GPU holds at most 256 samples: below the range's 512
    fn = make(min_batch_size=512, accumulation=False)
    assert float(fn(1, 1)) == 0 and fn.best_batch(1, 1) == (0, 0)
    assert float(fn(1, 2)) > 0


def test_shapes_and_memo():
    fn = make()
    n = np.array([[1, 1], [2, 0]])
    k = np.array([[1, 4], [8, 0]])
    first = fn(n, k)
    assert first.shape == (2, 2) and first[1, 1] == 0
    np.testing.assert_array_equal(fn(n, k), first)
    np.testing.assert_array_equal(fn(n.ravel(), k.ravel()), first.ravel())
    assert fn(np.zeros(0, dtype=int), np.zeros(0, dtype=int)).shape == (0,)
    np.testing.assert_array_equal(fn(1, np.array([1, 2, 3])), fn([1, 1, 1], [1, 2, 3]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"perf": (1, 2, 3)}, "PerfParams"),
        ({"min_batch_size": 0}, "min_batch_size"),
        ({"max_batch_size": 64}, r"max_batch_size \(64\) must be >= min_batch_size"),
        ({"min_batch_size": 12.5}, "min_batch_size"),
        ({"local_bsz_bounds": (32, 16)}, "local_bsz_bounds"),
        ({"local_bsz_bounds": 32}, "local_bsz_bounds"),
        ({"fixed_batch_size": -1}, "fixed_batch_size"),
    ],
)
def test_bad_construction_is_one_line(kwargs, match):
    args = {"perf": PERF, "min_batch_size": LO, "max_batch_size": HI,
            "local_bsz_bounds": BOUNDS, **kwargs}
    perf = args.pop("perf")
    with pytest.raises(ValueError, match=match) as err:
        ThroughputFunction(perf, **args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("n", "k"), [([1], [-1]), ([2], [1]), ([0], [3]), ([1, 1], [1, 2, 3]), ([1.5], [2])]
)
def test_bad_allocations_are_one_line(n, k):
    with pytest.raises(ValueError) as err:
        make()(np.array(n), np.array(k))
    assert "\n" not in str(err.value)

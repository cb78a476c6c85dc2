"""Efficiency (Eqn 4-6), goodput and the best (m, s) per allocation (Eqn 13), speedup."""

import numpy as np
import pytest

from pollux_launch.goodput import (
    GoodputFunction,
    GradParams,
    PerfParams,
    SpeedupFunction,
    efficiency,
    noise_scale,
    predict_step_time,
)

PERF = PerfParams(alpha_grad=0.02, beta_grad=0.0004, alpha_local=0.01, beta_local=0.002,
                  alpha_node=0.08, beta_node=0.004, gamma=1.5, grad_exponent=1.1,
                  node_contention=0.05)
GRAD = GradParams(sqr=0.01, var=0.5)
M0, MAX, BOUNDS = 128, 8192, (32, 256)


@pytest.fixture
def fn():
    return GoodputFunction(PERF, GRAD, M0)


def test_efficiency_is_one_at_m0_and_decreasing():
    batch = np.geomspace(M0, 100 * M0, 50)
    eff = efficiency(GRAD, M0, batch)
    assert eff[0] == pytest.approx(1.0)
    assert np.all(np.diff(eff) < 0)
    phi = noise_scale(GRAD, M0)
    assert phi == pytest.approx(M0 * 0.5 / 0.01)
    np.testing.assert_allclose(eff, (phi + M0) / (phi + batch))


def test_efficiency_limits():
    # all noise: every sample counts fully; no statistics: no credit for a larger batch
    assert efficiency(GradParams(0.0, 1.0), M0, 4 * M0) == pytest.approx(1.0)
    assert efficiency(GradParams(0.0, 0.0), M0, 4 * M0) == pytest.approx(0.25)


@pytest.mark.parametrize("bad", [{"sqr": -1.0, "var": 1.0}, {"sqr": 1.0, "var": float("nan")}])
def test_bad_grad_params(bad):
    with pytest.raises(ValueError, match="GradParams"):
        GradParams(**bad)


def test_efficiency_bad_batch():
    with pytest.raises(ValueError, match="batch_size must be > 0"):
        efficiency(GRAD, M0, [0, 128])
    with pytest.raises(ValueError, match="init_batch_size"):
        efficiency(GRAD, -1, [128])


def test_goodput_is_throughput_times_efficiency(fn):
    k, m, s = 4, 64, 1
    batch = k * m * (s + 1)
    thr = batch / predict_step_time(PERF, 1, k, m, s)
    assert fn.throughput(1, k, m, s) == pytest.approx(thr)
    assert fn.evaluate(1, k, m, s) == pytest.approx(thr * efficiency(GRAD, M0, batch))
    assert fn(1, k, m, s) == fn.evaluate(1, k, m, s)


ALLOCS = [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16), (8, 32), (16, 64)]


@pytest.mark.parametrize("accumulation", [True, False])
def test_optimize_respects_every_bound(fn, accumulation):
    n, k = (np.array(a) for a in zip(*ALLOCS, strict=True))
    good, m, s = fn.optimize(n, k, MAX, BOUNDS, accumulation=accumulation)
    assert good.shape == m.shape == s.shape == n.shape
    feasible = good > 0
    total = k * m * (s + 1)
    assert np.all((BOUNDS[0] <= m[feasible]) & (m[feasible] <= BOUNDS[1]))
    assert np.all((M0 <= total[feasible]) & (total[feasible] <= MAX))
    # s is the fewest steps: the same per-GPU samples would not fit in s steps
    assert np.all(m[feasible] * (s[feasible] + 1) > BOUNDS[1] * s[feasible])
    if not accumulation:
        assert np.all(s == 0)
    # one replica cannot reach M0 = 128 with m <= 256 only if accumulation is off: both fit
    assert feasible[0]
    # the reported goodput is the goodput of the reported configuration
    np.testing.assert_allclose(good[feasible], fn.evaluate(n, k, m, s)[feasible])


def test_optimize_beats_every_grid_configuration(fn):
    good, _, _ = fn.optimize(2, 8, MAX, BOUNDS)
    best = 0.0
    for mm in range(BOUNDS[0], BOUNDS[1] + 1, 8):
        for ss in range(0, 4):
            total = 8 * mm * (ss + 1)
            if M0 <= total <= MAX:
                best = max(best, float(fn.evaluate(2, 8, mm, ss)))
    assert float(good) >= 0.98 * best


def test_optimize_uses_accumulation_when_memory_is_short(fn):
    # Noise-dominated gradients favour big batches: one GPU must accumulate to get there.
    big = GoodputFunction(PERF, GradParams(sqr=1e-6, var=1.0), M0)
    _, m, s = big.optimize(1, 1, MAX, BOUNDS)
    assert int(s) > 0 and int(m) <= BOUNDS[1]
    _, m, s = big.optimize(1, 1, MAX, BOUNDS, accumulation=False)
    assert int(s) == 0 and int(m) <= BOUNDS[1]


def test_infeasible_and_empty_allocations_give_zero(fn):
    # 64 replicas x m >= 32 exceeds a max batch of 1024; 0 replicas run nothing
    good, m, s = fn.optimize([16, 0], [64, 0], 1024, BOUNDS)
    assert list(good) == [0, 0] and list(m) == [0, 0] and list(s) == [0, 0]
    # without accumulation one GPU with m <= 64 cannot reach M0 = 128
    good, _, _ = fn.optimize(1, 1, MAX, (32, 64), accumulation=False)
    assert float(good) == 0


def test_fixed_batch_size(fn):
    good, m, s = fn.optimize([1, 1, 2], [1, 4, 8], MAX, BOUNDS, fixed_batch_size=1024)
    np.testing.assert_array_equal([1, 4, 8] * m * (s + 1), [1024, 1024, 1024])
    thr = fn.throughput([1, 1, 2], [1, 4, 8], m, s)
    np.testing.assert_allclose(good, thr)  # efficiency 1 for a fixed batch


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f: f.optimize(1, 1, 64, BOUNDS), "max_batch_size .* must be >= init_batch_size"),
        (lambda f: f.optimize(1, 1, MAX, (0, 64)), "local_bsz_bounds"),
        (lambda f: f.optimize(1, 1, MAX, (64, 32)), "local_bsz_bounds"),
        (lambda f: f.optimize(1, 1, MAX, 64), "local_bsz_bounds"),
        (lambda f: f.optimize(3, 2, MAX, BOUNDS), "num_nodes <= num_replicas"),
        (lambda f: f.optimize([1, 2], [1, -2], MAX, BOUNDS), "num_nodes <= num_replicas"),
        (lambda f: f.optimize(1, 1, MAX, BOUNDS, fixed_batch_size=0), "fixed_batch_size"),
        (lambda f: f.optimize([1, 1], [1, 2, 4], MAX, BOUNDS), "broadcastable shapes"),
    ],
)
def test_optimize_bad_input(fn, call, message):
    with pytest.raises(ValueError, match=message):
        call(fn)


def test_goodput_function_bad_init():
    with pytest.raises(ValueError, match="init_batch_size"):
        GoodputFunction(PERF, GRAD, 0)


def test_speedup_reference_is_one_and_contract_shapes(fn):
    speedup = SpeedupFunction(fn, MAX, BOUNDS)
    assert float(speedup(np.array(1), np.array(1))) == pytest.approx(1.0)
    n = np.array([[1, 1, 2], [0, 4, 16]], dtype=np.int32)
    k = np.array([[1, 4, 8], [0, 16, 64]], dtype=np.int64)
    out = speedup(n, k)
    assert out.shape == (2, 3)
    assert out[1, 0] == 0  # no replicas, no speedup
    assert out[0, 1] > 1  # four GPUs beat one
    np.testing.assert_allclose(out, speedup.goodput(n, k) / speedup.goodput(1, 1))
    # memoised values equal a fresh optimisation
    fresh, _, _ = fn.optimize(n, k, MAX, BOUNDS)
    np.testing.assert_allclose(speedup.goodput(n, k), fresh)
    assert speedup(np.array([], dtype=int), np.array([], dtype=int)).shape == (0,)


def test_speedup_other_reference(fn):
    speedup = SpeedupFunction(fn, MAX, BOUNDS, reference=(2, 8))
    assert float(speedup(2, 8)) == pytest.approx(1.0)
    assert float(speedup(1, 1)) < 1


def test_speedup_bad_reference(fn):
    with pytest.raises(ValueError, match="reference"):
        SpeedupFunction(fn, MAX, BOUNDS, reference=(2, 1))
    with pytest.raises(ValueError, match="no batch configuration fits the reference"):
        SpeedupFunction(fn, MAX, (32, 64), accumulation=False)


def test_single_allocation_grids_are_memoised_by_their_owner_not_the_module(fn):
    many = fn.optimize(np.array([1, 1, 2]), np.array([1, 4, 8]), MAX, BOUNDS)
    cache: dict = {}
    for k, n in ((1, 1), (4, 1), (8, 2)):
        own = GoodputFunction(PERF, GRAD, M0, grid_cache=cache)
        one = own.optimize(n, k, MAX, BOUNDS)
        i = [1, 4, 8].index(k)
        assert [int(a) for a in one[1:]] == [int(many[1][i]), int(many[2][i])]
        assert float(one[0]) == pytest.approx(float(many[0][i]))
    assert len(cache) == 3  # shared by every function given it
    assert all(not a.flags.writeable for grid in cache.values() for a in grid)
    fresh = GoodputFunction(PERF, GRAD, M0)
    fresh.optimize(1, 4, MAX, BOUNDS)
    assert len(cache) == 3 and len(fresh._grids) == 1  # no state shared through the module

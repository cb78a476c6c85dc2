"""fit_perf_params warm-started from a previous fit (the simulator's and agent's refits)."""

import numpy as np
import pytest

from pollux_launch.goodput import PerfParams, fit_perf_params, predict_step_time

from .test_goodput_throughput import FULL, TRUE, grid, measured_sync


def _rmsle(params, n, k, m, step):
    return float(np.sqrt(np.mean((np.log(predict_step_time(params, n, k, m, 0)) - np.log(step))
                                 ** 2)))


def _data(pairs):
    n, k, m = grid(pairs, [8, 16, 32, 64])
    rng = np.random.default_rng(0)
    noise = np.exp(rng.normal(0.0, 0.02, n.size))
    step = predict_step_time(TRUE, n, k, m, 0) * noise
    sync = measured_sync(TRUE, n, k, m) * noise
    return n, k, m, step, sync


def test_warm_start_reaches_the_cold_fit_after_new_observations():
    # An agent has fitted its first configurations, then sees more: the warm refit must
    # fit the data as well as a fit from scratch does.
    n, k, m, step, sync = _data(FULL[:5])
    first = fit_perf_params(n, k, m, np.zeros_like(n), step, sync)
    n, k, m, step, sync = _data(FULL)
    zeros = np.zeros_like(n)
    cold = fit_perf_params(n, k, m, zeros, step, sync)
    warm = fit_perf_params(n, k, m, zeros, step, sync, init=first)
    assert _rmsle(warm, n, k, m, step) <= _rmsle(cold, n, k, m, step) + 2e-3
    assert _rmsle(warm, n, k, m, step) < 0.05  # the noise is 2 %
    # its own optimum is a fixed point: warm-starting there changes (almost) nothing
    again = fit_perf_params(n, k, m, zeros, step, sync, init=warm)
    np.testing.assert_allclose(predict_step_time(again, n, k, m, 0),
                               predict_step_time(warm, n, k, m, 0), rtol=1e-3)


def test_warm_start_from_a_far_guess_still_fits():
    n, k, m, step, sync = _data(FULL)
    far = PerfParams(1.0, 1e-6, 1e-6, 0.0, 5.0, 0.0, 9.0, 1.9, 0.0)
    warm = fit_perf_params(n, k, m, np.zeros_like(n), step, sync, init=far)
    assert _rmsle(warm, n, k, m, step) < 0.05


def test_bad_init_is_a_clear_error():
    n, k, m, step, sync = _data(FULL[:3])
    with pytest.raises(ValueError, match="init must be a PerfParams"):
        fit_perf_params(n, k, m, np.zeros_like(n), step, sync, init=(0.1, 0.2))

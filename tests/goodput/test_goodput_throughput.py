"""Throughput model (Pollux Eqn 7-11): predictions, fit, exploration priors, bad input."""

import numpy as np
import pytest

from pollux_launch.goodput import (
    PerfParams,
    exploration_cap,
    fit_perf_params,
    predict_grad_time,
    predict_step_time,
    predict_sync_time,
)

TRUE = PerfParams(alpha_grad=0.05, beta_grad=0.002, alpha_local=0.02, beta_local=0.004,
                  alpha_node=0.15, beta_node=0.01, gamma=1.8, grad_exponent=1.0,
                  node_contention=0.0)


def grid(nodes_replicas, local_bsz):
    """All (N, K) x m combinations as flat arrays."""
    n, k, m = [], [], []
    for nn, kk in nodes_replicas:
        for mm in local_bsz:
            n.append(nn)
            k.append(kk)
            m.append(mm)
    return np.array(n), np.array(k), np.array(m, dtype=float)


def measured_sync(params, n, k, m, s=0):
    """What an agent measures as sync time: the part of the step not spent computing."""
    step = predict_step_time(params, n, k, m, s)
    return np.maximum(step - (np.asarray(s) + 1) * predict_grad_time(params, m), 0.0)


FULL = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 2), (2, 4), (2, 8), (3, 6), (4, 8), (4, 16)]


def test_eqn_11_by_hand():
    p = TRUE
    t_grad = p.alpha_grad + p.beta_grad * 32
    t_sync = p.alpha_node + p.beta_node * (8 - 2)
    expected = 2 * t_grad + (t_grad**p.gamma + t_sync**p.gamma) ** (1 / p.gamma)
    assert predict_step_time(p, 2, 8, 32, 2) == pytest.approx(expected)
    assert predict_grad_time(p, 32) == pytest.approx(t_grad)
    # one GPU has no sync at all; one node uses the local parameters
    assert predict_sync_time(p, 1, 1) == 0
    assert predict_sync_time(p, 1, 4) == pytest.approx(p.alpha_local + 2 * p.beta_local)
    assert predict_step_time(p, 1, 1, 32, 0) == pytest.approx(t_grad)


def test_predictions_broadcast_over_arrays():
    k = np.array([[1, 2], [4, 8]])
    out = predict_step_time(TRUE, np.where(k > 4, 2, 1), k, 16, 0)
    assert out.shape == (2, 2)
    assert np.all(np.diff(out.ravel()) > 0)  # more replicas, more sync


@pytest.mark.parametrize("gamma", [1.0, 1.8, 4.0])
def test_fit_recovers_synthetic_parameters(gamma):
    true = PerfParams(**{**TRUE.to_dict(), "gamma": gamma})
    n, k, m = grid(FULL, [8, 16, 32, 64, 128])
    step = predict_step_time(true, n, k, m, 0)
    sync = measured_sync(true, n, k, m)
    fit = fit_perf_params(n, k, m, np.zeros_like(m), step, sync)
    pred = predict_step_time(fit, n, k, m, 0)
    np.testing.assert_allclose(pred, step, rtol=5e-3)
    for name in ("alpha_grad", "beta_grad", "alpha_node", "beta_node"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=0.05), name


def test_fit_recovers_extensions_and_accumulation():
    true = PerfParams(**{**TRUE.to_dict(), "grad_exponent": 1.3, "node_contention": 0.2})
    n, k, m = grid(FULL, [8, 16, 32, 64, 128])
    s = np.tile([0, 1, 0, 3, 0], len(FULL)).astype(float)
    step = predict_step_time(true, n, k, m, s)
    fit = fit_perf_params(n, k, m, s, step)
    np.testing.assert_allclose(predict_step_time(fit, n, k, m, s), step, rtol=2e-3)
    assert fit.grad_exponent == pytest.approx(1.3, abs=0.05)
    assert fit.node_contention == pytest.approx(0.2, rel=0.15)


def test_fit_is_robust_to_noise():
    rng = np.random.default_rng(0)
    n, k, m = grid(FULL, [8, 16, 32, 64, 128])
    n, k, m = np.tile(n, 5), np.tile(k, 5), np.tile(m, 5)
    step = predict_step_time(TRUE, n, k, m, 0) * np.exp(rng.normal(0, 0.05, n.size))
    fit = fit_perf_params(n, k, m, np.zeros_like(m), step)
    clean = predict_step_time(TRUE, n, k, m, 0)
    err = np.abs(predict_step_time(fit, n, k, m, 0) / clean - 1)
    assert err.mean() < 0.02


def test_single_gpu_observation_is_optimistic_about_sync():
    """Seen one GPU only: no sync cost is known, so none is assumed (exploration)."""
    fit = fit_perf_params([1], [1], [32], [0], [0.2])
    assert fit.alpha_local == fit.beta_local == fit.alpha_node == fit.beta_node == 0
    assert predict_step_time(fit, 1, 1, 32, 0) == pytest.approx(0.2, rel=1e-3)
    # one batch size seen: the constant part is held at half the compute time
    assert fit.alpha_grad == pytest.approx(0.1, rel=1e-3)
    assert predict_step_time(fit, 2, 8, 32, 0) == pytest.approx(0.2, rel=1e-3)


def test_one_node_only_holds_inter_node_sync_at_intra_node_value():
    n, k, m = grid([(1, 1), (1, 2), (1, 4)], [16, 32, 64])
    step = predict_step_time(TRUE, n, k, m, 0)
    fit = fit_perf_params(n, k, m, np.zeros_like(m), step, measured_sync(TRUE, n, k, m))
    assert fit.alpha_node == pytest.approx(fit.alpha_local)
    assert fit.beta_node == pytest.approx(fit.beta_local)
    assert fit.node_contention == 0
    # the prediction across nodes is the (optimistic) one-node figure
    assert predict_sync_time(fit, 2, 4) == pytest.approx(predict_sync_time(fit, 1, 4))
    assert predict_sync_time(fit, 2, 4) < predict_sync_time(TRUE, 2, 4)


@pytest.mark.parametrize("configs", [1, 2, 3, 4, 5])
def test_few_observations_fit_and_reproduce_what_was_seen(configs):
    """The agent refits after each new configuration: 1-5 distinct ones must work."""
    seen = [(1, 1, 32), (1, 2, 32), (1, 4, 64), (2, 8, 64), (2, 8, 16)][:configs]
    n, k, m = (np.array(c, dtype=float) for c in zip(*seen, strict=True))
    step = predict_step_time(TRUE, n, k, m, 0)
    for sync in (None, measured_sync(TRUE, n, k, m)):
        fit = fit_perf_params(n, k, m, np.zeros_like(m), step, sync)
        np.testing.assert_allclose(predict_step_time(fit, n, k, m, 0), step, rtol=0.05)
        # never more pessimistic than the truth about configurations it has not seen
        assert predict_step_time(fit, 4, 16, 64, 0) <= 1.05 * predict_step_time(
            TRUE, 4, 16, 64, 0)


def test_exploration_cap():
    assert exploration_cap(0) == 1
    assert exploration_cap(1) == 2
    assert exploration_cap(12) == 24
    with pytest.raises(ValueError, match=">= 0"):
        exploration_cap(-1)


def test_params_round_trip_and_validation():
    assert PerfParams.from_dict(TRUE.to_dict()) == TRUE
    assert PerfParams(**TRUE.to_dict()) == TRUE
    with pytest.raises(ValueError, match="unknown PerfParams fields"):
        PerfParams.from_dict({**TRUE.to_dict(), "alpha": 1.0})
    with pytest.raises(ValueError, match="gamma"):
        PerfParams(**{**TRUE.to_dict(), "gamma": 0.5})
    with pytest.raises(ValueError, match="beta_node"):
        PerfParams(**{**TRUE.to_dict(), "beta_node": -1.0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_nodes": []}, "no observations"),
        ({"local_bsz": [0, 32]}, "local_bsz must be > 0"),
        ({"local_bsz": [-4, 32]}, "local_bsz must be > 0"),
        ({"step_time": [0.1]}, "step_time has 1 values but num_nodes has 2"),
        ({"step_time": [0.1, 0.0]}, "step_time must be > 0"),
        ({"num_replicas": [1, 1]}, "num_nodes <= num_replicas"),
        ({"accum_steps": [0, -1]}, "accum_steps must be >= 0"),
        ({"sync_time": [0.1, -0.1]}, "sync_time must be >= 0"),
        ({"step_time": [0.1, float("nan")]}, "NaN"),
    ],
)
def test_bad_observations_raise_clear_errors(kwargs, message):
    obs = {"num_nodes": [1, 2], "num_replicas": [1, 4], "local_bsz": [32, 32],
           "accum_steps": [0, 0], "step_time": [0.1, 0.2], "sync_time": None}
    obs.update(kwargs)
    if kwargs.get("num_nodes") == []:
        obs = {k: ([] if v is not None else None) for k, v in obs.items()}
    with pytest.raises(ValueError, match=message):
        fit_perf_params(**obs)

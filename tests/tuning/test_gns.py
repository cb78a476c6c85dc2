"""Gradient noise scale: estimator against closed forms, robustness, pre-conditioning."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pollux_launch.tuning.gns import GNSEstimator, GradNoise, gradient_moments
from pollux_launch.tuning.grad_monitor import GradientNoiseMonitor
from pollux_launch.tuning.hooks import attach_measurement
from pollux_launch.tuning.preconditioner import (
    ADAM_MIN_STEPS,
    AdamPreconditioner,
    IdentityPreconditioner,
    auto_preconditioner_name,
    make_preconditioner,
)

# --- closed forms -------------------------------------------------------------------


@pytest.mark.parametrize(("count", "m", "m0"), [(2, 8, 8), (4, 16, 32), (12, 3, 100)])
def test_moments_invert_the_expectations_exactly(count, m, m0):
    g2, tr = 3.7, 52.0  # |G|^2 and tr(Sigma)
    big_m = count * m
    local = g2 + tr / m  # E|g_i|^2 of an m-sample micro-batch gradient
    total = g2 + tr / big_m  # E|mean g_i|^2
    sqr, var = gradient_moments(local, total, count, big_m / m0)
    assert sqr == pytest.approx(g2)
    assert var == pytest.approx(tr / m0)
    noise = GradNoise(sqr, var, m0)
    assert noise.noise_scale == pytest.approx(tr / g2)
    assert noise.efficiency(m0) == pytest.approx(1.0)
    # Pollux Eqn 6 and the AdaScale gain agree: E(M) = r * M0 / M.
    assert noise.efficiency(4 * m0) == pytest.approx(noise.gain(4.0) / 4.0)


def test_moments_are_unbiased_on_gaussian_samples():
    rng = np.random.default_rng(0)
    d, m, count, m0, trials = 20, 4, 6, 8, 4000
    mu = rng.normal(size=d)
    per_example_sd = 1.5
    # micro-batch gradients: mean mu, covariance (sd^2 / m) I
    g = mu + rng.normal(size=(trials, count, d)) * per_example_sd / math.sqrt(m)
    local = (g**2).sum(-1).mean(-1)
    total = (g.mean(1) ** 2).sum(-1)
    sqr, var = gradient_moments(local, total, count, count * m / m0)
    assert sqr.mean() == pytest.approx((mu**2).sum(), rel=0.03)
    assert var.mean() == pytest.approx(d * per_example_sd**2 / m0, rel=0.03)


def test_ema_bias_correction_and_scale_weighting():
    est = GNSEstimator(init_batch_size=10, smoothing=0.9)
    assert est.stats() is None
    assert est.update(local_sqr=5.0, total_sqr=4.0, count=2, scale=1.0)
    s1 = est.stats()
    assert (s1.sqr, s1.var) == pytest.approx(gradient_moments(5.0, 4.0, 2, 1.0))  # no zero bias
    est.update(local_sqr=9.0, total_sqr=7.0, count=2, scale=3.0)
    a, b = gradient_moments(5.0, 4.0, 2, 1.0), gradient_moments(9.0, 7.0, 2, 3.0)
    w_old, w_new = (1 - 0.9) * 0.9**3, 1 - 0.9**3  # the scale-3 step decays by 0.9^3
    want = (w_old * a[0] + w_new * b[0]) / (w_old + w_new)
    assert est.stats().sqr == pytest.approx(want)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_steps_are_skipped_not_averaged(bad):
    est = GNSEstimator(init_batch_size=4)
    est.update(3.0, 1.0, 4, 2.0)
    before = est.stats()
    assert not est.update(bad, 1.0, 4, 2.0)
    assert not est.update(3.0, bad, 4, 2.0)
    assert est.stats() == before and est.skipped == 2
    assert not est.update(3.0, 1.0, 1, 2.0)  # one sample: nothing to estimate from


def test_differenced_history_is_dropped_when_unbiased_samples_arrive():
    est = GNSEstimator(init_batch_size=4)
    for _ in range(5):
        est.update(100.0, 1.0, 2, 1.0, differenced=True)
    est.update(3.0, 2.0, 4, 1.0, differenced=False)
    sqr, var = gradient_moments(3.0, 2.0, 4, 1.0)
    assert (est.stats().sqr, est.stats().var) == pytest.approx((sqr, var))


def test_estimator_state_is_plain_json_and_round_trips():
    est = GNSEstimator(init_batch_size=16, smoothing=0.99)
    est.update(3.0, 1.0, 4, 2.0)
    state = json.loads(json.dumps(est.state_dict()))
    other = GNSEstimator(init_batch_size=1)
    other.load_state_dict(state)
    assert other.stats() == est.stats()
    with pytest.raises(ValueError, match="v=1"):
        other.load_state_dict({"sqr": [1, 2]})
    with pytest.raises(ValueError, match="malformed"):
        other.load_state_dict({**state, "sqr": "x"})


def test_bad_configuration_is_one_clear_error():
    with pytest.raises(ValueError, match="init_batch_size"):
        GNSEstimator(init_batch_size=0)
    with pytest.raises(ValueError, match="smoothing"):
        GNSEstimator(init_batch_size=8, smoothing=1.0)


# --- the torch monitor on linear regression (closed form in benchmarks/gns_accuracy.py) --


def _linreg(d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=gen)
    delta = torch.randn(d, generator=gen)
    delta /= delta.norm()
    model = torch.nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])

    def batch(n: int):
        x = torch.randn(n, d, generator=gen)
        y = x @ w_star + torch.randn(n, generator=gen)
        return x, y

    return model, batch, d + 1 + d  # B = d + 1 + d sigma^2 / |delta|^2 with sigma = 1


def _loss(model, x, y):
    return 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()


def test_simulated_replicas_match_the_true_noise_scale():
    model, batch, true_b = _linreg(d=16, seed=1)
    mon = GradientNoiseMonitor(
        torch.optim.SGD(model.parameters(), lr=0.0), 16, smoothing=0.99, overhead_budget=None
    )
    mon.configure(num_replicas=4, local_bsz=8, reduce_local=False)
    for _ in range(600):
        grads = []
        for _ in range(4):
            (g,) = torch.autograd.grad(_loss(model, *batch(8)), [model.weight])
            mon.add_local([g])
            grads.append(g)
        mon.end_micro_step()
        mon.reduce_local_async()
        mon.finish_step([torch.stack(grads).mean(0)])
    assert mon.stats().noise_scale == pytest.approx(true_b, rel=0.2)


@pytest.mark.parametrize("accum_steps", [0, 3])
def test_single_replica_hooks_differenced_and_accumulating(accum_steps):
    model, batch, true_b = _linreg(d=16, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hooks = attach_measurement(
        model, opt, 16, local_bsz=8, accum_steps=accum_steps, overhead_budget=None
    )
    hooks.monitor.estimator.smoothing = 0.99
    assert hooks.monitor.differenced == (accum_steps == 0)
    for _ in range(700):
        for _ in range(accum_steps):
            with hooks.accumulate():
                _loss(model, *batch(8)).backward()
        _loss(model, *batch(8)).backward()
        opt.zero_grad()
    stats = hooks.monitor.stats()
    assert stats.noise_scale == pytest.approx(true_b, rel=0.25)
    assert hooks.monitor.estimator.differenced == (accum_steps == 0)
    hooks.remove()


def test_loss_divided_by_accumulation_gives_the_same_statistics():
    results = []
    for averaged in (False, True):
        model, batch, _ = _linreg(d=8, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        hooks = attach_measurement(model, opt, 8, local_bsz=4, accum_steps=1, overhead_budget=None)
        hooks.configure(
            num_nodes=1,
            num_replicas=1,
            local_bsz=4,
            accum_steps=1,
            loss_averaged_over_accum=averaged,
        )
        for _ in range(50):
            div = 2.0 if averaged else 1.0
            with hooks.accumulate():
                (_loss(model, *batch(4)) / div).backward()
            (_loss(model, *batch(4)) / div).backward()
            opt.zero_grad()
        s = hooks.monitor.stats()
        results.append((s.sqr, s.var))
    assert results[0] == pytest.approx(results[1], rel=1e-5)


def test_amp_loss_scale_is_unscaled():
    out = []
    for init_scale in (None, 2.0**12):
        model, batch, _ = _linreg(d=8, seed=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if init_scale else None
        hooks = attach_measurement(
            model, opt, 8, local_bsz=4, accum_steps=1, grad_scaler=scaler, overhead_budget=None
        )
        for _ in range(30):
            with hooks.accumulate():
                loss = _loss(model, *batch(4))
                (scaler.scale(loss) if scaler else loss).backward()
            loss = _loss(model, *batch(4))
            (scaler.scale(loss) if scaler else loss).backward()
            opt.zero_grad()
        s = hooks.monitor.stats()
        out.append((s.sqr, s.var))
    assert out[0] == pytest.approx(out[1], rel=1e-4)


def test_non_finite_gradients_never_poison_the_monitor():
    model, batch, _ = _linreg(d=8, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hooks = attach_measurement(model, opt, 8, local_bsz=4, accum_steps=1, overhead_budget=None)
    mon = hooks.monitor

    def step(poison: bool):
        with hooks.accumulate():
            loss = _loss(model, *batch(4))
            (loss * math.inf if poison else loss).backward()
        _loss(model, *batch(4)).backward()
        opt.zero_grad()

    for _ in range(10):
        step(False)
    before = mon.stats()
    step(True)
    assert mon.stats() == before and mon.estimator.skipped == 1
    step(False)
    after = mon.stats()
    assert math.isfinite(after.sqr) and math.isfinite(after.var) and after != before


def test_non_finite_differenced_step_is_skipped_and_recovers():
    model, batch, _ = _linreg(d=8, seed=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hooks = attach_measurement(model, opt, 8, local_bsz=4, overhead_budget=None)
    for i in range(12):
        loss = _loss(model, *batch(4))
        (loss * math.nan if i == 6 else loss).backward()
        opt.zero_grad()
    mon = hooks.monitor
    mon.flush()
    assert mon.estimator.skipped == 2  # the NaN step pairs with both neighbours
    assert mon.estimator.updates == 11 - 2
    assert math.isfinite(mon.stats().noise_scale)


# --- pre-conditioning (PGNS, Pollux Eqn 5) ------------------------------------------------


@pytest.mark.parametrize(
    ("opt_cls", "name"),
    [
        (torch.optim.SGD, "identity"),
        (torch.optim.Adam, "adam"),
        (torch.optim.AdamW, "adam"),
        (torch.optim.NAdam, "adam"),
        (torch.optim.Adagrad, "identity"),
    ],
)
def test_preconditioner_is_chosen_from_the_optimizer(opt_cls, name):
    opt = opt_cls(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert auto_preconditioner_name(opt) == name
    assert make_preconditioner("auto", opt).name == name


def test_adam_lookalike_and_unknown_name():
    class MyAdam(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8})

    assert auto_preconditioner_name(MyAdam(torch.nn.Linear(2, 2).parameters())) == "adam"
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unknown preconditioner 'shampoo'; choose one of"):
        make_preconditioner("shampoo", opt)


def test_adam_preconditioner_matches_its_definition():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    pre = AdamPreconditioner(opt)
    params = list(model.parameters())
    assert pre.inverse(params) is None  # no state yet
    for step in range(1, ADAM_MIN_STEPS + 1):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        if step < ADAM_MIN_STEPS:
            assert pre.inverse(params) is None  # too early: identity
    inv = pre.inverse(params)
    for p, r in zip(params, inv, strict=True):
        v = opt.state[p]["exp_avg_sq"] / (1 - 0.95**ADAM_MIN_STEPS)
        torch.testing.assert_close(r, 1.0 / (v.sqrt() + 1e-6))
    assert IdentityPreconditioner(opt).inverse(params) is None


def test_adam_monitor_uses_preconditioned_norms():
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 1, bias=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-9)
    for _ in range(ADAM_MIN_STEPS):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon = GradientNoiseMonitor(opt, 4, refresh_every=1)
    mon.configure(num_replicas=2, local_bsz=2, reduce_local=False)
    g1 = torch.randn(1, 6)
    g2 = g1 + 0.3 * torch.randn(1, 6)
    mon.add_local([g1])
    mon.add_local([g2])
    mon.end_micro_step()
    mon.reduce_local_async()
    mon.finish_step([(g1 + g2) / 2])
    r = AdamPreconditioner(opt).inverse([model.weight])[0]
    p1, p2 = g1 * r, g2 * r
    local = float((p1.square().sum() + p2.square().sum()) / 2)
    total = float(((p1 + p2) / 2).square().sum())
    want = gradient_moments(local, total, 2, 1.0)
    s = mon.stats()
    assert (s.sqr, s.var) == pytest.approx(want, rel=1e-5)


# --- cost control: measure every few steps, the same schedule on every replica -----------


def test_skipped_steps_decay_the_average_as_if_measured():
    a, b = GNSEstimator(8, smoothing=0.9), GNSEstimator(8, smoothing=0.9)
    a.update(5.0, 4.0, 2, 1.0)
    b.update(5.0, 4.0, 2, 1.0)
    a.update(9.0, 7.0, 2, 1.0, steps=3)
    for _ in range(3):  # three measurements of the same value ~ one standing for three
        b.update(9.0, 7.0, 2, 1.0)
    assert (a.stats().sqr, a.stats().var) == pytest.approx((b.stats().sqr, b.stats().var))


def test_interval_grows_with_measurement_cost_and_keeps_estimating():
    now = [0.0]

    def clock():  # every call inside the measurement costs 10 ms; a step takes 1 s
        now[0] += 0.01
        return now[0]

    model, batch, _ = _linreg(d=8, seed=7)
    mon = GradientNoiseMonitor(
        torch.optim.SGD(model.parameters(), lr=0.0),
        8,
        clock=clock,
        overhead_budget=0.01,
        flush_every=8,
    )
    mon.configure(num_replicas=2, local_bsz=4, reduce_local=False)
    measured = []
    for _ in range(200):
        now[0] += 1.0
        measured.append(mon.measuring)
        grads = []
        for _ in range(2):
            (g,) = torch.autograd.grad(_loss(model, *batch(4)), [model.weight])
            mon.add_local([g])
            grads.append(g)
        mon.end_micro_step()
        mon.reduce_local_async()
        mon.finish_step([torch.stack(grads).mean(0)])
    assert 3 <= mon.interval <= 8  # about 5 clock reads of 10 ms per measured step
    assert all(measured[:8])  # every step until the first adaptation
    k = mon.interval
    tail = measured[-5 * k :]
    assert sum(tail) == 5 and all(
        tail[i] == (i % k == tail.index(True) % k) for i in range(len(tail))
    )
    assert mon.stats() is not None and mon.estimator.updates == sum(measured)
    mon.overhead_budget = None  # back to measuring every step at the next adaptation
    state = mon.state_dict()
    assert json.loads(json.dumps(state))["interval"] == k


def test_differenced_estimator_with_an_interval_uses_consecutive_steps():
    model, batch, true_b = _linreg(d=16, seed=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hooks = attach_measurement(model, opt, 16, local_bsz=8, overhead_budget=None)
    mon = hooks.monitor
    mon.estimator.smoothing = 0.99
    mon.interval = 4
    measured = []
    for _ in range(1200):
        measured.append(mon.measuring)
        _loss(model, *batch(8)).backward()
        opt.zero_grad()
    assert measured[4:12] == [True, False, False, True] * 2  # capture at 4k-1, estimate at 4k
    assert mon.stats().noise_scale == pytest.approx(true_b, rel=0.3)
    assert mon.estimator.updates == 1200 // 4 - 1


def test_squared_norm_sums_are_exact_in_float64_for_mixed_dtypes():
    """The monitor's sums of squared norms (one stack and one cast for a list of one
    dtype, a cast per part otherwise) equal a float64 reference."""
    from pollux_launch.tuning.grad_monitor import _sqr_sum, _sum_parts

    g = torch.Generator().manual_seed(3)
    same = [torch.randn(17, 5, generator=g), torch.randn(300, generator=g)]
    mixed = [*same, torch.randn(40, generator=g, dtype=torch.float64),
             torch.randn(9, generator=g).to(torch.bfloat16)]
    for tensors in (same, mixed):
        want = sum(float(t.double().square().sum()) for t in tensors)
        got = _sqr_sum(tensors)
        assert got.dtype == torch.float64
        assert float(got) == pytest.approx(want, rel=1e-5)
    parts = [torch.tensor(1.5), torch.tensor(2.0, dtype=torch.float64)]
    assert float(_sum_parts(parts)) == 3.5 and _sum_parts(parts).dtype == torch.float64

"""Step-time profile (warm-up, aggregation, JSON) and statistical-epoch progress."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.hooks import attach_measurement
from pollux_launch.tuning.profile import FIELDS, ProfileKey, StepProfile
from pollux_launch.tuning.progress import StatisticalProgress, progress_gain

# --- StepProfile ------------------------------------------------------------------------


def test_warmup_steps_after_every_change_are_not_recorded():
    prof = StepProfile(warmup_steps=2)
    a, b = ProfileKey(1, 2, 32, 0), ProfileKey(1, 4, 16, 1)
    prof.set_key(a)
    kept = [prof.record(t) for t in (9.0, 8.0, 1.0, 3.0)]
    assert kept == [False, False, True, True]
    prof.set_key(a)  # same key again: no new warm-up
    assert prof.record(2.0)
    prof.set_key(b)
    assert [prof.record(t, 0.5) for t in (7.0, 7.0, 4.0)] == [False, False, True]
    prof.set_key(a)  # back to a: warm up again, then keep aggregating into a
    assert [prof.record(t) for t in (9.0, 9.0, 5.0)] == [False, False, True]
    arr = prof.arrays()
    assert tuple(arr) == FIELDS
    np.testing.assert_array_equal(arr["num_replicas"], [2, 4])
    np.testing.assert_array_equal(arr["accum_steps"], [0, 1])
    np.testing.assert_allclose(arr["step_time"], [(1 + 3 + 2 + 5) / 4, 4.0])
    assert math.isnan(arr["sync_time"][0]) and arr["sync_time"][1] == 0.5
    assert prof.fit_inputs()["sync_time"] is None  # not measured for every key
    assert prof.max_profiled == (4, 1)


def test_sync_time_is_averaged_and_clipped_and_bad_times_ignored():
    prof = StepProfile(warmup_steps=0)
    prof.set_key(ProfileKey(2, 4, 8, 0))
    assert prof.record(2.0, 0.5) and prof.record(4.0, 9.0)  # sync > step: clipped to step
    assert not prof.record(math.nan) and not prof.record(-1.0)
    fit = prof.fit_inputs()
    np.testing.assert_allclose(fit["sync_time"], [(0.5 + 4.0) / 2])
    np.testing.assert_allclose(fit["step_time"], [3.0])


def test_profile_state_is_plain_json_and_round_trips():
    prof = StepProfile(warmup_steps=1)
    for key, times in ((ProfileKey(1, 1, 8, 0), (5, 1, 2)), (ProfileKey(2, 3, 8, 2), (5, 4))):
        prof.set_key(key)
        for t in times:
            prof.record(float(t), t / 10)
    state = json.loads(json.dumps(prof.state_dict()))
    other = StepProfile()
    other.load_state_dict(state)
    for name in FIELDS:
        np.testing.assert_array_equal(other.arrays()[name], prof.arrays()[name])
    with pytest.raises(ValueError, match="malformed"):
        other.load_state_dict({**state, "rows": [[1, 2]]})
    with pytest.raises(ValueError, match="v=1"):
        other.load_state_dict([])


def test_bad_keys_and_use_before_set_key():
    with pytest.raises(ValueError, match="num_nodes <= num_replicas"):
        ProfileKey(3, 2, 8, 0)
    with pytest.raises(ValueError, match="local_bsz >= 1"):
        ProfileKey(1, 1, 0, 0)
    with pytest.raises(RuntimeError, match="set_key"):
        StepProfile().record(1.0)


def test_hooks_time_steps_with_an_injected_clock():
    ticks = iter(range(1000))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = attach_measurement(
        model,
        opt,
        4,
        local_bsz=4,
        accum_steps=1,
        gns=False,
        warmup_steps=1,
        clock=lambda: float(next(ticks)),
    )
    for _ in range(4):
        with hooks.accumulate():
            model(torch.randn(4, 3)).sum().backward()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    # Each synchronising backward reads the clock twice (local done, synced), so steps
    # take 2 ticks of which 1 is the exposed sync; the first interval is warm-up.
    arr = hooks.profile.arrays()
    np.testing.assert_array_equal(arr["accum_steps"], [1])
    np.testing.assert_allclose(arr["step_time"], [2.0])
    np.testing.assert_allclose(arr["sync_time"], [1.0])


# --- statistical progress -----------------------------------------------------------------


def test_progress_at_m0_counts_ordinary_epochs():
    prog = StatisticalProgress(init_batch_size=32, dataset_size=320)
    noise = GradNoise(sqr=1.0, var=0.5, init_batch_size=32)
    for _ in range(20):
        assert prog.step(32, noise) == pytest.approx(1.0)
    assert prog.epochs() == pytest.approx(2.0)
    assert prog.done(2.0) and not prog.done(2.1)


def test_progress_is_scale_invariant_in_the_gain():
    noise = GradNoise(sqr=1.0, var=3.0, init_batch_size=16)  # phi = 48
    for m in (16, 64, 256):
        r = progress_gain(noise, m)
        assert r == pytest.approx((noise.noise_scale + 16) / (noise.noise_scale + m) * m / 16)
        assert 1.0 <= r <= m / 16
    # Pure noise (|G|^2 -> 0): a batch k times larger is worth k M0-steps.
    noisy = GradNoise(sqr=1e-12, var=1.0, init_batch_size=16)
    assert progress_gain(noisy, 64) == pytest.approx(4.0)
    np.testing.assert_allclose(progress_gain(noisy, np.array([16, 32])), [1.0, 2.0])
    assert progress_gain(None, 64) == 1.0  # before any statistics: conservative


def test_progress_state_round_trip_and_errors():
    prog = StatisticalProgress(8)
    prog.step(16, GradNoise(1.0, 1.0, 8))
    other = StatisticalProgress(1)
    other.load_state_dict(json.loads(json.dumps(prog.state_dict())))
    assert other.iterations == prog.iterations and other.samples == 16
    with pytest.raises(ValueError, match="dataset size"):
        other.epochs()
    with pytest.raises(ValueError, match="init_batch_size"):
        StatisticalProgress(0)
    with pytest.raises(ValueError, match="malformed"):
        other.load_state_dict({**prog.state_dict(), "steps": None})


# --- the hand-off to the goodput core ------------------------------------------------------


def test_measurements_feed_the_goodput_core_unchanged():
    from pollux_launch import goodput

    noise = GradNoise(sqr=2.0, var=5.0, init_batch_size=32)
    params = noise.to_grad_params()
    assert isinstance(params, goodput.GradParams)
    assert goodput.noise_scale(params, 32) == pytest.approx(noise.noise_scale)
    m = np.array([32, 64, 256])
    np.testing.assert_allclose(goodput.efficiency(params, 32, m), noise.efficiency(m))
    np.testing.assert_allclose(goodput.gain(params, m / 32), progress_gain(noise, m))

    prof = StepProfile(warmup_steps=0)
    for replicas, bsz, accum in ((1, 32, 0), (2, 32, 0), (4, 16, 1), (2, 64, 0)):
        prof.set_key(ProfileKey(1, replicas, bsz, accum))
        t = 0.01 * bsz * (accum + 1) + 0.02 * (replicas > 1)
        prof.record(t, 0.01 * (replicas > 1))
    perf = goodput.fit_perf_params(**prof.fit_inputs())
    assert isinstance(perf, goodput.PerfParams)

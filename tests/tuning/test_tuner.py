"""GoodputTuner's model upkeep: a failed refit is said once and the previous fit stands."""

from __future__ import annotations

import logging

import pytest

from pollux_launch.tuning import tuner as tuner_module
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.profile import ProfileKey, StepProfile
from pollux_launch.tuning.progress import StatisticalProgress
from pollux_launch.tuning.tuner import GoodputTuner, TunerConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _agent(clock: Clock) -> tuple[GoodputTuner, StepProfile]:
    profile = StepProfile(warmup_steps=0)
    cfg = TunerConfig(init_batch_size=32, max_batch_size=256, local_bsz_bounds=(8, 64),
                      fit_interval=1.0)
    grad = GradNoise(sqr=0.01, var=0.5, init_batch_size=32)
    return GoodputTuner(cfg, profile, lambda: grad, StatisticalProgress(32), clock), profile


def _observe(profile: StepProfile, replicas: int, local_bsz: int, seconds: float) -> None:
    profile.set_key(ProfileKey(1, replicas, local_bsz, 0))
    for _ in range(3):
        profile.record(seconds, 0.1 * seconds if replicas > 1 else 0.0)


def test_a_failed_refit_is_logged_once_and_keeps_the_previous_fit(monkeypatch, caplog):
    clock = Clock()
    agent, profile = _agent(clock)
    _observe(profile, 1, 32, 0.1)
    first = agent.perf_params()
    assert first is not None

    def broken(**_inputs):
        raise FloatingPointError("overflow in the solver\nsecond line")

    monkeypatch.setattr(tuner_module, "fit_perf_params", broken)
    caplog.set_level(logging.WARNING, logger=tuner_module.__name__)
    for replicas in (2, 4):  # the profile grows and a refit is due each time: both fail
        _observe(profile, replicas, 16, 0.08)
        clock.now += 5.0
        assert agent.perf_params() is first
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["throughput-model fit failed (FloatingPointError: overflow in the "
                     "solver); keeping the previous fit"]
    assert agent.choose(1, 2)[0] >= 8  # decisions go on with the previous model


def test_without_any_fit_yet_the_default_batch_is_used(monkeypatch, caplog):
    clock = Clock()
    agent, profile = _agent(clock)

    def broken(**_inputs):
        raise ValueError("fit_perf_params: step_time must be > 0 seconds")

    monkeypatch.setattr(tuner_module, "fit_perf_params", broken)
    _observe(profile, 1, 32, 0.1)
    with caplog.at_level(logging.WARNING, logger=tuner_module.__name__):
        assert agent.choose(1, 2) == agent.default_batch(2)
    assert "ValueError: fit_perf_params: step_time must be > 0 seconds" in caplog.text
    assert "no model yet" in caplog.text


def test_other_errors_are_not_swallowed(monkeypatch):
    clock = Clock()
    agent, profile = _agent(clock)

    def buggy(**_inputs):
        raise KeyError("a bug, not bad data")

    monkeypatch.setattr(tuner_module, "fit_perf_params", buggy)
    _observe(profile, 1, 32, 0.1)
    with pytest.raises(KeyError):
        agent.perf_params()


def test_candidate_grids_are_kept_by_the_agent_across_fits():
    clock = Clock()
    agent, profile = _agent(clock)
    _observe(profile, 1, 32, 0.1)
    agent.choose(1, 2)
    grids = dict(agent._grids)
    assert grids
    _observe(profile, 2, 16, 0.08)
    clock.now += 5.0
    agent.choose(1, 2)  # a new fit, a new GoodputFunction: the same grid
    assert all(agent._grids[k] is v for k, v in grids.items())

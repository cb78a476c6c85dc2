"""Idle steps (issue 31): boundaries and measurements with nothing due are skipped, and
the training, the schedule and the measurements come out exactly as without skipping.

``ElasticTrainer`` plans, after each step that did work, how many of the next steps have
no decision, vote, sampled gradient or profile warm-up due (the controller's and the
hooks' "Idle steps"); those cost one attribute test each. The same run with the plans
forced to zero is the reference.
"""

from __future__ import annotations

import pytest
import torch
from training_loops import run_steps  # (tests/ is on the path)

import pollux_launch.adapters.torch as pollux
from pollux_launch.elastic.adaptation import AdaptationPolicy, GoodputPolicy
from pollux_launch.tuning.grad_monitor import GradientNoiseMonitor

INTERVAL = 8  # the monitor's sampling interval, fixed (it adapts to measured costs)


def _train(steps: int, *, idle: bool, policies=None, accum: bool = False):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.randint(0, 4, (4096,)))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # a fixed batch (no decision changes it: both runs train the same) of one or two
    # micro-batches a step
    loader = pollux.AdaptiveDataLoader(data, batch_size=16,
                                       local_bsz_bounds=(8, 8) if accum else (None, None))
    trainer = pollux.ElasticTrainer(model, opt, loader, decide_every=10, policies=policies)
    monitor = trainer.hooks.monitor
    monitor.interval = INTERVAL
    monitor._update_interval = lambda: None  # (fixed: timings differ between the runs)
    monitor._reset_step()
    if not idle:
        trainer.controller.skip_idle = False
        trainer.hooks._idle_ahead = lambda: 0
    full = {"boundaries": 0}
    inner = trainer.controller._boundary

    def counted() -> None:
        full["boundaries"] += 1
        inner()

    trainer.controller._boundary = counted
    run_steps(trainer, loader, steps)
    trainer.hooks.end_idle()
    return trainer, full["boundaries"]


def _profile_counts(trainer) -> dict:
    return {k: t.count for k, t in trainer.hooks.profile._totals.items()}


def _sync_counts(trainer) -> dict:
    return {k: t.sync_count for k, t in trainer.hooks.profile._totals.items()}


@pytest.mark.parametrize("accum", [False, True], ids=["one-micro-batch", "accumulation"])
def test_idle_steps_train_measure_and_decide_exactly_as_full_ones(accum):
    steps = 300
    ref, ref_boundaries = _train(steps, idle=False, accum=accum)
    got, got_boundaries = _train(steps, idle=True, accum=accum)
    assert ref_boundaries == steps - 1  # (the reference skips none; the loop ends
    # before the last step's boundary, which comes with the next batch)
    # a full boundary for each decision (every 10 steps), each epoch's first step...
    assert got_boundaries <= steps // 10 + 10, got_boundaries
    for a, b in zip(ref.model.parameters(), got.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert got.controller.steps == ref.controller.steps == steps
    assert got.tuner.progress.iterations == ref.tuner.progress.iterations
    assert (got.controller.sync_points.counts["decision"]
            == ref.controller.sync_points.counts["decision"])
    mr, mg = ref.hooks.monitor, got.hooks.monitor
    assert (mg._step, mg._measured) == (mr._step, mr._measured)
    assert mg._measured >= steps // INTERVAL  # (it did sample)
    assert mg.estimator.stats() == mr.estimator.stats()  # the same steps, the same values
    # every step after the warm-up has its time in the profile (idle ones as their mean)
    assert _profile_counts(got) == _profile_counts(ref)
    # ...and sync times from the steps that did work (at one replica: ~0 each)
    for key, n in _sync_counts(got).items():
        assert 0 < n < _sync_counts(ref)[key]
    prof = got.hooks.profile.arrays()
    assert (prof["step_time"] > 0).all()


def test_a_policy_acting_on_every_step_sees_every_step():
    class EveryStep(AdaptationPolicy):
        name = "every-step"

        def __init__(self) -> None:
            self.seen: list[int] = []

        def after_step(self, ctx) -> None:
            self.seen.append(ctx.step)

    policy = EveryStep()
    assert not policy.idle_safe
    trainer, boundaries = _train(60, idle=True, policies=[GoodputPolicy(), policy])
    assert policy.seen == list(range(1, 60))  # (the 60th's boundary: with a next batch)
    assert boundaries == 59
    assert not trainer.hooks.skip_idle  # (each step's times measured for it)


@pytest.mark.parametrize("differenced", [True, False])
@pytest.mark.parametrize("interval", [1, 2, 3, 8])
def test_unmeasured_ahead_counts_the_steps_the_schedule_leaves_unmeasured(interval,
                                                                          differenced):
    model = torch.nn.Linear(2, 1)
    monitor = GradientNoiseMonitor(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    monitor.interval, monitor.differenced = interval, differenced

    def measuring(step: int) -> bool:
        monitor._step = step
        monitor._reset_step()
        return monitor.measuring

    for step in range(40):
        expected = 0
        while not measuring(step + expected):
            expected += 1
        monitor._step = step
        monitor._reset_step()
        assert monitor.unmeasured_ahead() == expected, (step, interval, differenced)
        monitor.skip_steps(expected)  # lands on the next measured step
        assert monitor._step == step + expected and (monitor.measuring or expected == 0)

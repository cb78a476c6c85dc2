"""A job's batch-size range (Saxena et al.): the agent's (m, s) and the policies' speedups
stay within [min, max]; pollux-run's flags narrow the script's range; every mistake is
one line."""

from __future__ import annotations

import numpy as np
import pytest

from pollux_launch.goodput import GoodputFunction, GradParams, PerfParams
from pollux_launch.launcher.options import OptionsError, parse_launch_args
from pollux_launch.messages import JobHints, JobSpec, MessageError
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.profile import ProfileKey, StepProfile
from pollux_launch.tuning.progress import StatisticalProgress
from pollux_launch.tuning.tuner import GoodputTuner, TunerConfig, batch_range

PERF = PerfParams(alpha_grad=0.01, beta_grad=0.001, alpha_local=0.01, beta_local=0.001,
                  alpha_node=0.02, beta_node=0.001, gamma=1.5)


def test_the_goodput_optimum_respects_the_ranges_lower_end():
    quiet = GoodputFunction(PERF, GradParams(sqr=1.0, var=0.01), 32)  # small batches win
    for replicas in (1, 2, 4, 8):
        _, m, s = quiet.optimize(np.array([1]), np.array([replicas]), 1024, (8, 64))
        _, m2, s2 = quiet.optimize(np.array([1]), np.array([replicas]), 1024, (8, 64),
                                   min_batch_size=256)
        assert replicas * m[0] * (s[0] + 1) < 256  # unconstrained: below the range
        assert replicas * m2[0] * (s2[0] + 1) >= 256  # constrained: inside it


def _tuner(min_bsz: int | None) -> GoodputTuner:
    profile = StepProfile(warmup_steps=0)
    for k, m in ((1, 32), (2, 32), (2, 64)):
        profile.set_key(ProfileKey(1, k, m, 0))
        for _ in range(3):
            profile.record(0.01 + 0.001 * m, 0.002 * (k > 1))
    cfg = TunerConfig(init_batch_size=32, max_batch_size=512, local_bsz_bounds=(8, 128),
                      min_batch_size=min_bsz)
    grad = GradNoise(sqr=1.0, var=0.01, init_batch_size=32)
    return GoodputTuner(cfg, profile, lambda: grad, StatisticalProgress(32))


def test_the_agent_keeps_its_batch_within_the_range():
    free, ranged = _tuner(None), _tuner(128)
    for k in (1, 2, 4):
        m, s = ranged.choose(1, k)
        assert 128 <= k * m * (s + 1) <= 512
    assert ranged.default_batch(1)[0] >= 128  # before any model too
    m, s = free.choose(1, 2)
    assert 2 * m * (s + 1) < 128
    with pytest.raises(ValueError, match="min batch size"):
        TunerConfig(init_batch_size=32, max_batch_size=64, local_bsz_bounds=(8, 64),
                    min_batch_size=100)


def test_pollux_runs_flags_narrow_the_scripts_range():
    env = {"POLLUX_MIN_BATCH_SIZE": "64", "POLLUX_MAX_BATCH_SIZE": "256"}
    assert batch_range(32, 1024, None, env) == (64, 256)
    assert batch_range(32, 1024, 128, env) == (128, 256)
    assert batch_range(32, 1024, None, {}) == (None, 1024)
    for bad, needle in [({"POLLUX_MAX_BATCH_SIZE": "16"}, "below the initial batch size"),
                        ({"POLLUX_MIN_BATCH_SIZE": "2048"}, "above max"),
                        ({"POLLUX_MIN_BATCH_SIZE": "x"}, "integers")]:
        with pytest.raises(ValueError, match=needle):
            batch_range(32, 1024, None, bad)


def test_the_flags_reach_the_spec_and_the_workers_and_mistakes_are_one_line(tmp_path):
    o = parse_launch_args(["--min-batch-size", "64", "--max-batch-size", "512", "python",
                           "t.py"], cwd=tmp_path)
    assert (o.min_batch_size, o.max_batch_size) == (64, 512)
    assert o.worker_env["POLLUX_MIN_BATCH_SIZE"] == "64"
    assert o.worker_env["POLLUX_MAX_BATCH_SIZE"] == "512"
    for argv, needle in [(["--min-batch-size", "600", "--max-batch-size", "512"], "above"),
                         (["--min-batch-size", "0"], "whole number")]:
        with pytest.raises(OptionsError, match=needle) as info:
            parse_launch_args([*argv, "python", "t.py"], cwd=tmp_path)
        assert "\n" not in str(info.value)
    with pytest.raises(MessageError, match="min_batch_size <= max_batch_size"):
        JobSpec(name="j", command=("x",), min_batch_size=9, max_batch_size=8)
    with pytest.raises(MessageError, match="min_batch_size <= max_batch_size"):
        JobHints(init_batch_size=8, max_batch_size=8, local_bsz_bounds=(8, 8),
                 min_batch_size=9)


def test_the_loader_and_the_ds_config_carry_the_range():
    import torch
    from torch.utils.data import TensorDataset

    from pollux_launch.adapters.deepspeed.config import PolluxConfigError, parse_pollux_config
    from pollux_launch.adapters.torch.data import AdaptiveDataLoader

    data = TensorDataset(torch.zeros(100, 1))
    assert AdaptiveDataLoader(data, 8, max_batch_size=64, min_batch_size=16).min_batch_size == 16
    with pytest.raises(ValueError, match="min_batch_size"):
        AdaptiveDataLoader(data, 8, max_batch_size=64, min_batch_size=65)
    section = {"enabled": True, "initial_batch_size": 32, "max_batch_size": 256,
               "micro_batch_size_range": [8, 64], "min_batch_size": 64}
    assert parse_pollux_config({"pollux": section}).min_batch_size == 64
    with pytest.raises(PolluxConfigError, match="min_batch_size"):
        parse_pollux_config({"pollux": {**section, "min_batch_size": 512}})

"""pollux_launch.policy.autoscale: Pollux's cluster utility and the U/L rule (pure)."""

import numpy as np
import pytest

from pollux_launch.policy import JobInfo
from pollux_launch.policy.autoscale import AutoscaleConfig, target_nodes, utility


def _job(name: str, speedup) -> JobInfo:
    return JobInfo(name=name, speedup_fn=speedup, age=100.0)


def _linear(n, k):
    return np.asarray(k, dtype=float)


def _sqrt(n, k):
    return np.sqrt(np.asarray(k, dtype=float))


# --- utility ------------------------------------------------------------------------------
def test_utility_is_speedup_per_gpu_the_cluster_holds():
    jobs = [_job("a", _linear), _job("b", _sqrt)]
    alloc = np.array([[2, 0], [0, 4]])  # a: 2 GPUs on node 0, b: 4 on node 1
    assert utility(jobs, alloc, gpus=8) == pytest.approx((2 + 2) / 8)
    # idle GPUs are paid for: the same allocation on a larger cluster scores less
    assert utility(jobs, alloc, gpus=16) == pytest.approx((2 + 2) / 16)
    # a perfectly scalable job filling the cluster scores 1
    assert utility([jobs[0]], np.array([[4, 4]]), gpus=8) == pytest.approx(1.0)


def test_utility_normalises_each_speedup_to_one_gpu_and_skips_empty_jobs():
    def scaled(n, k):  # any reference: 10x the linear speedup
        return 10.0 * np.asarray(k, dtype=float)

    seen = []

    def spy(n, k):
        seen.append((int(np.asarray(n)[0]), int(np.asarray(k)[0])))
        return np.asarray(k, dtype=float) / np.maximum(np.asarray(n, dtype=float), 1)

    jobs = [_job("a", scaled), _job("idle", _sqrt), _job("spread", spy)]
    alloc = np.array([[3, 0, 0], [0, 0, 0], [0, 2, 2]])
    # a: 3; idle: nothing; spread: 4 GPUs on 2 nodes -> 4/2 = 2 relative to 1 GPU
    assert utility(jobs, alloc, gpus=12) == pytest.approx((3 + 2) / 12)
    assert (2, 4) in seen and (1, 1) in seen


def test_utility_of_an_empty_cluster_or_allocation_is_zero():
    jobs = [_job("a", _linear)]
    assert utility(jobs, np.zeros((1, 2), dtype=int), gpus=8) == 0.0
    assert utility(jobs, np.array([[2, 0]]), gpus=0) == 0.0
    assert utility([], np.zeros((0, 3), dtype=int), gpus=12) == 0.0


# --- target_nodes -------------------------------------------------------------------------
def _table(values: dict[int, float]):
    calls = []

    def utility_at(n: int) -> float:
        calls.append(n)
        return values[n]

    return utility_at, calls


CFG = AutoscaleConfig(1, 8)  # U = 2/3, L = 1/2


def test_grows_above_u_to_the_largest_size_still_at_or_above_l():
    utility_at, calls = _table({2: 0.9, 3: 0.8, 4: 0.7, 5: 0.55, 6: 0.5, 7: 0.45, 8: 0.4})
    assert target_nodes(CFG, utility_at, 2) == (6, 0.9)
    assert sorted(set(calls)) == [2, 3, 4, 6, 7, 8]  # gallops 3, 4, 6, 8; bisects to 7


def test_grows_to_max_and_no_further():
    utility_at, _ = _table({n: 0.95 for n in range(1, 9)})
    assert target_nodes(CFG, utility_at, 3) == (8, 0.95)
    assert target_nodes(CFG, utility_at, 8) == (8, 0.95)  # at MAX: stays


def test_does_not_grow_when_one_more_node_would_fall_below_l():
    # growing to 3 would be undone by the shrink rule at the next decision
    utility_at, _ = _table({2: 0.7, 3: 0.45})
    assert target_nodes(CFG, utility_at, 2) == (2, 0.7)


def test_stays_within_the_band():
    for u in (0.5, 0.6, 2 / 3):
        utility_at, calls = _table({4: u})
        assert target_nodes(CFG, utility_at, 4) == (4, u)
        assert calls == [4]  # no what-if beyond the current size


def test_shrinks_below_l_to_the_largest_size_reaching_l():
    utility_at, _ = _table({6: 0.3, 5: 0.4, 4: 0.48, 3: 0.55, 2: 0.7, 1: 0.9})
    assert target_nodes(CFG, utility_at, 6) == (3, 0.3)


def test_shrinks_to_min_when_no_size_reaches_l_but_never_below():
    utility_at, _ = _table({n: 0.2 for n in range(1, 9)})
    cfg = AutoscaleConfig(2, 8)
    assert target_nodes(cfg, utility_at, 5) == (2, 0.2)
    assert target_nodes(cfg, utility_at, 2) == (2, 0.2)


def test_no_work_goes_to_min_without_what_ifs():
    utility_at, calls = _table({})
    assert target_nodes(AutoscaleConfig(0, 8), utility_at, 5, has_work=False) == (0, 0.0)
    assert target_nodes(CFG, utility_at, 5, has_work=False) == (1, 0.0)
    assert calls == []


def test_work_never_runs_on_zero_nodes():
    cfg = AutoscaleConfig(0, 4)
    # from zero nodes, work wants at least one even if one node scores below L
    utility_at, _ = _table({1: 0.25, 2: 0.2})
    assert target_nodes(cfg, utility_at, 0) == (1, 1.0)
    # even when U = 1 (no utility is above it)
    utility_at, _ = _table({1: 0.25})
    assert target_nodes(AutoscaleConfig(0, 4, high=1.0), utility_at, 0) == (1, 1.0)
    # and a poor utility never shrinks a cluster with work to zero
    utility_at, _ = _table({3: 0.1, 2: 0.1, 1: 0.1})
    assert target_nodes(cfg, utility_at, 3) == (1, 0.1)


def test_current_outside_the_bounds_is_clamped():
    utility_at, _ = _table({8: 0.6, 1: 0.6})
    assert target_nodes(CFG, utility_at, 12) == (8, 0.6)
    assert target_nodes(CFG, utility_at, 0) == (1, 0.6)


def _linear_target(cfg, utility_at, current):
    """The rule by one what-if per size (the reference the galloping search must match)."""
    floor = max(cfg.min_nodes, 1)
    now = utility_at(current) if current > 0 else 1.0
    if (now > cfg.high or current < floor) and current < cfg.max_nodes:
        best = max(current, floor)
        for n in range(current + 1, cfg.max_nodes + 1):
            if utility_at(n) < cfg.low:
                break
            best = n
        return best, now
    if now < cfg.low and current > floor:
        for n in range(current - 1, floor - 1, -1):
            if utility_at(n) >= cfg.low:
                return n, now
        return floor, now
    return current, now


def test_the_search_matches_a_linear_scan_in_log_many_what_ifs():
    rng = np.random.default_rng(7)
    for _ in range(400):
        top = int(rng.integers(1, 300))
        low = int(rng.integers(0, top + 1))
        cfg = AutoscaleConfig(low, top)
        # a falling utility (1 at 1 node, falling at a random rate), as scaling gives
        falling = np.r_[1.0, np.cumprod(rng.uniform(0.9, 1.0, top))]
        values = {n: float(v) for n, v in enumerate(falling)}
        current = int(rng.integers(low, top + 1))
        fast, calls = _table(values)
        want = _linear_target(cfg, _table(values)[0], current)
        assert target_nodes(cfg, fast, current) == want
        assert len(calls) <= 2 * np.log2(top + 1) + 3
    # 1024 nodes, utility falling through L at 700: ~20 what-ifs, not 700
    values = {n: 0.9 - 0.4 * n / 700 for n in range(1, 1025)}
    utility_at, calls = _table(values)
    assert target_nodes(AutoscaleConfig(1, 1024), utility_at, 1) == (700, 0.9 - 0.4 / 700)
    assert len(calls) <= 22


@pytest.mark.parametrize("kwargs, match", [
    ({"min_nodes": 3, "max_nodes": 2}, "MIN:MAX"),
    ({"min_nodes": 0, "max_nodes": 0}, "MIN:MAX"),
    ({"min_nodes": 1, "max_nodes": 4, "high": 0.4, "low": 0.5}, "utility-low"),
    ({"min_nodes": 1, "max_nodes": 4, "high": 1.5}, "utility-low"),
    ({"min_nodes": 1, "max_nodes": 4, "low": float("nan")}, "utility-low"),
    ({"min_nodes": 1, "max_nodes": 4, "interval": 0}, "interval"),
    ({"min_nodes": 1, "max_nodes": 4, "min_lifetime": -1}, "lifetime"),
    ({"min_nodes": 1, "max_nodes": 4, "rule": "cpu"}, "rule"),
])
def test_config_rejects_bad_values_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        AutoscaleConfig(**kwargs)
    assert "\n" not in str(err.value)

"""LR scaling rules: a registry of plug-ins, each 1 at S = 1."""

import math

import pytest

from pollux_launch.goodput import (
    GradParams,
    LEGWState,
    lr_rules,
    register_lr_rule,
    scale_lr,
    unregister_lr_rule,
)

GRAD = GradParams(sqr=0.02, var=0.6)
STATS = {"linear": None, "sqrt": None, "adascale": GRAD, "legw": LEGWState(5.0, 10.0)}


@pytest.mark.parametrize("rule", ["linear", "sqrt", "adascale", "legw"])
def test_every_rule_is_one_at_scale_one(rule):
    assert scale_lr(rule, 256, 256, STATS[rule]) == pytest.approx(1.0)


def test_rules_at_scale_four():
    assert scale_lr("linear", 128, 512) == pytest.approx(4.0)
    assert scale_lr("sqrt", 128, 512) == pytest.approx(2.0)
    gain = (0.6 + 0.02) / (0.6 / 4 + 0.02)
    assert scale_lr("adascale", 128, 512, GRAD) == pytest.approx(gain)
    assert 1 < gain < 4  # AdaScale lies between no scaling and linear scaling
    assert scale_lr("legw", 128, 512) == pytest.approx(2.0)
    # during warm-up LEGW stretches it S times: at half the base warm-up, 1/4 of the way
    assert scale_lr("legw", 128, 512, LEGWState(5.0, 10.0)) == pytest.approx(2.0 * 0.125 / 0.5)
    assert scale_lr("legw", 128, 512, LEGWState(100.0, 10.0)) == pytest.approx(2.0)


@pytest.fixture
def cube_root():
    """A user rule registered for one test and forgotten afterwards (no leaks)."""

    def rule(scale, stats):
        return scale ** (1 / 3)

    register_lr_rule("cube_root", rule)
    yield rule
    unregister_lr_rule("cube_root")


def test_user_rules_by_callable_and_registry(cube_root):
    assert scale_lr(cube_root, 100, 800) == pytest.approx(2.0)
    assert "cube_root" in lr_rules()
    assert scale_lr("cube_root", 100, 100) == pytest.approx(1.0)


def test_a_taken_name_is_refused_unless_replaced(cube_root):
    with pytest.raises(ValueError, match="'cube_root' is already registered"):
        register_lr_rule("cube_root", lambda scale, stats: scale)
    with pytest.raises(ValueError, match="'linear' is already registered"):
        register_lr_rule("linear", lambda scale, stats: 1.0)
    assert scale_lr("linear", 128, 512) == pytest.approx(4.0)
    register_lr_rule("cube_root", lambda scale, stats: scale, replace=True)
    assert scale_lr("cube_root", 100, 800) == pytest.approx(8.0)


def test_rules_do_not_leak_between_tests():
    assert "cube_root" not in lr_rules()  # the fixture above forgot it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("linear", 0, 128), "batch sizes must be > 0"),
        (("linear", 128, -1), "batch sizes must be > 0"),
        (("nope", 128, 256), "unknown LR rule 'nope'"),
        (("adascale", 128, 256, None), "needs GradParams"),
        ((42, 128, 256), "name or a callable"),
    ],
)
def test_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        scale_lr(*args)


def test_register_requires_callable():
    with pytest.raises(ValueError, match="callable"):
        register_lr_rule("x", math.pi)

"""The "pollux" section of a ds_config: every validation error, and the derived config."""

from __future__ import annotations

import json

import pytest

from pollux_launch.adapters.deepspeed import (
    PolluxConfig,
    PolluxConfigError,
    derive_ds_config,
    parse_pollux_config,
)

GOOD = {"enabled": True, "initial_batch_size": 64, "max_batch_size": 1024,
        "micro_batch_size_range": [4, 64], "lr_scaling": "adascale",
        "gradient_accumulation": True}


def ds(**section) -> dict:
    return {"zero_optimization": {"stage": 2}, "pollux": {**GOOD, **section}}


def test_good_section_from_dict_and_file(tmp_path):
    cfg = parse_pollux_config(ds())
    assert cfg == PolluxConfig(True, 64, 1024, (4, 64), "adascale", True)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds()))
    assert parse_pollux_config(path) == cfg
    assert parse_pollux_config(str(path)) == cfg


def test_report_interval():
    assert parse_pollux_config(ds()).report_interval == 30.0
    assert parse_pollux_config(ds(report_interval=2)).report_interval == 2.0
    assert parse_pollux_config(ds(report_interval=0.5)).report_interval == 0.5


def test_no_section_and_defaults():
    assert parse_pollux_config({"train_batch_size": 8}) is None
    cfg = parse_pollux_config({"pollux": {"enabled": True, "initial_batch_size": 32}})
    assert cfg == PolluxConfig(True, 32, 32, (1, 32), "adascale", False)
    off = parse_pollux_config({"pollux": {}, "train_batch_size": 8})
    assert off is not None and not off.enabled  # disabled: batch keys are the user's


@pytest.mark.parametrize("section, match", [
    ({"batch": 3}, r"unknown key\(s\) in the pollux section: batch"),
    ({"enabled": "yes"}, r"pollux.enabled must be true/false"),
    ({"initial_batch_size": 64.0}, r"initial_batch_size must be an integer"),
    ({"initial_batch_size": True}, r"initial_batch_size must be an integer"),
    ({"initial_batch_size": 0}, r"initial_batch_size must be >= 1"),
    ({"max_batch_size": 32}, r"max_batch_size \(32\) must be >= initial_batch_size \(64\)"),
    ({"micro_batch_size_range": 8}, r"micro_batch_size_range must be a list"),
    ({"micro_batch_size_range": [4]}, r"must be \[min, max\] integers"),
    ({"micro_batch_size_range": [4, 8.5]}, r"must be \[min, max\] integers"),
    ({"micro_batch_size_range": [0, 8]}, r"needs 1 <= min <= max"),
    ({"micro_batch_size_range": [16, 8]}, r"needs 1 <= min <= max"),
    ({"micro_batch_size_range": [2048, 4096]}, r"exceeds max_batch_size"),
    ({"micro_batch_size_range": [128, 256], "gradient_accumulation": False},
     r"exceeds initial_batch_size"),
    ({"micro_batch_size_range": [4, 32], "gradient_accumulation": False},
     r"set gradient_accumulation to true"),
    ({"lr_scaling": "cubic"}, r"lr_scaling 'cubic' is not a known rule"),
    ({"lr_scaling": 2}, r"lr_scaling must be a string"),
    ({"report_interval": "30"}, r"pollux.report_interval must be a number"),
    ({"report_interval": True}, r"pollux.report_interval must be a number"),
    ({"report_interval": 0}, r"report_interval must be > 0 seconds"),
    ({"report_interval": float("nan")}, r"report_interval must be > 0 seconds"),
])
def test_section_errors(section, match):
    with pytest.raises(PolluxConfigError, match=match) as err:
        parse_pollux_config(ds(**section))
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)


def test_initial_batch_size_required_when_enabled():
    with pytest.raises(PolluxConfigError, match="initial_batch_size is required"):
        parse_pollux_config({"pollux": {"enabled": True}})


@pytest.mark.parametrize("extra, match", [
    ({"elasticity": {"enabled": True, "max_train_batch_size": 2000}},
     "elasticity section and the pollux section are both enabled"),
    ({"train_batch_size": 32}, "train_batch_size=32 conflicts with pollux.initial_batch_size=64"),
    ({"train_micro_batch_size_per_gpu": 128}, r"outside pollux.micro_batch_size_range \[4, 64\]"),
    ({"zero_optimization": {"stage": 3}}, "ZeRO-3 does not re-shard live yet"),
])
def test_conflicts_with_the_ds_config(extra, match):
    with pytest.raises(PolluxConfigError, match=match):
        parse_pollux_config({**ds(), **extra})


def test_consistent_values_and_disabled_elasticity_are_accepted():
    cfg = {**ds(), "train_batch_size": 64, "train_micro_batch_size_per_gpu": 16,
           "gradient_accumulation_steps": 2, "elasticity": {"enabled": False}}
    assert parse_pollux_config(cfg).enabled
    with pytest.raises(PolluxConfigError, match="gradient_accumulation is false"):
        parse_pollux_config({**ds(gradient_accumulation=False, micro_batch_size_range=[4, 64]),
                             "gradient_accumulation_steps": 4})


@pytest.mark.parametrize("bad, match", [
    ("nope.json", "cannot read ds_config"),
    (42, "must be a dict or a path"),
])
def test_bad_config_source(tmp_path, bad, match):
    if isinstance(bad, str):
        bad = tmp_path / bad
    with pytest.raises(PolluxConfigError, match=match):
        parse_pollux_config(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{\"pollux\": ")
    with pytest.raises(PolluxConfigError, match="not valid JSON"):
        parse_pollux_config(broken)


def test_derive_ds_config_owns_the_batch_keys():
    source = ds()
    out = derive_ds_config(source, world_size=3, micro_batch_size=8, accumulation_steps=2)
    assert "pollux" not in out and "pollux" in source  # the input is not modified
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"],
            out["gradient_accumulation_steps"]) == (48, 8, 2)
    assert out["zero_optimization"] == {"stage": 2}
    with pytest.raises(PolluxConfigError, match="world_size must be a positive integer"):
        derive_ds_config(source, 0, 8, 1)


@pytest.mark.parametrize("world, expect", [(1, (64, 1)), (2, (32, 1)), (3, (21, 1)),
                                           (64, (4, 1))])
def test_initial_micro_batch(world, expect):
    cfg = parse_pollux_config(ds())
    assert cfg.initial_micro_batch(world) == expect
    small = parse_pollux_config(ds(micro_batch_size_range=[4, 16]))
    assert small.initial_micro_batch(1) == (16, 4)  # accumulation reaches 64 on one GPU

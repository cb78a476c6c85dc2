"""The rescale cost model (pure) and its calibration file (one validating layer)."""

import json

import pytest

from pollux_launch.calibration import BUNDLED, load_rescale_cost, write_rescale_cost
from pollux_launch.policy.rescale_cost import RescaleCost

COST = RescaleCost(start_s=3.0, shrink_s=0.2, grow_s=0.5, per_replica_s=0.01,
                   broadcast_bps=1e9, restart_s=4.0, checkpoint_bps=2e8)


@pytest.mark.parametrize("model, old, new, newcomers, expected", [
    ("live", 0, 4, True, (0.0, 3.0 + 0.04)),  # a start: every worker starts
    ("live", 2, 4, True, (3.0, 0.5 + 2.0 + 0.04)),  # grow: overlap, then the broadcast
    ("live", 4, 4, True, (3.0, 0.5 + 2.0 + 0.04)),  # a move is a grow of the moved ones
    ("live", 4, 2, False, (0.0, 0.2 + 0.02)),  # shrink: no state moves
    ("restart", 0, 2, True, (0.0, 4.0)),  # nothing to reload at a start
    ("restart", 2, 4, True, (0.0, 4.0 + 10.0)),
    ("checkpoint-restart", 0, 2, True, (0.0, 30.0)),  # the paper's, first start included
])
def test_transition(model, old, new, newcomers, expected):
    assert COST.transition(model, 2e9, old, new, newcomers) == pytest.approx(expected)


def test_rounds_are_frequent_only_when_changes_are_cheap():
    assert COST.round_interval("checkpoint-restart") == 60.0
    assert COST.round_interval("live") < COST.round_interval("restart") <= 60.0
    assert COST.round_interval("live") >= 15.0
    with pytest.raises(ValueError, match="unknown rescale model"):
        COST.transition("rsync", 0, 1, 2, True)


@pytest.mark.parametrize("data, message", [
    ({"start_s": -1}, "start_s must be a finite number >= 0"),
    ({"broadcast_bps": 0}, "broadcast_bps must be > 0"),
    ({"grow_s": "1"}, "grow_s must be a finite number"),
    ({"grow_s": True}, "grow_s must be a finite number"),
    ({"grwo_s": 1.0}, "unknown field"),
    ([], "expected a JSON object"),
])
def test_bad_costs_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        RescaleCost.from_dict(data)


def test_calibration_file_round_trip_and_one_line_errors(tmp_path):
    bundled = load_rescale_cost()
    assert bundled == load_rescale_cost(BUNDLED) and bundled.source
    path = tmp_path / "cal.json"
    out = write_rescale_cost(path, {"grow_s": 0.25, "source": "test"}, {"repeats": 3})
    assert out["version"] == 1 and out["measured"] == {"repeats": 3}
    write_rescale_cost(path, {"shrink_s": 0.125}, {"params": 10})  # merges, keeps the rest
    cost = load_rescale_cost(path)
    assert (cost.grow_s, cost.shrink_s, cost.source) == (0.25, 0.125, "test")
    assert json.loads(path.read_text())["measured"] == {"repeats": 3, "params": 10}
    for text in ("{not json", '{"version": 2}', '{"version": 1, "start_s": NaN}'):
        path.write_text(text)
        with pytest.raises(ValueError) as err:
            load_rescale_cost(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_rescale_cost(tmp_path / "missing.json")

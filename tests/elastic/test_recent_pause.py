"""What a live job reports as its cost of a change: the dearest recent survivors' pause."""

from pollux_launch.elastic.controller import recent_pause


def test_recent_pause_is_the_dearest_of_the_last_allocation_rescales():
    assert recent_pause([]) is None
    failures_only = [{"reason": "failure", "pause_s": 4.0}]
    assert recent_pause(failures_only) is None  # a failure's recovery is not a choice
    history = [{"reason": "allocation", "pause_s": 9.0}] + [
        {"reason": "allocation", "pause_s": p} for p in (0.1, 0.8, 0.2, 0.05, 0.3)]
    assert recent_pause(history + failures_only) == 0.8  # the 9 s one is too old
    assert recent_pause(history, last=6) == 9.0
    assert recent_pause([{"reason": "allocation"}]) is None  # still open: no pause yet

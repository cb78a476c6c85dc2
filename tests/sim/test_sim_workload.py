"""Workload files: the shipped ones load; bad ones fail with one line naming file, row, column."""

from pathlib import Path

import pytest

from pollux_launch.sim.traces import TRACES_DIR, available_models
from pollux_launch.sim.workload import WorkloadError, load_workload

MODELS = available_models()
HEADER = "name,time,application,num_replicas,batch_size\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "w.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("load", "count"),
    [("workloads", 160), ("workloads-0.5", 80), ("workloads-1.5", 240), ("workloads-2.0", 320)])
def test_shipped_workloads_load(load, count):
    for k in range(1, 9):
        jobs = load_workload(TRACES_DIR / load / f"workload-{k}.csv", MODELS)
        assert len(jobs) == count
        times = [j.submit_time for j in jobs]
        assert times == sorted(times)
        assert all(j.num_replicas >= 1 and j.batch_size >= 1 for j in jobs)


def test_tuned_columns_are_optional(tmp_path):
    jobs = load_workload(_write(tmp_path, "name,time,application\nb,5,bert\na,1,cifar10\n"),
                         MODELS)
    assert [j.name for j in jobs] == ["a", "b"]
    assert jobs[0].num_replicas is None and jobs[0].batch_size is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name,application\na,bert\n", "missing column(s) time"),
        (HEADER, "no jobs"),
        (HEADER + "a,10,resnet,1,128\n", "row 2, column 'application': unknown application "
                                         "'resnet'"),
        (HEADER + "a,10,bert,1,12\nb,-5,bert,1,12\n", "row 3, column 'time': submission time -5"),
        (HEADER + "a,soon,bert,1,12\n", "row 2, column 'time': 'soon' is not a number"),
        (HEADER + "a,1,bert,0,12\n", "row 2, column 'num_replicas': '0' must be a positive"),
        (HEADER + "a,1,bert,1,12.5\n", "row 2, column 'batch_size': '12.5' must be a positive"),
        (HEADER + "a,1,bert,1,12\na,2,bert,1,12\n", "row 3, column 'name': duplicate job name"),
    ],
)
def test_bad_workloads_give_one_clear_line(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(WorkloadError) as info:
        load_workload(path, MODELS)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert expected in message


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="file not found"):
        load_workload(tmp_path / "nope.csv", MODELS)


def test_workload_error_is_a_value_error():
    assert issubclass(WorkloadError, ValueError)


def test_workload_error_is_a_user_error():
    # pollux-run prints a UserError as one line and exits 2
    from pollux_launch.errors import PolluxError, UserError

    assert issubclass(WorkloadError, UserError) and issubclass(WorkloadError, PolluxError)

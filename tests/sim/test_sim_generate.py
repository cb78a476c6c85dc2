"""Workload limit columns, the scenario generator, and the simulate CLI's new flags."""

import json
from pathlib import Path

import pytest

from pollux_launch.sim.generate import (
    COMMUNICATION,
    COMPUTE,
    GPU_CAPS,
    SCENARIOS,
    classify_models,
    generate_workload,
    main,
)
from pollux_launch.sim.traces import available_models, load_model
from pollux_launch.sim.workload import TraceJob, WorkloadError, load_workload, write_workload

MODELS = available_models()
HEADER = "name,time,application,min_batch_size,max_batch_size,max_replicas\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "w.csv"
    path.write_text(text)
    return path


# --- workload columns ----------------------------------------------------------------------

def test_limit_columns_load_and_empty_cells_mean_no_limit(tmp_path):
    jobs = load_workload(_write(tmp_path, HEADER + "a,0,bert,12,96,4\nb,1,bert,,,\n"
                                          "c,2,cifar10,,1024,\n"), MODELS)
    assert [(j.min_batch_size, j.max_batch_size, j.max_replicas) for j in jobs] == [
        (12, 96, 4), (None, None, None), (None, 1024, None)]
    # any subset of the columns
    only_cap = load_workload(_write(tmp_path, "name,time,application,max_replicas\n"
                                              "a,0,bert,2\n"), MODELS)
    assert only_cap[0].max_replicas == 2 and only_cap[0].min_batch_size is None


@pytest.mark.parametrize(("row", "expected"), [
    ("a,0,bert,0,96,4", "row 2, column 'min_batch_size': '0' must be a positive integer"),
    ("a,0,bert,12,9.5,4", "row 2, column 'max_batch_size': '9.5' must be a positive"),
    ("a,0,bert,12,96,many", "row 2, column 'max_replicas': 'many' must be a positive"),
    ("a,0,bert,96,12,4", "row 2, column 'min_batch_size': min_batch_size 96 exceeds "
                         "max_batch_size 12"),
])
def test_bad_limit_columns_are_one_line(tmp_path, row, expected):
    path = _write(tmp_path, HEADER + row + "\n")
    with pytest.raises(WorkloadError) as info:
        load_workload(path, MODELS)
    assert "\n" not in str(info.value) and expected in str(info.value)


def test_write_workload_round_trips(tmp_path):
    specs = [TraceJob("a", 0.0, "bert", min_batch_size=12, max_batch_size=96),
             TraceJob("b", 12.25, "cifar10", max_replicas=8),
             TraceJob("c", 1234567.5, "ncf")]
    path = write_workload(specs, tmp_path / "out.csv")
    assert path.read_text().splitlines()[0] == HEADER.strip()
    assert load_workload(path, MODELS) == specs
    tuned = [TraceJob("t", 5.0, "bert", 2, 48)]
    assert load_workload(write_workload(tuned, tmp_path / "t.csv"), MODELS) == tuned


# --- generator --------------------------------------------------------------------------------

def test_categories_come_from_the_measured_allreduce_share():
    assert classify_models() == {
        "bert": COMMUNICATION, "cifar10": COMPUTE, "deepspeech2": COMPUTE,
        "imagenet": COMPUTE, "ncf": COMMUNICATION, "yolov3": COMMUNICATION}


def test_generator_is_deterministic_and_sized_by_load():
    a = generate_workload("high_rate", gpus=16, seed=3, jobs=30)
    b = generate_workload("high_rate", gpus=16, seed=3, jobs=30)
    c = generate_workload("high_rate", gpus=16, seed=4, jobs=30)
    assert a.specs == b.specs and a.specs != c.specs
    low = generate_workload("low_rate", gpus=16, seed=3, jobs=30)
    ratio = SCENARIOS["high_rate"].load / SCENARIOS["low_rate"].load
    assert a.rate_per_hour == pytest.approx(ratio * low.rate_per_hour)
    assert a.horizon == pytest.approx(30 / a.rate_per_hour * 3600)
    # twice the GPUs: twice the rate for the same load
    assert generate_workload("high_rate", gpus=32, seed=3, jobs=30).rate_per_hour == \
        pytest.approx(2 * a.rate_per_hour)
    times = [s.submit_time for s in a.specs]
    assert times == sorted(times) and times[0] > 0
    cats = {a.categories[s.application] for s in a.specs}
    assert cats == {COMPUTE, COMMUNICATION}
    for s in a.specs:
        trace = load_model(s.application)
        assert s.application not in ("ncf", "imagenet")
        assert trace.init_batch_size <= s.min_batch_size < s.max_batch_size
        assert s.max_batch_size <= trace.max_batch_size
        assert s.max_replicas in GPU_CAPS and s.max_replicas <= 16


def test_generator_cli_writes_the_csv(tmp_path, capsys):
    out = tmp_path / "high.csv"
    assert main(["--scenario", "low_rate", "--gpus", "8", "--jobs", "5", "--output",
                 str(out)]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["jobs"] == 5 and info["gpus"] == 8 and info["output"] == str(out)
    specs = load_workload(out, MODELS)
    assert specs == generate_workload("low_rate", gpus=8, jobs=5).specs
    # caps at most the cluster
    assert all(s.max_replicas <= 8 for s in specs)


# --- CLI ----------------------------------------------------------------------------------------

def _run_cli(argv, capsys):
    """As ``pollux-run simulate ARGV`` runs it (flags checked as they are read)."""
    from pollux_launch.cli import main

    rc = main(["simulate", *argv])
    return rc, capsys.readouterr()


def test_cli_scenario_with_admission(tmp_path, capsys):
    out = tmp_path / "out"
    rc, cap = _run_cli(["--scenario", "high_rate", "--scenario-jobs", "8", "--nodes", "1",
                        "--gpus-per-node", "4", "--admission", "drop", "--policy",
                        "saxena-dp", "--rescale-model", "checkpoint-restart", "--output",
                        str(out), "--no-progress"], capsys)
    assert rc == 0
    last = json.loads(cap.out.strip().splitlines()[-1])
    assert last["admission"] == "drop" and last["arrived"] <= 8
    assert last["horizon"] == pytest.approx(last["scenario"]["horizon"], abs=0.1)
    assert last["completed"] + last["dropped"] + last["unfinished"] == last["arrived"]
    assert (out / "workload.csv").is_file() and (out / "summary.json").is_file()
    assert "admission drop:" in cap.out


@pytest.mark.parametrize(("extra", "expected"), [
    (["--admission", "none", "--max-wait", "60"], "--max-wait and --max-running need"),
    (["--admission", "drop", "--max-wait", "60"], "--max-wait applies to --admission queue"),
    (["--admission", "queue", "--max-running", "0"], "must be a whole number from 1"),
    (["--profile-seconds", "30"], "--profile-seconds needs --profile-on-arrival"),
    (["--profile-on-arrival", "--profile-seconds", "-1"], "profile seconds must be > 0"),
    (["--scenario", "low_rate"], "give exactly one of --workload FILE and --scenario NAME"),
    (["--horizon", "0"], "horizon must be > 0 seconds"),
])
def test_cli_bad_combinations_are_one_line(tmp_path, capsys, extra, expected):
    path = _write(tmp_path, "name,time,application\na,0,cifar10\n")
    rc, cap = _run_cli(["--workload", str(path), "--no-progress", *extra], capsys)
    assert rc == 2 and cap.out == ""
    line, = cap.err.strip().splitlines()
    assert expected in line


def test_cli_without_workload_or_scenario_is_one_line(capsys):
    rc, cap = _run_cli(["--no-progress"], capsys)
    assert rc == 2
    line, = cap.err.strip().splitlines()
    assert "give exactly one of --workload FILE and --scenario NAME" in line

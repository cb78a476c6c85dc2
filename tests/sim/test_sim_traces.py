"""The trace tables: measured points come back exactly; the derived constants match the README."""

import csv

import numpy as np
import pytest

from pollux_launch.sim.traces import (
    MODELS_DIR,
    available_models,
    canonical_placement,
    load_model,
)

MODELS = ["bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_all_six_models_are_available():
    assert available_models() == MODELS


def test_canonical_placement_is_smallest_rotation_without_empty_nodes():
    assert canonical_placement((4, 0, 2, 1)) == (1, 4, 2)
    assert canonical_placement((2, 1, 4)) == (1, 4, 2)
    assert canonical_placement((1, 2, 4)) == (1, 2, 4)  # a different placement
    assert canonical_placement((0, 0)) == ()


@pytest.mark.parametrize("model", MODELS)
def test_measured_placements_are_reproduced_exactly(model):
    trace = load_model(model)
    for row in _rows(MODELS_DIR / model / "placements.csv"):
        placement = tuple(int(c) for c in row["placement"])
        step, sync = trace.step_time(placement, float(row["local_bsz"]))
        assert step == float(row["step_time"]), (placement, row)
        assert sync == float(row["sync_time"]), (placement, row)


@pytest.mark.parametrize("model", MODELS)
def test_unmeasured_placements_hit_scalability_points(model):
    """Beyond 4 nodes only scalability.csv has data: 3-D interpolation reproduces it."""
    trace = load_model(model)
    rows = [r for r in _rows(MODELS_DIR / model / "scalability.csv")
            if int(r["num_nodes"]) > 4 and int(r["num_nodes"]) <= int(r["num_replicas"])]
    assert rows
    for row in rows[:: max(1, len(rows) // 25)]:
        nodes, replicas = int(row["num_nodes"]), int(row["num_replicas"])
        placement = [replicas // nodes + (i < replicas % nodes) for i in range(nodes)]
        step, sync = trace.step_time(placement, float(row["local_bsz"]))
        assert step == pytest.approx(float(row["step_time"]), rel=1e-9)
        assert sync == pytest.approx(float(row["sync_time"]), rel=1e-9)


def test_step_time_is_linear_between_measured_batch_sizes():
    trace = load_model("cifar10")
    (b0, b1), (s0, s1) = trace.placement_tables[(1,)][0][:2], trace.placement_tables[(1,)][1][:2]
    mid = trace.step_time((1,), (b0 + b1) / 2)[0]
    assert mid == pytest.approx((s0 + s1) / 2)
    steps, _ = trace.step_times((1,), np.array([b0, b1]))
    assert list(steps) == [s0, s1]


@pytest.mark.parametrize("model", MODELS)
def test_grad_stats_at_validated_batch_sizes_are_the_table_rows(model):
    trace = load_model(model)
    for m in trace.batch_sizes:
        rows = _rows(MODELS_DIR / model / f"validation-{m}.csv")
        for e in (0, trace.max_epochs - 1):
            sqr, var = trace.grad_stats(m, e)
            assert sqr == float(rows[e]["grad_sqr"]) and var == float(rows[e]["grad_var"])


def test_grad_stats_are_linear_in_batch_size_and_efficiency_matches_readme():
    trace = load_model("cifar10")  # validated 128, 256, ...
    lo, hi = trace.grad_stats(128, 3), trace.grad_stats(256, 3)
    mid = trace.grad_stats(192, 3)
    assert mid[0] == pytest.approx((lo[0] + hi[0]) / 2)
    assert mid[1] == pytest.approx((lo[1] + hi[1]) / 2)
    sqr, var = trace.grad_stats(1024, 3)
    phi = 128 * var / sqr
    assert trace.efficiency(1024, 3) == pytest.approx((phi + 128) / (phi + 1024))
    assert trace.efficiency(128, 3) == pytest.approx(1.0)


def test_readme_constants():
    cifar = load_model("cifar10")
    assert (cifar.init_batch_size, cifar.max_batch_size) == (128, 4096)
    assert (cifar.min_local_bsz, cifar.max_local_bsz, cifar.max_epochs) == (32, 1024, 100)
    assert load_model("yolov3").max_local_bsz == 8
    assert load_model("bert").max_epochs == 2
    rows = {m: _rows(MODELS_DIR / "cifar10" / f"validation-{m}.csv") for m in cifar.batch_sizes}
    p_end = min(float(r[99]["progress"]) for r in rows.values())
    assert cifar.completion_progress == p_end
    assert cifar.epoch_progress[0] == 0.0
    assert cifar.epoch_of(0.0) == 0 and cifar.epoch_of(cifar.epoch_progress[1]) == 1

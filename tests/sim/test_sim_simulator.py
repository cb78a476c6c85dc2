"""The simulator on a toy model and toy workloads whose JCTs can be computed by hand.

Toy model (M0 = 10, gradient variance 0 so every batch size has gain 1; two epochs of
60 M0-iterations each, so a job is done at progress 120):

    placement  local_bsz  step  sync
    1          5          0.30  0.10
    1          10         0.50  0.10
    2          5          0.15  0.05
    2          10         0.25  0.05
"""

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from pollux_launch.policy import JobInfo, Policy, PolicyNode
from pollux_launch.sim import cli
from pollux_launch.sim.baselines import TunedJobsPolicy
from pollux_launch.sim.simulator import SimConfig, simulate
from pollux_launch.sim.traces import load_model
from pollux_launch.sim.workload import load_workload

PLACEMENTS = """placement,local_bsz,step_time,sync_time
1,5,0.3,0.1
1,10,0.5,0.1
2,5,0.15,0.05
2,10,0.25,0.05
"""
SCALABILITY = """num_nodes,num_replicas,local_bsz,step_time,sync_time
2,2,5,0.4,0.2
2,4,10,0.6,0.3
3,3,5,0.5,0.3
4,8,10,0.8,0.5
"""
VALIDATION = """progress,iteration,metric,grad_sqr,grad_var
60,60,0.5,1.0,0.0
120,120,0.9,1.0,0.0
"""


def _toy_models(root: Path, batch_sizes=(10, 20)) -> Path:
    model = root / "models" / "toy"
    model.mkdir(parents=True)
    (model / "placements.csv").write_text(PLACEMENTS)
    (model / "scalability.csv").write_text(SCALABILITY)
    for m in batch_sizes:
        (model / f"validation-{m}.csv").write_text(VALIDATION)
    return root / "models"


def _workload(root: Path, rows: str) -> Path:
    path = root / "workload.csv"
    path.write_text("name,time,application,num_replicas,batch_size\n" + rows)
    return path


TUNED_ROWS = "a,0,toy,2,20\nb,10,toy,1,10\nc,20,toy,1,20\n"
# a: 2 GPUs, m=10, s=0: step 0.25 s -> 4 M0-it/s -> 30 s of work.
# b: 1 GPU, m=10, s=0: step 0.5 s -> 2 M0-it/s -> 60 s of work.
# c: 1 GPU, M=20 -> m=10 with s=1: T = 0.5 + 1 * (0.5 - 0.1) = 0.9 s -> 108 s of work.
# Rounds every 60 s from t=60; 1 node x 2 GPUs; FIFO: a runs first, b and c wait.
#   a: allocated at 60, restart 30 s, works 90..120          -> JCT 120 - 0  = 120
#   b, c: allocated at 120, restart 30 s, b works 150..210    -> JCT 210 - 10 = 200
#                                         c works 150..258    -> JCT 258 - 20 = 238
TUNED_JCTS = {"a": 120.0, "b": 200.0, "c": 238.0}


@pytest.mark.parametrize("discipline", ["fifo", "las"])
def test_tuned_jobs_toy_workload_hand_computed(tmp_path, discipline):
    models = _toy_models(tmp_path)
    specs = load_workload(_workload(tmp_path, TUNED_ROWS), ["toy"])
    cfg = SimConfig(nodes=1, gpus_per_node=2, adaptive=False)
    res = simulate(specs, {"toy": load_model("toy", models)}, TunedJobsPolicy(discipline), cfg)
    assert res.jcts == pytest.approx(TUNED_JCTS)
    summary = res.summary()
    assert summary["avg_jct"] == pytest.approx(np.mean(list(TUNED_JCTS.values())))
    assert summary["makespan"] == pytest.approx(258.0)
    assert res.times[:4] == [60.0, 120.0, 180.0, 240.0]
    assert res.allocated_gpus[:4] == [2, 2, 2, 1]
    assert res.restarts == {"a": 0, "b": 0, "c": 0}


class GreedyPolicy(Policy):
    """In job order, each job gets as many GPUs as it may, on as few nodes as possible."""

    name = "greedy"

    def optimize(self, jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode], current):
        free = np.array([n.slots for n in nodes])
        out = np.zeros((len(jobs), len(nodes)), dtype=int)
        for j, job in enumerate(jobs):
            need = job.max_replicas
            for n in np.argsort(-free, kind="stable"):
                take = min(need, free[n])
                out[j, n], free[n], need = take, free[n] - take, need - take
        return out


def test_adaptive_job_explores_then_grows_hand_computed(tmp_path):
    """One adaptive job with M0 = max batch = 10 (so every choice of m is forced).

    t=60: no model yet -> linear prior capped at 1 GPU: m=10, restart 30 s, then
          30 s at 2 M0-it/s reaches P(1) = 60 exactly at t=120.
    t=120: it has seen 1 replica -> exploration cap 2 GPUs: re-allocated (restart 30 s),
          m = 10 / 2 = 5 -> step 0.15 s -> 60 more M0-iterations take 9 s -> done at 159.
    """
    models = _toy_models(tmp_path, batch_sizes=(10,))
    specs = load_workload(_workload(tmp_path, "solo,0,toy,1,10\n"), ["toy"])
    cfg = SimConfig(nodes=1, gpus_per_node=2)
    res = simulate(specs, {"toy": load_model("toy", models)}, GreedyPolicy(), cfg)
    assert res.jcts["solo"] == pytest.approx(159.0)
    assert res.allocated_gpus == [1, 2]
    assert res.restarts["solo"] == 1


def test_adaptive_job_learns_only_what_it_ran(tmp_path):
    from pollux_launch.sim.simulator import SimJob

    models = _toy_models(tmp_path, batch_sizes=(10,))
    spec = load_workload(_workload(tmp_path, "solo,0,toy,1,10\n"), ["toy"])[0]
    job = SimJob(spec, load_model("toy", models), SimConfig(nodes=1, gpus_per_node=2), 0)
    assert job.perf_params is None and job.max_replicas() == 1
    assert job.speedup_fn()(np.array([1, 1]), np.array([0, 1])).tolist() == [0.0, 1.0]
    job.reallocate(np.array([1]))
    job.advance(60.0, 60.0)
    assert list(job.profile) == [(1, 1, 10)]
    assert job.profile[(1, 1, 10)] == (0.5, 0.1)
    # Epoch 1 ended at t=120 on a configuration the model had not seen: it is refit
    # before (m, s) is re-picked, as the authors' simulator refits on every new one.
    assert job.perf_params is not None
    info = job.job_info(120.0)
    assert job.perf_params is not None and info.max_replicas == 2
    assert info.age == 120.0 and info.restarts == 0
    assert job.progress == pytest.approx(60.0)


def test_adaptive_job_refits_at_epoch_boundaries_not_mid_epoch(tmp_path):
    from pollux_launch.sim.simulator import SimJob

    models = _toy_models(tmp_path, batch_sizes=(10,))
    spec = load_workload(_workload(tmp_path, "solo,0,toy,1,10\n"), ["toy"])[0]
    job = SimJob(spec, load_model("toy", models), SimConfig(nodes=1, gpus_per_node=2), 0)
    job.reallocate(np.array([1]))
    job.advance(60.0, 50.0)  # 30 s restart + 20 s of work: 40 < P(1) = 60, same epoch
    assert job.epoch == 0 and job.profile and job.perf_params is None
    job.advance(110.0, 20.0)  # crosses into epoch 1: the new configuration is fitted
    assert job.epoch == 1 and job.perf_params is not None
    fitted = job.perf_params
    job.job_info(130.0)  # nothing new seen since: the round does not refit again
    assert job.perf_params is fitted


def _run_cli(argv, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    rc = cli.run(parser.parse_args(argv))
    return rc, capsys.readouterr()


def test_cli_prints_json_last_line_and_writes_output(tmp_path, capsys):
    models = _toy_models(tmp_path)
    workload = _workload(tmp_path, TUNED_ROWS)
    out = tmp_path / "out"
    rc, cap = _run_cli(["--workload", str(workload), "--policy", "tuned-fifo", "--nodes", "1",
                        "--gpus-per-node", "2", "--models-dir", str(models), "--output",
                        str(out), "--no-progress", "--rescale-model", "checkpoint-restart"],
                       capsys)
    assert rc == 0
    last = json.loads(cap.out.strip().splitlines()[-1])
    for key in ("avg_jct", "p99_jct", "makespan", "solve_ms_median", "solve_ms_p95", "rounds",
                "policy"):
        assert key in last
    assert last["policy"] == "tuned-fifo"
    assert last["avg_jct"] == pytest.approx(np.mean(list(TUNED_JCTS.values())))
    full = json.loads((out / "summary.json").read_text())
    assert full["jcts"] == pytest.approx(TUNED_JCTS)
    assert len(full["timeline"]["time"]) == last["rounds"]
    for png in ("jct_cdf.png", "timeline.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("rows", "policy", "expected"),
    [
        ("a,0,resnet,1,10\n", "tuned-fifo", "unknown application 'resnet'"),
        ("a,-1,toy,1,10\n", "tuned-fifo", "column 'time'"),
        ("a,0,toy,4,10\n", "tuned-fifo", "wants 4 GPUs but the cluster has 2"),
        ("a,0,toy,1,10\n", "no-such-policy", "unknown policy 'no-such-policy'"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, capsys, rows, policy, expected):
    models = _toy_models(tmp_path)
    rc, cap = _run_cli(["--workload", str(_workload(tmp_path, rows)), "--policy", policy,
                        "--nodes", "1", "--gpus-per-node", "2", "--models-dir", str(models),
                        "--no-progress"], capsys)
    assert rc == 2
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]


SMALL_REAL = """name,time,application,num_replicas,batch_size
cifar10-0,0,cifar10,2,2048
ncf-1,30,ncf,1,32768
bert-2,100,bert,4,384
deepspeech2-3,200,deepspeech2,2,320
"""


def test_default_policy_on_real_models_small_cluster(tmp_path):
    """Real traces, the default Pollux policy, 2 nodes x 4 GPUs: every job finishes, the
    ncf job stays pinned to one GPU, jobs grow only through the exploration cap, and the
    run is deterministic."""
    from pollux_launch.sim.run import run_workload

    path = tmp_path / "small.csv"
    path.write_text(SMALL_REAL)
    cfg = SimConfig(nodes=2, gpus_per_node=4)
    first = run_workload(path, None, cfg)
    assert set(first.jcts) == {"cifar10-0", "ncf-1", "bert-2", "deepspeech2-3"}
    assert all(jct > cfg.realloc_delay for jct in first.jcts.values())
    assert first.max_gpus["ncf-1"] == 1
    assert max(first.max_gpus.values()) > 1  # adaptive jobs scaled out
    assert max(first.allocated_gpus) <= 8
    assert first.summary()["rounds"] == len(first.solve_ms) > 0
    again = run_workload(path, None, cfg)
    assert again.jcts == first.jcts


def test_live_rescale_model_overlaps_newcomers_and_stalls_for_the_broadcast(tmp_path):
    """Hand-computed on the toy model: 1 GPU trains at 2 M0-it/s (m=10, 0.5 s steps),
    2 GPUs at 1/0.15 (m=5). Live costs: start 5 s; grow = 5 s overlap on the old GPU,
    then 1 s + state/bandwidth (1 s); shrink 0.5 s."""
    from pollux_launch.policy.rescale_cost import DEFAULT_STATE_BYTES, RescaleCost
    from pollux_launch.sim.simulator import SimJob

    cost = RescaleCost(start_s=5.0, grow_s=1.0, shrink_s=0.5, per_replica_s=0.0,
                       broadcast_bps=DEFAULT_STATE_BYTES)
    models = _toy_models(tmp_path, batch_sizes=(10,))
    spec = load_workload(_workload(tmp_path, "solo,0,toy,1,10\n"), ["toy"])[0]
    cfg = SimConfig(nodes=1, gpus_per_node=2, rescale_model="live", cost=cost)
    job = SimJob(spec, load_model("toy", models), cfg, 0)
    job.reallocate(np.array([1]))  # start: 5 s, then 5 s at 2 it/s
    job.advance(0.0, 10.0)
    assert job.progress == pytest.approx(10.0)
    assert job.job_info(10.0).realloc_delay == pytest.approx(2.0)  # a grow's stall
    job.reallocate(np.array([2]))  # grow: 5 s more on 1 GPU, 2 s stall, 3 s on 2 GPUs
    job.advance(10.0, 10.0)
    assert job.progress == pytest.approx(10.0 + 10.0 + 3.0 / 0.15)
    before = job.progress
    job.reallocate(np.array([1]))  # shrink: 0.5 s stall, 9.5 s at 2 it/s
    job.advance(20.0, 10.0)
    assert job.progress == pytest.approx(before + 19.0)


@pytest.mark.parametrize("model, first, second", [
    ("checkpoint-restart", 30.0, 30.0),  # the paper: every change, the first included
    ("restart", 2.0, 2.0 + 1.0),  # torchrun-style, plus reloading the state
])
def test_restart_models_stall_the_whole_job(tmp_path, model, first, second):
    from pollux_launch.policy.rescale_cost import DEFAULT_STATE_BYTES, RescaleCost
    from pollux_launch.sim.simulator import SimJob

    cost = RescaleCost(restart_s=2.0, checkpoint_bps=DEFAULT_STATE_BYTES)
    models = _toy_models(tmp_path, batch_sizes=(10,))
    spec = load_workload(_workload(tmp_path, "solo,0,toy,1,10\n"), ["toy"])[0]
    cfg = SimConfig(nodes=1, gpus_per_node=2, rescale_model=model, cost=cost)
    job = SimJob(spec, load_model("toy", models), cfg, 0)
    job.reallocate(np.array([1]))
    job.advance(0.0, first + 5.0)  # the stall, then 5 s at 2 it/s
    assert job.progress == pytest.approx(10.0)
    job.reallocate(np.array([2]))
    job.advance(first + 5.0, second + 5.0)  # no overlap: the stall, then 5 s on 2 GPUs
    assert job.progress == pytest.approx(10.0 + 5.0 / 0.15)


def test_cli_rejects_a_bad_calibration_in_one_line(tmp_path, capsys):
    models = _toy_models(tmp_path)
    workload = _workload(tmp_path, TUNED_ROWS)
    bad = tmp_path / "cal.json"
    bad.write_text('{"version": 1, "start_s": -3}')
    rc, cap = _run_cli(["--workload", str(workload), "--models-dir", str(models),
                        "--rescale-calibration", str(bad)], capsys)
    assert rc == 2 and cap.out == ""
    line, = cap.err.strip().splitlines()
    assert "start_s must be a finite number >= 0" in line and str(bad) in line

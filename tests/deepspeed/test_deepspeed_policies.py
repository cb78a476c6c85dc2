"""Adaptation policies in a real DeepSpeed job, attached by its ds_config.

``pollux-run`` (local mode, embedded store) runs ``policy_worker.py`` on two workers (real
DeepSpeed on CPU, gloo, ZeRO-0) with ``--ds_config FILE`` whose ``"pollux"`` section lists
``"policies": ["pollux", "tests.policies_for_tests:Probe"]``: the built-in goodput policy,
then the test's probe, imported by each worker from the job's working directory. The
controller decides every 20 steps and at each epoch end (10 steps of 2 x 8 here).

The plan (``tests/policies_for_tests.py``): at step 3 the ranks propose *different* total
batches (rank 0: 40, rank 1: 96) and LR factors (0.5, 2.0); at step 6 rank 1 alone asks
to stop; at step 19 rank 0 asks to stop. Checked from every rank's logs: the hooks ran
everywhere, the collectives (torch.distributed on the round's group) gave the right
values, rank 0's proposals - only rank 0's - applied on both ranks at the epoch end of
step 10 (the loader's micro-batch, the engine's batch, the LR used inside the optimizer's
step), and rank 0's stop ended ``engine.epochs()`` and the loader on both ranks at the
decision of step 20, mid-epoch. Also: a bad ``policies`` entry is one clear line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from policies_for_tests import EXPECTED_COLLECTIVES, run_probe_job  # (tests/ is on the path)

from pollux_launch.adapters.deepspeed import PolluxConfigError, parse_pollux_config

REPO = Path(__file__).parents[2]
WORKER = Path(__file__).with_name("policy_worker.py")
POLLUX_RUN = str(Path(sys.executable).with_name("pollux-run"))


def ds_config(policies: list) -> dict:
    return {"zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
            "pollux": {"enabled": True, "initial_batch_size": 16, "max_batch_size": 128,
                       "micro_batch_size_range": [4, 32], "gradient_accumulation": True,
                       "lr_scaling": "sqrt", "policies": policies, "decide_every": 20}}



def test_policies_from_the_ds_config_run_on_every_rank_and_rank0_decides(tmp_path):
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(["pollux", "tests.policies_for_tests:Probe"])))
    env = {**os.environ, "POLICY_PLAN": json.dumps({"stop_at": 19}), "DS_ACCELERATOR": "cpu"}
    policy, worker = run_probe_job(  # (the ds_config's list only)
        tmp_path, "ds-policies", [sys.executable, str(WORKER), "--ds_config", str(config)],
        env, timeout=300)

    # 1. every rank ran the hooks: on_rescale at the start, after_step each step, the
    # epoch hooks of engine.epochs() (the ds_config's list, in its order)
    for rank in (0, 1):
        evs = policy[rank]
        [start] = [r for r in evs if r["ev"] == "rescale"]
        assert (start["step"], start["prev"], start["world"]) == (0, 0, 2)
        assert evs[0]["ev"] == "rescale"
        assert [r["step"] for r in evs if r["ev"] == "step"] == list(range(1, 21))
        assert [r["epoch"] for r in evs if r["ev"] == "before_epoch"] == [0, 1, 2, 3]
        ends = [(r["epoch"], r["step"]) for r in evs if r["ev"] == "after_epoch"]
        assert ends[:3] == [(0, 10), (1, 14), (2, 18)], ends
        for r in evs:
            if r["ev"] == "after_epoch":  # (a collective inside: both at the same step)
                assert r["step_max"] == r["step_min"] == r["step"]
        [end] = [r for r in worker[rank] if r["ev"] == "end"]
        assert end["policies"] == ["pollux", "probe"]
    epoch_ends = {rank: [(r["epoch"], r["step"]) for r in policy[rank] if r["ev"] == "after_epoch"]
                  for rank in (0, 1)}
    assert epoch_ends[0] == epoch_ends[1], epoch_ends

    # 2. the context's collectives, rank-dependent inputs
    for rank in (0, 1):
        [start] = [r for r in policy[rank] if r["ev"] == "rescale"]
        assert start["got"] == EXPECTED_COLLECTIVES, start

    # 3. the ranks disagreed; rank 0's proposal applied on both at the epoch end (step 10)
    proposed = {rank: [(r["step"], r["batch_size"], r["lr_factor"])
                       for r in policy[rank] if r["ev"] == "proposed"] for rank in (0, 1)}
    assert proposed == {0: [(3, 40, 0.5)], 1: [(3, 96, 2.0)]}
    shapes = {rank: {r["step"]: (r["batch"], tuple(r["engine_batch"]), r["lr_used"],
                                 r["lr_factor"])
                     for r in worker[rank] if r["ev"] == "step"} for rank in (0, 1)}
    assert shapes[0] == shapes[1], "the ranks applied different batches or LR factors"
    assert sorted(shapes[0]) == list(range(1, 21))
    for step, (batch, engine_batch, lr_used, factor) in shapes[0].items():
        # rank 0's 40 = 2 x 20 x 1 at LR factor 0.5 (rank 1's 96 would be 2 x 24 x 2 at 2)
        want = (8, (8, 1), 0.1, 1.0) if step <= 10 else (20, (20, 1), 0.05, 0.5)
        assert (batch, engine_batch) == want[:2], (step, batch, engine_batch)
        assert lr_used == pytest.approx(want[2]) and factor == want[3], (step, lr_used, factor)
    for rank in (0, 1):
        seen = {r["step"]: (r["local_bsz"], r["accum"], r["batch_size"], r["lr_factor"])
                for r in policy[rank] if r["ev"] == "step"}
        assert all(v == ((8, 0, 16, 1.0) if s <= 10 else (20, 0, 40, 0.5))
                   for s, v in seen.items()), seen

    # 4. rank 1's stop (step 6) did nothing; rank 0's (step 19) ended engine.epochs() and
    # the loader on both ranks at the decision of step 20, inside epoch 3 (steps 19-22)
    assert [r["step"] for r in policy[1] if r["ev"] == "proposed_stop"] == [6]
    assert [r["step"] for r in policy[0] if r["ev"] == "proposed_stop"] == [19]
    for rank in (0, 1):
        [end] = [r for r in worker[rank] if r["ev"] == "end"]
        assert end["stopped"] and end["step"] == 20 and end["epoch"] == 3, end

    # the context's metrics: timings from the 2nd step; gradient statistics, the same on
    # both ranks
    steps = {rank: {r["step"]: r for r in policy[rank] if r["ev"] == "step"} for rank in (0, 1)}
    for rank in (0, 1):
        for step, r in steps[rank].items():
            if step >= 2:
                assert r["step_time"] > 0 and r["throughput"] > 0, r
    for step in range(1, 21):
        a, b = steps[0][step], steps[1][step]
        assert a["gns"] == b["gns"] and a["progress"] == b["progress"], (a, b)
    assert steps[0][20]["gns"] is not None and steps[0][20]["grad_sqr"] > 0


@pytest.mark.parametrize("entry, names", [
    ("nocolon", "'nocolon'"), ("", "''"), ("x;y:Z", "'x;y:Z'"), ("a:b:c", "'a:b:c'"),
    ("os:system('rm -rf /')", "os:system"), (3, "got 3"), ({"module": "m"}, "got {"),
])
def test_a_bad_policies_entry_is_one_line(entry, names):
    with pytest.raises(PolluxConfigError) as err:
        parse_pollux_config(ds_config(["pollux", entry]))
    text = str(err.value)
    assert "\n" not in text and text.startswith("pollux.policies"), text
    assert names in text and ("module:Class" in text), text


def test_the_policies_key_takes_a_list_of_names():
    with pytest.raises(PolluxConfigError, match=r"^pollux\.policies must be a list"):
        parse_pollux_config(ds_config("tests.policies_for_tests:Probe"))  # type: ignore[arg-type]
    ok = parse_pollux_config(ds_config([" pollux", "pkg.mod:Cls "]))
    assert ok is not None and ok.policies == ("pollux", "pkg.mod:Cls")


def test_a_policy_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch):
    from pollux_launch.adapters.deepspeed.engine import section_policies

    monkeypatch.chdir(tmp_path)  # (a worker looks in its working directory last)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    cfg = parse_pollux_config(ds_config(["pollux", "no_such_pkg.policies:Batch"]))
    assert cfg is not None
    with pytest.raises(PolluxConfigError) as err:
        section_policies(cfg)
    text = str(err.value)
    assert "\n" not in text and text.startswith("pollux.policies: "), text
    assert "no_such_pkg" in text, text
    (tmp_path / "ds_policies_here.py").write_text(
        "from pollux_launch.elastic import AdaptationPolicy\n"
        "class Mine(AdaptationPolicy):\n    pass\n"
        "NOT_A_POLICY = 3\n")
    try:
        cfg = parse_pollux_config(ds_config(["ds_policies_here:NOT_A_POLICY"]))
        with pytest.raises(PolluxConfigError,
                           match=r"^pollux\.policies: .*not an AdaptationPolicy"):
            section_policies(cfg)
        cfg = parse_pollux_config(ds_config(["pollux", "ds_policies_here:Mine"]))
        assert [p.label for p in section_policies(cfg)] == ["pollux", "Mine"]
    finally:
        sys.modules.pop("ds_policies_here", None)


def test_pollux_run_refuses_a_bad_policies_entry_before_starting(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(["pollux", "not a spec"])))
    out = subprocess.run(
        [POLLUX_RUN, "--store", f"embedded://{tmp_path / 'store.db'}", "-np", "2",
         sys.executable, str(WORKER), "--ds_config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert out.stdout == "" and out.stderr.strip().count("\n") == 0, out.stderr
    assert str(config) in out.stderr and "pollux.policies: 'not a spec'" in out.stderr
    assert not (tmp_path / "store.db").exists(), "nothing may start before the check"

"""Adaptation policies in a real Horovod Elastic job: two workers under ``pollux-run``.

``pollux-run --policy-module tests.policies_for_tests:Probe`` (the command line path:
``POLLUX_POLICIES``, imported by each worker from the job's working directory) runs
``policy_worker.py``, which also passes ``policies=[Counter()]`` to pollux's
``DistributedOptimizer``. Horovod's own ``hvd.elastic.run`` / ``TorchState`` loop, gloo on
CPU, a ``DataLoader(drop_last=True)`` whose batch pollux sets, ``decide_every=4``.

The plan (``tests/policies_for_tests.py``): at step 3 the two ranks propose *different*
total batches (rank 0: 40, rank 1: 96) and LR factors (0.5, 2.0); at step 6 rank 1 alone
asks to stop; at step 11 rank 0 asks to stop. Checked from every rank's logs: the hooks
ran everywhere (on_rescale at the start with ``previous_world_size`` 0, after_step every
step, before/after_epoch where the script calls them), the policy's collectives gave the
right values (Horovod's allreduce/allgather/broadcast), rank 0's proposals - and only
rank 0's - applied on both ranks at the decision of step 4 (the batch the loop received
mid-epoch, the accumulation, the LR used inside ``step()``), rank 1's stop did nothing and
rank 0's ended training on both ranks at the decision of step 12 (``control.stopped``).
The same script without ``hvd.elastic`` (a plain ``DistributedSampler`` loop: the control
starts at the first ``before_epoch``) behaves the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from policies_for_tests import EXPECTED_COLLECTIVES, run_probe_job  # (tests/ is on the path)

pytest.importorskip("horovod.torch", reason="Horovod is not installed: scripts/install-horovod.sh")

WORKER = Path(__file__).with_name("policy_worker.py")



@pytest.mark.parametrize("elastic", [True, False], ids=["hvd-elastic", "no-hvd-elastic"])
def test_policies_run_on_every_rank_and_rank0_decides_for_all(tmp_path, elastic):
    env = dict(os.environ)
    env.pop("POLICY_PLAN", None)  # the module's plan
    policy, worker = run_probe_job(
        tmp_path, "hvd-policies",
        ["-H", "localhost:2", "--policy-module", "tests.policies_for_tests:Probe",
         sys.executable, str(WORKER), *([] if elastic else ["--no-elastic"])],
        env, timeout=240)

    # 1. every rank ran the hooks, in order, the script's policy first
    for rank in (0, 1):
        evs = policy[rank]
        [start] = [r for r in evs if r["ev"] == "rescale"]
        assert (start["step"], start["prev"], start["world"]) == (0, 0, 2)
        assert evs[0]["ev"] == "rescale"  # on_rescale at the start, before any epoch
        steps = [r["step"] for r in evs if r["ev"] == "step"]
        assert steps == list(range(1, 13)), steps
        assert [r["epoch"] for r in evs if r["ev"] == "before_epoch"] == [0, 1, 2]
        ends = [r for r in evs if r["ev"] == "after_epoch"]
        assert [(r["epoch"], r["step"]) for r in ends] == [(0, 6), (1, 10)]
        for r in ends:  # (a collective inside after_epoch: both ranks at the same step)
            assert r["step_max"] == r["step_min"] == r["step"]
        [end] = [r for r in worker[rank] if r["ev"] == "end"]
        assert end["policies"] == ["Counter", "probe"]  # policies=, then --policy-module
        assert end["counts"] == {"before_epoch": 3, "after_step": 12, "after_epoch": 2,
                                 "on_rescale": 1}

    # 2. the context's collectives over Horovod, rank-dependent inputs
    for rank in (0, 1):
        [start] = [r for r in policy[rank] if r["ev"] == "rescale"]
        assert start["got"] == EXPECTED_COLLECTIVES, start

    # 3. the ranks disagreed; rank 0's proposal applied on both at step 4's decision
    proposed = {rank: [(r["step"], r["batch_size"], r["lr_factor"])
                       for r in policy[rank] if r["ev"] == "proposed"] for rank in (0, 1)}
    assert proposed == {0: [(3, 40, 0.5)], 1: [(3, 96, 2.0)]}
    shapes = {rank: {r["step"]: (r["batch"], r["accum"], r["lr_used"], r["lr_factor"])
                     for r in worker[rank] if r["ev"] == "step"} for rank in (0, 1)}
    assert shapes[0] == shapes[1], "the ranks applied different batches or LR factors"
    for step, (batch, accum, lr_used, factor) in shapes[0].items():
        # up to step 4 (its decision applied after its update): 8 per rank at LR 0.1; then
        # rank 0's 40 = 2 x 20 x 1 at LR factor 0.5 - the loader's next batch, mid-epoch
        # (rank 1's 96 would have been 2 x 24 x 2 at 2.0)
        want = (8, 1, 0.1) if step <= 4 else (20, 1, 0.05)
        assert (batch, accum) == want[:2] and lr_used == pytest.approx(want[2]), (step, batch)
        assert factor == (1.0 if step < 4 else 0.5), (step, factor)
    for rank in (0, 1):
        seen = {r["step"]: (r["local_bsz"], r["accum"], r["batch_size"], r["lr_factor"])
                for r in policy[rank] if r["ev"] == "step"}
        assert all(v == ((8, 0, 16, 1.0) if s <= 4 else (20, 0, 40, 0.5))
                   for s, v in seen.items()), seen

    # 4. rank 1's stop (step 6) did nothing; rank 0's (step 11) ended both at step 12
    assert [r["step"] for r in policy[1] if r["ev"] == "proposed_stop"] == [6]
    assert [r["step"] for r in policy[0] if r["ev"] == "proposed_stop"] == [11]
    for rank in (0, 1):
        [end] = [r for r in worker[rank] if r["ev"] == "end"]
        assert end["stopped"] and end["step"] == 12, end
        assert max(shapes[rank]) == 12
        assert end["epoch"] == 2  # mid-epoch: 12 is the 2nd of epoch 2's 4 steps

    # the context's metrics: timings from the 2nd step, Horovod's sync wait, and the
    # gradient statistics - the same on both ranks
    steps = {rank: {r["step"]: r for r in policy[rank] if r["ev"] == "step"} for rank in (0, 1)}
    for rank in (0, 1):
        for step, r in steps[rank].items():
            if step >= 2:
                assert r["step_time"] > 0 and r["throughput"] > 0, r
                assert r["sync_time"] is not None and r["sync_time"] >= 0, r
    for step in range(1, 13):
        a, b = steps[0][step], steps[1][step]
        assert a["gns"] == b["gns"] and a["progress"] == b["progress"], (a, b)
    assert steps[0][12]["gns"] is not None and steps[0][12]["grad_sqr"] > 0

"""Adaptation policies for the Horovod and DeepSpeed policy tests (real workers load them
by import path: ``tests.policies_for_tests:Probe``, from the repository root).

``Probe`` appends what every hook saw on this worker to ``$POLICY_LOG_DIR/policy-<pid>.jsonl``
and follows a plan (``$POLICY_PLAN``, JSON; defaults in :data:`PLAN`):

* ``on_rescale`` (the start: ``previous_world_size`` 0): the context's collectives on
  rank-dependent values (``allreduce`` sum/mean/max/min, scalar and vector; ``allgather``
  of scalars and rows; ``broadcast`` from rank 0 and from rank 1); the results are logged;
* ``before_epoch`` / ``after_epoch``: logged; ``after_epoch`` also checks with a max/min
  all-reduce that every rank is at the same step;
* ``after_step``: logged (the batch shape and LR factor in force, the metrics); at step
  ``propose_at`` each rank proposes its *own* total batch (``batch[rank]``) and LR factor
  (``lr[rank]``): replicas that disagree; at step ``stop_r1_at`` rank 1 alone proposes to
  stop (rank 0 decides: nothing happens); at step ``stop_at`` rank 0 alone proposes to stop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from pollux_launch.elastic import AdaptationPolicy, PolicyContext

PLAN: dict[str, Any] = {"propose_at": 3, "batch": [40, 96], "lr": [0.5, 2.0],
                        "stop_r1_at": 6, "stop_at": 11}


# what Probe's collectives at the start must give on 2 ranks (rank-dependent inputs)
EXPECTED_COLLECTIVES = {
    "sum": 3.0, "mean": 1.5, "max": 2.0, "min": 1.0, "vec_sum": [1.0, 12.0],
    "gather": [0.0, 10.0], "gather_rows": [[0.0, 7.0], [1.0, 8.0]],
    "bcast0": 100.0, "bcast1": 200.0, "bcast1_vec": [1.0, -1.5]}


def read_logs(log_dir: Path, prefix: str) -> dict[int, list[dict]]:
    """Each worker's JSON lines by rank (one process per rank: no rescale here)."""
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for f in sorted(log_dir.glob(f"{prefix}-*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line]
        assert recs and len({r["rank"] for r in recs}) == 1, f
        by_rank[recs[0]["rank"]] += recs
    return dict(by_rank)


def run_probe_job(tmp_path: Path, name: str, args: list[str], env: dict[str, str],
                  timeout: float) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
    """``pollux-run`` of a 2-rank job ``name`` (``args``: its options after the fixed
    size, then the script) with the probe's logs under ``tmp_path/logs``; it must
    succeed, and both ranks must have logged. The policy and worker logs by rank."""
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**env, "POLICY_LOG_DIR": str(logs), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("POLLUX_POLICIES", None)  # only the policies the test names
    pollux_run = str(Path(sys.executable).with_name("pollux-run"))
    out = subprocess.run(
        [pollux_run, "--store", f"embedded://{tmp_path / 'store.db'}", "--job-name", name,
         "-np", "2", "--min-np", "2", "--max-np", "2", "--interval", "3600", *args],
        cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True,
        timeout=timeout)
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-4000:]
    assert f"{name}: succeeded, exit code 0" in output, output[-4000:]
    policy, worker = read_logs(logs, "policy"), read_logs(logs, "worker")
    assert sorted(policy) == sorted(worker) == [0, 1], output[-3000:]
    return policy, worker


def _log_file(prefix: str) -> Any:
    path = os.path.join(os.environ["POLICY_LOG_DIR"], f"{prefix}-{os.getpid()}.jsonl")
    return open(path, "a", buffering=1)


class Probe(AdaptationPolicy):
    name = "probe"

    def __init__(self) -> None:
        self.plan = {**PLAN, **json.loads(os.environ.get("POLICY_PLAN", "{}"))}
        self._log = _log_file("policy")

    def _write(self, ev: str, ctx: PolicyContext, **fields: Any) -> None:
        rec = {"ev": ev, "pid": os.getpid(), "rank": ctx.rank, "world": ctx.world_size,
               "step": ctx.step, **fields}
        self._log.write(json.dumps(rec) + "\n")

    def on_rescale(self, ctx: PolicyContext) -> None:
        if ctx.detached:
            self._write("detached", ctx, prev=ctx.previous_world_size)
            return
        r = ctx.rank
        got = {
            "sum": ctx.allreduce(r + 1, "sum"),
            "mean": ctx.allreduce(r + 1, "mean"),
            "max": ctx.allreduce(r + 1, "max"),
            "min": ctx.allreduce(r + 1, "min"),
            "vec_sum": ctx.allreduce([r, 10.0 * r + 1], "sum").tolist(),
            "gather": ctx.allgather(10.0 * r).tolist(),
            "gather_rows": ctx.allgather([r, r * r + 7.0]).tolist(),
            "bcast0": ctx.broadcast((r + 1) * 100.0),
            "bcast1": ctx.broadcast((r + 1) * 100.0, src=1) if ctx.world_size > 1 else None,
            "bcast1_vec": (ctx.broadcast([r, -r - 0.5], src=1).tolist()
                           if ctx.world_size > 1 else None),
        }
        self._write("rescale", ctx, prev=ctx.previous_world_size, got=got,
                    local_bsz=ctx.local_bsz, accum=ctx.accum_steps)

    def before_epoch(self, ctx: PolicyContext) -> None:
        self._write("before_epoch", ctx, epoch=ctx.epoch)

    def after_epoch(self, ctx: PolicyContext) -> None:
        hi, lo = ctx.allreduce(ctx.step, "max"), ctx.allreduce(ctx.step, "min")
        self._write("after_epoch", ctx, epoch=ctx.epoch, step_max=hi, step_min=lo)

    def after_step(self, ctx: PolicyContext) -> None:
        p, r = self.plan, ctx.rank
        self._write("step", ctx, local_bsz=ctx.local_bsz, accum=ctx.accum_steps,
                    batch_size=ctx.batch_size, lr_factor=ctx.lr_factor,
                    decision_due=ctx.decision_due, step_time=ctx.step_time,
                    sync_time=ctx.sync_time, throughput=ctx.throughput, gns=ctx.gns,
                    grad_sqr=ctx.grad_sqr, progress=ctx.progress)
        if ctx.step == p["propose_at"]:
            total, factor = p["batch"][r % len(p["batch"])], p["lr"][r % len(p["lr"])]
            ctx.set_batch_size(total)
            ctx.set_lr_factor(factor)
            self._write("proposed", ctx, batch_size=total, lr_factor=factor)
        if ctx.step == p["stop_r1_at"] and r == 1:
            ctx.stop()
            self._write("proposed_stop", ctx)
        if ctx.step == p["stop_at"] and r == 0:
            ctx.stop()
            self._write("proposed_stop", ctx)


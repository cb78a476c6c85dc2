"""A job succeeds when every worker of its final group exited 0, as under torchrun: a rank
that finishes early ends nothing, its peers run on (no grace period kills them), and a
peer that dies instead fails the job. Real ``pollux-run`` processes on one machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from waiting import wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.completion import Completion, completion, generation
from pollux_launch.messages import (
    Allocation,
    JobGeneration,
    JobSpec,
    WorkerFinished,
    encode,
)
from pollux_launch.rendezvous.rounds import JobKeys, RoundInfo, RoundState

PYTHON = sys.executable
POLLUX_RUN = str(Path(PYTHON).with_name("pollux-run"))

# A torchrun-style script: rank 1 is done at once; rank 0 "saves its model" for SAVE_S
# seconds (longer than the old 30 s finish grace when the test asks), then writes it.
SCRIPT = r'''
import os, sys, time
rank = int(os.environ["RANK"])
out = sys.argv[1]
open(f"{out}/started.{rank}.{os.getpid()}", "w").close()
if rank == 0:
    time.sleep(float(sys.argv[2]))
    with open(f"{out}/model.pt", "w") as f:
        f.write("saved")
print(f"rank {rank} done", flush=True)
'''


def _launch(tmp_path: Path, job: str, save_s: float) -> subprocess.Popen:
    (tmp_path / "train.py").write_text(SCRIPT)
    return subprocess.Popen(
        [POLLUX_RUN, "--store", f"embedded://{tmp_path}/store.db", "--job-name", job,
         "--nproc-per-node", "2", "train.py", str(tmp_path), str(save_s)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_rank_that_finishes_early_waits_for_its_peers(tmp_path):
    """Rank 1 exits 0 at once; rank 0 saves for 35 s (past the old 30 s grace): the job
    succeeds only after that, with the model saved."""
    proc = _launch(tmp_path, "early", 35.0)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert (tmp_path / "model.pt").read_text() == "saved"
    assert "early: succeeded, exit code 0" in out
    assert "rank 0 done" in out and "rank 1 done" in out
    # (rank 1's end came first: the job was not reported done then)
    assert out.index("rank 1 done") < out.index("rank 0 done") < out.index("succeeded")


def test_a_peer_killed_after_another_completed_fails_the_job(tmp_path):
    """Rank 1 completed; rank 0 is killed while saving: nothing can replace it (its group
    has completed the script elsewhere), so the job fails and says why."""
    proc = _launch(tmp_path, "halfway", 60.0)
    rank0 = wait_for(lambda: [p for p in tmp_path.glob("started.0.*")], 60, "rank 0")
    wait_for(lambda: list(tmp_path.glob("started.1.*")), 60, "rank 1")
    time.sleep(3)  # rank 1 has exited and been reaped
    os.kill(int(rank0[0].name.split(".")[2]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "halfway: failed" in last and "rank 0" in last and "exited -9" in last, last
    assert not (tmp_path / "model.pt").exists()


# -- the rule itself (pure) -------------------------------------------------------------

def _mark(job: str, worker: str, gen=(0, 0, 0)) -> tuple[str, str]:
    return keys.job_finished(job, worker), encode(WorkerFinished("n1", gen))


def test_completion_of_a_live_job_is_its_last_formed_round():
    spec = JobSpec("j", ("x",))
    k = JobKeys("j")
    values = dict([_mark("j", "w1"), _mark("j", "gone")])
    # round 3 is open (not formed): round 2 is the last formed one, of w1 and w2
    values[k.round] = encode(RoundInfo(3, 4, ("n1",), prev_round=2, prev_members=("w1", "w2")))
    values[k.state(2)] = encode(RoundState(2, 3, ("w1", "w2")))
    assert completion(spec, Allocation(4, ("n1",)), values) == Completion(1, 2)
    values.update([_mark("j", "w2")])
    assert completion(spec, Allocation(4, ("n1",)), values).done
    values[keys.job_finished("j", "w3")] = '{"v":1,"node":"bad name!"}'  # skipped
    assert completion(spec, Allocation(4, ("n1",)), values) == Completion(2, 2)


def test_completion_of_a_restart_job_counts_only_its_current_group():
    spec = JobSpec("r", ("x",), elasticity="restart", min_replicas=1, max_replicas=2)
    alloc = Allocation(5, ("n1", "n2"), term=3)
    old = generation(alloc, 0)
    values = dict([_mark("r", "a", old), _mark("r", "b", old)])
    values[keys.job("r", "generation")] = encode(JobGeneration(restarts=1))
    # both completed in the group before a restart: the restarted group has not begun
    assert completion(spec, alloc, values) == Completion(0, 2)
    values.update([_mark("r", "c", generation(alloc, 1))])
    assert completion(spec, alloc, values) == Completion(1, 2)
    assert not completion(spec, alloc, {}).begun

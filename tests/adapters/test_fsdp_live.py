"""An FSDP2 job re-sharded live 2 -> 3 -> 1 -> 2 under a real node agent (embedded store,
gloo): after every change the whole model and Adam state equal, bit for bit, what they
were before it; each epoch saw every sample exactly once; survivors kept their
processes; leavers exited 0."""

import os
import signal
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from agent_job import agent_job  # tests/adapters/agent_job.py
from waiting import wait_for  # tests/waiting.py

from pollux_launch import keys
from pollux_launch.messages import JobRestarts, decode

WORKER = Path(__file__).with_name("fsdp_worker.py")
N = 480


def _each_epoch_saw_every_sample_once(steps: list[dict]) -> None:
    """Every epoch but the last saw all N samples, and none saw one twice."""
    seen: dict[int, Counter] = defaultdict(Counter)
    for r in steps:
        seen[r["epoch"]].update(r["indices"])
    for epoch, counts in seen.items():
        assert set(counts) == set(range(N)) or epoch == max(seen), f"epoch {epoch} missed"
        assert max(counts.values()) == 1, f"epoch {epoch} saw a sample twice"


@pytest.mark.parametrize("sharding", ["", "fsdp"], ids=["script-sharded", "trainer-sharded"])
def test_fsdp_job_reshards_live_2_3_1_2(tmp_path: Path, sharding: str) -> None:
    sizes = [2, 3, 1, 2]
    with agent_job(tmp_path, "sh", WORKER, {"N": str(N), "SHARDING": sharding}) as job:
        def steps_in(version: int) -> int:
            return sum(1 for rs in job.records().values() for r in rs
                       if r["kind"] == "step" and r["rank"] == 0 and r["round"] >= version)

        for replicas in sizes:
            version = job.allocate(replicas)
            wait_for(lambda v=version: steps_in(v) >= 6, 180,
                     f"6 steps on {replicas} replicas")
        (job.log_dir / "stop").touch()
        status = job.finished()
        assert status.state == "succeeded", status
        logs, exits = job.records(), job.agent.exits

    steps = [r for rs in logs.values() for r in rs if r["kind"] == "step"]
    assert [w for w in sorted({(r["round"], r["world"]) for r in steps})] == list(
        enumerate(sizes, start=1)), "the job ran at every size, in order"
    _each_epoch_saw_every_sample_once(steps)
    states = [r for rs in logs.values() for r in rs if r["kind"] == "state"]
    for rnd in range(2, len(sizes) + 1):
        after = {r["digest"] for r in states if r["when"] == "rescale" and r["round"] == rnd}
        assert len(after) == 1, f"round {rnd}: the ranks disagree after the change"
        last = max(r["step"] for r in states if r["when"] == "step" and r["round"] == rnd - 1)
        before = {r["digest"] for r in states
                  if r["when"] == "step" and r["round"] == rnd - 1 and r["step"] == last}
        first = next(r for r in states if r["when"] == "rescale" and r["round"] == rnd)
        assert first["step"] == last
        assert after == before, f"round {rnd}: the state changed in the re-shard"
    ends = [r for rs in logs.values() for r in rs if r["kind"] == "end"]
    assert len(ends) == sizes[-1] and len({e["digest"] for e in ends}) == 1
    # the noise scale was measured from the shards: a gradient and a variance, alike
    assert all(e["noise"] and e["noise"][0] > 0 and e["noise"][1] > 0 for e in ends), ends
    assert len({tuple(e["noise"]) for e in ends}) == 1
    for worker, rs in logs.items():
        assert len({r["pid"] for r in rs if "pid" in r}) == 1, worker
    assert all(code == 0 for _, _, code in exits), exits



def test_a_sigkilled_rank_of_a_sharded_job_fails_it_saying_why(tmp_path: Path, capfd) -> None:
    """Its shard cannot be rebuilt from the peers (no replica, no durable sharded
    checkpoint yet): the survivors say so in one line and the job fails - no hang, no
    survivor training on with a hole in its model."""
    with agent_job(tmp_path, "sk", WORKER, {"N": str(N), "SHARDING": ""}) as job:
        job.allocate(3)

        def victim() -> int | None:
            for rs in job.records().values():
                ranks = {r["rank"] for r in rs if r["kind"] == "step"}
                if 2 in ranks and sum(r["kind"] == "step" for r in rs) >= 4:
                    return next(r["pid"] for r in rs if r["kind"] == "start")
            return None

        os.kill(wait_for(victim, 180, "4 steps of rank 2"), signal.SIGKILL)
        status = job.finished(180)
        assert status.state == "failed", status
    assert "its shard of the model is lost" in capfd.readouterr().out


def test_a_sigkilled_rank_of_a_sharded_job_with_a_checkpoint_goes_on_from_it(
        tmp_path: Path, capfd) -> None:
    """The dead rank's shard is lost, but the job keeps durable sharded checkpoints: the
    survivors keep their processes, and with any worker started in the dead one's place
    load the newest checkpoint on the new group and train on, saying so in one line. The
    state right after equals the checkpoint's on every rank; in the steps the final
    model carries, each epoch saw every sample exactly once."""
    save_at = 4
    env = {"N": str(N), "SHARDING": "", "CKPT_DIR": str(tmp_path / "ckpt"),
           "SAVE_AT": str(save_at)}
    with agent_job(tmp_path, "sr", WORKER, env) as job:
        job.allocate(3)

        def steps() -> list[dict]:
            return [r for rs in job.records().values() for r in rs if r["kind"] == "step"]

        saved = wait_for(lambda: next((r for rs in job.records().values() for r in rs
                                       if r["kind"] == "saved"), None), 180, "the save")
        victim = wait_for(lambda: next((r["pid"] for r in steps() if r["rank"] == 2
                                        and r["step"] >= save_at + 3), None),
                          180, f"{save_at + 3} steps of rank 2")
        kill_round = max(r["round"] for r in steps())
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: sum(1 for r in steps() if r["round"] > kill_round and r["rank"] == 0)
                 >= 6, 180, "6 steps after the failure")
        (job.log_dir / "stop").touch()
        status = job.finished(180)
        assert status.state == "succeeded", status
        logs = job.records()
        kv = job.store.get(keys.job("sr", "restarts"))  # what status shows (RESTARTS)
        restarts = decode(JobRestarts, kv.value) if kv else None
    assert "took state its peers do not hold: resumed from" in capfd.readouterr().out
    last = max(r["step"] for rs in logs.values() for r in rs
               if r["kind"] == "step" and r["round"] <= kill_round)
    assert restarts is not None and restarts.count == 1 == restarts.resumed, restarts
    assert 0 < restarts.lost_progress <= last - save_at + 1, (restarts, last)
    states = [r for rs in logs.values() for r in rs
              if r["kind"] == "state" and r["when"] == "rescale" and r["round"] > kill_round]
    first = min(r["round"] for r in states)
    resumed = [r for r in states if r["round"] == first]
    assert resumed and {(r["step"], r["digest"]) for r in resumed} == {
        (save_at, saved["digest"])}, resumed
    carried = [r for rs in logs.values() for r in rs if r["kind"] == "step"
               and (r["round"] > kill_round or r["step"] <= save_at)]
    _each_epoch_saw_every_sample_once(carried)
    survivors = {r["pid"] for r in carried if r["round"] > kill_round} - {victim}
    before = {r["pid"] for r in carried if r["round"] <= kill_round}
    assert survivors & before, "the survivors kept their processes"


@pytest.mark.parametrize("replicas", [2, 1])
def test_sigterm_to_a_sharded_job_writes_a_final_checkpoint_with_every_rank(
        tmp_path: Path, capfd, replicas: int) -> None:
    """SIGTERM to every worker of a sharded job (a cancel, a drain, a batch system's
    preemption), no periodic checkpoint yet: no rank can write the state alone, so they
    agree at the next vote, write the final checkpoint together (every rank its shards)
    and end by the signal, all at the same step (one rank alone writes it at once). The
    workers that replace them resume from it: the same step, the whole model and Adam
    state bit for bit."""
    env = {"N": str(N), "SHARDING": "", "CKPT_DIR": str(tmp_path / "ckpt")}
    with agent_job(tmp_path, "term", WORKER, env) as job:
        job.allocate(replicas)

        def steps() -> list[dict]:
            return [r for rs in job.records().values() for r in rs if r["kind"] == "step"]

        wait_for(lambda: sum(r["step"] >= 5 for r in steps()) >= replicas, 180, "5 steps")
        first = {r["pid"] for r in steps()}
        assert len(first) == replicas and not (tmp_path / "ckpt" / "latest").exists()
        for pid in first:
            os.kill(pid, signal.SIGTERM)
        resumed = wait_for(lambda: [r for rs in job.records().values() for r in rs
                                    if r["kind"] == "start" and r["pid"] not in first
                                    and r["resumed"] is not None], 180, "the replacements")
        (job.log_dir / "stop").touch()
        assert job.finished().state == "succeeded"
        logs = job.records()
    out = capfd.readouterr().out
    said = ("SIGTERM: writing a final checkpoint with the job's other ranks" if replicas > 1
            else "SIGTERM: writing a final checkpoint")
    assert out.count(said) == replicas, out
    last = {r["pid"]: r["step"] for rs in logs.values() for r in rs
            if r["kind"] == "step" and r["pid"] in first}
    assert len(set(last.values())) == 1, last  # both ended at the same step
    [final] = set(last.values())
    assert {r["step"] for r in resumed} == {final}, resumed
    if replicas > 1:  # (the state's digest is logged after the vote's step: not alone)
        states = {r["digest"] for rs in logs.values() for r in rs if r["kind"] == "state"
                  and r["when"] == "step" and r["step"] == final and r["round"] == 1}
        assert len(states) == 1
        assert {r["digest"] for r in resumed} == states, resumed
    carried = [r for rs in logs.values() for r in rs if r["kind"] == "step"]
    _each_epoch_saw_every_sample_once(carried)


def test_a_sharded_checkpoint_taken_at_3_resumes_at_2_and_at_4(tmp_path: Path) -> None:
    """Every rank writes its shards (DCP, in the background); a new job started from the
    checkpoint at another size holds the same whole model and Adam state."""
    ckpt = tmp_path / "ckpt"
    env = {"N": str(N), "SHARDING": "", "CKPT_DIR": str(ckpt), "SAVE_AT": "5"}
    with agent_job(tmp_path / "first", "c3", WORKER, env) as job:
        job.allocate(3)
        saved = wait_for(lambda: next((r for rs in job.records().values() for r in rs
                                       if r["kind"] == "saved"), None), 180, "the save")
        (job.log_dir / "stop").touch()
        assert job.finished().state == "succeeded"
    assert (ckpt / "latest").exists() and not list(ckpt.glob("shards-*"))
    for replicas in (2, 4):
        where = tmp_path / f"at{replicas}"
        with agent_job(where, f"c{replicas}", WORKER, {**env, "SAVE_AT": "0"}) as job:
            job.allocate(replicas)
            starts = wait_for(lambda j=job, r=replicas: len(
                s := [x for rs in j.records().values() for x in rs if x["kind"] == "start"]
            ) == r and s, 180, f"{replicas} workers started")
            (job.log_dir / "stop").touch()
            assert job.finished().state == "succeeded"
        assert {s["digest"] for s in starts} == {saved["digest"]}, replicas
        assert {s["step"] for s in starts} == {saved["step"]}


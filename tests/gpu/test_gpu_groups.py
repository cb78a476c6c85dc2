"""The GPU suite: process groups over CUDA tensors, re-formed in place.

Run it with ``pytest tests/gpu`` on a machine with a GPU (one is enough); without CUDA
only the ``[cpu]`` variants run (gloo, tensors on the CPU: a check of the harness). See
``test_gpu_rescale.py`` for the suite as a whole.

* a single-rank job whose group is re-formed twice in the same process, on NCCL (on the
  CPU variant: gloo): each round is a fresh group (its own TCPStore) whose collectives and
  ``broadcast_state`` work on the device, and training goes on across them;
* two processes on one GPU over gloo: DDP, the trainer's state sync and the rendezvous'
  state transfer with CUDA tensors (NCCL cannot put two ranks on one GPU; gloo can).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from gpu_harness import expected_device

pytestmark = pytest.mark.cuda


def test_single_rank_group_reformed_in_place(device, gpu_job):
    """Allocations 1, 1', 1'' (new versions, the same single replica): the worker's process
    group is destroyed and formed again, in the same process, twice."""
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    job = gpu_job(device, backend=backend)
    job.allocate(1)
    job.start("w0")
    for n in range(1, 4):
        if n > 1:
            job.allocate(1)  # a new allocation version: the job re-forms at the same size
        rnd = job.wait_for(lambda n=n: len(r := job.records("round")) >= n and r[n - 1],
                           f"round {n}")
        job.wait_steps(4, worker="w0", round=rnd["round"])
    job.finish()

    home = expected_device(device, 0)
    start = job.one("start")
    assert start["device"] == home and start["backend"] == backend, start
    rounds = job.records("round")
    assert len(rounds) == 3, rounds
    assert rounds[0]["round"] < rounds[1]["round"] < rounds[2]["round"]
    assert {r["pid"] for r in job.records() if "pid" in r} == {start["pid"]}  # in place
    assert len({r["port"] for r in rounds}) == 3, "each round hosts a fresh TCPStore"
    for r in rounds:
        assert (r["world"], r["rank"], r["backend"], r["reason"]) == (
            1, 0, backend, "allocation"), r
        assert r["allreduce"] == 1.0, r  # a collective on the device, on the new group
        assert r["bcast_device"] == home and r["bcast"] == [100.0 * r["round"]] * 3, r
        # the trainer's own call (rank 0, the source, gets its own tensors back)
        assert r["bcast_default_device"] == home and r["bcast_default"] == r["bcast"], r
    steps = job.records("step")
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)), "a step was lost"
    for r in rounds:
        assert len([s for s in steps if s["round"] == r["round"]]) >= 4, r
    assert all(s["devices"] == [home] and s["finite"] for s in steps), steps[-1]


def test_gloo_cuda_tensors_two_processes_share_one_gpu(device, gpu_job):
    """Two workers pinned to the same device (cuda:0) on gloo: they start different, take
    rank 0's state, all-reduce and broadcast CUDA tensors, and DDP keeps them identical."""
    pinned = "cuda:0" if device == "cuda" else "cpu"
    job = gpu_job(pinned, backend="gloo")
    job.allocate(2)
    job.start("w0")
    job.start("w1")
    for worker in ("w0", "w1"):
        job.wait_steps(8, worker=worker, world=2)
    job.finish()

    starts = {w: job.one("start", worker=w) for w in ("w0", "w1")}
    assert starts["w0"]["pid"] != starts["w1"]["pid"]
    assert {s["device"] for s in starts.values()} == {pinned}  # one GPU, two processes
    assert {s["backend"] for s in starts.values()} == {"gloo"}
    assert sorted(s["rank"] for s in starts.values()) == [0, 1]
    assert starts["w0"]["params"] != starts["w1"]["params"], "precondition: replicas differ"
    rank0 = next(w for w, s in starts.items() if s["rank"] == 0)
    joined = {w: job.one("joined", worker=w) for w in starts}
    assert joined["w0"]["params"] == joined["w1"]["params"] == starts[rank0]["params"]
    assert all(j["devices"] == [pinned] for j in joined.values()), joined

    rounds = job.records("round")
    assert len(rounds) == 2 and len({r["round"] for r in rounds}) == 1, rounds
    first = rounds[0]["round"]
    for r in rounds:
        assert (r["world"], r["backend"]) == (2, "gloo") and r["allreduce"] == 3.0, r
        assert r["bcast_device"] == pinned and r["bcast"] == [100.0 * first] * 3, r
        # the trainer's own call: gloo's transfer lands on the CPU (the trainer's
        # load_state_dict puts it on the device: ``joined`` above); rank 0, the source,
        # gets its own tensors back
        assert r["bcast_default_device"] == (pinned if r["rank"] == 0 else "cpu"), r
        assert r["bcast_default"] == r["bcast"], r
    steps = job.steps_by_number(world=2)
    assert len(steps) >= 8
    for step, recs in steps.items():
        assert len(recs) == 2, (step, recs)
        assert len({r["params"] for r in recs}) == 1, f"replicas diverged at step {step}"
        assert len({r["opt"] for r in recs}) == 1, f"optimizer states differ at step {step}"
        assert all(r["devices"] == [pinned] and r["finite"] for r in recs), recs

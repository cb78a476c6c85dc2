"""The GPU suite: live rescales of jobs whose training state lives on CUDA devices.

Run it with ``pytest tests/gpu`` (``OMP_NUM_THREADS=1 .venv/bin/pytest -q tests/gpu``) on a
machine with a GPU; one GPU is enough (the two-process tests share it over gloo; the
NCCL multi-GPU variant needs two). Without CUDA every test is skipped (with the reason)
except its ``[cpu]`` variant, which runs the same test body with the tensors on the CPU
to check the harness; ``pytest tests/gpu -m cpu_sanity`` runs just those.

Each test starts real worker processes (``gpu_worker.py``: the native adapter's
``init``, ``AdaptiveDataLoader`` and ``ElasticTrainer``, the model on its device) against
an embedded store and plays the coordinator, writing allocations while they train; the
workers re-form their process group in place, and the test checks what they recorded.

This module: tensors through grow and shrink, the AMP grad scaler across a rescale, and
where a newcomer's state lands. ``test_gpu_groups.py``: the process groups themselves.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_harness import expected_device

pytestmark = pytest.mark.cuda


def _identical_replicas(job, world: int) -> int:
    """Every step taken by ``world`` replicas: all of them hold the same parameters and
    optimizer state afterwards. Returns how many such steps there were."""
    steps = job.steps_by_number(world=world)
    for step, recs in steps.items():
        assert len(recs) == world, (step, recs)
        assert len({r["params"] for r in recs}) == 1, f"replicas diverged at step {step}"
        assert len({r["opt"] for r in recs}) == 1, f"optimizer states differ at step {step}"
    return len(steps)


def _joined_from_rank0(job, newcomer: str, rank0: str) -> dict:
    """The newcomer's state before its first step is rank 0's after the step it joined at
    (and not what it initialised itself)."""
    joined = job.one("joined", worker=newcomer)
    start = job.one("start", worker=newcomer)
    source = job.one("step", worker=rank0, step=joined["step"])
    assert joined["step"] > 0, "the newcomer joined a job that had trained"
    assert joined["params"] == source["params"] != start["params"], (joined, source, start)
    assert joined["opt"] == source["opt"], "the optimizer state did not come along"
    assert joined["opt_entries"] == source["opt_entries"] > 0, joined
    # placed as the optimizer places it itself: Adam's step counts stay on the CPU (where
    # they arrive is left as it is by load_state_dict; on the GPU each step would sync)
    assert joined["step_devices"] == source["step_devices"] == ["cpu"], (joined, source)
    return joined


def test_cuda_tensors_through_a_live_rescale(device, gpu_job):
    """1 -> 2 -> 1 replicas (gloo, so one GPU will do): the survivor keeps its process and
    its tensors on its device through both rescales, the newcomer trains on its own
    device from rank 0's state, the two stay identical step by step, and the survivor
    trains on alone after the newcomer left."""
    job = gpu_job(device, backend="gloo")
    job.grow_1_to_2(alone=6, together=6)
    job.allocate(1)
    assert job.wait_exit("w1") == 0, job.output()  # removed by the shrink: exit 0
    before = job.records("step", worker="w0")[-1]["step"]
    job.wait_for(lambda: job.records("step", worker="w0")[-1]["step"] >= before + 5,
                 "the survivor to train on alone")
    job.finish()

    w0, w1 = job.one("start", worker="w0"), job.one("start", worker="w1")
    assert (w0["rank"], w1["rank"]) == (0, 1)
    home = {"w0": expected_device(device, 0), "w1": expected_device(device, 1)}
    assert (w0["device"], w1["device"]) == (home["w0"], home["w1"])
    # one process each, all along
    for worker, start in (("w0", w0), ("w1", w1)):
        assert {r["pid"] for r in job.records(worker=worker) if "pid" in r} == {start["pid"]}
    # the survivor was in three rounds; the tensors never left the device
    rounds = job.records("round", worker="w0")
    assert [r["world"] for r in rounds] == [1, 2, 1], rounds
    assert rounds[0]["round"] < rounds[1]["round"] < rounds[2]["round"]
    assert [r["allreduce"] for r in rounds] == [1.0, 3.0, 1.0]
    for worker in ("w0", "w1"):
        steps = job.records("step", worker=worker)
        assert all(r["devices"] == [home[worker]] for r in steps), (worker, steps[-1])
        assert all(r["finite"] for r in steps), worker
        assert [r["step"] for r in steps] == list(range(steps[0]["step"], steps[-1]["step"] + 1))
    # the newcomer started from rank 0's state, on its own device
    joined = _joined_from_rank0(job, "w1", "w0")
    assert joined["devices"] == [home["w1"]], joined
    assert _identical_replicas(job, 2) >= 6
    # training went on across both rescales, on rank 0's count of steps
    steps = [r["step"] for r in job.records("step", worker="w0")]
    world1_after = [r for r in job.records("step", worker="w0", world=1)
                    if r["round"] == rounds[2]["round"]]
    assert len(world1_after) >= 5 and world1_after[0]["step"] > joined["step"]
    assert steps[-1] >= 17
    left = job.one("left", worker="w1")
    assert left["code"] == 0


def test_amp_grad_scaler_state_across_a_rescale(device, gpu_job):
    """AMP (autocast + GradScaler, growth every 3 steps from 256): a newcomer takes rank
    0's scale and growth tracker instead of its own initial ones; the survivor's scaler is
    not reset by the rescale; afterwards both ranks' scalers agree at every step."""
    job = gpu_job(device, backend="gloo", amp=True)
    job.grow_1_to_2(alone=7, together=6)
    job.finish()

    init = 256.0  # gpu_worker.INIT_SCALE
    joined = _joined_from_rank0(job, "w1", "w0")
    source = job.one("step", worker="w0", step=joined["step"])
    assert source["scale"] != init, "precondition: rank 0's scale grew before the rescale"
    assert (joined["scale"], joined["tracker"]) == (source["scale"], source["tracker"])
    # rank 0 went on from its own scale (one growth or backoff at most), not from 256
    after = [r for r in job.records("step", worker="w0", world=2)]
    assert after and after[0]["step"] == source["step"] + 1
    assert after[0]["scale"] in (source["scale"], source["scale"] * 2, source["scale"] / 2)
    if device == "cpu":  # float32 gradients never overflow here: the scale only grows
        scales = [r["scale"] for r in job.records("step", worker="w0")]
        assert scales == sorted(scales) and scales[-1] >= init * 2 ** 4, scales
    # both ranks' scalers step together (the all-reduced gradients overflow together)
    for step, recs in job.steps_by_number(world=2).items():
        assert len({(r["scale"], r["tracker"]) for r in recs}) == 1, (step, recs)
        assert all(math.isfinite(r["scale"]) and r["scale"] > 0 for r in recs)
    assert _identical_replicas(job, 2) >= 6


NEWCOMER_CASES = [
    pytest.param("cpu", "gloo", id="cpu-gloo"),
    pytest.param("cuda", "gloo", id="cuda-gloo"),
    pytest.param("cuda", "nccl", id="cuda-nccl", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
        reason="NCCL with two ranks needs two GPUs (one GPU per rank)")),
]


@pytest.mark.parametrize(("device", "backend"), NEWCOMER_CASES)
def test_newcomer_state_lands_on_its_own_device(device, backend, gpu_job):
    """A newcomer (rank 1, local rank 1) learns its LOCAL_RANK from init(), puts itself on
    ``cuda:LOCAL_RANK`` and finds the model and optimizer state it received from rank 0
    there (parameters, buffers, Adam's moments), not on rank 0's device or on the CPU."""
    job = gpu_job(device, backend=backend)
    job.grow_1_to_2(alone=5, together=5)
    job.finish()

    start = job.one("start", worker="w1")
    assert (start["rank"], start["local_rank"], start["env_local_rank"]) == (1, 1, 1), start
    home = expected_device(device, 1)
    assert start["device"] == home
    if device == "cuda":
        assert f"cuda:{start['current_cuda']}" == home
    joined = _joined_from_rank0(job, "w1", "w0")
    assert joined["devices"] == [home], joined
    rank0 = job.one("start", worker="w0")
    assert rank0["device"] == expected_device(device, 0)
    for worker, dev in (("w0", rank0["device"]), ("w1", home)):
        assert all(r["devices"] == [dev] for r in job.records("step", worker=worker))
    # the group's collectives work with each rank on its device
    rounds = job.records("round", world=2)
    assert sorted(r["rank"] for r in rounds) == [0, 1] and {r["backend"] for r in rounds} == {
        backend}
    for r in rounds:
        assert r["allreduce"] == 3.0, r
        assert r["bcast_device"] == expected_device(device, r["local_rank"])
        assert r["bcast"] == [100.0 * r["round"]] * 3, r  # rank 0's value
    assert _identical_replicas(job, 2) >= 5

"""Clusters of several GPU types: no job spans two, a job runs only on the types it
allows, a running job keeps its type (policy/gpu_types.py, the coordinator's use of it),
and the types' names (the agent's detection, the validating decode layer)."""

from __future__ import annotations

import numpy as np
import pytest

from pollux_launch import keys
from pollux_launch.coordinator.service import Coordinator
from pollux_launch.launcher.devices import gpu_type, gpu_type_name
from pollux_launch.messages import (
    Allocation,
    JobSpec,
    MessageError,
    NodeInfo,
    decode,
    encode,
)
from pollux_launch.policy import JobInfo, PolicyNode, make_policy
from pollux_launch.policy.gpu_types import assign_types, typed_allocation
from pollux_launch.rendezvous.store import open_store

NOW = 1000.0


def _job(name: str, lo: int = 1, hi: int = 8) -> JobInfo:
    def speedup(nodes, replicas):
        replicas = np.asarray(replicas, dtype=float)
        return replicas / (1.0 + 0.05 * replicas) * (np.asarray(nodes) <= 2)

    return JobInfo(name, speedup, age=100.0, min_replicas=lo, max_replicas=hi)


@pytest.mark.parametrize("seed", range(20))
def test_no_job_spans_two_types_and_each_stays_within_its_allowed_ones(seed):
    rng = np.random.default_rng(seed)
    kinds = ["A100", "H100", "V100"][:rng.integers(2, 4)]
    node_types = [str(rng.choice(kinds)) for _ in range(rng.integers(2, 7))]
    nodes = [PolicyNode(f"n{i}", int(rng.integers(1, 5))) for i in range(len(node_types))]
    jobs = [_job(f"j{k}", 1, int(rng.integers(1, 6))) for k in range(rng.integers(1, 6))]
    allowed = [frozenset(rng.choice(kinds, rng.integers(0, 3), replace=False).tolist())
               for _ in jobs]
    current = np.zeros((len(jobs), len(nodes)), dtype=int)
    for j in range(len(jobs)):  # some jobs run somewhere already, maybe across types
        if rng.random() < 0.5:
            current[j, rng.integers(len(nodes))] = 1
    engines = {t: make_policy("pollux-dp", p=-1.0, delta=1.0).optimize for t in kinds}
    target = typed_allocation(engines, jobs, nodes, current, node_types, allowed)
    assert target.shape == current.shape
    assert (target.sum(axis=0) <= [n.slots for n in nodes]).all()
    for j in range(len(jobs)):
        used = {node_types[i] for i in np.flatnonzero(target[j])}
        assert len(used) <= 1, (j, used)
        assert not allowed[j] or used <= allowed[j], (j, used, allowed[j])


def test_a_running_job_keeps_its_type_and_a_new_one_takes_the_roomiest_allowed():
    nodes = [PolicyNode("a1", 2), PolicyNode("b1", 4), PolicyNode("b2", 4)]
    types = ["A100", "H100", "H100"]
    jobs = [_job("running", 2), _job("new"), _job("only-a", 1), _job("nowhere")]
    current = np.array([[2, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    allowed = [frozenset(), frozenset(), frozenset({"A100"}), frozenset({"L40S"})]
    assert assign_types(jobs, nodes, current, types, allowed) == [
        "A100", "H100", "A100", None]


def test_the_coordinator_never_spans_types_and_honours_a_job_s_types(tmp_path):
    with open_store(f"embedded://{tmp_path / 'store.db'}") as store:
        for name, kind in (("a1", "A100"), ("h1", "H100")):
            store.put(keys.node(name), encode(NodeInfo(name, 2, "127.0.0.1", NOW,
                                                       gpu_type=kind)))
        for name, types in (("any", ()), ("fast", ("H100",))):
            store.put(keys.job(name, "spec"), encode(JobSpec(
                name, ("python", "t.py"), initial_replicas=1, min_replicas=1, max_replicas=4,
                submit_time=NOW - 500, gpu_types=types)))
        Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0),
                    clock=lambda: NOW).schedule_once()
        placed = {n: set(decode(Allocation, store.get(keys.job(n, "allocation")).value).nodes)
                  for n in ("any", "fast")}
    assert placed["fast"] == {"h1"}
    assert placed["any"] in ({"a1"}, {"h1"})  # one type, whichever


def test_gpu_types_go_through_the_validating_decode_layer():
    node = NodeInfo("n1", 2, "127.0.0.1", NOW, gpus=("0", "1"), gpu_type="H100")
    assert decode(NodeInfo, encode(node)) == node
    spec = JobSpec("j", ("python",), gpu_types=("A100", "H100"))
    assert decode(JobSpec, encode(spec)).gpu_types == ("A100", "H100")
    for bad in ("H100; rm", "x" * 65, ""):
        if bad:  # (a node's "": an agent that names no type)
            with pytest.raises(MessageError, match="not a GPU type"):
                decode(NodeInfo, encode(node).replace('"H100"', f'"{bad}"'))
        with pytest.raises(MessageError, match="not a GPU type"):
            decode(JobSpec, encode(spec).replace('"A100"', f'"{bad}"'))


@pytest.mark.parametrize("model, kind", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("Tesla V100-SXM2-16GB", "V100"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L40S", "L40S"),
    ("AMD Instinct MI300X", "MI300X"), ("NVIDIA GeForce RTX 4090", "NVIDIA-GeForce-RTX-4090"),
    ("", "gpu"),
])
def test_a_driver_s_model_name_becomes_a_type(model, kind):
    assert gpu_type_name(model) == kind


def test_cpu_slots_are_a_type_of_their_own():
    assert gpu_type(()) == "cpu"


def test_a_missing_node_in_its_grace_keeps_its_type(tmp_path):
    """A node whose record vanished keeps its jobs' replicas for the coordinator's grace;
    it is offered with the type it had - else it became a type of its own and a job
    there and on a present node of that type looked split across two types, and could
    be moved onto the missing node alone (the full suite caught that)."""
    with open_store(f"embedded://{tmp_path / 'store.db'}") as store:
        for name, kind in (("n1", "cpu"), ("n2", "cpu"), ("g1", "H100")):
            store.put(keys.node(name), encode(NodeInfo(name, 1, "127.0.0.1", NOW,
                                                       gpu_type=kind)))
        store.put(keys.job("j", "spec"), encode(JobSpec(
            "j", ("python", "t.py"), initial_replicas=2, min_replicas=1, max_replicas=2,
            submit_time=NOW - 500)))
        store.put(keys.job("j", "allocation"), encode(Allocation(3, ("n1", "n2"), NOW - 100)))
        coordinator = Coordinator(store, make_policy("pollux-dp", p=-1.0, delta=1.0),
                                  clock=lambda: NOW)
        coordinator.schedule_once()
        store.delete(keys.node("n2"))  # n2 is missing (within its grace)
        coordinator.schedule_once()
        nodes = decode(Allocation, store.get(keys.job("j", "allocation")).value).nodes
    assert "n1" in nodes, nodes

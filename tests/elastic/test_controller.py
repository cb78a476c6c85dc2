"""The shared elastic controller: decisions, cadence, checkpoints and failure typing,
on a real GoodputTuner, real gloo process groups and real checkpoint files.

``_Hooks`` is a complete, minimal framework adapter (a linear model and SGD), the same
interface the torch, DeepSpeed and Horovod adapters implement.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pollux_launch.elastic.checkpoint import latest_checkpoint
from pollux_launch.elastic.controller import CheckpointWriter, Decision, ElasticController
from pollux_launch.elastic.failures import is_peer_failure
from pollux_launch.peer_failure import recorded_peer_failure
from pollux_launch.rendezvous.protocol import RendezvousError
from pollux_launch.tuning.gns import GradNoise
from pollux_launch.tuning.profile import ProfileKey, StepProfile
from pollux_launch.tuning.progress import StatisticalProgress
from pollux_launch.tuning.tuner import GoodputTuner, TunerConfig


class _Group:
    """One process, or the default gloo group of a real multi-process test."""

    def __init__(self, size: int | None = None) -> None:
        self._size = size

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        if self._size is not None:
            return self._size
        return dist.get_world_size() if dist.is_initialized() else 1

    num_nodes = 1

    def broadcast(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if dist.is_initialized():  # (else one process posing as a larger group)
            dist.broadcast(tensor, 0)
        return tensor

    def allreduce(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=ops[op])
        return tensor / self.world_size if op == "mean" else tensor

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        rows = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(rows, tensor)
        return torch.stack(rows)


class _Hooks:
    def __init__(self, profile: StepProfile) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.m, self.s, self.factor = 8, 0, 1.0
        self.applied: list[tuple[int, int]] = []
        self.grad: GradNoise | None = None
        self.profile = profile

    def batch(self) -> tuple[int, int]:
        return self.m, self.s

    def apply_batch(self, m: int, s: int) -> None:
        self.m, self.s = m, s
        self.applied.append((m, s))
        self.profile.set_key(ProfileKey(1, 1, m, s))

    def set_lr_factor(self, factor: float) -> None:
        self.factor = factor

    def grad_stats(self) -> GradNoise | None:
        return self.grad

    def capture(self, controller_state: dict[str, Any]) -> None:
        return None

    def rebuild(self, captured: Any, controller_state: dict[str, Any], from_rank0: bool):
        return None

    def leave(self) -> None:
        pass

    def checkpoint_state(self, controller_state: dict[str, Any], collective: bool):
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "ctl": controller_state}

    def checkpoint_needs_peers(self) -> bool:
        return False

    def restore_checkpoint(self, state: dict[str, Any]):
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        return None, state["ctl"]


def _controller(checkpoints=None, group=None, rule: str = "adascale", min_gain: float = 0.05,
                decide_every: int = 5) -> ElasticController:
    profile = StepProfile(warmup_steps=0)
    hooks = _Hooks(profile)
    config = TunerConfig(init_batch_size=8, max_batch_size=64, local_bsz_bounds=(4, 64),
                         lr_scaling=rule, min_gain=min_gain)
    box: list[ElasticController] = []
    tuner = GoodputTuner(config, profile, lambda: box[0].grad, StatisticalProgress(8, 800))
    ctl = ElasticController(hooks, tuner, group or _Group(), decide_every=decide_every,
                            checkpoints=checkpoints)
    box.append(ctl)
    return ctl


def test_decision_round_trips_and_a_malformed_one_is_refused():
    d = Decision(16, 2, 7, 1.75, True, True, (2, 0), True)
    assert Decision.from_tensor(d.to_tensor()) == d
    for bad in ([0, 0, 1, 1.0, 0], [8, -1, 1, 1.0, 0], [8, 0, 0, 1.0, 0],
                [8, 0, 1, float("nan"), 0], [8, 0, 1, 0.0, 0], [8, 0, 1, 1.0, 0, 0, 3, 2, 0],
                [8, 0, 1, 1.0, 0, 0, -1, 0, 0]):
        bad = bad + [0] * (Decision.SIZE - len(bad))
        with pytest.raises(ValueError, match="malformed decision"):
            Decision.from_tensor(torch.tensor(bad, dtype=torch.float64))


def test_start_forces_a_decision_and_the_cadence_is_decide_every():
    ctl = _controller(decide_every=5)
    ctl.start(fresh=True, sync=False)
    hooks = ctl.hooks
    assert hooks.applied == [(8, 0)] and ctl.resets == 1  # the forced one
    hooks.grad = GradNoise(sqr=1.0, var=50.0, init_batch_size=8)  # very noisy: grow
    for _ in range(12):
        hooks.profile.record(0.01 + 0.0001 * hooks.m)
        ctl.after_step(hooks.m)
    assert ctl.steps == 12
    assert ctl.tuner.progress.steps == 12
    # decisions at steps 5 and 10 only: a noisy gradient makes a larger batch pay off
    assert len(hooks.applied) >= 2 and hooks.applied[-1][0] > 8
    assert hooks.factor == ctl.lr_factor > 1.0  # AdaScale's gain for the larger batch


def test_a_size_change_underneath_is_a_new_group():
    group = _Group(size=1)
    ctl = _controller(group=group)
    ctl.start(fresh=True, sync=False)
    group._size = 2  # as after a Horovod reset that removed workers... or added: decide now
    ctl.after_step(8)
    assert ctl.resets == 2 and len(ctl.hooks.applied) == 2


def test_checkpoints_are_decided_written_and_resumed(tmp_path):
    writer = CheckpointWriter(tmp_path, every=0.0)
    ctl = _controller(checkpoints=writer, decide_every=3)
    ctl.start(fresh=True, sync=False)
    for _ in range(3):
        ctl.after_step(8)
    writer.flush()
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 3 and ckpt.progress == 3
    with torch.no_grad():
        ctl.hooks.model.weight.add_(1.0)  # trained on after the checkpoint
    saved = ckpt.state["model"]["weight"]

    again = _controller(checkpoints=CheckpointWriter(tmp_path, every=3600))
    again.start(fresh=True, sync=False)
    assert again.steps == 3 and again.resumed_from == 3
    assert torch.equal(again.hooks.model.weight, saved)


def test_a_checkpoint_that_does_not_fit_the_hooks_is_logged_and_training_starts_afresh(
        tmp_path, caplog):
    writer = CheckpointWriter(tmp_path, every=0.0)
    writer.save({"something": torch.zeros(1)}, step=3, progress=3.0, replicas=1, wait=True)
    ctl = _controller(checkpoints=CheckpointWriter(tmp_path, every=3600))
    ctl.start(fresh=True, sync=False)
    assert ctl.steps == 0 and ctl.resumed_from is None
    assert "not resuming" in caplog.text


def test_peer_failures_are_recognised_by_type_first():
    assert is_peer_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_peer_failure(dist.DistNetworkError("connection refused"))
    assert not is_peer_failure(RuntimeError("Connection reset by peer"))  # no group exists
    assert not is_peer_failure(RendezvousError("store unreachable: connection reset"))
    assert not is_peer_failure(ValueError("connection"))


def test_recorded_errors_of_peers_are_told_from_root_causes():
    """A failed worker's recorded error (torchrun's error file, ``Type: text``): a peer's
    failure by type, or gloo's untyped one by its words; a script's own error is not."""
    assert recorded_peer_failure("DistBackendError: NCCL communicator was aborted")
    assert recorded_peer_failure("torch.distributed.DistNetworkError: connection refused")
    assert recorded_peer_failure("RuntimeError: [../gloo/transport/tcp/pair.cc:553] "
                                 "Connection closed by peer [127.0.0.1]:35483")
    assert not recorded_peer_failure("RuntimeError: rank 1 fails in its first attempt")
    assert not recorded_peer_failure("ValueError: connection string malformed")
    assert not recorded_peer_failure("no type here")


def _worker(rank: int, port: int, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=2, timeout=datetime.timedelta(seconds=30))
    # each rank's tuner sees different gradient statistics: only rank 0's may count
    ctl = _controller(decide_every=4, min_gain=0.0)
    ctl.hooks.grad = GradNoise(sqr=1.0, var=50.0 if rank == 0 else 0.01, init_batch_size=8)
    ctl.start(fresh=True, sync=False)
    for _ in range(8):
        ctl.hooks.profile.record(0.01 + 0.0001 * ctl.hooks.m)
        ctl.after_step(ctl.hooks.m)
    out.put((rank, ctl.hooks.applied, ctl.lr_factor, ctl.check_every))
    if rank == 1:  # a gloo collective whose peer is gone: typed only by its message
        out.put(("done",))
        out.close()
        out.join_thread()  # (flushed before the abrupt exit)
        os._exit(0)
    try:
        import time

        time.sleep(1.0)
        dist.all_reduce(torch.ones(1))
    except RuntimeError as exc:
        out.put(("failure", is_peer_failure(exc)))
    dist.destroy_process_group()


def spawn_ranks(target: Any, messages: int, world: int = 2) -> tuple[list, list]:
    """Run ``target(rank, port, queue)`` in ``world`` spawned processes (a gloo group on
    ``port``); returns the first ``messages`` items they queue and the joined processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in range(messages)]
    for p in procs:
        p.join(timeout=60)
    return got, procs


def test_every_rank_applies_rank_0s_decision_and_a_dead_peer_is_a_peer_failure():
    got, _ = spawn_ranks(_worker, 4)
    decisions = {g[0]: g[1:] for g in got if isinstance(g[0], int)}
    assert decisions[0] == decisions[1]  # batches, LR factor and vote interval alike
    assert decisions[0][0][-1][0] > 8 and decisions[0][1] > 1.0  # rank 0's noisy view won
    assert ("failure", True) in got

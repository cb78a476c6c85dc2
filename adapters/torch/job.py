"""This worker's place in its job: the rendezvous under pollux-run, or a static group.

* Under ``pollux-run`` (``POLLUX_JOB`` set) the worker joins the job's live rendezvous
  and can move to new rounds in place (``next_round``).
* Under ``torchrun``/``mpirun``-style environments (``RANK``/``WORLD_SIZE`` set) it
  initialises a static process group from the environment, as plain PyTorch would.
* Otherwise it is a single standalone process (world size 1, no process group).

The torch environment variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) are kept up to date with the current round, so libraries that
read them see the truth.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pollux_launch import env as envvars
from pollux_launch.elastic.protocols import MemberRemoved
from pollux_launch.rendezvous.protocol import (
    ENV_JOB,
    GroupInfo,
    Rendezvous,
    RendezvousConfig,
    WorkerRemoved,
)

log = logging.getLogger(__name__)

__all__ = ["ElasticJob", "JobCollectives", "JobMembership", "Placement", "WorkerRemoved",
           "current_job", "init"]


def own_gpu_index(environ: Mapping[str, str] | None = None) -> int | None:
    """This worker's own GPU as a device index in what it sees (``GPUS``' position in
    ``CUDA_VISIBLE_DEVICES``), None where its agent gave it none."""
    environ = os.environ if environ is None else environ
    own = environ.get(envvars.GPUS)
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    return visible.index(own) if own and own in visible else None


@dataclass(frozen=True)
class Placement:
    """Where this worker stands in the current round."""

    rank: int
    world_size: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    round: int = 0


class ElasticJob:
    def __init__(self, rdzv: Rendezvous | None, backend: str | None) -> None:
        self.rdzv, self.backend = rdzv, backend
        self.info: GroupInfo | None = None
        self.rounds = 0
        self.placement = Placement(0, 1, 1, 0, 1)

    @property
    def elastic(self) -> bool:
        return self.rdzv is not None

    @property
    def name(self) -> str | None:
        return self.rdzv.job if self.rdzv else None

    @property
    def store(self):
        return self.rdzv.store if self.rdzv else None

    def next_round(self, hand_off: Any = None) -> GroupInfo:
        """Enter the job's next round (raises ``WorkerRemoved`` when not in it);
        ``hand_off``: as for ``Rendezvous.next_round``."""
        assert self.rdzv is not None
        self.info = self.rdzv.next_round(hand_off)
        self.rounds += 1
        self.placement = self._placement(self.info)
        _export_env(self.placement, self.info)
        log.info("round %d: rank %d of %d (%s)", self.info.round, self.info.rank,
                 self.info.world_size, self.info.reason)
        return self.info

    def vote(self, ending: bool) -> tuple[bool, bool]:
        """Collective, one all-reduce: (any rank saw a reason to re-form, any rank is
        ``ending``)."""
        return self.rdzv.vote(ending) if self.rdzv else (False, ending)

    def membership(self) -> JobMembership | None:
        """This job as the elastic controller's ``Membership``; None for a static job."""
        return JobMembership(self) if self.elastic else None

    @property
    def worker(self) -> str | None:
        """This worker's id in the job's rounds (None for a static job)."""
        return self.rdzv.worker if self.rdzv else None

    @property
    def device(self) -> torch.device:
        """Where this worker trains: its own GPU (the one its node agent gave it under
        pollux-run, else ``cuda:LOCAL_RANK`` as torchrun's scripts use), or the CPU where
        CUDA is absent. The same for the process's life: rescales never move it."""
        if not torch.cuda.is_available():
            return torch.device("cpu")
        index = own_gpu_index()
        if index is None:
            index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        return torch.device("cuda", index)

    def device_mesh(self, device_type: str | None = None) -> Any:
        """A 1-D ``DeviceMesh`` over this round's group, for ``fully_shard(mesh=...)``
        (cuda where the group is nccl, else cpu); a live rescale re-points a model
        sharded on it at the new round's mesh."""
        from .fsdp import device_mesh

        if not dist.is_initialized():
            raise RuntimeError("device_mesh(): no process group (call pollux.init() first; "
                               "a single process needs no mesh)")
        return device_mesh(device_type)

    def credit_resumed(self, progress: float) -> None:
        """The job resumed from a checkpoint with this progress (``JobRestarts``)."""
        if self.rdzv is not None:
            self.rdzv.credit_resumed(progress)

    def record_rollback(self, lost: float) -> None:
        """The job went back to a checkpoint in place, losing ``lost`` (``JobRestarts``)."""
        if self.rdzv is not None:
            self.rdzv.record_rollback(lost)

    def close(self) -> None:
        global _current
        if self.rdzv is not None:
            self.rdzv.close()
            self.rdzv = None
        if _current is self:  # init() starts a new one after this
            _current = None

    @staticmethod
    def _placement(info: GroupInfo) -> Placement:
        return Placement(info.rank, info.world_size, info.num_nodes, info.local_rank,
                         info.local_world_size, info.round)


class JobMembership:
    """An elastic ``ElasticJob`` as the controller's ``elastic.protocols.Membership``:
    the rendezvous's ``WorkerRemoved`` becomes the controller's ``MemberRemoved`` (the
    controller knows nothing of the rendezvous)."""

    def __init__(self, job: ElasticJob) -> None:
        self.job = job

    @property
    def elastic(self) -> bool:
        return self.job.elastic

    @property
    def name(self) -> str | None:
        return self.job.name

    @property
    def store(self) -> Any:
        return self.job.store

    def vote(self, ending: bool) -> tuple[bool, bool]:
        return self.job.vote(ending)

    def next_round(self, hand_off: Any = None) -> GroupInfo:
        """The job's next round; raises ``MemberRemoved`` when this worker is not in it."""
        try:
            return (self.job.next_round(hand_off) if hand_off is not None
                    else self.job.next_round())
        except WorkerRemoved as exc:
            raise MemberRemoved(str(exc)) from exc

    def credit_resumed(self, progress: float) -> None:
        self.job.credit_resumed(progress)

    def record_rollback(self, lost: float) -> None:
        self.job.record_rollback(lost)

    def close(self) -> None:
        self.job.close()


class JobCollectives:
    """The controller's view of the job's current group (``elastic.controller.
    Collectives``): small CPU broadcasts over the round's gloo control group, or over the
    default group of a static job (on its device for nccl)."""

    def __init__(self, job: ElasticJob) -> None:
        self.job = job

    @property
    def rank(self) -> int:
        return self.job.placement.rank

    @property
    def world_size(self) -> int:
        return self.job.placement.world_size

    @property
    def num_nodes(self) -> int:
        return self.job.placement.num_nodes

    def _where(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The process group to use and ``tensor`` on its device: the round's gloo control
        group, or the default group (a static nccl group moves device tensors only)."""
        group = self.job.rdzv.group if self.job.rdzv is not None else None
        if group is not None:
            return group.control, tensor
        if dist.get_backend() == "nccl":
            return None, tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return None, tensor

    def broadcast(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        group, t = self._where(tensor)
        dist.broadcast(t, 0, group=group)
        return t.cpu() if t is not tensor else tensor

    def allreduce(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        group, t = self._where(tensor)
        dist.all_reduce(t, op=_OPS[op], group=group)
        t = t.cpu()
        return t / self.world_size if op == "mean" else t

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        group, t = self._where(tensor)
        rows = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(rows, t, group=group)
        return torch.stack(rows).cpu()


_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


# The process's job once init() ran: a process belongs to one job at a time, as it has one
# default process group; close() clears it.
_current: ElasticJob | None = None


def init(backend: str | None = None, config: RendezvousConfig | None = None) -> ElasticJob:
    """Join this worker's job (see the module docstring); idempotent until ``close()``."""
    global _current
    if _current is not None:
        return _current
    if os.environ.get(ENV_JOB):
        _pin_device()
        config = config or RendezvousConfig(backend=backend)
        rdzv = Rendezvous.from_env(config)
        job = ElasticJob(rdzv, backend)
        # a worker that ends leaves the job before the interpreter tears down: its watcher
        # and keep-alive threads stop, its lease is revoked and its group destroyed while
        # everything they use still exists (a daemon thread touching the store during
        # finalisation can kill the process by a signal, which its agent takes for lost)
        atexit.register(job.close)
        rdzv.await_newcomers()  # the allocation's other newcomers, so survivors pause once
        job.next_round()
    else:
        job = ElasticJob(None, backend)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            if torch.cuda.is_available():  # (as torchrun's scripts do: nccl on GPUs)
                torch.cuda.set_device(job.device)
            dist.init_process_group(backend or ("nccl" if torch.cuda.is_available()
                                                else "gloo"))
        if dist.is_initialized():
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            job.placement = Placement(
                dist.get_rank(), dist.get_world_size(), max(1, world // local_world),
                int(os.environ.get("LOCAL_RANK", 0)), local_world)
    _current = job
    return job


def current_job() -> ElasticJob:
    return init()


def _pin_device() -> None:
    """Make the GPU this worker's agent gave it the current CUDA device, for good: a
    process keeps its device across rounds (its CUDA context and tensors live there)."""
    index = own_gpu_index()
    if index is not None and torch.cuda.is_available():
        torch.cuda.set_device(index)


def _export_env(p: Placement, info: GroupInfo) -> None:
    # LOCAL_RANK indexes the worker's own GPU where its agent gave it one (it never moves:
    # a torchrun-style cuda:LOCAL_RANK after a rescale must not land on another's GPU)
    device = own_gpu_index()
    local_rank = p.local_rank if device is None else device
    os.environ.update({
        "RANK": str(p.rank), "WORLD_SIZE": str(p.world_size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(p.local_world_size), "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
    })

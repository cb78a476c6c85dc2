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

import logging
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from pollux_launch.messages import Allocation, MessageError, decode
from pollux_launch.rendezvous.protocol import (
    ENV_JOB,
    GroupInfo,
    Rendezvous,
    RendezvousConfig,
    WorkerRemoved,
)
from pollux_launch.rendezvous.store import StoreError

log = logging.getLogger(__name__)

__all__ = ["ElasticJob", "Placement", "WorkerRemoved", "current_job", "init"]


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

    def next_round(self) -> GroupInfo:
        """Enter the job's next round (raises ``WorkerRemoved`` when not in it)."""
        assert self.rdzv is not None
        self.info = self.rdzv.next_round()
        self.rounds += 1
        self.placement = self._placement(self.info)
        _export_env(self.placement, self.info)
        log.info("round %d: rank %d of %d (%s)", self.info.round, self.info.rank,
                 self.info.world_size, self.info.reason)
        return self.info

    def rescale_due(self) -> bool:
        """Collective: True on every rank when any rank saw a reason to re-form."""
        return self.rdzv.should_rescale() if self.rdzv else False

    def close(self) -> None:
        if self.rdzv is not None:
            self.rdzv.close()
            self.rdzv = None

    def wait_for_peers(self, grace: float) -> None:
        """A newcomer waits (at most ``grace`` s) until every worker the allocation asks
        for has registered, so that the running replicas pause only once, briefly."""
        assert self.rdzv is not None
        store, rkeys = self.rdzv.store, self.rdzv.keys
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            rev = store.revision()
            kv = store.get(rkeys.allocation)
            try:
                want = decode(Allocation, kv.value).num_replicas if kv else 0
            except MessageError:
                return
            if want and len(store.get_prefix(rkeys.workers)) >= want:
                return
            store.wait(rkeys.prefix, rev, timeout=min(1.0, deadline - time.monotonic()))

    @staticmethod
    def _placement(info: GroupInfo) -> Placement:
        return Placement(info.rank, info.world_size, info.num_nodes, info.local_rank,
                         info.local_world_size, info.round)


_CURRENT: list[ElasticJob] = []  # the process's job, once init() ran (one per process)


def init(backend: str | None = None, config: RendezvousConfig | None = None) -> ElasticJob:
    """Join this worker's job (see the module docstring); idempotent."""
    if _CURRENT:
        return _CURRENT[0]
    if os.environ.get(ENV_JOB):
        config = config or RendezvousConfig(backend=backend)
        rdzv = Rendezvous.from_env(config)
        job = ElasticJob(rdzv, backend)
        try:
            job.wait_for_peers(config.grow_grace)
        except StoreError:
            pass  # next_round reports store trouble properly
        job.next_round()
    else:
        job = ElasticJob(None, backend)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend or "gloo")
        if dist.is_initialized():
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            job.placement = Placement(
                dist.get_rank(), dist.get_world_size(), max(1, world // local_world),
                int(os.environ.get("LOCAL_RANK", 0)), local_world)
    _CURRENT.append(job)
    return job


def current_job() -> ElasticJob:
    return init()


def _export_env(p: Placement, info: GroupInfo) -> None:
    os.environ.update({
        "RANK": str(p.rank), "WORLD_SIZE": str(p.world_size), "LOCAL_RANK": str(p.local_rank),
        "LOCAL_WORLD_SIZE": str(p.local_world_size), "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
    })

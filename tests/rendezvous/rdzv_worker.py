"""A tiny elastic training worker for the rendezvous tests (run as its own process).

It trains a 1000-float "model" whose update is an all-reduce of ones, so every rank's
weights stay identical; it prints one JSON line per event on stdout:

* ``ready``   constructed, about to enter its first round;
* ``round``   a round formed: rank, world size, pid, the all-reduce of rank+1 (checked by
              the test against ws(ws+1)/2), whether the weights agree on every rank, and
              the step reached (rank 0's, received by broadcast when state is synced);
* ``step``    every 10 steps; ``error`` a collective failed (a peer died);
* ``removed`` the worker left the job (exit 0). A RendezvousError exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from pollux_launch.rendezvous.process_group import InMemoryCommit, broadcast_state
from pollux_launch.rendezvous.protocol import (
    GroupInfo,
    Rendezvous,
    RendezvousConfig,
    RendezvousError,
    WorkerRemoved,
)
from pollux_launch.rendezvous.store import open_store


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


class Trainer:
    def __init__(self) -> None:
        self.weights = torch.zeros(1000)
        self.step = 0
        self.commit = InMemoryCommit(self.get_state, self.set_state)

    def get_state(self) -> dict:
        return {"weights": self.weights, "step": self.step}

    def set_state(self, state: dict) -> None:
        self.weights.copy_(state["weights"])
        self.step = int(state["step"])

    def train_step(self, world_size: int) -> None:
        grad = torch.ones(1000)
        dist.all_reduce(grad)
        self.weights += grad / world_size
        self.step += 1

    def enter(self, info: GroupInfo, failed: bool) -> None:
        """After a round formed: restore/sync the state and check the group."""
        if failed:
            self.commit.restore()
        if info.needs_state_sync:
            self.set_state(broadcast_state(self.get_state()))
        check = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(check)
        total = self.weights.sum().reshape(1)
        lo, hi = total.clone(), total.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        emit(event="round", round=info.round, rank=info.rank, ws=info.world_size,
             pid=os.getpid(), reason=info.reason, members=list(info.members),
             allreduce=check.item(), consistent=bool(lo.item() == hi.item()), step=self.step)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--prefix", default="/pollux")
    p.add_argument("--job", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--ttl", type=float, default=2.0)
    p.add_argument("--join-timeout", type=float, default=30.0)
    p.add_argument("--sleep", type=float, default=0.02)
    a = p.parse_args()
    cfg = RendezvousConfig(lease_ttl=a.ttl, join_timeout=a.join_timeout, collective_timeout=10,
                           backend="gloo", addr="127.0.0.1")
    trainer = Trainer()
    try:
        rdzv = Rendezvous(open_store(a.store, a.prefix), a.job, a.worker, node="local",
                          config=cfg, owns_store=True)
        emit(event="ready", pid=os.getpid())
        info, failed = rdzv.next_round(), False
        while True:
            trainer.enter(info, failed)
            failed = False
            try:
                while not rdzv.should_rescale():
                    trainer.train_step(info.world_size)
                    trainer.commit.commit()
                    if trainer.step % 10 == 0:
                        emit(event="step", step=trainer.step, round=info.round)
                    time.sleep(a.sleep)
            except RuntimeError as exc:  # a peer died mid-collective
                emit(event="error", error=str(exc).splitlines()[0][:200])
                failed = True
            info = rdzv.next_round()
    except WorkerRemoved:
        emit(event="removed", pid=os.getpid())
        return 0
    except RendezvousError as exc:
        print(f"worker {a.worker}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Worker of test_horovod_policies: a Horovod Elastic script with adaptation policies.

Run by ``pollux-run --policy-module tests.policies_for_tests:Probe`` (the command line's
policy) and passing ``policies=[Counter()]`` to pollux's ``DistributedOptimizer`` (the
script's, first in the list). The loop is Horovod's usual one (``hvd.elastic.run``,
``TorchState``, ``ElasticSampler``, a ``DataLoader`` with ``drop_last=True`` whose batch
pollux sets; with ``--no-elastic``: a plain ``DistributedSampler`` loop, no
``hvd.elastic``); it calls ``control.before_epoch`` / ``control.after_epoch`` around each
epoch and ends when ``control.stopped``. Appends JSON lines to
``$POLICY_LOG_DIR/worker-<pid>.jsonl``: one ``step`` per optimiser step (the batch the loop
got, the accumulation, the LR the optimiser used inside ``step()``) and an ``end``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pollux_launch.adapters.horovod import DistributedOptimizer, TorchState
from pollux_launch.elastic import AdaptationPolicy, PolicyContext

LOG = open(os.path.join(os.environ["POLICY_LOG_DIR"], f"worker-{os.getpid()}.jsonl"), "a",
           buffering=1)
MAX_EPOCHS = 50  # the policy stops the job long before


def write(**rec: object) -> None:
    LOG.write(json.dumps({"pid": os.getpid(), "rank": hvd.rank(), "size": hvd.size(), **rec})
              + "\n")


class Counter(AdaptationPolicy):
    """The script's own policy: counts its hooks on this worker."""

    def __init__(self) -> None:
        self.counts = {"before_epoch": 0, "after_step": 0, "after_epoch": 0, "on_rescale": 0}

    def before_epoch(self, ctx: PolicyContext) -> None:
        self.counts["before_epoch"] += 1

    def after_step(self, ctx: PolicyContext) -> None:
        self.counts["after_step"] += 1

    def after_epoch(self, ctx: PolicyContext) -> None:
        self.counts["after_epoch"] += 1

    def on_rescale(self, ctx: PolicyContext) -> None:
        self.counts["on_rescale"] += 1


def train_epochs(model: torch.nn.Module, optimizer: Any, loader: DataLoader, epoch: int,
                 after_batch: Callable[[int], None], after_epoch: Callable[[int], None]
                 ) -> int:
    """Horovod's usual loop, with the control's epoch hooks; ends when a policy stops it.
    Returns the epoch it ended in."""
    control = optimizer.pollux_control
    used: list[float] = []  # the LR inside the optimiser's step (read by a closure)
    while epoch < MAX_EPOCHS and not control.stopped:
        control.before_epoch(epoch)
        for xb, yb in loader:
            accum = optimizer.backward_passes_per_step
            optimizer.zero_grad()
            for xs, ys in zip(xb.chunk(accum), yb.chunk(accum), strict=True):
                (F.cross_entropy(model(xs), ys) / accum).backward()
            optimizer.step(lambda: used.append(optimizer.param_groups[0]["lr"]))
            write(ev="step", step=control.steps, epoch=epoch, batch=len(xb), accum=accum,
                  lr_used=used[-1], lr_factor=control.lr_factor)
            if control.stopped:
                break
            time.sleep(0.01)
            after_batch(len(xb))
        if control.stopped:
            break
        control.after_epoch(epoch)
        epoch += 1
        after_epoch(epoch)
    return epoch


def main(elastic: bool) -> None:
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(160, 16, generator=gen)
    y = (x.sum(dim=1) > 0).long()
    data = TensorDataset(x, y)
    sampler = (hvd.elastic.ElasticSampler(data, shuffle=True, seed=0) if elastic else
               DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), seed=0))
    local_bsz = 8  # M0 = 16 on 2 ranks: 10 steps an epoch
    loader = DataLoader(data, batch_size=local_bsz, sampler=sampler, drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    counter = Counter()
    optimizer = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        local_bsz=local_bsz, data_loader=loader, max_batch_size=128, decide_every=4,
        policies=[counter])
    control = optimizer.pollux_control
    if elastic:
        state = TorchState(model, optimizer, sampler=sampler, epoch=0)

        def next_epoch(epoch: int) -> None:
            state.epoch = epoch
            state.sampler.set_epoch(epoch)
            state.commit()

        @hvd.elastic.run
        def train(state: TorchState) -> int:
            return train_epochs(model, optimizer, loader, state.epoch,
                                lambda n: (state.sampler.record_batch(0, n),
                                           state.check_host_updates()), next_epoch)

        epoch = train(state)
    else:  # no hvd.elastic: the control starts at the first before_epoch
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        epoch = train_epochs(model, optimizer, loader, 0, lambda n: None, sampler.set_epoch)
    write(ev="end", step=control.steps, epoch=epoch, stopped=control.stopped,
          counts=counter.counts, policies=[p.label for p in control.policies])


if __name__ == "__main__":
    main(elastic="--no-elastic" not in sys.argv[1:])

"""Horovod Elastic in the style of Horovod's ``pytorch_synthetic_benchmark_elastic.py`` /
``pytorch_mnist_elastic.py``: ``hvd.init()``, ``hvd.DistributedOptimizer``,
``hvd.elastic.TorchState(model, optimizer, epoch=..., batch=...)``, ``state.commit()``
and a training function wrapped in ``@hvd.elastic.run``. Plain Horovod, no pollux::

    horovodrun --gloo -np 2 -H localhost:2 python horovod_elastic.py --result r.json
    horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script ./discover.sh \\
        --network-interface lo python horovod_elastic.py --result r.json

The result does not depend on the number of workers, nor on resets: the data, the
initial weights and each epoch's order are seeded; every step takes the next GLOBAL
batch of ``--global-batch`` samples (``state.batch`` counts them, ``state.epoch`` the
epochs) and splits it evenly among the current ranks; Horovod averages the gradients;
plain SGD with a fixed LR (no ``lr * hvd.size()``: the global batch does not change).
A reset rolls back to the last ``commit()`` (every ``--commit-every`` steps) and resumes
from that batch at the new size. There is deliberately no ``state.check_host_updates()``
between commits (Horovod's examples call it there): on the ``HostsUpdatedInterrupt`` it
raises, ``ObjectState.sync()`` broadcasts the last COMMITTED ``epoch``/``batch`` while
``TorchState`` broadcasts the CURRENT weights, so the batches since the commit would be
trained twice (measured: 0.004 off in the weights after one 1 -> 2 growth).

Rank 0 appends one JSON line per (re)start of the training function to ``--events``
(default: the result path + ``.log.jsonl``) and writes the result JSON at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F


def make_data(n: int = 512, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)


def append(path: str, **record: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description="Horovod Elastic on synthetic data")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--commit-every", type=int, default=1, help="steps between commits")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pace steps (seconds)")
    p.add_argument("--pace-file", default=None,
                   help="with --step-sleep: pace only while this file exists")
    p.add_argument("--result", default="result.json")
    p.add_argument("--events", default=None,
                   help="JSON-lines event log (default: RESULT.log.jsonl)")
    args = p.parse_args()
    log_path = args.events or args.result + ".log.jsonl"

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = make_data()
    steps_per_epoch = len(x) // args.global_batch

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    sizes: list[int] = []

    def on_state_reset() -> None:  # Horovod calls it on every rank after a reset
        if hvd.rank() == 0:
            append(log_path, event="reset", size=hvd.size())

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        rank, size = hvd.rank(), hvd.size()
        assert args.global_batch % size == 0, "the global batch must split evenly"
        share = args.global_batch // size
        sizes.append(size)
        if rank == 0:
            append(log_path, event="start", size=size, epoch=state.epoch, batch=state.batch)
        while state.epoch < args.epochs:
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(state.epoch))
            while state.batch < steps_per_epoch:
                idx = order[state.batch * args.global_batch:(state.batch + 1) * args.global_batch]
                mine = idx[rank * share:(rank + 1) * share]
                optimizer.zero_grad()
                loss = F.mse_loss(model(x[mine]), y[mine])
                loss.backward()
                optimizer.step()
                state.batch += 1
                if args.step_sleep and (args.pace_file is None
                                        or os.path.exists(args.pace_file)):
                    time.sleep(args.step_sleep)
                if state.batch % args.commit_every == 0:
                    state.commit()  # saves, then raises HostsUpdatedInterrupt on a change
            state.epoch += 1
            state.batch = 0
            if rank == 0:
                append(log_path, event="epoch", epoch=state.epoch - 1, size=size)
            state.commit()

    train(state)

    if hvd.rank() == 0:
        with torch.no_grad():
            loss = float(F.mse_loss(model(x), y))
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        result = {"final_loss": loss, "checksum": float(flat.sum()),
                  "abs_checksum": float(flat.abs().sum()), "weights": flat.tolist(),
                  "epochs_run": state.epoch, "world_sizes": sizes, "final_size": hvd.size()}
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result)


if __name__ == "__main__":
    main()

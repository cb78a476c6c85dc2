"""Horovod Elastic on CPU: a small MLP on scikit-learn's bundled digits (no downloads).

An ordinary Horovod Elastic script (``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``)
whose Pollux changes are two imports: ``TorchState`` is Horovod's plus durable checkpoints
(``pollux-run --checkpoint-dir``: a job whose workers all died resumes from the last one),
and the ``DistributedOptimizer`` wrapper is given the loader (whose batch Pollux adapts:
``m * backward_passes_per_step``), and the loop splits each batch into
``optimizer.backward_passes_per_step`` micro-batches, as Horovod's own examples do. The
LR given is the LR at the initial batch size; Pollux scales it with the batch (AdaScale
for SGD), so there is no ``lr * hvd.size()`` rule::

    horovodrun --gloo -np 2 --min-np 1 --max-np 4 --network-interface lo \\
        --host-discovery-script ./discover.sh python examples/horovod_elastic.py
    pollux-run --framework horovod -np 2 --max-np 4 python examples/horovod_elastic.py

``--log-dir`` makes every worker append JSON lines (one file per process) with its pid,
rank and size at each (re)start, a timestamp per step, a parameter digest for the first
steps after each (re)start and each Pollux decision; tests read them.
``--stop-file`` ends training at the next epoch boundary once that file exists
(rank 0 decides, all ranks follow), instead of after ``--epochs``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from pollux_launch.adapters.horovod import DistributedOptimizer, TorchState


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="initial per-rank batch size")
    p.add_argument("--accum", type=int, default=1, help="initial backward passes per step")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate at the initial batch")
    p.add_argument("--max-batch-size", type=int, default=512,
                   help="largest total batch Pollux may choose")
    p.add_argument("--report-interval", type=float, default=30.0,
                   help="seconds between rank 0's hints to the store")
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pace steps (seconds)")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--stop-file", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha1(flat.cpu().numpy().tobytes()).hexdigest()[:16]


class Log:
    """One JSON-lines file per worker process (no-op without --log-dir)."""

    def __init__(self, log_dir: Path | None) -> None:
        self.f = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self.f = open(log_dir / f"worker-{os.getpid()}.jsonl", "a", buffering=1)

    def __call__(self, event: str, **fields: object) -> None:
        if self.f is not None:
            rec = {"event": event, "pid": os.getpid(), "rank": hvd.rank(), "size": hvd.size(),
                   "t": time.time(), **fields}
            self.f.write(json.dumps(rec) + "\n")


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    log = Log(args.log_dir)

    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data / 16.0, dtype=torch.float32),
                         torch.tensor(digits.target, dtype=torch.int64))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size * args.accum, sampler=sampler,
                        drop_last=True)

    # on a GPU machine: the worker's own GPU (Horovod's local rank; pollux-run's agent gives
    # each worker one and makes it visible as the local rank's)
    device = (torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
              if torch.cuda.is_available() else torch.device("cpu"))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        backward_passes_per_step=args.accum, local_bsz=args.batch_size,
        data_loader=loader, max_batch_size=args.max_batch_size,
        report_interval=args.report_interval,
        on_decision=lambda m, s, lr_factor: log("decision", local_bsz=m, accum=s + 1,
                                                lr_factor=lr_factor))

    def on_reset() -> None:  # survivors, after a reset (Pollux re-decides in the sync)
        log("reset")

    state = TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        log("start", epoch=state.epoch, step=state.step)
        since_start = 0
        while state.epoch < args.epochs:
            for x, y in loader:  # the sampler re-partitions what is left after a reset
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                accum = optimizer.backward_passes_per_step  # Pollux may change it
                optimizer.zero_grad()
                for xs, ys in zip(x.chunk(accum), y.chunk(accum), strict=True):
                    loss = F.cross_entropy(model(xs), ys) / accum
                    loss.backward()
                optimizer.step()
                state.sampler.record_batch(0, len(x))
                state.step += 1
                since_start += 1
                loss_value = float(loss.detach()) * accum
                fields: dict[str, object] = {"step": state.step, "loss": loss_value,
                                             "batch": len(x), "accum": accum}
                if since_start <= 3:
                    fields["digest"] = digest(model)
                log("step", **fields)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if state.step % args.commit_every == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)  # at the END of an epoch (Horovod's rule)
            if args.stop_file is not None:
                stop = torch.tensor([float(hvd.rank() == 0 and args.stop_file.exists())])
                if hvd.allreduce(stop, op=hvd.Sum, name="stop")[0] > 0:
                    break
            state.commit()

    train(state)
    noise = optimizer.pollux.stats()
    log("done", step=state.step, digest=digest(model),
        noise_scale=None if noise is None else noise.noise_scale,
        grad_sqr=None if noise is None else noise.sqr,
        grad_var=None if noise is None else noise.var,
        profile=optimizer.pollux.profile.state_dict()["rows"])
    if hvd.rank() == 0:
        print(f"done: {state.step} steps, {hvd.size()} ranks, gradient noise scale "
              f"{'n/a' if noise is None else f'{noise.noise_scale:.1f}'}", flush=True)


if __name__ == "__main__":
    main()

"""Adaptive, elastic training of a small MLP on scikit-learn's bundled handwritten digits.

Run it under the launcher (it adapts replicas, batch size and LR live)::

    pollux-run -np 1 --max-np 2 python examples/digits.py

sharded with FSDP2 (re-sharded in place when the job rescales)::

    pollux-run -np 2 --max-np 3 python examples/digits.py --sharding fsdp

or alone (one process, still batch-size adaptive)::

    python examples/digits.py --epochs 5

On a GPU machine the same command trains on each worker's own GPU (``job.device``: the
one its node agent gave it, as ``cuda:LOCAL_RANK`` would be under torchrun; NCCL between
them), with ``--amp`` under bf16 autocast.

Nothing is downloaded: the 1797 8x8 images ship inside scikit-learn. 20 % are held out
for validation. Rank 0 prints one line per epoch: what the GoodputTuner decided and the
validation accuracy.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import pollux_launch.adapters.torch as pollux


def datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, val = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def make_model(hidden: int = 128) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset,
             device: torch.device | str = "cpu") -> float:
    x, y = (t.to(device) for t in data.tensors)
    return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=30, help="statistical epochs")
    parser.add_argument("--batch-size", type=int, default=32, help="initial total batch M0")
    parser.add_argument("--max-batch-size", type=int, default=256,
                        help="largest total batch the agent may choose (= M0: fixed batch)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=128,
                        help="hidden width (1024: ~1.1M parameters, slow enough to watch)")
    parser.add_argument("--target", type=float, default=None,
                        help="stop once validation accuracy reaches this")
    parser.add_argument("--sharding", choices=["fsdp"], default=None,
                        help="shard the model with FSDP2 (under pollux-run: re-sharded live)")
    parser.add_argument("--amp", action="store_true",
                        help="bf16 autocast (on a GPU; on a CPU where it supports bf16)")
    parser.add_argument("--report-interval", type=float, default=5.0)
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="extra seconds per step (makes a tiny job long enough to watch)")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("POLLUX_LOG_LEVEL", "WARNING").replace(
        "TRACE", "DEBUG").replace("FATAL", "CRITICAL"))

    torch.manual_seed(0)
    job = pollux.init()
    device = job.device  # this worker's GPU, or the CPU
    train_set, val_set = datasets()
    model = make_model(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = pollux.AdaptiveDataLoader(train_set, batch_size=args.batch_size,
                                       max_batch_size=args.max_batch_size,
                                       local_bsz_bounds=(8, 128),
                                       pin_memory=device.type == "cuda")
    trainer = pollux.ElasticTrainer(model, optimizer, loader, sharding=args.sharding,
                                    report_interval=args.report_interval)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.amp
                else contextlib.nullcontext())
    acc = 0.0
    for epoch in trainer.epochs(args.epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                loss = F.cross_entropy(trainer.model(x), y)
            trainer.step(loss)
            if args.step_delay:
                import time

                time.sleep(args.step_delay)
        acc = accuracy(trainer.module, val_set, device)
        if job.placement.rank == 0:
            print(f"epoch {epoch:3d} | {trainer.describe()} | val_acc {acc:.4f}", flush=True)
        if args.target is not None and acc >= args.target:
            break
    if job.placement.rank == 0:
        print(f"final val_acc {acc:.4f}", flush=True)


if __name__ == "__main__":
    main()

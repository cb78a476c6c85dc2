"""A DeepSpeed job with a "pollux" section: a small MLP on scikit-learn's digits, CPU.

    DS_ACCELERATOR=cpu python examples/deepspeed_train.py            # one process
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed_train.py
    pollux-run -np 1 --max-np 4 python examples/deepspeed_train.py   # adaptive, live rescale

The only pollux-specific line is the import of ``initialize``. Under pollux-run the
engine is a PolluxEngine handle: the batch size, accumulation and LR factor follow the
agent, and the job rescales in place; elsewhere it is a plain DeepSpeed engine running
at the section's ``initial_batch_size``. The config's optimizer is AdamW (DeepSpeed
JIT-compiles its CPU Adam on first use: g++ and ninja are needed).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from pollux_launch.adapters.deepspeed import initialize


def _single_process_env() -> None:
    """A one-process world when started without a launcher (DeepSpeed needs these)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).with_name("ds_config.json")))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.9, help="validation accuracy goal")
    opts = parser.parse_args()
    _single_process_env()

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1500], perm[1500:]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                 config=opts.config)
    rank, world = engine.global_rank, engine.dp_world_size
    for epoch in range(opts.epochs):
        order = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
        pos = 0
        micro = engine.train_micro_batch_size_per_gpu()
        while pos + world * micro <= len(order):
            idx = order[pos + rank * micro: pos + (rank + 1) * micro]
            pos += world * micro
            loss = F.cross_entropy(engine(x[idx]), y[idx])
            engine.backward(loss)
            engine.step()
        with torch.no_grad():
            acc = (engine(x[val]).argmax(1) == y[val]).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f} val acc {acc:.3f} "
                  f"batch {engine.train_batch_size()} (world {world})", flush=True)
        if acc >= opts.target:
            break
    if rank == 0:
        print(f"reached {acc:.3f} (target {opts.target})")


if __name__ == "__main__":
    main()

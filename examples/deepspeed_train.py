"""A DeepSpeed job with a "pollux" section: a small MLP on scikit-learn's digits, CPU.

    python examples/deepspeed_train.py                                   # one process
    torchrun --nproc-per-node 2 examples/deepspeed_train.py              # static, 2 procs
    pollux-run --store embedded:///tmp/pollux.db -np 2 --max-np 3 \\
        python examples/deepspeed_train.py                               # adaptive, live

The only pollux-specific lines are the import of ``initialize`` and ``epochs``. Under
pollux-run the engine is a PolluxEngine handle: the agent picks the per-GPU micro batch,
the accumulation steps and the LR factor, the job rescales in place inside
``engine.step()``, and the dataloader (passed as ``training_data``) is pollux's
AdaptiveDataLoader, whose position in the epoch survives every rescale (newcomers
receive it with the training state, so each sample is seen once per epoch). Elsewhere it
is a plain DeepSpeed engine at the section's ``initial_batch_size``. Without a GPU the
adapter sets ``DS_ACCELERATOR=cpu``. The config's optimizer is AdamW (DeepSpeed
JIT-compiles its CPU Adam on first use: g++ and ninja are needed).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from pollux_launch.adapters.deepspeed import epochs, initialize


def _single_process_env() -> None:
    """A one-process world when started without any launcher (DeepSpeed needs these)."""
    if "POLLUX_JOB" in os.environ:
        return  # pollux-run: the rendezvous provides them
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(Path(__file__).with_name("ds_config.json")))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.9, help="validation accuracy goal")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="passed by the deepspeed launcher and by pollux-run")
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
    engine, _, loader, _ = initialize(model=model, model_parameters=model.parameters(),
                                      training_data=TensorDataset(x[train], y[train]),
                                      config=opts.config)
    acc = 0.0
    for epoch in epochs(engine, opts.epochs):
        for xb, yb in loader:  # (to the engine's GPU where there is one)
            xb, yb = xb.to(engine.device, non_blocking=True), yb.to(engine.device)
            loss = F.cross_entropy(engine(xb), yb)
            engine.backward(loss)
            engine.step()  # under pollux-run: batch changes and rescales happen in here
        with torch.no_grad():
            out = engine.module(x[val].to(engine.device)).argmax(1)
            acc = (out == y[val].to(engine.device)).float().mean().item()
        if engine.global_rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f} val acc {acc:.3f} batch "
                  f"{engine.train_batch_size()} = {engine.dp_world_size} x "
                  f"{engine.train_micro_batch_size_per_gpu()} x "
                  f"{engine.gradient_accumulation_steps()}", flush=True)
        if acc >= opts.target:
            break
    if engine.global_rank == 0:
        print(f"reached {acc:.3f} (target {opts.target})", flush=True)


if __name__ == "__main__":
    main()

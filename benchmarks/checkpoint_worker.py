"""Worker of benchmarks/checkpoint.py: the digits MLP under pollux-run, torch or DeepSpeed.

    checkpoint_worker.py --framework torch|deepspeed --epochs N [--step-delay S]

``--local_rank=N`` is accepted (and unused: the adapters read the environment): pollux-run
passes it to DeepSpeed scripts, as the ``deepspeed`` launcher does.

Logs one JSON line per optimiser step to ``$LOG_DIR/<worker>.jsonl`` (pid, rank, world,
epoch, step, t) and ends after N statistical epochs. The job's checkpoint directory comes
from ``pollux-run --checkpoint-dir`` (the environment), as a user's script would get it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import digits

parser = argparse.ArgumentParser()
parser.add_argument("--framework", choices=("torch", "deepspeed"), required=True)
parser.add_argument("--epochs", type=float, default=4)
parser.add_argument("--step-delay", type=float, default=0.05)
parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
args = parser.parse_args()

out = open(Path(os.environ["LOG_DIR"]) / f"{os.environ['POLLUX_WORKER_ID']}.jsonl", "a")
torch.manual_seed(0)
train_set, _ = digits.datasets()
model = digits.make_model(64)


def record(rank: int, world: int, epoch: int, step: int) -> None:
    out.write(json.dumps({"pid": os.getpid(), "rank": rank, "world": world, "epoch": epoch,
                          "step": step, "t": time.time()}) + "\n")
    out.flush()


if args.framework == "torch":
    import pollux_launch.adapters.torch as pollux

    job = pollux.init()
    loader = pollux.AdaptiveDataLoader(train_set, batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = pollux.ElasticTrainer(model, optimizer, loader)
    for epoch in trainer.epochs(args.epochs):
        for x, y in loader:
            t0 = time.monotonic()
            if trainer.step(F.cross_entropy(trainer.model(x), y)):
                p = job.placement
                record(p.rank, p.world_size, epoch, trainer.steps)
            time.sleep(max(0.0, args.step_delay - (time.monotonic() - t0)))
else:
    from pollux_launch.adapters.deepspeed import initialize

    config = {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9,
              "pollux": {"enabled": True, "initial_batch_size": 32,
                         "micro_batch_size_range": [8, 32]}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, _, loader, _ = initialize(model=model, optimizer=optimizer,
                                      training_data=train_set, config=config)
    for epoch in engine.epochs(args.epochs):
        for x, y in loader:
            t0 = time.monotonic()
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()  # (a fixed batch without accumulation: every step is an update)
            record(engine.global_rank, engine.dp_world_size, epoch, engine.driver.steps)
            time.sleep(max(0.0, args.step_delay - (time.monotonic() - t0)))

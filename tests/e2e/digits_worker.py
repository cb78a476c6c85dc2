"""Worker for the cluster end-to-end tests: the digits example, run until told to stop.

Trains with the native adapter. Every optimiser step costs at least --step-delay seconds
per 32 samples of its per-replica batch (so the job scales near-linearly on a busy 2-core
machine and the policy has a reason to move GPUs). Logs one JSON line per step to
$LOG_DIR/<worker>.jsonl and ends once --stop-file exists and validation accuracy reached
--target, or after --epochs epochs.
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import digits

import pollux_launch.adapters.torch as pollux

parser = argparse.ArgumentParser()
parser.add_argument("--stop-file", required=True)
parser.add_argument("--target", type=float, default=0.9)
parser.add_argument("--step-delay", type=float, default=0.05)
parser.add_argument("--epochs", type=int, default=10_000, help="end after this many epochs")
args = parser.parse_args()
faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand when debugging

log = open(Path(os.environ["LOG_DIR"]) / f"{os.environ['POLLUX_WORKER_ID']}.jsonl", "a")
torch.manual_seed(0)
job = pollux.init()
train_set, val_set = digits.datasets()
model = digits.make_model(64)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = pollux.AdaptiveDataLoader(train_set, batch_size=32, max_batch_size=256,
                                   local_bsz_bounds=(8, 64))
trainer = pollux.ElasticTrainer(model, optimizer, loader, report_interval=1.0, decide_every=5)
acc = 0.0
for epoch in trainer.epochs(args.epochs):
    for x, y in loader:
        t0 = time.monotonic()
        if trainer.step(F.cross_entropy(trainer.model(x), y)):
            p = job.placement
            log.write(json.dumps({"pid": os.getpid(), "round": p.round, "world": p.world_size,
                                  "rank": p.rank, "node": os.environ["POLLUX_NODE"], "epoch": epoch,
                                  "step": trainer.steps, "t": time.time()}) + "\n")
            log.flush()
        # compute-bound stand-in: a step costs time in proportion to the per-replica batch
        time.sleep(max(0.0, args.step_delay * len(x) / 32 - (time.monotonic() - t0)))
    acc = digits.accuracy(trainer.module, val_set)
    # every replica must leave at the same epoch: rank 0 decides
    stop = torch.tensor([int(os.path.exists(args.stop_file) and acc >= args.target)])
    if job.placement.world_size > 1:
        try:
            torch.distributed.broadcast(stop, 0)
        except Exception as exc:  # a peer died at the epoch's end: re-formed; ask again
            if not trainer.controller.recover(exc, in_flight=False):
                raise
            stop.zero_()
    if stop.item():
        break
if job.placement.rank == 0:
    print(f"final val_acc {acc:.4f} statistical epochs {trainer.tuner.progress.epochs():.2f}",
          flush=True)

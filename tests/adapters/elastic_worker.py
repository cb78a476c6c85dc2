"""Worker for test_torch_elastic: trains with the native adapter, logs what it did, and
stops at the end of the first epoch after the test created $LOG_DIR/stop (LOG_DIR: the
first argument, else the environment's).

Each worker appends JSON lines to $LOG_DIR/<worker>.jsonl: one per optimiser step
({"kind": "step", "epoch", "round", "world", "rank", "indices", "node", "t"}) and, at the
end, the hash of its parameters. Samples are identified by their index (the dataset
returns it).
"""

import hashlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pollux_launch.adapters.torch as pollux

N = int(os.environ.get("N", 480))
LOG_DIR = sys.argv[1] if len(sys.argv) > 1 else os.environ["LOG_DIR"]
STOP = os.path.join(LOG_DIR, "stop")  # the test creates it when done
log = open(os.path.join(LOG_DIR, os.environ["POLLUX_WORKER_ID"] + ".jsonl"), "a")


def write(**record):
    log.write(json.dumps(record) + "\n")
    log.flush()


torch.manual_seed(int.from_bytes(os.urandom(2), "little"))  # replicas start different
x = torch.randn(N, 16)
y = (x.sum(dim=1) > 0).long()
data = TensorDataset(x, y, torch.arange(N))
job = pollux.init()
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = pollux.AdaptiveDataLoader(data, batch_size=12, local_bsz_bounds=(2, 12))
trainer = pollux.ElasticTrainer(model, optimizer, loader, report_interval=1.0)
write(kind="start", pid=os.getpid(), round=job.placement.round)
pending = []
for _ in trainer.epochs(10_000):
    for xb, yb, idx in loader:
        epoch = loader.epoch
        pending.extend(idx.tolist())
        if trainer.step(F.cross_entropy(trainer.model(xb), yb)):
            p = job.placement
            write(kind="step", epoch=epoch, round=p.round, world=p.world_size, rank=p.rank,
                  pid=os.getpid(), indices=pending, step=trainer.steps,
                  node=os.environ.get("POLLUX_NODE"), t=time.time())
            pending = []
        time.sleep(0.01)
    # every replica must leave at the same epoch: rank 0 decides
    stop = torch.tensor([int(os.path.exists(STOP))])
    if job.placement.world_size > 1:
        try:
            torch.distributed.broadcast(stop, 0)
        except Exception as exc:  # a peer died at the epoch's end: re-formed; ask again
            if not trainer.controller.recover(exc, in_flight=False):
                raise
            stop.zero_()
    if stop.item():
        break
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
write(kind="end", pid=os.getpid(), params=digest.hexdigest(), round=job.placement.round)
sys.exit(0)

"""Worker for test_fsdp_live: an FSDP2 model (sharded by the script on the job's mesh, or
by the trainer with SHARDING=fsdp) trained with Adam under pollux-run, rescaled live by
the test. Appends JSON lines to $LOG_DIR/<worker>.jsonl: every optimiser step (samples,
round, size, and a digest of the whole model and Adam state, gathered), each new group's
digest right after it formed, and the end."""

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import pollux_launch.adapters.torch as pollux
from pollux_launch.elastic.adaptation import AdaptationPolicy, GoodputPolicy

N = int(os.environ.get("N", 480))
faulthandler.register(signal.SIGUSR1)  # (a hung test: kill -USR1 shows where)
faulthandler.enable()  # (and an abort, where)
STOP = os.path.join(os.environ["LOG_DIR"], "stop")
log = open(os.path.join(os.environ["LOG_DIR"], os.environ["POLLUX_WORKER_ID"] + ".jsonl"), "a")


def write(**record):
    log.write(json.dumps(record) + "\n")
    log.flush()


def digest(model, optimizer) -> str:
    """A hash of the whole model and optimizer state (a collective: every rank gathers)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode() + p.full_tensor().detach().numpy().tobytes())
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            v = v.full_tensor() if isinstance(v, DTensor) else v
            h.update(k.encode() + v.detach().cpu().numpy().tobytes())
    return h.hexdigest()


class Digest(AdaptationPolicy):
    def after_step(self, ctx):
        p = job.placement
        write(kind="state", when="step", step=ctx.step, round=p.round, rank=p.rank,
              digest=digest(model, optimizer))

    def on_rescale(self, ctx):
        if ctx.detached or ctx.previous_world_size == 0:
            return
        p = job.placement
        write(kind="state", when="rescale", step=ctx.step, round=p.round, rank=p.rank,
              digest=digest(model, optimizer))


torch.manual_seed(0)  # the same data everywhere; each rank's shard of the same init
x = torch.randn(N, 16)
y = (x.sum(dim=1) > 0).long()
data = TensorDataset(x, y, torch.arange(N))
job = pollux.init()
model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 2))
sharding = os.environ.get("SHARDING") or None
if sharding is None:  # as FSDP's docs show, on the job's mesh
    mesh = job.device_mesh()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
loader = pollux.AdaptiveDataLoader(data, batch_size=12, local_bsz_bounds=(2, 12))
ckpt = os.environ.get("CKPT_DIR") or None
trainer = pollux.ElasticTrainer(model, optimizer, loader, report_interval=1.0,
                                sharding=sharding, policies=[GoodputPolicy(), Digest()],
                                checkpoint_dir=ckpt,
                                checkpoint_interval=float(os.environ.get("CKPT_EVERY", 1e9)))
model = trainer.module
assert trainer.sharded
fresh = job.info is None or job.info.fresh  # every rank starts here together (a collective)
write(kind="start", pid=os.getpid(), round=job.placement.round, step=trainer.steps,
      resumed=trainer.resumed_from, digest=digest(model, optimizer) if fresh else None)
SAVE_AT = int(os.environ.get("SAVE_AT", 0))
pending = []
for _ in trainer.epochs(10_000):
    for xb, yb, idx in loader:
        epoch = loader.epoch
        pending.append((job.placement.round, idx.tolist()))
        if trainer.step(F.cross_entropy(trainer.model(xb), yb)):
            p = job.placement
            # (a micro-batch of an older round was in a step a failure dropped)
            write(kind="step", epoch=epoch, round=p.round, world=p.world_size, rank=p.rank,
                  pid=os.getpid(), step=trainer.steps,
                  indices=[i for rnd, ix in pending if rnd == p.round for i in ix])
            pending = []
            if trainer.steps == SAVE_AT:
                trainer.save_checkpoint(wait=True)
                write(kind="saved", step=trainer.steps, digest=digest(model, optimizer))
        time.sleep(0.01)
    stop = torch.tensor([int(os.path.exists(STOP))])
    if job.placement.world_size > 1:
        torch.distributed.broadcast(stop, 0)
    if stop.item():
        break
grad = trainer.controller.grad  # the gradient noise scale, measured on shards
write(kind="end", pid=os.getpid(), digest=digest(model, optimizer), round=job.placement.round,
      noise=None if grad is None else [float(grad.sqr), float(grad.var)])
sys.exit(0)

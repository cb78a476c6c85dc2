"""Worker of test_deepspeed_pollux: a DeepSpeed job on digits, started by a real node agent.

Uses ``pollux_launch.adapters.deepspeed.initialize`` exactly as a user script would (with
``training_data``: the pollux AdaptiveDataLoader). Appends JSON lines to
``$LOG_DIR/<worker>.jsonl``: ``start``, one ``step`` per optimizer step, one ``check`` per
round it joins after the first (identical parameters on every rank; the consolidated
engine state equal to the one before the rescale) and ``end`` (validation accuracy,
parameter digest). Training runs until the test creates ``$LOG_DIR/stop`` (rank 0 reads
it at epoch ends and broadcasts the verdict) or ``MAX_EPOCHS`` data epochs.
"""

import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand when debugging
os.environ["POLLUX_DEEPSPEED_KEEP_STATE"] = "1"  # keep engine.restored_state for the checks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from state_compare import as_held_by, close  # noqa: E402  (beside this script)
from torch.utils.data import TensorDataset  # noqa: E402

from pollux_launch.adapters.deepspeed import initialize  # noqa: E402

LOG_DIR = Path(os.environ["LOG_DIR"])
STAGE = int(os.environ["ZERO_STAGE"])
MAX_EPOCHS = int(os.environ.get("MAX_EPOCHS", "100000"))  # the test stops it
SLEEP = float(os.environ.get("STEP_SLEEP", "0.01"))
log = open(LOG_DIR / f"{os.environ['POLLUX_WORKER_ID']}.jsonl", "a")


def write(**record) -> None:
    log.write(json.dumps({**record, "t": time.time()}) + "\n")
    log.flush()


def comparable(state: dict, like: dict | None = None) -> dict:
    """The training state proper (as held by ``like``), without micro_steps (re-aligned to
    the new accumulation steps on a rebuild)."""
    out = as_held_by(state, like or {})
    out["counters"] = {k: v for k, v in state["counters"].items() if k != "micro_steps"}
    return out


def check(engine, job) -> None:
    """Collective on the new group, right after a rescale (or a newcomer's join)."""
    before = engine.restored_state
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    after = engine.capture()
    p = job.placement
    write(kind="check", round=p.round, world=p.world_size, rank=p.rank, pid=os.getpid(),
          params_identical=all(torch.equal(everyone[0], t) for t in everyone),
          state_diffs=close(comparable(before), comparable(after, before))[:5],
          partial=bool(before.get("partial")),
          optimizer_tensors=sum(len(v) for v in after["optimizer"]["state"].values()),
          zero_stage=after["zero_stage"], global_steps=after["counters"]["global_steps"])


digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
train, val = perm[:1500], perm[1500:]

torch.manual_seed(int.from_bytes(os.urandom(2), "little"))  # replicas start different
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.9)
config = {
    "zero_optimization": {"stage": STAGE},
    "steps_per_print": 10**9,
    "pollux": {"enabled": True, "initial_batch_size": 32, "max_batch_size": 256,
               "micro_batch_size_range": [4, 64], "lr_scaling": "sqrt",
               "gradient_accumulation": True, "report_interval": 1.0},
}
engine, optimizer, loader, scheduler = initialize(
    model=model, optimizer=optimizer, lr_scheduler=scheduler,
    training_data=TensorDataset(x[train], y[train]), config=config)
job = engine.driver.job
write(kind="start", pid=os.getpid(), round=job.placement.round, world=job.placement.world_size)
seen_round = job.placement.round
if engine.restored_state is not None:  # a newcomer: it received the job's state
    check(engine, job)

stop = torch.zeros(1)
while loader.epoch < MAX_EPOCHS:
    epoch = loader.epoch
    for xb, yb in loader:
        loss = F.cross_entropy(engine(xb), yb)
        engine.backward(loss)
        engine.step()
        p = job.placement
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:  # stepped
            write(kind="step", round=p.round, world=p.world_size, rank=p.rank, epoch=epoch,
                  pid=os.getpid(), loss=loss.item(), batch=list(engine.batch),
                  steps=engine.global_steps, lr=optimizer.param_groups[0]["lr"],
                  lr_factor=engine.lr_factor)
        if p.round != seen_round:
            seen_round = p.round
            check(engine, job)
        time.sleep(SLEEP)
    p = job.placement
    stop[0] = float((LOG_DIR / "stop").exists()) if p.rank == 0 else 0.0
    try:
        dist.broadcast(stop, 0)
    except Exception as exc:  # a peer died at the epoch's end: re-formed; ask again next one
        if not engine.driver.controller.recover(exc, in_flight=False):
            raise
        stop.zero_()
    if stop.item():
        break

with torch.no_grad():
    acc = (engine.module(x[val]).argmax(1) == y[val]).float().mean().item()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
p = job.placement
write(kind="end", pid=os.getpid(), round=p.round, world=p.world_size, rank=p.rank, acc=acc,
      params=digest.hexdigest(), epochs=loader.epoch,
      rescales=[{k: v for k, v in r.items() if k != "t0"} for r in engine.driver.rescales])
sys.exit(0)

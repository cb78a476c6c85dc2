"""A torchrun-style training script that knows nothing of pollux-launch: an env:// gloo
group, DDP, its own snapshot file (resumed at start), a stop file. Each process logs its
steps as JSON lines to ``$LOG_DIR/<pid>.jsonl`` for the tests."""

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--snapshot", required=True)
p.add_argument("--stop-file", required=True)
p.add_argument("--step-delay", type=float, default=0.1)
args = p.parse_args()

# before the group: imported after it (torch._dynamo does, with the first optimizer), this
# module keeps the group alive past destroy_process_group in a default argument (torch
# 2.13), and gloo may abort the exit (see tests/compat/torchrun_ddp.py)
import torch.distributed.nn.functional  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
snap = Path(args.snapshot)
step = 0
if snap.exists():
    state = torch.load(snap, weights_only=True)
    model.module.load_state_dict(state["model"])
    step = state["step"]
log = open(Path(os.environ["LOG_DIR"]) / f"{os.getpid()}.jsonl", "a", buffering=1)
first = step
while True:
    stop = torch.tensor([float(Path(args.stop_file).exists())])
    dist.all_reduce(stop)
    if stop.item():
        break
    x = torch.randn(16, 8)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    log.write(json.dumps({
        "t": time.time(), "rank": rank, "world": world, "step": step, "first": first,
        "node": os.environ.get("POLLUX_NODE"), "group_rank": int(os.environ["GROUP_RANK"]),
        "master": os.environ["MASTER_ADDR"], "pid": os.getpid(),
        "restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}) + "\n")
    if rank == 0 and step % 5 == 0:
        torch.save({"model": model.module.state_dict(), "step": step}, str(snap) + ".tmp")
        os.replace(str(snap) + ".tmp", snap)
    time.sleep(args.step_delay)
del model, opt  # (the DDP reducer holds the group: see tests/compat/torchrun_ddp.py)
gc.collect()
dist.destroy_process_group()

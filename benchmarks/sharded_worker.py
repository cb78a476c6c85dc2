"""Worker of benchmarks/sharded_rescale.py: the benchmarks' MLP (rescale.py's) with Adam,
trained by ``ElasticTrainer`` sharded with FSDP2 (SHARDING=fsdp) or in DDP (SHARDING
empty), under a node agent. Appends JSON lines to $LOG_DIR/<worker>.jsonl: "step" (rank
0), "change" (each new group: its peak extra resident memory during the change, bytes
received), "pause" (the controller's timing of each rescale)."""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rescale import build_mlp

import pollux_launch.adapters.torch as pollux
from pollux_launch.elastic.adaptation import AdaptationPolicy, GoodputPolicy

LOG_DIR = Path(os.environ["LOG_DIR"])
STOP = LOG_DIR / "stop"
out = open(LOG_DIR / f"{os.environ['POLLUX_WORKER_ID']}.jsonl", "a")


def write(**record):
    out.write(json.dumps(record) + "\n")
    out.flush()


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Probe(AdaptationPolicy):
    """Resets the peak resident set at every step boundary (before the rescale vote), so
    that on a new group the peak since then is the change's."""

    rss = 0
    seen = 0

    def after_step(self, ctx):
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (Linux)
        self.rss = _status("VmRSS")
        rescales = trainer.controller.rescales
        for r in rescales[self.seen:]:
            write(kind="pause", **{k: v for k, v in r.items() if k != "t0"})
        self.seen = len(rescales)

    def on_rescale(self, ctx):
        if ctx.detached or ctx.previous_world_size == 0 or "trainer" not in globals():
            return  # (a newcomer's first round: measured on the survivors)
        rs = trainer._resharder
        write(kind="change", world=job.placement.world_size, rank=job.placement.rank,
              extra=_status("VmHWM") - self.rss, moved=rs.bytes_moved if rs else None)


# everything that takes time before joining the job's round (pollux.init()): a newcomer
# that built its model after joining would hold the survivors in the pause meanwhile
torch.manual_seed(0)
params = int(os.environ["PARAMS"]) or None
model = build_mlp(torch, params)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
x = torch.randn(256, 256)
data = TensorDataset(x, x.flip(1))
job = pollux.init()
loader = pollux.AdaptiveDataLoader(data, batch_size=16, max_batch_size=16,
                                   local_bsz_bounds=(1, 16))
trainer = pollux.ElasticTrainer(model, optimizer, loader, report_interval=1e9,
                                sharding=os.environ.get("SHARDING") or None,
                                policies=[GoodputPolicy(), Probe()])
while True:
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(trainer.model(xb), yb)
        if trainer.step(loss) and job.placement.rank == 0:
            write(kind="step", step=trainer.steps, world=job.placement.world_size,
                  round=job.placement.round)
    stop = torch.tensor([int(STOP.exists())])
    if job.placement.world_size > 1:
        torch.distributed.broadcast(stop, 0)
    if stop.item():
        break
    time.sleep(0.001)
sys.exit(0)

"""Worker of test_torch_policies: trains with the native adapter until its adaptation
policy (given by pollux-run --policy-module) stops it; then logs its end."""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pollux_launch.adapters.torch as pollux

torch.manual_seed(0)
x = torch.randn(4000, 16)
y = (x.sum(dim=1) > 0).long()
job = pollux.init()
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = pollux.AdaptiveDataLoader(TensorDataset(x, y), batch_size=16,
                                   local_bsz_bounds=(4, 16))
trainer = pollux.ElasticTrainer(model, optimizer, loader, decide_every=2, report_interval=1.0)
for _ in trainer.epochs(10_000):
    for xb, yb in loader:
        trainer.step(F.cross_entropy(trainer.model(xb), yb))
        time.sleep(0.05)
with open(os.path.join(os.environ["LOG_DIR"], os.environ["POLLUX_WORKER_ID"] + ".jsonl"),
          "a") as f:
    f.write(json.dumps({"ev": "end", "step": trainer.steps, "stopped": trainer.stopped,
                        "world": job.placement.world_size}) + "\n")
sys.exit(0)

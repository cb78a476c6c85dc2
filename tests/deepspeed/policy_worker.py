"""Worker of test_deepspeed_policies: a DeepSpeed script whose adaptation policies come
from its ds_config (``"pollux": {"policies": [...]}``, passed as ``--ds_config FILE``).

A user-style loop (``pollux_launch.adapters.deepspeed.initialize`` with ``training_data``,
``engine.epochs()``, the returned pollux loader) on CPU, ZeRO-0. Appends JSON lines to
``$POLICY_LOG_DIR/worker-<pid>.jsonl``: one ``step`` per optimizer step (the micro-batch
the loop got, the engine's batch for it, the LR the optimizer used inside its step, the
LR factor after it) and an ``end``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from pollux_launch.adapters.deepspeed import compat, initialize

LOG = open(os.path.join(os.environ["POLICY_LOG_DIR"], f"worker-{os.getpid()}.jsonl"), "a",
           buffering=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ds_config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # (as DeepSpeed's launcher)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(160, 16, generator=gen)
    y = (x.sum(dim=1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    engine, _, loader, _ = initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        training_data=TensorDataset(x, y), config=args.ds_config)
    driver = engine.driver
    used: list[float] = []  # the LR inside the optimizer's step (after pollux's factor)
    compat.basic_optimizer(engine.engine).register_step_pre_hook(
        lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))

    def write(**rec: object) -> None:
        p = driver.job.placement
        LOG.write(json.dumps({"pid": os.getpid(), "rank": p.rank, "world": p.world_size, **rec})
                  + "\n")

    for epoch in engine.epochs(50):  # the policy stops the job long before
        for xb, yb in loader:
            shape = list(engine.batch)  # (micro batch, accumulation) of this step
            engine.backward(F.cross_entropy(engine(xb), yb))
            engine.step()
            if engine.micro_steps % engine.gradient_accumulation_steps() == 0:  # stepped
                write(ev="step", step=driver.steps, epoch=epoch, batch=len(xb),
                      engine_batch=shape, lr_used=used[-1], lr_factor=engine.lr_factor)
    write(ev="end", step=driver.steps, epoch=loader.epoch, stopped=driver.controller.stopped,
          policies=[p.label for p in driver.controller.policies])
    sys.exit(0)


if __name__ == "__main__":
    main()

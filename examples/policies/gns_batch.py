"""KungFu's gradient-noise-scale batch policy on scikit-learn's digits, against fixed batches.

The policy (``GNSBatch``) reads the gradient noise scale that the agent measures anyway
(``ctx.gns``, McCandlish et al.'s critical batch size: Pollux Eqn 4-5) at the end of
every data epoch (or every ``every`` steps) and doubles the total batch, up to the
loader's ``max_batch_size``, once the noise scale exceeds ``factor`` x the current batch:
past that point a larger batch costs almost no extra samples per unit of progress, and it
runs faster per sample. The LR follows the job's rule for the batch (AdaScale for SGD).
No goodput policy runs beside it (``policies=[GNSBatch()]``).

Run it alone, or with replicas under the launcher::

    python -m examples.policies.gns_batch --target 0.95
    pollux-run -np 2 python examples/policies/gns_batch.py --target 0.95
    python -m examples.policies.gns_batch --fixed small     # batch fixed at --batch-size
    python -m examples.policies.gns_batch --fixed large     # batch fixed at --max-batch-size

Training stops once validation accuracy (20 % of the digits held out) reaches
``--target``. Rank 0 prints a line per epoch and, LAST, one JSON object (also appended to
``--out`` with the per-epoch records, one JSON object a line)::

    {"event": "result", "mode", "reached", "time_to_target_s", "epochs", "steps",
     "batch_sizes", "final_batch_size", "val_acc", "replicas"}

``time_to_target_s``: wall seconds from the first step to the end of the epoch whose
validation accuracy reached the target (evaluation included); null if it never did.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file (pollux-run ... examples/policies/gns_batch.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pollux_launch.adapters.torch as pollux
from examples.digits import accuracy, datasets, make_model
from examples.policies.common import emitter, start
from pollux_launch.elastic import AdaptationPolicy, PolicyContext

log = logging.getLogger("gns_batch")


class GNSBatch(AdaptationPolicy):
    """Double the total batch (up to ``max_batch_size``) while the gradient noise scale
    exceeds ``factor`` x the batch: checked after each data epoch, or every ``every``
    optimiser steps when ``every`` > 0.

    Every rank runs the same check on the same statistics (the monitor's are identical on
    every replica); rank 0's proposal is the one applied, at the next decision (at once
    after an epoch). ``growths`` lists ``(step, from, to, noise scale)``.
    """

    name = "gns-batch"

    def __init__(self, factor: float = 1.0, growth: int = 2, every: int = 0) -> None:
        if factor <= 0 or growth < 2 or every < 0:
            raise ValueError("GNSBatch: need factor > 0, growth >= 2 and every >= 0")
        self.factor, self.growth, self.every = factor, growth, every
        self.growths: list[tuple[int, int, int, float]] = []

    def after_epoch(self, ctx: PolicyContext) -> None:
        if not self.every:
            self._check(ctx)

    def after_step(self, ctx: PolicyContext) -> None:
        if self.every and ctx.step % self.every == 0:
            self._check(ctx)

    def _check(self, ctx: PolicyContext) -> None:
        gns, batch = ctx.gns, ctx.batch_size
        limit = ctx.config.max_batch_size
        if gns is None or batch >= limit or gns <= self.factor * batch:
            return
        new = min(limit, batch * self.growth)
        if ctx.pending.batch_size == new:
            return  # proposed already; it applies at the next decision
        ctx.set_batch_size(new)
        self.growths.append((ctx.step, batch, new, gns))
        if ctx.rank == 0:
            log.warning("gns-batch: step %d: noise scale %.0f > %.3g x batch %d: batch -> %d",
                        ctx.step, gns, self.factor, batch, new)

    def state_dict(self) -> dict[str, Any]:
        return {"growths": [list(g) for g in self.growths]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.growths = [(int(step), int(before), int(after), float(gns))
                        for step, before, after, gns in state.get("growths", [])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixed", choices=("small", "large"), default=None,
                    help="no policy: the batch fixed at --batch-size (small) or "
                         "--max-batch-size (large)")
    ap.add_argument("--batch-size", type=int, default=32, help="initial (small) total batch")
    ap.add_argument("--max-batch-size", type=int, default=512, help="largest total batch")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD LR at --batch-size")
    ap.add_argument("--large-lr", type=float, default=None,
                    help="LR of --fixed large (default: --lr x sqrt(max/initial batch))")
    ap.add_argument("--factor", type=float, default=1.0,
                    help="grow once the noise scale exceeds factor x the batch")
    ap.add_argument("--every", type=int, default=0,
                    help="check every N optimiser steps (0: after each data epoch)")
    ap.add_argument("--target", type=float, default=0.95, help="validation accuracy to reach")
    ap.add_argument("--max-epochs", type=float, default=200,
                    help="give up after this many statistical epochs")
    ap.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append JSON lines (epochs, result) here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train to the target; returns (and prints, on rank 0) the result record."""
    args = parse_args(argv)
    job = start(args.seed)
    train_set, val_set = datasets(args.seed)
    device = job.device  # this worker's GPU, or the CPU
    model = make_model(args.hidden).to(device)
    if args.fixed == "large":
        batch = max_batch = args.max_batch_size
        lr = (args.large_lr if args.large_lr is not None
              else args.lr * (args.max_batch_size / args.batch_size) ** 0.5)
    else:
        batch, lr = args.batch_size, args.lr
        max_batch = args.batch_size if args.fixed == "small" else args.max_batch_size
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = pollux.AdaptiveDataLoader(train_set, batch_size=batch, max_batch_size=max_batch,
                                       local_bsz_bounds=(1, max_batch))
    policy = GNSBatch(args.factor, every=args.every)
    trainer = pollux.ElasticTrainer(model, optimizer, loader,
                                    policies=[] if args.fixed else [policy])
    rank0 = job.placement.rank == 0
    emit = emitter(args.out if rank0 else None)

    mode = args.fixed or "adaptive"
    emit({"event": "start", "mode": mode, "t": time.time(), "lr": lr,
          "batch_size": batch, "max_batch_size": max_batch, "replicas": job.placement.world_size})
    t0: float | None = None
    reached, acc, epochs, sizes = None, 0.0, 0, [loader.batch_size]
    for epoch in trainer.epochs(args.max_epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if t0 is None:
                t0 = time.perf_counter()
            trainer.step(F.cross_entropy(trainer.model(x), y))
        acc = accuracy(trainer.module, val_set, device)
        if job.placement.world_size > 1:  # the replicas agree (identical weights anyway)
            acc = float(trainer.controller.ctx.allreduce(acc, "min"))
        elapsed = time.perf_counter() - (t0 or time.perf_counter())
        epochs = epoch + 1
        gns = trainer.controller.ctx.gns
        emit({"event": "epoch", "epoch": epoch, "step": trainer.steps, "t": time.time(),
              "elapsed_s": elapsed, "batch_size": loader.batch_size, "val_acc": acc,
              "gns": gns, "lr_factor": trainer.controller.lr_factor})
        if rank0:
            print(f"epoch {epoch:3d} | {elapsed:6.2f} s | batch {loader.batch_size:4d} | "
                  f"gns {gns or 0:8.1f} | val_acc {acc:.4f}", flush=True)
        if loader.batch_size != sizes[-1]:
            sizes.append(loader.batch_size)
        if acc >= args.target:
            reached = elapsed
            break
    result = {"event": "result", "mode": mode, "reached": reached is not None,
              "time_to_target_s": reached, "target": args.target, "epochs": epochs,
              "steps": trainer.steps, "batch_sizes": sizes,
              "final_batch_size": loader.batch_size, "val_acc": acc,
              "replicas": job.placement.world_size, "growths": [list(g) for g in policy.growths]}
    emit(result)
    if rank0:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

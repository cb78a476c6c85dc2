"""Straggler detection from per-worker step times (KungFu's monitoring policy), on the digits.

Under synchronous data parallelism every replica's step lasts as long as the slowest
one's, so ``ctx.step_time`` cannot tell which replica is slow. ``ctx.local_time`` can:
it is the step less the time this worker waited for its peers (the exposed wait inside
the gradient all-reduce), i.e. its own work. The policy (``StragglerDetector``) keeps each
worker's local times, and every ``every`` steps all-gathers their medians (one small
collective) and compares each rank with the median of the others: a rank above
``threshold`` x that for ``consecutive`` checks in a row is a straggler. Every rank
reaches the same verdict from the same gathered numbers; rank 0 logs one warning line
naming the rank and the verdict goes to ``emit``. What to do then (exclude the node,
ask for another replica...) is a job's own choice: this example only reports.

A slowdown can be injected to test it: from step ``--slow-from`` on, rank ``--slow-rank``
sleeps ``--slow-delay`` seconds in every forward pass (a forward pre-hook), on top of the
``--step-delay`` every rank sleeps there (emulated compute)::

    pollux-run -np 2 python examples/policies/straggler.py --slow-rank 1 --slow-from 100

Workers append JSON lines to ``--out``: the slow rank ``{"event": "inject", "rank",
"step", "t"}`` when its slowdown starts, rank 0 ``{"event": "detect", "rank", "step", "t",
"local_times"}`` per straggler found and last ``{"event": "result", "detected", "rank",
"inject_t", "detect_t", "detect_s", "false_positives", ...}``, also printed as the last
line (``detect_s``: wall seconds from the injection to the detection; both clocks are
this machine's ``time.time()``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file (pollux-run ... examples/policies/straggler.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pollux_launch.adapters.torch as pollux
from examples.digits import datasets, make_model
from examples.policies.common import emitter, start
from pollux_launch.elastic import AdaptationPolicy, PolicyContext

log = logging.getLogger("straggler")


class StragglerDetector(AdaptationPolicy):
    """Flag a rank whose local step time exceeds ``threshold`` x the median of the other
    ranks' for ``consecutive`` checks (one every ``every`` steps); module docstring.

    ``detected``: rank -> step it was flagged (the same on every rank), ``detected_at``:
    rank -> this worker's wall time then; ``stop_after`` > 0 stops training that many
    steps after the first detection (tests, benchmarks).
    """

    name = "straggler"

    def __init__(self, every: int = 10, threshold: float = 1.5, consecutive: int = 3,
                 stop_after: int = 0,
                 emit: Callable[[dict[str, Any]], None] | None = None) -> None:
        if every < 1 or threshold <= 1 or consecutive < 1 or stop_after < 0:
            raise ValueError("StragglerDetector: need every >= 1, threshold > 1, "
                             "consecutive >= 1, stop_after >= 0")
        self.every, self.threshold, self.consecutive = every, threshold, consecutive
        self.stop_after, self.emit = stop_after, emit
        self.detected: dict[int, int] = {}
        self.detected_at: dict[int, float] = {}
        self._streak: dict[int, int] = {}
        self._times: list[float] = []  # this worker's local times since the last check

    def on_rescale(self, ctx: PolicyContext) -> None:
        self._times, self._streak = [], {}  # ranks mean other workers now

    def after_step(self, ctx: PolicyContext) -> None:
        if ctx.local_time is not None:
            self._times.append(ctx.local_time)
        if self.detected and self.stop_after:
            if ctx.step - min(self.detected.values()) >= self.stop_after:
                ctx.stop()
        if ctx.step % self.every:
            return
        mine = statistics.median(self._times) if self._times else -1.0  # -1: none yet
        self._times = []
        if ctx.world_size < 2:
            return
        times = ctx.allgather(mine)
        for rank, t in enumerate(times):
            others = [float(o) for r, o in enumerate(times) if r != rank and o >= 0]
            slow = t >= 0 and bool(others) and t > self.threshold * float(np.median(others))
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            if self._streak[rank] == self.consecutive and rank not in self.detected:
                self.detected[rank], self.detected_at[rank] = ctx.step, time.time()
                ctx.record("stragglers", len(self.detected))
                if ctx.rank == 0:
                    log.warning("straggler: rank %d is slow at step %d: local step %.1f ms, "
                                "others' median %.1f ms (%d checks in a row)", rank, ctx.step,
                                1e3 * t, 1e3 * float(np.median(others)), self.consecutive)
                    if self.emit is not None:
                        self.emit({"event": "detect", "rank": rank, "step": ctx.step,
                                   "t": self.detected_at[rank],
                                   "local_times": [float(v) for v in times]})

    def state_dict(self) -> dict[str, Any]:
        return {"detected": {str(k): v for k, v in self.detected.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detected = {int(k): int(v) for k, v in state.get("detected", {}).items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=10, help="steps between checks")
    ap.add_argument("--threshold", type=float, default=1.5,
                    help="slow: local time above threshold x the others' median")
    ap.add_argument("--consecutive", type=int, default=3, help="checks in a row to flag")
    ap.add_argument("--slow-rank", type=int, default=None, help="rank to slow down")
    ap.add_argument("--slow-from", type=int, default=100, help="optimiser step it starts at")
    ap.add_argument("--slow-delay", type=float, default=0.02,
                    help="extra seconds the slow rank sleeps in each forward")
    ap.add_argument("--step-delay", type=float, default=0.005,
                    help="seconds every rank sleeps in each forward (emulated compute)")
    ap.add_argument("--steps", type=int, default=400, help="train at most this many steps")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop this many steps after the first detection (0: run --steps)")
    ap.add_argument("--batch-size", type=int, default=64, help="total batch (fixed)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out", default=None, help="append JSON lines (inject, detect, result)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, maybe slow one rank down, report detections; returns the result record."""
    args = parse_args(argv)
    job = start(0)
    emit = emitter(args.out)

    train_set, _ = datasets()
    device = job.device  # this worker's GPU, or the CPU
    model = make_model(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = pollux.AdaptiveDataLoader(train_set, batch_size=args.batch_size,
                                       local_bsz_bounds=(1, args.batch_size))
    detector = StragglerDetector(args.every, args.threshold, args.consecutive,
                                 args.stop_after, emit=emit)
    trainer = pollux.ElasticTrainer(model, optimizer, loader, decide_every=5,
                                    policies=[detector])
    injected: list[float] = []  # the wall time this worker's slowdown began

    def forward_delay(module: torch.nn.Module, inputs: Any) -> None:
        delay = args.step_delay
        if job.placement.rank == args.slow_rank and trainer.steps >= args.slow_from:
            if not injected:
                injected.append(time.time())
                emit({"event": "inject", "rank": job.placement.rank, "step": trainer.steps,
                      "t": injected[0], "delay_s": args.slow_delay})
            delay += args.slow_delay
        if delay:
            time.sleep(delay)

    model.register_forward_pre_hook(forward_delay)
    t_start = time.time()
    for _ in trainer.epochs(1e6):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            trainer.step(F.cross_entropy(trainer.model(x), y))
            if trainer.steps >= args.steps:
                break  # every rank at the same step
        if trainer.steps >= args.steps:
            break
    # every rank's injection time (0: none), through the job's own collective
    inject_ts = trainer.controller.ctx.allgather(injected[0] if injected else 0.0)
    inject_t = float(max(inject_ts)) or None
    slow = int(np.argmax(inject_ts)) if inject_t else None
    first = min(detector.detected, key=detector.detected.__getitem__, default=None)
    detect_t = detector.detected_at.get(first) if first is not None else None
    right = first is not None and first == slow and inject_t is not None
    result = {"event": "result", "detected": right, "rank": first, "slow_rank": slow,
              "detected_ranks": {str(k): v for k, v in detector.detected.items()},
              "inject_step": args.slow_from if slow is not None else None,
              "inject_t": inject_t, "detect_t": detect_t,
              "detect_s": (detect_t - inject_t) if right and detect_t and inject_t else None,
              "false_positives": sum(1 for r, s in detector.detected.items()
                                     if r != slow or s < args.slow_from),
              "steps": trainer.steps, "wall_s": time.time() - t_start,
              "replicas": job.placement.world_size}
    if job.placement.rank == 0:
        emit(result)
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

"""Cost-aware replica search: add replicas while each one pays for itself, then give back.

The policy (``ReplicaSearch``) pins the job at the replicas it started with, measures the
job's throughput there (samples/s: the total batch over the median step time of a window
of steps after a warm-up - the median, as a neighbour's burst on a shared machine should
not decide - averaged over the replicas with one all-reduce, so every rank holds the same
figure), and asks the coordinator for one replica more while the *marginal* speed-up of
the last one added,

    gain(n) = (X(n) - X(prev)) / ((n - prev) * X(n0) / n0)

(``X``: measured throughput; ``n0``: the smallest count measured; 1.0: the added replica
did as much as a replica did at the start), stays at or above ``--threshold``, up to
``--max-replicas``. Once a gain falls below, it asks for the best count (the largest one
whose every step up passed) and stops searching: the replicas beyond it go back to the
cluster. A request the coordinator does not grant within ``--grant-steps`` steps ends the
search at the current count. No goodput policy runs beside it; the total batch stays
fixed (``max_batch_size == batch_size``), so every configuration does the same work.

The workload: a 512-wide MLP, a total batch of 479 (every step of an epoch full) and
``--step-delay`` seconds of sleep per 32 local samples after each step - compute that
scales with replicas as a GPU's would (a sleeping worker takes no core), beside the real
compute, which stops scaling once the replicas outnumber this machine's cores.

Run it under the launcher, allowed up to K replicas (slots: ``-H localhost:K`` beyond
this machine's cores)::

    pollux-run -np 1 --max-np 2 python examples/policies/replica_search.py --max-replicas 2
    pollux-run -np 1 --max-np 3 -H localhost:3 python examples/policies/replica_search.py \\
        --max-replicas 3 --threshold 0.5
    pollux-run -np 3 -H localhost:3 python examples/policies/replica_search.py --static

``--static`` runs without a policy at whatever it is given (the baseline);
``--stop-after N`` ends training N steps after the search settled (tests). Rank 0 appends
JSON lines to ``--out``: one per optimiser step ``{"event": "step", "step", "t", "world",
"charged"}`` (``charged``: the replicas held, counting a grow from the decision that sent
its request on and a shrink until it happened, so replica-hours include the newcomers'
start-up), the policy's ``measure``/``request``/``settle``/``not-granted`` events, and
last ``{"event": "result", "wall_s", "replica_s", "worlds", "measured", "best", ...}``,
also printed as the last line (``wall_s``: first step to last; ``replica_s``: charged
replicas integrated over that time, as this process saw them - integrate the step lines
when rank 0 may have changed process).
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

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file (pollux-run ... examples/policies/replica_search.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pollux_launch.adapters.torch as pollux
from examples.digits import accuracy, datasets, make_model
from examples.policies.common import emitter, start
from pollux_launch.elastic import AdaptationPolicy, PolicyContext

log = logging.getLogger("replica_search")


class ReplicaSearch(AdaptationPolicy):
    """Grow one replica at a time while the marginal gain is >= ``threshold`` (module
    docstring), then settle at the best count.

    Every decision is taken from values every rank holds alike (step counts, an
    all-reduced throughput), so all ranks keep the same state; only rank 0's requests are
    applied, and its state goes to newcomers. ``emit`` (rank 0) gets the policy's events.
    """

    name = "replica-search"

    def __init__(self, threshold: float = 0.5, max_replicas: int = 2, warmup: int = 10,
                 window: int = 30, grant_steps: int = 400, stop_after: int = 0,
                 emit: Callable[[dict[str, Any]], None] | None = None) -> None:
        if not (max_replicas >= 1 and warmup >= 0 and window >= 1 and grant_steps >= 1
                and stop_after >= 0):
            raise ValueError("ReplicaSearch: need max_replicas >= 1, warmup >= 0, window >= 1, "
                             "grant_steps >= 1, stop_after >= 0")
        self.threshold, self.max_replicas = threshold, max_replicas
        self.warmup, self.window, self.grant_steps = warmup, window, grant_steps
        self.stop_after, self.emit = stop_after, emit
        self.phase = "search"  # -> "settled"
        self.measured: dict[int, float] = {}  # replicas -> samples/s of the whole job
        self.best: int | None = None
        self.settled_at = 0  # the step the search ended
        self.asked = 0  # replicas asked for and not yet given (0: none)
        self.asked_at = 0
        self._since = 0  # the step this group started at
        self._times: list[float] = []  # this group's measured step times (this worker's)

    # -- hooks ---------------------------------------------------------------------------
    def on_rescale(self, ctx: PolicyContext) -> None:
        if ctx.detached:
            return
        self._since, self._times = ctx.step, []
        if self.asked == ctx.world_size:
            self.asked = 0
        if ctx.replica_request is None and self.phase == "search":
            ctx.request_replicas(ctx.world_size)  # hold what we have while measuring

    def after_step(self, ctx: PolicyContext) -> None:
        if self.phase != "search":
            if (self.stop_after and ctx.world_size == self.best
                    and ctx.step - max(self._since, self.settled_at) >= self.stop_after):
                ctx.stop()
            return
        n, k = ctx.world_size, ctx.step - self._since
        if self.asked:  # waiting for the coordinator
            if ctx.step - self.asked_at >= self.grant_steps:
                self._event(ctx, "not-granted", asked=self.asked)
                self._settle(ctx, n)
            return
        if n in self.measured:  # resized from outside (a failure) to a measured count
            self._settle(ctx, n)
            return
        if k > self.warmup and ctx.step_time:
            self._times.append(ctx.step_time)
        if k == self.warmup + self.window:
            # the median step: robust to a neighbour's burst on a shared machine
            local = ctx.batch_size / statistics.median(self._times) if self._times else 0.0
            rate = float(ctx.allreduce(local, "mean"))
            self.measured[n] = rate
            self._decide(ctx, n, rate)

    # -- the search ----------------------------------------------------------------------
    def gain(self, n: int) -> float | None:
        """Marginal gain of the step up to ``n`` (module docstring); None for the first."""
        below = [c for c in self.measured if c < n]
        if not below or n not in self.measured:
            return None
        prev, n0 = max(below), min(self.measured)
        base = self.measured[n0] / n0
        return (self.measured[n] - self.measured[prev]) / ((n - prev) * base)

    def _decide(self, ctx: PolicyContext, n: int, rate: float) -> None:
        gain = self.gain(n)
        self._event(ctx, "measure", replicas=n, samples_per_s=rate, gain=gain)
        if gain is not None and gain < self.threshold:
            self._settle(ctx, max(c for c in self.measured if c < n))
        elif n < self.max_replicas:
            self.asked, self.asked_at = n + 1, ctx.step
            ctx.request_replicas(n + 1)
            self._event(ctx, "request", replicas=n + 1)
        else:
            self._settle(ctx, n)

    def _settle(self, ctx: PolicyContext, best: int) -> None:
        self.phase, self.best, self.asked, self.settled_at = "settled", best, 0, ctx.step
        ctx.request_replicas(best)
        self._event(ctx, "settle", replicas=best, measured=self.measured)
        if ctx.rank == 0:
            rates = ", ".join(f"{c}: {r:.0f}/s" for c, r in sorted(self.measured.items()))
            log.warning("replica-search: settled at %d replicas (measured %s; threshold %.2f)",
                        best, rates, self.threshold)

    def _event(self, ctx: PolicyContext, event: str, **fields: Any) -> None:
        if ctx.rank == 0 and self.emit is not None:
            self.emit({"event": event, "step": ctx.step, "t": time.time(), **fields})

    # -- state that travels to newcomers -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "measured": {str(k): v for k, v in self.measured.items()},
                "best": self.best, "settled_at": self.settled_at, "asked": self.asked,
                "asked_at": self.asked_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase, self.best = state["phase"], state["best"]
        self.settled_at = int(state["settled_at"])
        self.measured = {int(k): float(v) for k, v in state["measured"].items()}
        self.asked, self.asked_at = int(state["asked"]), int(state["asked_at"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threshold", type=float, default=0.5,
                    help="least marginal gain (replica-equivalents) an added replica must give")
    ap.add_argument("--max-replicas", type=int, default=2, help="search no further than this")
    ap.add_argument("--warmup", type=int, default=10, help="steps skipped after each rescale")
    ap.add_argument("--window", type=int, default=30, help="steps measured per count")
    ap.add_argument("--grant-steps", type=int, default=400,
                    help="steps to wait for a requested replica before settling")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop training this many steps after settling (0: train --epochs)")
    ap.add_argument("--static", action="store_true", help="no policy (the baseline)")
    ap.add_argument("--epochs", type=float, default=20, help="work: epochs of the digits")
    ap.add_argument("--batch-size", type=int, default=479,
                    help="total batch, fixed (479: a third of the 1437 training digits, so "
                         "every step of an epoch is full)")
    ap.add_argument("--hidden", type=int, default=512, help="MLP hidden width")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--step-delay", type=float, default=0.006,
                    help="extra seconds per step per 32 samples of the local batch "
                         "(emulates compute that scales with replicas)")
    ap.add_argument("--out", default=None, help="append JSON lines (steps, events, result)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train ``--epochs`` epochs; returns (and prints, on rank 0) the result record."""
    args = parse_args(argv)
    job = start(0)
    emit = emitter(args.out, lambda: job.placement.rank == 0)  # (rank 0 may change)

    train_set, val_set = datasets()
    device = job.device  # this worker's GPU, or the CPU
    model = make_model(args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = pollux.AdaptiveDataLoader(train_set, batch_size=args.batch_size,
                                       local_bsz_bounds=(1, args.batch_size))
    policy = ReplicaSearch(args.threshold, args.max_replicas, args.warmup, args.window,
                           args.grant_steps, args.stop_after, emit=emit)
    trainer = pollux.ElasticTrainer(model, optimizer, loader, decide_every=5,
                                    policies=[] if args.static else [policy])
    ctl = trainer.controller
    t0: float | None = None
    t_last, replica_s, worlds = 0.0, 0.0, []
    for _ in trainer.epochs(args.epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if not trainer.step(F.cross_entropy(trainer.model(x), y)):
                continue
            if args.step_delay:
                time.sleep(args.step_delay * len(x) / 32)
            now, world = time.time(), job.placement.world_size
            request = ctl.replica_request[0] if ctl.replica_request else world
            charged = max(world, request)
            if t0 is None:
                t0 = now
            else:
                replica_s += (now - t_last) * charged
            t_last = now
            if not worlds or worlds[-1] != world:
                worlds.append(world)
            emit({"event": "step", "step": trainer.steps, "t": now, "world": world,
                  "charged": charged})
    acc = accuracy(trainer.module, val_set, device)
    result = {"event": "result", "mode": "static" if args.static else "search",
              "wall_s": t_last - (t0 or t_last), "replica_s": replica_s,
              "steps": trainer.steps, "worlds": worlds, "final_world": job.placement.world_size,
              "measured": {str(k): v for k, v in policy.measured.items()},
              "best": policy.best, "threshold": args.threshold, "val_acc": acc}
    emit(result)
    if job.placement.rank == 0:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

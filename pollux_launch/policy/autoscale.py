"""Goodput-driven cluster autoscaling (Pollux Sec. 4.2.2 and 5.3.3). Pure.

The *utility* of an allocation ``A`` on a cluster of ``G`` GPUs is the speedup it buys
per GPU the cluster holds:

    UTILITY(A) = sum_j SPEEDUP_j(A_j) / G

with each job's speedup relative to one GPU (a perfectly scalable job scores 1; an idle
GPU, paid for, scores 0). For one job that takes the cluster it is
``GOODPUT(a) / (SUM(a) * GOODPUT(1 GPU))``: its goodput as a fraction of the ideal.
Because statistical efficiency rises as training goes on, utility rises too, and a
larger cluster starts to pay.

The rule: each decision, with the allocation the scheduling policy would pick on ``n``
nodes (``utility_at(n)``), a cluster whose utility is above ``high`` (U = 2/3) grows to
the largest size whose predicted utility is still at least ``low`` (L = 1/2); one below
``low`` shrinks to the largest size whose utility reaches ``low``. Between the two it
stays: the band is the hysteresis (the coordinator adds a minimum node lifetime). A
cluster with work never shrinks below one node, and one with none goes to its minimum.

``rule="throughput"`` is the baseline (Or et al., MLSys'20): the same rule on speedups of
system throughput alone, blind to statistical efficiency. :class:`RuleView` gives the
jobs as a rule sees them: as they are for ``goodput``; for ``throughput`` each job's
speedup is its :class:`~pollux_launch.goodput.ThroughputFunction` (samples/s at the best
batch in its range, ``JobInfo.throughput_fn``) over its value on 1 GPU, and a job
without a throughput model keeps its speedup (the linear prior, before it has one). The
simulator and the coordinator both decide through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import JobInfo

RULES = ("goodput", "throughput")


@dataclass(frozen=True)
class AutoscaleConfig:
    """``min_nodes``..``max_nodes``: the cluster's bounds; ``high``/``low``: U and L;
    ``interval``: seconds between decisions; ``min_lifetime``: seconds a node stays
    before it may be released; ``rule``: one of RULES."""

    min_nodes: int
    max_nodes: int
    high: float = 2 / 3
    low: float = 1 / 2
    interval: float = 60.0
    min_lifetime: float = 300.0
    rule: str = "goodput"

    def __post_init__(self) -> None:
        if not 0 <= self.min_nodes <= self.max_nodes or self.max_nodes < 1:
            raise ValueError(f"--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got "
                             f"{self.min_nodes}:{self.max_nodes}")
        if not 0 < self.low < self.high <= 1:
            raise ValueError(f"need 0 < --utility-low ({self.low:g}) < --utility-high "
                             f"({self.high:g}) <= 1")
        if not self.interval > 0 or not self.min_lifetime >= 0:
            raise ValueError("the scale interval must be > 0 and the node lifetime >= 0 s")
        if self.rule not in RULES:
            raise ValueError(f"autoscale rule must be one of {', '.join(RULES)}, got "
                             f"{self.rule!r}")


class _RelativeThroughput:
    """A job's system-throughput speedup: its throughput function over its 1-GPU value."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.ref = float(np.asarray(fn(np.array([1]), np.array([1])))[0])

    def __call__(self, num_nodes, num_replicas) -> np.ndarray:
        return np.asarray(self.fn(num_nodes, num_replicas), dtype=float) / self.ref


class RuleView:
    """The jobs as ``rule`` sees them (module docstring). Keeps each job's 1-GPU
    throughput until its model changes, so a decision's what-ifs do not recompute it."""

    def __init__(self, rule: str) -> None:
        if rule not in RULES:
            raise ValueError(f"autoscale rule must be one of {', '.join(RULES)}, got {rule!r}")
        self.rule = rule
        self._rel: dict[str, _RelativeThroughput] = {}

    def __call__(self, jobs: Sequence[JobInfo]) -> list[JobInfo]:
        if self.rule == "goodput":
            return list(jobs)
        out = []
        for job in jobs:
            fn = job.throughput_fn
            rel = self._rel.get(job.name)
            if fn is not None and (rel is None or rel.fn is not fn):
                rel = self._rel[job.name] = _RelativeThroughput(fn)
            usable = fn is not None and rel is not None and rel.ref > 0
            out.append(dataclasses.replace(job, speedup_fn=rel) if usable else job)
        names = {j.name for j in jobs}
        for gone in [k for k in self._rel if k not in names]:
            del self._rel[gone]
        return out


def utility(jobs: Sequence[JobInfo], alloc: np.ndarray, *, gpus: int) -> float:
    """UTILITY(A) (module docstring): ``alloc`` is jobs x nodes, ``gpus`` the cluster's
    GPUs (idle ones included); 0 for an empty cluster."""
    alloc = np.asarray(alloc)
    if gpus <= 0:
        return 0.0
    total = 0.0
    for job, row in zip(jobs, alloc, strict=True):
        k = int(row.sum())
        if k == 0:
            continue
        n = int(np.count_nonzero(row))
        one = float(job.speedup_fn(np.array([1]), np.array([1]))[0])
        here = float(job.speedup_fn(np.array([n]), np.array([k]))[0])
        if one > 0 and np.isfinite(here):
            total += here / one
    return total / gpus


def target_nodes(cfg: AutoscaleConfig, utility_at: Callable[[int], float], current: int,
                 has_work: bool = True) -> tuple[int, float]:
    """The cluster size to move to, and the utility now (module docstring).
    ``utility_at(n)``: the utility of the policy's allocation on ``n`` nodes;
    ``has_work``: some job is waiting or running (else the cluster shrinks to its
    minimum)."""
    if not has_work:
        return cfg.min_nodes, 0.0
    current = min(max(current, cfg.min_nodes), cfg.max_nodes)
    floor = max(cfg.min_nodes, 1)  # work never runs on no nodes
    now = utility_at(current) if current > 0 else 1.0  # no nodes: the work wants one

    def low_ok(n: int) -> bool:
        return utility_at(n) >= cfg.low

    if (now > cfg.high or current < floor) and current < cfg.max_nodes:
        # Only to sizes predicted to stay at or above L: a size below it would be undone
        # by the shrink rule at the next decision (grow, shrink, grow, ...).
        best = _last_holding(low_ok, current + 1, cfg.max_nodes)
        return (max(current, floor) if best is None else best), now
    if now < cfg.low and current > floor:
        still_low = _last_holding(lambda n: not low_ok(n), current - 1, floor)
        return (current - 1 if still_low is None else max(still_low - 1, floor)), now
    return current, now


def _last_holding(holds: Callable[[int], bool], first: int, last: int) -> int | None:
    """The last size of ``first``..``last`` (either direction) reached before ``holds``
    first fails, or None if it fails at ``first``. Utility falls as the cluster grows, so
    ``holds`` is taken to fail from some size on: galloping from ``first`` (steps 1, 2,
    4, ...) then bisection, O(log |last - first|) what-if solves instead of one per size
    (a linear scan would give the same answer on a monotone utility)."""
    step = 1 if last >= first else -1
    if not holds(first):
        return None
    good, bad, gap = first, None, 1
    while bad is None:
        probe = good + step * gap
        if (probe - last) * step > 0:
            probe = last
        if probe == good:
            return good  # holds all the way to ``last``
        if holds(probe):
            good, gap = probe, 2 * gap
        else:
            bad = probe
    while abs(bad - good) > 1:
        mid = (good + bad) // 2
        if holds(mid):
            good = mid
        else:
            bad = mid
    return good

"""The policy interface: jobs and nodes in, an allocation matrix out.

A scheduling round (PolluxSched, Pollux Sec. 4.2) sees every active job as a
:class:`JobInfo` (its speedup function and limits) and every node as a
:class:`PolicyNode`, plus the current allocation matrix ``A`` (jobs x nodes, replicas of
job ``j`` on node ``n``), and returns the next ``A``. Engines implement :class:`Policy`
and are chosen by name through :func:`pollux_launch.policy.make_policy`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

SpeedupFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class JobInfo:
    """What the policy knows about one job.

    ``speedup_fn(num_nodes, num_replicas)`` takes int arrays of any (equal) shape and
    returns the speedup at each, 0 at 0 replicas, relative to any fixed reference: the
    policy normalises it to the job's fair share (Eqn 15) itself.
    """

    name: str
    speedup_fn: SpeedupFn
    age: float  # T_j of the re-allocation penalty, seconds since the job started
    restarts: int = 0  # R_j: re-allocations so far
    min_replicas: int = 0
    max_replicas: int = 1_000_000  # already includes the goodput exploration cap
    preemptible: bool = True  # False: once running, never shrunk, moved or stopped
    # seconds a change of allocation costs this job (delta of the re-allocation penalty);
    # None: the policy's own delta
    realloc_delay: float | None = None
    # samples/s at (num_nodes, num_replicas) at the job's best batch size within its
    # range, system throughput only (no statistical efficiency), 0 at 0 replicas: e.g.
    # goodput.ThroughputFunction. Used by throughput-maximising engines (saxena-dp).
    # None: unknown; saxena-dp then scales the shape of speedup_fn instead (see there).
    throughput_fn: SpeedupFn | None = None


@dataclass(frozen=True)
class PolicyNode:
    """One node of the cluster and its number of slots (GPUs, or CPU slots)."""

    name: str
    slots: int


class Policy(abc.ABC):
    """One scheduling engine. ``optimize`` may keep search state across calls (warm start)
    but is otherwise pure: no I/O, no clocks."""

    name: str = "abstract"

    @abc.abstractmethod
    def optimize(
        self, jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode], current: np.ndarray
    ) -> np.ndarray:
        """Return the next allocation matrix.

        ``current`` and the result are int arrays of shape ``(len(jobs), len(nodes))``:
        replicas of job ``j`` on node ``n``; ``current`` is the allocation in force.
        """

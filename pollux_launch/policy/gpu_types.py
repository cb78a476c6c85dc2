"""Clusters of several GPU types: no job spans two.

A synchronous data-parallel job runs at its slowest replica's pace, so replicas on
GPUs of different types waste the faster ones (Sia, Jayaram Subramanya et al., SOSP'23,
Sec. 3: "a job never spans GPU types"). :func:`typed_allocation` gives each job one type
and runs a single-type engine on each type's nodes with that type's jobs:

1. a job that runs keeps the type most of its replicas run on (a change of type is a
   migration, decided by a heterogeneity-aware engine, not here), if it may use it;
2. every other job, in order, takes among the types it may use the one with the most
   slots left after the minimum replicas of the jobs already given it (ties: by name).

Pure: arrays and frozen dataclasses in, an allocation matrix out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .base import JobInfo, PolicyNode

Optimize = Callable[[Sequence[JobInfo], Sequence[PolicyNode], np.ndarray], np.ndarray]


def assign_types(jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode], current: np.ndarray,
                 node_types: Sequence[str],
                 allowed: Sequence[frozenset[str]]) -> list[str | None]:
    """Each job's type (module docstring); None for a job no present type suits.
    ``allowed[j]``: the types job ``j`` may use (empty: any)."""
    types = sorted(set(node_types))
    # slots of each type left after the minimum replicas of the jobs given it so far
    left = {t: sum(n.slots for n, nt in zip(nodes, node_types, strict=True) if nt == t)
            for t in types}
    per_type = np.array([[nt == t for nt in node_types] for t in types], dtype=int)
    out: list[str | None] = [None] * len(jobs)
    usable = [[t for t in types if not allowed[j] or t in allowed[j]] for j in range(len(jobs))]
    for j, job in enumerate(jobs):  # running jobs first: they keep their type
        held = dict(zip(types, per_type @ current[j], strict=True))
        best = max(usable[j], key=lambda t: (held[t], -types.index(t)), default=None)
        if best is not None and held[best] > 0:
            out[j] = best
            left[best] -= job.min_replicas
    for j, job in enumerate(jobs):
        if out[j] is None and usable[j]:
            out[j] = max(usable[j], key=lambda t: (left[t], -types.index(t)))
            left[out[j]] -= job.min_replicas
    return out


def typed_allocation(optimize: Mapping[str, Optimize], jobs: Sequence[JobInfo],
                     nodes: Sequence[PolicyNode], current: np.ndarray,
                     node_types: Sequence[str],
                     allowed: Sequence[frozenset[str]]) -> np.ndarray:
    """The next allocation (``Policy.optimize``'s shape) with no job spanning two types:
    ``optimize[t]`` allocates type ``t``'s nodes among the jobs given type ``t``
    (:func:`assign_types`); a job given no type gets nothing."""
    target = np.zeros((len(jobs), len(nodes)), dtype=int)
    chosen = assign_types(jobs, nodes, current, node_types, allowed)
    for t in sorted(set(node_types)):
        cols = [i for i, nt in enumerate(node_types) if nt == t]
        rows = [j for j, c in enumerate(chosen) if c == t]
        if not rows:
            continue
        target[np.ix_(rows, cols)] = optimize[t]([jobs[j] for j in rows],
                                                  [nodes[i] for i in cols],
                                                  current[np.ix_(rows, cols)])
    return target

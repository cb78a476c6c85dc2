"""Allocation matrices: input checks, constraint checks, and placing GPU counts on nodes.

Constraints every engine honours (PolluxSched, Pollux Sec. 4.2):

* capacity: replicas on a node <= its slots;
* interference avoidance (switchable): at most one distributed (multi-node) job per node;
* per-job limits: 0 or ``min_replicas <= replicas <= max_replicas``;
* a non-preemptible job that is running keeps its allocation unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pollux_launch.policy.base import JobInfo, PolicyNode


def validate_round(
    jobs: Sequence[JobInfo], nodes: Sequence[PolicyNode], current: np.ndarray | None
) -> np.ndarray:
    """Check one round's inputs; return ``current`` as an int64 ``(J, N)`` array."""
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError("node names must be unique")
    for n in nodes:
        if int(n.slots) < 0:
            raise ValueError(f"node {n.name!r} has {n.slots} slots; slots must be >= 0")
    for j in jobs:
        if j.min_replicas < 0 or j.max_replicas < 0:
            raise ValueError(f"job {j.name!r}: min/max replicas must be >= 0")
        if j.min_replicas > j.max_replicas:
            raise ValueError(
                f"job {j.name!r}: min_replicas={j.min_replicas} > max_replicas="
                f"{j.max_replicas}; lower min_replicas or raise max_replicas"
            )
    shape = (len(jobs), len(nodes))
    if current is None:
        return np.zeros(shape, dtype=np.int64)
    cur = np.asarray(current)
    if cur.size == 0 and 0 in shape:
        return np.zeros(shape, dtype=np.int64)
    if cur.shape != shape:
        raise ValueError(
            f"current allocation has shape {cur.shape}, expected (len(jobs), len(nodes)) = "
            f"{shape}: pass one row per job and one column per node, in the same order"
        )
    if not np.issubdtype(cur.dtype, np.integer) and not np.all(cur == np.round(cur)):
        raise ValueError("current allocation must hold whole replica counts")
    cur = cur.astype(np.int64)
    if np.any(cur < 0):
        raise ValueError("current allocation has negative replica counts")
    return cur


def pinned_jobs(jobs: Sequence[JobInfo], current: np.ndarray) -> np.ndarray:
    """Jobs that must keep their current allocation: non-preemptible and running."""
    running = np.asarray(current).sum(axis=-1) > 0
    return np.array([not j.preemptible for j in jobs], dtype=bool) & running


def distributed_per_node(alloc: np.ndarray) -> np.ndarray:
    """Number of distributed (multi-node) jobs with replicas on each node, ``(..., N)``."""
    alloc = np.asarray(alloc)
    dist = np.count_nonzero(alloc, axis=-1) > 1
    return np.count_nonzero((alloc > 0) & dist[..., None], axis=-2)


def allocation_violations(
    alloc: np.ndarray,
    nodes: Sequence[PolicyNode],
    jobs: Sequence[JobInfo] | None = None,
    current: np.ndarray | None = None,
    interference_avoidance: bool = True,
) -> list[str]:
    """Every constraint ``alloc`` (one ``(J, N)`` matrix) breaks, as readable lines."""
    alloc = np.asarray(alloc)
    out: list[str] = []
    slots = np.array([int(n.slots) for n in nodes], dtype=np.int64)
    if np.any(alloc < 0):
        out.append("negative replica counts")
    used = alloc.sum(axis=0)
    for n in np.flatnonzero(used > slots):
        out.append(f"node {nodes[n].name!r}: {used[n]} replicas > {slots[n]} slots")
    if interference_avoidance:
        per_node = distributed_per_node(alloc)
        for n in np.flatnonzero(per_node > 1):
            out.append(f"node {nodes[n].name!r}: {per_node[n]} distributed jobs (max 1)")
    if jobs is not None:
        for j, job in enumerate(jobs):
            k = int(alloc[j].sum())
            if k and not job.min_replicas <= k <= job.max_replicas:
                out.append(
                    f"job {job.name!r}: {k} replicas outside "
                    f"[{job.min_replicas}, {job.max_replicas}]"
                )
        if current is not None:
            cur = np.asarray(current)
            for j in np.flatnonzero(pinned_jobs(jobs, cur)):
                if not np.array_equal(alloc[j], cur[j]):
                    out.append(f"job {jobs[j].name!r}: non-preemptible job was changed")
    return out


def check_allocation(
    alloc: np.ndarray,
    nodes: Sequence[PolicyNode],
    jobs: Sequence[JobInfo] | None = None,
    current: np.ndarray | None = None,
    interference_avoidance: bool = True,
) -> None:
    """Raise ``ValueError`` naming the first broken constraint of ``alloc``."""
    bad = allocation_violations(alloc, nodes, jobs, current, interference_avoidance)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"infeasible allocation: {bad[0]}{more}")


def place_job(
    k: int,
    free: np.ndarray,
    has_distributed: np.ndarray,
    prev: np.ndarray,
    interference_avoidance: bool,
) -> np.ndarray:
    """Choose nodes for ``k`` replicas of one job, packed onto as few nodes as possible.

    One node when any node has ``k`` free slots (best fit: the fullest such node, ties
    to where the job already runs). Otherwise the job goes distributed over the nodes
    with the most free slots (skipping nodes that already host a distributed job when
    interference avoidance is on), its last, partial share on the best-fitting node so
    that large holes stay free for other jobs. Returns a row of replicas per node; its sum
    is less than ``k`` when the job cannot be placed whole.
    """
    n_nodes = free.shape[0]
    row = np.zeros(n_nodes, dtype=np.int64)
    if k <= 0 or n_nodes == 0:
        return row
    fits = np.flatnonzero(free >= k)
    if fits.size:
        # lexsort: last key is primary -> fewest free slots, then most previous replicas.
        n = fits[np.lexsort((-prev[fits], free[fits]))[0]]
        row[n] = k
        return row
    eligible = free > 0
    if interference_avoidance:
        eligible &= ~has_distributed
    cand = np.flatnonzero(eligible)
    order = cand[np.lexsort((-prev[cand], -free[cand]))]
    cum = np.cumsum(free[order])
    if cum.size == 0:
        return row
    if cum[-1] < k:
        row[order] = free[order]
        return row
    m = int(np.searchsorted(cum, k, side="left"))  # order[:m+1] hold k
    full = order[:m]
    row[full] = free[full]
    rest = k - int(row.sum())
    # Best fit for the remainder among the nodes not yet used.
    others = order[m:]
    ok = others[free[others] >= rest]
    n = ok[np.lexsort((-prev[ok], free[ok]))[0]]
    row[n] = rest
    return row
